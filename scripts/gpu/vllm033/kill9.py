"""The ``_kill9`` drill of issue #42's job (`realistic.JOB_TAGS`) and the checks of a ``launch.mps=true`` run.

A ``_kill9`` run goes on past the measured steps; once step ``after`` is logged, `Kill9.fire` kill -9s the
supervisor (the driver's child running ``asyncgrpo_cli``), having remembered its tree (vLLM, its engine, the
trainer, the CUDA MPS control daemon and its server). `Kill9.observe` then waits for every remembered process to
go and records what is left after the wait: DEVELOPERS.md's "no process left", the checkpoint the trainer wrote,
status.json, the GPU's compute processes and any MPS process on the machine. What it remembered and is still
there is then SIGKILLed (its own processes only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from asyncgrpo_cli.testing import still_running

STATUS_KEYS = ("state", "step", "note", "stopping", "trainer_state", "server_status", "last_checkpoint", "last_error",
               "resume_command")
MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def supervisor_pid(driver: int | None = None) -> int | None:
    """The pid of the ``asyncgrpo_cli`` child of ``driver`` (default: this process), or None."""
    try:
        children = psutil.Process(driver or os.getpid()).children()
    except psutil.Error:
        return None
    for p in children:
        try:
            if any("asyncgrpo_cli" in a for a in p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    return None


def describe(pid: int) -> dict:
    """pid, name, status and the start of its command line (``gone`` once it is)."""
    try:
        p = psutil.Process(pid)
        return {"pid": pid, "name": p.name(), "status": p.status(), "cmdline": " ".join(p.cmdline())[:160]}
    except psutil.Error:
        return {"pid": pid, "status": "gone"}


def mps_processes() -> list[dict]:
    """Every CUDA MPS control daemon or server on the machine (`describe` rows)."""
    out = []
    for p in psutil.process_iter(["pid", "name"]):
        if (p.info.get("name") or "") in MPS_NAMES:
            out.append(describe(p.info["pid"]))
    return [r for r in out if r["status"] not in ("gone", psutil.STATUS_ZOMBIE)]


def mps_pipe_dirs() -> list[str]:
    """The run pipe folders (`launch.mps.pipe_dir_of`) in the temp dir."""
    return sorted(str(p) for p in Path(tempfile.gettempdir()).glob("asyncgrpo-mps-*"))


def gpu_apps() -> list[str]:
    """nvidia-smi's compute processes (pid, name, MiB), or why they could not be read."""
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        return [repr(exc)]


def mps_check(run_dir: Path, console: str) -> dict:
    """After a ``launch.mps=true`` run: how many processes joined its daemon (`launch.mps.joined_clients`: the
    distinct pids of ``NEW CLIENT`` lines in ``logs/mps.log`` and ``logs/mps/control.log``; vLLM's engine, its API
    servers and the trainer), the client lines, the console's CUDA MPS lines, and the MPS processes and pipe
    folders left."""
    from asyncgrpo_cli.launch import mps

    plan = mps.MpsPlan("", mps.pipe_dir_of(run_dir), run_dir / "logs" / "mps")
    lines = [line for p in (plan.stdout_log, plan.log_dir / "control.log") if p.is_file()
             for line in p.read_text(errors="replace").splitlines() if "NEW CLIENT" in line or "mps keeper" in line]
    return {"joined_clients": mps.joined_clients(plan), "client_lines": [line[:200] for line in lines[:30]],
            "console": [line[:300] for line in console.splitlines() if "MPS" in line][:10],
            "mps_processes_after": mps_processes(), "pipe_dirs_after": mps_pipe_dirs()}


class Kill9:
    """kill -9 of the job's supervisor once step ``after`` is logged, and what that leaves."""

    def __init__(self, after: int, run_dir: Path) -> None:
        self.after, self.run_dir = after, run_dir
        self.seen: dict[int, float] = {}
        self.t: float | None = None
        self.record: dict = {"after_step": after}

    def fire(self, last_step: int) -> bool:
        """kill -9 of the supervisor if step ``after`` is logged and it has not fired yet; whether it fired now."""
        if self.t is not None or last_step < self.after:
            return False
        pid = supervisor_pid()
        if pid is None:
            return False
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return False
        for p in procs:
            try:
                self.seen.setdefault(p.pid, p.create_time())
            except psutil.Error:
                continue
        self.record.update(supervisor=pid, step_at_kill=last_step, tree=[describe(p) for p in self.seen],
                           gpu_before=gpu_apps())
        os.kill(pid, signal.SIGKILL)
        self.t = time.monotonic()
        return True

    def left(self) -> list[int]:
        """Remembered processes still running (`asyncgrpo_cli.testing.still_running`)."""
        return still_running(self.seen)

    def observe(self, timeout_s: float = 120.0) -> dict:
        """Wait up to ``timeout_s`` for every remembered process to go; record when, what is left, the
        checkpoints, status.json and the GPU; then SIGKILL what is left of them."""
        if self.t is None:
            self.record["fired"] = False
            return self.record
        deadline = self.t + timeout_s
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = self.left()
        self.record.update(fired=True, all_gone_after_s=None if left else round(time.monotonic() - self.t, 1),
                           left_after_wait=[describe(p) for p in left], mps_processes_after=mps_processes(),
                           pipe_dirs_after=mps_pipe_dirs(), gpu_after=gpu_apps(),
                           checkpoints=sorted(p.name for p in self.run_dir.glob("checkpoint-*")),
                           partial=sorted(p.name for p in self.run_dir.glob(".checkpoint-*")))
        try:
            status = json.loads((self.run_dir / "status.json").read_text())
            self.record["status"] = {k: status.get(k) for k in STATUS_KEYS if k in status}
        except (OSError, ValueError) as exc:
            self.record["status"] = repr(exc)
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        return self.record
