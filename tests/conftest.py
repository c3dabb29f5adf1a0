"""Suite-wide: the per-test timeout (pytest-timeout, ``timeout`` in pyproject.toml) follows the machine's load,
so a loaded CI machine makes tests slower, not failed (`asyncgrpo_cli.testing.deadline_s`); and a suite ended with
SIGTERM tears down as one ended with Ctrl-C does (`sigterm_as_interrupt`)."""

from __future__ import annotations

import signal
import threading

import pytest

from asyncgrpo_cli.testing import deadline_s


def pytest_collection_modifyitems(config, items):
    try:
        base = float(config.getini("timeout") or 0)
    except (ValueError, TypeError):  # pytest-timeout not installed
        return
    if base <= 0 or config.getoption("timeout", None):  # --timeout on the command line wins
        return
    scaled = deadline_s(base)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(scaled))


def sigterm_as_interrupt(signum, frame):
    """SIGTERM to the suite's process raises KeyboardInterrupt, as Ctrl-C does: the running test's ``finally`` blocks
    and every fixture's teardown then end the processes they started (a job's supervisor, its accelerate launcher).
    Python's default ends the process at once, and a suite stopped with ``kill PID`` left a test's launcher behind
    (twenty-fifth session). A second SIGTERM ends it at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM): tearing down")


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, sigterm_as_interrupt)
