"""Why a trainer is asked to stop: the one line the supervisor writes into the run folder before it signals, read
by the trainer's stop path (it goes into status.json and the console's outcome)."""

from __future__ import annotations

import signal
from pathlib import Path

STOP_REASON_FILE = "stop_reason.txt"
"""In ``<output_dir>/logs/``: one line written by the supervisor before it signals the trainer (why it stops)."""

own_reason: list[str] = []
"""Set by this process before it signals itself (the trainer's supervisor watchdog): read first by `stop_reason`."""


def stop_reason(output_dir: str | Path, signum: int) -> str:
    """Why the trainer was asked to stop: its own reason (``SIGTERM: the supervisor (pid P) is gone``), the
    supervisor's line (`STOP_REASON_FILE`: ``SIGINT from the supervisor: the server (pid N) was killed by SIGKILL``;
    a fresh-user trial read the bare ``SIGINT: ... SIGKILL`` as two signals to the same process), or the signal's
    name."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if own_reason:
        return f"{name}: {own_reason[-1]}"
    text = read_stop_reason(output_dir)
    return f"{name} from the supervisor: {text}" if text else name


FAILS_LINE = "the job fails"
"""The second line of `STOP_REASON_FILE` when the supervisor stops the trainer because the job failed (its server
died), not because it was asked to stop (`stop_fails`)."""


def read_stop_reason(output_dir: str | Path) -> str | None:
    """The supervisor's line (`STOP_REASON_FILE`'s first), None when it wrote none."""
    try:
        text = (Path(output_dir) / "logs" / STOP_REASON_FILE).read_text().strip()
    except OSError:
        return None
    return text.splitlines()[0].strip() if text else None


def stop_fails(output_dir: str | Path) -> bool:
    """Whether the supervisor stops the trainer because the job failed (`write_stop_reason` with ``fails``): the
    trainer then ends ``status.json`` at ``failed: <reason>`` rather than ``stopped``, as the supervisor will."""
    try:
        lines = (Path(output_dir) / "logs" / STOP_REASON_FILE).read_text().splitlines()
    except OSError:
        return False
    return any(line.strip() == FAILS_LINE for line in lines[1:])


def write_stop_reason(output_dir: str | Path, reason: str, fails: bool = False) -> None:
    """The supervisor's side of `stop_reason` (best effort: a missing folder only loses the reason). ``fails``: the
    job fails whatever the trainer does (its server died: `stop_fails`)."""
    try:
        path = Path(output_dir) / "logs" / STOP_REASON_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(reason + "\n" + (FAILS_LINE + "\n" if fails else ""))
    except OSError:
        pass


def clear_stop_reason(output_dir: str | Path) -> None:
    """Remove an earlier run's reason before a new job starts."""
    try:
        (Path(output_dir) / "logs" / STOP_REASON_FILE).unlink(missing_ok=True)
    except OSError:
        pass


def stop_under_way(output_dir: str | Path | None, server_pid: int | None = None) -> str | None:
    """Why this job is already stopping, for a line about its server's outage, which must not promise the
    outage's whole wait then (``server unreachable ... 1800 s more at most`` followed a ``kill -9`` of the server
    that the supervisor had already seen: a fresh-user trial). Only for a server the supervisor started
    (``server_pid``, default the `run.state.SERVER_PID_ENV` it sets; None for an external server or the Python
    API, whose outages are waited out): the supervisor's line (`STOP_REASON_FILE`, written before it signals),
    else ``the server (pid N) is gone`` once that pid no longer runs (the supervisor stops the job when the server it
    started exits, and may not have written its line yet; "gone", not "exited": this process cannot see how it
    ended, and the supervisor's line, a moment later, may say ``killed by SIGKILL``); None while neither holds.
    Before all that, whatever the server: ``the supervisor (pid P) is gone`` once the job's supervisor
    (`state.LOCK_OWNER_ENV`) no longer runs, or this process's own reason (`own_reason`): the trainer stops then (a
    trial's ``kill -9`` of the supervisor was followed by "every request waits for it, 1800 s more at most" in
    trainer.log, logged before the trainer's watchdog had seen it)."""
    if own_reason:
        return own_reason[-1]
    gone = _supervisor_gone()
    if gone:
        return gone
    if server_pid is None:
        from .state import server_pid_from_env

        server_pid = server_pid_from_env()
    if server_pid is None:
        return None
    said = read_stop_reason(output_dir) if output_dir else None
    if said:
        return said
    from .orphans import process_alive

    return None if process_alive(server_pid) else f"the server (pid {server_pid}) is gone"


def _supervisor_gone() -> str | None:
    """``the supervisor (pid P) is gone`` when this process runs under `asyncgrpo train` (`state.LOCK_OWNER_ENV`,
    a pid other than its own) and that pid no longer runs; else None."""
    import os

    from .state import LOCK_OWNER_ENV

    owner = os.environ.get(LOCK_OWNER_ENV, "").strip()
    if not owner.isdigit() or int(owner) in (0, os.getpid()):
        return None
    from .orphans import process_alive

    return None if process_alive(int(owner)) else f"the supervisor (pid {owner}) is gone"
