"""SPEC §13.2's `IncrementEnv`: the environment owns the task (``reset`` draws a target) and the reward.

Used by ``asyncgrpo train +recipe=increment_env`` (no dataset: ``reset`` returns each rollout's prompt,
``max_steps`` bounds training). `tool_call_reward` is a trainer-owned shaping reward that scores whether the
model made a parsed call to the tool at all (an untrained model seldom does), summed with ``get_reward`` (SPEC §13.2).
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
    """Shaping reward for tool use, earned by parsed tool calls only: 0.5 when a call to one of ``tool_names``
    ran and returned a result, 0.2 when the completion's replies hold a parsed call to one of them but none
    returned one (each ``tool`` message is an ``Error: ...``: bad arguments, an exception, a timeout; or the
    call was past ``max_tool_calling_iterations`` and not run), else 0.0. Naming a tool in prose, a malformed ``<tool_call>`` block the tool loop could not read, or a call to a
    tool not in ``tool_names`` earns nothing.

    Args:
        completions: G completions, each the list of assistant and tool messages of one rollout (assistant
            messages carry their parsed calls in ``tool_calls``; ``tool`` messages name the tool that ran).
        tool_names: the tools whose calls earn the reward (bind with functools.partial or the rewards
            group's ``kwargs``).

    Returns:
        G floats in {0.0, 0.2, 0.5}.
    """
    wanted = set(tool_names)
    out = []
    for messages in completions:
        called = any(
            isinstance(call, dict) and (call.get("function") or call).get("name") in wanted
            for m in messages if m.get("role") == "assistant"
            for call in (m.get("tool_calls") or [])
        )
        results = [m.get("content") or "" for m in messages if m.get("role") == "tool" and m.get("name") in wanted]
        if called and any(not r.startswith("Error") for r in results):
            out.append(0.5)
        elif called:
            out.append(0.2)
        else:
            out.append(0.0)
    return out
