"""The worker's scorer takes every waiting group in one batch (one thread hop per reward function), keeps
queue order, and the loop freezes its start-up heap only while it runs (P6, scripts/bench/NOTES.md)."""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.rollout.reward_runner import RewardRunner
from asyncgrpo_cli.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

G = 4


class _Value:
    def __init__(self, value):
        self.value = value


class CountingExecutor(ThreadPoolExecutor):
    """A thread pool that counts the jobs handed to it."""

    def __init__(self):
        super().__init__(2)
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


class RecordingReward:
    """Alternating rewards (no group is dropped); records the row of each call and its thread."""

    def __init__(self):
        self.rows, self.threads = [], set()

    def __call__(self, completions, row, **kwargs):
        self.rows.append(row[0])
        self.threads.add(threading.get_ident())
        return [float(i % 2) for i in range(len(completions))]


def make_loop(tmp_path, reward, loop_cls=AsyncRolloutLoop, client=None, n_prompts=4):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=G, max_completion_length=4,
                          vllm_server_base_url="http://127.0.0.1:1", max_concurrent_rollouts=8,
                          vllm_server_timeout=30.0, report_to="none")
    dataset = [{"prompt": [{"role": "user", "content": f"q{i}"}], "row": i} for i in range(n_prompts)]
    return loop_cls(cfg, "m", dataset, [reward], None, [0], queue.Queue(), _Value(0), _Value(1e9), _Value(0.0),
                    threading.Event(), queue.Queue(), queue.Queue(), client=client, consumed_tokens_value=_Value(0.0))


def make_group(loop, row):
    rollouts, sequences = [], []
    loop.allowance.on_group_started(G)
    for _ in range(G):
        seq = TrainingSequence(input_ids=[1, 2, 3], trained_mask=[0, 1, 1], sampler_logprobs=[0.0, -0.5, -0.5],
                               advantage=0.0, group_id=row, row_index=row, model_version=0)
        loop.allowance.on_rollout_finished(seq.num_tokens)
        rollouts.append(Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=[2, 3], turns=[]))
        sequences.append([seq])
    loop.allowance.on_group_finished()
    group = RolloutGroup(prompts=[[{"role": "user", "content": f"q{row}"}]] * G, reward_kwargs={"row": [row] * G},
                         completions=[r.completion for r in rollouts], completions_ids=[r.completion_ids for r in rollouts],
                         completions_sequences=sequences, tool_call_counts=[0] * G, tool_failure_counts=[0] * G,
                         model_version=0, group_id=row, row_index=row, env_rewards=[None] * G,
                         rollout_rewards=[None] * G, queued_at=time.monotonic())
    return group, rollouts, 100 + row


def test_waiting_groups_are_scored_in_one_batch_in_queue_order(tmp_path):
    reward, executor = RecordingReward(), CountingExecutor()
    loop = make_loop(tmp_path, reward)
    loop.reward_runner = RewardRunner([reward], executor=executor)

    async def main():
        score_queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        for row in (2, 0, 3, 1):
            score_queue.put_nowait(make_group(loop, row))
        scorer = asyncio.create_task(loop._scorer(score_queue))
        deadline = time.monotonic() + 30
        while loop.rollout_buffer.qsize() < 4:
            assert time.monotonic() < deadline and not scorer.done()
            await asyncio.sleep(0.01)
        scorer.cancel()

    try:
        asyncio.run(main())
    finally:
        executor.shutdown()
    outcomes = [loop.rollout_buffer.get_nowait() for _ in range(4)]
    assert [o.position for o in outcomes] == [102, 100, 103, 101] and all(o.kind == "kept" for o in outcomes)
    assert reward.rows == [2, 0, 3, 1] and executor.jobs == 1 and len(reward.threads) == 1
    for o in outcomes:  # rewards 0, 1, 0, 1: advantages -1, 1, -1, 1 (SPEC §3.2)
        assert [s.advantage for s in o.samples] == pytest.approx([-1.0, 1.0, -1.0, 1.0])
    names = set(loop.metrics.snapshot())
    while not loop.metrics_queue.empty():
        names |= set(loop.metrics_queue.get_nowait())  # shipped with each group
    assert {"rollout/score_s", "rollout/score_wait_s", "rollout/score_queue_size", "reward"} <= names
    assert loop.allowance.groups_in_flight == 0


def test_a_failing_group_stops_the_scorer_after_the_groups_before_it(tmp_path):
    def reward(completions, row, **kwargs):
        if row[0] == 1:
            raise RuntimeError("reward broke on row 1")
        return [float(i % 2) for i in range(len(completions))]

    loop = make_loop(tmp_path, reward)

    async def main():
        score_queue: asyncio.Queue = asyncio.Queue()
        for row in (0, 1, 2):
            score_queue.put_nowait(make_group(loop, row))
        await loop._scorer(score_queue)

    with pytest.raises(RuntimeError, match="row 1") as err:
        asyncio.run(main())
    assert any("reward" in note for note in err.value.__notes__)
    assert [loop.rollout_buffer.get_nowait().position for _ in range(loop.rollout_buffer.qsize())] == [100]


class FakeClient:
    """Just enough of `SamplerClient` for `run_async`: ready at once, no /metrics."""

    retry_count = 0

    async def wait_until_ready(self, deadline_s):
        return 0.0

    async def read_metrics(self):
        return None

    async def max_model_len(self):
        return 64


class QuickLoop(AsyncRolloutLoop):
    """Rollouts without a sampler: three generated tokens each."""

    async def generate_one(self, prompt, tools, group_id=0):
        await asyncio.sleep(0)
        return Rollout(completion=[{"role": "assistant", "content": "ok"}], completion_ids=[5, 6, 7],
                       turns=[TurnRecord(prompt_ids=[1, 2], output_ids=[5, 6, 7], output_log_probs=[-0.5] * 3)])


def test_start_up_heap_is_frozen_only_while_the_loop_runs(tmp_path):
    assert gc.get_freeze_count() == 0
    loop = make_loop(tmp_path, RecordingReward(), loop_cls=QuickLoop, client=FakeClient())
    thread = threading.Thread(target=lambda: asyncio.run(loop.run_async()), daemon=True)
    thread.start()
    try:
        first = loop.rollout_buffer.get(timeout=60)
        assert first.kind == "kept" and len(first.samples) == G
        assert gc.get_freeze_count() > 0
    finally:
        loop.stop()
        thread.join(timeout=30)
    assert not thread.is_alive() and gc.get_freeze_count() == 0


def test_no_group_starts_while_the_score_queue_is_full(tmp_path):
    release = threading.Event()

    def held_reward(completions, **kwargs):  # scoring stalls until released
        release.wait(60)
        return [float(i % 2) for i in range(len(completions))]

    loop = make_loop(tmp_path, held_reward, loop_cls=QuickLoop, client=FakeClient(), n_prompts=50)
    loop.score_queue_maxsize, loop.scorers = 1, 1
    thread = threading.Thread(target=lambda: asyncio.run(loop.run_async()), daemon=True)
    thread.start()
    try:
        # One batch in the scorer, one group in the full queue, and at most the groups that were already
        # generating when it filled: the producer must not keep starting groups.
        deadline = time.monotonic() + 60
        while loop._group_counter < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # give a producer that ignored the full queue time to run ahead
        started = loop._group_counter
        assert started <= 4, started
        release.set()
        assert loop.rollout_buffer.get(timeout=60).kind == "kept"
    finally:
        release.set()
        loop.stop()
        thread.join(timeout=30)
