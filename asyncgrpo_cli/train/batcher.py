"""The token-budget batcher (SPEC §6.3, §6.4) and the step's batch metrics (SPEC §15.7).

Plans micro-batches of ``num_processes`` rows, each within ``token_budget`` forwarded tokens after tree
packing, counting shared tokens incrementally (`asyncgrpo_cli.train.packing`'s row counter) so planning a
step of hundreds of samples takes milliseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from asyncgrpo_cli.rollout.stale_schedule import record_stale_verdict  # noqa: F401 - the trainer's, with the plan
from asyncgrpo_cli.rollout.types import TrainingSequence

from .packing import PackedRow, RowStats, _key, _RowCounter, _span_cost

logger = logging.getLogger("asyncgrpo_cli.train.packing")


# --------------------------------------------------------------------------------------------------
# Token-budget batcher (SPEC §6.3)
# --------------------------------------------------------------------------------------------------


@dataclass
class MicroBatchPlan:
    """One planned micro-batch: exactly ``num_processes`` rows, some possibly empty.

    Attributes:
        rows: per process, the samples placed in its row (in placement order).
        row_sample_indices: the same samples as indices in the order they were given to the batcher.
        row_tokens: forwarded (unique) tokens per row, ``<= token_budget``.
        row_costs: attention cost per row (module docstring).
        row_sample_tokens: sum of the samples' own tokens per row (before sharing).
    """

    rows: list[list[TrainingSequence]]
    row_sample_indices: list[list[int]]
    row_tokens: list[int]
    row_costs: list[int]
    row_sample_tokens: list[int]

    @property
    def num_samples(self) -> int:
        """Samples in the micro-batch."""
        return sum(len(r) for r in self.rows)


class _OpenMicroBatch:
    def __init__(self, num_processes: int) -> None:
        self.counters = [_RowCounter() for _ in range(num_processes)]
        self.rows: list[list[TrainingSequence]] = [[] for _ in range(num_processes)]
        self.indices: list[list[int]] = [[] for _ in range(num_processes)]
        self.group_rows: dict[int, list[int]] = {}
        self.num_samples = 0

    def place(self, r: int, sample: TrainingSequence, index: int, key: bytes, delta: tuple[int, int]) -> None:
        self.counters[r].add(key, delta)
        self.rows[r].append(sample)
        self.indices[r].append(index)
        rows_of_group = self.group_rows.setdefault(sample.group_id, [])
        if r not in rows_of_group:
            rows_of_group.append(r)
        self.num_samples += 1

    def close(self) -> MicroBatchPlan:
        return MicroBatchPlan(
            rows=self.rows,
            row_sample_indices=self.indices,
            row_tokens=[c.tokens for c in self.counters],
            row_costs=[c.cost for c in self.counters],
            row_sample_tokens=[c.sample_tokens for c in self.counters],
        )


class TokenBudgetBatcher:
    """Plans micro-batches of ``num_processes`` rows, each within ``token_budget`` forwarded tokens
    (SPEC §6.3, §6.4, Appendix B.12). Pure Python and incremental: feed samples with :meth:`add` as they
    leave the rollout queue, or plan a whole list with :meth:`plan`.

    Placement of a sample (row load = attention cost, module docstring):

    1. Into a row of the open micro-batch that already holds its group, if it fits the budget there
       (counting only the tokens it does not share).
    2. Its group's rows are full: into another row that fits it, if some row is still empty, or if the
       row's load after adding it does not exceed the current most loaded row; the least loaded such
       row wins.
    3. Its group is new to the micro-batch: into the row, among those it fits, with the lowest load after
       adding it (empty rows first, naturally; a row already holding a common prefix costs less).
    4. Otherwise the micro-batch is closed and the sample opens the next one.

    With ``max_groups``, a sample of a group new to the open micro-batch also closes it once it holds
    ``max_groups`` groups (issue #41: late in a run completions shrink and identical ones merge, so a token-bounded
    micro-batch grows to hundreds of groups and its step waits for thousands of rollouts).

    A sample with more tokens than ``token_budget`` fits in no row: it is dropped with a warning and
    counted in :attr:`dropped_oversize_count` (``batch/dropped_oversize_count``); :attr:`oversize_streak` counts
    those dropped since the last sample placed (the trainer stops on a long streak, `OVERSIZE_STREAK_LIMIT`).

    Args:
        token_budget: maximum forwarded (unique) tokens per row, >= 1.
        num_processes: rows per micro-batch (data-parallel processes), >= 1.
        max_groups: most groups per micro-batch (all rows together), >= 1; None = only ``token_budget`` bounds it.

    Raises:
        ValueError: ``token_budget``, ``num_processes`` or ``max_groups`` is not a positive int.
    """

    def __init__(self, token_budget: int, num_processes: int, max_groups: int | None = None) -> None:
        for name, value in (("token_budget", token_budget), ("num_processes", num_processes),
                            ("max_groups", 1 if max_groups is None else max_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.token_budget = token_budget
        self.num_processes = num_processes
        self.max_groups = max_groups
        self.dropped_oversize_count = 0
        self.oversize_streak = 0  # samples dropped as oversize since the last one placed
        self.dropped: list[TrainingSequence] = []
        self._next_index = 0
        self._open = _OpenMicroBatch(num_processes)

    @property
    def pending_samples(self) -> int:
        """Samples placed in the open (not yet closed) micro-batch."""
        return self._open.num_samples

    def add(self, sample: TrainingSequence) -> MicroBatchPlan | None:
        """Place one sample. Returns the micro-batch it closed (the sample then opens the next one), or
        ``None``. Oversize samples are dropped (returns ``None``)."""
        index = self._next_index
        n = len(sample.input_ids)
        if n == 0:
            raise ValueError(
                f"sample {index} (rollout {sample.rollout_id!r}) has empty input_ids; every sample needs tokens"
            )
        self._next_index += 1
        if n > self.token_budget:
            self.dropped_oversize_count += 1
            self.oversize_streak += 1
            self.dropped.append(sample)
            logger.warning(
                "dropping sample %s of group %s: %d tokens exceed token_budget=%d (raise token_budget to "
                "train on it)", sample.rollout_id or index, sample.group_id, n, self.token_budget,
            )
            return None
        self.oversize_streak = 0
        key = _key(sample.input_ids)
        full = (self.max_groups is not None and sample.group_id not in self._open.group_rows
                and len(self._open.group_rows) >= self.max_groups)
        r, delta = (None, (0, 0)) if full else self._choose(self._open, sample.group_id, key)
        if r is not None:
            self._open.place(r, sample, index, key, delta)
            return None
        closed = self._open.close()
        self._open = _OpenMicroBatch(self.num_processes)
        self._open.place(0, sample, index, key, (n, _span_cost(0, n)))
        return closed

    def pending(self) -> list[TrainingSequence]:
        """The samples of the open micro-batch, row by row (not removed)."""
        return [s for row in self._open.rows for s in row]

    def take_pending(self) -> list[TrainingSequence]:
        """Remove and return the samples of the open micro-batch, row by row (the batcher is then empty)."""
        samples = self.pending()
        self._open = _OpenMicroBatch(self.num_processes)
        return samples

    def flush(self) -> MicroBatchPlan | None:
        """Close the open micro-batch and return it, or ``None`` if it holds no sample."""
        if self._open.num_samples == 0:
            return None
        closed = self._open.close()
        self._open = _OpenMicroBatch(self.num_processes)
        return closed

    def plan(self, samples: Iterable[TrainingSequence]) -> list[MicroBatchPlan]:
        """Add every sample, then flush: all micro-batches that hold the samples, in order."""
        out = []
        for s in samples:
            closed = self.add(s)
            if closed is not None:
                out.append(closed)
        last = self.flush()
        if last is not None:
            out.append(last)
        return out

    def _choose(self, mb: _OpenMicroBatch, group_id: int, key: bytes) -> tuple[int | None, tuple[int, int]]:
        budget = self.token_budget
        counters = mb.counters
        group_rows = mb.group_rows.get(group_id, [])
        for r in group_rows:  # rule 1
            d = counters[r].delta(key)
            if counters[r].tokens + d[0] <= budget:
                return r, d
        max_load = max(c.cost for c in counters)
        has_empty = any(c.tokens == 0 for c in counters)
        best: tuple[int, int] | None = None
        best_delta = (0, 0)
        for r, c in enumerate(counters):
            if r in group_rows:
                continue
            d = c.delta(key)
            if c.tokens + d[0] > budget:
                continue
            load = c.cost + d[1]
            if group_rows and not (has_empty or load <= max_load):  # rule 2
                continue
            if best is None or load < best[0]:
                best, best_delta = (load, r), d
        if best is None:
            return None, (0, 0)
        return best[1], best_delta


# --------------------------------------------------------------------------------------------------
# Deadline-ordered last micro-batch (issue #28)
# --------------------------------------------------------------------------------------------------


def plan_edge_first(plans: list[MicroBatchPlan], batcher: TokenBudgetBatcher, version: int,
                    max_staleness: int) -> list[MicroBatchPlan]:
    """Re-plan ``plans[-1]`` (the step's last micro-batch) with ``batcher``'s open micro-batch, edge samples first.

    The batcher fills micro-batches in pull order: the sample that does not fit the step's last micro-batch
    opens the next one and trains one model version later. A sample pulled exactly ``max_staleness`` versions
    behind is then dropped at the next step (SPEC §3.1, B.6), and long samples are the ones that do not fit a
    nearly full row: a length bias (issue #28, `scripts/bench/bench_staleness_bias.py`). When a carried sample
    would be stale at ``version + 1``, the last micro-batch and the carried samples are planned again, oldest
    model version first: the edge samples train now, fresher ones are carried instead. Rows keep at most
    ``token_budget`` forwarded tokens; the trainer's drop rule still checks every trained sample.

    Args:
        plans: the micro-batches of the step about to train at model ``version``; the last one may be replaced
            (in place). An empty list is left as it is.
        batcher: the trainer's batcher; its open micro-batch holds the samples carried to the next step
            (trained at ``version + 1``). Changed in place: it keeps the samples carried after re-planning.
        version: the model version the step trains (carried samples train at ``version + 1``).
        max_staleness: the drop rule's limit in versions (>= 0).

    Returns:
        Rarely, whole micro-batches the carried samples fill on their own (the caller trains them with the next
        step); usually ``[]``. Nothing changes when no carried sample would be stale at ``version + 1``.
    """
    if not plans or not any(version + 1 - s.model_version > max_staleness for s in batcher.pending()):
        return []
    last = plans[-1]
    samples: list[TrainingSequence] = [s for row in last.rows for s in row] + batcher.take_pending()
    samples.sort(key=lambda s: (s.model_version, s.group_id))  # stable: a group's samples stay in order
    fresh = TokenBudgetBatcher(batcher.token_budget, batcher.num_processes, batcher.max_groups)
    new_last, rest = None, []
    for s in samples:
        if new_last is not None:
            rest.append(s)
            continue
        closed = fresh.add(s)
        if closed is not None:
            new_last = closed
            rest = fresh.take_pending()
    plans[-1] = new_last if new_last is not None else (fresh.flush() or last)  # None: all of it fits one
    return [p for p in (batcher.add(s) for s in rest) if p is not None]


# --------------------------------------------------------------------------------------------------
# Batch metrics (SPEC §15.7)
# --------------------------------------------------------------------------------------------------


OVERSIZE_STREAK_LIMIT = 256
"""Samples dropped as oversize in a row, none placed, after which the trainer stops: no step can ever fill."""


def oversize_stop_message(budget: int, last_tokens: int, streak: int, key: str = "packing.token_budget") -> str:
    """The error when `OVERSIZE_STREAK_LIMIT` samples in a row exceeded the token budget (no step can fill)."""
    return (f"{key}={budget}: the last {streak} samples were all longer than the token budget (the last one "
            f"{last_tokens} tokens) and were dropped, so no training step can fill. Fix: raise {key} to at least "
            f"{last_tokens}, or null for sampler.max_model_len")


def batch_metrics(
    micro_batches: Sequence[Sequence[PackedRow | RowStats]],
    *,
    token_budget: int,
    dropped_oversize_count: int = 0,
) -> dict[str, float]:
    """Every ``batch/*`` metric of SPEC §15.7 for one optimizer step.

    Args:
        micro_batches: the step's micro-batches, each a sequence of its rows (one per process, empty rows
            included) as :class:`PackedRow` or :class:`RowStats`.
        token_budget: the token budget in tokens (for ``batch/row_fill_frac``), >= 1.
        dropped_oversize_count: samples the batcher dropped as oversize during this step.

    Returns:
        ``batch/forwarded_tokens_per_step``, ``batch/trained_tokens_per_step`` (sums over all rows),
        ``batch/samples_per_step``, ``batch/groups_per_step`` (distinct group ids),
        ``batch/microbatches_per_step``, ``batch/masked_token_frac`` (1 − distinct trained positions /
        forwarded tokens), ``batch/samples_per_row``, ``batch/row_tokens_mean``, ``batch/row_tokens_max``
        (over all rows, empty ones included), ``batch/row_fill_frac`` (mean row tokens / token_budget),
        ``batch/row_imbalance`` (per micro-batch max row cost / mean row cost, averaged over micro-batches
        with any cost; 1.0 if none), ``batch/packing_ratio`` (Appendix B.13), ``batch/pad_frac`` (padding to
        the longest row of each micro-batch / all tokens after padding), ``batch/dropped_oversize_count``.

    Raises:
        ValueError: ``token_budget`` is not a positive int.
    """
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    forwarded = trained = trained_pos = samples = sample_tokens = 0
    groups: set[int] = set()
    row_tokens: list[int] = []
    imbalances: list[float] = []
    padded_total = pad = 0
    for mb in micro_batches:
        stats = [r.stats() if isinstance(r, PackedRow) else r for r in mb]
        if not stats:
            continue
        costs = [s.attention_cost for s in stats]
        if sum(costs) > 0:
            imbalances.append(max(costs) / (sum(costs) / len(costs)))
        longest = max(s.num_tokens for s in stats)
        padded_total += longest * len(stats)
        for s in stats:
            forwarded += s.num_tokens
            trained += s.num_trained_tokens
            trained_pos += s.num_trained_positions
            samples += s.num_samples
            sample_tokens += s.sample_tokens
            groups.update(s.group_ids)
            row_tokens.append(s.num_tokens)
            pad += longest - s.num_tokens
    n_rows = len(row_tokens)
    mean_tokens = sum(row_tokens) / n_rows if n_rows else 0.0
    return {
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(trained),
        "batch/samples_per_step": float(samples),
        "batch/groups_per_step": float(len(groups)),
        "batch/microbatches_per_step": float(len(micro_batches)),
        "batch/masked_token_frac": 1.0 - trained_pos / forwarded if forwarded else 0.0,
        "batch/samples_per_row": samples / n_rows if n_rows else 0.0,
        "batch/row_tokens_mean": float(mean_tokens),
        "batch/row_tokens_max": float(max(row_tokens, default=0)),
        "batch/row_fill_frac": mean_tokens / token_budget,
        "batch/row_imbalance": sum(imbalances) / len(imbalances) if imbalances else 1.0,
        "batch/packing_ratio": sample_tokens / forwarded if forwarded else 1.0,
        "batch/pad_frac": pad / padded_total if padded_total else 0.0,
        "batch/dropped_oversize_count": float(dropped_oversize_count),
    }
