"""RewardRunner and check_picklable (SPEC §10.1, §10.2, §2 item 11)."""

import asyncio
import functools
import math
import threading

import numpy as np
import pytest

from asyncgrpo_cli.rollout.reward_runner import (
    RewardFunctionError,
    RewardRunner,
    check_picklable,
    reward_function_name,
)

PROMPTS = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]
COMPLETIONS = [[{"role": "assistant", "content": " blue."}], [{"role": "assistant", "content": " in the sky."}]]
IDS = [[6303, 13], [304, 279, 12884, 13]]


def length_func(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


async def async_nonempty(completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0 if c[0]["content"] else 0.0 for c in completions]


def math_only(prompts, completions, task, **kwargs):
    return [1.0 if t == "math" else None for t in task]


def code_only(prompts, completions, task, **kwargs):
    return [-1.0 if t == "code" else None for t in task]


def never_scores(**kwargs):
    return [None] * len(kwargs["completions"])


def records_kwargs(**kwargs):
    records_kwargs.seen = kwargs
    return [0.0] * len(kwargs["completions"])


class Scorer:
    def __init__(self, value):
        self.value = value

    def __call__(self, completions, **kwargs):
        return [self.value] * len(completions)


class AsyncScorer:
    async def __call__(self, completions, **kwargs):
        return [2.0] * len(completions)


def weighted(completions, weight, **kwargs):
    return [weight] * len(completions)


def run(coro):
    return asyncio.run(coro)


def test_names():
    assert reward_function_name(length_func) == "length_func"
    assert reward_function_name(Scorer(1.0)) == "Scorer"
    assert reward_function_name(functools.partial(weighted, weight=2.0)) == "weighted"
    runner = RewardRunner([functools.partial(weighted, weight=1.0), functools.partial(weighted, weight=2.0)])
    assert runner.names == ["weighted", "weighted_2"]


def test_mixed_sync_async_and_columns():
    runner = RewardRunner([length_func, async_nonempty, Scorer(0.5), AsyncScorer(), records_kwargs])
    result = run(
        runner.score(PROMPTS, COMPLETIONS, IDS, {"prompt": ["x", "y"], "ground_truth": ["2", "5"]})
    )
    assert list(result.per_function) == ["length_func", "async_nonempty", "Scorer", "AsyncScorer", "records_kwargs"]
    assert result.per_function["length_func"] == [2.0, 4.0]
    assert result.per_function["async_nonempty"] == [1.0, 1.0]
    np.testing.assert_allclose(result.totals, [2.0 + 1 + 0.5 + 2, 4.0 + 1 + 0.5 + 2])
    seen = records_kwargs.seen
    assert set(seen) == {"prompts", "completions", "completion_ids", "ground_truth"}  # no 'prompt'
    assert seen["ground_truth"] == ["2", "5"]
    assert seen["completion_ids"] == IDS


def test_none_rewards_multi_task():
    runner = RewardRunner([math_only, code_only, never_scores])
    tasks = ["math", "code", "other"]
    result = run(runner.score([[]] * 3, [[{"role": "assistant", "content": "a"}]] * 3, [[1]] * 3, {"task": tasks}))
    assert result.per_function["math_only"] == [1.0, None, None]
    assert result.per_function["never_scores"] == [None, None, None]
    assert result.totals[0] == 1.0 and result.totals[1] == -1.0
    assert math.isnan(result.totals[2])


def test_single_function_and_no_function():
    result = run(RewardRunner(length_func).score(PROMPTS, COMPLETIONS, IDS))
    assert result.totals.tolist() == [2.0, 4.0]
    empty = run(RewardRunner([]).score(PROMPTS, COMPLETIONS, IDS))
    assert empty.per_function == {} and np.isnan(empty.totals).all()


def wrong_length(completions, **kwargs):
    return [1.0]


def wrong_type(completions, **kwargs):
    return 1.0


def wrong_entry(completions, **kwargs):
    return ["1.0"] * len(completions)


def infinite(completions, **kwargs):
    return [math.inf] * len(completions)


def nan_and_bool_and_numpy(completions, **kwargs):
    return np.array([float("nan"), 1.0])


def bools(completions, **kwargs):
    return [True, False]


@pytest.mark.parametrize(
    "func, match",
    [
        (wrong_length, r"'wrong_length' returned 1 rewards for 2 completions"),
        (wrong_type, r"'wrong_type' returned float"),
        (wrong_entry, r"'wrong_entry' returned '1.0' \(str\)"),
        (infinite, r"'infinite' returned inf"),
    ],
)
def test_invalid_results_name_the_function(func, match):
    runner = RewardRunner([length_func, func])
    with pytest.raises(RewardFunctionError, match=match):
        run(runner.score(PROMPTS, COMPLETIONS, IDS))
    assert issubclass(RewardFunctionError, ValueError)


def test_nan_is_unscored_bool_and_numpy_accepted():
    result = run(RewardRunner([nan_and_bool_and_numpy, bools]).score(PROMPTS, COMPLETIONS, IDS))
    assert result.per_function["nan_and_bool_and_numpy"] == [None, 1.0]
    assert result.per_function["bools"] == [1.0, 0.0]
    assert result.totals.tolist() == [1.0, 1.0]


def boom(completions, **kwargs):
    raise KeyError("missing column")


async def async_boom(completions, **kwargs):
    raise RuntimeError("server down")


def test_raising_functions_propagate_with_a_note():
    with pytest.raises(KeyError) as info:
        run(RewardRunner([length_func, boom]).score(PROMPTS, COMPLETIONS, IDS))
    assert any("'boom'" in note for note in info.value.__notes__)
    with pytest.raises(RuntimeError, match="server down") as info:
        run(RewardRunner([async_boom]).score(PROMPTS, COMPLETIONS, IDS))
    assert any("'async_boom'" in note for note in info.value.__notes__)


def test_bad_columns_and_lengths():
    runner = RewardRunner(length_func)
    with pytest.raises(ValueError, match="'completions' clashes"):
        run(runner.score(PROMPTS, COMPLETIONS, IDS, {"completions": [1, 2]}))
    with pytest.raises(ValueError, match="'answer' must hold one value per completion"):
        run(runner.score(PROMPTS, COMPLETIONS, IDS, {"answer": ["1"]}))
    with pytest.raises(ValueError, match="completion_ids"):
        run(runner.score(PROMPTS, COMPLETIONS, IDS[:1]))
    with pytest.raises(TypeError, match=r"reward_funcs\[1\]"):
        RewardRunner([length_func, "my-org/reward-model"])


class BarrierReward:
    """Sync reward that only returns once `parties` calls are inside it at the same time."""

    def __init__(self, barrier):
        self.barrier = barrier

    def __call__(self, completions, **kwargs):
        self.barrier.wait()  # raises BrokenBarrierError on timeout: functions did not overlap
        return [1.0] * len(completions)


def test_sync_functions_overlap_in_threads():
    barrier = threading.Barrier(3, timeout=30)
    runner = RewardRunner([BarrierReward(barrier), BarrierReward(barrier), BarrierReward(barrier)])
    result = run(runner.score(PROMPTS, COMPLETIONS, IDS))
    assert result.totals.tolist() == [3.0, 3.0]


def test_async_and_sync_overlap():
    """An async function waits on an event that only a concurrently running sync function sets."""
    state = {}

    async def main():
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        state["loop"], state["event"] = loop, event

        async def waits(completions, **kwargs):
            await asyncio.wait_for(event.wait(), timeout=30)
            return [1.0] * len(completions)

        def sets(completions, **kwargs):
            loop.call_soon_threadsafe(event.set)
            return [1.0] * len(completions)

        return await RewardRunner([waits, sets]).score(PROMPTS, COMPLETIONS, IDS)

    assert run(main()).totals.tolist() == [2.0, 2.0]


def make_closure():
    threshold = 3

    def reward(completion_ids, **kwargs):
        return [float(len(ids) > threshold) for ids in completion_ids]

    return reward


def test_check_picklable_accepts_module_level_partial_and_instance():
    check_picklable(length_func, "reward function")
    check_picklable(functools.partial(weighted, weight=0.5), "reward function")
    check_picklable(Scorer(1.0), "reward function")
    RewardRunner([length_func, Scorer(1.0)]).check_picklable()


def test_check_picklable_rejects_lambda_and_closure():
    with pytest.raises(TypeError, match="lambda") as info:
        check_picklable(lambda completions, **kw: [0.0] * len(completions), "reward function")
    message = str(info.value)
    assert "reward function" in message and "<lambda>" in message
    assert "module-level function" in message and "functools.partial" in message and "callable class" in message

    with pytest.raises(TypeError, match="make_closure.<locals>.reward") as info:
        check_picklable(make_closure(), "tool")
    assert str(info.value).startswith("tool ")
    assert "closure" in str(info.value)

    with pytest.raises(TypeError, match="functools.partial"):
        RewardRunner([functools.partial(make_closure(), completion_ids=[])]).check_picklable()


class CountingExecutor:
    """A thread pool that counts the jobs handed to it."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(4)
        self.jobs = 0

    def submit(self, fn, *args):
        self.jobs += 1
        return self.pool.submit(fn, *args)

    def shutdown(self, wait=True, **kwargs):
        self.pool.shutdown(wait)


class OrderRecorder:
    """Sync reward that records each call's first completion and fails on the word 'boom'."""

    def __init__(self):
        self.calls, self.active, self.overlapped = [], 0, False
        self.lock = threading.Lock()

    def __call__(self, completions, **kwargs):
        with self.lock:
            self.active += 1
            self.overlapped |= self.active > 1
        try:
            text = completions[0][0]["content"]
            self.calls.append(text)
            if text == "boom":
                raise KeyError("boom")
            return [float(len(c[0]["content"])) for c in completions]
        finally:
            with self.lock:
                self.active -= 1


def group(text, n=2, **columns):
    from asyncgrpo_cli.rollout.reward_runner import RewardInputs

    return RewardInputs([PROMPTS[0]] * n, [[{"role": "assistant", "content": text}]] * n, [[1]] * n, columns or None)


def test_score_many_one_thread_hop_per_function_and_groups_in_order():
    executor, recorder = CountingExecutor(), OrderRecorder()
    runner = RewardRunner([recorder, async_nonempty], executor=executor)
    texts = ["a", "bb", "boom", "dddd"]
    bad = group("x", task=["math"])  # a column with one value for two completions
    try:
        results = run(runner.score_many([group(t) for t in texts[:2]] + [bad] + [group(t) for t in texts[2:]]))
    finally:
        executor.shutdown()
    assert executor.jobs == 1  # one thread hop for the sync function and the whole batch
    assert recorder.calls == texts and not recorder.overlapped  # each group once, in order, never two at once
    assert [r.totals.tolist() for r in (results[0], results[1], results[4])] == [[2.0, 2.0], [3.0, 3.0], [5.0, 5.0]]
    assert isinstance(results[2], ValueError) and "task" in str(results[2])
    assert isinstance(results[3], KeyError) and any("OrderRecorder" in note for note in results[3].__notes__)
    assert results[0].per_function["OrderRecorder"] == [1.0, 1.0]


def test_score_is_score_many_of_one_group():
    result = run(RewardRunner([length_func, async_nonempty]).score(PROMPTS, COMPLETIONS, IDS))
    many = run(RewardRunner([length_func, async_nonempty]).score_many([group(" blue.")]))
    assert result.totals.tolist() == [3.0, 5.0] and many[0].per_function["async_nonempty"] == [1.0, 1.0]
    with pytest.raises(KeyError, match="boom"):
        run(RewardRunner(OrderRecorder()).score(PROMPTS, [[{"role": "assistant", "content": "boom"}]] * 2, IDS))
