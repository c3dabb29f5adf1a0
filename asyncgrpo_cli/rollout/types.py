"""Data types that cross the rollout boundary (SPEC §16.6–16.8, Appendix B.24).

`TurnRecord` is one sampling request (defined in `asyncgrpo_cli.sampler.turn_record`, shared with the sampler
boundary, re-exported here), `Rollout` one finished conversation, `RolloutGroup` the
`num_generations` rollouts of one prompt, and `TrainingSequence` one sample: the unit the trainer's
batcher packs into rows. All are plain dataclasses of Python lists so they pickle cheaply through the
cross-process rollout queue.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sampler.turn_record import TurnRecord

__all__ = ["PromptOutcome", "Rollout", "RolloutGroup", "TrainingSequence", "TurnRecord"]


_ID_PREFIX: tuple[int, str] | None = None  # (pid, a random prefix drawn once in that process)
_ID_COUNTER = itertools.count()


def _new_rollout_id() -> str:
    """A unique rollout id: 20 random hex digits drawn once per process, then a counter (a fresh ``uuid4`` per
    rollout read the OS entropy source each time: 8% of the worker's time at 12-token completions, issue #41)."""
    global _ID_PREFIX
    if _ID_PREFIX is None or _ID_PREFIX[0] != os.getpid():  # a forked child draws its own prefix
        _ID_PREFIX = (os.getpid(), uuid.uuid4().hex[:20])
    return f"{_ID_PREFIX[1]}{next(_ID_COUNTER):012x}"


@dataclass
class Rollout:
    """One finished rollout, as returned by ``AsyncRolloutLoop.generate_one`` (SPEC §16.6)."""

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=_new_rollout_id)
    loop_exhausted: bool = False
    """True when the rollout was cut off at ``max_tool_calling_iterations`` while still calling tools
    (``tools/loop_exhausted_frac``, SPEC §15.4). An extension of SPEC §16.6's fields."""


@dataclass
class TrainingSequence:
    """One training sample (SPEC Appendix B.24): what the batcher packs into rows.

    Attributes:
        input_ids: all token ids of the sample, context and generated, length ``T``.
        trained_mask: length ``T``; 1 where the token is trained (its log-prob enters the loss).
            The first token is never trained (nothing predicts it).
        sampler_logprobs: length ``T``; the sampler log-prob of each trained token, 0.0 elsewhere.
        sampler_top_ids / sampler_top_logprobs: length ``T`` lists; for trained tokens the ids and
            log-probs of the sampler's top-``num_sampler_logprobs`` tokens, ``[]`` elsewhere.
        sampling_mask: length ``T`` or ``None``; for trained tokens the candidate set the token was
            drawn from (``None`` entries or a ``None`` list mean the full vocabulary).
        advantage: the rollout's advantage (SPEC §3.2), the same for every token.
        group_id, row_index, model_version, rollout_id: provenance, for staleness and debugging.
        queued_at: ``time.monotonic()`` when the sample entered the rollout queue (seconds).
        reward: the rollout's total reward (the sum over reward functions, SPEC §10), set when its group is
            kept; the trainer logs the mean over the samples a step trained as ``reward_trained``.
    """

    input_ids: list[int]
    trained_mask: list[int]
    sampler_logprobs: list[float]
    advantage: float
    group_id: int
    row_index: int
    model_version: int
    rollout_id: str = ""
    sampler_top_ids: list[list[int]] | None = None
    sampler_top_logprobs: list[list[float]] | None = None
    sampling_mask: list[list[int] | None] | None = None
    queued_at: float = 0.0
    reward: float | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.trained_mask) != n or len(self.sampler_logprobs) != n:
            raise ValueError(
                f"TrainingSequence: input_ids has {n} tokens but trained_mask has "
                f"{len(self.trained_mask)} and sampler_logprobs {len(self.sampler_logprobs)}; "
                "all three must have one entry per token"
            )

    @property
    def num_tokens(self) -> int:
        """Forwarded tokens of this sample alone (before any sharing), in tokens."""
        return len(self.input_ids)

    @property
    def num_trained_tokens(self) -> int:
        """Trained tokens of this sample, in tokens."""
        return int(sum(self.trained_mask))


@dataclass
class RolloutGroup:
    """The ``num_generations`` rollouts of one prompt, scored together (SPEC §16.8)."""

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    failed: list[bool] | None = None
    """Per rollout, True when its environment's ``reset``/``get_reward`` raised: it is unscored and yields no
    sample. An extension of SPEC §16.8's fields; ``None`` = none failed."""


@dataclass
class PromptOutcome:
    """What the worker puts in the rollout queue for one prompt: its kept samples, or none.

    The trainer reads ``position`` to keep the resume position (SPEC §12): the first prompt position not
    yet trained. Dropped groups (zero reward spread) and filtered prompts count as consumed (SPEC §3.2,
    §11), so they travel through the queue too, with no samples.

    Attributes:
        position: global prompt position, ``epoch × len(dataset) + row_index``.
        row_index: the prompt's row in the dataset.
        kind: ``"kept"`` (samples to train), ``"dropped"`` (group dropped), ``"filtered"``, or ``"stale"`` (its
            group was cancelled as too old for ``max_staleness`` more often than ``max_retries``, issue #33).
        samples: the kept group's samples (empty otherwise).
        group_id: the group's id (``None`` for a filtered prompt).
    """

    position: int
    row_index: int
    kind: str
    samples: list[TrainingSequence] = field(default_factory=list)
    group_id: int | None = None
