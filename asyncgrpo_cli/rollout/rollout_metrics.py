"""The per-group rollout metrics of SPEC §15.2-§15.4 (completion lengths, clipping, duplicates, turns, tools,
multi-turn forks), recorded into the worker's `MetricsWindow` once a group is finished."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .metrics import MetricsWindow
from .tool_loop import record_tool_counters


def record_rollout_metrics(m: MetricsWindow, rollouts: Sequence[Any], stats: Sequence[Any], sequences: Sequence[list],
                           ends_with_eos: Callable[[Any], bool], with_tools: bool, tool_names: Any) -> None:
    """Record one finished group's rollout metrics into ``m``.

    Args:
        m: the worker's metrics window.
        rollouts: the group's `Rollout` objects (at least one).
        stats: one `ReconcileStats` per rollout (multi-turn forks and drift tokens).
        sequences: the `TrainingSequence` list each rollout became.
        ends_with_eos: whether a turn ended with EOS (not cut at the length limit).
        with_tools: tools or an environment are configured (the ``tools/*`` metrics are logged only then).
        tool_names: the configured tool names (their counters are logged as 0 in a window without calls).
    """
    lengths = [len(r.completion_ids) for r in rollouts]
    terminated = [n for r, n in zip(rollouts, lengths) if r.turns and ends_with_eos(r.turns[-1])]
    m.add_many("completions/mean_length", lengths)
    m.add("completions/min_length", min(lengths))
    m.add("completions/max_length", max(lengths))
    if terminated:
        m.add_many("completions/mean_terminated_length", terminated)
        m.add("completions/min_terminated_length", min(terminated))
        m.add("completions/max_terminated_length", max(terminated))
    m.add_many("completions/clipped_ratio",
               [0.0 if r.turns and ends_with_eos(r.turns[-1]) else 1.0 for r in rollouts])
    seen: set[tuple[int, ...]] = set()
    dup = []
    for r in rollouts:
        key = tuple(t for turn in r.turns for t in turn.output_ids)
        dup.append(1.0 if key in seen else 0.0)
        seen.add(key)
    m.add_many("completions/duplicate_frac", dup)
    m.add_many("rollout/turns_mean", [len(r.turns) for r in rollouts])
    m.add("rollout/turns_max", max(len(r.turns) for r in rollouts))
    m.add_many("rollout/samples_per_rollout", [len(s) for s in sequences])
    if with_tools:  # SPEC §15.2, §15.4: only with tools
        m.add_many("tools/call_frequency", [r.tool_call_count for r in rollouts])
        m.add_many("tools/loop_exhausted_frac", [float(r.loop_exhausted) for r in rollouts])
        if not any(r.tool_call_count for r in rollouts):
            m.add("tools/failure_frequency", math.nan)  # NaN in a window without calls (SPEC §15.2)
        record_tool_counters(m, tool_names)
    transitions = sum(s.transitions for s in stats)
    if transitions:
        m.add_many("rollout/fork_frac", [1.0] * sum(s.forks for s in stats) +
                   [0.0] * (transitions - sum(s.forks for s in stats)))
        drift = [d for s in stats for d in s.drift_tokens]
        m.add_many("rollout/drift_tokens_mean", drift)
        m.add("rollout/drift_tokens_max", max(drift))
