"""The last word in ``status.json`` when nobody else is left to write it (issue #45).

The supervisor gives ``status.json`` its final state when the trainer could not (`launch.job_files.finalize_status`).
Once the supervisor itself is gone (``kill -9``, a closed terminal), the trainer stops on its own and writes its
final state; if the trainer dies too before it has (killed during the save of its last step), the file would keep
saying ``running`` with ``stopping: ... saving the last completed step``. So when the trainer learns that its
supervisor is gone, it starts a guard (`start_guard`): a small process of its own session, detached from the
trainer's tree (a double fork: the launcher's or anyone's kill of the trainer's tree does not reach it), which
waits for the trainer's pid to end and then, only if the state is not final, writes `close_cut_status`'s
``failed`` state: what was cut, the newest complete checkpoint (or that there is none) and its resume command.
The guard ends right after; it never outlives the trainer by more than one poll and one write.

    python -m asyncgrpo_cli.run.status_guard OUTPUT_DIR PID WHY
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .state import FINAL_STATES, _pid_alive, _process_started  # the one liveness test of a pid (same start time)

POLL_S = 0.25
"""Seconds between the guard's checks that the trainer still runs."""

FINAL_PREFIXES = FINAL_STATES


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def close_cut_status(output_dir: str | Path, pid: int, why: str) -> dict[str, Any] | None:
    """Give ``<output_dir>/status.json`` a final ``failed`` state after the trainer ``pid`` died without writing one.

    Args:
        output_dir: the run folder.
        pid: the trainer process that died (named in the state).
        why: what had happened before it died (``the supervisor (pid S) is gone``).

    Returns:
        The status written, or None when there was nothing to do (no file, or a final state already there).
    """
    from .checkpoints import checkpoint_step, newest_complete_checkpoint
    from .folder import resume_command_from_env
    from .state import with_always_keys, write_json_atomic

    path = Path(output_dir) / "status.json"
    status = _read(path)
    state = str(status.get("state", ""))
    if not status or state.startswith(FINAL_PREFIXES):
        return None
    step = status.get("step")
    newest = newest_complete_checkpoint(output_dir)
    saved = checkpoint_step(newest) if newest is not None else None
    if status.get("stopping") and isinstance(step, int) and step > 0 and saved != step:
        cut = f"its save of the last completed step (step {step}) was cut"
    elif status.get("stopping"):
        cut = "it died before its stop ended"
    else:
        cut = f"it died while {state or 'starting'}"
    kept = (f"the newest complete checkpoint is {newest} (step {saved})" if newest is not None
            else "there is no complete checkpoint")
    status["state"] = f"failed: the trainer (pid {pid}) died after {why}: {cut}; {kept}"[:300]
    status["outcome"] = "failed"
    status["note"] = (f"the trainer (pid {pid}) ended without writing its final state ({cut}); nothing else of the "
                      f"job was left to write it; {kept}" + ("" if newest is not None else
                                                             ": start over, or resume from an earlier run's"))
    status["stopping"] = None
    status["server_status"] = None
    if newest is not None:
        status["resume_command"] = resume_command_from_env(newest)
        status["last_checkpoint"] = str(newest)
    else:
        status["resume_command"] = None
    status["updated_at"] = time.time()
    try:
        write_json_atomic(path, with_always_keys(status))
    except OSError:
        return None
    return status


def start_guard(output_dir: str | Path, why: str, pid: int | None = None) -> int | None:
    """Start the detached guard of the trainer ``pid`` (default: this process) for ``output_dir``.

    Returns the pid of the intermediate process (already reaped), or None when it could not start (best
    effort: the trainer's own final state still comes first)."""
    pid = os.getpid() if pid is None else int(pid)
    try:
        started = _process_started(pid)
        proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo_cli.run.status_guard", str(output_dir), str(pid),
                                 why, repr(started)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        proc.wait(30)  # the intermediate exits at once, its child (the guard) detached
        return proc.pid
    except Exception:  # noqa: BLE001 - best effort
        return None


def main(argv: list[str] | None = None) -> int:
    """``OUTPUT_DIR PID WHY [CREATE_TIME]``: detach (fork; the parent returns at once), wait for ``PID`` to end,
    then `close_cut_status`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or not args[1].isdigit():
        print("usage: python -m asyncgrpo_cli.run.status_guard OUTPUT_DIR PID WHY [CREATE_TIME]", file=sys.stderr)
        return 2
    output_dir, pid, why = args[0], int(args[1]), args[2]
    try:
        started = float(args[3]) if len(args) > 3 and args[3] != "None" else None
    except ValueError:
        started = None
    if hasattr(os, "fork") and os.fork() != 0:
        return 0  # the intermediate: the guard below is re-parented, out of the trainer's tree
    while _pid_alive(pid, started):
        time.sleep(POLL_S)
    close_cut_status(output_dir, pid, why)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the forked guard must not run the parent's exit handlers twice
