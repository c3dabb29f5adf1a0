"""Plain mode before the first logged step: a line on generation every 30 s, so a slow first step (a cold vLLM,
a stalled worker) is not a silent minute (issue #41's kept run: no console line for 37 s of training)."""

from __future__ import annotations

import json
import time

from rich.console import Console

import asyncgrpo_cli.dashboard as dashboard
from asyncgrpo_cli.dashboard import Dashboard
from asyncgrpo_cli.dashboard.diagnosis import RunSettings


def _dash(tmp_path, monkeypatch, mode="plain"):
    out = tmp_path / "run"
    out.mkdir(parents=True)
    now = {"t": 100.0}
    monkeypatch.setattr(dashboard.time, "monotonic", lambda: now["t"])
    console = Console(record=True, width=200, force_terminal=False)
    dash = Dashboard(out, mode=mode, console=console, settings=RunSettings(), started_at=time.time() - 5)
    return out, now, console, dash


def _status(out, **fields):
    (out / "status.json").write_text(json.dumps({"state": "running", "step": 0, **fields}))


def _printed(console):
    return [ln for ln in console.export_text().splitlines() if ln.strip()]


def test_a_line_every_30_s_until_the_first_step_then_none(tmp_path, monkeypatch):
    out, now, console, dash = _dash(tmp_path, monkeypatch)
    for t, done in ((0, 0), (10, 8), (29, 8), (30, 162), (45, 170), (60, 400)):
        now["t"] = 100.0 + t
        _status(out, concurrency=936, rollouts_finished=done, queue_size=0)
        dash.poll()
    assert _printed(console) == [
        "waiting for step 1 (30 s since training started): 936 rollouts in flight, 162 finished, queue 0",
        "waiting for step 1 (60 s since training started): 936 rollouts in flight, 400 finished, queue 0"]
    row = {"step": 1, "reward": 0.1}
    (out / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    dash.poll()
    now["t"] += 300.0
    _status(out, step=1, concurrency=10, rollouts_finished=900, queue_size=3)
    dash.poll()
    assert [ln for ln in _printed(console) if ln.startswith("waiting")] == _printed(console)[:2]


def test_a_resumed_run_waits_for_its_next_step_and_old_status_fields_still_print(tmp_path, monkeypatch):
    out, now, console, dash = _dash(tmp_path, monkeypatch)
    for t in (0, 31):
        now["t"] = 100.0 + t
        _status(out, step=8, concurrency=64)  # no rollouts_finished or queue_size (an older trainer)
        dash.poll()
    assert _printed(console) == ["waiting for step 9 (31 s since training started): 64 rollouts in flight"]


def test_no_waiting_line_once_status_json_is_past_the_step_it_waited_from(tmp_path, monkeypatch):
    """status.json reached step 1 a poll before metrics.jsonl had its line (a fresh-user trial printed 'waiting
    for step 2' just before 'step 1/30'): nothing is printed then."""
    out, now, console, dash = _dash(tmp_path, monkeypatch)
    for t, step in ((0, 0), (20, 0), (31, 1), (62, 1)):
        now["t"] = 100.0 + t
        _status(out, step=step, concurrency=8)
        dash.poll()
    assert _printed(console) == []


def test_no_line_outside_plain_mode_or_while_not_running(tmp_path, monkeypatch):
    out, now, console, dash = _dash(tmp_path, monkeypatch, mode="off")
    for t in (0, 31, 62):
        now["t"] = 100.0 + t
        _status(out, concurrency=5)
        dash.poll()
    assert _printed(console) == []
    out2, now2, console2, dash2 = _dash(tmp_path / "b", monkeypatch)
    for t, state in ((0, "loading"), (31, "saving"), (62, "stopped")):
        now2["t"] = 100.0 + t
        (out2 / "status.json").write_text(json.dumps({"state": state, "step": 0, "concurrency": 5}))
        dash2.poll()
    assert _printed(console2) == []


def test_the_line_says_why_finished_rollouts_are_not_queued(tmp_path, monkeypatch):
    """Groups dropped without reward spread (status.json's consecutive ``groups_without_signal``) explain a
    queue that stays empty while rollouts finish; none dropped, nothing said."""
    out, now, console, dash = _dash(tmp_path, monkeypatch)
    for t, dropped in ((0, 0), (30, 0), (60, 12)):
        now["t"] = 100.0 + t
        _status(out, concurrency=64, rollouts_finished=8 * (t + 1), queue_size=0, groups_without_signal=dropped,
                max_groups_without_signal=64)
        dash.poll()
    assert _printed(console) == [
        "waiting for step 1 (30 s since training started): 64 rollouts in flight, 248 finished, queue 0",
        "waiting for step 1 (60 s since training started): 64 rollouts in flight, 488 finished, queue 0, the last "
        "12 group(s) dropped without reward spread (the run stops at 64: rollout.max_groups_without_signal)"]
