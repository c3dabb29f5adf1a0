"""The rules of ``trainer.activation_checkpointing_kwargs`` (transformers' ``TrainingArguments`` field, read as
`transformers.Trainer` reads it; `asyncgrpo_cli.train.checkpointing` applies it). Pure: no torch, no transformers.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["CHECKPOINT_KEYS", "KEY", "OWN_KEYS", "checkpoint_every", "checkpointing_options"]

KEY = "trainer.activation_checkpointing_kwargs"
OWN_KEYS = ("every_n_layers", "offload")
"""The keys transformers takes out for itself (`transformers.Trainer`)."""
CHECKPOINT_KEYS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")
"""The keyword arguments of ``torch.utils.checkpoint.checkpoint`` (torch 2.x); in non-reentrant mode it hands any
other key to the layer's forward, which ignores it: a misspelt key would silently do nothing."""


def checkpointing_options(kwargs: Mapping[str, Any] | str | None, key: str = KEY) -> tuple[int, bool, dict[str, Any]]:
    """``(every_n_layers, offload, the rest for torch.utils.checkpoint)`` of ``activation_checkpointing_kwargs``
    (a mapping, a JSON string as `TrainingArguments` takes it, or None), ``use_reentrant`` set to false when absent.

    Raises:
        ConfigError: not a mapping, a key neither transformers nor ``torch.utils.checkpoint`` reads,
            ``every_n_layers`` not a whole number >= 1, or ``offload`` not a boolean (each names the key and the fix).
    """
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs) if kwargs.strip() else None
        except ValueError:
            pass  # refused below as not a mapping
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigError(f"{key}={kwargs!r}: must be a mapping. Fix: e.g. {key}={{every_n_layers: 2}}", key=key)
    rest = dict(kwargs or {})
    unknown = [k for k in rest if k not in OWN_KEYS + CHECKPOINT_KEYS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(str(unknown[0]), OWN_KEYS + CHECKPOINT_KEYS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"{key}.{unknown[0]}={rest[unknown[0]]!r}: not a key transformers or "
                          f"torch.utils.checkpoint reads, so it would do nothing. Fix: {hint}the keys are "
                          f"{', '.join(OWN_KEYS + CHECKPOINT_KEYS)}", key=key)
    every = rest.pop("every_n_layers", 1)
    offload = rest.pop("offload", False)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{key}.every_n_layers={every!r}: must be a whole number >= 1 (1 checkpoints every layer, 2 "
                          f"every other one). Fix: {key}={{every_n_layers: 2}}, or leave it out", key=key)
    if not isinstance(offload, bool):  # the fix sets the whole mapping: a dotted key into it is no override
        raise ConfigError(f"{key}.offload={offload!r}: must be true or false. Fix: {key}={{offload: true}}", key=key)
    rest.setdefault("use_reentrant", False)  # the trainer's default; transformers' too when no kwargs are given
    return every, offload, rest


def checkpoint_every(trainer: Any) -> int:
    """How the ``trainer`` group (a mapping with ``get``) checkpoints: 0 when activation checkpointing is off,
    else ``every_n_layers`` (1 = every layer; 1 too when the kwargs are invalid, which the rules refuse with their
    own message). Unset (``activation_checkpointing`` and its alias null) is on, as `AsyncGRPOConfig` resolves it
    (SPEC §16.4)."""
    on = trainer.get("activation_checkpointing")
    if on is None:
        on = trainer.get("gradient_checkpointing")
    if on is False:
        return 0
    try:
        return checkpointing_options(trainer.get("activation_checkpointing_kwargs")
                                     or trainer.get("gradient_checkpointing_kwargs"))[0]
    except ConfigError:
        return 1
