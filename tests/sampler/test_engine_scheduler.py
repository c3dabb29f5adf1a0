"""The embedded engine's scheduler (pure) and async loop (with a fake model), step by step."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo_cli.sampler.embedded.engine import (
    Engine,
    EngineRequest,
    RequestStatus,
    Scheduler,
    TokenOutput,
    finish_reason_after_token,
)
from asyncgrpo_cli.sampler.embedded.sampling import SamplingOptions

from .conftest import run


def req(prompt_len=10, max_tokens=20, **opts):
    return EngineRequest("r", list(range(prompt_len)), SamplingOptions(max_tokens=max_tokens, **opts))


def grow(requests, n=1):
    """What a step does to each request: one more output token and KV for everything before it."""
    for r in requests:
        for _ in range(n):
            r.output_ids.append(1)
        r.has_kv = True


def test_admission_by_blocks_and_max_num_seqs():
    s = Scheduler(num_blocks=4, block_size=4, max_num_seqs=3)
    a, b, c, d = req(5, 4), req(4, 4), req(3, 4), req(1, 4)
    for r in (a, b, c, d):
        s.add(r)
    plan = s.schedule()
    # a needs 2 blocks, b 1, c 1: all 4 blocks taken; d waits (blocks, and max_num_seqs=3)
    assert plan.prefill == [a, b, c] and plan.decode == []
    assert [r.blocks for r in (a, b, c)] == [2, 1, 1]
    assert s.usage == 1.0 and list(s.waiting) == [d]
    assert d.status is RequestStatus.WAITING and a.status is RequestStatus.RUNNING


def test_fcfs_head_of_line_blocks():
    s = Scheduler(num_blocks=3, block_size=4, max_num_seqs=8)
    big, small = req(9, 2), req(1, 2)
    s.add(req(4, 2))
    s.add(big)
    s.add(small)
    plan = s.schedule()
    assert len(plan.prefill) == 1 and list(s.waiting) == [big, small]


def test_growth_preempts_latest_and_requeues_in_front():
    s = Scheduler(num_blocks=4, block_size=4, max_num_seqs=8)
    a, b, w = req(4, 8), req(4, 8), req(2, 4)
    s.add(a)
    s.add(b)
    s.schedule()
    grow([a, b], 4)  # 8 tokens each: 2 blocks each -> exactly full
    s.add(w)
    plan = s.schedule()
    assert plan.decode == [a, b] and plan.preempted == [] and list(s.waiting) == [w]
    grow([a, b])  # 9 tokens each: 3 blocks each > 4 -> preempt b (admitted last)
    plan = s.schedule()
    assert plan.preempted == [b] and plan.decode == [a]
    assert list(s.waiting) == [b, w] and not b.has_kv and b.blocks == 0
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    s.finish(a, "length")
    plan = s.schedule()
    assert plan.prefill == [b, w]  # b is recomputed: prompt plus its 5 outputs
    assert b.blocks == 3 and w.blocks == 1 and s.used_blocks == 4


def test_lone_request_is_never_preempted_and_oversized_is_refused():
    s = Scheduler(num_blocks=2, block_size=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="--kv-cache-tokens"):
        s.add(req(4, max_tokens=10))
    a = req(2, max_tokens=6)
    s.add(a)
    s.schedule()
    grow([a], 6)
    assert s.schedule().decode == [a] and s.num_preemptions == 0


def test_finish_frees_blocks_and_preempt_all():
    s = Scheduler(num_blocks=8, block_size=4, max_num_seqs=8)
    a, b = req(4), req(4)
    s.add(a)
    s.add(b)
    s.schedule()
    grow([a, b])
    assert s.preempt_all_running() == 2 and s.num_preemptions == 2
    assert s.schedule().prefill == [a, b]
    s.finish(b, "stop", 7)
    assert b.finished and b.stop_reason == 7 and s.running == [a] and b.blocks == 0
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(0, 4, 1)


def test_finish_reasons():
    eos = frozenset({99})
    r = req(2, max_tokens=3, stop_token_ids=(5,))
    r.output_ids = [99]
    assert finish_reason_after_token(r, 99, eos) == ("stop", None)
    r.output_ids = [5]
    assert finish_reason_after_token(r, 5, eos) == ("stop", 5)
    r.output_ids = [1, 2, 3]
    assert finish_reason_after_token(r, 3, eos) == ("length", None)
    r2 = req(2, max_tokens=30, ignore_eos=True)
    r2.max_model_len = 4
    r2.output_ids = [99]
    assert finish_reason_after_token(r2, 99, eos) == (None, None)
    r2.output_ids = [99, 1]
    assert finish_reason_after_token(r2, 1, eos) == ("length", None)


class FakeRunner:
    """Emits token 1 for every row; counts steps; can be told to fail."""

    def __init__(self):
        self.steps = 0
        self.resets = 0
        self.fail = False

    def step(self, plan):
        self.steps += 1
        if self.fail:
            raise RuntimeError("boom")
        return [TokenOutput(1, -0.5, [1], [-0.5]) for _ in plan.rows]

    def reset(self):
        self.resets += 1


def make_engine(max_num_seqs=8):
    runner = FakeRunner()
    return Engine(runner, Scheduler(num_blocks=4096, block_size=4, max_num_seqs=max_num_seqs), frozenset({2})), runner


async def until(pred, deadline_s=30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.001)


def test_engine_generates_and_pause_keep_freezes():
    async def main():
        engine, runner = make_engine()
        await engine.start()
        r = req(3, max_tokens=50)
        task = asyncio.create_task(engine.generate(r))
        await until(lambda: len(r.output_ids) >= 3)
        await engine.pause("keep")
        frozen, steps = len(r.output_ids), runner.steps
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(r.output_ids) == frozen and runner.steps == steps and not task.done()
        late = req(3, max_tokens=5)
        late_task = asyncio.create_task(engine.generate(late))
        await until(lambda: engine.stats().num_requests_waiting == 1)
        assert engine.paused
        await engine.resume()
        done = await task
        await late_task
        await engine.close()
        return done, late

    done, late = run(main())
    assert done.finish_reason == "length" and len(done.output_ids) == 50
    assert late.output_logprobs == [-0.5] * 5 and late.top_ids == [[1]] * 5


def test_engine_pause_abort_and_wait():
    async def main():
        engine, runner = make_engine()
        await engine.start()
        a = req(3, max_tokens=10**4 - 3)
        task = asyncio.create_task(engine.generate(a))
        await until(lambda: len(a.output_ids) >= 1)
        await engine.pause("abort")
        await task
        assert a.finish_reason == "abort" and engine.paused and runner.resets == 1
        await engine.resume()
        b = req(3, max_tokens=30)
        b_task = asyncio.create_task(engine.generate(b))
        await until(lambda: len(b.output_ids) >= 1)
        await engine.pause("wait")  # returns once b has finished
        assert b.finished and b.finish_reason == "length" and engine.paused
        await b_task
        c = req(3, max_tokens=4)
        c_task = asyncio.create_task(engine.generate(c))
        await until(lambda: engine.stats().num_requests_waiting == 1)
        await engine.resume()
        await c_task
        await engine.close()
        return c

    assert run(main()).finish_reason == "length"


def test_engine_cancel_aborts_and_model_failure_errors():
    from asyncgrpo_cli.sampler.embedded.engine import EngineError

    async def main():
        engine, runner = make_engine()
        await engine.start()
        a = req(3, max_tokens=10**4 - 3)
        task = asyncio.create_task(engine.generate(a))
        await until(lambda: len(a.output_ids) >= 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert a.finish_reason == "abort" and engine.stats().num_requests_running == 0
        runner.fail = True
        with pytest.raises(EngineError, match="boom"):
            await engine.generate(req(3, max_tokens=5))
        runner.fail = False
        ok = await engine.generate(req(3, max_tokens=5))
        await engine.close()
        return ok

    assert run(main()).finish_reason == "length"


def test_engine_eos_stops():
    async def main():
        engine, _ = make_engine()
        engine.eos_token_ids = frozenset({1})
        await engine.start()
        r = await engine.generate(req(3, max_tokens=5))
        ignored = await engine.generate(req(3, max_tokens=5, ignore_eos=True))
        await engine.close()
        return r, ignored

    r, ignored = run(main())
    assert r.finish_reason == "stop" and r.output_ids == [1]
    assert ignored.finish_reason == "length" and len(ignored.output_ids) == 5
