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
