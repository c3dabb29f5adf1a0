"""Checks of the command line's overrides that need no composed config: a key given twice, a true/false field given
another word, and which override a Hydra error is about (`compose` names each faulty override in one try)."""

from __future__ import annotations

import re

from .errors import ConfigError

__all__ = ["MAX_OVERRIDE_ERRORS", "refuse_repeated_keys"]

_UNKNOWN_KEY = re.compile(r"full_key: ([\w.]+(?:\[\d+\])?)")

MAX_OVERRIDE_ERRORS = 20
"""At most this many faulty overrides are named in one try (each costs one more compose, ~50 ms)."""


def _override_at_fault(exc: Exception, overrides: list[str]) -> int | None:
    """The index of the override a Hydra/OmegaConf error is about (an unknown key, a value of the wrong type, a
    group's missing option), or None when it names none of them (a recipe's key, a missing recipe, a parse
    error)."""
    msg = f"{exc}\n{exc.__cause__ or exc.__context__ or ''}"
    cause = exc.__cause__ or exc.__context__
    names = {str(k) for k in (getattr(exc, "full_key", None), getattr(cause, "full_key", None)) if k}
    names |= set(re.findall(r"Could not (?:override|append to) '([^']+)'", msg)) | set(_UNKNOWN_KEY.findall(msg))
    names |= {re.sub(r"\[\d+\]$", "", n) for n in names}
    names |= {g for g in re.findall(r"Could not (?:find|load) '([a-z_]+)/[^']+'", msg) if g != "recipe"}  # group=?
    for i, o in enumerate(overrides):
        key, sep, _ = o.partition("=")
        if sep and key.lstrip("+~") in names:
            return i
    return None


def refuse_repeated_keys(overrides: list[str]) -> None:
    """A key set twice on the command line with different values (``trainer.max_steps=5 ... trainer.max_steps=7``):
    Hydra would silently keep the last one, which is rarely what a long command line meant. The CLI calls it on
    what the user typed; `compose` itself keeps Hydra's rule (code that adds overrides to a list relies on it).

    Raises:
        ConfigError: naming the key, both values and the fix (give it once).
    """
    seen: dict[str, str] = {}
    for o in overrides:
        key, sep, value = o.partition("=")
        key = key.lstrip("+")
        if not sep or not key or key.startswith("~") or key.startswith("hydra."):
            continue
        if key in seen and seen[key] != value:
            raise ConfigError(f"{key} is set twice on the command line ({key}={seen[key]}, then {key}={value}); "
                              f"Hydra would silently keep the last. Fix: give it once: keep {key}={seen[key]} or "
                              f"{key}={value}, and drop the other", key=key)
        seen[key] = value


def _loose_bools(overrides: list[str]) -> list[tuple[int, ConfigError]]:
    """A true/false field set on the command line takes ``true`` or ``false`` (``null`` where None is allowed):
    OmegaConf would read ``2``, ``yes`` or ``on`` as true, so ``rollout.group_requests=2`` passed unnoticed.

    Returns:
        (index of the override, a `ConfigError` naming the field, the value and the two values it takes) for each.
    """
    from .override_errors import _unwrap, describe_type, field_at, type_error_message

    found = []
    for i, o in enumerate(overrides):
        key, sep, value = o.partition("=")
        key = key.lstrip("+")
        if not sep or key.startswith("~") or key.startswith("hydra."):
            continue
        field = field_at(key)
        if field is None:
            continue
        tp, optional = _unwrap(field[0])
        allowed = {"true", "false"} | ({"null"} if optional else set())
        parts = [v.strip().strip("'\"").lower() for v in value.split(",")]  # a sweep: true,false
        if tp is bool and not value.strip().startswith("${") and not all(v in allowed for v in parts):
            found.append((i, ConfigError(type_error_message(key, value) or
                                         f"{key}={value}: not {describe_type(field[0])}", key=key)))
    return found
