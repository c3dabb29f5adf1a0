"""Secrets never reach a file or a command line: how a secret-bearing name is recognised and hidden.

A name ending in ``TOKEN`` or holding ``SECRET``, ``PASSWORD`` or ``API_KEY`` (any case: ``hub_token``,
``HF_TOKEN``, ``WANDB_API_KEY``) is a secret. `redact_argv` hides the value of every ``key=value`` override (and ``--flag
value`` pair) with such a name, for what is written down from a command line (the run lock).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SECRET_WORDS = ("SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY")
"""Parts of a name that make its value a secret (besides a name ending in ``TOKEN``)."""

HIDDEN = "***"
"""What a hidden value is replaced with."""

_SPECIAL_TOKENS = ("EOS_TOKEN", "BOS_TOKEN", "PAD_TOKEN", "UNK_TOKEN", "SEP_TOKEN", "CLS_TOKEN", "MASK_TOKEN")


def is_secret_name(name: str) -> bool:
    """Whether ``name`` (a config key, an environment variable, a flag) names a secret: its last part ends in
    ``TOKEN`` (``hub_token``, ``HF_TOKEN``, ``--hf-token``; not a tokenizer's ``eos_token``) or holds one of
    `SECRET_WORDS`; names that count tokens (``max_tokens``, ``token_budget``) do not."""
    parts = [p for p in re.split(r"[.\[\]]", name.strip().lstrip("-+~")) if p]
    leaf = (parts[-1] if parts else "").upper().replace("-", "_")
    if any(word in leaf for word in SECRET_WORDS):
        return True
    return leaf.endswith("TOKEN") and not leaf.endswith(_SPECIAL_TOKENS)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of each secret ``key=value`` override or ``--secret-flag value`` pair replaced
    by `HIDDEN`."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next and not arg.startswith("-"):
            out.append(HIDDEN)
            hide_next = False
            continue
        hide_next = False
        key, sep, _value = arg.partition("=")
        if sep and is_secret_name(key):
            out.append(f"{key}={HIDDEN}")
        elif arg.startswith("-") and not sep and is_secret_name(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return out
