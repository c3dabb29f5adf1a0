"""`asyncgrpo_cli.run.process_exit.exit_now`: a normal exit's effects without the module teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(body: str) -> subprocess.CompletedProcess:
    code = "from asyncgrpo_cli.run.process_exit import exit_now\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_status_the_atexit_hooks_and_buffered_output_survive():
    r = _run("""
        import atexit, sys
        atexit.register(lambda: print("hook ran", flush=True))
        sys.stdout.write("buffered, no newline")
        exit_now(3)
        print("never")
    """)
    assert r.returncode == 3 and r.stdout == "buffered, no newlinehook ran\n"


def test_a_live_non_daemon_thread_is_waited_for_as_in_a_normal_exit():
    """An upload or a save in a thread must not be cut: exit_now then takes the normal exit."""
    r = _run("""
        import threading, time
        def work():
            time.sleep(1.0)
            print("thread finished", flush=True)
        threading.Thread(target=work).start()
        exit_now(0)
    """)
    assert r.returncode == 0 and r.stdout == "thread finished\n"
