"""No learning signal (issue #19): consecutive groups dropped for zero reward spread or no reward stop the
worker with a diagnosis naming the reward functions; errors while the worker builds its loop reach the trainer."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import datasets
import pytest

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.rollout.no_signal import NoLearningSignalError, NoSignalWatch
from asyncgrpo_cli.rollout.types import Rollout, RolloutGroup, TrainingSequence
from asyncgrpo_cli.rollout.worker import RolloutWorker, RolloutWorkerError
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

G = 4


def test_watch_counts_consecutive_groups_and_resets_on_signal():
    watch = NoSignalWatch(limit=3)
    none = {"accuracy_reward": [None] * G}
    assert watch.observe(False, 0, none) is None
    assert watch.observe(False, 0, none) is None
    assert watch.observe(True, G, {"accuracy_reward": [0.0, 1.0, 0.0, 1.0]}) is None
    assert watch.observe(False, 0, none) is None and watch.observe(False, 0, none) is None
    text = watch.observe(False, 0, none)
    assert text is not None and "last 3 groups" in text and "accuracy_reward" in text
    assert "None/NaN for all 12 completions" in text and "ground truth" in text
    assert "rollout.max_groups_without_signal" in text
    # a group another scorer finishes after the stop changes nothing, not even a kept one
    assert watch.observe(True, G, {"accuracy_reward": [0.0, 1.0, 0.0, 1.0]}) == text
    assert watch.observe(False, 0, none) == text and watch.consecutive == 3


def test_watch_names_a_constant_reward_and_a_disabled_limit_never_stops():
    watch = NoSignalWatch(limit=2)
    values = {"format_reward": [0.0] * G, "accuracy_reward": [1.0, None, 1.0, 1.0]}
    assert watch.observe(False, G, values) is None
    text = watch.observe(False, G, values)
    assert "format_reward: always 0" in text and "accuracy_reward: always 1" in text and "too hard" in text
    assert "last group: [1, None, 1, 1]" in text
    never = NoSignalWatch(limit=0)
    assert all(never.observe(False, 0, {"r": [None] * G}) is None for _ in range(1000))


def test_unscored_groups_stop_sooner_than_constant_ones():
    watch = NoSignalWatch(limit=64)
    assert watch.unscored_limit == 16
    assert all(watch.observe(False, G, {"r": [0.0] * G}) is None for _ in range(40))  # constant: 64 needed
    assert all(watch.observe(False, 0, {"r": [None] * G}) is None for _ in range(15))
    assert watch.observe(False, 0, {"r": [None] * G}) is not None  # 16 unscored in a row
    assert watch.consecutive == 56


def test_kept_groups_with_nothing_trained_count_as_without_signal():
    """With mask_truncated_completions a group whose every completion was cut trains nothing although its rewards
    spread: such groups must end the run too (they kept the trainer waiting forever: CI of 2026-12-01)."""
    watch = NoSignalWatch(limit=3)
    spread = {"length_reward": [0.0, 1.0, 0.5, 1.0]}
    assert watch.observe(True, G, spread, num_trained=0) is None
    assert watch.observe(True, G, spread, num_trained=1) is None and watch.consecutive == 0  # one trained: signal
    assert watch.observe(True, G, spread, num_trained=0) is None
    assert watch.observe(True, G, spread, num_trained=0) is None
    text = watch.observe(True, G, spread, num_trained=0)
    assert text is not None and "3 kept with nothing to train" in text
    assert "every completion of 3 of them was cut at rollout.max_completion_length" in text
    assert "The reward functions returned" not in text.splitlines()[0]  # the first line is the console's cause
    assert "Fix: raise rollout.max_completion_length or set loss.mask_truncated_completions=false" in text
    assert "length_reward" not in text  # the rewards spread: they are not what to fix
    mixed = NoSignalWatch(limit=2)
    assert mixed.observe(False, G, {"r": [0.0] * G}) is None
    text = mixed.observe(True, G, {"r": [0.0, 1.0, 0.0, 1.0]}, num_trained=0)
    assert "1 with every completion scored the same" in text and "1 kept with nothing to train" in text
    assert "r: always 0" in text and "Fix: correct the reward or the data" in text
    # dropped groups whose completions were all cut (rewards all 0 because nothing ended): truncation is named
    cut = NoSignalWatch(limit=2)
    assert cut.observe(False, G, {"r": [0.0] * G}, num_trained=0) is None
    text = cut.observe(True, G, {"r": [0.0, 1.0, 0.0, 1.0]}, num_trained=0)
    assert "every completion of 2 of them was cut" in text
    assert "Fix: raise rollout.max_completion_length or set loss.mask_truncated_completions=false" in text


class _Value:
    def __init__(self, value):
        self.value = value


def none_reward(completions, **kwargs):
    return [None for _ in completions]


def constant_reward(completions, **kwargs):
    return [0.5 for _ in completions]


def spread_reward(completions, **kwargs):
    return [float(i % 2) for i, _ in enumerate(completions)]


def _loop(tmp_path, reward, limit, **options):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=G, max_completion_length=4,
                          vllm_server_base_url="http://127.0.0.1:1", max_concurrent_rollouts=8,
                          vllm_server_timeout=30.0, report_to="none", max_groups_without_signal=limit, **options)
    dataset = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    return AsyncRolloutLoop(cfg, "m", dataset, [reward], None, [0], queue.Queue(), _Value(0), _Value(1e9),
                            _Value(0.0), threading.Event(), queue.Queue(), queue.Queue(),
                            consumed_tokens_value=_Value(0.0))


def _group(loop, row):
    loop.allowance.on_group_started(G)
    rollouts, sequences = [], []
    for _ in range(G):
        seq = TrainingSequence(input_ids=[1, 2, 3], trained_mask=[0, 1, 1], sampler_logprobs=[0.0, -0.5, -0.5],
                               advantage=0.0, group_id=row, row_index=row, model_version=0)
        loop.allowance.on_rollout_finished(seq.num_tokens)
        rollouts.append(Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=[2, 3], turns=[]))
        sequences.append([seq])
    loop.allowance.on_group_finished()
    group = RolloutGroup(prompts=[[{"role": "user", "content": f"q{row}"}]] * G, reward_kwargs={},
                         completions=[r.completion for r in rollouts], completions_ids=[r.completion_ids for r in rollouts],
                         completions_sequences=sequences, tool_call_counts=[0] * G, tool_failure_counts=[0] * G,
                         model_version=0, group_id=row, row_index=row, env_rewards=[None] * G,
                         rollout_rewards=[None] * G, queued_at=time.monotonic())
    return group, rollouts, row


@pytest.mark.parametrize("reward,expect", [(none_reward, "None/NaN for all"), (constant_reward, "always 0.5")])
def test_loop_stops_after_the_limit_with_the_diagnosis(tmp_path, reward, expect):
    loop = _loop(tmp_path, reward, limit=3)
    asyncio.run(loop._score_groups([_group(loop, 0), _group(loop, 1)]))
    with pytest.raises(NoLearningSignalError, match=expect) as info:
        asyncio.run(loop._score_groups([_group(loop, 2)]))
    assert reward.__name__ in str(info.value)
    outcomes = [loop.rollout_buffer.get_nowait() for _ in range(2)]
    assert [o.kind for o in outcomes] == ["dropped", "dropped"]
    loop.report_failure(info.value)  # what the trainer receives: the diagnosis, no traceback
    text = loop.exception_info_queue.get_nowait()
    assert text.startswith("NoLearningSignalError: no learning signal") and "Traceback" not in text


def test_loop_stops_when_every_completion_is_masked_as_truncated(tmp_path):
    loop = _loop(tmp_path, spread_reward, limit=2, mask_truncated_completions=True)
    asyncio.run(loop._score_groups([_group(loop, 0)]))  # no turn ends with EOS: nothing of it is trained
    outcome = loop.rollout_buffer.get_nowait()
    assert outcome.kind == "kept" and len(outcome.samples) == G  # untrained stubs, counted as sequences (TRL)
    assert not any(s.num_trained_tokens for s in outcome.samples)
    with pytest.raises(NoLearningSignalError, match="loss.mask_truncated_completions=false"):
        asyncio.run(loop._score_groups([_group(loop, 1)]))


# ------------------------------------------------------------------------------------------ real processes
class BrokenLoop(AsyncRolloutLoop):
    """Fails while the worker builds it (like a bad reward given to the constructor)."""

    def __init__(self, *args, **kwargs):
        raise ValueError("reward_funcs[0]: cannot be built here")


def _prompts():
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}?"}]} for i in range(3)])


def test_an_error_while_building_the_loop_reaches_the_trainer(tmp_path):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=G, vllm_server_base_url="http://127.0.0.1:9",
                          vllm_server_timeout=30.0, report_to="none")
    worker = RolloutWorker(cfg, "m", _prompts(), [none_reward], None, [0], loop_cls=BrokenLoop)
    start = time.monotonic()
    try:
        with pytest.raises(RolloutWorkerError) as info:
            worker.start(ready_timeout_s=120)
    finally:
        worker.stop()
    text = str(info.value)
    assert "while building the rollout loop" in text and "cannot be built here" in text and "ValueError" in text
    assert "without reporting an error" not in text
    assert time.monotonic() - start < 120


def test_a_run_without_signal_stops_with_the_diagnosis(tmp_path):
    from transformers import AutoTokenizer

    from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
    from asyncgrpo_cli.testing import make_tiny_model
    from asyncgrpo_cli.train.model_loading import prepare_tokenizer

    model_dir = make_tiny_model(tmp_path / "tiny")
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    server = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32", max_model_len=64,
                                       kv_cache_tokens=512, max_num_seqs=16, served_model_name="tiny")).start()
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=G, max_completion_length=4, num_sampler_logprobs=2,
                          vllm_server_base_url=server.url, max_concurrent_rollouts=8, vllm_server_timeout=60.0,
                          rollout_worker_timeout=60.0, report_to="none", max_groups_without_signal=5)
    worker = RolloutWorker(cfg, "tiny", _prompts(), [none_reward], tokenizer, [tokenizer.eos_token_id],
                           initial_allowance=10**9)
    try:
        worker.start(ready_timeout_s=120)
        end = time.monotonic() + 120
        dropped = 0
        with pytest.raises(RolloutWorkerError) as info:
            while time.monotonic() < end:
                worker.check_alive()
                out = worker.get_outcome(0.2)
                dropped += out is not None and out.kind == "dropped"
        assert dropped <= 5 and worker.no_signal_value.value == 4  # 4 unscored groups in a row (limit 5)
        text = str(info.value)
        assert "no learning signal" in text and "none_reward" in text and "Traceback" not in text, text
    finally:
        worker.stop()
        server.stop()
