"""The suite's own set-up (tests/conftest.py): a suite ended with SIGTERM runs its teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncgrpo_cli.testing import deadline_s

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

PROBE = '''
import os, subprocess, sys, time
from pathlib import Path


def test_holds_a_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:  # the pid file is written inside: the signal, sent once it exists, lands in here
        Path(os.environ["PROBE_DIR"], "child").write_text(str(child.pid))
        time.sleep(600)
    finally:
        child.kill()
        child.wait()
        Path(os.environ["PROBE_DIR"], "torn_down").write_text("yes")
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_suite_runs_the_running_tests_teardown(tmp_path):
    """`kill PID` of a suite (a CI's cancel) left a test's accelerate launcher behind: Python's default SIGTERM ends
    the process without ``finally`` blocks or fixture teardowns. With the suite's conftest, SIGTERM raises
    KeyboardInterrupt as Ctrl-C does, so the test's ``finally`` ends the process it started."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(CONFTEST)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n"
        "pytest_configure = mod.pytest_configure\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    suite = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout",
                              str(tmp_path / "test_probe.py")], cwd=tmp_path, env={**os.environ,
                             "PROBE_DIR": str(tmp_path)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    child_file = tmp_path / "child"
    try:
        deadline = time.monotonic() + deadline_s(60)
        while not child_file.exists() and suite.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child_file.exists(), suite.communicate(timeout=10)[0]
        child = int(child_file.read_text())
        suite.send_signal(signal.SIGTERM)
        out = suite.communicate(timeout=deadline_s(60))[0].decode()
        assert (tmp_path / "torn_down").exists(), out
        assert "KeyboardInterrupt" in out or "Interrupted" in out, out
        deadline = time.monotonic() + deadline_s(10)
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
        if child_file.exists() and _alive(int(child_file.read_text())):
            os.kill(int(child_file.read_text()), signal.SIGKILL)
