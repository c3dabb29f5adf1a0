"""Checks of what a run reads: the model, the prompt dataset, the reward functions and every import path
(issue #19). Used by `asyncgrpo_cli.config.validate`'s CLI and API passes; nothing is downloaded.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .rules import ConfigError, ConfigErrors, config_error as _err

RESERVED_REWARD_KWARGS = ("prompts", "completions", "completion_ids")
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
ROWS_CHECKED = 64  # prompt rows whose form is checked (the whole column would cost seconds on big datasets)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")
_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt", ".tsv")


# ------------------------------------------------------------------------------------------ model
def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", "\\")) or name.count("/") > 1 or os.sep + os.sep in name
            or (os.altsep is not None and os.altsep in name) or Path(name).suffix in (".gguf", ".safetensors"))


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    if (folder / "additional_chat_templates").is_dir():
        return True
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text()).get("chat_template"))
        except (ValueError, OSError):
            return False
    return False


def model_max_len(folder: Path) -> int | None:
    """``max_position_embeddings`` of a local model folder's config.json (vLLM's default max_model_len), or None."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


HUB_PROBE_S = 5.0
"""Timeout of the one request that tells whether the Hugging Face Hub answers (`hub_problem`)."""


def hub_problem(timeout_s: float = HUB_PROBE_S) -> str | None:
    """Why the Hugging Face Hub cannot be used from here (``HF_HUB_OFFLINE`` set, or its endpoint does not
    answer within ``timeout_s``), None when it answers. One HEAD request to the endpoint's root."""
    import os

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        httpx.head(endpoint, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"the Hugging Face Hub ({endpoint}) is unreachable ({type(exc).__name__}: {str(exc)[:120]})"
    return None


def check_hub_reachable(name: str, key: str, what: str = "model") -> None:
    """A Hub id that is not cached here needs the Hub: refuse it now, in one line, when the Hub cannot be used
    (else the server or the trainer fails a minute in with a raw ``ConnectionError``).

    Raises:
        ConfigError: naming the id, why the Hub cannot be used and the fix.
    """
    problem = hub_problem()
    if problem is None:
        return
    local = "a local folder" if what == "model" else "a local data file or folder"
    where = "is not in the local cache" if what == "model" else "is read from the Hub"
    raise _err(key, name, f"this Hub {what} {where}, and {problem}",
               f"set {key} to {local}, or download it where the Hub is reachable and run with HF_HUB_OFFLINE=1 "
               "(the cached copy is used)")


def check_model_source(name: Any, key: str = "model.name", *, needs_chat_template: bool = True,
                       probe_hub: bool = False) -> tuple[Path | None, list[str]]:
    """Check that ``name`` is a local model folder or a well-formed Hub id (no network is used).

    Args:
        name: a local folder or a Hub id ``owner/name``.
        key: the key to name in errors.
        needs_chat_template: the prompts are rendered with the tokenizer's chat template (SPEC §2).

    Returns:
        ``(folder, notes)``: the local folder (the Hub cache's snapshot for a cached Hub id; None when
        only the Hub has it) and notes for the user.

    Raises:
        ConfigError: not a string; a path that does not exist or holds no model; a malformed Hub id;
            a folder whose tokenizer has no chat template.
    """
    notes: list[str] = []
    if not isinstance(name, str) or not name.strip():
        raise _err(key, name, "the model is a local folder or a Hub id", f"set {key}=HUB_ID_OR_DIR, e.g. "
                   "Qwen/Qwen3-0.6B")
    folder = Path(name).expanduser()
    if folder.exists():
        if not folder.is_dir():
            raise _err(key, name, "is a file, not a model folder", f"set {key} to the folder holding config.json")
        if not (folder / "config.json").is_file():
            raise _err(key, name, "the folder holds no config.json, so it is not a transformers model",
                       f"point {key} at the folder written by save_pretrained")
    elif _looks_like_path(name):
        parent = folder.parent
        near = difflib.get_close_matches(folder.name, [p.name for p in parent.iterdir()] if parent.is_dir() else [],
                                         n=3, cutoff=0.6)
        hint = f" (in {parent}: did you mean {', '.join(near)}?)" if near else ""
        raise _err(key, name, f"no such folder{hint}", f"set {key} to an existing model folder or a Hub id owner/name")
    elif not _HUB_ID.match(name) or ".." in name or "--" in name:
        raise _err(key, name, "neither an existing folder nor a Hub id of the form owner/name",
                   f"set {key} to a Hub id such as Qwen/Qwen3-0.6B or to an existing folder")
    else:
        folder = _hub_cache_folder(name)
        if folder is None:  # downloaded when the server and the trainer start; its template is checked then
            if probe_hub:
                check_hub_reachable(name, key)
            return None, notes
    if needs_chat_template and not _has_chat_template(folder):
        raise _err(key, name, "its tokenizer has no chat template, and prompts are chat messages rendered with it "
                   "(SPEC §2)", "use an instruct/chat model, or add a chat_template to its tokenizer_config.json")
    return folder, notes


def _hub_cache_folder(repo_id: str) -> Path | None:
    """The cached snapshot folder of ``repo_id`` (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a transformers dependency
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id answers like an absent one
        return None
    return Path(found).parent if isinstance(found, str) else None


# ------------------------------------------------------------------------------------------ dataset
def looks_like_local_data(name: str) -> bool:
    """Whether a ``data.name`` means a local file or folder (not a Hub dataset id)."""
    return _looks_like_path(name) or Path(name).suffix in _DATA_SUFFIXES or Path(name).expanduser().exists()


def check_data_source(name: Any, key: str = "data.name") -> None:
    """A local dataset path must exist (a Hub id is left to ``datasets``, which may need the network).

    Raises:
        ConfigError: the path does not exist (names close file names in its folder).
    """
    if not isinstance(name, str) or not name:
        return
    path = Path(name).expanduser()
    if looks_like_local_data(name) and not path.exists():
        parent = path.parent
        near = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()] if parent.is_dir() else [],
                                         n=3, cutoff=0.6)
        hint = f"; in {parent}: {', '.join(near)}" if near else ""
        raise _err(key, name, f"no such file or folder{hint}", f"set {key} to an existing data file or folder "
                   "(json, jsonl, csv, parquet) or a Hub dataset id")


def _prompt_form(value: Any, *, allow_text: bool) -> str | None:
    """None when ``value`` is a valid prompt, else what is wrong with it."""
    if isinstance(value, str):
        if not allow_text:
            return "a plain string, but the trainer takes conversational prompts (a list of {role, content} messages)"
        return "an empty string" if not value.strip() else None
    if isinstance(value, (list, tuple)):
        if not value:
            return "an empty list of messages"
        for i, m in enumerate(value):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                return f"message {i} is {type(m).__name__} {str(m)[:60]!r}, not a {{role, content}} dict"
            if m["role"] not in CHAT_ROLES:
                return f"message {i} has role {m['role']!r} (roles: {', '.join(CHAT_ROLES)})"
        return None
    return f"a {type(value).__name__}, not a string or a list of {{role, content}} messages"


def check_prompt_rows(dataset: Any, column: str = "prompt", *, key: str = "data.prompt_column",
                      dataset_key: str = "data.name", allow_text: bool = True) -> list[str]:
    """Check a prompt dataset: not empty, ``column`` present, its first rows of chat (or text) form.

    Args:
        dataset: a `datasets.Dataset` / IterableDataset, or any sequence of row dicts.
        column: the prompt column.
        key, dataset_key: keys named in errors.
        allow_text: a plain string is a prompt (the CLI wraps it as one user message); the API wants messages.

    Returns:
        The dataset's column names.

    Raises:
        ConfigError: the dataset is empty, has no such column, or a prompt has another form.
    """
    names = list(getattr(dataset, "column_names", None) or [])
    rows: list[Any] = []
    for i, row in enumerate(dataset):
        rows.append(row)
        if i + 1 >= ROWS_CHECKED:
            break
    if not rows:
        raise _err(dataset_key, getattr(dataset, "info", None) and getattr(dataset.info, "dataset_name", None) or
                   "(dataset)", "the dataset has no rows, so no prompt could ever be sampled",
                   "check the file, the split and any filter; it needs at least one prompt")
    if not names and isinstance(rows[0], Mapping):
        names = list(rows[0])
    if column not in names:
        close = difflib.get_close_matches(column, names, n=2, cutoff=0.5)
        raise _err(key, column, f"the dataset has no such column (its columns: {', '.join(names) or 'none'})",
                   f"set {key} to the column holding the prompt" + (f", e.g. {close[0]}" if close else ""))
    for i, row in enumerate(rows):
        problem = _prompt_form(row[column], allow_text=allow_text)
        if problem:
            shown = str(row[column])[:60]
            fix = ("map it to messages: dataset.map(lambda r: {'prompt': [{'role': 'user', 'content': r['prompt']}]})"
                   if isinstance(row[column], str) else f"point {key} at the column holding the prompt")
            raise ConfigError(f"{key}={column!r}: row {i} holds {shown!r}, {problem}. Fix: {fix}", key=key)
    return names


# ------------------------------------------------------------------------------------------ rewards
def check_reward_funcs(funcs: Sequence[Any], columns: Sequence[str] | None, key_of: Callable[[int], str] = lambda i: f"reward_funcs[{i}]",
                       names: Sequence[str] | None = None) -> None:
    """Each reward function must be a callable that accepts what the worker passes it (SPEC §10.1):
    ``prompts``, ``completions``, ``completion_ids`` and every dataset column except ``prompt``, by keyword.

    Args:
        funcs: the reward callables (functions, partials, callable instances).
        columns: the dataset's columns (None: unknown, only the callables are checked).
        key_of: maps the index of a function to the key named in errors (``rewards[0].func`` in the CLI).
        names: how each function was named (its import path), for the messages.

    Raises:
        ConfigErrors: a string instead of a callable; a required argument that no column provides; none of
            the columns a function lists in its ``ground_truth_columns`` attribute (`accuracy_reward`:
            ``solution`` or ``answer``); a function without ``**kwargs`` that does not accept every argument
            it is given.
    """
    errors: list[ConfigError] = []
    passed = set(RESERVED_REWARD_KWARGS) | {c for c in columns or [] if c != "prompt"}
    for i, func in enumerate(funcs):
        key = key_of(i)
        shown = names[i] if names and i < len(names) else getattr(func, "__name__", repr(func))
        if isinstance(func, str):
            errors.append(_err(key, func, "a string: reward models by Hub id are not supported by this trainer; "
                               "reward functions are Python callables", "pass a function (or its import path "
                               "module:function in a recipe's rewards list), e.g. asyncgrpo_cli.rewards:accuracy_reward"))
            continue
        if not callable(func):
            errors.append(_err(key, shown, f"a {type(func).__name__} is not callable", "pass a reward function"))
            continue
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            continue  # builtins and C callables: nothing to check
        if columns is None:
            continue
        params = sig.parameters.values()
        has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        accepted = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY)}
        required = [p.name for p in params if p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_ONLY)]
        missing = [n for n in required if n not in passed]
        if missing:
            close = {m: difflib.get_close_matches(m, list(columns), n=1, cutoff=0.6) for m in missing}
            hints = ", ".join(f"{m} (closest column: {c[0]})" if c else m for m, c in close.items())
            errors.append(_err(key, shown, f"needs argument(s) {hints} that no dataset column provides (columns: "
                               f"{', '.join(columns) or 'none'}); the worker passes prompts, completions, "
                               "completion_ids and every column by keyword", "add the column to the dataset, rename "
                               "it, or give the argument a default"))
            continue
        truth = getattr(func, "ground_truth_columns", None) or getattr(getattr(func, "func", None),
                                                                       "ground_truth_columns", None)
        if truth and not any(t in passed for t in truth):
            errors.append(_err(key, shown, f"scores against a ground-truth column, one of {', '.join(truth)}, and "
                               f"the dataset has none (columns: {', '.join(columns) or 'none'})",
                               f"add or rename the ground-truth column to {truth[0]}, e.g. "
                               f"dataset.rename_column('gold', '{truth[0]}')"))
            continue
        extra = sorted(passed - accepted)
        if not has_var_kw and extra:
            errors.append(_err(key, shown, f"takes no **kwargs, but the worker also passes {', '.join(extra)} "
                               "(SPEC §10.1: prompts, completions, completion_ids and every dataset column)",
                               "add **kwargs to its signature"))
    if errors:
        raise ConfigErrors(errors)


def check_reward_kwargs(func: Any, kwargs: dict[str, Any], key: str, path: str) -> None:
    """Each keyword argument of ``rewards[i].kwargs`` must name a parameter of the function: one that only
    lands in its ``**kwargs`` is read by nothing (a typo), and one the worker passes itself (``completions``,
    a dataset column) collides with it.

    Raises:
        ConfigError: naming the argument, the function's parameters (the closest first) and the fix.
    """
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return
    named = [p.name for p in params.values() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                              inspect.Parameter.KEYWORD_ONLY)]
    settable = [n for n in named if n not in RESERVED_REWARD_KWARGS]
    for arg in kwargs:
        if arg in RESERVED_REWARD_KWARGS:
            raise _err(key, dict(kwargs), f"{arg!r} is what the worker passes {path} itself on every call",
                       f"remove {arg} from {key}")
        if arg not in named:
            close = difflib.get_close_matches(arg, settable, n=1)
            raise _err(key, dict(kwargs), f"{path} has no parameter {arg!r} (its parameters: "
                       f"{', '.join(settable) or 'none'}), so nothing would read it",
                       f"{'did you mean ' + close[0] + '? ' if close else ''}use the function's own argument names")


# ------------------------------------------------------------------------------------------ imports
def check_import(path: Any, key: str) -> Any:
    """Import ``module:attr`` (or ``module.attr``) and return the object; on a typo name the closest names.

    Raises:
        ConfigError: not an import path, the module cannot be imported (closest module names of its package),
            or it has no such attribute (closest attribute names).
    """
    import importlib
    import pkgutil

    if not isinstance(path, str) or not path:
        raise _err(key, path, "not an import path", "write it as package.module:function")
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr or "/" in path:
        why = ("not an import path (a Hub id? reward models by Hub id are not supported: rewards are Python "
               "functions)" if "/" in path else "not an import path")
        raise _err(key, path, why, "write it as package.module:function, e.g. asyncgrpo_cli.rewards:accuracy_reward")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        parent, _, leaf = missing.rpartition(".")
        candidates: list[str] = []
        if parent:
            try:
                pkg = importlib.import_module(parent)
                candidates = [m.name for m in pkgutil.iter_modules(getattr(pkg, "__path__", []))]
            except ImportError:
                candidates = []
        close = difflib.get_close_matches(leaf, candidates, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(f'{parent}.{c}' for c in close)}?" if close else ""
        if missing != module_name and not module_name.startswith(missing):
            raise _err(key, path, f"importing {module_name!r} failed: it needs {missing!r}, which is not installed",
                       f"pip install the package that provides {missing}") from None
        raise _err(key, path, f"no module named {missing!r}{hint}",
                   "correct the module path, or install the package (or add its folder to PYTHONPATH)") from None
    except Exception as exc:  # noqa: BLE001 - the module itself failed on import
        raise _err(key, path, f"importing {module_name!r} raised {type(exc).__name__}: {exc}",
                   "fix that module (import it in python to see the traceback)") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise _err(key, path, f"{module_name!r} has no attribute {part!r}{hint}", "correct the name")
        obj = getattr(obj, part)
    return obj


def check_imports(cfg: Any) -> tuple[list[Any], list[str]]:
    """Import every reward function and the loop class of a composed config and bind the rewards' kwargs.

    Returns:
        ``(reward callables, their import paths)``.

    Raises:
        ConfigErrors: every import that fails, every reward that is not callable or refuses its kwargs,
            a ``rollout.loop_cls`` that is not an `AsyncRolloutLoop` subclass.
    """
    import functools

    from omegaconf import OmegaConf

    errors: list[ConfigError] = []
    funcs, paths = [], []
    for i, spec in enumerate(cfg.rewards):
        key = f"rewards[{i}].func"
        try:
            func = check_import(str(spec.func), key)
        except ConfigError as exc:
            errors.append(exc)
            continue
        if not callable(func):
            errors.append(_err(key, str(spec.func), f"is a {type(func).__name__}, not callable", "name a function"))
            continue
        kwargs = OmegaConf.to_container(spec.kwargs, resolve=True) if spec.kwargs else {}
        if kwargs:
            try:
                inspect.signature(func).bind_partial(**kwargs)
            except TypeError as exc:
                errors.append(_err(f"rewards[{i}].kwargs", kwargs, f"{spec.func} refuses them ({exc})",
                                   "use the function's own argument names"))
                continue
            except ValueError:
                pass
            try:
                check_reward_kwargs(func, kwargs, f"rewards[{i}].kwargs", str(spec.func))
            except ConfigError as exc:
                errors.append(exc)
                continue
            func = functools.partial(func, **kwargs)
        funcs.append(func)
        paths.append(str(spec.func))
    if cfg.rollout.loop_cls:
        try:
            loop_cls = check_import(str(cfg.rollout.loop_cls), "rollout.loop_cls")
            from ..rollout.loop import AsyncRolloutLoop

            if not (isinstance(loop_cls, type) and issubclass(loop_cls, AsyncRolloutLoop)):
                errors.append(_err("rollout.loop_cls", str(cfg.rollout.loop_cls), "is not a subclass of "
                                   "AsyncRolloutLoop", "name a class defined as class MyLoop(AsyncRolloutLoop)"))
        except ConfigError as exc:
            errors.append(exc)
    if errors:
        raise ConfigErrors(errors)
    return funcs, paths
