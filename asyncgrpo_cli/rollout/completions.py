"""Completion records of ``log_completions`` (SPEC §16.3): what the rollout worker ships to the trainer for
each scored group, so the trainer can write ``completions.jsonl``, print the tables and hand them to the
``report_to`` trackers.

A record is a plain dict (it pickles through the worker's metrics queue and is one JSON line as is)::

    {"prompt": [messages], "completion": "text", "reward": float | None, "advantage": float | None,
     "rewards": {reward_func_name: float | None}, "group_id": int, "model_version": int, "dropped": bool}

``reward`` is the total over the reward sources (SPEC §3.2), ``advantage`` the rollout's advantage (None
when unscored), ``rewards`` each function's own reward (an environment's ``get_reward`` under its class
name, as its metric, SPEC §15.2), ``dropped`` whether the group was dropped for zero reward spread. The
trainer adds ``step``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .types import RolloutGroup


@dataclass
class CompletionRecords:
    """One group's completion records, as they travel through the worker's metrics queue (beside the metric
    snapshots, told apart by type)."""

    records: list[dict[str, Any]] = field(default_factory=list)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def messages_text(messages: Any) -> str:
    """A completion (a list of message dicts) as text: each message's content, tool results marked
    ``[tool]``, tool calls as ``[call name(arguments)]``; a string is returned as is."""
    if isinstance(messages, str):
        return messages
    parts = []
    for m in messages or []:
        if not isinstance(m, Mapping):
            parts.append(str(m))
            continue
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        calls = [c.get("function", c) for c in m.get("tool_calls") or [] if isinstance(c, Mapping)]
        text = str(content) + "".join(f" [call {c.get('name')}({c.get('arguments')})]" for c in calls)
        parts.append(f"[tool] {text}" if m.get("role") == "tool" else text)
    return "\n".join(p.strip() for p in parts if p.strip())


def group_records(group: RolloutGroup, advantages: Sequence[float],
                  per_function: Mapping[str, Sequence[float | None]], dropped: bool) -> list[dict[str, Any]]:
    """The completion records of one scored group, one per rollout (module docstring).

    Args:
        group: the scored group (``group.rewards``: ``[G]`` float64 totals, NaN = unscored).
        advantages: ``[G]`` advantages (NaN = unscored).
        per_function: reward function name -> ``[G]`` rewards (`RewardRunner` result).
        dropped: the group was dropped (SPEC §3.2).
    """
    records = []
    for i, completion in enumerate(group.completions):
        rewards = {name: _number(values[i]) for name, values in per_function.items()}
        env = group.env_rewards[i] if i < len(group.env_rewards) else None
        if env is not None:
            rewards[env[0].__name__] = _number(env[1])
        records.append({"prompt": group.prompts[i], "completion": messages_text(completion),
                        "reward": _number(group.rewards[i]) if group.rewards is not None else None,
                        "advantage": _number(advantages[i]), "rewards": rewards, "group_id": int(group.group_id),
                        "model_version": int(group.model_version), "dropped": bool(dropped)})
    return records


def ship_group_records(config: Any, metrics_queue: Any, group: RolloutGroup, advantages: Sequence[float],
                       per_function: Mapping[str, Sequence[float | None]], dropped: bool) -> None:
    """Put the group's records on ``metrics_queue`` when ``config.log_completions`` is on (else nothing)."""
    if getattr(config, "log_completions", False):
        metrics_queue.put(CompletionRecords(group_records(group, advantages, per_function, dropped)))
