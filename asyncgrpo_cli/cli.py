"""`asyncgrpo`: the command line (DESIGN.md §1). Every command takes Hydra overrides as extra arguments."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .config.rules import ConfigError, ConfigErrors

app = typer.Typer(
    name="asyncgrpo",
    help="Asynchronous GRPO post-training: a vLLM sampler, a rollout worker and a tree-packed FSDP2 trainer, "
         "composed from Hydra configs and recipes.\n\nExamples:\n\n"
         "  asyncgrpo train +recipe=smoke\n\n"
         "  asyncgrpo serve +recipe=deepmath --dry-run\n\n"
         "  asyncgrpo config +recipe=deepmath rollout.num_generations=16\n\n"
         "  asyncgrpo train -m +recipe=smoke rollout.temperature=0.7,1.0   (a sweep: one job after another)",
    epilog=None,  # set by _groups_epilog below
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


def _flags_without_type(display_type_rich):
    """Typer's ``--help`` shows a type after every option, ``<bool>`` after a flag too; a flag takes no
    value, so it gets none (the rich help table and the plain one)."""

    def display(self, ctx):
        return None if getattr(self, "is_flag", False) else display_type_rich(self, ctx)

    return display


if hasattr(typer.core.TyperOption, "display_type_rich"):  # Typer's help internals: only where they are as known
    typer.core.TyperOption.display_type_rich = _flags_without_type(typer.core.TyperOption.display_type_rich)

OVERRIDES_HELP = "Hydra overrides, e.g. +recipe=deepmath rollout.temperature=0.8 trainer.max_steps=100"
RECIPES_DIR_HELP = "Extra folder of recipes (NAME.yaml) for +recipe=NAME; may be repeated."
MULTIRUN_HELP = ("Sweep: run one job per combination of the swept values (key=a,b  key=range(1,4)  group=a,b), "
                 "one after another, each in its own folder <trainer.output_dir>/<job number> "
                 "(or <hydra.sweep.dir>/<job number>).")
CFG_HELP = "Print the config and exit (Hydra's --cfg): job = the composed config, hydra = Hydra's own, all = both."


def _groups_epilog() -> str | None:
    """The config groups and their options, for the end of ``--help``."""
    try:
        from .config.hydra_conventions import config_groups

        groups = config_groups()
    except Exception:  # noqa: BLE001 - --help must work even when the config folders are broken
        return None
    lines = ", ".join(f"{g} ({'|'.join(opts)})" if opts else g for g, opts in groups.items())
    return (f"Config groups (group=option, +recipe=NAME): {lines}. `asyncgrpo --info` shows where they are read "
            "from; `asyncgrpo config --doc` describes every key. hydra.run.dir=DIR is trainer.output_dir=DIR.")


app.info.epilog = _groups_epilog()


def _print_error(exc: BaseException, label: str = "config error") -> None:
    """One user error, without a traceback; its text is printed as is (a value like ``[a, b]`` is not markup)."""
    from rich.markup import escape

    err.print(f"[bold red]{label}:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)


def _compose(overrides: list[str] | None, recipes_dirs: list[Path] | None, early: bool = False):
    """The composed config, or exit 2 naming every problem of its values. ``early`` (``train``, ``config
    --check``): with them, what `train` refuses before it loads anything (`launch.preflight.early_refusal`: a used
    folder, another job there, a busy port), so that one try names it too."""
    from .config.compose import compose, refuse_repeated_keys

    try:
        refuse_repeated_keys(list(overrides or []))
        return compose(overrides or [], extra_recipe_dirs=recipes_dirs)
    except ConfigError as exc:
        deep, also = _more_problems_unchecked(exc, overrides, recipes_dirs) if early else ([], None)
        _print_error(ConfigErrors([*(exc.errors if isinstance(exc, ConfigErrors) else [exc]), *deep]) if deep
                     else exc)
        if also:  # its overrides apply once the problems above are fixed
            _print_refusal(also, after_problems=True)
        raise typer.Exit(2) from None


def _print_refusal(message: str, after_problems: bool = False) -> None:
    """An early refusal (``label: text``, `launch.preflight.early_refusal`) with its label in bold red; after
    problems printed above it, its fix says it applies once they are fixed."""
    label, _, text = message.partition(": ")
    if after_problems:
        text = text.replace("Fix:", "Fix (once the problems above are fixed):", 1)
    err.print(Text.assemble((f"{label}: ", "bold red"), text), highlight=False, soft_wrap=True)


def _more_problems_unchecked(found: ConfigError, overrides: list[str] | None,
                             recipes_dirs: list[Path] | None) -> tuple[list[ConfigError], str | None]:
    """The other problems `train` would name, on the config composed without the value checks that ``found``
    came from: the deep pass's (model, data, rewards, imports: `config.run_checks.validate_run`) whose keys
    ``found`` does not name, and `launch.preflight.early_refusal`'s (a used folder, another job there, a busy
    port). Empty when the config cannot be checked that way (a value they need is the one at fault)."""
    from .config.compose import compose, with_values_without
    from .config.run_checks import validate_run
    from .launch.preflight import early_refusal

    known = set(found.keys if isinstance(found, ConfigErrors) else [found.key])
    deep: list[ConfigError] = []
    kept = list(overrides or [])
    try:
        cfg = compose(kept, extra_recipe_dirs=recipes_dirs, validate=False)
    except Exception:  # noqa: BLE001 - Hydra refused overrides (unknown keys, types): the value rules never ran,
        kept = [o for o in kept if o.split("=", 1)[0].lstrip("+~") not in known]  # so run them on the rest
        try:
            compose(kept, extra_recipe_dirs=recipes_dirs)
        except ConfigError as exc:
            deep = [e for e in (exc.errors if isinstance(exc, ConfigErrors) else [exc]) if e.key not in known]
        except Exception:  # noqa: BLE001
            pass
        known |= {e.key for e in deep}
        try:
            cfg = compose(kept, extra_recipe_dirs=recipes_dirs, validate=False)
        except Exception:  # noqa: BLE001 - an extra: the config's own errors are printed all the same
            return deep, None
    if cfg.model.name:
        try:
            validate_run(cfg, "train")
        except ConfigError as exc:
            exc = with_values_without(exc, kept, recipes_dirs)
            deep += [e for e in (exc.errors if isinstance(exc, ConfigErrors) else [exc])  # a key without a dot is
                     if e.key not in known and "." in str(e.key)]  # the Python API's name of a rule named above
        except Exception:  # noqa: BLE001
            pass
    try:
        also = early_refusal(cfg, whole_commands=False)  # this command line has problems: the overrides to add
    except Exception:  # noqa: BLE001
        also = None
    return deep, also


def _validate(cfg, command: str, probe: bool = False, keep_going: bool = False, overrides: list[str] | None = None,
              recipes_dir: list[Path] | None = None) -> list[ConfigError]:
    """The deep pass of `asyncgrpo_cli.config.validate` before anything starts (``probe``: with the network
    checks, an external sampler answering): exit 2 on a problem, print its warnings otherwise. ``keep_going``
    (``train --dry-run``): return the problems instead, so that the launch plan is still printed with them.
    A problem with a key of ``overrides`` also names that key's value without the override (the recipe's)."""
    problem, warnings = _deep_checks(cfg, command, probe, overrides, recipes_dir)
    if problem is not None:
        if keep_going:
            return list(problem.errors) if isinstance(problem, ConfigErrors) else [problem]
        _print_error(problem)
        raise typer.Exit(2)
    _print_warnings(warnings)
    return []


def _deep_checks(cfg, command: str, probe: bool, overrides: list[str] | None,
                 recipes_dir: list[Path] | None) -> tuple[ConfigError | None, list[str]]:
    """`_validate`'s checks, printing nothing: ``(problem, warnings)``, the problem (every one, a `ConfigErrors`)
    naming the value of an overridden key without the override, or None."""
    from .config.compose import with_values_without
    from .config.run_checks import validate_run

    try:
        return None, validate_run(cfg, command, probe=probe)
    except ConfigError as exc:
        return with_values_without(exc, list(overrides or []), recipes_dir), []


def _print_warnings(warnings: list[str]) -> None:
    from rich.markup import escape

    from .config.notes import is_note

    for w in warnings:
        label = "[cyan]note:[/]" if is_note(w) else "[yellow]warning:[/]"
        err.print(f"{label} {escape(w)}", highlight=False, soft_wrap=True)


def _resolve_model(cfg, export: bool = True) -> str | None:
    """Point ``model.name`` at the folder the server and trainer load. A packaged GGUF is exported once
    (with ``export``); without it, a note saying the folder is made on the first real start is returned."""
    from .config.models import plan_model_path, resolve_model_path

    if not cfg.model.name:
        return None
    name, gguf_file = str(cfg.model.name), cfg.model.gguf_file
    note = None
    if export:
        cfg.model.name = resolve_model_path(name, gguf_file)
    else:
        try:
            cfg.model.name, gguf = plan_model_path(name, gguf_file)
        except ConfigError as exc:  # a dry run still prints the line; the note says what a real start needs
            return f"a real start would stop here: {exc}"
        if gguf is not None:
            note = f"{cfg.model.name} does not exist yet: asyncgrpo serve/train export {gguf} there on first start"
    cfg.model.gguf_file = None
    return note


def _version_option(value: bool) -> None:
    if value:
        _print_version()
        raise typer.Exit(0)


def _info_option(value: bool) -> None:
    if value:
        _print_info()
        raise typer.Exit(0)


INFO_HELP = "Print the config search path, the config groups and the recipes, and exit."


def _info_flag() -> Any:
    """``--info`` on a command too (`asyncgrpo train --info`), as on `asyncgrpo` itself (Hydra's flag)."""
    return typer.Option(False, "--info", is_eager=True, callback=_info_option, help=INFO_HELP)


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version_option,
                                 help="Print the version and exit."),
    info: bool = _info_flag(),
) -> None:
    """Options of the `asyncgrpo` command itself."""


