"""The last lines of a child's log, as the supervisor shows them when that child failed.

A trainer that fails has already printed its own error; `accelerate launch` then adds a traceback of its
own (``subprocess.CalledProcessError`` from its single-process launcher, or torchrun's
``ChildFailedError`` report with its "Root Cause" table for several processes). That report says only
"the child exited with code N", which the supervisor already says, and it buries the trainer's error.
`launcher_report_removed` drops it; the full log keeps everything. accelerate >= 1.16 pipes the trainer's
stderr through the launcher and chains its report to a ``RuntimeError: <the last 512 KiB of that stderr>``
("The above exception was the direct cause of the following exception:"): a second copy of what the log
already holds, with a first line that is not an error. It goes too.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

LOG_TAIL_LINES = 30
_READ_BYTES = 262144

_TRACEBACK = "Traceback (most recent call last):"
_CALLED_PROCESS = re.compile(r"^subprocess\.CalledProcessError: Command .* "
                             r"(returned non-zero exit status|died with <Signals)")
_DIED_WITH = re.compile(r"died with <Signals\.(SIG\w+): \d+>")
_EXIT_STATUS = re.compile(r"^subprocess\.CalledProcessError: Command .* returned non-zero exit status (\d+)\.?$")
#: Exit statuses of a trainer that stopped as asked (SIGINT / SIGTERM: checkpoint, then stop; `train.main`).
STOPPED_STATUSES = (130, 143)
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Interrupt))(?::\s*(.*))?$")
# At a line's start, or glued to a progress bar that the error interrupted (tqdm ends its bar with "]" and no
# newline: "\r 12%|█▎ | 1/8 [00:37<04:24, 37.76s/it]error: ...").
_OWN_ERROR = re.compile(r"(?:^|[\r\]])\s*(?:asyncgrpo (?:trainer|router): )?(?:config )?error: (.+)$")
_PY_WARNING = re.compile(r"\.py:\d+: \w*Warning: ")  # warnings.warn's line: "path/main.py:41: UserWarning: ..."
_CHILD_FAILED = re.compile(r"^torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError")
_RULE = re.compile(r"^=+\s*$")
_CAUSE_TRAILER = "The above exception was the direct cause of the following exception:"
_STDERR_COPY = "RuntimeError: "


def tail_lines(path: str | Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a text file ([] when it does not exist); reads at most the last 256 KiB."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            fh.seek(max(0, size - _READ_BYTES))
            data = fh.read()
    except OSError:
        return []
    lines: list[str] = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        # a traceback glued to a progress bar it interrupted (tqdm ends its bar with "]" and no newline) starts
        # a line of its own, so that it is recognised and cut like any other
        at = line.find(_TRACEBACK)
        if at > 0:
            lines += [line[:at], line[at:]]
        else:
            lines.append(line)
    return lines[-n:]


def _launcher_block_end(lines: list[str], start: int) -> int | None:
    """Index after the launcher's report that starts with the traceback at ``start``, or None when that
    traceback is not the launcher's (it does not go through accelerate / torchrun, or it ends otherwise)."""
    launcher = False
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("  File ") and ("accelerate" in line or "torch/distributed" in line):
            launcher = True
        if line.startswith(_TRACEBACK):
            return None  # another traceback starts before this one ended
        if _CALLED_PROCESS.match(line):
            return i + 1 if launcher else None
        if _CHILD_FAILED.match(line):
            if not launcher:
                return None
            rules = 0  # the report is framed by two rules of '=' after the exception line
            for j in range(i + 1, len(lines)):
                rules += bool(_RULE.match(lines[j]))
                if rules == 2:
                    return j + 1
            return len(lines)
        if line and not line.startswith(" ") and not line.startswith("During handling"):
            return None  # the traceback ended with some other exception
    return None


