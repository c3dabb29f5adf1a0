"""Stop signals on real process trees: a stop saves the last completed step first, the exit is prompt, nothing
is left running, ``status.json`` ends as ``stopped``, and the resumed run restores those weights and continues at
the first prompt not yet trained (each prompt trained once, modulo the in-flight window of docs/FAULTS.md).
One folder runs one job: a second one is refused, naming the first one's pid."""

from __future__ import annotations

import json
import signal
import time

from asyncgrpo_cli.train.checkpoint import checkpoint_problem, newest_complete_checkpoint

from .conftest import api_job_argv, cli_argv, metrics_steps, scored_indices, status, wait_for


def test_sigterm_saves_first_and_resume_continues_at_the_trained_position(tiny_model, prompt_file, tmp_path, jobs):
    out, log = tmp_path / "run", tmp_path / "scored.jsonl"
    env = {"ASYNCGRPO_FAULT_LOG": str(log)}
    first = jobs(api_job_argv(tiny_model, prompt_file, out), "first", {**env, "ASYNCGRPO_FAULT_RUN": "first"})
    wait_for(lambda: len(metrics_steps(out)) >= 2, 240, "step 2", first)
    sent = time.monotonic()
    first.signal(signal.SIGTERM)
    assert first.wait(120) == 143, first.output()[-3000:]
    assert time.monotonic() - sent < 60  # a step, a save of a tiny model and the worker's stop
    first.assert_no_process_left(30)
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint_problem(checkpoint) is None, first.output()[-3000:]
    trained = metrics_steps(out)[-1]
    assert checkpoint.name == f"checkpoint-{trained}"  # the last completed step, nothing trained after it
    final = status(out)
    assert final["state"] == "stopped" and final["step"] == trained
    position = json.loads((checkpoint / "rollout_state.json").read_text())["dataset_start_index"]
    first_scored = set(scored_indices(log, "first"))
    assert position >= 1 and set(range(position)) <= first_scored  # every prompt before it went through run 1

    resumed = jobs(api_job_argv(tiny_model, prompt_file, out, "--resume", "--max-steps", str(trained + 2)), "resumed",
                   {**env, "ASYNCGRPO_FAULT_RUN": "resumed"})
    assert resumed.wait(240) == 0, resumed.output()[-3000:]
    resumed.assert_no_process_left(30)
    text = resumed.output()
    assert f"weights restored from {checkpoint}" in text and "match the saved checksum" in text
    assert metrics_steps(out)[-2:] == [trained + 1, trained + 2]
    again = scored_indices(log, "resumed")
    # The resumed worker starts at the saved position: nothing before it is generated again, nothing skipped.
    assert again and min(again) == position and again[0] == position
    assert status(out)["state"] == "finished"


def test_sigint_on_the_cli_and_a_second_job_on_the_same_folder(tiny_model, prompt_file, tmp_path, jobs):
    out = tmp_path / "run"
    first = jobs(cli_argv(tiny_model, prompt_file, out, "trainer.max_steps=500"), "first")
    wait_for(lambda: len(metrics_steps(out)) >= 1, 300, "step 1", first)
    lock = json.loads((out / ".asyncgrpo.lock").read_text())
    assert lock["pid"] == first.pid

    second = jobs(cli_argv(tiny_model, prompt_file, out, "trainer.max_steps=5"), "second")
    assert second.wait(120) == 2
    assert f"another job (pid {first.pid} on " in second.output()
    second.assert_no_process_left(10)
    assert first.popen.poll() is None  # the first job is untouched

    sent = time.monotonic()
    first.signal(signal.SIGINT)
    assert first.wait(180) == 130, first.output()[-3000:]
    assert time.monotonic() - sent < 120
    first.assert_no_process_left(30)
    text = first.output()
    assert "checkpoint saved:" in text, text[-3000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == f"checkpoint-{metrics_steps(out)[-1]}"
    assert status(out)["state"] == "stopped"
    assert not (out / ".asyncgrpo.lock").exists()


def test_a_stop_signal_while_the_worker_boots_reaches_the_trainer_only(tiny_model, tmp_path, jobs):
    """Ctrl-C in a run's first seconds: the CLI signals the trainer's whole process group, which still holds the
    rollout worker while it boots. The worker must come up anyway (it used to die half-started, and the
    trainer's start then hung until the second signal) and the trainer must still get its signal."""
    import sys
    from pathlib import Path

    program = str(Path(__file__).with_name("boot_signal_program.py"))
    job = jobs([sys.executable, program, str(tiny_model), str(tmp_path / "out")], "boot")
    assert job.wait(timeout=240) == 0, job.output()[-4000:]
    result = json.loads(job.output().strip().splitlines()[-1])
    assert result["booting"], "the signal was sent after the worker had left the group: the case was not tested"
    assert result == {"booting": True, "ready": True, "error": None, "seen": [int(signal.SIGINT)]}, job.output()
