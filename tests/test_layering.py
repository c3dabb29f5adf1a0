"""The layers point one way (DEVELOPERS.md): checked on the source and in fresh interpreters.

- no import cycle inside the package: every import of every module (lazy ones inside functions and
  ``TYPE_CHECKING`` ones included) forms a graph without a cycle;
- the rules of `LAYER_RULES` (config is data; the worker never imports the trainer; the trainer does not
  import the CLI's doctor; launch reads the run folder through ``run/``; ...), on the same scan;
- the package's top level holds the CLI and its packages, not single-file modules of other layers; every
  module stays under 800 lines;
- the sampler boundary imports nothing from ``rollout/`` or ``train/`` (AST scan of every import, lazy
  ones inside functions included, and a fresh interpreter importing every sampler module);
- ``train/batcher.py`` and ``train/packing.py`` each import on their own (no import circle);
- composing a config (``asyncgrpo config``, ``train --cfg job``) imports neither transformers nor torch;
- the trainer-group snapshot matches the installed transformers (else composing would fall back to it).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "asyncgrpo_cli"
SAMPLER = PKG / "sampler"
FORBIDDEN_FROM_SAMPLER = ("asyncgrpo_cli.rollout", "asyncgrpo_cli.train")


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path) -> str:
    return _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]


def _imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``source`` (a module of ``package``),
    relative ones resolved; lazy imports inside functions included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # ``from .. import rollout`` names the forbidden package as an imported attribute.
            found.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
    return found


def _sampler_files() -> list[Path]:
    return sorted(SAMPLER.rglob("*.py"))


def test_import_scan_resolves_relative_imports():
    """The scanner itself: lazy relative imports of rollout/train from a sampler module are seen."""
    source = "import json\ndef f():\n    from ..rollout.types import Rollout\n    from .. import train\n"
    names = [name for _, name in _imported_modules(source, "asyncgrpo_cli.sampler")]
    assert "asyncgrpo_cli.rollout.types" in names
    assert "asyncgrpo_cli.train" in names
    assert not any(n.startswith(FORBIDDEN_FROM_SAMPLER) for _, n in _imported_modules("import json", "x"))


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (an import of ``a.b.name`` counts as one of module ``a.b``
    unless ``a.b.name`` is itself a module; a package's ``__init__`` is the package's module)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {owner(n) for _, n in _imported_modules(path.read_text(), _package_of(path))
                   if n.startswith("asyncgrpo_cli")}
        graph[name] = {t for t in targets if t is not None and t != name and t != "asyncgrpo_cli"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "asyncgrpo_cli" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)  # module names relative to the fake package
    graph = _import_graph({_module_name(p): p for p in pkg.glob("*.py")})
    assert graph == {"asyncgrpo_cli.sub.a": {"asyncgrpo_cli.sub.b"}, "asyncgrpo_cli.sub.b": {"asyncgrpo_cli.sub.a"}}
    assert _cycles(graph) == [["asyncgrpo_cli.sub.a", "asyncgrpo_cli.sub.b"]]


def test_no_import_cycle_inside_the_package():
    cycles = _cycles(_import_graph(_package_modules()))
    assert not cycles, ("import cycles (move what both sides share down into a module both import; a "
                        "function-level import is still a cycle):\n" + "\n".join(" <-> ".join(c) for c in cycles))


_P = "asyncgrpo_cli."
#: (modules under, must not import any of, why): the layers of README's layout section.
LAYER_RULES = [
    ("config", ("train", "launch", "server", "doctor", "dashboard", "cli"),
     "config is data: it imports no trainer, launcher or CLI code"),
    ("run", ("config", "train", "rollout", "sampler", "server", "launch", "doctor", "dashboard", "cli"),
     "the run folder's rules sit under everything that reads the folder"),
    ("sampler", ("rollout", "train", "server", "launch", "doctor", "dashboard", "cli"),
     "the sampler boundary knows nothing of GRPO"),
    ("rollout", ("train", "server", "launch", "doctor", "dashboard", "cli"), "the worker never imports the trainer"),
    ("server", ("train", "launch", "doctor", "dashboard", "cli"),
     "what the server must be is shared by launch, the trainer and doctor"),
    ("train", ("doctor", "launch", "dashboard", "cli"), "the trainer does not import the CLI's doctor or launcher"),
    ("launch", ("train",), "launch reads the run folder through run/, never the trainer's modules"),
    ("doctor", ("train", "launch", "cli"), "doctor checks a server; it starts nothing"),
    ("dashboard", ("train", "launch", "doctor", "cli"), "the dashboard reads the run's files"),
]


def _breaks(graph: dict[str, set[str]], under: str, forbidden: tuple[str, ...]) -> list[str]:
    def inside(name: str, prefix: str) -> bool:
        return name == _P + prefix or name.startswith(_P + prefix + ".")

    return sorted(f"{m} imports {t}" for m, targets in graph.items() if inside(m, under)
                  for t in targets if any(inside(t, f) for f in forbidden))


def test_the_rule_check_sees_a_broken_rule():
    graph = {"asyncgrpo_cli.config.x": {"asyncgrpo_cli.train.config", "asyncgrpo_cli.config.y"},
             "asyncgrpo_cli.configure": {"asyncgrpo_cli.train"}}
    assert _breaks(graph, "config", ("train",)) == ["asyncgrpo_cli.config.x imports asyncgrpo_cli.train.config"]


@pytest.mark.parametrize("under,forbidden,why", LAYER_RULES, ids=[r[0] for r in LAYER_RULES])
def test_layer_rule(under, forbidden, why):
    bad = _breaks(_import_graph(_package_modules()), under, forbidden)
    assert not bad, f"{why}:\n" + "\n".join(bad)


#: Single-file modules allowed at the package's top: the CLI and the two helpers it shares with the trainer.
TOP_LEVEL_MODULES = {"__init__", "__main__", "cli", "data", "imports"}


def test_the_top_level_holds_the_cli_and_packages():
    stray = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in TOP_LEVEL_MODULES)
    assert not stray, f"single-file modules at the package's top: {stray}; put each in the package it serves"


def test_modules_stay_under_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) >= 800}
    assert not long, f"split these modules by what they hold: {long}"


def test_sampler_source_imports_nothing_from_rollout_or_train():
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
           for path in _sampler_files() for line, name in _imported_modules(path.read_text(), _package_of(path))
           if name.startswith(FORBIDDEN_FROM_SAMPLER)]
    assert not bad, "the sampler boundary must not depend on the rollout or trainer side:\n" + "\n".join(bad)


def test_sampler_modules_import_without_rollout_in_a_fresh_interpreter():
    modules = [_module_name(p) for p in _sampler_files() if p.name != "__main__.py"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('asyncgrpo_cli.rollout', "
        "'asyncgrpo_cli.train')))))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("module", ["asyncgrpo_cli.train.batcher", "asyncgrpo_cli.train.packing"])
def test_batcher_and_packing_import_on_their_own(module):
    proc = _run(f"import {module}")
    assert proc.returncode == 0, proc.stderr


def test_packing_does_not_import_the_batcher():
    proc = _run("import sys, asyncgrpo_cli.train.packing; print('asyncgrpo_cli.train.batcher' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_composing_a_config_imports_no_transformers(tmp_path):
    """With a snapshot that matches this install, composing imports neither transformers nor torch. A CI
    machine may get another transformers than the one the shipped snapshot was read from: the first compose
    then reads the fields live and keeps them in the user cache (here a temporary one); the second, in a
    fresh interpreter, must be light."""
    code = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from asyncgrpo_cli.config.compose import compose, to_yaml, training_args_kwargs\n"
        "cfg = compose(['+recipe=smoke', 'trainer.learning_rate=3e-6'])\n"
        "assert 'learning_rate: 3.0e-06' in to_yaml(cfg), to_yaml(cfg)\n"
        "assert training_args_kwargs(cfg)['learning_rate'] == 3e-6\n"
        "from asyncgrpo_cli.cli import app\n"
        "runner = CliRunner()\n"
        "results = [runner.invoke(app, args) for args in (['config', '+recipe=smoke'], "
        "['train', '--cfg', 'job', '+recipe=smoke'])]\n"
        "print(json.dumps({'exit': [r.exit_code for r in results], 'lr_shown': all('learning_rate' in r.output "
        "for r in results), 'heavy': [m for m in ('transformers', 'torch') if m in sys.modules]}))\n"
    )
    env = {"ASYNCGRPO_CACHE": str(tmp_path / "cache")}
    first = _run(code, env=env)
    assert first.returncode == 0, first.stderr
    proc = _run(code, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"exit": [0, 0], "lr_shown": True, "heavy": []}, got


def test_the_trainer_fields_used_are_the_installed_ones(tmp_path, monkeypatch):
    """Whatever snapshot is shipped, the fields composing uses are those of this transformers and
    ``config/grpo_config.py``; when the shipped snapshot matches this install it is used as it is."""
    from asyncgrpo_cli.config import trainer_fields

    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    live = trainer_fields.live_specs()
    assert trainer_fields.trainer_field_specs() == live
    shipped = trainer_fields.snapshot_specs()
    if shipped is not None:
        assert shipped == live
        assert not trainer_fields.cache_path().exists()
    else:  # stale for this install (another transformers): the live fields went to the user cache
        assert trainer_fields.snapshot_specs(trainer_fields.cache_path()) == live


def test_the_shipped_trainer_field_snapshot_is_stamped_with_this_grpo_config():
    """Editing ``config/grpo_config.py`` (or merging branches that did) without regenerating the snapshot makes
    every compose read the fields live, importing transformers: the used-folder refusal then imported it, as
    it should not, whenever the user cache held another checkout's fields. Regenerate with
    ``python -m asyncgrpo_cli.config.trainer_fields``."""
    from asyncgrpo_cli.config import trainer_fields

    shipped = json.loads(trainer_fields.SNAPSHOT_PATH.read_text())["stamp"]["train_config_sha256"]
    assert shipped == trainer_fields.current_stamp()["train_config_sha256"], \
        "config/trainer_fields.json is stale: run python -m asyncgrpo_cli.config.trainer_fields"


def test_a_stale_trainer_field_snapshot_is_not_used(tmp_path):
    from asyncgrpo_cli.config import trainer_fields

    data = json.loads(trainer_fields.SNAPSHOT_PATH.read_text())
    data["stamp"]["transformers"] = "0.0.1"
    stale = tmp_path / "trainer_fields.json"
    stale.write_text(json.dumps(data))
    assert trainer_fields.snapshot_specs(stale) is None
    assert trainer_fields.snapshot_specs(tmp_path / "missing.json") is None


def test_every_public_name_resolves_to_its_own_object():
    """``from asyncgrpo_cli import X`` for every public name: a real import, no 'not available' fallback."""
    import asyncgrpo_cli
    from asyncgrpo_cli.rollout.types import TurnRecord as rollout_turn_record

    for name in asyncgrpo_cli.__all__:
        assert getattr(asyncgrpo_cli, name).__name__ == name
    assert asyncgrpo_cli.TurnRecord is rollout_turn_record  # one TurnRecord, re-exported by rollout.types
    with pytest.raises(AttributeError, match="no attribute"):
        asyncgrpo_cli.NotAName  # noqa: B018


#: The launch and doctor functions that once took the whole composed config (issue #29, "The house"): each
#: takes the typed groups it reads. Only the two top-level orchestrators keep ``cfg``, and say why.
GROUP_FUNCTIONS = [
    ("asyncgrpo_cli.server.checks", "evaluate"),
    ("asyncgrpo_cli.server.command", "build_server_command"),
    ("asyncgrpo_cli.server.colocate", "decide_layout"),
    ("asyncgrpo_cli.launch.preflight", "check_server_port"),
    ("asyncgrpo_cli.launch.plan", "build_launch_plan"),
    ("asyncgrpo_cli.doctor.report", "run_doctor"),
]
ORCHESTRATORS = {"build_launch_plan", "run_doctor"}


@pytest.mark.parametrize("module,name", GROUP_FUNCTIONS, ids=[n for _, n in GROUP_FUNCTIONS])
def test_launch_and_doctor_functions_take_typed_groups(module, name):
    import dataclasses
    import importlib
    import inspect

    from asyncgrpo_cli.config.schema import AppConfig

    fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn).parameters
    groups = {f.name for f in dataclasses.fields(AppConfig)}
    if name in ORCHESTRATORS:
        assert "cfg" in params, f"{name} no longer takes cfg: take it off ORCHESTRATORS"
        assert "whole composed config because" in " ".join(inspect.getdoc(fn).split()), \
            f"{name} takes the whole config: its docstring must say why"
        return
    assert "cfg" not in params, f"{name}{inspect.signature(fn)} takes the whole config; pass the groups it reads"
    taken = [p for p in params.values() if p.name in groups]
    assert taken, f"{name} takes no config group"
    for p in taken:  # by name at every call site: sampler=cfg.sampler
        assert p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD), p
        assert p.kind is inspect.Parameter.KEYWORD_ONLY or len(taken) == 1, \
            f"{name}: with several groups each is keyword-only ({p.name})"


#: What an orchestrator may still hand the whole config: `restart_command` rebuilds the config (the address
#: in ``sampler.url``) before it passes groups on.
WHOLE_CONFIG_CALLEES = {"run_doctor": {"restart_command"}, "build_launch_plan": set()}


def _calls_given_cfg(fn) -> set[str]:
    """Names of the functions ``fn``'s body calls with the bare name ``cfg`` as an argument."""
    import inspect
    import textwrap

    out = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if isinstance(node, ast.Call):
            values = [*node.args, *(k.value for k in node.keywords)]
            if any(isinstance(v, ast.Name) and v.id == "cfg" for v in values):
                f = node.func
                out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ast.dump(f)))
    return out


def test_the_call_scan_sees_cfg_handed_on():
    def f(cfg):
        g(cfg.sampler, x=1)
        h.k(1, c=cfg)

    assert _calls_given_cfg(f) == {"k"}


@pytest.mark.parametrize("module,name", [(m, n) for m, n in GROUP_FUNCTIONS if n in ORCHESTRATORS],
                         ids=sorted(ORCHESTRATORS))
def test_orchestrators_pass_only_groups_down(module, name):
    import importlib

    fn = getattr(importlib.import_module(module), name)
    extra = _calls_given_cfg(fn) - WHOLE_CONFIG_CALLEES[name]
    assert not extra, f"{name} hands the whole cfg to {sorted(extra)}: pass the groups they read"
