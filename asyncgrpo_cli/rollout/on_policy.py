"""On-policy rounds: how the worker schedules generation at ``max_staleness=0`` (issue #33; SPEC §3.1, §4.1, B.6).

At ``max_staleness=0`` a sample is trained only by the policy that generated it: a group stamped ``v`` must be
pulled before the trainer's step at version ``v`` closes. The asynchronous allowance (one step's worth of tokens
queued plus in flight) let the worker start groups at ``v`` while the trainer was already training ``v``'s
step, so they came back stale; deadline admission then throttled generation to a group or two at a time (the
issue measured 14-20x slower than ``max_staleness=2``, 42% of the sampled tokens dropped).

:class:`OnPolicyRounds` makes the worker behave as an efficient synchronous trainer instead. For each model
version ``v`` it runs one **round**:

- it starts a **wave** of groups at full concurrency (under the concurrency cap) until the kept sample tokens it
  expects from the round reach ``fill_target`` × the step's capacity (the sample tokens one step of full rows holds,
  published by the trainer, `step_capacity`). Expected = the kept tokens already queued + finished groups awaiting
  their score × the keep rate + rollouts in flight × the mean sample tokens per rollout × the keep rate. The keep
  rate is the share of generated sample tokens that were queued over the last `KEEP_WINDOW` scored groups (groups
  without reward spread are dropped, SPEC §3.2), floored at `KEEP_FLOOR`: the groups that will be dropped are
  replaced up front, in the same wave, not in later small rounds. No group starts while the wave is out: short
  completions come back first, so replacing what comes back early would over-fill the round with long ones;
- once nothing of the round is in flight or being scored, the round is **done** if it queued at least
  ``min_fill`` × its target: the worker starts nothing more at ``v`` and tells the trainer, which trains the step
  with all of the round's samples (in as many rows of ``token_budget`` as they need) and syncs. Below ``min_fill``
  one more wave starts, sized for the shortfall;
- the round also ends when the trainer closes its step (``pull_version > v``: whatever it pulls next trains at
  ``v + 1``); groups of ``v`` still in flight can then never be trained (the rollout loop cancels them).

Nothing here changes what is trained: the trainer's drop rule (B.6) still checks every sample. This replaces the
allowance's rule at ``max_staleness=0`` (stated in README "Staleness and concurrency"): the round counts groups
in flight at their expected *kept* tokens, so it may keep more tokens in flight than one step when groups are
dropped for zero reward spread. Pure: no I/O, no clocks; the rollout loop feeds it events.
"""

from __future__ import annotations

from collections import deque

from .allowance import _require_int, _require_tokens

__all__ = ["FILL_TARGET", "KEEP_FLOOR", "KEEP_WINDOW", "MIN_FILL", "OnPolicyRounds", "step_capacity"]

#: Share of the step's capacity a round aims at. The trainer trains all of a done round in one step (as many rows
#: as it needs), so a round a little over the capacity costs one partly filled micro-batch, not dropped samples.
FILL_TARGET = 1.0
#: A round with nothing left in flight is done once it queued this share of its target.
MIN_FILL = 0.5
#: Scored groups the keep rate is measured over.
KEEP_WINDOW = 64
#: Lowest keep rate assumed (at most 1 / KEEP_FLOOR times the needed rollouts start at once).
KEEP_FLOOR = 0.1


def step_capacity(token_budget: int, gradient_accumulation_steps: int, num_processes: int, weight_sync_steps: int,
                  sample_tokens: int = 0, forwarded_tokens: int = 0, max_groups_per_step: int | None = None,
                  groups: int = 0) -> float:
    """Sample tokens one weight version's steps hold when every row is full (issue #33).

    ``token_budget × gradient_accumulation_steps × num_processes × weight_sync_steps`` forwarded tokens, times
    the last step's packing ratio ``sample_tokens / forwarded_tokens`` (SPEC B.13: tree packing shares prompt
    tokens, so a full row holds more sample tokens than its budget). Before any step (``forwarded_tokens=0``)
    the ratio is taken as 1, as SPEC B.3 does. With ``max_groups_per_step`` (``packing.max_groups_per_step``,
    issue #41) and a last step of ``groups`` groups, the capacity is also at most ``max_groups_per_step ×
    weight_sync_steps`` groups of the last step's mean sample tokens per group.

    Args:
        token_budget, gradient_accumulation_steps, num_processes, weight_sync_steps: ints >= 1.
        sample_tokens: the last step's sample tokens (each sample's own tokens, before sharing), >= 0.
        forwarded_tokens: the last step's forwarded tokens (after sharing), >= 0.
        max_groups_per_step: the group bound of a step (>= 1), or None.
        groups: the last step's distinct groups, >= 0 (0: no bound applied yet).

    Returns:
        The capacity in sample tokens (float).

    Raises:
        TypeError / ValueError: an argument is not an int or is below its minimum (named in the message).
    """
    for name, value in (("token_budget", token_budget), ("gradient_accumulation_steps", gradient_accumulation_steps),
                        ("num_processes", num_processes), ("weight_sync_steps", weight_sync_steps)):
        _require_int(name, value, 1)
    _require_int("sample_tokens", sample_tokens, 0)
    _require_int("forwarded_tokens", forwarded_tokens, 0)
    _require_int("groups", groups, 0)
    if max_groups_per_step is not None:
        _require_int("max_groups_per_step", max_groups_per_step, 1)
    ratio = sample_tokens / forwarded_tokens if forwarded_tokens > 0 and sample_tokens > 0 else 1.0
    capacity = float(token_budget * gradient_accumulation_steps * num_processes * weight_sync_steps) * ratio
    if max_groups_per_step is not None and groups > 0 and sample_tokens > 0:
        capacity = min(capacity, max_groups_per_step * weight_sync_steps * sample_tokens / groups)
    return capacity


