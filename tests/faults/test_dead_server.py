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
import re
import signal
import sys
import time
from pathlib import Path

from asyncgrpo_cli.train.checkpoint import newest_complete_checkpoint

from .conftest import cli_argv, metrics_steps, status, wait_for  # noqa: F401

BOOT_S = 400.0  # start-up and step 1 on two loaded cores
STOP_BOUND_S = 90.0  # the trainer notices, saves a tiny model, the worker and the supervisor stop


def supervised(argv: list[str], events: Path, fault: str, route: str = "/update_weights@2") -> list[str]:
    """``route``: ``/update_weights@2``, the weight sync after step 1 (version 0's push at start is the first)."""
    assert argv[1:3] == ["-m", "asyncgrpo_cli"]
    return [sys.executable, "-m", "tests.faults.supervised_job", "--events", str(events), fault, route,
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
    # a cause line, as every failure path has (issue #36): the server's log ends without an error
    assert "\ncause: the server got SIGKILL from outside this job" in text, text[-4000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-1", text[-4000:]  # step 1 was complete
    assert metrics_steps(out) == [1]
    assert f"checkpoint saved: {checkpoint}" in text
    assert re.search(r"resume with: (ASYNCGRPO_\w+=\S+ )*asyncgrpo train", text), text[-4000:]  # env as the run had
    assert f"trainer.resume_from_checkpoint={checkpoint}" in text
    final = status(out)
    assert final["state"].startswith("failed: the server") and "SIGKILL" in final["state"], final
    assert final["outcome"] == "failed"
    summary = (out / "logs" / "summary.txt").read_text()  # kept with the run: the error and how to resume
    assert "  error: the server" in summary and f"trainer.resume_from_checkpoint={checkpoint}" in summary, summary
    assert "\n  cause: the server got SIGKILL from outside this job" in summary, summary  # as the console said
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "its weight sync was abandoned by the stop" in trainer_log, trainer_log[-4000:]
    assert "CalledProcessError" not in trainer_log  # the launcher's report of the stop is cut (second trial)
    assert f"SIGINT from the supervisor: the server (pid {server_pid}) was killed by SIGKILL" in trainer_log


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
    # nobody is left to read the 143, which accelerate's launcher reported with a traceback and a copy of the log
    # (the thirteenth session's trials): the trainer says why it stopped and exits 0, so the log ends there
    assert "stopped because the supervisor was gone, after saving the last completed step (step 1)" in trainer_log, \
        trainer_log[-4000:]
    assert "CalledProcessError" not in trainer_log and "exit status 143" not in trainer_log, trainer_log[-4000:]
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-1", trainer_log[-4000:]
    final = status(out)
    assert final["state"] == "stopped" and final["step"] == 1, final
    assert final["note"] == f"stopped by SIGTERM: the supervisor (pid {job.pid}) is gone", final
    # nobody is left to print how to continue: status.json says it
    assert final["resume_command"].endswith(f"trainer.resume_from_checkpoint={checkpoint}"), final
    assert final["stopping"] is None


def test_supervisor_killed_while_the_rollout_worker_boots_every_process_ends(tiny_model, prompt_file, tmp_path, jobs):
    """The thirteenth session's suite, interrupted during a job's start: the supervisor died while the trainer waited
    for its rollout worker to become ready, the server died with the supervisor, and the trainer's stop did not end
    that wait (it would have lasted sampler.timeout + 60 s; without the fix this test leaves the launcher, trainer
    and worker alive). The worker's own /v1/models read at boot (the fourth: after the doctor's and the trainer's)
    never answers here, so the kill comes while the trainer waits for the worker."""
    out, events = tmp_path / "run", tmp_path / "events.txt"
    job = jobs(supervised(run_args(tiny_model, prompt_file, out), events, "--hang-on", "/v1/models@4"), "job")
    wait_for(Path(f"{events}.hit").is_file, BOOT_S, "the rollout worker's /v1/models at boot", job)
    job.track()
    assert status(out).get("state") == "starting" and not metrics_steps(out)  # the trainer waits for its worker
    os.kill(job.pid, signal.SIGKILL)
    killed = time.monotonic()
    job.wait(30)
    job.assert_no_process_left(STOP_BOUND_S)
    print(f"measured: supervisor kill -9 during the worker's boot -> gone in {time.monotonic() - killed:.1f} s")
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "before step 1 ended: nothing was trained, so no checkpoint was possible" in trainer_log, \
        trainer_log[-4000:]
    final = status(out)
    assert final["state"] == "stopped" and final["step"] == 0 and not final.get("resume_command"), final
    assert newest_complete_checkpoint(out) is None


DOWN_TIMEOUT_S = 15.0  # sampler.timeout of the stays-down drill (backoff 1, 2, 4, 8 s: four retries in it)
DOWN_BOUND_S = 60.0  # after it: the step in progress, one save of the tiny model, the teardown (loaded CI)


def test_an_external_server_that_stays_down_fails_the_run_within_the_timeout_with_every_step_logged(
        tiny_model, prompt_file, tmp_path, jobs):
    """``sampler.backend=external``: the server dies in the weight sync after step 1 (kill -9, nobody restarts
    it). The worker met the outage first; the sync, which met it later, gives up with it (one outage, one
    clock), so the run fails within ``sampler.timeout`` + the step in progress + one save; the step whose sync
    failed is trained, logged in metrics.jsonl and saved (was: checkpoint-1 without its metrics line)."""
    from .conftest import free_port

    events, port = tmp_path / "events.txt", free_port()
    server = jobs([sys.executable, str(Path(__file__).with_name("outage_program.py")), "server", "--events",
                   str(events), "--die-on", "/update_weights@2", "--", "--model", str(tiny_model), "--port", str(port),
                   "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--max-logprobs", "8",
                   "--weights-dir", str(tmp_path / "weights")], "server")  # killed -9: its folder stays in tmp_path
    wait_for(lambda: "serving" in server.output(), 120, "the server to listen", server)
    out = tmp_path / "run"
    argv = [a for a in cli_argv(tiny_model, prompt_file, out, "trainer.max_steps=50",
                                f"sampler.timeout={DOWN_TIMEOUT_S:g}")
            if not a.startswith(("sampler.backend=", "sampler.port=", "sampler.device="))]
    job = jobs([*argv, "sampler.backend=external", f"sampler.url=http://127.0.0.1:{port}"], "job")
    wait_for(Path(f"{events}.hit").is_file, BOOT_S, "the server's death at the sync after step 1", job)
    died = time.monotonic()
    rc = job.wait(DOWN_TIMEOUT_S + DOWN_BOUND_S + 60)
    elapsed = time.monotonic() - died
    text = job.output()
    print(f"measured: external server kill -9 -> job exit in {elapsed:.1f} s (sampler.timeout={DOWN_TIMEOUT_S:g})")
    assert rc == 1, text[-4000:]
    assert elapsed < DOWN_TIMEOUT_S + DOWN_BOUND_S, (elapsed, text[-4000:])
    job.assert_no_process_left(30)
    checkpoint = newest_complete_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-1", text[-4000:]
    assert metrics_steps(out) == [1], metrics_steps(out)  # the saved step has its metrics line
    assert f"checkpoint saved: {checkpoint}" in text and f"trainer.resume_from_checkpoint={checkpoint}" in text
    cause = next((ln for ln in text.splitlines() if ln.startswith("cause: ")), "")
    assert "unreachable" in cause and f"vllm_server_timeout={DOWN_TIMEOUT_S:g} s" in cause, text[-4000:]
    assert status(out)["state"].startswith("failed"), status(out)
