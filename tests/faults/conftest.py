"""Helpers of the fault suite: one tiny model and prompt file per session, jobs started as real process trees in
their own session, waits on files and conditions (never a sleep as synchronisation), kills, and a check that
no process of a job is left. Every job a test starts is SIGKILLed with all its descendants at teardown, even
when the test fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from asyncgrpo_cli.testing import make_tiny_model, still_running

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 400


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """One tiny random Qwen3-style model for the whole suite (built offline)."""
    return make_tiny_model(tmp_path_factory.mktemp("fault-model"))


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    """``NUM_PROMPTS`` prompts with their ``index`` column (JSON lines), enough that no run wraps an epoch."""
    path = tmp_path_factory.mktemp("fault-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i % 7}?", "index": i}) + "\n"
                            for i in range(NUM_PROMPTS)))
    return path


class Job:
    """A process tree started in its own session, its output in ``log``; descendants are remembered (psutil,
    polled every 0.1 s) so that `kill_all` also reaches processes re-parented after their parent died."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log = argv, log
        self.started = time.monotonic()
        with log.open("ab") as fh:
            self.popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                          start_new_session=True)
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.track()
            self._stop.wait(0.1)

    def track(self) -> None:
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def alive(self) -> list[int]:
        """Remembered processes of this job still running (`asyncgrpo_cli.testing.still_running`)."""
        return still_running(self.seen)

    def wait(self, timeout: float) -> int:
        """The exit status of the job's first process within ``timeout`` s (fails the test otherwise)."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.argv[:4]} did not exit within {timeout:.0f} s; output:\n{self.output()[-4000:]}")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL the session and every remembered descendant; reap the first process."""
        self._stop.set()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.alive():
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def assert_no_process_left(self, timeout: float = 30.0) -> None:
        """Every process this job started is gone within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                left = [(p, " ".join(psutil.Process(p).cmdline())[:120]) for p in self.alive()]
                pytest.fail(f"processes left {timeout:.0f} s after the job ended: {left}")
            time.sleep(0.1)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, job: Job | None = None) -> Any:
    """Poll ``condition`` until it returns a truthy value (returned); fails after ``timeout`` s, or as soon as
    ``job`` exited, with its output."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if job is not None and job.popen.poll() is not None:
            pytest.fail(f"the job exited with {job.popen.returncode} while waiting for {what}:\n{job.output()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}" +
                        (f"; output:\n{job.output()[-4000:]}" if job else ""))
        time.sleep(0.1)


def metrics_steps(out: Path) -> list[int]:
    """Steps logged in ``<out>/metrics.jsonl``."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def status(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def scored_indices(log: Path, run: str) -> list[int]:
    """Prompt indices the reward scored in run ``run`` (from `rewards.logged_parity`'s log)."""
    if not log.is_file():
        return []
    return [r["index"] for r in map(json.loads, log.read_text().splitlines()) if r["run"] == run]


def worker_pid(job: Job) -> int | None:
    """The rollout worker of a job: the multiprocessing-spawned child running ``spawn_main``."""
    try:
        for p in psutil.Process(job.pid).children(recursive=True):
            if "spawn_main" in " ".join(p.cmdline()):
                return p.pid
    except psutil.Error:
        return None
    return None


@pytest.fixture
def jobs(tmp_path):
    """``start(argv, name, env)`` → a `Job`; all of them are killed at teardown."""
    started: list[Job] = []

    def start(argv: list[str], name: str, env: dict[str, str] | None = None) -> Job:
        job = Job(argv, tmp_path / f"{name}.log", env)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill_all()


def api_job_argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.faults.api_job", "--model", str(model), "--data", str(data),
            "--out", str(out), *extra]


CLI_RECIPE = """# description: tiny random model for the fault suite
# @package _global_
rewards:
  - func: tests.faults.rewards:logged_parity
"""


def cli_argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """``asyncgrpo train`` on the tiny model with the embedded sampler (CPU) and the prompt file."""
    recipes = out.parent / "recipes"
    recipes.mkdir(exist_ok=True)
    (recipes / "fault_test.yaml").write_text(CLI_RECIPE)
    return [sys.executable, "-m", "asyncgrpo_cli", "train", "--recipes-dir", str(recipes), "+recipe=fault_test",
            f"model.name={model}", "sampler.backend=embedded", "sampler.device=cpu", f"sampler.port={free_port()}",
            "sampler.max_model_len=128", f"data.name={data.parent}", "rollout.num_generations=4",
            "rollout.max_completion_length=8", "rollout.num_sampler_logprobs=3", "staleness.max_staleness=2",
            "staleness.max_concurrent_rollouts=8", "trainer.bf16=false", "trainer.learning_rate=1e-2",
            "trainer.activation_checkpointing=false", f"trainer.output_dir={out}", "logging.dashboard=plain",
            # These jobs test stop paths. At lr 1e-2 the tiny model's policy can collapse to one answer within a
            # minute, and the no-signal stop (tested in tests/rollout/test_no_signal.py) would end them first.
            "rollout.max_groups_without_signal=0", *extra]
