"""The fault drills of docs/FAULTS.md on the CPU recipe ``+recipe=smoke`` (embedded sampler, SmolLM2-135M), run by
hand one at a time (each takes minutes on two cores), measuring what a user would see:

    python scripts/drills/smoke_faults.py SCENARIO [--out DIR]

Scenarios (issue #36):

- ``hang``: SIGSTOP of the supervised server for 60 s after step 1, then SIGCONT (default sampler.timeout):
  when status.json and the console show it, when they say it answers again, and that the run finishes;
- ``hang-timeout``: the same with ``sampler.timeout=120`` and no SIGCONT: the run must end with the cause and a
  checkpoint once the silence has lasted the timeout, leaving no process;
- ``external-down``: ``asyncgrpo serve`` + ``train sampler.backend=external sampler.timeout=60``, the server
  kill -9'ed after step 1 and left down: time to the job's exit, and a metrics line for every saved step;
- ``external-back``: the same server restarted 20 s after the kill: the re-push in the logs, the run finishes;
- ``double-ctrl-c``: two SIGINTs 0.3 s apart once step 2 is trained: what the console says about checkpoints;
- ``resume-stop``: a finished run (8 steps), resumed with ``trainer.max_steps=16`` and stopped after step 9: the
  summary's final-model row, then the same command again: the used-folder refusal;
- ``server-kill``: kill -9 of the supervised server after step 1: the error and cause lines, time to exit;
- ``supervisor-kill``: kill -9 of the supervisor (``asyncgrpo train`` itself) once step 1 is in ``metrics.jsonl``
  (issue #45): how long until every process of the job is gone, the checkpoints, what ``status.json`` says last,
  and the end of ``logs/trainer.log``. ``--after-step N`` kills after step N instead.

Every process a scenario starts runs in a session of its own and is SIGKILLed by its group at the end. Prints
one JSON object of measurements (and the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from asyncgrpo_cli.testing import still_running

SMOKE = ["+recipe=smoke", "logging.dashboard=plain"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One started command in its own session; its output in ``log``; descendants remembered."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.popen = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.seen: dict[int, float] = {}

    def track(self) -> None:
        """Remember the process and its current descendants (pid, start time)."""
        try:
            for p in [psutil.Process(self.popen.pid), *psutil.Process(self.popen.pid).children(recursive=True)]:
                self.seen.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def left(self) -> list[int]:
        """Remembered processes still running (`asyncgrpo_cli.testing.still_running`)."""
        return still_running(self.seen)

    def kill(self) -> None:
        """SIGKILL its session and every remembered descendant; reap it."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.left():
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


def wait_for(cond, timeout: float, what: str, procs: list[Proc] = ()):
    """Poll ``cond`` every 0.2 s until it is truthy (returned); `TimeoutError` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.track()
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def status(out: Path) -> dict:
    """``<out>/status.json`` ({} while absent or half-written)."""
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def steps(out: Path) -> list[int]:
    """The steps ``<out>/metrics.jsonl`` has a window for."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r["step"] for r in map(json.loads, filter(None, lines)) if "event" not in r]


def checkpoints(out: Path) -> list[int]:
    """N of every ``checkpoint-N`` folder of ``out``."""
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit())


def train(out: Path, *extra: str) -> list[str]:
    """The ``asyncgrpo train +recipe=smoke`` argv writing into ``out``, with ``extra`` overrides."""
    return [sys.executable, "-m", "asyncgrpo_cli", "train", *SMOKE, f"trainer.output_dir={out}", *extra]


def lines_with(text: str, *words: str) -> list[str]:
    """The lines of ``text`` holding any of ``words``."""
    return [ln for ln in text.splitlines() if any(w in ln for w in words)]


def finish(job: Proc, timeout: float) -> tuple[int | None, float]:
    """Wait up to ``timeout`` s for ``job``: (exit status or None, seconds waited)."""
    start = time.monotonic()
    try:
        rc = job.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.monotonic() - start


