"""``accuracy_reward``: math answer checking with math-verify (SPEC §1.2, §10.2).

The ground truth comes from the dataset column ``solution`` (e.g. DeepMath-103K) or ``answer`` (e.g.
reasoning-gym rows) and is parsed with ``math_verify.parse``'s defaults. Only the completion's **final
answer** is credited (`asyncgrpo_cli.rewards.final_answer`): a ``\\boxed{...}`` answer, an explicit final
statement ("the answer is 42", "#### 42"), "= 42" ending a computation, or a bare answer, the last one
written; an expression of numbers not followed by its value ("To compute 3 + 4, add them") is no answer.
``math_verify.verify`` then compares it with the ground truth symbolically (``\\frac{1}{2}`` = ``0.5``).

math-verify bounds its own work with ``signal.alarm``, which only works in a process's main thread, and
reward functions run in worker threads. Verification therefore runs in a module-level
:class:`concurrent.futures.ProcessPoolExecutor` (spawn start method, created on first use, kept warm
across calls, shut down at interpreter exit). Inside a pool process every completion is bounded by
our own interval timer (``verification_timeout_s``); a completion that runs out of time scores 0.0 and
is counted (:func:`verification_timeouts`). A pool process that stops answering (stuck outside
Python, where no signal can interrupt it) is killed after a generous grace period, its completions
scoring 0.0 and counting as timeouts too. Nothing is ever verified without a timeout.

A call's completions go to the pool in a few tasks, not one each (`_tasks_per_call`): each task costs the
calling process, the rollout worker, Python time of its own. So a process stuck past its grace period scores the
other completions of its task 0.0 as well.
"""

from __future__ import annotations

import atexit
import importlib.util
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait
from typing import Any

__all__ = [
    "DEFAULT_VERIFICATION_TIMEOUT_S",
    "accuracy_reward",
    "completion_text",
    "shutdown_verification_pool",
    "verification_timeouts",
    "warm_up_verification_pool",
]

#: Default time allowed to parse and verify one completion, in seconds.
DEFAULT_VERIFICATION_TIMEOUT_S = 10.0
#: Extra seconds the caller waits for pool processes beyond their own per-completion timers
#: (covers spawning the pool and importing sympy on a loaded machine).
_POOL_GRACE_S = 120.0
_WORKERS_ENV = "ASYNCGRPO_MATH_VERIFY_WORKERS"

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()
_timeouts = 0
_timeouts_lock = threading.Lock()
_atexit_registered = False
_math_verify_found = False  # math-verify was found once: not looked up again at every call


