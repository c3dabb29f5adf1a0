"""Group rewards and advantages (SPEC §3.2, Appendix B.7).

- :func:`sum_rewards` adds the reward sources of each completion (reward functions, the environment's
  ``get_reward()``, ``Rollout.reward``), each with weight 1; ``None`` contributes nothing and a
  completion with no score at all gets NaN ("unscored").
- :func:`group_advantages` normalises inside one group: ``(r - mean) / (std + 1e-8)`` over the scored
  completions, population std (``scale_rewards="none"``: ``r - mean``); unscored completions get advantage 0.
- :func:`weighted_rewards` multiplies each reward function's rewards by its ``reward_weights`` entry
  before they are summed (TRL's ``reward_weights``; default: every weight 1, i.e. SPEC §3.2 as written).
- :func:`should_drop_group` says whether a group is dropped (all scored rewards equal, or fewer than
  two scored completions). The decision looks at rewards, never at advantages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "ADVANTAGE_EPS",
    "group_advantages",
    "group_reward_std",
    "should_drop_group",
    "sum_rewards",
    "total_rewards",
    "weighted_rewards",
]

#: Added to the group std in the advantage denominator (SPEC Appendix B.7).
ADVANTAGE_EPS = 1e-8


def _is_missing(value: float | None) -> bool:
    return value is None or (isinstance(value, (float, np.floating)) and math.isnan(value))


def sum_rewards(
    sources: Iterable[Sequence[float | None] | None], num_completions: int
) -> np.ndarray:
    """Sum reward sources per completion, each with weight 1 (SPEC §3.2).

    Args:
        sources: each a sequence of ``num_completions`` rewards (float, int or ``None``), or ``None``
            for a source that does not exist (e.g. no environment reward). ``None`` entries and NaN
            floats contribute nothing.
        num_completions: G, the number of completions.

    Returns:
        float64 array of shape ``(num_completions,)``: the sum of the non-``None`` entries of each
        completion, NaN where every source was ``None``.

    Raises:
        ValueError: a source has a length other than ``num_completions`` (its position is named).
    """
    totals = np.zeros(num_completions, dtype=np.float64)
    scored = np.zeros(num_completions, dtype=bool)
    for position, source in enumerate(sources):
        if source is None:
            continue
        if len(source) != num_completions:
            raise ValueError(
                f"reward source #{position} has {len(source)} entries but there are "
                f"{num_completions} completions; give one entry (float or None) per completion"
            )
        for i, value in enumerate(source):
            if _is_missing(value):
                continue
            totals[i] += float(value)
            scored[i] = True
    totals[~scored] = np.nan
    return totals


def total_rewards(
    reward_func_rewards: Sequence[Sequence[float | None]],
    env_rewards: Sequence[float | None] | None = None,
    rollout_rewards: Sequence[float | None] | None = None,
    num_completions: int | None = None,
) -> np.ndarray:
    """Total reward of each completion from all three sources of SPEC §3.2.

    Args:
        reward_func_rewards: one list per reward function, each with one entry per completion.
        env_rewards: the environment's ``get_reward()`` per completion (``None`` = no reward).
        rollout_rewards: ``Rollout.reward`` per completion (``None`` = not set).
        num_completions: G; inferred from the first source given when omitted.

    Returns:
        float64 array of shape ``(G,)``, NaN for unscored completions.

    Raises:
        ValueError: no source gives the number of completions, or the lengths disagree.
    """
    sources: list[Sequence[float | None] | None] = [*reward_func_rewards, env_rewards, rollout_rewards]
    if num_completions is None:
        first = next((s for s in sources if s is not None), None)
        if first is None:
            raise ValueError(
                "total_rewards: pass num_completions when there is no reward source to infer it from"
            )
        num_completions = len(first)
    return sum_rewards(sources, num_completions)


def _as_rewards(rewards: Sequence[float | None] | np.ndarray) -> np.ndarray:
    return np.array([np.nan if v is None else float(v) for v in rewards], dtype=np.float64)


def group_reward_std(rewards: Sequence[float | None] | np.ndarray) -> float:
    """Population std (ddof=0) of the scored (non-NaN, non-``None``) rewards of one group.

    Returns NaN when nothing is scored. This is what the advantage is divided by (metric
    ``reward_group_std``, SPEC §15.2).
    """
    r = _as_rewards(rewards)
    scored = r[~np.isnan(r)]
    return float(np.std(scored)) if scored.size else math.nan


def should_drop_group(rewards: Sequence[float | None] | np.ndarray) -> bool:
    """Whether a group is dropped before training (SPEC §3.2, Appendix B.7).

    A group is dropped when it has fewer than two scored completions or when all its scored rewards
    are equal (zero std; equality up to float rounding of the summed sources, i.e. a spread of at
    most ``1e-12 × max(1, max|r|)``).

    Args:
        rewards: total rewards of the G completions; NaN or ``None`` = unscored.
    """
    r = _as_rewards(rewards)
    scored = r[~np.isnan(r)]
    if scored.size < 2:
        return True
    spread = float(np.max(scored) - np.min(scored))
    return spread <= 1e-12 * max(1.0, float(np.max(np.abs(scored))))


def group_advantages(rewards: Sequence[float | None] | np.ndarray, scale_rewards: str = "group") -> np.ndarray:
    """Group-normalised advantages (SPEC §3.2, Appendix B.7; TRL's ``scale_rewards``).

    ``scale_rewards="group"`` (default): ``A_i = (r_i - mean) / (std + 1e-8)`` with mean and population std
    (ddof=0) over the scored completions (TRL's ``GRPOTrainer`` divides by the Bessel-corrected std + 1e-4, so its
    advantages are ours × ``sqrt((n-1)/n)`` for ``n`` scored completions, up to the epsilons). ``"none"`` (Dr.
    GRPO): ``A_i = r_i - mean``. An unscored completion (NaN or ``None``) gets 0. With no scored completion
    every advantage is 0.

    Args:
        rewards: total rewards of the G completions, shape ``(G,)``.
        scale_rewards: ``"group"`` or ``"none"``.

    Returns:
        float64 array of shape ``(G,)``.

    Raises:
        ValueError: another ``scale_rewards`` (``"batch"`` needs the whole generation batch, README "Loss variants").
    """
    if scale_rewards not in ("group", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: a group's advantages can be scaled by its own std "
                         "('group') or not at all ('none')")
    r = _as_rewards(rewards)
    mask = ~np.isnan(r)
    out = np.zeros_like(r)
    if not mask.any():
        return out
    scored = r[mask]
    centred = scored - scored.mean()
    out[mask] = centred if scale_rewards == "none" else centred / (scored.std() + ADVANTAGE_EPS)
    return out


def weighted_rewards(
    per_function: Sequence[Sequence[float | None]], weights: Sequence[float] | None
) -> list[list[float | None]]:
    """Each reward function's rewards times its weight (``reward_weights``); ``None`` stays ``None``.

    Args:
        per_function: one list per reward function (in ``reward_funcs`` order), one entry per completion.
        weights: one float per reward function, or ``None`` (every weight 1: the lists come back unchanged).

    Returns:
        the weighted lists (new lists; NaN entries stay NaN, i.e. unscored).

    Raises:
        ValueError: ``len(weights) != len(per_function)`` (checked at start too; this guards custom loops).
    """
    if weights is None:
        return [list(values) for values in per_function]
    if len(weights) != len(per_function):
        raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(per_function)} reward "
                         "functions; give one weight per reward function")
    return [[None if _is_missing(v) else float(w) * float(v) for v in values]
            for values, w in zip(per_function, weights)]
