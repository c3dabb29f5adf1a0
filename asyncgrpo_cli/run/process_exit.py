"""A process's exit without the interpreter's teardown of every module (1 to 3 s with torch loaded).

The trainer, the embedded sampler and the CLI leave through `exit_now` once their work is done: the supervisor
waits for each of them (every job's stop, every test that runs one). Everything a normal exit does for the run
still happens: the ``atexit`` hooks run (logging's flush, multiprocessing's joins, trackers' own hooks) and the
standard streams are flushed. When a thread other than the main one is still alive and not a daemon (a normal
exit would wait for it: an upload, a save in a pool), the normal exit is taken instead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_now(status: int) -> None:
    """Leave the process with ``status`` (an int, 0-255) as a normal exit would, without the module teardown.

    Falls back to ``sys.exit(status)`` while a non-daemon thread other than the main one is alive.
    Never returns.
    """
    main = threading.main_thread()
    if any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
