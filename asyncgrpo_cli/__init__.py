"""asyncgrpo: asynchronous GRPO post-training of language models.

Public API (imported lazily so the CLI starts fast)::

    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop, Rollout, TurnRecord, RolloutGroup
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncGRPOConfig": "asyncgrpo_cli.config.grpo_config",
    "AsyncGRPOTrainer": "asyncgrpo_cli.train.trainer",
    "AsyncRolloutLoop": "asyncgrpo_cli.rollout.loop",
    "Rollout": "asyncgrpo_cli.rollout.types",
    "TurnRecord": "asyncgrpo_cli.sampler.turn_record",
    "RolloutGroup": "asyncgrpo_cli.rollout.types",
    "TrainingSequence": "asyncgrpo_cli.rollout.types",
    "SamplerClient": "asyncgrpo_cli.sampler.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncgrpo_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
