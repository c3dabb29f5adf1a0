"""Shell completion of the overrides every command takes: ``+recipe=NAME`` and the config's keys.

`complete_override` is what the CLI's override argument completes with (``asyncgrpo --install-completion``
installs the shell side): an empty word or ``+`` offers ``+recipe=`` and the groups, ``+recipe=`` the
recipes (the built-in ones and those of ``--recipes-dir``), a partial key the keys that start with it
(``rollout.t`` → ``rollout.temperature=``, ``rollout.top_k=``, ...), and ``key=`` the values of a choice
or a boolean. Reads the schema only (the trainer group from its snapshot): nothing heavy is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

__all__ = ["complete_override", "config_keys", "key_values"]


def _groups() -> dict[str, type | None]:
    from .schema import AppConfig

    hints = typing.get_type_hints(AppConfig)
    out: dict[str, type | None] = {}
    for f in dataclasses.fields(AppConfig):
        tp = hints[f.name]
        out[f.name] = tp if dataclasses.is_dataclass(tp) else None  # rewards, tools: lists, set in a recipe
    return out


def config_keys() -> list[str]:
    """Every ``group.key`` of the config (``rewards`` and ``tools``, lists, as the group name alone)."""
    keys: list[str] = []
    for group, cls in _groups().items():
        if cls is None:
            keys.append(group)
            continue
        keys.extend(f"{group}.{f.name}" for f in dataclasses.fields(cls))
    return keys


def _field_type(key: str) -> Any:
    group, _, name = key.partition(".")
    cls = _groups().get(group)
    if cls is None or not name:
        return None
    return typing.get_type_hints(cls).get(name)


def key_values(key: str) -> list[str]:
    """The values ``key`` takes when they are few: an enum's values, ``true``/``false`` (and ``null`` when
    optional); [] otherwise."""
    tp = _field_type(key)
    optional = False
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [str(m.value) for m in tp]
    elif tp is bool:
        values = ["true", "false"]
    else:
        return []
    return values + (["null"] if optional else [])


def complete_override(incomplete: str, recipe_dirs: list[str | Path] | None = None) -> list[str]:
    """The completions of one override word ``incomplete`` (see the module docstring).

    Args:
        incomplete: the word typed so far (``""``, ``+rec``, ``+recipe=sm``, ``rollout.te``, ``sampler.backend=``).
        recipe_dirs: the command's ``--recipes-dir`` folders (their recipes are offered too).

    Returns:
        Whole override words, or ``key=`` prefixes to go on typing, sorted; [] when nothing fits.
    """
    from .compose import list_recipes
    from .rules import ConfigError

    prefix = "+" if incomplete.startswith("+") else ""
    word = incomplete.lstrip("+~")
    if word.startswith("recipe="):
        try:
            names = [r.name for r in list_recipes(recipe_dirs)]
        except ConfigError:  # a --recipes-dir that does not exist: the built-in recipes only
            names = [r.name for r in list_recipes()]
        return sorted(f"+recipe={n}" for n in names if f"+recipe={n}".startswith("+" + word))
    if "=" in word:
        key, _, value = word.partition("=")
        return [f"{prefix}{key}={v}" for v in key_values(key) if v.startswith(value)]
    candidates = ["+recipe="] if "recipe=".startswith(word) else []
    keys = config_keys()
    if "." not in word:  # a group first: "rollout." narrows to its keys
        candidates += sorted({f"{k.split('.')[0]}." if "." in k else f"{k}=" for k in keys if k.startswith(word)})
    else:
        candidates += sorted(f"{k}=" for k in keys if k.startswith(word))
    return [c if c.startswith("+") else prefix + c for c in candidates]
