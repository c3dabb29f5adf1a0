"""The supervisor's process rows: a stopped server's row says how to continue its whole process group (the
server leads a session of its own; vLLM's API servers and engine core are in it, so `kill -CONT P` alone would
leave them stopped: a fresh-user trial saw the two rows disagree)."""

from __future__ import annotations

from types import SimpleNamespace

from asyncgrpo_cli.launch.supervisor import Supervisor


def _supervisor(stopped: bool) -> Supervisor:
    sup = Supervisor.__new__(Supervisor)  # only the attributes _processes reads
    sup.server = SimpleNamespace(pid=4242, stopped=lambda: stopped, poll=lambda: None)
    sup.plan = SimpleNamespace(url="http://127.0.0.1:8000")
    sup.trainer = None
    return sup


def test_a_stopped_server_row_continues_its_process_group():
    row = _supervisor(True)._processes()[0]
    assert row.stopped and "kill -CONT -- -4242 continues its process group" in row.detail, row
    assert "kill -CONT" not in _supervisor(False)._processes()[0].detail


def test_a_stopped_trainer_is_said_once_and_a_stopped_launcher_is_told_apart():
    """A fresh-user trial (thirtieth session) stopped accelerate's launcher: the line said "training waits", while
    steps went on (its rank runs until the log it relays fills). The launcher's line says so; a rank's says training
    waits; each is said once, and once more when it runs again."""
    printed: list[str] = []
    sup = Supervisor.__new__(Supervisor)
    sup._trainer_paused = None
    state = {"paused": None}
    sup.trainer = SimpleNamespace(pid=100, stopped_pid=lambda: state["paused"])
    dash = SimpleNamespace(print=lambda text: printed.append(str(text)))
    for paused in (100, 100, None, 101, None):
        state["paused"] = paused
        sup._say_trainer_stopped(dash)
    assert len(printed) == 4, printed
    assert printed[0] == ("the trainer's launcher 100 is stopped (SIGSTOP or Ctrl-Z): the trainer goes on a while, "
                          "but the run cannot end until `kill -CONT 100` continues it")
    assert printed[1] == "the trainer process 100 runs again"
    assert printed[2] == ("the trainer process 101 is stopped (SIGSTOP or Ctrl-Z): training waits until "
                          "`kill -CONT 101` continues it")
