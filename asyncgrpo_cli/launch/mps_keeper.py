"""The keeper of a job's CUDA MPS control daemon: ``python -m asyncgrpo_cli.launch.mps_keeper <control>
[--drain-timeout S]``, started by the supervisor in the daemon's place (`mps.start_daemon`, `mps.keeper_argv`).

Why: the supervisor's children get a parent-death signal, so that none outlives it. The trainer answers it by
saving a checkpoint on the GPU; had the daemon died of that signal too, its MPS server would go at once, and the
save would fail ("the remote procedural call between the MPS server and the MPS client failed"). The keeper takes
that signal instead and keeps the daemon until its clients are gone, bounded in time:

- it starts ``<control> -f`` (the daemon in the foreground) as its own child, with the keeper's environment (the
  supervisor gives it `mps.MpsPlan.daemon_env`) and a parent-death signal tied to the keeper (`orphans`): a
  SIGKILL of the keeper cannot leave the daemon behind (it gets SIGTERM, which ends it and its MPS server);
- while no signal came it waits, and exits with the daemon's exit status when the daemon exits (the normal
  end: the supervisor sends ``quit`` on the control pipe, `mps.stop_daemon`);
- on SIGTERM (its own parent-death signal, or `mps.stop_daemon`'s fallback) or SIGINT it drains: every
  `POLL_S` it asks the daemon for its MPS servers (``get_server_list``) and their clients (``get_client_list
  <server pid>``), until none is left, a control command fails (the daemon is gone or does not answer), or
  ``--drain-timeout`` seconds have passed; then it sends ``quit``, waits ``--quit-timeout`` seconds for the
  daemon to exit, and SIGKILLs the daemon and its descendants (its MPS server) if it has not. A second SIGTERM
  or SIGINT does not shorten the drain (it is only said); a SIGKILL of the keeper ends the daemon at once. After
  a drain it removes the pipe folder, as the supervisor would have.

It writes its pid to `KEEPER_PID` in the pipe folder (``$CUDA_MPS_PIPE_DIRECTORY``): a job started again in the
same run folder while it drains is refused until it has exited (`mps.draining_keeper`), instead of removing the
folder under a daemon that still serves the killed job's trainer.

Exit status: the daemon's (128 + N when a signal N ended it: 137 after the SIGKILL); 1 when the daemon cannot be
started, 128 + N for a signal N that came before it was; 2 for bad arguments (argparse). Its lines (prefixed
``mps keeper:``) and the daemon's output go to the keeper's stdout (the job's ``logs/mps.log``).

This module imports nothing of the package but `run.orphans`, so that it starts fast and on its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from ..run.orphans import die_with_parent

DRAIN_S = 600.0  # default --drain-timeout: a trainer's save of a 1.7B model's checkpoint takes a minute or two
QUIT_S = 20.0  # default --quit-timeout: for the daemon (and its MPS server) to exit after ``quit``
POLL_S = 0.5  # between two looks at the daemon's clients while draining
COMMAND_S = 10.0  # for one control command (``echo get_server_list | <control>``) to answer
WAIT_S = 0.1  # between two looks at the daemon and the signals before a drain
KEEPER_PID = "keeper.pid"  # in the pipe folder: a new job there waits for a draining keeper (mps.draining_keeper)


def exit_status(returncode: int) -> int:
    """A `subprocess.Popen.returncode` as a shell gives it: itself, or 128 + N for a death by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


