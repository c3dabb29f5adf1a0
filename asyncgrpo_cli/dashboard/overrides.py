"""Hydra overrides as a user types them on the command line, for the fixes the diagnosis prints
(`asyncgrpo_cli.dashboard.diagnosis`): list values, quoting, and dropping a flag from ``sampler.extra_args``."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable


def _bare_ok(value: str) -> bool:
    """Whether Hydra reads ``value`` unquoted as this very string (not a bool, null, float, or another int)."""
    if not re.fullmatch(r"[A-Za-z0-9_\-+./:%@]+", value) or value.lower() in ("true", "false", "null"):
        return False
    try:
        float(value)
    except ValueError:
        return True
    return re.fullmatch(r"-?[1-9][0-9]*|0", value) is not None


def _hydra_str(value: str) -> str:
    """``value`` as a Hydra list element: bare when `_bare_ok` (``--seed``, ``512``), else double-quoted
    (``"--kv-cache-dtype=fp8"``, ``"0.90"``)."""
    if _bare_ok(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _list_override(key: str, values: Iterable[str]) -> str:
    """``key=[a,b]`` as typed on the command line (Hydra list syntax, `_hydra_str` elements); in single
    quotes for the shell when an element is quoted."""
    text = f"{key}=[{','.join(_hydra_str(v) for v in values)}]"
    return shlex.quote(text) if '"' in text else text


def _drop_flag(args: Iterable[str], flags: tuple[str, ...], takes_value: bool) -> list[str]:
    """``args`` without ``flags`` (``--flag``, ``--flag=v``, and with ``takes_value`` the value after it)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = takes_value and "=" not in a
            continue
        out.append(a)
    return out
