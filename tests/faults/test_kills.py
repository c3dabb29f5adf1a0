"""Processes killed with -9, and a reward that raises: the run stops promptly with the cause, saves the last
completed step when it can, leaves no process, and a later resume picks the newest complete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from asyncgrpo_cli.train.checkpoint import checkpoint_problem, newest_complete_checkpoint, partial_dir

from .conftest import api_job_argv, metrics_steps, status, wait_for, worker_pid


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hung_worker_stops_the_run_with_a_checkpoint(tiny_model, prompt_file, tmp_path, jobs, fault):
    """kill -9: noticed by the timer within a second (the heartbeat timeout is long, and the queue may still
    hold samples). SIGSTOP: a silent worker, noticed after rollout_worker_timeout (5 s here)."""
    out = tmp_path / "run"
    timeout = "300" if fault == "SIGKILL" else "5"
    job = jobs(api_job_argv(tiny_model, prompt_file, out, "--worker-timeout", timeout), "job")
    wait_for(lambda: len(metrics_steps(out)) >= 2, 240, "step 2", job)
    pid = wait_for(lambda: worker_pid(job), 30, "the rollout worker", job)
    hit = time.monotonic()
    os.kill(pid, getattr(signal, fault))
    assert job.wait(120) == 1
    assert time.monotonic() - hit < (60 if fault == "SIGKILL" else 5 + 60)
    job.assert_no_process_left(30)
    text = job.output()
    expected = (f"the rollout worker (pid {pid}) died: killed by SIGKILL" if fault == "SIGKILL" else
                "the rollout worker has not sent a heartbeat for")
    assert expected in text, text[-3000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == f"checkpoint-{metrics_steps(out)[-1]}", text[-3000:]
    final = status(out)
    assert final["state"].startswith("failed: RolloutWorkerError")


def test_reward_that_raises_saves_the_last_step(tiny_model, prompt_file, tmp_path, jobs):
    out = tmp_path / "run"
    job = jobs(api_job_argv(tiny_model, prompt_file, out, "--reward", "failing_at_prompt_40"), "job")
    assert job.wait(240) == 1
    job.assert_no_process_left(30)
    text = job.output()
    assert "reward exploded on prompt 40" in text, text[-3000:]
    steps = metrics_steps(out)
    assert steps, text[-3000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == f"checkpoint-{steps[-1]}"
    assert f"{checkpoint.name} holds the last completed step" in text
    final = status(out)["state"]
    assert final.startswith("failed: RolloutWorkerError") and "RuntimeError: reward exploded on prompt 40" in final


def test_trainer_killed_during_a_save_leaves_the_last_complete_checkpoint(tiny_model, prompt_file, tmp_path, jobs):
    out = tmp_path / "run"
    job = jobs(api_job_argv(tiny_model, prompt_file, out, "--save-steps", "1", "--hang-save-at", "3"), "job")
    wait_for(lambda: (out / "hang-save-3").is_file(), 300, "the save of step 3", job)
    os.kill(job.pid, signal.SIGKILL)
    job.wait(30)
    job.kill_all()  # the trainer's worker: its own parent-death watchdog is tested with the server outages
    job.assert_no_process_left(10)
    assert partial_dir(out, 3).is_dir() and not (out / "checkpoint-3").exists()  # half-written, never published
    assert newest_complete_checkpoint(out) == out / "checkpoint-2"
    assert json.loads((out / ".asyncgrpo.lock").read_text())["pid"] == job.pid  # left by the dead trainer

    resumed = jobs(api_job_argv(tiny_model, prompt_file, out, "--resume", "--max-steps", "3", "--save-steps", "1"),
                   "resumed")
    assert resumed.wait(240) == 0, resumed.output()[-3000:]
    resumed.assert_no_process_left(30)
    text = resumed.output()
    assert f"weights restored from {out / 'checkpoint-2'}" in text and "resuming at step 2" in text, text[-3000:]
    assert checkpoint_problem(out / "checkpoint-3") is None and not partial_dir(out, 3).exists()
    assert metrics_steps(out)[-1] == 3 and status(out)["state"] == "finished"