def launcher_report_removed(lines: list[str]) -> list[str]:
    """``lines`` without the tracebacks `accelerate launch` / torchrun print after the trainer exited
    non-zero (see the module docstring); every other line, other tracebacks included, is kept."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(_TRACEBACK):
            end = _launcher_block_end(lines, i)
            if end is not None:
                _drop_stderr_copy(out)
                i = end
                continue
        out.append(lines[i])
        i += 1
    return out


def _drop_stderr_copy(out: list[str]) -> None:
    """Remove, from the end of ``out`` (the lines before a launcher report), accelerate >= 1.16's chained
    ``RuntimeError: <stderr copy>`` and its "direct cause" line (module docstring). The copy starts at the
    earliest ``RuntimeError: `` line whose following lines all appear, in order, before it (stdout lines
    interleave the original, not the copy); when that start is not within ``out`` (a tail read), only the
    "direct cause" line and its blanks go."""
    j = len(out)
    while j and not out[j - 1].strip():
        j -= 1
    if not j or out[j - 1] != _CAUSE_TRAILER:
        return
    j -= 1
    while j and not out[j - 1].strip():
        j -= 1
    del out[j:]
    if j and out[j - 1] == _STDERR_COPY.rstrip(": "):  # the copy of an empty stderr: a bare "RuntimeError"
        del out[j - 1:]
        return
    for r in range(j):
        # The copy's first line may be glued to the progress bar it follows ("  0%|...]RuntimeError: "), which
        # is then the original of the copy's last line.
        glued = _BAR.match(out[r])
        head = glued.group(0) if glued else ""
        if out[r][len(head):].lstrip().startswith(_STDERR_COPY) and \
                _in_order(out[r + 1:], out[:r] + ([head] if head else [])):
            out[r:] = [head] if head else []
            return
    # The original is not all within the lines read: a copy of a stderr that began with a progress bar starts
    # with a bare "RuntimeError: " line (its text was on the other side of the bar's carriage return).
    bare = [r for r in range(j) if out[r].strip() == _STDERR_COPY.strip()]
    if bare:
        del out[bare[-1]:]


def _in_order(needles: list[str], hay: list[str]) -> bool:
    """Whether every non-blank line of ``needles`` is found, in order, inside a line of ``hay`` (the original
    holds stdout glued to the stderr lines the copy has alone: "...it/s]step 1/40 | ...")."""
    it = iter(hay)
    return all(any(n in h for h in it) for n in needles if n.strip())


_BAR = re.compile(r"^\s*\d+%\|[^|]*\|\s*\d+/\d+ \[[^\]]*\]")  # tqdm: " 5%|▌    | 2/40 [00:43<12:00, 18.96s/it]"


def without_progress_bars(lines: list[str]) -> list[str]:
    """``lines`` without tqdm's progress bars (a bar glued to the text after it leaves that text) and without
    the blank lines they leave: a log's last lines say what happened, not how far a bar had got."""
    out: list[str] = []
    for line in lines:
        line = _BAR.sub("", line)
        line = line if line.strip() else ""
        if line or (out and out[-1]):
            out.append(line)
    return out


def without_shutdown_noise(lines: list[str]) -> list[str]:
    """``lines`` without multiprocessing's shutdown warning of a killed process tree (``resource_tracker: There
    appear to be N leaked semaphore objects``, and the ``warnings.warn(`` line it prints under it): it follows
    any kill of the trainer and read as a second error (fresh-user trial)."""
    out: list[str] = []
    for line in lines:
        if "resource_tracker: There appear to be" in line:
            continue
        if line.strip().startswith("warnings.warn('resource_tracker"):
            continue
        out.append(line)
    return out


