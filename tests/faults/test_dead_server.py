"""The supervised server dies (kill -9) in the middle of a weight sync, and the supervisor itself is killed
with -9 while the trainer waits on the server: the trainer stops retrying at once, saves the step it
completed, the run ends with a final status and nothing is left running (docs/FAULTS.md: the rows
"the supervised server killed" and "the supervisor itself is killed").

Both drills run the real ``asyncgrpo train`` (`supervised_job.py`); its embedded sampler is
`outage_program.py server`, which dies (``--die-on``) or stops answering (``--hang-on``) at the first
``/update_weights`` of the run: the sync right after step 1. The server timeout is long (900 s), so a
trainer that kept retrying would fail the deadlines below by minutes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from asyncgrpo_cli.train.checkpoint import newest_complete_checkpoint

from .conftest import cli_argv, metrics_steps, status, wait_for

BOOT_S = 400.0  # start-up and step 1 on two loaded cores
STOP_BOUND_S = 90.0  # the trainer notices, saves a tiny model, the worker and the supervisor stop


def supervised(argv: list[str], events: Path, fault: str) -> list[str]:
    assert argv[1:3] == ["-m", "asyncgrpo_cli"]
    return [sys.executable, "-m", "tests.faults.supervised_job", "--events", str(events), fault, "/update_weights@2",  # @2: after version 0's push at start
            "--", *argv[3:]]


def run_args(tiny_model, prompt_file, out):
    return cli_argv(tiny_model, prompt_file, out, "trainer.max_steps=50", "trainer.save_steps=1",
                    "sampler.timeout=900", "launch.stop_timeout=600")


def test_server_killed_during_a_sync_the_trainer_saves_the_step_and_the_run_fails_fast(
        tiny_model, prompt_file, tmp_path, jobs):
    out, events = tmp_path / "run", tmp_path / "events.txt"
    job = jobs(supervised(run_args(tiny_model, prompt_file, out), events, "--die-on"), "job")
    hit = Path(f"{events}.hit")
    wait_for(hit.is_file, BOOT_S, "the server's death at /update_weights", job)
    died = time.monotonic()
    rc = job.wait(STOP_BOUND_S + 60)
    elapsed = time.monotonic() - died
    text = job.output()
    print(f"measured: server kill -9 during the sync -> job exit in {elapsed:.1f} s")  # docs/FAULTS.md
    assert rc == 1, text[-4000:]
    assert elapsed < STOP_BOUND_S, (elapsed, text[-4000:])  # not launch.stop_timeout=600, not sampler.timeout
    job.assert_no_process_left(30)
    server_pid = int(hit.read_text().split()[0])
    assert f"the server (pid {server_pid}) was killed by SIGKILL" in text, text[-4000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-1", text[-4000:]  # step 1 was complete
    assert metrics_steps(out) == [1]
    assert f"checkpoint saved: {checkpoint}" in text and f"resume with: asyncgrpo train" in text
    assert f"trainer.resume_from_checkpoint={checkpoint}" in text
    final = status(out)
    assert final["state"].startswith("failed: the server") and "SIGKILL" in final["state"], final
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "its weight sync was abandoned by the stop" in trainer_log, trainer_log[-4000:]
    assert f"SIGINT: the server (pid {server_pid}) was killed by SIGKILL" in trainer_log


def test_supervisor_killed_while_the_trainer_waits_on_the_server_every_process_ends(
        tiny_model, prompt_file, tmp_path, jobs):
    out, events = tmp_path / "run", tmp_path / "events.txt"
    job = jobs(supervised(run_args(tiny_model, prompt_file, out), events, "--hang-on"), "job")
    wait_for(Path(f"{events}.hit").is_file, BOOT_S, "the weight sync after step 1", job)
    job.track()
    family = len(job.seen)
    os.kill(job.pid, signal.SIGKILL)  # as the OOM killer or a closed terminal would
    killed = time.monotonic()
    job.wait(30)
    # the server (parent-death signal), the launcher, the trainer (it follows the supervisor's pid, also
    # inside its retry loop), the rollout worker (bound to the trainer) and its children
    job.assert_no_process_left(STOP_BOUND_S)
    elapsed = time.monotonic() - killed
    print(f"measured: supervisor kill -9 -> {family} processes gone in {elapsed:.1f} s")  # docs/FAULTS.md
    assert family >= 4 and elapsed < STOP_BOUND_S, (family, elapsed)
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert f"the supervisor (pid {job.pid}) is gone" in trainer_log, trainer_log[-4000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-1", trainer_log[-4000:]
    final = status(out)
    assert final["state"] == "stopped" and final["step"] == 1, final
    assert final["note"] == f"stopped by SIGTERM: the supervisor (pid {job.pid}) is gone", final
    # nobody is left to print how to continue: status.json says it
    assert final["resume_command"].endswith(f"trainer.resume_from_checkpoint={checkpoint}"), final
    assert "stopping" not in final or final["stopping"] is None
