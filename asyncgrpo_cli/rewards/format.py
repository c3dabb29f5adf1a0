"""Format and length rewards (SPEC §10.2, §10.3 example 2).

Both are cheap, pure functions meant to be combined with :func:`asyncgrpo_cli.rewards.accuracy_reward`;
parametrise them with ``functools.partial`` (which stays picklable).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["FORMAT_PATTERN", "format_reward", "length_reward"]

#: The DeepSeek-R1-style layout ``<think>...</think><answer>...</answer>`` (SPEC §10.3 example 2).
#: ``re.DOTALL`` lets the reasoning and the answer span several lines.
FORMAT_PATTERN = re.compile(r"^<think>.*?</think><answer>.*?</answer>$", re.DOTALL)


def _first_message_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content")
    else:
        messages = list(completion or [])
        if not messages:
            return ""
        first = messages[0]
        content = first.get("content") if isinstance(first, dict) else first
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(
            p if isinstance(p, str) else str(p.get("text", "")) for p in content if isinstance(p, (str, dict))
        )
    return str(content)


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the first message of a completion fully matches :data:`FORMAT_PATTERN`, else 0.0.

    Args:
        completions: G completions, each a list of message dicts (the first message's ``content``
            is checked) or a plain string.
        **kwargs: the other reward-function arguments, ignored.

    Returns:
        G floats in {0.0, 1.0}.
    """
    return [1.0 if FORMAT_PATTERN.fullmatch(_first_message_text(c)) else 0.0 for c in completions]


def length_reward(
    completion_ids: Sequence[Sequence[int]], target_length: int = 1024, **kwargs: Any
) -> list[float]:
    """Penalty for completions longer than ``target_length`` tokens, 0.0 otherwise.

    With ``L`` the completion length in tokens and ``T = target_length``::

        reward = 0.0                          if L <= T
        reward = -min(1.0, (L - T) / T)       if L >  T

    i.e. the penalty grows linearly from 0 at ``T`` to -1.0 at ``2T`` and stays at -1.0 beyond. Being
    never positive, it does not reward short wrong answers; it only tilts the group toward concise
    completions when added to a correctness reward.

    Args:
        completion_ids: G token-id lists.
        target_length: T, in tokens (>= 1); set with ``functools.partial(length_reward, target_length=...)``.
        **kwargs: the other reward-function arguments, ignored.

    Returns:
        G floats in [-1.0, 0.0].

    Raises:
        ValueError: ``target_length < 1``.
    """
    if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"length_reward: target_length must be an int >= 1, got {target_length!r}")
    rewards = []
    for ids in completion_ids:
        excess = len(ids) - target_length
        rewards.append(0.0 if excess <= 0 else -min(1.0, excess / target_length))
    return rewards