def hang(out: Path, timeout_s: float | None) -> dict:
    """Scenarios ``hang`` (``timeout_s`` None: SIGCONT after 60 s) and ``hang-timeout``."""
    port = free_port()
    job = Proc(train(out, f"sampler.port={port}", "trainer.max_steps=8",
                     *([f"sampler.timeout={timeout_s:g}"] if timeout_s else [])), out.parent / "job.log")
    result: dict = {}
    try:
        server = int(wait_for(lambda: re.search(r"started the server \(pid (\d+)\)", job.output()), 300, "server",
                              [job]).group(1))
        wait_for(lambda: steps(out), 1200, "step 1", [job])
        os.kill(server, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: str(status(out).get("server_status") or "").startswith("server not answering"), 120,
                 "status.json shows it", [job])
        result["status_shown_s"] = round(time.monotonic() - t0, 1)
        wait_for(lambda: "server not answering" in job.output(), 60, "the console shows it", [job])
        result["console_shown_s"] = round(time.monotonic() - t0, 1)
        result["status_line"] = status(out).get("server_status")
        if timeout_s is None:
            wait_for(lambda: time.monotonic() - t0 >= 60, 120, "60 s", [job])
            os.kill(server, signal.SIGCONT)
            t1 = time.monotonic()
            wait_for(lambda: "sampler server: answering again" in job.output(), 120, "answering again", [job])
            result["answering_again_s"] = round(time.monotonic() - t1, 1)
        rc, waited = finish(job, 1800)
        result.update(rc=rc, exit_after_sigstop_s=round(time.monotonic() - t0, 1), steps=steps(out),
                      checkpoints=checkpoints(out), state=status(out).get("state"),
                      console=lines_with(job.output(), "server not answering", "answering again", "error:",
                                         "cause:", "checkpoint saved", "resume with", "outcome"))
        time.sleep(2)
        result["processes_left"] = job.left()
    finally:
        job.kill()
    return result


def external(out: Path, restart_after_s: float | None) -> dict:
    """Scenarios ``external-down`` (``restart_after_s`` None) and ``external-back``."""
    port = free_port()
    serve_argv = [sys.executable, "-m", "asyncgrpo_cli", "serve", "+recipe=smoke", f"sampler.port={port}"]
    server = Proc(serve_argv, out.parent / "serve.log")
    result: dict = {}
    procs = [server]
    try:
        wait_for(lambda: "serving" in server.output(), 300, "the server", procs)
        job = Proc(train(out, "sampler.backend=external", f"sampler.url=http://127.0.0.1:{port}", "sampler.timeout=60",
                         "trainer.save_steps=1", f"trainer.max_steps={4 if restart_after_s else 16}"),
                   out.parent / "job.log")
        procs.append(job)
        wait_for(lambda: steps(out), 1200, "step 1", procs)
        server.kill()
        t0 = time.monotonic()
        if restart_after_s:
            wait_for(lambda: time.monotonic() - t0 >= restart_after_s, 60, "the restart delay", procs)
            server = Proc(serve_argv, out.parent / "serve2.log")
            procs.append(server)
        rc, _ = finish(job, 1800)
        trainer_log = (out / "logs" / "trainer.log").read_text(errors="replace")
        result.update(rc=rc, exit_after_kill_s=round(time.monotonic() - t0, 1), steps=steps(out),
                      checkpoints=checkpoints(out), state=status(out).get("state"),
                      every_checkpoint_logged=set(checkpoints(out)) <= set(steps(out)),
                      console=lines_with(job.output(), "server unreachable", "server back", "answering again", "error:",
                                         "cause:", "checkpoint saved", "outcome")[-12:],
                      repush_log=lines_with(trainer_log, "answers again after an outage", "re-pushed model version"))
        time.sleep(2)
        result["processes_left"] = job.left()
    finally:
        for p in procs:
            p.kill()
    return result


def double_ctrl_c(out: Path) -> dict:
    """Scenario ``double-ctrl-c``."""
    job = Proc(train(out, f"sampler.port={free_port()}", "trainer.max_steps=16", "trainer.save_steps=1"),
               out.parent / "job.log")
    result: dict = {}
    try:
        wait_for(lambda: 2 in steps(out) and 1 in checkpoints(out), 1800, "step 2", [job])
        job.popen.send_signal(signal.SIGINT)
        time.sleep(0.3)  # the drill itself: two Ctrl-C 0.3 s apart
        job.popen.send_signal(signal.SIGINT)
        rc, waited = finish(job, 300)
        result.update(rc=rc, exit_after_second_s=round(waited, 1), checkpoints=checkpoints(out), steps=steps(out),
                      partial=[p.name for p in out.glob(".checkpoint-*")], state=status(out).get("state"),
                      console=lines_with(job.output(), "SIGINT", "checkpoint", "final model", "resume with"))
        time.sleep(2)
        result["processes_left"] = job.left()
    finally:
        job.kill()
    return result


