"""The worker process publishes its count of finished rollouts to the trainer (``RolloutWorker.rollouts_done_value``:
status.json's ``rollouts_finished``, the plain log's line before the first step)."""

from __future__ import annotations

import threading
import time

import datasets

from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
from asyncgrpo_cli.rollout.allowance import TokenAllowance
from asyncgrpo_cli.rollout.worker import RolloutWorker


class CountingLoop:
    """Stands in for the rollout loop in the spawned process: reports ready, publishes 7 finished rollouts
    through the value the worker process hands it, and waits to be stopped."""

    def __init__(self, **kwargs):
        self._stopped = threading.Event()

    def run(self):
        self.ready_event.set()
        self.rollouts_done_value.value = 7
        self._stopped.wait(120)

    def stop(self):
        self._stopped.set()


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


def test_the_worker_process_hands_its_loop_the_finished_rollouts_value(tmp_path):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=2, vllm_server_base_url="http://127.0.0.1:9",
                          vllm_server_timeout=30.0, report_to="none")
    prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1?"}]}])
    worker = RolloutWorker(cfg, "m", prompts, [_reward], None, [0], loop_cls=CountingLoop)
    try:
        worker.start(ready_timeout_s=120)
        end = time.monotonic() + 120
        while worker.rollouts_done_value.value != 7 and time.monotonic() < end:
            time.sleep(0.05)
        assert worker.rollouts_done_value.value == 7
    finally:
        worker.stop()


def test_finished_rollouts_total_counts_every_finished_rollout():
    allowance = TokenAllowance()
    allowance.on_group_started(3)
    for tokens in (5, 0, 9):
        allowance.on_rollout_finished(tokens)
    assert allowance.finished_rollouts_total == 3


class NeverReadyLoop(CountingLoop):
    """A worker whose server never answers: it never reports ready (the supervisor killed during the start)."""

    def run(self):
        self._stopped.wait(120)


def test_a_stop_during_the_workers_boot_ends_the_wait_for_it(tmp_path):
    """The thirteenth session's suite, interrupted during `test_sigint_saves_a_checkpoint`: the supervisor died while
    the trainer waited for its worker, whose server had died with the supervisor; the trainer's stop (SIGTERM to
    itself) set the worker's stop byte, but the wait went on to its deadline (sampler.timeout + 60 s: 31 minutes
    with the defaults). It now returns once the stop begins; the teardown stops the worker."""
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=2, vllm_server_base_url="http://127.0.0.1:9",
                          vllm_server_timeout=1800.0, report_to="none")
    prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1?"}]}])
    worker = RolloutWorker(cfg, "m", prompts, [_reward], None, [0], loop_cls=NeverReadyLoop)
    started = threading.Event()
    stopper = threading.Thread(target=lambda: (started.wait(60), time.sleep(1.0), worker.begin_stop()), daemon=True)
    stopper.start()
    try:
        begin = time.monotonic()
        started.set()
        worker.start()  # the default deadline: 1,860 s
        assert time.monotonic() - begin < 60 and not worker.ready_event.is_set()
    finally:
        worker.stop(timeout_s=5.0)
    assert worker.process is None or not worker.process.is_alive()
