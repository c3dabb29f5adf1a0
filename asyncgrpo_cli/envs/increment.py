"""SPEC §13.2's `IncrementEnv`: the environment owns the task (``reset`` draws a target) and the reward.

Used by ``asyncgrpo train +recipe=increment_env`` (no dataset: ``reset`` returns each rollout's prompt,
``max_steps`` bounds training). `tool_call_reward` is a trainer-owned shaping reward that scores whether the
model called a tool at all (an untrained model seldom does), summed with ``get_reward`` (SPEC §13.2).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementEnv", "IncrementEnvWithExample", "tool_call_reward"]


class IncrementEnv:
    """A counter the model must raise to a target with the ``increment`` tool."""

    def __init__(self) -> None:
        self.counter = 0
        self.target = 0

    def reset(self, target: int | None = None, **kwargs: Any) -> str | None:
        """Start an episode: counter 0, a target from the dataset row or drawn in 1..6.

        Returns:
            The task when the target is drawn here (environment-owned data); None when the row gave it
            (the row's prompt is used).
        """
        self.counter = 0
        if target is not None:
            self.target = int(target)
            return None
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        """1.0 when the counter reached the target exactly, else 0.0."""
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Add a step to the counter.

        Args:
            step: how much to add to the counter.

        Returns:
            The counter after the increment.
        """
        self.counter += int(step)
        return self.counter


EXAMPLE_CALL = '<tool_call>\n{"name": "increment", "arguments": {"step": 1}}\n</tool_call>'
"""One call in the Qwen3/Hermes format the ChatML tool template asks for (`rollout.chat_templates`)."""


class IncrementEnvWithExample(IncrementEnv):
    """`IncrementEnv` whose drawn task shows one tool call first, for models too small to follow the system
    turn's tool instructions alone: SmolLM2-135M-Instruct (``+recipe=increment_env``) writes a parseable
    ``increment`` call in 1 to 3 of 48 sampled replies with the example and in none of 32 without it (CPU,
    temperature 0.7 to 1.0). The example's step is 1, so copying it earns the reward only when the target is 1."""

    def reset(self, target: int | None = None, **kwargs: Any) -> str | None:
        """As `IncrementEnv.reset`; a drawn task reads ``"Example tool call: ... Now increment the counter by N."``."""
        task = super().reset(target, **kwargs)
        if task is None:
            return None
        return f"Example tool call:\n{EXAMPLE_CALL}\nNow {task[0].lower()}{task[1:]}"


def tool_call_reward(completions: Sequence[list[dict[str, Any]]], tool_names: Sequence[str] = ("increment",),
                     **kwargs: Any) -> list[float]:
    """Shaping reward for tool use: 0.5 when a completion called a tool that ran, 0.2 when it only tried (every
    tool message is an error), 0.1 when it called none but its first reply names a tool, else 0.0.

    Args:
        completions: G completions, each the list of assistant and tool messages of one rollout.
        tool_names: the names whose mention earns the smallest step (bind with functools.partial or the
            rewards group's ``kwargs``).

    Returns:
        G floats in {0.0, 0.1, 0.2, 0.5}.
    """
    out = []
    for messages in completions:
        results = [m.get("content") or "" for m in messages if m.get("role") == "tool"]
        first = next((m.get("content") or "" for m in messages if m.get("role") == "assistant"), "")
        if any(not r.startswith("Error") for r in results):
            out.append(0.5)
        elif results:
            out.append(0.2)
        else:
            out.append(0.1 if any(name in first for name in tool_names) else 0.0)
    return out
