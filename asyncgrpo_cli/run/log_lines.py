"""The package's log records in a log file: each after its time, as the trainer's plain lines are (`train.console_log`).

Without a handler of its own, a warning of ``asyncgrpo_cli`` (a retry, an outage, a failed ``/metrics`` read) reached
``logs/trainer.log`` through Python's last-resort handler: the message alone, without the time that the step lines
around it carry. A fresh-user trial (twenty-fourth session) could not time what it read there. `stamp_package_logs`
gives the package's logger one handler, in the processes whose output is a run's log (the trainer under
`asyncgrpo train`, its rollout worker).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

PACKAGE_LOGGER = "asyncgrpo_cli"
TIME_FORMAT = "%H:%M:%S"  # every stamped line's: `stamped`, `stamp_package_logs`


def stamp_package_logs(stream: TextIO | None = None) -> bool:
    """Give the ``asyncgrpo_cli`` logger a handler writing ``HH:MM:SS <message>`` to ``stream`` (default
    ``sys.stderr``) at WARNING and above (what the last-resort handler printed), when ``stream`` is not a terminal and
    the logger has no handler yet; its records then no longer propagate to the root logger (no line twice).
    Returns whether it did."""
    stream = sys.stderr if stream is None else stream
    logger = logging.getLogger(PACKAGE_LOGGER)
    isatty = getattr(stream, "isatty", None)
    if logger.handlers or (isatty is not None and isatty()):
        return False
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", TIME_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False
    return True


def stamped(line: str) -> str:
    """``line`` after the local wall-clock time, ``23:14:05 step 3/8 | ...``: how a line reads in a log file."""
    return f"{time.strftime(TIME_FORMAT)} {line}"


def say(line: str, stream: TextIO | None = None) -> None:
    """Print one event line of a trainer or worker process to ``stream`` (default ``sys.stdout``), after its
    ``HH:MM:SS`` time (`stamped`) when ``stream`` is not a terminal (a run's log), as its warnings are
    (`stamp_package_logs`)."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    print(line if isatty is not None and isatty() else stamped(line), file=stream, flush=True)
