"""``sampler.weight_sync_overlap`` in the trainer, on CPU against the embedded sampler: the sync of step N runs on a
background thread while step N+1 pulls, forwards and backwards; it is settled before step N+1's optimizer step (the
parameters never change under it), the rollout worker learns the new version only once its push has ended, and a sync that
fails is found one step later yet ends the run as without overlap (the same checkpoint, status and metrics lines)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import datasets
import pytest
import torch

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.train.weight_sync import WeightSyncError
from tests.train.test_trainer_e2e import model_dir, server, token_parity_reward  # noqa: F401 - fixtures, reward


def prompts(n=16):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}]}
                                       for i in range(n)])


def args_for(out: Path, url: str, **kw) -> AsyncGRPOConfig:
    base = dict(output_dir=str(out), max_steps=4, num_generations=4, max_completion_length=8, num_sampler_logprobs=3,
                vllm_server_base_url=url, learning_rate=1e-2, save_steps=100, logging_steps=1, report_to="none",
                max_staleness=2, vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0,
                optim="sgd", max_grad_norm=0.0, weight_sync_overlap=True)
    base.update(kw)
    return AsyncGRPOConfig(**base)


def parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


class RecordingTrainer(AsyncGRPOTrainer):
    """Each step's sync takes ``SYNC_S`` s longer and records, in ``events``: when it starts and ends (on which thread,
    whether the parameters changed while it ran, the version the worker had meanwhile), each optimizer step, eval
    round asked for and checkpoint write (whether a sync was in flight then), each `_finish_step` (the trainer's
    version then) and each version the worker is given."""

    SYNC_S = 0.4

    def _setup_rollouts(self, *args, **kwargs):
        self.events = []
        super()._setup_rollouts(*args, **kwargs)  # its own first push is not recorded: made before the loop
        step, set_version, request_eval = self.optimizer.step, self.worker.set_model_version, self.worker.request_eval

        def optimizer_step(*a, **kw):
            self.events.append(("optimizer", self.state.global_step + 1, self.pending_sync.in_flight))
            return step(*a, **kw)

        def worker_version(version):
            self.events.append(("worker", int(version), threading.current_thread().name))
            set_version(version)

        def eval_round(at_step):
            self.events.append(("eval", at_step, self.pending_sync.in_flight))
            request_eval(at_step)

        self.optimizer.step, self.worker.set_model_version = optimizer_step, worker_version
        self.worker.request_eval = eval_round

    def _save_checkpoint(self, model, trial):
        self.events.append(("save", self.state.global_step, self.pending_sync.in_flight))
        return super()._save_checkpoint(model, trial)

    def _push_weights(self, version, again=False):
        served = int(self.worker.model_version_value.value)
        self.events.append(("sync start", version, threading.current_thread().name, served))
        before = parameters(self.model)
        time.sleep(self.SYNC_S)
        metrics = super()._push_weights(version, again)
        self.events.append(("sync end", version, torch.equal(before, parameters(self.model))))
        return metrics

    def _finish_step(self, *args, **kwargs):
        self.events.append(("finish", self.state.global_step, self.model_version))
        return super()._finish_step(*args, **kwargs)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # the recording wrapper
def test_the_sync_overlaps_the_next_step_and_is_settled_before_its_optimizer_step(model_dir, server, tmp_path):
    out = tmp_path / "run"
    evals = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} minus 1?"}]}
                                        for i in range(3)])
    trainer = RecordingTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                               args=args_for(out, server.url, save_steps=2, eval_strategy="steps", eval_steps=2),
                               train_dataset=prompts(), eval_dataset=evals)
    result = trainer.train()
    assert result.global_step == 4 and trainer.model_version == 4
    events = trainer.events
    starts = [e for e in events if e[0] == "sync start"]
    assert [e[1] for e in starts] == [1, 2, 3, 4]
    # Steps 1-3 sync on the background thread, the run's last step where it stands (nothing is left to overlap).
    assert [e[2] for e in starts] == ["weight-sync-v1", "weight-sync-v2", "weight-sync-v3", "MainThread"]
    assert all(e[2] for e in events if e[0] == "sync end"), events  # the parameters never changed under a sync
    assert [e for e in events if e[0] == "optimizer" and e[2]] == [], events  # nor did an optimizer step run then
    # An eval round samples the step's weights, a checkpoint holds a step whose sync is done (or failed).
    assert [e for e in events if e[0] in ("eval", "save")] == [("eval", 2, False), ("save", 2, False),
                                                                ("eval", 4, False), ("save", 4, False)], events
    # The trainer's version advances as its sync starts (its weights are that version); the worker's only once the
    # server serves it: every version the worker is given was synced before, and during a sync it had the previous.
    assert [e[2] for e in events if e[0] == "finish"] == [1, 2, 3, 4]
    assert [e[3] for e in starts] == [0, 1, 2, 3]
    ended: set[int] = {0}
    for e in events:
        if e[0] == "sync end":
            ended.add(e[1])
        elif e[0] == "worker":
            assert e[1] in ended, (e, events)
    assert [e[1] for e in events if e[0] == "worker"][-1] == 4
    # The worker learns an overlapped sync's version on its thread as soon as the push ends (the server serves it
    # from then on), not only at the settle, which may come a step's forward and backward later.
    for version in (1, 2, 3):
        assert ("worker", version, f"weight-sync-v{version}") in events, events
    # A window logs the syncs settled in its step (step 1's in step 2's, before its optimizer step; step 2's before
    # step 2's eval round, so in step 2's too; step 3's in step 4's) with the time the trainer blocked for them: the
    # sync sleeps longer than a tiny step takes, so some step waited (perf/step_s counts the wait).
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"event"' not in line]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [("perf/weight_sync_s" in line, "perf/weight_sync_wait_s" in line) for line in lines] == \
        [(False, False), (True, True), (False, False), (True, True)], lines
    waited = max(lines[1::2], key=lambda line: line["perf/weight_sync_wait_s"])
    assert 0.1 < waited["perf/weight_sync_wait_s"] <= RecordingTrainer.SYNC_S + 1.0, waited
    assert waited["perf/step_s"] >= waited["perf/weight_sync_wait_s"], waited
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 4 and status["model_version"] == 4


class FailingSync(AsyncGRPOTrainer):
    """The first sync of model version 2 (after step 2) fails; with ``STOP`` a stop signal came first (the sync then
    failed because the stop abandoned its wait for the server). Before pulling, the trainer waits until an overlapped
    sync has ended, so that it is found at the next step's first settle whatever the machine's speed."""

    STOP = False

    def _push_weights(self, version, again=False):
        if version == 2 and not again and not getattr(self, "failed", False):
            self.failed = True
            time.sleep(0.2)
            if self.STOP:
                self._on_stop_signal(signal.SIGTERM, None)
            raise WeightSyncError(f"weight sync to model version {version} failed at /update_weights: injected",
                                  "/update_weights", version)
        return super()._push_weights(version, again)

    def _next_step_plan(self):
        pending = getattr(self, "pending_sync", None)
        if pending is not None and pending.in_flight:
            pending._done.wait(30)
        return super()._next_step_plan()


def run_failing(model_dir, url, out: Path, overlap: bool, stop: bool):
    trainer = type("Trainer", (FailingSync,), {"STOP": stop})(
        model=str(model_dir), reward_funcs=[token_parity_reward], args=args_for(out, url, weight_sync_overlap=overlap),
        train_dataset=prompts())
    error = None
    try:
        trainer.train()
    except WeightSyncError as exc:
        error = exc
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    status = json.loads((out / "status.json").read_text())
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    return trainer, error, lines, status, checkpoints


@pytest.mark.parametrize("overlap", [False, True], ids=["today", "overlap"])
def test_a_failed_sync_found_at_the_next_settle_saves_the_step_it_followed_as_today(model_dir, server, tmp_path,
                                                                                   overlap):
    trainer, error, lines, status, checkpoints = run_failing(model_dir, server.url, tmp_path / "run", overlap, False)
    assert error is not None and "injected" in str(error)
    assert checkpoints == ["checkpoint-2"]  # the last trained step, the one whose sync failed
    assert [line["step"] for line in lines] == [1, 2]  # its metrics line, once
    assert status["state"].startswith("failed: WeightSyncError: weight sync to model version 2 failed"), status
    assert status["step"] == 2 and status["model_version"] == 1, status
    assert "checkpoint-2 saved" in status["last_error"], status["last_error"]
    assert trainer.model_version == 1  # the version the server served: the failed one never took
    assert ("perf/weight_sync_wait_s" in lines[1]) is overlap  # overlap on: step 1's sync settled in step 2


@pytest.mark.parametrize("overlap", [False, True], ids=["today", "overlap"])
def test_a_sync_a_stop_abandoned_saves_the_step_it_followed_as_today(model_dir, server, tmp_path, capsys, overlap):
    trainer, error, lines, status, checkpoints = run_failing(model_dir, server.url, tmp_path / "run", overlap, True)
    assert error is None and trainer.exit_code == 143
    assert checkpoints == ["checkpoint-2"]
    assert status["state"] == "stopped" and status["step"] == 2, status
    assert "step 2 is trained; its weight sync was abandoned by the stop" in capsys.readouterr().out
