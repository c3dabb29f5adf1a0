"""The staleness token allowance (SPEC §4.1, Appendix B.3, B.4, B.6).

Generation may run at most ``max(max_staleness, 1) × weight_sync_steps`` optimizer steps ahead of
training. The limit is counted in **sample tokens**: the sum of each sample's own forwarded tokens,
before any sharing by tree packing (B.4).

Two halves live here:

- the trainer side, two pure formulas: :func:`initial_allowance` (before the first optimizer step, every
  row assumed full, B.3) and :func:`allowance_after_step` (after every step, B.4/B.6). The trainer
  publishes the result through the shared ``token_allowance`` value;
- the worker side, :class:`TokenAllowance`: a state machine fed with events from the rollout loop
  that says whether a new group of rollouts may start under the published allowance. How it counts a
  rollout still in flight is ``staleness.in_flight_estimate`` (`IN_FLIGHT_ESTIMATES`): ``"mean"`` (B.4,
  the default) or ``"kept"`` (an opt-in departure from B.4, see :class:`TokenAllowance`).

Nothing here does I/O or reads a clock; the rollout loop times its own waits
(``rollout/backpressure_s``).
"""

from __future__ import annotations

import math

__all__ = [
    "IN_FLIGHT_ESTIMATES",
    "KEPT_FLOOR_FRACTION",
    "KEPT_MIN_DECIDED_ROLLOUTS",
    "TokenAllowance",
    "allowance_after_step",
    "allowance_steps",
    "initial_allowance",
]


#: Values of ``staleness.in_flight_estimate`` (the config's check, `config.rules`, holds the same tuple).
IN_FLIGHT_ESTIMATES = ("mean", "kept")

#: ``"kept"`` never counts an in-flight rollout below this fraction of the plain mean (see `TokenAllowance`).
KEPT_FLOOR_FRACTION = 0.1