def resume_stop(out: Path) -> dict:
    """Scenario ``resume-stop``."""
    port = free_port()
    first = Proc(train(out, f"sampler.port={port}"), out.parent / "first.log")
    result: dict = {}
    try:
        rc, waited = finish(first, 1800)
        result["first"] = {"rc": rc, "s": round(waited, 1), "final": lines_with(first.output(), "final model")}
        argv = train(out, f"sampler.port={port}", "trainer.max_steps=16", "trainer.resume_from_checkpoint=true")
        second = Proc(argv, out.parent / "second.log")
        try:
            wait_for(lambda: 9 in steps(out), 1800, "step 9", [second])
            second.popen.send_signal(signal.SIGINT)
            rc, waited = finish(second, 600)
            result["stopped"] = {"rc": rc, "checkpoints": checkpoints(out),
                                 "console": lines_with(second.output(), "checkpoint", "final model", "steps ")}
        finally:
            second.kill()
        again = subprocess.run(train(out, f"sampler.port={port}", "trainer.max_steps=16"), capture_output=True,
                               text=True, timeout=300)
        result["again"] = {"rc": again.returncode, "refusal": (again.stdout + again.stderr).strip().splitlines()[:4]}
    finally:
        first.kill()
    return result


def server_kill(out: Path) -> dict:
    """Scenario ``server-kill``."""
    job = Proc(train(out, f"sampler.port={free_port()}", "trainer.max_steps=16"), out.parent / "job.log")
    result: dict = {}
    try:
        server = int(wait_for(lambda: re.search(r"started the server \(pid (\d+)\)", job.output()), 300, "server",
                              [job]).group(1))
        wait_for(lambda: steps(out), 1800, "step 1", [job])
        os.kill(server, signal.SIGKILL)
        t0 = time.monotonic()
        rc, _ = finish(job, 1200)
        result.update(rc=rc, exit_after_kill_s=round(time.monotonic() - t0, 1), checkpoints=checkpoints(out),
                      state=status(out).get("state"), console=lines_with(job.output(), "error:", "cause:",
                                                                         "checkpoint saved", "resume with"))
        time.sleep(2)
        result["processes_left"] = job.left()
    finally:
        job.kill()
    return result


def supervisor_kill(out: Path, after_step: int = 1) -> dict:
    """Scenario ``supervisor-kill``."""
    job = Proc(train(out, f"sampler.port={free_port()}", "trainer.max_steps=50",
                     "rollout.max_groups_without_signal=100000"), out.parent / "job.log")
    result: dict = {}
    try:
        wait_for(lambda: after_step in steps(out), 1800, f"step {after_step}", [job])
        job.track()
        os.kill(job.popen.pid, signal.SIGKILL)
        t0 = time.monotonic()
        job.popen.wait(10)
        others = [pid for pid in job.seen if pid != job.popen.pid]
        wait_for(lambda: not [pid for pid in job.left() if pid in others], 600, "every process gone")
        trainer_log = (out / "logs" / "trainer.log").read_text(errors="replace").splitlines()
        result.update(all_gone_after_s=round(time.monotonic() - t0, 1), processes=len(others),
                      checkpoints=checkpoints(out), partial=[p.name for p in out.glob(".checkpoint-*")],
                      steps=steps(out), status={k: status(out).get(k) for k in
                                                ("state", "step", "note", "stopping", "last_error", "resume_command")},
                      retry_lines=sum("retrying" in ln for ln in trainer_log), trainer_log_tail=trainer_log[-25:])
    finally:
        job.kill()
    return result


SCENARIOS = {"hang": lambda out: hang(out, None), "hang-timeout": lambda out: hang(out, 120.0),
             "external-down": lambda out: external(out, None), "external-back": lambda out: external(out, 20.0),
             "double-ctrl-c": double_ctrl_c, "resume-stop": resume_stop, "server-kill": server_kill,
             "supervisor-kill": supervisor_kill}


def main() -> int:
    """Run one scenario; print its measurements as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--out", default="/tmp/asyncgrpo-drills")
    parser.add_argument("--after-step", type=int, default=1, help="supervisor-kill: the step to kill after")
    ns = parser.parse_args()
    base = Path(ns.out) / ns.scenario
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    load_before = os.getloadavg()
    start = time.monotonic()
    if ns.scenario == "supervisor-kill":
        result = supervisor_kill(base / "run", ns.after_step)
    else:
        result = SCENARIOS[ns.scenario](base / "run")
    print(json.dumps({"scenario": ns.scenario, "load_before": [round(x, 2) for x in load_before],
                      "load_after": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count(),
                      "wall_s": round(time.monotonic() - start, 1), **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
