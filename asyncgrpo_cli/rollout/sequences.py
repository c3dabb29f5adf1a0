"""Reconcile a rollout's turns into training samples (SPEC §13.3, Appendix B.24).

A turn whose prompt starts with the tokens kept so far extends the current sample; any other turn is a
*fork* and starts a new sample that re-renders its history as context. Every generated token is trained
in exactly one sample; tokens a turn marks as context (``output_mask`` 0) and prompt tokens are not trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import Rollout, TrainingSequence


@dataclass
class ReconcileStats:
    """Per-rollout reconciliation figures for ``rollout/fork_frac`` and ``rollout/drift_tokens_*``.

    ``transitions`` counts turn transitions (turns - 1); ``forks`` those that started a new sample;
    ``drift_tokens`` holds, per transition, how many kept tokens the fork re-rendered (0 when no fork).
    """

    transitions: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)


@dataclass
class _Building:
    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    masks: list[list[int] | None] = field(default_factory=list)
    any_mask: bool = False

    def add_turn_output(self, ids: list[int], mask: list[int], logprobs: list[float],
                        tops: list[dict[int, float]] | None, sampling_masks: list[list[int] | None] | None) -> None:
        """One turn's output tokens, every per-token field of length ``len(ids)`` (list by list, not per token)."""
        n = len(ids)
        self.ids.extend(map(int, ids))
        self.trained.extend([int(bool(m)) for m in mask])
        self.logprobs.extend(map(float, logprobs))
        if tops is None:
            self.top_ids.extend([[] for _ in range(n)])
            self.top_logprobs.extend([[] for _ in range(n)])
        else:
            self.top_ids.extend([list(map(int, top)) for top in tops])
            self.top_logprobs.extend([list(map(float, top.values())) for top in tops])
        if sampling_masks is None:
            self.masks.extend([None] * n)
        else:
            self.masks.extend([list(sm) if sm is not None else None for sm in sampling_masks])
            self.any_mask = self.any_mask or any(sm is not None for sm in sampling_masks)

    def add_context(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.trained.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.top_ids.extend([[] for _ in ids])
        self.top_logprobs.extend([[] for _ in ids])
        self.masks.extend([None] * len(ids))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def rollout_to_sequences(rollout: Rollout, *, group_id: int, row_index: int, model_version: int,
                         advantage: float = 0.0) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Training samples of one rollout, and its reconciliation stats.

    Args:
        rollout: the finished rollout; its ``turns`` carry prompt and output token ids, sampler
            log-probs, optional ``output_mask``, top log-probs and sampling masks.
        group_id, row_index, model_version: provenance copied into every sample.
        advantage: the rollout's advantage (set later by the scorer when unknown here).

    Returns:
        The samples (only those with at least one trained token) and the stats.

    Raises:
        ValueError: a turn has ``output_log_probs`` of the wrong length while some of its tokens are trained.
    """
    stats = ReconcileStats()
    done: list[_Building] = []
    cur = _Building()
    for t, turn in enumerate(rollout.turns):
        prompt = list(turn.prompt_ids)
        if t > 0:
            stats.transitions += 1
            if prompt[: len(cur.ids)] == cur.ids:
                stats.drift_tokens.append(0)
                cur.add_context(prompt[len(cur.ids):])
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(cur.ids) - _common_prefix(cur.ids, prompt))
                done.append(cur)
                cur = _Building()
                cur.add_context(prompt)
        else:
            cur.add_context(prompt)
        n = len(turn.output_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        if any(mask) and len(turn.output_log_probs) != n:
            raise ValueError(f"TurnRecord.output_log_probs has {len(turn.output_log_probs)} entries for {n} output "
                             "tokens; the sampler log-prob of every trained token is required")
        tops = turn.output_sampler_logprobs
        sms = turn.output_sampling_mask
        if (len(mask) == n and len(turn.output_log_probs) == n and (tops is None or len(tops) == n)
                and (sms is None or len(sms) == n)):
            cur.add_turn_output(turn.output_ids, mask, turn.output_log_probs, tops, sms)
            continue
        for i, token in enumerate(turn.output_ids):  # short or long per-token fields: token by token
            cur.ids.append(int(token))
            cur.trained.append(int(bool(mask[i])))
            cur.logprobs.append(float(turn.output_log_probs[i]) if i < len(turn.output_log_probs) else 0.0)
            top = tops[i] if tops is not None and i < len(tops) else {}
            cur.top_ids.append([int(k) for k in top])
            cur.top_logprobs.append([float(v) for v in top.values()])
            sm = turn.output_sampling_mask[i] if turn.output_sampling_mask is not None else None
            cur.masks.append(list(sm) if sm is not None else None)
            cur.any_mask = cur.any_mask or sm is not None
    done.append(cur)
    samples = []
    for b in done:
        if not any(b.trained):
            continue
        samples.append(TrainingSequence(
            input_ids=b.ids, trained_mask=b.trained, sampler_logprobs=b.logprobs, advantage=advantage,
            group_id=group_id, row_index=row_index, model_version=model_version, rollout_id=rollout.rollout_id,
            sampler_top_ids=b.top_ids, sampler_top_logprobs=b.top_logprobs,
            sampling_mask=b.masks if b.any_mask else None))
    return samples, stats


def untrained_stub(sample: TrainingSequence) -> TrainingSequence:
    """A cut completion's sample as TRL keeps it with ``mask_truncated_completions``: a row with no trained token.

    Its loss term is zero and its gradient none, but it is one more sequence in the micro-batch: ``grpo`` divides
    by the number of sequences and ``dr_grpo`` by sequences × ``max_completion_length``, cut ones included
    (README "Loss variants"). Only the context before the first trained token is kept (at least one token): the
    generated tokens would be forwarded for nothing, and the context is a prefix of the group's other samples, so
    tree packing shares it (no extra forwarded token when a group mate is in the same row).

    Args:
        sample: the cut completion's sample (advantage and provenance are kept).

    Returns:
        A new `TrainingSequence` with ``num_trained_tokens == 0`` and ``1 <= num_tokens <= sample.num_tokens``.
    """
    first = sample.trained_mask.index(1) if any(sample.trained_mask) else len(sample.input_ids)
    n = max(1, first)
    return TrainingSequence(
        input_ids=list(sample.input_ids[:n]), trained_mask=[0] * n, sampler_logprobs=[0.0] * n,
        advantage=sample.advantage, group_id=sample.group_id, row_index=sample.row_index,
        model_version=sample.model_version, rollout_id=sample.rollout_id, queued_at=sample.queued_at)
