"""`Child.signal_ranks`: a stop signal reaches the trainer ranks, not the launcher between them and the
supervisor (accelerate >= 1.16 answers a signal by terminating its tree: a second signal to the trainer,
which then stops without saving)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

from asyncgrpo_cli.launch.child import Child

# Like accelerate 1.16's simple launcher: on SIGINT / SIGTERM it sends SIGTERM to its child.
LAUNCHER = textwrap.dedent("""\
    import signal, subprocess, sys
    child = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
    def forward(signum, frame):
        child.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    sys.exit(child.wait())
    """)
# The trainer: counts the stop signals it gets, "saves" for a moment after the first, then writes the count.
RANK = textwrap.dedent("""\
    import pathlib, signal, sys, time
    out, got = pathlib.Path(sys.argv[1]), []
    signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    out.with_suffix(".ready").write_text("")
    while not got:
        time.sleep(0.05)
    time.sleep(1.0)
    out.write_text(",".join(signal.Signals(s).name for s in got))
    """)


def _wait(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_the_stop_signal_reaches_the_rank_once_and_not_the_launcher(tmp_path):
    launcher, rank, out = tmp_path / "launcher.py", tmp_path / "rank.py", tmp_path / "got.txt"
    launcher.write_text(LAUNCHER)
    rank.write_text(RANK)
    child = Child("trainer", [sys.executable, str(launcher), str(rank), str(out)], {}, tmp_path / "trainer.log",
                  death_signal=False).start()
    try:
        assert _wait(out.with_suffix(".ready").is_file)
        child.track()
        child.signal_ranks(signal.SIGINT)
        assert _wait(lambda: not child.main_alive())
        assert out.read_text() == "SIGINT"  # one signal: the launcher passed nothing on
        assert child.poll() == 0
    finally:
        child.kill_leftovers()


def test_before_any_rank_is_seen_the_group_gets_the_signal(tmp_path):
    child = Child("trainer", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "t.log").start()
    try:
        child.signal_ranks(signal.SIGTERM)  # nothing tracked: the leader is the one to stop
        assert _wait(lambda: child.poll() is not None)
        assert child.poll() == -signal.SIGTERM
    finally:
        child.kill_leftovers()


def test_a_stopped_rank_or_launcher_is_named(tmp_path):
    """SIGSTOP of a trainer rank (or of the launcher, which then stops relaying its stderr): `stopped_pid` names
    it, so the supervisor can say so instead of showing a live trainer whose steps stop coming."""
    launcher, rank, out = tmp_path / "launcher.py", tmp_path / "rank.py", tmp_path / "got.txt"
    launcher.write_text(LAUNCHER)
    rank.write_text(RANK)
    child = Child("trainer", [sys.executable, str(launcher), str(rank), str(out)], {}, tmp_path / "trainer.log",
                  death_signal=False).start()
    try:
        assert _wait(out.with_suffix(".ready").is_file)
        child.track()
        (pid,) = child._direct
        assert child.stopped_pid() is None
        os.kill(pid, signal.SIGSTOP)
        assert _wait(lambda: child.stopped_pid() == pid)
        os.kill(pid, signal.SIGCONT)
        assert _wait(lambda: child.stopped_pid() is None)
        os.kill(child.pid, signal.SIGSTOP)
        assert _wait(lambda: child.stopped_pid() == child.pid)
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill_leftovers()
