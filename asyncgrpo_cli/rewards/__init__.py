"""Built-in reward functions (SPEC §1.2, §10): ``accuracy_reward`` (math-verify), ``format_reward``
(think/answer layout) and ``length_reward`` (over-length penalty).

All are module-level functions, so they (and ``functools.partial`` objects of them) pickle into the
spawned rollout worker.
"""

from asyncgrpo_cli.rewards.accuracy import (
    accuracy_reward,
    shutdown_verification_pool,
    verification_timeouts,
    warm_up_verification_pool,
)
from asyncgrpo_cli.rewards.format import format_reward, length_reward

__all__ = [
    "accuracy_reward",
    "format_reward",
    "length_reward",
    "shutdown_verification_pool",
    "verification_timeouts",
    "warm_up_verification_pool",
]
