"""No process outlives the one that started it, even when that one is killed with SIGKILL.

Two mechanisms, both used by the supervisor's children and the rollout worker:

- `set_parent_death_signal` (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel signals this process when the
  thread that started it exits; `die_with_parent` is the ``preexec_fn`` form for `subprocess.Popen`.
- `watch_process`: a daemon thread that calls back once a given pid is gone (a zombie counts as gone), for
  a process whose parent is not the one to follow (the trainer under ``accelerate launch`` follows the
  supervisor, its grandparent).
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

try:  # resolved before any fork: the child of `die_with_parent` only calls it
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends ``sig`` to this process when the parent *thread*
    that started it exits. Returns False off Linux or when the call fails."""
    if _LIBC is None:
        return False
    try:
        return _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """``preexec_fn`` for `subprocess.Popen`: the child gets SIGTERM when its parent dies (Linux). Start
    such children from a thread that lives as long as the parent (the main thread)."""
    set_parent_death_signal(signal.SIGTERM)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting to be reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def watch_process(pid: int, on_gone: Callable[[], None], poll_s: float = 1.0,
                  name: str = "process-watchdog") -> threading.Thread:
    """Start a daemon thread that calls ``on_gone()`` once, as soon as ``pid`` is gone (checked every
    ``poll_s`` seconds). Returns the started thread."""
    def watch() -> None:
        while process_alive(pid):
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread
