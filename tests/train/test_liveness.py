"""WorkerWatch: the timer notices a hung or dead worker without the rollout queue, and reaps its descendants."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from asyncgrpo_cli.rollout.worker import RolloutWorkerError
from asyncgrpo_cli.train.liveness import WorkerWatch, describe_exit


class FakeWorker:
    """check_alive() like RolloutWorker's: fails once ``fail_after`` seconds passed."""

    def __init__(self, fail_after: float, process=None) -> None:
        self.deadline = time.monotonic() + fail_after
        self.process = process

    def check_alive(self) -> None:
        if time.monotonic() > self.deadline:
            raise RolloutWorkerError("the rollout worker has not sent a heartbeat for 3 s (rollout_worker_timeout=2)")


def test_the_timer_reports_a_hung_worker():
    watch = WorkerWatch(FakeWorker(0.3), interval_s=0.05).start()
    deadline = time.monotonic() + 10
    while watch.problem is None:  # nobody calls check(): the thread alone must find it
        assert time.monotonic() < deadline
        time.sleep(0.02)
    watch.stop()
    assert "heartbeat" in watch.problem


def test_exit_descriptions():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"


class Proc:
    def __init__(self, popen):
        self.popen, self.pid = popen, popen.pid


def test_reap_kills_descendants_left_by_a_dead_worker():
    # A stand-in worker with a grandchild (like a reward process pool); the worker dies, the grandchild stays.
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True); time.sleep(120)")
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(worker.stdout.readline())
    try:
        watch = WorkerWatch(FakeWorker(60, Proc(worker)), interval_s=0.05)
        watch.check()  # remembers the descendants
        worker.kill()
        worker.wait()
        assert psutil.pid_exists(grandchild)
        assert watch.reap() == [grandchild]
        psutil.Process(grandchild).wait(timeout=10)
    finally:
        worker.kill()
        try:
            psutil.Process(grandchild).kill()
        except psutil.Error:
            pass
