"""Start-up rules of evaluation (``eval_strategy``, ``eval_steps``, the eval dataset; README "Evaluation").

Shared by the Python API (`AsyncGRPOTrainer(..., eval_dataset=...)`) and the CLI (``trainer.eval_*`` +
``data.eval_*``); each error names the field as the user typed it, its value and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError, shown_value

#: The ``eval_strategy`` values this trainer implements (transformers also has ``epoch``: refused, a step of
#: this trainer is a token budget of rows, not a share of an epoch).
EVAL_STRATEGIES = ("no", "steps")


def strategy_name(value: Any) -> str:
    """``eval_strategy`` as a plain string (TrainingArguments turns it into an `IntervalStrategy`)."""
    return str(getattr(value, "value", value) if value is not None else "no")


def check_eval_setup(strategy: Any, eval_steps: Any, has_eval_data: bool, *, eval_on_start: bool = False,
                     strategy_key: str = "eval_strategy", steps_key: str = "eval_steps",
                     data_key: str = "eval_dataset", data_fix: str = "pass eval_dataset=a datasets.Dataset with a "
                     "'prompt' column", environment: bool = False, on_start_key: str = "eval_on_start") -> None:
    """Refuse an evaluation set-up the trainer cannot run exactly.

    Raises:
        ConfigError: ``eval_strategy`` not in `EVAL_STRATEGIES`; ``steps`` with ``eval_steps`` not an integer
            >= 1 (a float share of the run is not supported) or without eval data; ``eval_on_start``;
            eval data with an ``environment_factory`` (its rollouts need the environment's ``reset``).
    """
    name = strategy_name(strategy)
    if name not in EVAL_STRATEGIES:
        raise ConfigError(f"{strategy_key}={name!r}: this trainer evaluates every N optimizer steps or not at all "
                          f"(one of {', '.join(EVAL_STRATEGIES)}). Fix: set {strategy_key}=steps and {steps_key}=N",
                          key=strategy_key)
    if eval_on_start:
        raise ConfigError(f"{on_start_key}=true: not supported by this trainer (the first round runs at step "
                          f"{steps_key}). Fix: set {on_start_key}=false", key=on_start_key)
    if name == "no":
        return
    steps = eval_steps
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps < 1 or int(steps) != steps:
        shown = int(steps) if isinstance(steps, float) and steps == int(steps) else steps
        raise ConfigError(f"{steps_key}={shown!r}: {strategy_key}=steps needs a whole number of optimizer steps "
                          f">= 1 between eval rounds. Fix: set {steps_key}=50", key=steps_key)
    if not has_eval_data:
        raise ConfigError(f"{data_key}={shown_value(data_key, None)}: {strategy_key}=steps needs eval prompts. "
                          f"Fix: {data_fix}, or set {strategy_key}=no", key=data_key)
    if environment:
        raise ConfigError(f"{data_key}: evaluation with an environment_factory is not supported (an eval rollout "
                          f"would need the environment's reset and tools). Fix: set {strategy_key}=no",
                          key=data_key)


def check_eval_dataset(dataset: Any, funcs: Sequence[Any], key: str, reward_key_of=None,
                       names: Sequence[str] | None = None) -> list[str]:
    """The eval prompts pass the training set's checks: a ``prompt`` column of chat messages, at least one row,
    and every column a reward function needs (its ground truth included), named under ``key``.

    Returns:
        The dataset's columns.

    Raises:
        ConfigErrors / ConfigError: as `sources.check_prompt_rows` and `sources.check_reward_funcs`, the
            messages naming ``key``.
    """
    from .sources import check_prompt_rows, check_reward_funcs

    if not hasattr(dataset, "__len__"):
        raise ConfigError(f"{key}: an IterableDataset (streaming) cannot be evaluated in full rounds. Fix: pass "
                          "a datasets.Dataset (not streaming)", key=key)
    if len(dataset) == 0:
        raise ConfigError(f"{key}: has no rows. Fix: give at least one eval prompt", key=key)
    columns = check_prompt_rows(dataset, "prompt", key=f"{key}['prompt']", dataset_key=key, allow_text=False)
    if funcs:
        check_reward_funcs(funcs, columns, reward_key_of or (lambda i: f"reward_funcs[{i}] (on {key})"), names)
    return columns
