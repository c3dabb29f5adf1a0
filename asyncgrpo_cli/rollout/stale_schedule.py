"""Scheduling so that stale drops do not bias training toward short prompts (SPEC §3.1, §4.1, B.4, B.6; issue #28).

The token allowance (`asyncgrpo_cli.rollout.allowance`) bounds what is queued plus in flight at the moment a
group starts. It cannot see that a long group started at version ``v`` is overtaken by short groups started
after it: those finish first, the trainer consumes them, and by the time the long group is pulled the trainer
is more than ``max_staleness`` versions ahead, so it is dropped. Long (often harder) prompts were then trained
less often than the data holds (`scripts/bench/bench_staleness_bias.py`).

:class:`StaleSchedule` adds two rules on top of the allowance, which stays the contract for what may be in
flight (a group starts only when both agree):

- **Deadline admission**, from the first stale drop on (a group that comes back stale, or a sample the trainer
  dropped: until then nothing was lost, and the rule would only cost throughput). With ``release_after_versions``
  (``staleness.deadline_release_versions``, opt-in) it turns off again once that many weight updates pass without
  another drop, twice as many each time a drop turns it on again. The drop that turns it on can be a phase that
  passed (the trainer the bound early in a run, its queue grown), and the rule is pessimistic (every token
  committed counts as pulled first): left on, it held a two-server job at 100-850 rollouts in flight of 1,024 and
  69-95% of the producer's time late in the run (GPU 2026-12-04, fifth session), with no stale drop after step 9.
  Released, drops recur where overtaking is the rule (the CPU bench: 6-10% of generated tokens against 3-5%), so
  it stays opt-in until the GPU job shows the trade. A group stamped ``v`` can be trained while the trainer's version is at most
  ``v + max_staleness``: the trainer may still pull about ``(v + max_staleness − V + 1 − headroom_margin) ×
  tokens_per_version − consumed_this_version`` sample tokens before it is lost (its *headroom*). A new group
  starts only if (a) for every group in flight, the tokens committed ahead of it (everything committed but its
  own estimate, counted pessimistically as pulled first) plus the new group's estimate fit its headroom, and (b)
  the new group itself, pulled after everything committed, fits its own headroom (stamped at the current
  version). Tokens committed are counted as the trainer will pull them: a rollout in flight at what it is expected
  to put in the queue (groups dropped for zero reward std are never pulled). ``tokens_per_version`` is the smallest of the last `RECENT_STEPS` distinct estimates, since steps
  differ (a row of long samples holds fewer of them). When a long group nears its deadline, generation stops
  adding short work that would overtake it, the queue drains, and the trainer's version waits for the long group
  instead of leaving it behind. While nothing is in flight a group always starts, so admission cannot stall.
- **No prompt left behind.** A group that comes back already stale (``V − v > max_staleness`` when its last
  rollout finishes: versions only grow, so the trainer would drop every one of its samples) is not scored; its
  prompt goes to the front of the prompt order and is generated again under the current policy, at most
  ``max_retries`` times (then it is shipped and the trainer drops it, as before).

How deadline admission counts the groups started after a group in flight is ``staleness.deadline_order``
(`DEADLINE_ORDERS`): ``pessimistic`` (the default) in full; ``observed`` (opt-in, issue #42) at the share of such
groups seen to finish first (`StaleSchedule.overtake_share`).

Neither rule changes what is trained: the trainer's drop rule (B.6) still checks every sample at pull time,
so no trained token is more than ``max_staleness`` versions old. Pure: no I/O, no clocks; the rollout loop
feeds it events and asks it questions.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .allowance import _require_int, _require_tokens

__all__ = ["DEADLINE_ORDERS", "HEADROOM_MARGIN", "LENGTH_CLASSES", "OVERTAKE_MIN_SEEN", "OVERTAKE_WINDOW",
           "StaleSchedule", "length_class", "record_stale_verdict"]

#: How many of the latest distinct ``tokens_per_version`` values deadline admission takes the minimum of.
RECENT_STEPS = 64

#: A value to try for ``staleness.deadline_release_versions`` (weight updates without a stale drop after which deadline
#: admission first turns off again; each time a drop turns it on again the count doubles: `StaleSchedule.release_after`).
RELEASE_AFTER_VERSIONS = 4

#: `StaleSchedule`'s default ``headroom_margin``: versions' worth of tokens deadline admission keeps in reserve.
HEADROOM_MARGIN = 0.25

#: Values of ``staleness.deadline_order`` (the config's check, `config.rules`, holds the same tuple): how deadline
#: admission orders what is committed against a group in flight (`StaleSchedule`).
DEADLINE_ORDERS = ("pessimistic", "observed")

#: ``deadline_order="observed"``: the share is the largest of the last this many groups'
#: (`StaleSchedule.overtake_share`).
OVERTAKE_WINDOW = 64

#: ``deadline_order="observed"`` counts newer groups in full until this many groups have finished with newer ones
#: started beside them.
OVERTAKE_MIN_SEEN = 16

#: Completion-length classes of ``sample/trained_frac_{class}``: thirds of ``max_completion_length``.
LENGTH_CLASSES = ("short", "medium", "long")


def length_class(completion_tokens: int, max_completion_length: int) -> str:
    """``short`` / ``medium`` / ``long``: which third of ``max_completion_length`` (tokens, >= 1) a sample's
    ``completion_tokens`` (its trained tokens) fall in; the upper bound of a third belongs to it."""
    limit = max(int(max_completion_length), 1)
    third = min(2, max(0, (3 * int(completion_tokens) - 1) // limit))
    return LENGTH_CLASSES[third]


def record_stale_verdict(window, completion_tokens: int, max_completion_length: int, trained: bool) -> None:
    """Record what became of one sample: trained, or dropped for exceeding ``max_staleness`` (issue #28).

    Adds to ``window`` (a `MetricsWindow`):

    - ``sample/dropped_stale_token_frac``: generated (trained-mask) tokens dropped stale / generated tokens of
      every sample with a verdict, a ratio of window totals;
    - ``sample/trained_frac_{short,medium,long}``: per completion-length third (`length_class`), the share of
      its samples that were trained (1.0 trained, 0.0 dropped stale), a per-sample mean;
    - ``sample/dropped_stale_count`` += 1 for a dropped sample (SPEC §15.6).

    A sample without a trained token (a cut completion's stub with ``mask_truncated_completions``, which only
    counts as a sequence in the loss) has no verdict: nothing is recorded.
    """
    tokens = int(completion_tokens)
    if tokens <= 0:
        return
    window.add_ratio("sample/dropped_stale_token_frac", 0 if trained else tokens, tokens)
    window.add(f"sample/trained_frac_{length_class(tokens, max_completion_length)}", 1.0 if trained else 0.0)
    if not trained:
        window.add("sample/dropped_stale_count", 1)


class StaleSchedule:
    """Deadline admission and re-queueing of stale groups (module docstring; SPEC §3.1, §4.1, B.6).

    Args:
        max_staleness: weight updates a sample may lag (>= 0), as the trainer's drop rule uses it.
        max_retries: how often one prompt may be generated again after coming back stale (>= 0).
        headroom_margin: versions' worth of tokens kept in reserve by deadline admission (>= 0), for what its
            estimates miss (each in-flight rollout counts as what it is expected to put in the queue,
            `TokenAllowance.expected_kept_tokens_per_rollout`; the last step stands for the next).
        release_after_versions: weight updates without a stale drop after which deadline admission turns off
            (>= 1), doubled each time it turns on again; ``None`` (the default): it stays on from the first drop.
        order: ``"pessimistic"`` (the default): every token committed counts as pulled before a group in flight,
            the groups started after it too. ``"observed"`` (opt-in, ``staleness.deadline_order``; issue #42): the
            groups started at a later version than a group in flight, and the new group when it is, count at
            `overtake_share` of their tokens, the largest share of such groups' tokens seen to finish before a group
            (`DEADLINE_ORDERS`). Groups started at the group's own version count in full either way.

    Raises:
        TypeError / ValueError: an argument is not an int or is negative; an unknown ``order``.

    Overtaking, measured whatever the order (`overtake_share`, logged as ``rollout/deadline_overtake_share``): for
    each group in flight the schedule sums the estimated tokens of the groups started at a later version while it
    runs, and of those that finished before it; when it finishes, their ratio is its overtaken share. Groups started
    at the same version are left out: admitted in one burst, they finish in any order, and that order does not move
    a deadline by a version (the GPU run of 2026-12-06 that counted them held the share at 1 for 16 steps). With
    completions that all run to the same length (a random model, or most completions cut at
    ``max_completion_length``) later groups rarely finish first and the share stays near 0; where short groups
    overtake long ones (issue #28) it reaches 1, and ``"observed"`` is then as strict as ``"pessimistic"``. The
    largest share of the last `OVERTAKE_WINDOW` groups is used, 1 until `OVERTAKE_MIN_SEEN` groups have one, so the
    groups overtaken most (the long ones) set it.

    Events, in the order the rollout loop sees them::

        observe(version, consumed_total)          # whenever the trainer's version / pulled counter is read
        on_group_started(group_id, version, est)  # est: the group's estimated sample tokens
        on_group_finished(group_id, version)      # -> True: it is stale, retry it (requeue) instead of scoring
        requeue(prompt)                           # then next_retry() hands it out before any new prompt
    """

    def __init__(self, max_staleness: int, max_retries: int = 3, headroom_margin: float = HEADROOM_MARGIN,
                 release_after_versions: int | None = None, order: str = "pessimistic") -> None:
        if order not in DEADLINE_ORDERS:
            raise ValueError(f"order={order!r}: must be one of {', '.join(DEADLINE_ORDERS)}")
        self.order = order
        # group id -> [stamp, tokens of groups started at a later version while it runs, of those finished first]
        self._overtake: dict[int, list[float]] = {}
        self._overtaken_shares: deque[float] = deque(maxlen=OVERTAKE_WINDOW)
        self.max_staleness = _require_int("max_staleness", max_staleness, 0)
        self.max_retries = _require_int("max_retries", max_retries, 0)
        self.headroom_margin = _require_tokens("headroom_margin", headroom_margin)
        self.release_after_versions = (None if release_after_versions is None
                                       else _require_int("release_after_versions", release_after_versions, 1))
        self.deadline_admission = False  # on at a stale drop (a group back stale, or the trainer's); released,
        # off again after `release_after` weight updates without one
        self._clean_versions = 0  # weight updates since deadline admission last turned on or saw a drop
        self.admission_turned_on = 0  # how often deadline admission turned on (a drop while off)
        self._groups: dict[int, tuple[int, float]] = {}  # group id -> (stamp version, estimated tokens)
        self._retries: deque[tuple[Any, ...]] = deque()
        self._tries: dict[Any, int] = {}
        self._version = 0
        self._consumed = 0.0
        self._consumed_at_version = 0.0
        self.requeued_total = 0
        self._recent_per_version: deque[float] = deque(maxlen=RECENT_STEPS)

    # ------------------------------------------------------------------ observations
    @property
    def version(self) -> int:
        """The latest trainer model version observed."""
        return self._version

    @property
    def consumed_this_version(self) -> float:
        """Sample tokens the trainer pulled since the current version was first observed."""
        return max(0.0, self._consumed - self._consumed_at_version)

    def observe(self, version: int, consumed_total: float) -> None:
        """The trainer's model version and its monotonic count of pulled sample tokens (B.4).

        Raises:
            ValueError: ``version`` or ``consumed_total`` went down, or is negative.
        """
        version = _require_int("version", version, 0)
        consumed = _require_tokens("consumed_total", consumed_total)
        if version < self._version or consumed < self._consumed:
            raise ValueError(f"observe: version {self._version} -> {version} and consumed_total {self._consumed} "
                             f"-> {consumed}: the trainer's version and pulled-token counter only grow")
        if version > self._version:
            # The trainer pulls a step's samples, trains, then publishes the version: what it pulled before
            # this read belongs to the step that made the version, so the new version starts here.
            self._consumed_at_version = consumed
            if self.deadline_admission and self.release_after_versions is not None:
                self._clean_versions += version - self._version
                if self._clean_versions >= self.release_after:
                    self.deadline_admission = False
        self._version = version
        self._consumed = consumed

    # ------------------------------------------------------------------ groups
    @property
    def groups_in_flight(self) -> int:
        """Groups started and not yet finished."""
        return len(self._groups)

    def is_stale(self, stamp: int, version: int | None = None) -> bool:
        """Whether a group stamped ``stamp`` is past training at ``version`` (default: the observed one):
        ``version − stamp > max_staleness``, the trainer's drop rule (SPEC §3.1, B.6)."""
        return (self._version if version is None else version) - stamp > self.max_staleness

    def on_group_started(self, group_id: int, version: int, est_tokens: float) -> None:
        """A group goes in flight, stamped at ``version``, estimated at ``est_tokens`` sample tokens.

        The stamp may be a lower bound of the real one (the version when its first rollout starts): a lower
        stamp only makes admission stricter.

        Raises:
            ValueError: ``group_id`` is already in flight, or a negative argument.
        """
        _require_int("version", version, 0)
        est = _require_tokens("est_tokens", est_tokens)
        if group_id in self._groups:
            raise ValueError(f"on_group_started: group {group_id} is already in flight")
        self._groups[group_id] = (version, est)
        for rec in self._overtake.values():
            if rec[0] < version:
                rec[1] += est
        self._overtake[group_id] = [float(version), 0.0, 0.0]

    def on_group_finished(self, group_id: int, version: int | None = None, stamp: int | None = None) -> bool:
        """The group's last rollout is back; returns whether it is already stale (retry it, do not score it).

        ``stamp`` is the group's real model version (the policy when its first rollout started, SPEC §3.1);
        default the version given to :meth:`on_group_started`. ``version``: default the observed one.

        Raises:
            ValueError: ``group_id`` is not in flight.
        """
        if group_id not in self._groups:
            raise ValueError(f"on_group_finished: group {group_id} is not in flight")
        started, est = self._groups.pop(group_id)
        self._note_finish(group_id, est)
        stamp = started if stamp is None else stamp
        stale = self.is_stale(stamp, version)
        if stale:
            self._stale_event()
        return stale

    def _note_finish(self, group_id: int, est: float) -> None:
        """Overtaking: the finished group's tokens finished before every group still in flight stamped at an earlier
        version; its own overtaken share is recorded when groups of later versions were started beside it."""
        stamp, later, first = self._overtake.pop(group_id)
        for rec in self._overtake.values():
            if rec[0] < stamp:
                rec[2] += est
        if later > 0:
            self._overtaken_shares.append(min(1.0, first / later))

    @property
    def overtake_share(self) -> float:
        """The largest share, over the last `OVERTAKE_WINDOW` groups that had groups of later versions started beside
        them, of those groups' estimated tokens that finished first; 1.0 until `OVERTAKE_MIN_SEEN` such groups have
        finished (a fraction in [0, 1])."""
        if len(self._overtaken_shares) < OVERTAKE_MIN_SEEN:
            return 1.0
        return max(self._overtaken_shares)

    @property
    def release_after(self) -> int | None:
        """Weight updates without a stale drop after which deadline admission turns off now:
        ``release_after_versions`` the first time it is on, doubled each time a drop turns it on again (drops that
        recur keep it on longer and longer; a passing phase releases it soon). ``None``: never released."""
        if self.release_after_versions is None:
            return None
        return self.release_after_versions * 2 ** max(0, min(self.admission_turned_on - 1, 30))

    def _stale_event(self) -> None:
        if not self.deadline_admission:
            self.admission_turned_on += 1
        self.deadline_admission = True
        self._clean_versions = 0

    def headroom_tokens(self, stamp: int, tokens_per_version: float) -> float:
        """Sample tokens the trainer may still pull before a group stamped ``stamp`` is past training, less the
        margin: ``(stamp + max_staleness − version + 1 − headroom_margin) × tokens_per_version −
        consumed_this_version`` (may be < 0)."""
        versions_left = stamp + self.max_staleness - self._version + 1 - self.headroom_margin
        return versions_left * tokens_per_version - self.consumed_this_version

    def can_admit(self, committed_tokens: float, new_group_tokens: float, tokens_per_version: float) -> bool:
        """Whether a new group may start without pushing a group in flight past its deadline.

        Args:
            committed_tokens: the sample tokens the trainer is expected to pull from what is queued, finished
                or in flight (`TokenAllowance.expected_queue_tokens`: a rollout in flight counts as what it is
                expected to put in the queue, since groups dropped for zero reward std are never pulled).
            new_group_tokens: the new group's estimated sample tokens (0 while no rollout has finished).
            tokens_per_version: sample tokens the trainer consumes per weight update (the published allowance
                divided by ``max(max_staleness, 1)``: ``weight_sync_steps`` steps of the last step's tokens).

        Returns:
            ``True`` while deadline admission is off (no stale drop yet, by either side, or, when released, none
            in the last `release_after` weight updates), when no group is in
            flight, or when ``committed_tokens + new_group_tokens <= headroom_tokens(version)`` (the new group's
            own deadline) and, for every group in flight that can still be trained, ``committed_tokens − its own
            estimate − (1 − s) × later + s' × new_group_tokens <= its headroom``, where ``later`` is the estimate
            of the groups in flight stamped at a later version, ``s`` is 1 with ``order="pessimistic"`` and
            `overtake_share` with ``"observed"``, and ``s'`` is ``s`` when the new group's version is later than
            the group's stamp, else 1. Groups already stale are left out (they are re-queued when they come
            back). Headrooms use the smallest ``tokens_per_version`` of the last `RECENT_STEPS` distinct values
            given.

        Raises:
            TypeError / ValueError: a token count is not a finite number >= 0.
        """
        committed = _require_tokens("committed_tokens", committed_tokens)
        new = _require_tokens("new_group_tokens", new_group_tokens)
        per_version = _require_tokens("tokens_per_version", tokens_per_version)
        if not self._recent_per_version or self._recent_per_version[-1] != per_version:
            self._recent_per_version.append(per_version)
        if not self.deadline_admission or not self._groups:
            return True
        per_version = min(self._recent_per_version)
        if committed + new > self.headroom_tokens(self._version, per_version):
            return False
        share = 1.0 if self.order == "pessimistic" else self.overtake_share
        by_stamp: dict[int, float] = {}  # estimated tokens of the groups in flight, per stamp
        for stamp, est in self._groups.values():
            by_stamp[stamp] = by_stamp.get(stamp, 0.0) + est
        for stamp, est in self._groups.values():
            if self.is_stale(stamp):
                continue
            later = 0.0 if share == 1.0 else sum(t for v, t in by_stamp.items() if v > stamp)
            weight = share if self._version > stamp else 1.0
            if committed - est - (1.0 - share) * later + weight * new > self.headroom_tokens(stamp, per_version):
                return False
        return True

    def on_dropped_stale(self) -> None:
        """The trainer dropped a sample as too old (its drop rule at pull time, B.6): deadline admission turns
        on (or its release count starts again), as when a group comes back stale."""
        self._stale_event()

    # ------------------------------------------------------------------ prompts
    def requeue(self, key: Any, prompt: tuple[Any, ...]) -> bool:
        """Put ``prompt`` (what the loop needs to start its group again) at the front of the prompt order.

        ``key`` identifies the prompt across retries (its position). Returns ``False`` (not queued) once the
        prompt was retried ``max_retries`` times; the caller then ships the group as it is.
        """
        tries = self._tries.get(key, 0)
        if tries >= self.max_retries:
            self._tries.pop(key, None)
            return False
        self._tries[key] = tries + 1
        self._retries.append(prompt)
        self.requeued_total += 1
        return True

    def next_retry(self) -> tuple[Any, ...] | None:
        """The oldest re-queued prompt, or ``None``; re-queued prompts go before any new one."""
        return self._retries.popleft() if self._retries else None

    @property
    def retries_waiting(self) -> int:
        """Re-queued prompts not yet handed out."""
        return len(self._retries)

    def forget(self, key: Any) -> None:
        """The prompt reached the trainer (scored and shipped): its retry count is dropped."""
        self._tries.pop(key, None)
