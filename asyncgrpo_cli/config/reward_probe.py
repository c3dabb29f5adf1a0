"""Each reward function called once before anything starts (issue #45): a reward that raises, or that returns
something other than numbers or None, was found only when the first group was scored (a minute into the CPU
smoke job; after vLLM's 3-minute start on a GPU). `probe_reward_funcs` calls every reward function once on
the first prompt of the data with a group of two stand-in completions (`STAND_IN_COMPLETIONS`; two, so that a
function returning a fixed-length list is caught), as the rollout worker calls it (``prompts``, ``completions``,
``completion_ids`` and every other column of that row, by keyword, lists of two),
and refuses at start with the function's own error and the fix. ``asyncgrpo train``, its ``--dry-run`` and
``asyncgrpo config --check`` run it (`run_checks.validate_run`), and so does ``AsyncGRPOTrainer(...)``
(`run_checks.validate_trainer_inputs`).

Skipping the call, for a reward with side effects (a paid judge, a call that writes somewhere): the function's
attribute ``probe_at_start = False`` (Python API and CLI), or ``probe: false`` in its ``rewards`` entry
(CLI: ``'rewards=[{func: mymod:judge, probe: false}]'``). The built-in ``accuracy_reward`` is not called (it is
tested here, and its first call starts a process pool of math-verify).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .rules import ConfigError, ConfigErrors, config_error as _err

STAND_IN_COMPLETION = "The answer is 0."
"""The text of the first stand-in completion the probe scores (an assistant message for conversational prompts)."""
STAND_IN_COMPLETIONS = (STAND_IN_COMPLETION, "I cannot tell.")
"""The probe's group: two completions, so a function that returns a fixed-length list is caught."""
STAND_IN_IDS = [16, 17, 18]
"""Its ``completion_ids`` (any ids: a reward that decodes them gets some text)."""
PROBE_TIMEOUT_S = 60.0
"""Seconds one probe call may take; a slower function is not refused (a warning says it was not checked)."""


def probe_enabled(func: Any) -> bool:
    """False when ``func`` (or the function a ``functools.partial`` wraps) has ``probe_at_start = False``."""
    while func is not None:
        flag = getattr(func, "probe_at_start", None)
        if flag is not None:
            return bool(flag)
        func = getattr(func, "func", None)  # functools.partial
    return True


def stand_in_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one probe call for the dataset ``row`` (a group of the `STAND_IN_COMPLETIONS`)."""
    prompt = row.get("prompt")
    conversational = isinstance(prompt, (list, tuple))
    n = len(STAND_IN_COMPLETIONS)
    completions: list[Any] = [[{"role": "assistant", "content": text}] if conversational else text
                              for text in STAND_IN_COMPLETIONS]
    kwargs: dict[str, Any] = {"prompts": [prompt] * n, "completions": completions,
                              "completion_ids": [list(STAND_IN_IDS), list(STAND_IN_IDS[:1])]}
    for column, value in row.items():
        if column not in ("prompt", "prompts", "completions", "completion_ids"):
            kwargs[column] = [value] * n
    return kwargs


def _call(func: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    result = func(**kwargs)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result
        result = asyncio.run(wait())
    return result


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the frame that raised (the reward's own code, not ours)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name})"


def _bad_result(result: Any) -> str | None:
    """Why ``result`` is not one reward per stand-in completion (None when it is)."""
    n = len(STAND_IN_COMPLETIONS)
    if hasattr(result, "tolist") and getattr(result, "ndim", 1) == 1:
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        return f"it returned {type(result).__name__} {result!r:.80}, not a list with one reward per completion"
    if len(result) != n:
        return f"it returned {len(result)} rewards for {n} completions"
    for value in result:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return (f"it returned {list(result)!r:.80} ({type(value).__name__}); each reward must be a number "
                    "(float or int) or None")
        if math.isinf(float(value)):
            return f"it returned {list(result)}; rewards must be finite (None leaves a completion unscored)"
    return None


def probe_reward_funcs(funcs: Sequence[Any], row: dict[str, Any], key_of: Callable[[int], str],
                       names: Sequence[str] | None = None, skip: Sequence[bool] | None = None,
                       skip_hint: Callable[[int], str] | None = None,
                       timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """Call each reward function once on ``row`` with the stand-in completion (module docstring).

    Args:
        funcs: the reward callables (already imported and checked by `sources.check_reward_funcs`).
        row: the first row of the dataset (a dict of its columns; ``prompt`` holds the prompt).
        key_of: the key of function ``i`` in errors (``rewards[0].func``, ``reward_funcs[0]``).
        names: how each function was named (its import path), for the messages.
        skip: per function, True to leave it uncalled (``rewards[i].probe=false``).
        skip_hint: the way to skip function ``i``, named in the fix (default: its ``probe_at_start`` attribute).
        timeout_s: how long one call may take before it is left unchecked (a warning), seconds.

    Returns:
        Warnings (a call that did not return within ``timeout_s``).

    Raises:
        ConfigErrors: every function that raised (its exception, message and where) or returned something that
            is not one number or None per completion, each with the fix.
    """
    errors: list[ConfigError] = []
    warnings: list[str] = []
    for i, func in enumerate(funcs):
        if (skip is not None and i < len(skip) and skip[i]) or not probe_enabled(func) or not callable(func):
            continue
        shown = names[i] if names and i < len(names) else getattr(func, "__name__", type(func).__name__)
        how_to_skip = skip_hint(i) if skip_hint is not None else \
            f"set {getattr(func, '__name__', 'the function')}.probe_at_start = False"
        box: dict[str, Any] = {}

        def run(func=func, box=box) -> None:
            try:
                box["result"] = _call(func, stand_in_kwargs(row))
            except BaseException as exc:  # noqa: BLE001 - the function's own error is the message
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"reward-probe-{i}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        called = (f"called once before the start on the first prompt with {len(STAND_IN_COMPLETIONS)} stand-in "
                  f"completions {list(STAND_IN_COMPLETIONS)!r}")
        if thread.is_alive():
            warnings.append(f"{key_of(i)}={shown}: {called}, it had not returned after {timeout_s:g} s; it was not "
                            f"checked (for a reward with side effects or a slow judge: {how_to_skip})")
            continue
        later = (f"(the run would fail at the first group it scores); a reward that must not run before the start "
                 f"(side effects, a paid judge): {how_to_skip}")
        if "error" in box:
            exc = box["error"]
            errors.append(_err(key_of(i), shown, f"{called}, it raised {type(exc).__name__}: {str(exc)[:300]}"
                               f"{_where(exc)}", f"correct the function {later}"))
            continue
        why = _bad_result(box.get("result"))
        if why is not None:
            errors.append(_err(key_of(i), shown, f"{called}, {why}", "return a list with one number (or None) per "
                               f"completion {later}"))
    if errors:
        raise ConfigErrors(errors) if len(errors) > 1 else errors[0]
    return warnings
