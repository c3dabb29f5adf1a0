"""What holds the rollout loop's producer before it starts a group, and for how long (issue #41).

The producer starts a group only when every gate lets it (`asyncgrpo_cli.rollout.loop`): the on-policy round
(``max_staleness=0``, `OnPolicyRounds`), the staleness token allowance (SPEC §4.1, B.4, `TokenAllowance`), deadline
admission (`StaleSchedule.can_admit`, on from the first stale drop), a concurrency slot under the adaptive cap or
``max_concurrent_rollouts``, and room in the scoring queue. ``rollout/backpressure_s`` (SPEC §4.1) is the mean of
the producer's waits for the first three and cannot say which one held it, nor for what share of the time.
`HoldClock` keeps the seconds per gate; the loop's monitor turns them into ``rollout/held_{gate}_frac``, the share
of wall time the producer was held by that gate over the logging window (rates of window totals, SPEC §15.1). Their
sum is at most 1; what is left is time the producer was free to start groups, so a sum well below 1 with the
trainer waiting for samples means the producer's own loop (or the prompts) is the bound.

Pure apart from the clock it is given; not thread-safe (the loop's event loop owns it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["HOLD_GATES", "HoldClock", "held_metric"]

#: The gates, in the order the producer asks them: ``round`` (on-policy round closed or full), ``allowance`` (the
#: token allowance), ``deadline`` (deadline admission), ``cap`` (no concurrency slot), ``score`` (scoring queue full).
HOLD_GATES = ("round", "allowance", "deadline", "cap", "score")


def held_metric(gate: str) -> str:
    """The metric name of ``gate``'s held share: ``rollout/held_{gate}_frac``.

    Raises:
        ValueError: ``gate`` is not one of `HOLD_GATES`.
    """
    if gate not in HOLD_GATES:
        raise ValueError(f"unknown hold gate {gate!r}: one of {', '.join(HOLD_GATES)}")
    return f"rollout/held_{gate}_frac"


class HoldClock:
    """Seconds the producer spent held, per gate, since the last `take`.

    ``hold(gate)`` says which gate holds the producer from now on (``None``: none); the time since the previous
    call is credited to the gate that held until now. ``take()`` returns the seconds per gate and the seconds
    elapsed since the previous take (or since construction), crediting a hold still going on up to now, and
    starts a new period; so a long hold is spread over the periods it spans, and each gate's seconds never
    exceed the elapsed ones.

    Args:
        clock: monotonic seconds (default `time.monotonic`; tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._gate: str | None = None
        self._since = self._period_start = clock()
        self._seconds = dict.fromkeys(HOLD_GATES, 0.0)

    @property
    def gate(self) -> str | None:
        """The gate holding the producer now, or None."""
        return self._gate

    def _credit(self, now: float) -> None:
        if self._gate is not None:
            self._seconds[self._gate] += max(0.0, now - self._since)
        self._since = now

    def hold(self, gate: str | None) -> None:
        """From now on ``gate`` holds the producer (``None``: nothing does).

        Raises:
            ValueError: ``gate`` is neither None nor one of `HOLD_GATES`.
        """
        if gate is not None and gate not in HOLD_GATES:
            raise ValueError(f"unknown hold gate {gate!r}: one of {', '.join(HOLD_GATES)}")
        if gate == self._gate:
            return
        self._credit(self._clock())
        self._gate = gate

    def take(self) -> tuple[dict[str, float], float]:
        """(seconds held per gate, seconds elapsed) since the previous take; then starts a new period."""
        now = self._clock()
        self._credit(now)
        seconds, elapsed = self._seconds, max(0.0, now - self._period_start)
        self._seconds = dict.fromkeys(HOLD_GATES, 0.0)
        self._period_start = now
        return seconds, elapsed