def failure_tail(path: str | Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a failed child's log once the launcher's own report, progress bars and
    multiprocessing's shutdown warning are removed."""
    return without_shutdown_noise(without_progress_bars(launcher_report_removed(tail_lines(path, n + 60))))[-n:]


def killed_by(path: str | Path) -> str | None:
    """The signal (``SIGKILL``) that killed the trainer, as its launcher reported it in the log (accelerate's
    ``CalledProcessError ... died with <Signals.SIGKILL: 9>``: the launcher itself then exits with 1)."""
    for line in reversed(tail_lines(path, 200)):
        found = _DIED_WITH.search(line)
        if found:
            return found.group(1)
    return None


def launcher_reported_status(path: str | Path) -> int | None:
    """The trainer's own exit status as its single-process launcher reported it last in the log (accelerate's
    ``CalledProcessError ... returned non-zero exit status 130``: the launcher itself then exits with 1); None
    when the log holds no such report."""
    for line in reversed(tail_lines(path, 200)):
        found = _EXIT_STATUS.match(line.strip())
        if found:
            return int(found.group(1))
    return None


_FORCED_NOTE = "the trainer was stopped at once by a second stop signal"


def note_requested_stop(path: str | Path, why: str | None = None, forced: bool = False) -> bool:
    """After the supervisor asked the trainer to stop: when the launcher's report ends the log with the trainer's
    exit status 130 or 143 (`STOPPED_STATUSES`), remove that report (its ``CalledProcessError`` traceback and
    accelerate's ``RuntimeError:`` copy of the trainer's stderr read as a crash: two fresh-user trials) and end the
    log with a line, after the time, saying the trainer stopped as asked and ``why`` the supervisor asked (a third
    trial read "stopped as asked" alone at the end of a run whose server had been killed). ``forced``: a second
    signal stopped the trainer at once (SIGTERM to its process group), which also stops its launcher before it
    reports, and the trainer's own last line, written through the launcher, is lost: the log then ends with a line
    saying so (it ended with whatever the trainer was doing). Returns whether it wrote a line; other logs are left
    as they are."""
    status = launcher_reported_status(path)
    if status not in STOPPED_STATUSES and forced:
        if any(_FORCED_NOTE in line for line in tail_lines(path, 1)):
            return False  # said already (the supervisor's final sweep stops the trainer's group again)
        if status is not None:
            _remove_launcher_report(Path(path))
        because = f"; the stop was asked because {why}" if why else ""
        _append_line(path, f"{_FORCED_NOTE}, without waiting for its checkpoint{because}")
        return True
    if status not in STOPPED_STATUSES:
        return False
    _remove_launcher_report(Path(path))
    because = f", because {why}" if why else ""
    _append_line(path, f"the trainer stopped as asked{because} (exit status {status}; accelerate's report of that "
                 "status, no crash, was removed from this log)")
    return True


def note_own_error_exit(path: str | Path) -> bool:
    """After the trainer exited non-zero on its own, its last words its own error line (``error: ...``, printed by
    `train.main` with no traceback: a hung server's watchdog, a failed rollout worker, a late config error): remove
    the launcher's report of that exit status (its traceback, and accelerate's copy of the trainer's stderr), as
    `note_requested_stop` does after a stop, and end the log with a line saying that the trainer exited with that
    status after its error above (the hang's deliberate stop ended trainer.log with accelerate's traceback). Returns
    whether it did; a crash (a traceback of the trainer's own after its last error line) is left as it is."""
    status = launcher_reported_status(path)
    if status is None or status in STOPPED_STATUSES:
        return False
    lines = launcher_report_removed(tail_lines(path, 200))
    own = max((i for i, line in enumerate(lines) if _OWN_ERROR.search(line.strip())), default=None)
    if own is None or any(line.startswith(_TRACEBACK) for line in lines[own:]):
        return False
    _remove_launcher_report(Path(path))
    _append_line(path, f"the trainer exited with status {status} after its error above (accelerate's report of that "
                 "status, which repeated it, was removed from this log)")
    return True


def _append_line(path: str | Path, text: str) -> None:
    """End the log at ``path`` with ``HH:MM:SS asyncgrpo: <text>``, a line of ours."""
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{time.strftime('%H:%M:%S')} asyncgrpo: {text}\n")


_REWRITE_BYTES = 4 * 1024 * 1024  # the report and accelerate's copy (<= 512 KiB) with the lines it copied


def _remove_launcher_report(path: Path) -> None:
    """Cut `launcher_report_removed`'s lines out of the end of ``path`` in place (its last `_REWRITE_BYTES`;
    the file is opened for appending by its writers, so a late write still lands at the end)."""
    try:
        size = path.stat().st_size
        start = max(0, size - _REWRITE_BYTES)
        with path.open("rb") as fh:
            fh.seek(start)
            data = fh.read()
    except OSError:
        return
    if start:
        cut = data.find(b"\n") + 1
        start, data = start + cut, data[cut:]
    lines: list[str] = []
    for line in data.decode("utf-8", errors="replace").split("\n"):
        at = line.find(_TRACEBACK)  # a traceback glued to a progress bar starts a line of its own (`tail_lines`)
        lines += [line[:at], line[at:]] if at > 0 else [line]
    kept = launcher_report_removed(lines)
    if kept == lines:
        return
    text = "\n".join(kept).rstrip("\n")
    try:
        with path.open("r+b") as fh:
            fh.seek(start)
            fh.truncate()
            fh.write((text + "\n" if text else "").encode("utf-8"))
    except OSError:
        pass


def failure_cause(lines: list[str]) -> str | None:
    """The one line that says why a child failed: the last ``error: ...`` line it printed itself (the
    trainer's own messages name the fix), else the last exception line of its tracebacks (the launcher's
    removed first), cut to 600 characters; None when there is neither."""
    kept = launcher_report_removed(lines)
    for line in reversed(kept):
        own = _OWN_ERROR.search(line.strip())
        if own:
            return own.group(1)[:600]
    for line in reversed(kept):
        found = _EXCEPTION.match(line.strip())
        if found and (_PY_WARNING.search(found.group(2) or "") or (found.group(2) or "").lstrip().startswith("note: ")):
            continue  # a copy of a Python warning ("RuntimeError: x.py:41: UserWarning: ...") or of a start-up note
        if found and not line.startswith(" "):
            name, text = found.group(1), (found.group(2) or "").strip()
            return (f"{name}: {text}" if text else name)[:600]
    return None


CAUSE_ABOVE = "(the cause above)"


def cause_said_once(lines: list[str], cause: str | None) -> list[str]:
    """``lines`` (a failed child's last lines, printed under its ``cause:`` line) with the cause's text, where a
    line holds it (the child's own ``error:`` line, or its exception's), replaced by `CAUSE_ABOVE`: a hang's
    cause (some 450 characters) was printed three times, in the dashboard's last frame, as the cause and in these
    lines (a fresh-user trial). The line stays, so the lines after it (the same message's) still read in order."""
    if not cause:
        return list(lines)
    out = []
    for line in lines:
        at = line.find(cause)
        if at >= 0:
            head = line[:at]
            line = (head if not head.endswith(".") else "") + CAUSE_ABOVE  # "module.Error: ..." keeps no "module."
        out.append(line)
    return out


def without_tracebacks(lines: list[str]) -> list[str]:
    """``lines`` with each traceback cut to its last line (the exception): the frames are in the log."""
    out: list[str] = []
    inside = False
    for line in launcher_report_removed(lines):
        if line.startswith(_TRACEBACK):
            inside = True
            continue
        if inside and (line.startswith(" ") or not line.strip() or line.startswith("During handling")
                       or line.startswith("The above exception")):
            continue
        inside = False
        out.append(line)
    return out
