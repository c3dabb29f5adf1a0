"""One ``metrics.jsonl`` window as the plain log line (issue #36): what `asyncgrpo train` prints per logging step
in plain mode and what the Python API prints instead of transformers' dict of every metric (the dict stays in
``metrics.jsonl``). The dashboard adds its diagnosis to the same line; the trainer has none to add.

Example: ``step 3/8 | reward 0.25 | gen 1.2k tok/s | train 3.4k tok/s | step 2.10 s | busy 41% | queue 5 | stale 0.50``
(``| dropped stale 3 (92% of generated tokens)`` follows in a window that dropped samples stale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

DASH = "—"


def num(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    """``metrics[name]`` as a finite float, or None when absent, null, NaN or not a number."""
    if not metrics:
        return None
    value = metrics.get(name)
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def busy_share(m: Mapping[str, Any] | None) -> float | None:
    """The trainer's busy share of a step: ``1 - perf/rollout_wait_s / perf/step_s`` clamped to [0, 1]
    (a fraction); None when either is missing or the step time is not positive."""
    wait, step_s = num(m, "perf/rollout_wait_s"), num(m, "perf/step_s")
    if wait is None or step_s is None or step_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - wait / step_s))


def fmt(value: float | None, spec: str = ".3g") -> str:
    """A number with ``spec``, or ``—`` when unknown."""
    return DASH if value is None else format(value, spec)


def fmt_pct(value: float | None) -> str:
    """A fraction as a percentage (``0.25`` → ``25%``), or ``—``."""
    return DASH if value is None else f"{value:.0%}"


def fmt_rate(value: float | None) -> str:
    """Tokens per second with a k/M suffix (``1234.5`` → ``1.23k``), or ``—``."""
    if value is None:
        return DASH
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


def metrics_line(metrics: Mapping[str, Any], max_steps: float | None = None, diagnosis: str | None = None) -> str:
    """The plain line of one window: step (of ``max_steps``), reward, generated and trained tokens per second,
    step time, the trainer's busy share (left out when unknown), queue, mean staleness, the samples dropped stale
    (only when some were, with their share of the generated tokens) and ``diagnosis`` (if any)."""
    step = num(metrics, "step")
    busy = busy_share(metrics)
    parts = [f"step {fmt(step, '.0f')}" + (f"/{max_steps:.0f}" if max_steps and max_steps > 0 else ""),
             f"reward {fmt(num(metrics, 'reward'), '.4g')}" if num(metrics, "reward") is not None else
             "reward — (no group scored since the last log)",
             f"gen {fmt_rate(num(metrics, 'rollout/generated_tokens_per_s'))} tok/s",
             f"train {fmt_rate(num(metrics, 'perf/wall_clock_trained_tokens_per_s'))} tok/s",
             f"step {fmt(num(metrics, 'perf/step_s'), '.2f')} s",
             *([f"busy {fmt_pct(busy)}"] if busy is not None else []),
             f"queue {fmt(num(metrics, 'rollout/queue_size'), '.0f')}",
             f"stale {fmt(num(metrics, 'sample/staleness_mean'), '.2f')}"]
    dropped = num(metrics, "sample/dropped_stale_count")
    if dropped:
        share = num(metrics, "sample/dropped_stale_token_frac")
        parts.append(f"dropped stale {dropped:.0f}" + (f" ({share:.0%} of generated tokens)" if share else ""))
    if diagnosis:
        parts.append(diagnosis)
    return " | ".join(parts)
