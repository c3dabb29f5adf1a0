"""Logging-window aggregation of metrics (SPEC §15.1).

A :class:`MetricsWindow` collects everything recorded since the previous log and reduces each metric
by its kind:

1. per-item means (``add_many``: one value per rollout / sample / call) are item-weighted;
2. rates (``add_rate``) are total amount / total seconds;
3. otherwise a name whose last path segment contains ``count`` is summed;
4. a last path segment containing ``max`` / ``min`` keeps the largest / smallest value;
5. anything else is the mean of the values logged.

"Contains" is decided on the ``_``-separated words of the last segment, so ``max_length``,
``forwarded_tokens_max`` and ``low_min`` are extremes while ``mean_terminated_length`` (whose letters
contain "min") is a mean.

Windows are mergeable: the rollout worker sends :meth:`MetricsWindow.snapshot` (plain tuples, cheap to
pickle through a ``multiprocessing`` queue) and the trainer folds it in with :meth:`MetricsWindow.merge`;
the same works across training processes.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MetricsWindow", "metric_kind"]

#: Aggregation kinds, as they appear in snapshots.
MEAN, SUM, MAX, MIN, RATE = "mean", "sum", "max", "min", "rate"
_KINDS = (MEAN, SUM, MAX, MIN, RATE)
_WORD_SPLIT = re.compile(r"[_\-.\s]+")


@functools.lru_cache(maxsize=4096)  # called for every value the worker records; the names are few
def metric_kind(name: str) -> str:
    """How a metric recorded with ``add``/``add_many`` is reduced over a window (SPEC §15.1).

    Returns ``"sum"`` when a word of the last path segment starts with ``count`` (rule 3, checked
    first), ``"max"`` / ``"min"`` when a word is ``max``/``maximum`` or ``min``/``minimum`` (rule 4),
    else ``"mean"``.
    """
    last = name.rsplit("/", 1)[-1].lower()
    words = [w for w in _WORD_SPLIT.split(last) if w]
    if any(w.startswith("count") for w in words):
        return SUM
    if any(w in ("max", "maximum") for w in words):
        return MAX
    if any(w in ("min", "minimum") for w in words):
        return MIN
    return MEAN


def _number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"metric {name!r}: value {value!r} ({type(value).__name__}) is not a number"
        ) from None


class _Agg:
    """Partial aggregate of one metric: ``(kind, total, count, extreme, nan_seen, denominator)``."""

    __slots__ = ("kind", "total", "count", "extreme", "nan_seen", "denominator")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.total = 0.0  # sum of non-NaN values (mean, sum) or amounts (rate)
        self.count = 0  # number of non-NaN values
        self.extreme: float | None = None  # max or min of non-NaN values
        self.nan_seen = False
        self.denominator = 0.0  # rate: total seconds

    def add(self, value: float) -> None:
        if math.isnan(value):
            self.nan_seen = True
            return
        self.total += value
        self.count += 1
        if self.kind == MAX:
            self.extreme = value if self.extreme is None else max(self.extreme, value)
        elif self.kind == MIN:
            self.extreme = value if self.extreme is None else min(self.extreme, value)

    def as_tuple(self) -> tuple[str, float, int, float | None, bool, float]:
        return (self.kind, self.total, self.count, self.extreme, self.nan_seen, self.denominator)

    def merge(self, state: tuple) -> None:
        _, total, count, extreme, nan_seen, denominator = state
        self.total += total
        self.count += count
        self.nan_seen = self.nan_seen or bool(nan_seen)
        self.denominator += denominator
        if extreme is not None:
            if self.extreme is None:
                self.extreme = extreme
            elif self.kind == MAX:
                self.extreme = max(self.extreme, extreme)
            else:
                self.extreme = min(self.extreme, extreme)

    def value(self) -> float | None:
        if self.kind == RATE:
            if self.denominator <= 0:
                return math.nan if (self.count or self.nan_seen) else None
            return self.total / self.denominator
        if self.count == 0:
            return math.nan if self.nan_seen else None
        if self.kind == MEAN:
            return self.total / self.count
        if self.kind == SUM:
            return self.total
        return self.extreme


class MetricsWindow:
    """Metrics recorded since the previous log, reduced per SPEC §15.1 on :meth:`flush`.

    ``None`` values are skipped. NaN values are ignored by every reduction unless a metric received
    nothing but NaN, in which case it reports NaN (e.g. ``tools/failure_frequency`` in a window
    without tool calls). A metric that received only ``None`` is absent from :meth:`flush`.

    Not thread-safe: use one window per thread or guard it.
    """

    def __init__(self) -> None:
        self._aggs: dict[str, _Agg] = {}

    def _agg(self, name: str, kind: str) -> _Agg:
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name must be a non-empty string, got {name!r}")
        agg = self._aggs.get(name)
        if agg is None:
            agg = self._aggs[name] = _Agg(kind)
        elif agg.kind != kind:
            raise ValueError(
                f"metric {name!r} is aggregated as {agg.kind!r} in this window but was now recorded "
                f"as {kind!r}; record a metric the same way every time (add/add_many vs add_rate)"
            )
        return agg

    def add(self, name: str, value: float | None) -> None:
        """Record one value (one item): reduced by :func:`metric_kind` of ``name``.

        Raises:
            TypeError: ``value`` is not a number (or ``None``).
            ValueError: ``name`` was recorded with :meth:`add_rate` in this window.
        """
        number = _number(name, value)
        agg = self._agg(name, metric_kind(name))
        if number is not None:
            agg.add(number)

    def add_many(self, name: str, values: Iterable[float | None]) -> None:
        """Record one value per item (rollout, sample, call): an item-weighted mean for mean metrics,
        the sum for ``count`` metrics, the extreme for ``max``/``min`` metrics. ``None`` is skipped.

        Raises:
            TypeError: a value is not a number (or ``None``).
        """
        agg = self._agg(name, metric_kind(name))
        for value in values:
            number = _number(name, value)
            if number is not None:
                agg.add(number)

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        """Record ``amount`` (e.g. tokens) over ``seconds``; the window reports total / total.

        Also usable for any ratio of window totals (e.g. ``tools/failure_frequency`` = failed calls /
        calls). A window whose denominator total is 0 reports NaN if anything was recorded.

        Raises:
            TypeError: a non-number. ValueError: negative ``seconds`` or a name used with ``add``.
        """
        amount_f = _number(name, amount)
        seconds_f = _number(name, seconds)
        if amount_f is None or seconds_f is None:
            raise TypeError(f"metric {name!r}: add_rate needs numbers, got {amount!r} / {seconds!r}")
        if seconds_f < 0 or math.isnan(seconds_f):
            raise ValueError(f"metric {name!r}: seconds must be >= 0, got {seconds!r}")
        agg = self._agg(name, RATE)
        if math.isnan(amount_f):
            agg.nan_seen = True
            return
        agg.total += amount_f
        agg.count += 1
        agg.denominator += seconds_f

    add_ratio = add_rate

    def snapshot(self, reset: bool = False) -> dict[str, tuple]:
        """The raw partial aggregates: ``{name: (kind, total, count, extreme, nan_seen, denominator)}``.

        Plain builtins only, so it pickles cheaply through a queue; feed it to :meth:`merge`.
        With ``reset=True`` the window is emptied in the same call.
        """
        snap = {name: agg.as_tuple() for name, agg in self._aggs.items()}
        if reset:
            self.reset()
        return snap

    def merge(self, snapshot: Mapping[str, tuple]) -> None:
        """Fold a :meth:`snapshot` of another window (another process) into this one.

        Raises:
            ValueError: a snapshot entry is malformed, or its kind differs from this window's for
                the same name.
        """
        for name, state in snapshot.items():
            if not isinstance(state, (tuple, list)) or len(state) != 6 or state[0] not in _KINDS:
                raise ValueError(
                    f"metric {name!r}: {state!r} is not a MetricsWindow.snapshot() entry "
                    "(kind, total, count, extreme, nan_seen, denominator)"
                )
            self._agg(name, state[0]).merge(tuple(state))

    def reset(self) -> None:
        """Forget everything recorded."""
        self._aggs.clear()

    def __len__(self) -> int:
        return len(self._aggs)

    def __contains__(self, name: object) -> bool:
        return name in self._aggs

    def compute(self) -> dict[str, float]:
        """The window's values without resetting (see :meth:`flush`)."""
        out: dict[str, float] = {}
        for name, agg in self._aggs.items():
            value = agg.value()
            if value is not None:
                out[name] = value
        return out

    def flush(self) -> dict[str, float]:
        """Reduce the window to one float per metric and start a new window.

        Metrics that only received ``None`` are left out.
        """
        out = self.compute()
        self.reset()
        return out