class _Group:
    __slots__ = ("version", "rollouts", "tokens")

    def __init__(self, version: int, rollouts: int) -> None:
        self.version = version
        self.rollouts = rollouts  # in flight
        self.tokens: float | None = None  # real sample tokens once generated (awaiting its score)


class OnPolicyRounds:
    """The worker's schedule at ``max_staleness=0`` (module docstring).

    Args:
        fill_target: share of the step's capacity a round aims at, in (0, 1].
        min_fill: share of the target under which a round with nothing in flight starts another wave, in [0, 1].
        keep_window: scored groups the keep rate is measured over (>= 1).
        keep_floor: lowest keep rate assumed, in (0, 1].

    Raises:
        ValueError: an argument out of its range.

    Events, in the order the rollout loop sees them::

        observe(model_version, pull_version, capacity)   # whenever the trainer's shared values are read
        on_group_started(group_id, version, rollouts)    # a group goes in flight, stamped ``version``
        on_group_stamped(group_id, version)              # its first rollout started at this version (if later)
        on_group_generated(group_id, sample_tokens)      # every rollout is back: awaiting its score
        on_group_resolved(group_id, kept_tokens)         # scored: kept tokens queued (0: dropped)
          or on_group_abandoned(group_id)                # cancelled, or back stale and re-queued
    """

    def __init__(self, fill_target: float = FILL_TARGET, min_fill: float = MIN_FILL, keep_window: int = KEEP_WINDOW,
                 keep_floor: float = KEEP_FLOOR) -> None:
        if not 0 < fill_target <= 1:
            raise ValueError(f"fill_target must be in (0, 1], got {fill_target}")
        if not 0 <= min_fill <= 1:
            raise ValueError(f"min_fill must be in [0, 1], got {min_fill}")
        if not 0 < keep_floor <= 1:
            raise ValueError(f"keep_floor must be in (0, 1], got {keep_floor}")
        self.fill_target = float(fill_target)
        self.min_fill = float(min_fill)
        self.keep_floor = float(keep_floor)
        self._keep: deque[tuple[float, float]] = deque(maxlen=_require_int("keep_window", keep_window, 1))
        self._groups: dict[int, _Group] = {}
        self._version = 0
        self._pull_version = 0
        self._capacity = 0.0
        self._kept = 0.0  # sample tokens queued by this round
        self._done = False  # the round told the trainer it is done: nothing more starts at this version
        self._wave_open = True  # groups may start until the wave's expected kept tokens reach the target
        self.rounds_done = 0

    # ------------------------------------------------------------------ observations
    @property
    def version(self) -> int:
        """The round's model version (the weights the server samples with)."""
        return self._version

    def observe(self, model_version: int, pull_version: int, capacity: float) -> bool:
        """The trainer's shared values: the served ``model_version``, ``pull_version`` (what samples pulled from
        now on train at, >= model_version; larger while a closed step trains and syncs) and the step's
        ``capacity`` in sample tokens (`step_capacity`). Returns whether a new round began.

        Raises:
            ValueError: a version went down or is negative, or ``capacity`` is not a finite number >= 0.
        """
        _require_int("model_version", model_version, 0)
        _require_int("pull_version", pull_version, 0)
        self._capacity = _require_tokens("capacity", capacity)
        if model_version < self._version or pull_version < self._pull_version:
            raise ValueError(f"observe: model_version {self._version} -> {model_version}, pull_version "
                             f"{self._pull_version} -> {pull_version}: the trainer's versions only grow")
        self._pull_version = max(pull_version, model_version)
        if model_version == self._version:
            return False
        self._version = model_version
        self._kept = 0.0
        self._done = False
        self._wave_open = True
        return True

    @property
    def keep_rate(self) -> float:
        """Queued / generated sample tokens over the last scored groups, in [`keep_floor`, 1]; 1 before any."""
        generated = sum(g for g, _ in self._keep)
        if generated <= 0:
            return 1.0
        return min(1.0, max(self.keep_floor, sum(k for _, k in self._keep) / generated))

    @property
    def target(self) -> float:
        """Kept sample tokens the round aims at: ``fill_target × capacity``."""
        return self.fill_target * self._capacity

    @property
    def kept_tokens(self) -> float:
        """Sample tokens this round has queued for the trainer."""
        return self._kept

    @property
    def closed(self) -> bool:
        """Nothing more starts at this version: the round is done, or the trainer closed its step."""
        return self._done or self._pull_version > self._version

    def _current(self) -> list[_Group]:
        return [g for g in self._groups.values() if g.version == self._version]

    def in_flight(self) -> int:
        """Groups of this round in flight or awaiting their score."""
        return len(self._current())

    def expected_tokens(self, tokens_per_rollout: float) -> float:
        """Kept sample tokens this round expects: queued + awaiting score × keep rate + in flight × mean sample
        tokens per rollout (``tokens_per_rollout``) × keep rate."""
        per = _require_tokens("tokens_per_rollout", tokens_per_rollout)
        k = self.keep_rate
        pending = sum(g.tokens if g.tokens is not None else g.rollouts * per for g in self._current())
        return self._kept + k * pending

    # ------------------------------------------------------------------ decisions
    def can_start(self, tokens_per_rollout: float) -> bool:
        """Whether a new group may start now: the round is open and expects fewer kept tokens than its target
        (`expected_tokens` < `target`); with nothing of the round in flight, also only while `done` is not
        reached (below ``min_fill`` of the target another full-width wave starts).

        Raises:
            ValueError: ``tokens_per_rollout`` is not a finite number >= 0.
        """
        expected = self.expected_tokens(tokens_per_rollout)
        if self.closed or self._capacity <= 0:
            return False
        if not self._current():
            if self.done_ready():
                return False
            self._wave_open = True  # nothing in flight and short of min_fill: one more full-width wave
        if not self._wave_open:
            return False
        if expected >= self.target:
            self._wave_open = False  # the wave is complete: no more starts until it is back
            return False
        return True

    def done_ready(self) -> bool:
        """Nothing of the round is in flight or being scored and it queued at least ``min_fill`` × its target
        (and something): the trainer can train now."""
        return not self._current() and self._kept > 0 and self._kept >= self.min_fill * self.target

    def take_done(self) -> bool:
        """``True`` once when the round becomes done (`done_ready`); from then on nothing starts at this version.
        The caller tells the trainer."""
        if self._done or self._pull_version > self._version or not self.done_ready():
            return False
        self._done = True
        self.rounds_done += 1
        return True

    def reopen(self) -> None:
        """The trainer found nothing it could train in the done round (every sample over its token budget): the
        round counts from zero again and may start groups at this version."""
        self._kept = 0.0
        self._done = False
        self._wave_open = True

    # ------------------------------------------------------------------ groups
    def on_group_started(self, group_id: int, version: int, rollouts: int) -> None:
        """A group of ``rollouts`` rollouts goes in flight, stamped ``version`` (as far as known yet).

        Raises:
            ValueError: ``group_id`` is already tracked, or a bad ``version``/``rollouts``.
        """
        _require_int("version", version, 0)
        _require_int("rollouts", rollouts, 1)
        if group_id in self._groups:
            raise ValueError(f"on_group_started: group {group_id} is already in flight")
        self._groups[group_id] = _Group(version, rollouts)

    def on_group_stamped(self, group_id: int, version: int) -> None:
        """The group's first rollout started at ``version`` (its real stamp, SPEC §3.1); unknown ids are ignored."""
        group = self._groups.get(group_id)
        if group is not None:
            group.version = _require_int("version", version, 0)

    def on_group_generated(self, group_id: int, sample_tokens: float) -> None:
        """Every rollout of the group is back with ``sample_tokens`` sample tokens; it awaits its score.
        Unknown ids are ignored."""
        group = self._groups.get(group_id)
        if group is not None:
            group.rollouts = 0
            group.tokens = _require_tokens("sample_tokens", sample_tokens)

    def on_group_resolved(self, group_id: int, kept_tokens: float) -> None:
        """The group was scored: ``kept_tokens`` sample tokens went to the trainer (0 when it was dropped).
        Feeds the keep rate; counts toward the round when the group belongs to it. Unknown ids are ignored."""
        kept = _require_tokens("kept_tokens", kept_tokens)
        group = self._groups.pop(group_id, None)
        if group is None:
            return
        if group.tokens is not None and group.tokens > 0:
            self._keep.append((group.tokens, min(kept, group.tokens)))
        if group.version == self._version:
            self._kept += kept

    def on_group_abandoned(self, group_id: int) -> None:
        """The group will not reach the trainer from this round (cancelled, or back stale and re-queued)."""
        self._groups.pop(group_id, None)

    def __repr__(self) -> str:
        return (f"OnPolicyRounds(version={self._version}, pull_version={self._pull_version}, "
                f"capacity={self._capacity}, kept={self._kept}, in_flight={self.in_flight()}, "
                f"keep_rate={self.keep_rate:.3f}, done={self._done})")
