"""Rollout-worker liveness on a timer, independent of the rollout queue (trainer rank 0).

`WorkerWatch` checks the worker about once a second on a daemon thread: a reported failure (its traceback),
an exit (its exit code or signal), or no heartbeat for ``rollout_worker_timeout`` seconds; and the problem
of the sampler server's `server_watch.ServerWatch` when one is attached (silent for ``sampler.timeout``).
The first problem is kept in `problem`; the training loop reads it at every poll and between steps, so a
queue still full of samples no longer hides a dead worker. The thread also remembers the worker's descendants (the reward
process pool) so that `reap` can kill them even after the worker itself died (they are re-parented then).
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def describe_exit(exitcode: int | None) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` for a `multiprocessing` exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class WorkerWatch:
    """Watches a `RolloutWorker` (module docstring).

    Args:
        worker: the started `RolloutWorker` handle.
        interval_s: check period, seconds.
    """

    def __init__(self, worker: Any, interval_s: float = 1.0) -> None:
        self.worker = worker
        self.interval_s = interval_s
        self.problem: str | None = None
        self.problem_kind: str | None = None  # "worker", or "server": the server stopped answering (`server`)
        self.server = None  # a started `server_watch.ServerWatch` whose problem stops the run too
        self._descendants: dict[int, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> WorkerWatch:
        """Start the daemon thread."""
        self._thread = threading.Thread(target=self._run, name="rollout-worker-watch", daemon=True)
        self._thread.start()
        return self

    def check(self) -> str | None:
        """One check now (also run by the thread): the problem text, or None while the worker is healthy."""
        from ..rollout.worker import RolloutWorkerError

        with self._lock:  # the thread and the training loop both call it; the traceback is read once
            if self.problem is not None:
                return self.problem
            self._track()
            try:
                self.worker.check_alive()
            except RolloutWorkerError as exc:
                text = str(exc)
                proc = getattr(self.worker, "process", None)
                if proc is not None and not proc.is_alive() and "exited with code" in text:
                    text = (f"the rollout worker (pid {proc.pid}) died: {describe_exit(proc.exitcode)}, "
                            "without reporting an error")
                self.problem, self.problem_kind = text, "worker"
            server_problem = getattr(self.server, "problem", None)
            if self.problem is None and server_problem is not None:
                self.problem, self.problem_kind = server_problem, "server"
            return self.problem

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.check() is not None:
                    return
            except Exception:  # noqa: BLE001 - the watch must never break training; the loop checks too
                continue

    def _track(self) -> None:
        proc = getattr(self.worker, "process", None)
        if proc is None or proc.pid is None:
            return
        try:
            import psutil

            for child in psutil.Process(proc.pid).children(recursive=True):
                self._descendants.setdefault(child.pid, child.create_time())
        except Exception:  # noqa: BLE001 - the worker just exited, or psutil is missing
            return

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def reap(self) -> list[int]:
        """SIGKILL every remembered descendant of the worker still running (same pid and start time);
        returns their pids. Call after the worker was stopped."""
        killed = []
        try:
            import psutil
        except ImportError:
            return killed
        for pid, created in self._descendants.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    killed.append(pid)
            except Exception:  # noqa: BLE001 - already gone
                continue
        return killed