def _print_version() -> None:
    import importlib.metadata

    def v(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    out.print(f"asyncgrpo {v('asyncgrpo')} (python {sys.version.split()[0]}, torch {v('torch')}, transformers "
              f"{v('transformers')}, hydra-core {v('hydra-core')}, vllm {v('vllm')})", highlight=False, soft_wrap=True)


def _info_rows(title: str, rows: list[tuple[str, str]]) -> None:
    """One ``--info`` section: its title, then its rows with the names padded to the longest one, so the
    second column lines up (values are printed whole: no wrapping, no cut)."""
    out.print(title)
    width = max((len(name) for name, _ in rows), default=0)
    for name, value in rows:
        out.print(f"  {name:<{width}}  {value}", markup=False, highlight=False, soft_wrap=True, crop=False)


def _print_info() -> None:
    from .config.hydra_conventions import config_groups, search_path
    from .config.compose import list_recipes

    _info_rows("[bold]config search path[/]", search_path())
    _info_rows("[bold]config groups[/] (group=option; the defaults are in conf/config.yaml)",
               [(group, ", ".join(options)) for group, options in config_groups().items() if group != "recipe"])
    _info_rows("[bold]recipes[/] (+recipe=NAME; add a folder with --recipes-dir DIR)",
               [(r.name, r.description or "(no description)") for r in list_recipes()])


def _hydra_args(overrides: list[str] | None, *, multirun: bool = False, command: str = "train"):
    """Overrides with Hydra's own keys handled (`config.hydra_conventions`): ``hydra.run.dir`` becomes
    ``trainer.output_dir``, other ``hydra.*`` keys and (without ``-m``) sweeps are refused."""
    from .config.hydra_conventions import refuse_sweeps, take_hydra_keys

    try:
        args = take_hydra_keys(overrides, multirun=multirun)
        if not multirun:
            refuse_sweeps(args.overrides, command)
    except ConfigError as exc:
        err.print(Text.assemble(("config error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    for note in args.notes:
        err.print(f"[dim]note: {note}[/]", highlight=False, soft_wrap=True)
    return args


def _print_cfg(which: str, cfg, overrides: list[str], recipes_dirs, sweep_dir: str | None = None) -> None:
    """``--cfg job|hydra|all``: print the composed config and/or Hydra's own config."""
    from .config.compose import to_yaml

    if which not in ("job", "hydra", "all"):
        err.print(f"[bold red]error:[/] --cfg {which}: unknown. Fix: --cfg job, --cfg hydra or --cfg all",
                  highlight=False)
        raise typer.Exit(2)
    if which in ("hydra", "all"):
        from .config.hydra_conventions import hydra_config_yaml

        try:
            sys.stdout.write(hydra_config_yaml(overrides, recipes_dirs, sweep_dir=sweep_dir))
        except ConfigError as exc:
            err.print(Text.assemble(("config error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    if which in ("job", "all"):
        sys.stdout.write(to_yaml(cfg))


def _sweep_jobs(overrides: list[str], sweep_dir: str | None, recipes_dirs):
    """The jobs of a ``-m`` sweep with their composed configs; each job's ``trainer.output_dir`` is
    ``<hydra.sweep.dir or trainer.output_dir>/<job number>`` unless the sweep varies it itself."""
    from .config.hydra_conventions import OUTPUT_KEY, expand_sweep, job_output_dir, swept_keys
    from .launch.plan import output_dir_of

    try:
        jobs = expand_sweep(overrides)
        output_swept = OUTPUT_KEY in swept_keys(overrides)
    except ConfigError as exc:
        err.print(Text.assemble(("config error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    composed = []
    bases = set()
    for job in jobs:
        cfg = _compose(job.overrides, recipes_dirs)
        if not output_swept:
            base = sweep_dir if sweep_dir is not None else str(output_dir_of(cfg.trainer))
            cfg.trainer.output_dir = str(job_output_dir(base, job))
            bases.add(base)
        composed.append((job, cfg))
    for base in sorted(bases):
        note = _sweep_inside_a_run_note(Path(base))
        if note:
            err.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    return composed


def _sweep_inside_a_run_note(base: Path) -> str | None:
    """A note when a sweep's job folders (``<base>/<job number>``) would go inside a folder that holds an
    earlier run's checkpoint or final model; None otherwise."""
    from .run.folder import earlier_run

    newest, final = earlier_run(base)
    if newest is None and not final:
        return None
    held = ", ".join([*([newest.name] if newest is not None else []), *(["the final model"] if final else [])])
    return (f"the sweep's job folders go inside {base} ({base}/0, {base}/1, ...), which holds an earlier run "
            f"({held}); that run is kept, but the jobs mix with it. To keep them apart: "
            f"hydra.sweep.dir={base}-sweep")


def _complete_overrides(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of an override word: ``+recipe=NAME`` and config keys (`config.completion`).

    bash splits a word at ``=`` (``+recipe = sm``): the word is rejoined from the words before it, and only
    the part after the ``=`` is offered back."""
    from .config.completion import complete_override

    before = list(ctx.params.get("overrides") or [])
    dirs = ctx.params.get("recipes_dir") or None
    if before and before[-1] == "=" and len(before) >= 2:
        head = f"{before[-2]}="
        return [w[len(head):] for w in complete_override(head + incomplete, dirs) if w.startswith(head)]
    return complete_override(incomplete, dirs)


@app.command("config", help="Print the composed config as YAML, types and rules checked (--check: every check "
                             "train runs; --doc: with each key's description).")  # one line: --help breaks a docstring's
def config_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, autocompletion=_complete_overrides),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
    doc: bool = typer.Option(False, "--doc", help="Describe every key: its docstring as a comment above it."),
    check: bool = typer.Option(False, "--check", help="Also run every check train runs (model, lengths, imports, "
                               "data, rewards; loads transformers): exit 2 naming each problem, without the YAML."),
    cfg_kind: Optional[str] = typer.Option(None, "--cfg", "-c", help=CFG_HELP),
    multirun: bool = typer.Option(False, "--multirun", "-m", help="Print the config of every job of a sweep."),
    info: bool = _info_flag(),
) -> None:
    """`asyncgrpo config` (its help is the decorator's: a docstring's line break showed in ``--help``)."""
    from .config.compose import to_yaml
    from .config.docs import documented_yaml

    hargs = _hydra_args(overrides, multirun=multirun, command="config")
    if multirun:
        for job, cfg in _sweep_jobs(hargs.overrides, hargs.sweep_dir, recipes_dir):
            sys.stdout.write(f"# job {job.num}: {' '.join(job.swept) or '(no swept key)'}\n")
            sys.stdout.write((documented_yaml(cfg) if doc else to_yaml(cfg)) + "---\n")
        return
    cfg = _compose(hargs.overrides, recipes_dir, early=check and cfg_kind is None)
    if cfg_kind is not None:
        _print_cfg(cfg_kind, cfg, hargs.overrides, recipes_dir, hargs.sweep_dir)
        return
    warnings: list[str] = []
    if check and cfg.model.name:  # the deep pass train runs, before the YAML: exit 2 with every problem, and
        # without the YAML (240 lines of it above the problems hid them: a fresh-user trial)
        problem, warnings = _deep_checks(cfg, "train", True, hargs.overrides, recipes_dir)
        if problem is not None:
            _print_error(problem)
            raise typer.Exit(2)
        _check_plan(cfg)
    sys.stdout.write(documented_yaml(cfg) if doc else to_yaml(cfg))
    sys.stdout.flush()
    if not check:  # composing stays light (no transformers, no torch)
        return
    if not cfg.model.name:  # the defaults alone: the deep checks need a model
        err.print("note: model.name is unset, so only types and rules were checked; with a model (+recipe=NAME "
                  "or model.name=...) --check runs the checks train runs (lengths, imports, data, rewards)",
                  highlight=False, soft_wrap=True)
        return
    _print_warnings(warnings)  # after the YAML, as before the checks moved in front of it
    err.print("[green]config --check: every check train runs before it starts passed[/] (the server's own "
              "checks run when it answers: asyncgrpo doctor)", highlight=False, soft_wrap=True)


def _check_plan(cfg) -> None:
    """`config --check`: the launch plan's problems on this machine (GPUs, cores, the server command), and what
    `train` refuses before it loads anything (`launch.preflight.early_refusal`: another job in the folder, a busy
    port, a folder that holds an earlier run), which `train` and its dry run refuse too: exit 2 naming each (before
    the YAML, which is then not printed)."""
    from .launch.preflight import early_refusal

    problems, unused = _plan_problems(cfg)
    early = early_refusal(cfg, whole_commands=not problems)  # with problems, the fix is the overrides to add
    if early:
        problems.append(early)  # with train's own label ("error:" for a used folder), so both read alike
    for problem in problems:
        _print_refusal(problem)
    if problems:
        raise typer.Exit(2)
    for note in unused:  # the plan's note that a chosen setting does nothing here (train prints it in the plan)
        err.print(f"note: {note}", highlight=False, soft_wrap=True)


@app.command("recipes")
def recipes_cmd(
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """List the recipes, each with its one-line description."""
    from .config.compose import list_recipes

    try:
        recipes = list_recipes(recipes_dir)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    table = Table("recipe", "description", box=None, show_header=True, header_style="bold")
    for r in recipes:
        table.add_row(f"+recipe={r.name}", r.description or "(no description)")
    out.print(table)


@app.command("serve")
def serve_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, autocompletion=_complete_overrides),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and environment instead of starting it."),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
    info: bool = _info_flag(),
) -> None:
    """Start the inference server (vLLM, or the embedded sampler) with exactly the flags the config needs."""
    from .server.colocate import visible_gpu_count
    from .server.command import server_command_here
    from .launch.supervisor import server_exec_argv

    served = _hydra_args(overrides, command="serve").overrides
    cfg = _compose(served, recipes_dir)
    _validate(cfg, "serve", overrides=served, recipes_dir=recipes_dir)
    external_note = None
    if getattr(cfg.sampler.backend, "value", cfg.sampler.backend) == "external":  # the server that config expects
        from .server.command import server_for_external

        cfg, external_note = server_for_external(cfg, at_url=True)
    if not dry_run:
        _check_port(cfg)
    try:
        export_note = _resolve_model(cfg, export=not dry_run)
        command = server_command_here(cfg)
    except ConfigError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    if export_note:
        command.notes.append(export_note)
    if external_note:
        command.notes.insert(0, external_note)
    backend = getattr(cfg.sampler.backend, "value", cfg.sampler.backend)
    if backend == "vllm":
        if visible_gpu_count() == 0:
            where = "sampler.backend=vllm: no CUDA GPU is visible here, and vLLM needs one. "
            if dry_run:
                command.notes.append(where + "Run this command on the GPU machine, or serve on CPU with "
                                     "sampler.backend=embedded")
            else:
                command.problems.append(where + "Fix: run this command on the GPU machine, or serve on CPU with "
                                        "sampler.backend=embedded")
    if dry_run:
        from .launch.supervisor import check_server_port

        try:
            check_server_port(cfg.sampler)
        except ConfigError as exc:
            command.problems.append(str(exc))
        for note in command.notes:
            sys.stdout.write(f"# {note}\n")
        for problem in command.problems:
            sys.stdout.write(f"# problem: {problem}\n")
        sys.stdout.write(command.shell_line() + "\n")
        if command.problems:  # the line is shown, but it would not run as configured
            err.print(f"[bold red]error:[/] {len(command.problems)} problem(s) above: this server would not start "
                      "as configured", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        return
    if command.problems:
        for problem in command.problems:
            err.print(f"[bold red]error:[/] {problem}", highlight=False)
        raise typer.Exit(2)  # a configuration refusal
    for note in command.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)
    from .config.compose import public_host_warning

    if public_host_warning(cfg):
        err.print(f"[bold yellow]{public_host_warning(cfg)}[/]", highlight=False)
    try:
        argv = server_exec_argv(command)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    env = {**os.environ, **command.env}
    err.print(Text(f"$ {command.shell_line()}", style="dim"), highlight=False, soft_wrap=True, crop=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)


def _check_port(cfg) -> None:
    """`serve`: refuse a busy ``sampler.port`` before the model is exported or loaded."""
    from .launch.supervisor import check_server_port

    try:
        check_server_port(cfg.sampler, command="serve")
    except ConfigError as exc:
        err.print(Text.assemble(("config error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("doctor", context_settings={"allow_extra_args": True})
def doctor_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, autocompletion=_complete_overrides),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """Check a running server against the config (flags, LoRA limits, versions, GPUs) and print the fix."""
    from .doctor.report import run_doctor

    cfg = _compose(_hydra_args(overrides, command="doctor").overrides, recipes_dir)
    try:
        _resolve_model(cfg)  # compare against the folder `serve` and `train` give the server
    except ConfigError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    typed = [*(a for d in recipes_dir or [] for a in ("--recipes-dir", str(d))), *(overrides or [])]
    raise typer.Exit(run_doctor(cfg, as_json=as_json, serve_args=typed))  # serve_args: its fix, as typed


@app.command("train")
def train_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, autocompletion=_complete_overrides),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch plan only."),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
    multirun: bool = typer.Option(False, "--multirun", "-m", help=MULTIRUN_HELP),
    cfg_kind: Optional[str] = typer.Option(None, "--cfg", "-c", help=CFG_HELP),
    info: bool = _info_flag(),
) -> None:
    """Run the main job: the sampler, the FSDP2 trainer and its rollout worker, with live panels."""
    hargs = _hydra_args(overrides, multirun=multirun, command="train")
    if multirun:
        raise typer.Exit(_train_sweep(hargs, recipes_dir, dry_run, cfg_kind))
    cfg = _compose(hargs.overrides, recipes_dir, early=cfg_kind is None)
    if cfg_kind is not None:
        _print_cfg(cfg_kind, cfg, hargs.overrides, recipes_dir, hargs.sweep_dir)
        raise typer.Exit(0)
    if not dry_run and cfg.model.name:
        _refuse_early(cfg, hargs.overrides, recipes_dir)
    from .launch.supervisor import run_train  # after --cfg: printing a config imports no trainer code

    refused = _validate(cfg, "train", probe=True, keep_going=dry_run, overrides=hargs.overrides,
                        recipes_dir=recipes_dir)
    if refused:  # a dry run shows its plan all the same, with the checks that failed in it
        from .launch.supervisor import print_refused_plan

        raise typer.Exit(print_refused_plan(cfg, refused))
    raise typer.Exit(run_train(cfg, dry_run=dry_run))


def _refuse_early(cfg, overrides: list[str] | None = None, recipes_dirs: list[Path] | None = None) -> None:
    """`train`: exit 2 at once on what needs no model (`launch.preflight.early_refusal`: another job in the
    folder, a busy port, a used or unwritable folder, an external sampler that does not answer), before the
    deep checks import transformers and load the data. When it refuses, the `TrainingArguments` rules (no heavy
    import) run all the same, so that one try names their problems too (a bad ``activation_checkpointing_kwargs``
    in a used folder took two), and the refusal's fix then gives only the overrides to add, not a command that
    repeats the faulty ones."""
    from .config.validate import check_training_arguments
    from .launch.preflight import early_refusal

    problem = None
    try:  # pure and cheap; the deep pass runs them again when nothing is refused here
        check_training_arguments({k: v for k, v in cfg.trainer.items()}, lambda n: f"trainer.{n}")
    except ConfigError as exc:
        problem = exc
    message = early_refusal(cfg, whole_commands=problem is None)
    if message:
        planned, _ = _plan_problems(cfg)  # on a refusal only: the plan's own (launch.mps on a CPU, GPUs) too
        if planned and problem is None:
            message = early_refusal(cfg, whole_commands=False)
        if problem is not None:
            from .config.compose import with_values_without

            _print_error(with_values_without(problem, list(overrides or []), recipes_dirs))
        for line in planned:
            _print_refusal(line)
        _print_refusal(message, after_problems=problem is not None or bool(planned))
        raise typer.Exit(2)


def _plan_problems(cfg) -> tuple[list[str], list[str]]:
    """``(problems, unused)`` of the launch plan on this machine (`launch.plan.build_launch_plan`): its problems
    (GPUs, cores, ``launch.mps``, the server command), each as ``config error: ...`` (`train --dry-run` and
    `config --check` name them too), and its sentences on chosen settings it leaves without effect (`GpuPlan.unused`)."""
    from .launch.plan import build_launch_plan

    try:
        plan = build_launch_plan(cfg)
        problems, unused = [f"config error: {p}" for p in plan.problems], list(plan.gpus.unused)
    except ConfigError as exc:
        problems, unused = [f"config error: {exc}"], []
    return problems, unused


def _train_sweep(hargs, recipes_dir, dry_run: bool, cfg_kind: str | None) -> int:
    """``train -m``: every job of the sweep, one after another; stops at an interrupt (130 / 143).

    Returns:
        0 when every job succeeded, else the first non-zero exit status.
    """
    from .config.compose import to_yaml
    from .launch.supervisor import run_train

    jobs = _sweep_jobs(hargs.overrides, hargs.sweep_dir, recipes_dir)
    results: list[tuple[int, str, str, int]] = []
    for job, cfg in jobs:
        out.print(f"[bold cyan]sweep job {job.num + 1}/{len(jobs)}[/]: {' '.join(job.swept) or '(no swept key)'} "
                  f"-> {cfg.trainer.output_dir}", highlight=False, soft_wrap=True)
        if cfg_kind is not None:
            sys.stdout.write(to_yaml(cfg) + "---\n")
            rc = 0
        else:
            rc = run_train(cfg, dry_run=dry_run)
        results.append((job.num, " ".join(job.swept), str(cfg.trainer.output_dir), rc))
        if rc in (130, 143):
            break
    table = Table("job", "exit", "swept values", "output", title="sweep", box=None, header_style="bold")
    for column in table.columns:  # a narrow or plain console wraps the folders, never cuts them ("/0", "/1")
        column.overflow = "fold"
    for num, swept, folder, rc in results:
        table.add_row(str(num), str(rc), swept, folder)
    if len(results) < len(jobs):
        table.caption = f"stopped after job {results[-1][0]}: {len(jobs) - len(results)} job(s) not run"
    out.print(table, soft_wrap=True)
    return next((rc for *_, rc in results if rc != 0), 0)


def sigint_stops() -> None:
    """Let SIGINT stop this process from its first line: a process started with ``&`` by a non-interactive shell
    inherits SIGINT ignored, and a ``kill -INT`` in a job's first seconds, before the supervisor installs its own
    handler, was dropped (a fresh-user trial: the run went on to step 6). The supervisor handles SIGINT from then on
    whatever it inherited, so the first seconds now behave as the rest."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> None:
    """Console-script entry point. After a command that loaded torch (a job), the process leaves without the
    interpreter's teardown of every module (1 to 3 s, after the job's last line): the ``atexit`` hooks run and
    the streams are flushed as in a normal exit, and the exit status is the same. SIGINT stops it from the start
    (`sigint_stops`)."""
    sigint_stops()
    try:
        app()
    except SystemExit as exc:
        if "torch" in sys.modules and (exc.code is None or isinstance(exc.code, int)):
            from .run.process_exit import exit_now

            exit_now(exc.code or 0)
        raise


if __name__ == "__main__":
    main()
