"""The rollout worker against the embedded sampler: scored groups stream into the queue, generation holds
when the staleness allowance is used up, the cap follows KV usage, and failures reach the trainer."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import datasets
import pytest

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.rollout.types import PromptOutcome
from asyncgrpo_cli.rollout.worker import RolloutWorker, RolloutWorkerError
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import deadline_s as machine_deadline
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
from asyncgrpo_cli.train.model_loading import prepare_tokenizer

MAX_LEN = 128


def length_parity_reward(completion_ids, **kwargs):
    """Module-level (picklable) reward with spread inside groups: 1 when the first and last generated
    tokens have the same parity (random for a random model)."""
    return [float(bool(ids) and ids[0] % 2 == ids[-1] % 2) for ids in completion_ids]


def alternating_reward(completions, **kwargs):
    """Always spread inside a group, so no group is dropped."""
    return [float(i % 2) for i in range(len(completions))]


def answer_seen_reward(completions, answer, **kwargs):
    """Checks that dataset columns arrive by name (None for rows without an answer)."""
    return [None if a is None else 0.0 for a in answer]


class FrozenLoop(AsyncRolloutLoop):
    """Blocks its event loop on the first rollout, so heartbeats stop (hang detection)."""

    async def generate_one(self, prompt, tools, group_id=0):
        time.sleep(3600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir):
    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=MAX_LEN, kv_cache_tokens=8 * MAX_LEN, max_num_seqs=16,
                                       served_model_name="tiny")).start()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir))


def prompts(n=6):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}],
                                        "answer": str(2 * i)} for i in range(n)])


def config(tmp_path, url, **kw):
    base = dict(output_dir=str(tmp_path), num_generations=4, max_completion_length=12, num_sampler_logprobs=3,
                vllm_server_base_url=url, max_concurrent_rollouts=8, vllm_server_timeout=60.0,
                rollout_worker_timeout=60.0, report_to="none")
    base.update(kw)
    return AsyncGRPOConfig(**base)


def pull(worker, n, deadline_s=120.0):
    deadline_s = machine_deadline(deadline_s)
    got, end = [], time.monotonic() + deadline_s
    while len(got) < n:
        assert time.monotonic() < end, f"only {len(got)} outcomes after {deadline_s} s"
        out = worker.get_outcome(0.5)
        if out is None:
            worker.check_alive()
            continue
        got.append(out)
    return got


def test_worker_streams_scored_groups(server, tokenizer, tmp_path):
    cfg = config(tmp_path, server.url)
    worker = RolloutWorker(cfg, "tiny", prompts(), [length_parity_reward, answer_seen_reward], tokenizer,
                           [tokenizer.eos_token_id], initial_allowance=10**9)
    worker.start(ready_timeout_s=machine_deadline(120))
    try:
        outcomes = pull(worker, 5)
        kept = [o for o in outcomes if o.kind == "kept"]
        assert kept, [o.kind for o in outcomes]
        assert all(isinstance(o, PromptOutcome) and o.kind in ("kept", "dropped") for o in outcomes)
        for o in kept:
            advantages = [s.advantage for s in o.samples]
            assert len(o.samples) == 4 and abs(sum(advantages)) < 1e-6 and len(set(advantages)) > 1
            for s in o.samples:
                n = len(s.input_ids)
                assert len(s.trained_mask) == n and s.trained_mask[0] == 0 and 1 <= s.num_trained_tokens <= 12
                trained = [i for i in range(n) if s.trained_mask[i]]
                assert all(s.sampler_logprobs[i] <= 0 for i in trained)
                assert all(len(s.sampler_top_ids[i]) == 3 for i in trained)
                assert s.model_version == 0 and s.queued_at > 0
        time.sleep(0)  # metrics are shipped once a second by the worker
        names = set()
        end = time.monotonic() + machine_deadline(60)
        wanted = {"reward", "rewards/length_parity_reward/mean", "frac_reward_zero_std", "completions/mean_length",
                  "completions/clipped_ratio", "completions/duplicate_frac", "rollout/concurrency",
                  "rollout/concurrency_cap", "rollout/generated_tokens_per_s", "rollout/score_s",
                  "rollout/duration_s", "rollout/vllm_kv_cache_usage_frac"}
        while not wanted <= names:
            assert time.monotonic() < end, f"missing metrics: {wanted - names}"
            for snap in worker.drain_metrics():
                names |= set(snap)
            worker.get_outcome(0.2)
    finally:
        worker.stop()


def test_lambda_reward_is_refused_before_spawn(tokenizer, tmp_path):
    cfg = config(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(TypeError, match="lambda"):
        RolloutWorker(cfg, "tiny", prompts(), [lambda completions, **kw: [0.0]], tokenizer, [0])

    def closure(completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match="closure"):
        RolloutWorker(cfg, "tiny", prompts(), [closure], tokenizer, [0])


def test_hung_worker_is_detected(server, tokenizer, tmp_path):
    cfg = config(tmp_path, server.url, rollout_worker_timeout=2.0)
    worker = RolloutWorker(cfg, "tiny", prompts(), [length_parity_reward], tokenizer, [0], loop_cls=FrozenLoop,
                           initial_allowance=10**9)
    worker.start(ready_timeout_s=machine_deadline(120))
    try:
        end = time.monotonic() + machine_deadline(60)
        with pytest.raises(RolloutWorkerError, match="heartbeat"):
            while time.monotonic() < end:
                worker.check_alive()
                worker.get_outcome(0.2)
    finally:
        worker.stop()


def test_failure_carries_the_child_traceback(tokenizer, tmp_path):
    cfg = config(tmp_path, "http://127.0.0.1:9", vllm_server_timeout=1.0)
    worker = RolloutWorker(cfg, "tiny", prompts(), [length_parity_reward], tokenizer, [0])
    with pytest.raises(RolloutWorkerError, match="Traceback"):
        worker.start(ready_timeout_s=machine_deadline(60))
    worker.stop()


class _Value:
    def __init__(self, value):
        self.value = value


class _Loop(AsyncRolloutLoop):
    metrics_poll_s = 0.2


def _in_process_loop(server_url, tokenizer, tmp_path, allowance, **kw):
    cfg = config(tmp_path, server_url, **kw)
    buf, metrics, errors = queue.Queue(), queue.Queue(), queue.Queue()
    loop = _Loop(cfg, "tiny", prompts(), [alternating_reward], tokenizer, [tokenizer.eos_token_id], buf,
                 _Value(0), _Value(float(allowance)), _Value(0.0), threading.Event(), errors, metrics,
                 consumed_tokens_value=_Value(0.0))
    thread = threading.Thread(target=lambda: asyncio.run(loop.run_async()), daemon=True)
    return loop, buf, metrics, thread


def test_generation_holds_when_allowance_is_used_up(server, tokenizer, tmp_path):
    loop, buf, metrics, thread = _in_process_loop(server.url, tokenizer, tmp_path, allowance=1.0)
    thread.start()
    try:
        first = buf.get(timeout=machine_deadline(120))  # the first group may always start (nothing is committed)
        end = time.monotonic() + machine_deadline(60)
        while not loop.allowance.first_group_finished or loop.allowance.groups_in_flight:
            assert time.monotonic() < end
            time.sleep(0.05)
        queued = [first] + [buf.get_nowait() for _ in range(buf.qsize())]
        assert len(queued) <= 2
        # Held: tokens are committed (queued, nothing consumed) and the allowance is below them.
        assert not loop.allowance.can_start_group(1.0)
        assert loop.allowance.groups_in_flight == 0 and loop.allowance.rollouts_in_flight == 0
        # The trainer consumes everything and raises the allowance: generation resumes.
        loop.consumed_tokens_value.value = float(sum(s.num_tokens for o in queued for s in o.samples))
        loop.token_allowance.value = 10**9
        buf.get(timeout=machine_deadline(120))
    finally:
        loop.stop()
        thread.join(timeout=30)


def test_cap_shrinks_when_kv_usage_passes_80_percent(model_dir, tokenizer, tmp_path):
    # A tiny KV budget: 4 requests at full length fill it, so usage passes 80% under load.
    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=64, kv_cache_tokens=4 * 64, max_num_seqs=16,
                                       served_model_name="tiny")).start()
    try:
        loop, buf, metrics, thread = _in_process_loop(handle.url, tokenizer, tmp_path, allowance=10**9,
                                                      max_completion_length=40, max_concurrent_rollouts=16)
        thread.start()
        end = time.monotonic() + machine_deadline(120)
        while loop.cap is None:
            assert time.monotonic() < end
            time.sleep(0.05)
        initial = loop.cap.value
        assert initial == 4  # KV tokens / max_model_len (SPEC §4.2)
        history = []
        observe = loop.cap.observe_load

        def record(load):
            before = loop.cap.value
            after = observe(load)
            history.append((load.kv_cache_usage_frac if load else None, before, after))
            return after

        loop.cap.observe_load = record
        while not any(after < before for _, before, after in history):
            assert time.monotonic() < end, f"the cap never shrank: {history}"
            time.sleep(0.05)
        usage, before, after = next(h for h in history if h[2] < h[1])
        assert usage > 0.8 and after == max(1, int(before * 0.7)), history
    finally:
        loop.stop()
        thread.join(timeout=30)
        handle.stop()


_two_groups = threading.Barrier(2, timeout=60)


def two_groups_at_once_reward(completions, **kwargs):
    """Passes only when a second group is being scored at the same time (else the barrier breaks)."""
    _two_groups.wait()
    return [1.0 if i % 2 else 0.0 for i in range(len(completions))]


def test_groups_are_scored_concurrently(server, tokenizer, tmp_path):
    cfg = config(tmp_path, server.url)
    buf, metrics, errors = queue.Queue(), queue.Queue(), queue.Queue()
    loop = _Loop(cfg, "tiny", prompts(), [two_groups_at_once_reward], tokenizer, [tokenizer.eos_token_id], buf,
                 _Value(0), _Value(10.0**9), _Value(0.0), threading.Event(), errors, metrics,
                 consumed_tokens_value=_Value(0.0), scorers=2)
    thread = threading.Thread(target=lambda: asyncio.run(loop.run_async()), daemon=True)
    thread.start()
    try:
        outcomes = [buf.get(timeout=machine_deadline(120)) for _ in range(2)]
        assert all(o.kind == "kept" for o in outcomes) and not _two_groups.broken
    finally:
        loop.stop()
        thread.join(timeout=30)
    with pytest.raises(ValueError, match="scorers=0"):
        _Loop(cfg, "tiny", prompts(), [alternating_reward], tokenizer, [tokenizer.eos_token_id], buf, _Value(0),
              _Value(1.0), _Value(0.0), threading.Event(), errors, metrics, scorers=0)


def test_once_a_stop_began_the_worker_ends_without_retrying_a_server_that_is_gone(model_dir, tokenizer, tmp_path):
    """Issue #45: after the supervisor (and with it the server) was gone, the worker kept retrying for the whole
    sampler timeout while the trainer saved. `begin_stop` (the trainer's stop-signal handler calls it) ends its
    generation at once; its exit is no failure, and no outage countdown is shown for it any more."""
    own = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32", max_model_len=MAX_LEN,
                                    kv_cache_tokens=8 * MAX_LEN, max_num_seqs=16, served_model_name="tiny")).start()
    cfg = config(tmp_path, own.url, vllm_server_timeout=1800.0)
    worker = RolloutWorker(cfg, "tiny", prompts(), [length_parity_reward], tokenizer, [tokenizer.eos_token_id],
                           initial_allowance=10**9)
    worker.start(ready_timeout_s=machine_deadline(120))
    try:
        pull(worker, 1)
        own.stop()  # the server is gone: the worker's requests are refused
        end = time.monotonic() + machine_deadline(60)
        while worker.server_seconds_left() is None:
            assert time.monotonic() < end, "the worker never saw the server gone"
            worker.check_alive()
            worker.get_outcome(0.2)
        assert worker.server_seconds_left() > 1700  # it would wait out sampler.timeout
        worker.begin_stop()
        stopped = time.monotonic()
        worker.process.join(machine_deadline(30))
        assert not worker.process.is_alive(), "the worker kept retrying after the stop began"
        print(f"measured: the worker ended {time.monotonic() - stopped:.1f} s after begin_stop")
        assert worker.process.exitcode == 0
        worker.check_alive()  # its exit is no failure: the trainer is stopping
        assert worker.server_seconds_left() is None  # no "server unreachable, retrying" for a stopped worker
    finally:
        worker.stop()
        own.stop()
