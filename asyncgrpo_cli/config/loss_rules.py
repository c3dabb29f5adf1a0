"""Value rules of the loss-variant fields (TRL ``GRPOConfig`` names; README "Loss variants").

Shared by `AsyncGRPOConfig` (Python API) and the composed Hydra config (CLI) through `rules.check_fields`;
each error names the field as the user typed it (``path_of``), its value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError

#: SPEC §3.3's loss is ``dapo`` with the ``token`` level and ``token_mask`` correction (the defaults).
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
#: TRL's ``scale_rewards`` values; ``group`` (B.7's group std) is the default. ``batch`` is refused (below).
SCALE_REWARDS = ("group", "none")


def scale_rewards_name(value: Any) -> Any:
    """TRL's boolean spelling of ``scale_rewards`` as its name: ``True`` → ``"group"``, ``False`` → ``"none"``
    (also the strings ``"true"`` / ``"false"`` in any case, as Hydra hands ``rollout.scale_rewards=true`` to a
    string field). Any other value is returned unchanged (checked by `check_loss_fields`)."""
    if isinstance(value, bool):
        return "group" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "group" if value.lower() == "true" else "none"
    return value
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize",)
_BATCH_REFUSED = ("TRL normalises by statistics of the whole generation batch (the std of every reward in it, "
                  "groups without spread included); here a group's advantages are computed when the group finishes, "
                  "before the step that trains it exists, and groups without spread never reach the trainer, so "
                  "TRL's number cannot be reproduced (README: Loss variants)")


def _error(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {problem}. Fix: {fix}", key=key)


def check_loss_fields(values: Mapping[str, Any], path_of: Callable[[str], str] = lambda n: n) -> None:
    """Check ``loss_type``, ``importance_sampling_level``, ``vllm_importance_sampling_mode`` (a ``*_truncate`` mode
    needs a bound), ``scale_rewards``, ``multi_objective_aggregation``, ``beta``, ``mask_truncated_completions``
    and ``reward_weights`` (values only; the count of reward weights
    against the reward functions is checked where the functions are known).

    Raises:
        ConfigError: the first bad value, naming ``path_of(field)``, the value and the fix.
    """
    p, g = path_of, values.get
    loss_type = g("loss_type", "dapo")
    level = g("importance_sampling_level", "token")
    mode = g("vllm_importance_sampling_mode", "token_mask")
    for name, value, allowed in (("loss_type", loss_type, LOSS_TYPES), ("importance_sampling_level", level, IS_LEVELS),
                                 ("vllm_importance_sampling_mode", mode, IS_MODES)):
        if value not in allowed:
            raise _error(p(name), value, f"must be one of {', '.join(allowed)}",
                         f"set {p(name)}={allowed[0]} (the default)")
    if g("score_centering", True):
        for name, value, bad in (("loss_type", loss_type, loss_type == "cispo"),
                                 ("importance_sampling_level", level, level == "sequence"),
                                 ("vllm_importance_sampling_mode", mode, mode.startswith("sequence"))):
            if bad:
                raise _error(p(name), value, "score centering (the default objective) is per token and cannot use "
                             "it (README: Loss variants)",
                             f"also set {p('score_centering')}=false (the clipped surrogate), or drop {p(name)}")
    if mode.endswith("truncate") and g("vllm_importance_sampling_clip_min", 0.5) is None and \
            g("vllm_importance_sampling_clip_max", 5.0) is None:
        raise _error(p("vllm_importance_sampling_mode"), mode, f"truncation clamps the ratio to [C_min, C_max] but "
                     f"{p('vllm_importance_sampling_clip_min')} and {p('vllm_importance_sampling_clip_max')} are "
                     "both null (no bound: nothing to truncate)",
                     f"set {p('vllm_importance_sampling_clip_max')}=3.0 (TRL's default), or use token_mask")
    eh = g("epsilon_high", None)
    if loss_type == "cispo" and not (eh is not None and eh > 0):
        raise _error(p("epsilon_high"), eh, "loss_type=cispo caps the stop-gradient importance weight at "
                     "epsilon_high (its ε_max)", f"set {p('epsilon_high')}=5.0 (ScaleRL's value)")
    scale = scale_rewards_name(g("scale_rewards", "group"))
    if scale == "batch":
        raise _error(p("scale_rewards"), scale, _BATCH_REFUSED, f"set {p('scale_rewards')}=group (the default) or none")
    if scale not in SCALE_REWARDS:
        raise _error(p("scale_rewards"), scale, "must be group (divide by the group's reward std, the default) or "
                     "none (Dr. GRPO: no division)", f"set {p('scale_rewards')}=group")
    agg = g("multi_objective_aggregation", "sum_then_normalize")
    if agg == "normalize_then_sum":
        raise _error(p("multi_objective_aggregation"), agg, _BATCH_REFUSED.replace(
            "TRL normalises", "after normalising each reward function within its group, TRL normalises the sum"),
            f"set {p('multi_objective_aggregation')}=sum_then_normalize (the default)")
    if agg not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise _error(p("multi_objective_aggregation"), agg, "must be sum_then_normalize (the weighted sum of the "
                     "reward functions, then the group advantage)",
                     f"set {p('multi_objective_aggregation')}=sum_then_normalize")
    beta = g("beta", 0.0)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise _error(p("beta"), beta, "the KL coefficient must be a finite number >= 0",
                     f"set {p('beta')}=0.0 (no KL penalty) or e.g. {p('beta')}=0.001")
    mtc = g("mask_truncated_completions", False)
    if not isinstance(mtc, bool):
        raise _error(p("mask_truncated_completions"), mtc, "must be true or false",
                     f"set {p('mask_truncated_completions')}=true")
    weights = g("reward_weights", None)
    if weights is not None:
        if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
            raise _error(p("reward_weights"), weights, "must be a list of numbers, one per reward function",
                         f"set {p('reward_weights')}=[1.0, 0.5] (in reward-function order) or null")
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise _error(p("reward_weights"), list(weights), f"entry {i} ({w!r}) is not a finite number",
                             f"give one finite number per reward function, e.g. {p('reward_weights')}=[1.0, 0.5]")


def loss_warnings(values: Mapping[str, Any], path_of: Callable[[str], str] = lambda n: n) -> list[str]:
    """Warnings where TRL's ``GRPOTrainer`` warns: GSPO's sequence ratio (``importance_sampling_level=sequence``)
    with a loss type that sums token terms (``dapo``, ``bnpo``, ``dr_grpo``, ``cispo``), which weighs each
    sequence by its length instead of optimising GSPO's per-sequence objective.

    Returns:
        The warning texts (empty when none applies).
    """
    p, g = path_of, values.get
    loss_type = g("loss_type", "dapo")
    if g("importance_sampling_level", "token") == "sequence" and loss_type in ("dapo", "bnpo", "dr_grpo", "cispo"):
        return [f"{p('importance_sampling_level')}=sequence with {p('loss_type')}={loss_type}: this loss sums "
                "per-token terms, so each sequence weighs by its completion length instead of the per-sequence "
                f"objective of GSPO; set {p('loss_type')}=grpo for the GSPO paper's setup (README: Loss variants)"]
    return []


def check_reward_weights_count(weights: Any, num_funcs: int, key: str = "reward_weights",
                               funcs_key: str = "reward_funcs") -> None:
    """Refuse ``reward_weights`` whose length differs from the number of reward functions.

    Raises:
        ConfigError: naming both counts and the fix.
    """
    if weights is not None and len(weights) != num_funcs:
        raise _error(key, list(weights), f"has {len(weights)} weight(s) but there are {num_funcs} reward "
                     f"function(s) in {funcs_key}", f"give exactly {num_funcs} weight(s), in the order of "
                     f"{funcs_key}, or set {key}=null (all 1.0)")
