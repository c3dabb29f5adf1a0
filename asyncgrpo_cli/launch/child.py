"""`Child`: one process the supervisor starts (the server, the trainer's launcher), in its own session, with
its descendants tracked so that no orphan survives the job (see `launch.supervisor`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ..run.orphans import die_with_parent
from .log_tail import LOG_TAIL_LINES, failure_tail


class Child:
    """A child process started in its own session, its output appended to ``log_path``.

    Args:
        name: component name (``server``, ``trainer``) used in messages.
        argv: the command.
        env: variables added to the supervisor's environment.
        log_path: log file (stdout and stderr).
        death_signal: the kernel sends the leader SIGTERM when the supervisor dies (`orphans.die_with_parent`).
            Not for the trainer's launcher: accelerate >= 1.16 answers SIGTERM by terminating its whole tree
            and SIGKILLing it 5 s later, which would cut the trainer's save; the trainer follows the
            supervisor's pid itself and the launcher exits with it.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, *,
                 death_signal: bool = True) -> None:
        self.name, self.argv, self.env, self.log_path = name, list(argv), dict(env), log_path
        self.death_signal = death_signal
        self.popen: subprocess.Popen | None = None
        self._seen: dict[int, float] = {}  # descendant pid -> create time (psutil)
        self._direct: dict[int, float] = {}  # direct children of the leader -> create time

    def start(self) -> Child:
        """Start the process (its own session / process group). With ``death_signal`` it gets SIGTERM if the
        supervisor dies, even by SIGKILL (`orphans.die_with_parent`); the trainer follows the supervisor's
        pid itself (`train.main`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # when it started (the lines of a trainer log carry the time only): a resume appends to the same log
            blank = "\n" if log.tell() else ""  # a blank line before a resume's part of the log, none at its top
            log.write(f"{blank}$ {' '.join(self.argv)}  # started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **self.env}, start_new_session=True,
                                          preexec_fn=die_with_parent if self.death_signal else None)
        return self

    @property
    def pid(self) -> int | None:
        """The leader's pid (= its process group id)."""
        return self.popen.pid if self.popen else None

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.popen.poll() if self.popen else None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (ignored when the group is gone); a stop signal is
        followed by SIGCONT, so that a process stopped with SIGSTOP or Ctrl-Z acts on it now instead of
        when someone continues it."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
            if sig in (signal.SIGINT, signal.SIGTERM):
                os.killpg(self.popen.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to the leader's direct children seen so far (`track`: the trainer ranks under
        ``accelerate launch``), not to the launcher itself: accelerate >= 1.16 answers a SIGINT or SIGTERM by
        sending SIGTERM to its whole tree and SIGKILL 5 s later, a second signal that would stop the trainer
        without its save. Before any rank is seen (the launcher still starting), the whole group gets it.
        A stop signal is followed by SIGCONT to them and to the launcher, as in `signal_group`."""
        ranks = self._alive_direct()
        if not ranks:
            self.signal_group(sig)
            return
        for p in ranks:
            try:
                p.send_signal(sig)
                if sig in (signal.SIGINT, signal.SIGTERM):
                    p.send_signal(signal.SIGCONT)
            except Exception:  # noqa: BLE001 - it just exited
                continue
        if sig in (signal.SIGINT, signal.SIGTERM) and self.popen is not None:  # a stopped launcher relays no
            try:                                                             # stderr: the rank would block on it
                os.kill(self.popen.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

    def _alive_direct(self) -> list:
        """The tracked direct children of the leader still running (same pid and start time), as
        `psutil.Process` objects; [] without psutil."""
        try:
            import psutil
        except ImportError:
            return []
        alive = []
        for pid, created in self._direct.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except Exception:  # noqa: BLE001 - gone
                continue
        return alive

    def stopped(self) -> bool:
        """Whether the leader is stopped (SIGSTOP, SIGTSTP, Ctrl-Z): alive, and running nothing."""
        if self.popen is None or self.poll() is not None:
            return False
        try:
            import psutil

            return psutil.Process(self.popen.pid).status() == psutil.STATUS_STOPPED
        except Exception:  # noqa: BLE001 - psutil missing or the process just exited
            return False

    def stopped_pid(self) -> int | None:
        """The pid of the leader or of a tracked direct child (a trainer rank) that is stopped (SIGSTOP, Ctrl-Z),
        else None. A stopped launcher stops its trainer too once the stderr pipe it relays fills (accelerate
        >= 1.16 relays the trainer's stderr)."""
        if self.stopped():
            return self.popen.pid if self.popen is not None else None
        try:
            import psutil
        except ImportError:
            return None
        for p in self._alive_direct():
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    return p.pid
            except Exception:  # noqa: BLE001 - it just exited
                continue
        return None

    def group_alive(self) -> bool:
        """Whether any process of the child's group is still there."""
        if self.popen is None:
            return False
        self.poll()
        try:
            os.killpg(self.popen.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def track(self) -> None:
        """Remember the current descendants (psutil; no-op without it) for the final sweep, and the
        leader's direct children (the trainer ranks under accelerate) for `main_alive`."""
        if self.popen is None or self.poll() is not None:
            return
        try:
            import psutil

            leader = psutil.Process(self.popen.pid)
            for p in leader.children(recursive=False):
                self._direct.setdefault(p.pid, p.create_time())
            for p in leader.children(recursive=True):
                self._seen.setdefault(p.pid, p.create_time())
        except Exception:  # psutil missing or the process just exited
            return

    def main_alive(self) -> bool:
        """Whether the leader or one of its direct children runs. A launcher can exit before the trainer it
        started (accelerate before 1.16 died at once of a signal that reached it while its trainer went on
        saving): that trainer is a direct child, so waiting on this waits for the save (the rollout worker,
        a grandchild, is not waited for)."""
        if self.poll() is None and self.popen is not None:
            return True
        return bool(self._alive_direct())

    def kill_leftovers(self) -> None:
        """SIGKILL the group and every tracked descendant still running (same pid and start time)."""
        self.signal_group(signal.SIGKILL)
        if not self._seen:
            return
        try:
            import psutil
        except ImportError:
            return
        for pid, created in self._seen.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3:
                    p.kill()
            except Exception:
                continue

    def tail(self, n: int = LOG_TAIL_LINES) -> list[str]:
        """The last ``n`` lines of its log, without the launcher's report of a non-zero exit
        (`log_tail.launcher_report_removed`)."""
        return failure_tail(self.log_path, n)
