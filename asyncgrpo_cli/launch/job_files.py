"""What the supervisor reads and writes in ``<output_dir>`` around the trainer: ``status.json`` (read for the
stop grace, closed with a final state when the trainer could not), and the newest complete checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

FINAL_STATES = ("finished", "stopped")


def exit_text(code: int | None) -> str:
    """``exited with code 3``, or ``was killed by SIGKILL`` for a `subprocess` return code of minus a signal."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def read_status(output_dir: str | Path) -> dict[str, Any]:
    """``<output_dir>/status.json`` as a dict ({} when absent or unreadable)."""
    try:
        data = json.loads((Path(output_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def newest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` of ``output_dir`` (`train.checkpoint`), None when there is none."""
    from ..run.checkpoints import newest_complete_checkpoint

    found = newest_complete_checkpoint(output_dir)
    return str(found) if found is not None else None


def stop_grace(configured: float | None, output_dir: str | Path, fallback_s: float) -> float:
    """Seconds to wait for the trainer to save after a stop signal: ``configured`` (``launch.stop_timeout``),
    else the trainer's last step time + 3 × its last save time + 30 s (``status.json``: ``last_step_s``,
    ``last_save_s``), else ``fallback_s`` (no save measured yet)."""
    if configured is not None:
        return float(configured)
    status = read_status(output_dir)
    save_s, step_s = status.get("last_save_s"), status.get("last_step_s")
    if isinstance(save_s, (int, float)) and save_s > 0:
        return float(step_s if isinstance(step_s, (int, float)) else 0.0) + 3.0 * float(save_s) + 30.0
    return float(fallback_s)


def _add_resume_command(output_dir: str | Path, status: dict) -> bool:
    """A trainer that stopped or was killed before its first save of this attempt (a resumed run) wrote no
    ``resume_command``: the newest complete checkpoint of the folder is what the console's ``resume with:`` names
    too. Sets ``resume_command`` (and ``last_checkpoint`` if unset) in ``status``; True when it did."""
    newest = newest_checkpoint(output_dir)
    if not newest or status.get("resume_command"):
        return False
    from ..run.folder import resume_command

    status.update(resume_command=resume_command(newest), last_checkpoint=status.get("last_checkpoint") or newest)
    return True


def finalize_status(output_dir: str | Path, rc: int, failure: str | None) -> None:
    """Give ``status.json`` a final state when the trainer left it running (killed, or stopped mid-save):
    ``finished`` (rc 0), ``stopped`` (rc 130 / 143) or ``failed: <failure>``, and ``outcome`` its one word
    (`run.state.outcome_of`). A final state is kept, except
    a trainer's ``stopped`` when the job failed (rc 1: it was stopped because its server
    died), or its ``failed: <reason>`` with ``trainer_state: stopped`` (what it writes when the supervisor said the
    job fails, `run.stop_reason.stop_fails`): the job's ``failed: <failure>`` then, the trainer's state in
    ``trainer_state``, so that the
    file, the console and the exit status agree. A run that did not finish and has a complete checkpoint gets
    ``resume_command`` (and ``last_checkpoint``) when the trainer wrote none, its own final state kept or not
    (a resumed run stopped before it saved anything: the console's ``resume with:`` names the checkpoint it
    resumed from). An absent file is written with the final state: the trainer was started (the supervisor calls
    this only then) but stopped or failed before it wrote one, while loading the model and the data (a fresh-user
    trial's Ctrl-C 2 s after the start left none, against the rule that every run ends with one)."""
    from ..run.state import ALWAYS_KEYS, outcome_of, with_always_keys, write_json_atomic

    status = read_status(output_dir)
    if not status:
        status = {"state": "", "job_pid": os.getpid()}  # the supervisor's own pid: the job's
    complete = all(key in status for key in ALWAYS_KEYS)
    with_always_keys(status)
    state = str(status.get("state", ""))
    # the trainer's own "failed: <the supervisor's reason>" after a stop for a failure: the supervisor's text, which
    # names the checkpoint too, replaces it
    told = state.startswith("failed") and status.get("trainer_state") == "stopped" and bool(failure) \
        and rc not in (0, 130, 143)
    if not told and (state.startswith("failed") or state == "finished"
                     or (state == "stopped" and (rc in (0, 130, 143) or not failure))):
        added = state != "finished" and rc != 0 and _add_resume_command(output_dir, status)
        if added or not complete or status.get("outcome") != outcome_of(state):
            status["outcome"] = outcome_of(state)
            try:
                write_json_atomic(Path(output_dir) / "status.json", status)
            except OSError:
                pass
        return
    if state == "stopped":  # the trainer stopped as asked, but the job failed (e.g. its server died)
        status["trainer_state"] = state
    if rc == 0:
        final = "finished"
    elif rc in (130, 143):
        final = "stopped"
    else:
        final = f"failed: {failure or f'exit status {rc}'}"[:300]
    if rc in (130, 143):
        kept = newest_checkpoint(output_dir)
        status["note"] = (f"the trainer was stopped while {state or 'starting'}; "
                          + (f"newest complete checkpoint: {kept}" if kept else "no complete checkpoint"))
    status["stopping"] = None  # the stop is over: its "saving ... and stopping" no longer holds
    if rc != 0:
        _add_resume_command(output_dir, status)
    status.update(state=final, outcome=outcome_of(final), updated_at=time.time())
    try:
        write_json_atomic(Path(output_dir) / "status.json", status)
    except OSError:
        pass


def write_summary_file(output_dir: str | Path, lines: list[str], append: bool = False) -> None:
    """``logs/summary.txt``: the end-of-run summary as the plain console prints it (first fresh-user trial of
    2026-12-05: after the fact the run folder held no summary); ``append``: lines after it (a failure's error, the
    resume command: the second trial), added only where the summary was written; the summary ends with the time it
    was written and the command that ran (`run.folder.train_command`); a resume's summary keeps the earlier ones
    below it, after `EARLIER_HEADER`. A write that fails is skipped: the console has printed it."""
    path = Path(output_dir) / "logs" / "summary.txt"
    if append and (not lines or not path.is_file()):
        return
    if not append:  # when, and what ran (a resume rewrites it)
        from ..run.folder import train_command

        command = train_command([])
        lines = [*lines, f"  {'written':<21} {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
                 *([f"  {'command':<21} {command}"] if command else [])]
    from ..run.state import write_text_atomic

    try:
        old = path.read_text(encoding="utf-8", errors="replace").rstrip("\n") if path.is_file() else ""
        if append:  # this attempt's lines go before the earlier attempts' summaries
            head, sep, earlier = old.partition(f"\n\n{EARLIER_HEADER}\n")
            text = "\n".join([head, *lines]) + (f"{sep}{earlier}" if sep else "")
        else:  # a resume: the earlier attempts' summaries stay below this one
            text = "\n".join([*lines, *(["", EARLIER_HEADER, _removed_marked(old, Path(output_dir))] if old else [])])
        write_text_atomic(path, text + "\n")  # it holds the earlier attempts too: never half-written
    except OSError:
        pass


def _removed_marked(text: str, output_dir: Path) -> str:
    """``text`` with ``(since removed)`` after each line that names a checkpoint folder no longer there (checkpoint
    rotation deletes the old ones: an earlier attempt's ``resume with:`` would be refused)."""
    newest = newest_checkpoint(output_dir)
    instead = f"; the newest is {Path(newest).name}: trainer.resume_from_checkpoint=true" if newest else ""
    out = []
    for line in text.splitlines():
        gone = [m for m in re.findall(r"[^\s=]*checkpoint-\d+", line)
                if not (Path(m).is_dir() or (output_dir / Path(m).name).is_dir())]
        out.append(f"{line}  ({', '.join(Path(m).name for m in gone)} since removed{instead})"
                   if gone and "since removed" not in line else line)
    return "\n".join(out)


EARLIER_HEADER = "--- an earlier attempt in this folder (a resume, or a run before it) ---"
"""The line between a resumed run's summary and the one it replaced (`write_summary_file`)."""


def server_death_cause(code: int | None) -> str:
    """The cause line of a server that died during training when its log names none: a signal from outside
    the job (the supervisor signals the server only once the trainer is done), or an exit without an error."""
    if code is not None and code < 0:
        name = exit_text(code).removeprefix("was killed by ")
        oom = "the out-of-memory killer: see `dmesg`, or " if code == -signal.SIGKILL else ""
        return f"the server got {name} from outside this job ({oom}a `kill`); its log ends without an error"
    return f"the server {exit_text(code)} without an error line in its log"