# --------------------------------------------------------------------------- text helpers
def completion_text(completion: Any) -> str:
    """Text of a completion: a plain string, or the last assistant message of a conversational one.

    Message ``content`` may be a string or a list of parts (``{"type": "text", "text": ...}``).
    """
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    messages = list(completion)
    if not messages:
        return ""
    chosen = next(
        (m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        messages[-1],
    )
    return completion_text(chosen)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


# --------------------------------------------------------------------------- pool side
class _VerificationTimeout(BaseException):
    """Raised by the interval timer inside a pool process. A BaseException, so that math-verify's and
    sympy's ``except Exception`` blocks cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _VerificationTimeout()


def _worker_init() -> None:
    """Pool-process initializer: import math-verify and exercise it once, with no timer armed, so
    that an early timeout can never interrupt a half-done import or lazy initialisation."""
    import logging

    # We run math-verify with its own (signal) timeouts off and bound it ourselves; silence the
    # warning it logs about that.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    from asyncgrpo_cli.rewards.final_answer import extract_final_answer

    try:
        verify(
            parse("$\\frac{1}{2}$", parsing_timeout=None),
            extract_final_answer("so the answer is \\boxed{0.5}"),
            timeout_seconds=None,
        )
    except Exception:  # warming up is best effort
        pass
    signal.signal(signal.SIGALRM, _on_alarm)


def _warm_up() -> bool:
    return True


def _verify_one(gold_text: str, answer_text: str, timeout_s: float) -> tuple[str, float | None]:
    """Run in a pool process. Returns ``("ok", 1.0|0.0)``, ``("no_gold", None)`` or ``("timeout", 0.0)``."""
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            from math_verify import parse, verify

            from asyncgrpo_cli.rewards.final_answer import extract_final_answer

            gold = parse(gold_text, extraction_mode="first_match", parsing_timeout=None)
            if not gold:
                return ("no_gold", None)
            answer = extract_final_answer(answer_text)
            if not answer:
                return ("ok", 0.0)
            correct = verify(gold, answer, timeout_seconds=None)
            return ("ok", 1.0 if correct else 0.0)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _VerificationTimeout:
        return ("timeout", 0.0)
    except Exception:  # a parser bug on odd input: that completion is simply not correct
        return ("ok", 0.0)


def _verify_many(verify_one: Any, items: list[tuple[str, str]], timeout_s: float) -> list[tuple[str, float | None]]:
    """Run in a pool process: ``verify_one(gold, answer, timeout_s)`` for each item, each under its own timer."""
    return [verify_one(gold_text, answer_text, timeout_s) for gold_text, answer_text in items]


# --------------------------------------------------------------------------- caller side
def _tasks_per_call(workers: int, jobs: int) -> int:
    """Pool tasks one call's ``jobs`` completions go out as (issue #41).

    Every task costs the calling process about 0.2 ms of its own Python (pickling, the pool's manager and feeder
    threads), which in a rollout worker competes with the answers it parses; one task per completion took half the
    worker's CPU per rollout with the arith recipe's answers (`scripts/bench/bench_worker_ingest.py --reward
    accuracy`). The rollout worker scores up to 4 groups at once (`rollout.loop.SCORERS`), so a call spreads over
    a quarter of the pool: with every scorer calling, every pool process has a task."""
    return max(1, min(jobs, workers // 4))


def _num_workers() -> int:
    raw = os.environ.get(_WORKERS_ENV)
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{_WORKERS_ENV} must be an integer >= 1, got {raw!r}") from None
        if value < 1:
            raise ValueError(f"{_WORKERS_ENV} must be an integer >= 1, got {raw!r}")
        return value
    return max(1, min(8, os.cpu_count() or 1))


def _get_pool() -> ProcessPoolExecutor:
    global _pool, _atexit_registered
    with _pool_lock:
        if _pool is None:
            if multiprocessing.current_process().daemon:
                raise RuntimeError(
                    "accuracy_reward needs a process pool for math-verify, but it runs in a daemonic "
                    "process, which may not start children; start the rollout worker with daemon=False"
                )
            _pool = ProcessPoolExecutor(
                max_workers=_num_workers(),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
            )
            if not _atexit_registered:
                atexit.register(shutdown_verification_pool)
                _atexit_registered = True
        return _pool


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool`` now, terminating processes that may be stuck, and forget it."""
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        try:
            process.terminate()
        except Exception:  # already gone
            pass
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown_verification_pool() -> None:
    """Shut down the verification process pool (registered with ``atexit``; safe to call twice).

    The next ``accuracy_reward`` call starts a new pool.
    """
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def verification_timeouts() -> int:
    """How many completions timed out during verification in this process so far (each scored 0.0)."""
    return _timeouts


def _count_timeouts(n: int) -> None:
    global _timeouts
    if n:
        with _timeouts_lock:
            _timeouts += n


def accuracy_reward(
    completions: Sequence[Any],
    solution: Sequence[Any] | None = None,
    answer: Sequence[Any] | None = None,
    verification_timeout_s: float = DEFAULT_VERIFICATION_TIMEOUT_S,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when a completion's final answer equals the ground truth, else 0.0 (math-verify).

    The final answer is what `asyncgrpo_cli.rewards.final_answer.extract_final_answer` finds: boxed first,
    then an explicit final statement, then the last value written; a restated expression ("3 + 4") is
    none and scores 0.0.

    Args:
        completions: G completions, each a string or a list of message dicts (the last assistant
            message is checked).
        solution: G ground truths (dataset column ``solution``), or
        answer: G ground truths (dataset column ``answer``); used when ``solution`` is not given.
        verification_timeout_s: seconds allowed to parse and verify one completion (> 0); set it with
            ``functools.partial(accuracy_reward, verification_timeout_s=...)``.
        **kwargs: other reward-function arguments (``prompts``, ``completion_ids``, other columns),
            ignored.

    Returns:
        One entry per completion: 1.0 (correct), 0.0 (wrong, no answer found, or verification timed
        out; timeouts are counted by :func:`verification_timeouts`), ``None`` when the ground truth
        is missing or cannot be parsed (the completion is then not scored by this function).

    Raises:
        ValueError: neither ``solution`` nor ``answer`` is given, their length differs from
            ``completions``, or ``verification_timeout_s`` is not > 0.
        RuntimeError: called in a daemonic process (no pool can be started).
        ImportError: math-verify is not installed.
        RuntimeError: the verification pool fails twice in a row (see the message for the fix).
    """
    gold_column, name = (solution, "solution") if solution is not None else (answer, "answer")
    if gold_column is None:
        raise ValueError(
            "accuracy_reward needs the ground truth in a dataset column named 'solution' or 'answer'; "
            "neither was passed"
        )
    if len(gold_column) != len(completions):
        raise ValueError(
            f"accuracy_reward: column {name!r} has {len(gold_column)} values for "
            f"{len(completions)} completions"
        )
    timeout_s = float(verification_timeout_s)
    if not timeout_s > 0 or math.isinf(timeout_s):
        raise ValueError(
            f"verification_timeout_s must be a finite number of seconds > 0, got {verification_timeout_s!r}"
        )

    rewards: list[float | None] = [None] * len(completions)
    jobs: list[tuple[int, str, str]] = []
    for i, (completion, gold) in enumerate(zip(completions, gold_column)):
        if gold is None or (isinstance(gold, float) and math.isnan(gold)):
            continue
        gold_text = str(gold).strip()
        if not gold_text:
            continue
        jobs.append((i, gold_text, completion_text(completion)))
    if not jobs:
        return rewards

    global _math_verify_found
    if not _math_verify_found and importlib.util.find_spec("math_verify") is None:
        raise ImportError(
            "accuracy_reward needs math-verify: pip install 'math-verify[antlr4_9_3]' "
            "(or the asyncgrpo package, which depends on it)"
        )
    _math_verify_found = True
    results, timed_out = _run_jobs(jobs, timeout_s)
    for i, value in results.items():
        rewards[i] = value
    _count_timeouts(timed_out)
    return rewards


accuracy_reward.ground_truth_columns = ("solution", "answer")  # checked before start (config.sources)
accuracy_reward.probe_at_start = False  # not called before the start (config.reward_probe): tested here, and its
# first call starts the math-verify process pool


def _run_jobs(
    jobs: list[tuple[int, str, str]], timeout_s: float
) -> tuple[dict[int, float | None], int]:
    """Verify ``(index, gold_text, completion_text)`` jobs in the pool.

    Returns ``({index: reward}, number of timeouts)``. Jobs hit by a broken pool (e.g. another call
    killed a stuck process) are retried once on a fresh pool.

    Raises:
        RuntimeError: the pool fails twice in a row (its processes cannot start or crash).
    """
    results: dict[int, float | None] = {}
    timed_out = 0
    pending = jobs
    last_error: BaseException | None = None
    for _attempt in range(2):
        pool = _get_pool()
        workers = max(1, getattr(pool, "_max_workers", 1))
        size = math.ceil(len(pending) / _tasks_per_call(workers, len(pending)))
        futures: dict[Future, list[tuple[int, str, str]]] = {}
        try:
            for k in range(0, len(pending), size):
                chunk = pending[k:k + size]
                futures[pool.submit(_verify_many, _verify_one, [(j[1], j[2]) for j in chunk], timeout_s)] = chunk
        except Exception as exc:  # broken or shut down under us: drop it and retry on a new pool
            last_error = exc
            for future in futures:
                future.cancel()
            _kill_pool(pool)
            continue
        # Each pool process bounds every completion itself; this outer bound only catches a
        # process stuck where signals cannot reach it.
        rounds = math.ceil(len(futures) / workers)
        done, not_done = wait(futures, timeout=_POOL_GRACE_S + timeout_s * (rounds * size + 1))
        failed: list[tuple[int, str, str]] = []
        for future in done:
            chunk = futures[future]
            try:
                outcomes = future.result()
            except Exception as exc:  # BrokenProcessPool, or the call could not run in the pool
                last_error = exc
                failed.extend(chunk)
                continue
            for job, (status, value) in zip(chunk, outcomes):
                if status == "timeout":
                    timed_out += 1
                results[job[0]] = value
        if not_done:
            _kill_pool(pool)
            for future in not_done:
                for job in futures[future]:
                    results[job[0]] = 0.0
                    timed_out += 1
        if not failed:
            return results, timed_out
        _kill_pool(pool)
        pending = failed
    raise RuntimeError(
        "accuracy_reward: the math-verify process pool failed twice "
        f"({type(last_error).__name__}: {last_error}). Its processes are started with spawn and "
        "re-import your main script: guard the training code with `if __name__ == \"__main__\":`, "
        "and check that math-verify imports in a fresh interpreter."
    ) from last_error


def warm_up_verification_pool(timeout_s: float = _POOL_GRACE_S) -> None:
    """Start the pool and import math-verify in one of its processes ahead of the first reward call.

    Raises:
        TimeoutError: the pool did not answer within ``timeout_s`` seconds.
    """
    try:
        _get_pool().submit(_warm_up).result(timeout=timeout_s)
    except FutureTimeoutError as exc:
        raise TimeoutError(
            f"the math-verify process pool did not start within {timeout_s} s"
        ) from exc
