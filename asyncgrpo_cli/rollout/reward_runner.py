"""Running reward functions inside the rollout worker (SPEC §10.1, §10.2, §2 item 11).

:class:`RewardRunner` calls every reward function on the completions of one group, all in parallel:
``async def`` functions are awaited concurrently on the event loop, synchronous ones run in threads,
so their latencies overlap. ``score_many`` does the same for several groups at once, each function
taking the groups in order (one thread hop per function and batch). Each function gets ``prompts``, ``completions``, ``completion_ids`` and
every dataset column except ``prompt`` as keyword arguments, and must return one reward (float, int
or ``None``) per completion.

:func:`check_picklable` is the start-up check that reward functions, tools and the environment
factory can travel to the spawned worker.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import pickle
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo_cli.rollout.advantages import sum_rewards

__all__ = [
    "RESERVED_REWARD_KWARGS",
    "RewardFunctionError",
    "RewardInputs",
    "RewardResult",
    "RewardRunner",
    "check_picklable",
    "reward_function_name",
]

#: Keyword arguments the runner itself passes; a dataset column may not use these names.
RESERVED_REWARD_KWARGS = ("prompts", "completions", "completion_ids")


class RewardFunctionError(ValueError):
    """A reward function returned something that is not one reward per completion."""


def reward_function_name(func: Callable[..., Any]) -> str:
    """Name used for a reward function in metrics (``rewards/{name}/mean``, SPEC §15.2).

    ``functools.partial`` objects take the name of the wrapped function, functions their
    ``__name__``, callable instances their class name.
    """
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name:
        return name
    return type(func).__name__


def _describe(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"functools.partial({_describe(obj.func)}, ...)"
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if isinstance(qualname, str):
        return f"{module}.{qualname}" if module else qualname
    return f"{type(obj).__module__}.{type(obj).__qualname__} instance"


def check_picklable(obj: Any, what: str) -> None:
    """Check that ``obj`` survives the standard ``pickle`` (SPEC §2 item 11, §10.2).

    Reward functions, tools and ``environment_factory`` are sent to the rollout worker, a process
    started with *spawn*; anything they close over travels with them.

    Args:
        obj: the object to check.
        what: what it is, for the message (e.g. ``"reward function"``, ``"tool"``).

    Raises:
        TypeError: ``obj`` cannot be pickled (a lambda, a closure, a local function, or something
            holding one). The message names the object and the fix: a module-level function, a
            ``functools.partial`` or a callable class instance.
    """
    try:
        pickle.dumps(obj)
    except Exception as exc:  # PicklingError, AttributeError ("Can't pickle local object"), TypeError
        hint = ""
        inner = obj
        while isinstance(inner, functools.partial):
            inner = inner.func
        qualname = getattr(inner, "__qualname__", "") or ""
        if getattr(inner, "__name__", None) == "<lambda>":
            hint = " It is a lambda."
        elif "<locals>" in qualname:
            hint = " It is defined inside another function (a closure or local function)."
        raise TypeError(
            f"{what} {_describe(obj)} cannot be pickled, but it must be sent to the rollout worker "
            f"process (started with spawn).{hint} Use a module-level function, a functools.partial "
            f"of one, or an instance of a module-level callable class instead. "
            f"(pickle said: {type(exc).__name__}: {exc})"
        ) from exc


def _is_async_callable(func: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(func):
        return True
    inner = func
    while isinstance(inner, functools.partial):
        inner = inner.func
    call = getattr(inner, "__call__", None)  # noqa: B004 - callable instances with async __call__
    return call is not None and inspect.iscoroutinefunction(call)


def _validate(name: str, result: Any, num_completions: int) -> list[float | None]:
    if isinstance(result, np.ndarray):
        if result.ndim != 1:
            raise RewardFunctionError(
                f"reward function {name!r} returned an array of shape {result.shape}; "
                f"return a list with one reward per completion ({num_completions})"
            )
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(result).__name__}; it must return a list "
            f"with one reward (float or None) per completion ({num_completions})"
        )
    if len(result) != num_completions:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(result)} rewards for {num_completions} "
            "completions; return exactly one entry (float or None) per completion"
        )
    out: list[float | None] = []
    for i, value in enumerate(result):
        if value is None:
            out.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value!r} ({type(value).__name__}) for "
                f"completion {i}; each reward must be a float, an int or None"
            )
        reward = float(value)
        if math.isnan(reward):
            out.append(None)  # NaN means "not scored", like None
            continue
        if math.isinf(reward):
            raise RewardFunctionError(
                f"reward function {name!r} returned {reward} for completion {i}; rewards must be "
                "finite (return None to leave a completion unscored)"
            )
        out.append(reward)
    return out


@dataclass
class RewardResult:
    """Rewards of one group from the reward functions.

    Attributes:
        per_function: reward-function name -> one reward (float or ``None``) per completion, in the
            order the functions were given.
        totals: float64 array of shape ``(G,)``: the sum over functions, ``None`` skipped, NaN where
            every function returned ``None`` (SPEC §3.2). Environment and rollout rewards are not
            included (see :func:`asyncgrpo_cli.rollout.advantages.total_rewards`).
    """

    per_function: dict[str, list[float | None]]
    totals: np.ndarray


class RewardRunner:
    """Runs reward functions in parallel on one group of completions (SPEC §10.2).

    Args:
        reward_funcs: one callable or a sequence of them (sync or ``async def``).
        executor: where synchronous functions run; ``None`` = the event loop's default thread pool.

    Attributes:
        names: one unique metric name per function, in order (:func:`reward_function_name`; a repeated
            name gets a suffix ``_2``, ``_3``, ...).

    Raises:
        TypeError: an entry of ``reward_funcs`` is not callable.
    """

    def __init__(
        self,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]],
        executor: Executor | None = None,
    ) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        for i, func in enumerate(funcs):
            if not callable(func):
                raise TypeError(
                    f"reward_funcs[{i}] is {type(func).__name__} {func!r}, not a callable; reward "
                    "models given as ids or models are not supported (README: Supported setups), pass a function"
                )
        self.funcs: list[Callable[..., Any]] = funcs
        self.names: list[str] = []
        seen: dict[str, int] = {}
        for func in funcs:
            base = reward_function_name(func)
            seen[base] = seen.get(base, 0) + 1
            self.names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
        self._is_async = [_is_async_callable(f) for f in funcs]
        self._executor = executor

    def check_picklable(self) -> None:
        """:func:`check_picklable` on every reward function (raises ``TypeError``)."""
        for func in self.funcs:
            check_picklable(func, "reward function")

    async def _call_many(self, index: int, kwargs_list: list[dict[str, Any]]) -> list[Any]:
        """Function ``index`` on each group in turn: one result or raised Exception per group.

        A sync function runs the whole batch in one job on the executor (one thread hop per batch, and
        never two calls of the same function at once, as when groups were scored one by one).
        """
        func = self.funcs[index]
        if self._is_async[index]:
            outcomes: list[Any] = []
            for kwargs in kwargs_list:
                try:
                    outcomes.append(await func(**kwargs))
                except Exception as exc:  # noqa: BLE001 - reported per group by score_many
                    outcomes.append(exc)
            return outcomes
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._executor, _call_each, func, kwargs_list)
        for i, result in enumerate(outcomes):
            if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
                try:
                    outcomes[i] = await result
                except Exception as exc:  # noqa: BLE001
                    outcomes[i] = exc
        return outcomes

    async def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Score the G completions of one group with every reward function, all in parallel.

        Args:
            prompts: G prompts (each a list of message dicts).
            completions: G completions (each a list of message dicts, ``Rollout.completion``).
            completion_ids: G token-id lists (``Rollout.completion_ids``).
            columns: dataset column name -> G values; ``prompt`` is left out, every other column is
                passed by its name.

        Returns:
            A :class:`RewardResult`.

        Raises:
            ValueError: the lengths disagree, or a column is named like a reserved argument
                (``prompts``, ``completions``, ``completion_ids``).
            RewardFunctionError: a function returned a wrong type, length or value (named).
            Exception: whatever a reward function raised, re-raised after all functions finished,
                with a note naming the function.
        """
        (result,) = await self.score_many([RewardInputs(prompts, completions, completion_ids, columns)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def score_many(self, groups: Sequence[RewardInputs]) -> list[RewardResult | Exception]:
        """Score several groups: the functions run in parallel as in `score`, each one on the groups in order.

        The rollout worker's scorer takes every group waiting in its queue at once: a sync function then
        costs one thread hop per batch instead of one per group (the hop waits for the event loop, which
        is busy parsing sampler answers). Each function is still called once per group, never twice at
        the same time; an async function is awaited group after group.

        Args:
            groups: the groups' inputs, as `score` takes them.

        Returns:
            One entry per group, in order: its `RewardResult`, or the Exception `score` would have
            raised for it (bad lengths or columns, a function's error with a note naming it, or
            `RewardFunctionError`). The functions are not called for a group with bad inputs.

        Raises:
            BaseException: a non-Exception (e.g. KeyboardInterrupt) raised by a reward function.
        """
        outcomes: list[RewardResult | Exception | None] = [None] * len(groups)
        valid: list[int] = []
        kwargs_list: list[dict[str, Any]] = []
        for j, group in enumerate(groups):
            try:
                kwargs_list.append(_reward_kwargs(group))
            except ValueError as exc:
                outcomes[j] = exc
                continue
            valid.append(j)
        per_func: list[Any] = []
        if valid:
            per_func = await asyncio.gather(
                *(self._call_many(i, kwargs_list) for i in range(len(self.funcs))), return_exceptions=True
            )
        noted: set[int] = set()
        for k, j in enumerate(valid):
            n = len(groups[j].completions)
            per_function: dict[str, list[float | None]] = {}
            try:
                for name, outcome in zip(self.names, per_func):
                    result = outcome if isinstance(outcome, BaseException) else outcome[k]
                    if isinstance(result, BaseException):
                        if isinstance(result, Exception) and id(result) not in noted:
                            noted.add(id(result))
                            result.add_note(f"raised by reward function {name!r}")
                        raise result
                    per_function[name] = _validate(name, result, n)
            except Exception as exc:  # noqa: BLE001 - returned for this group
                outcomes[j] = exc
                continue
            outcomes[j] = RewardResult(per_function=per_function, totals=sum_rewards(per_function.values(), n))
        return outcomes  # type: ignore[return-value]


@dataclass
class RewardInputs:
    """What `RewardRunner.score` takes for one group (see there)."""

    prompts: Sequence[Any]
    completions: Sequence[Any]
    completion_ids: Sequence[Sequence[int]]
    columns: Mapping[str, Sequence[Any]] | None = None


def _call_each(func: Callable[..., Any], kwargs_list: list[dict[str, Any]]) -> list[Any]:
    """Runs on the executor: ``func`` on each group's kwargs, an Exception kept in place of its result."""
    outcomes: list[Any] = []
    for kwargs in kwargs_list:
        try:
            outcomes.append(func(**kwargs))
        except Exception as exc:  # noqa: BLE001 - reported per group by score_many
            outcomes.append(exc)
    return outcomes


def _reward_kwargs(group: RewardInputs) -> dict[str, Any]:
    """The keyword arguments of every reward function for one group (SPEC §10.1).

    Raises:
        ValueError: the lengths disagree, or a column is named like a reserved argument.
    """
    prompts, completions, completion_ids = group.prompts, group.completions, group.completion_ids
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(
            f"score: got {len(prompts)} prompts, {n} completions and {len(completion_ids)} "
            "completion_ids; give one of each per completion"
        )
    kwargs: dict[str, Any] = {
        "prompts": list(prompts),
        "completions": list(completions),
        "completion_ids": list(completion_ids),
    }
    for column, values in (group.columns or {}).items():
        if column == "prompt":
            continue
        if column in RESERVED_REWARD_KWARGS:
            raise ValueError(
                f"dataset column {column!r} clashes with the reward-function argument of the same "
                "name; rename the column"
            )
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(
                f"dataset column {column!r} must hold one value per completion ({n}), got {got}"
            )
        kwargs[column] = list(values)
    return kwargs