class Keeper:
    """Runs and drains one daemon (see the module docstring).

    Args:
        control: the ``nvidia-cuda-mps-control`` program (the daemon is ``[control, "-f"]``; a control command is
            ``control`` with the command on its stdin).
        drain_s: seconds a drain waits for the clients at most.
        quit_s: seconds to wait for the daemon to exit after ``quit``, before SIGKILL.
        poll_s: seconds between two looks at the clients.
    """

    def __init__(self, control: str, drain_s: float = DRAIN_S, quit_s: float = QUIT_S, poll_s: float = POLL_S) -> None:
        self.control, self.drain_s, self.quit_s, self.poll_s = control, drain_s, quit_s, poll_s
        self.daemon: subprocess.Popen | None = None
        self.signals: list[int] = []  # signals received, in order (the handler only records them)
        self.said = 0  # how many of them were said

    def _on_signal(self, signum: int, _frame) -> None:
        self.signals.append(signum)

    def _say_signals(self, what: str) -> None:
        """One line per signal name received since the last call, with how many times (a dead supervisor's other
        children may pass theirs on: four SIGTERMs came within one second in a GPU drill of 2026-12-06)."""
        new = [signal.Signals(n).name for n in self.signals[self.said:]]
        for name in dict.fromkeys(new):
            times = new.count(name)
            say(f"{name} received{f' ({times} times)' if times > 1 else ''}: {what}")
        self.said += len(new)

    def command(self, line: str) -> list[str] | None:
        """Send ``line`` to the daemon through ``control`` (stdin); its output's whitespace-separated words, or
        None when the command fails (cannot start, exits non-zero, or takes over `COMMAND_S` seconds)."""
        try:
            out = subprocess.run([self.control], input=line + "\n", capture_output=True, text=True, timeout=COMMAND_S)
        except (OSError, subprocess.SubprocessError) as exc:
            say(f"`echo {line} | {self.control}` failed: {exc}")
            return None
        if out.returncode != 0:
            why = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1:] or [""]
            say(f"`echo {line} | {self.control}` exited with {out.returncode}: {why[0][:200]}")
            return None
        return out.stdout.split()

    def clients(self) -> list[int] | None:
        """The pids of the clients of every MPS server of the daemon (sorted; [] when no server runs), or None
        when a control command fails or answers something other than pids."""
        servers = self.command("get_server_list")
        if servers is None or not all(w.isdigit() for w in servers):
            return None
        found: set[int] = set()
        for server in servers:
            words = self.command(f"get_client_list {server}")
            if words is None or not all(w.isdigit() for w in words):
                return None
            found.update(int(w) for w in words)
        return sorted(found)

    def run(self) -> int:
        """Start the daemon and wait for it, or for a signal and then drain. Returns the exit status (module
        docstring); 1 when the daemon cannot start (its error is said)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        if self.signals:  # came before anything started: nothing to keep
            return 128 + self.signals[0]
        keeper = os.getpid()

        def preexec() -> None:  # in the daemon before exec: SIGTERM when the keeper dies, even by SIGKILL
            die_with_parent()
            if os.getppid() != keeper:  # the keeper died before the signal was set
                os._exit(1)

        try:
            self.daemon = subprocess.Popen([self.control, "-f"], stdin=subprocess.DEVNULL, preexec_fn=preexec)
        except OSError as exc:
            say(f"cannot start `{self.control} -f`: {exc}")
            return 1
        pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe_dir:
            try:  # temp + rename: a job started meanwhile reads a whole pid or none (mps.draining_keeper)
                tmp = os.path.join(pipe_dir, f".{KEEPER_PID}.{os.getpid()}")
                with open(tmp, "w") as fh:
                    fh.write(f"{os.getpid()}\n")
                os.replace(tmp, os.path.join(pipe_dir, KEEPER_PID))
            except OSError as exc:
                say(f"could not write {KEEPER_PID} in {pipe_dir}: {exc}")
        say(f"pid {os.getpid()}: keeps the CUDA MPS control daemon `{self.control} -f` (pid {self.daemon.pid}); "
            f"on SIGTERM or SIGINT it waits up to {self.drain_s:g} s for the daemon's clients to go, then quits it")
        while not self.signals:
            try:
                return self._ended(self.daemon.wait(timeout=WAIT_S))
            except subprocess.TimeoutExpired:
                continue
        return self.drain()

    def drain(self) -> int:
        """Wait until the daemon has no client (or a control command fails, or `drain_s` seconds pass), then
        `quit` it. Returns the exit status."""
        assert self.daemon is not None
        self._say_signals(f"the daemon stays until its clients are gone (at most {self.drain_s:g} s; SIGKILL of "
                          f"pid {os.getpid()} stops it at once)")
        deadline = time.monotonic() + self.drain_s
        shown: list[int] | None = None
        while self.daemon.poll() is None:
            clients = self.clients()
            if clients is None:
                say("the daemon does not answer: it is quit now")
                break
            if not clients:
                say("no client left: the daemon is quit now")
                break
            if clients != shown:
                say(f"waiting for {len(clients)} client(s) of the MPS server: pids {' '.join(map(str, clients))}")
                shown = clients
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"the drain timeout ({self.drain_s:g} s) passed with client(s) {' '.join(map(str, clients))} "
                    "still there: the daemon is quit now")
                break
            time.sleep(min(self.poll_s, left))
            self._say_signals("still waiting for the clients (the drain is not cut short)")
        status = self.quit()
        pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe_dir:  # the supervisor, gone, would have removed it (mps.stop_daemon)
            shutil.rmtree(pipe_dir, ignore_errors=True)
        return status

    def quit(self) -> int:
        """Send ``quit`` to a daemon still running, wait `quit_s` seconds, then SIGKILL it and its descendants.
        Returns the exit status."""
        assert self.daemon is not None
        if self.daemon.poll() is None:
            self.command("quit")
            try:
                self.daemon.wait(timeout=self.quit_s)
            except subprocess.TimeoutExpired:
                say(f"the daemon did not exit within {self.quit_s:g} s of `quit`: SIGKILL to it and its MPS server")
                kill_tree(self.daemon.pid)
                self.daemon.wait()
        return self._ended(self.daemon.returncode)

    def _ended(self, returncode: int) -> int:
        say(f"the CUDA MPS control daemon (pid {self.daemon.pid if self.daemon else '?'}) exited "
            f"({exit_status(returncode)})")
        return exit_status(returncode)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (those seen with psutil; the process alone without it)."""
    procs = []
    try:
        import psutil

        procs = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing, or the process just exited
        pass
    for target in (pid, *(p.pid for p in procs)):
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def say(line: str) -> None:
    """One line of the keeper on its stdout (the job's ``logs/mps.log``), with the time."""
    print(f"mps keeper: {time.strftime('%H:%M:%S')} {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring). Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo_cli.launch.mps_keeper",
        description="Run `<control> -f` (the CUDA MPS control daemon) for one job and keep it, after a SIGTERM or "
                    "SIGINT, until its clients are gone. `asyncgrpo train` starts it under launch.mps; when the "
                    "job's supervisor dies (even by kill -9), the keeper gets SIGTERM, waits for vLLM and the "
                    "trainer (saving its checkpoint) to leave the daemon, then quits it and removes its pipe "
                    "folder ($CUDA_MPS_PIPE_DIRECTORY). A SIGKILL of the keeper ends the daemon at once.")
    parser.add_argument("control", help="the nvidia-cuda-mps-control program")
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_S, metavar="S",
                        help=f"seconds to wait for the clients after a signal (default {DRAIN_S:g})")
    parser.add_argument("--quit-timeout", type=float, default=QUIT_S, metavar="S",
                        help=f"seconds to wait for the daemon after `quit`, before SIGKILL (default {QUIT_S:g})")
    parser.add_argument("--poll", type=float, default=POLL_S, metavar="S",
                        help=f"seconds between two looks at the clients (default {POLL_S:g})")
    args = parser.parse_args(argv)
    for name in ("drain_timeout", "quit_timeout", "poll"):
        if not getattr(args, name) >= 0:  # NaN too
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a number of seconds >= 0")
    return Keeper(args.control, drain_s=args.drain_timeout, quit_s=args.quit_timeout, poll_s=args.poll).run()


if __name__ == "__main__":
    sys.exit(main())