#: ``"kept"`` is the plain mean until the groups kept or dropped so far hold this many rollouts (see `TokenAllowance`):
#: one group's verdict is no keep rate (the one-GPU job's first group was dropped, the estimate fell to its floor
#: and 936 rollouts went in flight at once; ``"mean"`` averaged 159 over the same job's first step).
KEPT_MIN_DECIDED_ROLLOUTS = 64


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _require_tokens(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of tokens, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of tokens >= 0, got {value}")
    return float(value)


def allowance_steps(max_staleness: int, weight_sync_steps: int) -> int:
    """How many optimizer steps generation may run ahead of training (SPEC Appendix B.6).

    Returns ``max(max_staleness, 1) × weight_sync_steps`` (steps). ``max_staleness`` counts weight
    updates, and one weight update happens every ``weight_sync_steps`` optimizer steps.

    Raises:
        ValueError: ``max_staleness < 0`` or ``weight_sync_steps < 1``.
    """
    _require_int("max_staleness", max_staleness, 0)
    _require_int("weight_sync_steps", weight_sync_steps, 1)
    return max(max_staleness, 1) * weight_sync_steps


def initial_allowance(
    max_staleness: int,
    weight_sync_steps: int,
    token_budget: int,
    gradient_accumulation_steps: int,
    num_processes: int,
) -> int:
    """Token allowance published before the first optimizer step (SPEC §4.1, Appendix B.3).

    Every row is assumed full, so one step is estimated at
    ``token_budget × gradient_accumulation_steps × num_processes`` sample tokens, and the allowance is
    ``max(max_staleness, 1) × weight_sync_steps`` such steps.

    Args:
        max_staleness: weight updates generation may lag behind (>= 0).
        weight_sync_steps: optimizer steps per weight update (>= 1).
        token_budget: forwarded tokens per row (>= 1).
        gradient_accumulation_steps: micro-batches per step (>= 1).
        num_processes: training processes (>= 1).

    Returns:
        The allowance in sample tokens.

    Raises:
        TypeError / ValueError: an argument is not an int or is below its minimum (named in the message).
    """
    _require_int("token_budget", token_budget, 1)
    _require_int("gradient_accumulation_steps", gradient_accumulation_steps, 1)
    _require_int("num_processes", num_processes, 1)
    steps = allowance_steps(max_staleness, weight_sync_steps)
    return steps * token_budget * gradient_accumulation_steps * num_processes


def allowance_after_step(
    max_staleness: int, weight_sync_steps: int, tokens_consumed_by_last_step: int
) -> int:
    """Token allowance published after an optimizer step (SPEC §4.1, Appendix B.4, B.6).

    ``max(max_staleness, 1) × weight_sync_steps × tokens_consumed_by_last_step``, where the tokens a
    step consumed are the sample tokens (each sample's own forwarded tokens, before sharing) of the
    samples trained in that step.

    Raises:
        TypeError / ValueError: a bad ``max_staleness``/``weight_sync_steps``, or a negative or
            non-integer ``tokens_consumed_by_last_step``.
    """
    _require_int("tokens_consumed_by_last_step", tokens_consumed_by_last_step, 0)
    return allowance_steps(max_staleness, weight_sync_steps) * tokens_consumed_by_last_step


class TokenAllowance:
    """Worker-side bookkeeping of the tokens committed against the allowance (SPEC §4.1, B.4).

    Tokens committed = tokens of queued samples + real sample tokens of finished rollouts whose group
    is not yet queued or discarded + an estimate for every rollout still in flight
    (:attr:`in_flight_tokens_per_rollout` each). Before the first group has finished, the worker runs
    **one group at a time** (either estimate).

    The estimate for a rollout in flight, ``in_flight_estimate``:

    - ``"mean"`` (the default, SPEC Appendix B.4): the running mean of sample tokens per finished rollout
      (:attr:`tokens_per_rollout`).
    - ``"kept"`` (opt-in; departs from B.4): the running mean of sample tokens that finished rollouts put
      into the rollout queue, ``queued tokens total / rollouts of decided groups`` (:attr:`kept_tokens_per_rollout`;
      a group is decided when it is queued or discarded, and the rollouts of a discarded group count zero). It
      is what a rollout in flight is expected to add to the queue: a group dropped for zero reward std never
      reaches it, so a run that discards most of its groups keeps proportionally more rollouts in flight for the
      same allowance. Like the B.4 mean it is cumulative over the run, so it follows a changing keep rate
      slowly. It is clamped to ``[kept_floor × mean, mean]``:

      * until the decided groups hold ``kept_min_decided`` rollouts (default `KEPT_MIN_DECIDED_ROLLOUTS` = 64,
        8 groups of 8) it is the plain mean: start-up is unchanged, and one group's verdict is not a keep rate;
      * **floor**: never below ``kept_floor`` (default `KEPT_FLOOR_FRACTION` = 0.1) × the plain mean, so a run
        whose every group so far was discarded (estimate 0) still counts each rollout in flight, and at most
        ``1 / kept_floor`` = 10× the rollouts ``"mean"`` would admit are in flight (the concurrency cap and
        ``max_concurrent_rollouts`` bound them too);
      * never above the plain mean, so ``"kept"`` never admits fewer rollouts than ``"mean"``.

    Neither estimate changes the hard staleness bound: the trainer checks every sample when it pulls it and
    drops one more than ``max_staleness`` weight updates behind the policy it would train
    (``train/step_pull.py`` ``_drop_if_stale``; ``sample/dropped_stale_count``,
    ``sample/dropped_stale_token_frac``), and the worker's `StaleSchedule` re-queues groups that come back stale
    and `stale_loop` cancels groups that can no longer be trained. What ``"kept"`` risks is generation wasted on
    such samples, not staler training.

    Lifecycle events, in the order the rollout loop sees them::

        on_group_started(num_rollouts)        # num_rollouts rollouts go in flight
        on_rollout_finished(sample_tokens)    # x num_rollouts: in flight -> finished (real tokens)
        on_group_finished()                   # the whole group is back (scoring may begin)
        on_samples_queued(tokens, rollouts=G)     # kept group: finished -> queued
          or on_samples_discarded(tokens, rollouts=G)  # dropped group (zero std...): finished -> released
        on_samples_consumed(tokens)           # the trainer pulled them (trained or dropped stale)

    ``rollouts`` is how many rollouts the event decides (the group's, once per group; 0 for an event that only
    releases part of a group that another event decides, e.g. the untrained completions of a kept group).

    ``on_rollout_cancelled()`` takes a rollout out of flight without tokens (e.g. at shutdown);
    ``on_group_cancelled(num_rollouts)`` a whole group none of whose rollouts was reported.

    All token counts are sample tokens (ints or floats >= 0). Counters never go below zero: an event
    that would do so raises ``ValueError`` naming the event and the amounts, except
    :meth:`on_samples_consumed`, which clamps at zero because consumption is reported by another
    process and may race with the worker's own bookkeeping.

    Args:
        in_flight_estimate: ``"mean"`` or ``"kept"`` (`IN_FLIGHT_ESTIMATES`).
        kept_floor: the floor of ``"kept"`` as a fraction of the plain mean, in (0, 1].
        kept_min_decided: rollouts of decided groups before ``"kept"`` departs from the plain mean (>= 1).

    Raises:
        ValueError: an unknown ``in_flight_estimate``, a ``kept_floor`` outside (0, 1] or a ``kept_min_decided``
            below 1.
    """

    def __init__(self, in_flight_estimate: str = "mean", kept_floor: float = KEPT_FLOOR_FRACTION,
                 kept_min_decided: int = KEPT_MIN_DECIDED_ROLLOUTS) -> None:
        if in_flight_estimate not in IN_FLIGHT_ESTIMATES:
            raise ValueError(f"in_flight_estimate={in_flight_estimate!r}: must be one of "
                             f"{', '.join(IN_FLIGHT_ESTIMATES)}")
        floor = _require_tokens("kept_floor", kept_floor)
        if not 0 < floor <= 1:
            raise ValueError(f"kept_floor={kept_floor!r}: must lie in (0, 1] (a fraction of the mean)")
        self.in_flight_estimate = in_flight_estimate
        self.kept_floor = floor
        self.kept_min_decided = _require_int("kept_min_decided", kept_min_decided, 1)
        self._groups_in_flight = 0
        self._rollouts_in_flight = 0
        self._finished_tokens = 0.0
        self._queued_tokens = 0.0
        self._finished_rollouts_total = 0
        self._finished_sample_tokens_total = 0.0
        self._queued_tokens_total = 0.0
        self._decided_rollouts_total = 0
        self._first_group_finished = False
        self._consumed_total_seen = 0.0

    # ------------------------------------------------------------------ state
    @property
    def groups_in_flight(self) -> int:
        """Groups started whose rollouts have not all come back."""
        return self._groups_in_flight

    @property
    def rollouts_in_flight(self) -> int:
        """Rollouts started and not yet finished or cancelled."""
        return self._rollouts_in_flight

    @property
    def first_group_finished(self) -> bool:
        """Whether a whole group has come back at least once (ends the one-group-at-a-time phase)."""
        return self._first_group_finished

    @property
    def finished_tokens(self) -> float:
        """Sample tokens of finished rollouts not yet queued or discarded."""
        return self._finished_tokens

    @property
    def queued_tokens(self) -> float:
        """Sample tokens put in the rollout queue and not yet reported consumed."""
        return self._queued_tokens

    @property
    def consumed_total_seen(self) -> float:
        """The trainer's pulled-token counter as last applied by :meth:`sync_consumed_total` (0.0 before)."""
        return self._consumed_total_seen

    @property
    def finished_rollouts_total(self) -> int:
        """Rollouts finished since the start (never decreases)."""
        return self._finished_rollouts_total

    @property
    def tokens_per_rollout(self) -> float | None:
        """Running mean of sample tokens per finished rollout; ``None`` before any rollout finished."""
        if self._finished_rollouts_total == 0:
            return None
        return self._finished_sample_tokens_total / self._finished_rollouts_total

    @property
    def decided_rollouts_total(self) -> int:
        """Rollouts of the groups queued or discarded so far (the ``rollouts`` those events reported)."""
        return self._decided_rollouts_total

    @property
    def queued_tokens_total(self) -> float:
        """Sample tokens put in the rollout queue so far (never decreases; consumption does not change it)."""
        return self._queued_tokens_total

    @property
    def kept_tokens_per_rollout(self) -> float | None:
        """Running mean of sample tokens queued per rollout of a decided group (discarded ones count 0);
        ``None`` before any group was decided."""
        if self._decided_rollouts_total == 0:
            return None
        return self._queued_tokens_total / self._decided_rollouts_total

    @property
    def in_flight_tokens_per_rollout(self) -> float | None:
        """Sample tokens one rollout in flight counts for; ``None`` before any rollout finished.

        ``"mean"``: :attr:`tokens_per_rollout`. ``"kept"``: :attr:`kept_tokens_per_rollout` clamped to
        ``[kept_floor × mean, mean]``, the plain mean until the decided groups hold ``kept_min_decided``
        rollouts (class docstring).
        """
        if self.in_flight_estimate == "mean":
            return self.tokens_per_rollout
        return self.expected_kept_tokens_per_rollout

    @property
    def expected_kept_tokens_per_rollout(self) -> float | None:
        """Sample tokens one rollout in flight is expected to put in the rollout queue, whatever
        ``in_flight_estimate`` is: :attr:`kept_tokens_per_rollout` clamped to ``[kept_floor × mean, mean]``, the
        plain mean until the decided groups hold ``kept_min_decided`` rollouts (class docstring); ``None`` before
        any rollout finished. ``"kept"`` counts rollouts in flight against the allowance at this figure; deadline
        admission (`StaleSchedule.can_admit`) always does, since it compares with tokens the trainer pulls."""
        mean = self.tokens_per_rollout
        kept = self.kept_tokens_per_rollout
        if mean is None or kept is None or self._decided_rollouts_total < self.kept_min_decided:
            return mean
        return min(mean, max(kept, self.kept_floor * mean))

    @property
    def in_flight_tokens(self) -> float:
        """Estimated sample tokens of the rollouts in flight (0.0 while no rollout has finished)."""
        per_rollout = self.in_flight_tokens_per_rollout
        return 0.0 if per_rollout is None else self._rollouts_in_flight * per_rollout

    @property
    def committed_tokens(self) -> float:
        """Queued + finished + estimated in-flight sample tokens: what counts against the allowance."""
        return self._queued_tokens + self._finished_tokens + self.in_flight_tokens

    @property
    def expected_queue_tokens(self) -> float:
        """Queued + finished + in-flight rollouts × :attr:`expected_kept_tokens_per_rollout`: the sample tokens the
        trainer is expected to pull from what is committed now (a finished rollout of a group not yet decided
        counts in full). What deadline admission counts (`StaleSchedule.can_admit`); equal to
        :attr:`committed_tokens` with ``in_flight_estimate="kept"``."""
        per_rollout = self.expected_kept_tokens_per_rollout
        in_flight = 0.0 if per_rollout is None else self._rollouts_in_flight * per_rollout
        return self._queued_tokens + self._finished_tokens + in_flight

    # ------------------------------------------------------------------ decision
    def can_start_group(self, allowance: float) -> bool:
        """Whether a new group of rollouts may start under ``allowance`` (SPEC §4.1, B.4).

        Args:
            allowance: the latest value the trainer published, in sample tokens (>= 0).

        Returns:
            Before the first group has finished: ``True`` only when no group is in flight (one group
            at a time). Afterwards: ``True`` while the committed tokens are strictly under
            ``allowance``. In both phases a group may always start when nothing at all is committed
            (no rollout in flight, nothing finished or queued), so a zero or not-yet-published
            allowance cannot stall training and generation forever.

        Raises:
            TypeError / ValueError: ``allowance`` is not a finite number >= 0.
        """
        allowance = _require_tokens("allowance", allowance)
        idle = (
            self._rollouts_in_flight == 0
            and self._groups_in_flight == 0
            and self._finished_tokens == 0
            and self._queued_tokens == 0
        )
        if idle:
            return True
        if not self._first_group_finished:
            return self._groups_in_flight == 0
        return self.committed_tokens < allowance

    # ------------------------------------------------------------------ events
    def on_group_started(self, num_rollouts: int) -> None:
        """A group of ``num_rollouts`` rollouts (normally ``num_generations``) goes in flight.

        Raises:
            ValueError: ``num_rollouts < 1``.
        """
        _require_int("num_rollouts", num_rollouts, 1)
        self._groups_in_flight += 1
        self._rollouts_in_flight += num_rollouts

    def on_rollout_finished(self, sample_tokens: float) -> None:
        """One rollout came back with ``sample_tokens`` sample tokens (sum over its samples).

        It leaves flight, its real tokens count as finished, and it updates the running mean.

        Raises:
            ValueError: no rollout is in flight, or ``sample_tokens`` is negative.
        """
        tokens = _require_tokens("sample_tokens", sample_tokens)
        if self._rollouts_in_flight == 0:
            raise ValueError(
                "on_rollout_finished: no rollout is in flight; call on_group_started(num_rollouts) "
                "before reporting its rollouts"
            )
        self._rollouts_in_flight -= 1
        self._finished_tokens += tokens
        self._finished_rollouts_total += 1
        self._finished_sample_tokens_total += tokens

    def on_rollout_cancelled(self) -> None:
        """A rollout in flight ended without producing samples (cancelled or abandoned).

        Raises:
            ValueError: no rollout is in flight.
        """
        if self._rollouts_in_flight == 0:
            raise ValueError("on_rollout_cancelled: no rollout is in flight")
        self._rollouts_in_flight -= 1

    def on_group_cancelled(self, num_rollouts: int) -> None:
        """A group in flight was cancelled before any of its ``num_rollouts`` rollouts was reported: the group
        and its rollouts leave flight without tokens (issue #33: a group that can no longer be trained).

        Raises:
            ValueError: no group is in flight, or fewer than ``num_rollouts`` rollouts are.
        """
        _require_int("num_rollouts", num_rollouts, 1)
        if self._groups_in_flight == 0 or self._rollouts_in_flight < num_rollouts:
            raise ValueError(f"on_group_cancelled: {self._groups_in_flight} group(s) and {self._rollouts_in_flight} "
                             f"rollout(s) in flight, cannot cancel a group of {num_rollouts}")
        self._groups_in_flight -= 1
        self._rollouts_in_flight -= num_rollouts

    def on_group_finished(self) -> None:
        """All rollouts of one group are back; ends the one-group-at-a-time phase.

        Raises:
            ValueError: no group is in flight.
        """
        if self._groups_in_flight == 0:
            raise ValueError(
                "on_group_finished: no group is in flight; call on_group_started(num_rollouts) first"
            )
        self._groups_in_flight -= 1
        self._first_group_finished = True

    def on_samples_queued(self, tokens: float, rollouts: int = 0) -> None:
        """Samples of a kept group, ``tokens`` sample tokens in all, entered the rollout queue; the event
        decides ``rollouts`` rollouts (the group's; 0 when another event decides the group).

        Raises:
            ValueError: ``tokens`` is negative or exceeds the finished tokens not yet resolved, or
                ``rollouts`` is negative.
        """
        rollouts = _require_int("rollouts", rollouts, 0)
        tokens = self._take_finished("on_samples_queued", tokens)
        self._queued_tokens += tokens
        self._queued_tokens_total += tokens
        self._decided_rollouts_total += rollouts

    def on_samples_discarded(self, tokens: float, rollouts: int = 0) -> None:
        """Finished samples that will never be queued (e.g. a zero-std group) release ``tokens``; the event
        decides ``rollouts`` rollouts (a whole dropped group: its rollouts; 0 for part of a kept group).

        Raises:
            ValueError: ``tokens`` is negative or exceeds the finished tokens not yet resolved, or
                ``rollouts`` is negative.
        """
        rollouts = _require_int("rollouts", rollouts, 0)
        self._take_finished("on_samples_discarded", tokens)
        self._decided_rollouts_total += rollouts

    def on_samples_consumed(self, tokens: float) -> None:
        """The trainer pulled queued samples worth ``tokens`` sample tokens (trained or dropped stale).

        Clamped at zero queued tokens (consumption is reported across processes).

        Raises:
            ValueError: ``tokens`` is negative.
        """
        tokens = _require_tokens("tokens", tokens)
        self._queued_tokens = max(0.0, self._queued_tokens - tokens)

    def sync_consumed_total(self, consumed_total: float) -> float:
        """Apply a monotonic "sample tokens pulled so far" counter published by the trainer.

        Calls :meth:`on_samples_consumed` with the increase since the previous call and returns it.

        Raises:
            ValueError: ``consumed_total`` is negative or smaller than a value seen before.
        """
        total = _require_tokens("consumed_total", consumed_total)
        if total < self._consumed_total_seen:
            raise ValueError(
                f"sync_consumed_total: consumed_total went down from {self._consumed_total_seen} "
                f"to {total}; the trainer's counter must only grow"
            )
        delta = total - self._consumed_total_seen
        self._consumed_total_seen = total
        self.on_samples_consumed(delta)
        return delta

    def _take_finished(self, event: str, tokens: float) -> float:
        tokens = _require_tokens("tokens", tokens)
        # Allow float rounding slack when callers sum floats.
        if tokens > self._finished_tokens + 1e-6:
            raise ValueError(
                f"{event}: {tokens} tokens exceed the {self._finished_tokens} sample tokens of "
                "finished rollouts; report each rollout with on_rollout_finished(sample_tokens) first"
            )
        self._finished_tokens = max(0.0, self._finished_tokens - tokens)
        return tokens

    def __repr__(self) -> str:
        return (
            f"TokenAllowance(groups_in_flight={self._groups_in_flight}, "
            f"rollouts_in_flight={self._rollouts_in_flight}, finished_tokens={self._finished_tokens}, "
            f"queued_tokens={self._queued_tokens}, tokens_per_rollout={self.tokens_per_rollout}, "
            f"in_flight_estimate={self.in_flight_estimate!r}, "
            f"in_flight_tokens_per_rollout={self.in_flight_tokens_per_rollout}, "
            f"first_group_finished={self._first_group_finished})"
        )
