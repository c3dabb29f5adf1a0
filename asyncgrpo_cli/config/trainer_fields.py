"""The fields of the ``trainer`` Hydra group, without importing transformers when it can be avoided.

The ``trainer`` group holds every `transformers.TrainingArguments` field of `AsyncGRPOConfig` (with SPEC
§16.4's changed defaults). Reading them means importing transformers (and torch): seconds, for a command
such as ``asyncgrpo config`` that only composes YAML. So the field list is kept in ``trainer_fields.json``
next to this module, stamped with the transformers version it was read from and a hash of
``config/grpo_config.py`` (where the changed defaults live). When both stamps match the installed versions the
file is used; otherwise the fields are read live from `AsyncGRPOConfig` (correct, only slower), never
from a stale file, and kept in the user cache (``$ASYNCGRPO_CACHE`` or ``~/.cache/asyncgrpo``,
``trainer_fields.json``, same stamp) so that only the first compose after an upgrade pays for it.

Regenerate the file after upgrading transformers or editing ``config/grpo_config.py``::

    python -m asyncgrpo_cli.config.trainer_fields
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Optional

SNAPSHOT_PATH = Path(__file__).with_name("trainer_fields.json")
_TRAIN_CONFIG_PATH = Path(__file__).resolve().parent / "grpo_config.py"

_SCALARS: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}
_LIST_FACTORY = {"default_factory": "list"}

# One field: (name, type name, default). Type names: a scalar of ``_SCALARS``, ``Optional[<scalar>]`` or
# ``Any``; default: a JSON value, or ``_LIST_FACTORY`` for a ``default_factory=list`` field.
FieldSpec = tuple[str, str, Any]


def _type_name(tp: Any) -> str:
    """A TrainingArguments annotation as the name of a type OmegaConf can check (``Any`` where it cannot)."""
    for name, scalar in _SCALARS.items():
        if tp is scalar:
            return name
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS.values():
            return f"Optional[{args[0].__name__}]"
    return "Any"


def resolve_type(name: str) -> Any:
    """The type of a type name of `FieldSpec` (``"Optional[int]"`` → ``Optional[int]``)."""
    if name in _SCALARS:
        return _SCALARS[name]
    if name.startswith("Optional[") and name[9:-1] in _SCALARS:
        return Optional[_SCALARS[name[9:-1]]]
    if name == "Any":
        return Any
    raise ValueError(f"trainer field type {name!r} is not one of {sorted(_SCALARS)}, Optional[...] or Any")


def live_specs() -> list[FieldSpec]:
    """The trainer fields read from `AsyncGRPOConfig` itself (imports transformers).

    Raises:
        ValueError: a field whose default cannot be stored as JSON (a new transformers field type).
    """
    from .grpo_config import ASYNC_GRPO_FIELDS, AsyncGRPOConfig

    specs: list[FieldSpec] = []
    hints = typing.get_type_hints(AsyncGRPOConfig)
    for f in dataclasses.fields(AsyncGRPOConfig):
        if not f.init or f.name in ASYNC_GRPO_FIELDS or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            if made != []:
                raise ValueError(f"TrainingArguments.{f.name}: default_factory gives {made!r}; only an empty list "
                                 "is supported by the trainer-group snapshot")
            default = _LIST_FACTORY
        else:
            default = None
        type_name = _type_name(hints.get(f.name, Any))
        if default is None and type_name in _SCALARS:
            type_name = f"Optional[{type_name}]"
        try:
            json.dumps(default)
        except TypeError as exc:
            raise ValueError(f"TrainingArguments.{f.name}: default {default!r} is not JSON ({exc})") from exc
        specs.append((f.name, type_name, default))
    return specs


def current_stamp() -> dict[str, str]:
    """The stamp a snapshot must carry to be used here: the installed transformers version and the
    SHA-256 of ``config/grpo_config.py``. Reads metadata and one file; imports nothing heavy."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    digest = hashlib.sha256(_TRAIN_CONFIG_PATH.read_bytes()).hexdigest() if _TRAIN_CONFIG_PATH.is_file() else ""
    return {"transformers": version, "train_config_sha256": digest}


def snapshot_specs(path: Path = SNAPSHOT_PATH) -> list[FieldSpec] | None:
    """The stored fields when ``path`` exists, parses and carries `current_stamp`; else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stamp") != current_stamp():
        return None
    return [tuple(item) for item in data.get("fields", [])]  # type: ignore[misc]


def cache_path() -> Path:
    """The user-cache copy of the snapshot, written when the shipped one does not match this install."""
    from .models import cache_root

    return cache_root() / "trainer_fields.json"


def trainer_field_specs() -> list[FieldSpec]:
    """The trainer group's fields: from the shipped snapshot or the user-cache copy when one matches this
    install, else `live_specs` (then stored in the user cache; a cache that cannot be written is skipped)."""
    for path in (SNAPSHOT_PATH, cache_path()):
        specs = snapshot_specs(path)
        if specs is not None:
            return specs
    try:
        write_snapshot(cache_path())
    except OSError:
        return live_specs()
    specs = snapshot_specs(cache_path())
    return specs if specs is not None else live_specs()


def write_snapshot(path: Path = SNAPSHOT_PATH) -> Path:
    """Write `live_specs` with `current_stamp` to ``path`` atomically (temp file + rename)."""
    data = {"stamp": current_stamp(), "fields": [list(s) for s in live_specs()]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


if __name__ == "__main__":
    print(f"wrote {write_snapshot()}")
