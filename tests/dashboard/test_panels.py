"""Panels, plain lines, file following, summary and curves of the dashboard."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from rich.console import Console

from asyncgrpo_cli.dashboard import Dashboard, JsonlTail, ProcessInfo, read_status, resolve_mode
from asyncgrpo_cli.dashboard.diagnosis import MetricsHistory, RunSettings, diagnose
from asyncgrpo_cli.dashboard.panels import (
    DashboardView,
    completions_table,
    eta_seconds,
    fmt_duration,
    fmt_rate,
    plain_line,
    render_dashboard,
    summarize,
    summary_lines,
    summary_panel,
)
from asyncgrpo_cli.dashboard.plot import load_metrics, plot_training_curves

T0 = 1_700_000_000.0


def window(step: int) -> dict:
    return {"step": step, "epoch": step / 4, "time": T0 + 10 * step, "reward": 0.1 * step, "reward_kept": 0.2,
            "reward_dropped": 0.0, "frac_reward_zero_std": 0.25, "completions/duplicate_frac": 0.01,
            "completions/clipped_ratio": 0.05, "entropy": 0.9, "rewards/accuracy_reward/mean": 0.1 * step,
            "rewards/format_reward/mean": 0.5, "rollout/queue_size": 6, "perf/rollout_wait_s": 0.02,
            "rollout/backpressure_s": 0.0, "rollout/concurrency": 12, "rollout/concurrency_cap": 32,
            "rollout/vllm_kv_cache_usage_frac": 0.45, "rollout/vllm_running_requests": 9,
            "rollout/vllm_queued_requests": 1, "sample/staleness_mean": 1.25, "sample/staleness_max": 3,
            "sample/dropped_stale_count": 2, "rollout/generated_tokens_per_s": 12345.0,
            "perf/fwd_bwd_forwarded_tokens_per_s": 54321.0, "perf/wall_clock_trained_tokens_per_s": 4321.0,
            "perf/step_s": 10.0, "perf/fwd_bwd_mfu": 0.31}


STATUS = {"state": "running", "step": 3, "max_steps": 10, "epoch": 0.75, "num_train_epochs": 3, "model_version": 3,
          "queue_size": 7, "concurrency": 14, "concurrency_cap": 32, "max_concurrent_rollouts": 64,
          "kv_cache_usage_frac": 0.5, "requests_running": 10, "requests_waiting": 2, "worker_heartbeat_age_s": 0.4,
          "num_processes": 2, "last_error": None, "started_at": T0, "updated_at": T0 + 30, "pid": 123}


def write_run(out: Path, steps: int = 3) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "status.json").write_text(json.dumps(STATUS))
    with (out / "metrics.jsonl").open("a") as fh:
        for s in range(1, steps + 1):
            fh.write(json.dumps(window(s)) + "\n")


def record_console(width: int = 160) -> Console:
    return Console(record=True, width=width, force_terminal=False)


def view_of(steps: int = 3, status=STATUS) -> DashboardView:
    h = MetricsHistory()
    for s in range(1, steps + 1):
        h.push(window(s))
    settings = RunSettings(max_staleness=4, max_concurrent_rollouts=64)
    procs = [ProcessInfo("server", 11, True, "http://127.0.0.1:8000"), ProcessInfo("trainer", 12, False, "exit 1")]
    return DashboardView(status=status, history=h, diagnosis=diagnose(h, settings), processes=procs,
                         settings=settings, started_at=T0, now=T0 + 30)


def test_render_dashboard_shows_every_panel():
    console = record_console()
    console.print(render_dashboard(view_of()))
    text = console.export_text()
    for label in ("run", "processes", "rollout queue & concurrency", "staleness", "rewards", "throughput",
                  "diagnosis:"):
        assert label in text, label
    assert "3 / 10" in text and "0.75" in text  # step / max_steps, the epoch
    assert "0.75 / 3" not in text  # max_steps ends the run, not num_train_epochs=3
    assert "ETA" in text and "1m10s" in text  # 7 steps left at one step per 10 s
    assert "14 / 32 / 64" in text  # in flight / cap / max_concurrent_rollouts from status.json
    assert "50%" in text and "10 / 2" in text and "elsewhere" in text  # KV, running / waiting; 14-10-2 = 2
    assert "1.25 / 4" in text and "3 / 4" in text  # staleness mean / max vs max_staleness
    assert "accuracy_reward" in text and "format_reward" in text
    assert "12.3k" in text and "54.3k" in text and "4.32k" in text and "31%" in text  # throughput and MFU
    assert "pid 11" in text and "alive" in text and "exited" in text and "heartbeat 0.4 s ago" in text
    assert "healthy" in text


def test_render_without_any_data_does_not_fail():
    h = MetricsHistory()
    view = DashboardView(status=None, history=h, diagnosis=diagnose(h), now=T0, started_at=T0)
    console = record_console()
    console.print(render_dashboard(view))
    text = console.export_text()
    assert "starting" in text and "waiting for the first logged step" in text


def test_status_error_and_stale_status_are_shown():
    status = {**STATUS, "last_error": "RuntimeError: boom", "updated_at": T0 + 5}
    console = record_console()
    console.print(render_dashboard(view_of(status=status)))
    text = console.export_text()
    assert "RuntimeError: boom" in text and "not updated for 25s" in text


def test_eta_from_epochs_when_max_steps_is_unset():
    status = {**STATUS, "max_steps": None, "epoch": 0.75, "num_train_epochs": 3}
    console = record_console()
    console.print(render_dashboard(view_of(status=status)))
    assert "0.75 / 3" in console.export_text()  # the epochs end this run
    # epochs advance 0.25 per 10 s: (3 - 0.75) / 0.025 = 90 s
    assert eta_seconds(view_of(status=status)) == pytest.approx(90.0)
    assert eta_seconds(view_of(steps=3)) == pytest.approx(70.0)


def test_plain_line_and_formats():
    line = plain_line(window(2), None, max_steps=10)
    assert line.startswith("step 2/10 | reward 0.2 | gen 12.3k tok/s | train 4.32k tok/s | step 10.00 s")
    unscored = {k: v for k, v in window(3).items() if k != "reward"}  # SPEC §15.1: no rollout scored in it
    assert plain_line(unscored).startswith("step 3 | reward — (no group scored in this window) | gen ")
    # ... and with what the groups it trained had scored (a trial: the step showed no reward at all)
    trained = plain_line({**unscored, "reward_trained": 0.4375})
    assert trained.startswith("step 3 | reward — (no group scored in this window; the trained groups had scored "
                              "0.4375) | gen "), trained
    assert "trained groups" not in plain_line({**window(3), "reward_trained": 0.4})  # a scored window: its own
    # stale drops show in the line only when a window had some (fresh-user trial: 92% of a step's generated
    # tokens dropped while the line read 'stale 1.00')
    assert "dropped" not in plain_line({**window(4), "sample/dropped_stale_count": 0})
    dropped = plain_line({**window(4), "sample/dropped_stale_count": 3, "sample/dropped_stale_token_frac": 0.917})
    assert "| dropped stale 3 (92% of generated tokens)" in dropped
    assert fmt_duration(3725) == "1h02m" and fmt_duration(65) == "1m05s" and fmt_duration(None) == "—"
    assert fmt_rate(2_500_000) == "2.5M" and fmt_rate(None) == "—"


def test_dashboard_plain_prints_one_line_per_step(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps(window(99)) + "\n")  # an earlier run's line: ignored
    console = record_console()
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(), started_at=time.time())
    dash.poll()
    assert console.export_text(clear=False).strip() == ""
    write_run(out, steps=3)
    new = dash.poll()
    assert [r["step"] for r in new] == [1, 2, 3]
    lines = [ln for ln in console.export_text().splitlines() if ln.strip()]
    assert [ln.split(" |")[0] for ln in lines] == ["step 1/10", "step 2/10", "step 3/10"]
    assert all("healthy" in ln for ln in lines)
    assert dash.poll() == [] and dash.rows[-1]["step"] == 3


def test_dashboard_rich_mode_runs_a_live_panel(tmp_path):
    out = tmp_path / "run"
    write_run(out)
    console = Console(record=True, width=160, height=60, force_terminal=True)  # tall enough for the panel grid
    dash = Dashboard(out, mode="rich", console=console, started_at=T0 - 1)
    dash._metrics.offset = 0  # read the lines written before it started
    with dash:
        dash.poll([ProcessInfo("trainer", 5, True)])
    text = console.export_text()
    assert "rollout queue & concurrency" in text and "diagnosis:" in text and "pid 5" in text


def test_resolve_mode():
    assert resolve_mode("auto", Console(force_terminal=False)) == "plain"
    assert resolve_mode("auto", Console(force_terminal=True)) == "rich"
    assert resolve_mode("off", Console()) == "off"
    with pytest.raises(ValueError, match="logging.dashboard='fancy'"):
        resolve_mode("fancy", Console())


def test_completions_tables_at_most_n_per_step(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    console = record_console()
    dash = Dashboard(out, mode="off", console=console, log_completions=True, num_completions_to_print=2)
    with (out / "completions.jsonl").open("w") as fh:
        for step in (1, 2):
            for i in range(3):
                fh.write(json.dumps({"step": step, "prompt": [{"role": "system", "content": "sys"},
                                                              {"role": "user", "content": f"q{step}-{i}"}],
                                     "completion": f"answer {step}-{i}", "reward": 1.0}) + "\n")
    dash.poll()
    text = console.export_text()
    assert "completions (step 1)" in text and "completions (step 2)" in text
    assert "q1-0" in text and "q1-1" in text and "q1-2" not in text and "answer 2-1" in text
    assert "sys" not in text.replace("system", "")  # the last user message is shown, not the system prompt


def test_plain_output_prints_one_line_per_completion_and_unwrapped_messages(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    console = Console(record=True, width=80, force_terminal=False)
    dash = Dashboard(out, mode="plain", console=console, log_completions=True, num_completions_to_print=2)
    long = "word " * 40
    (out / "completions.jsonl").write_text(json.dumps({"step": 1, "prompt": "2+2?", "completion": f"{long}\n4",
                                                       "reward": 1.0, "advantage": 0.5,
                                                       "rewards": {"exact": 1.0}}) + "\n")
    dash.poll()
    dash.print(f"SIGINT: {long}")
    text = console.export_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("completion step", "SIGINT"))]
    assert lines[0].startswith("completion step 1 | reward 1 | advantage 0.5 | exact 1 | prompt: 2+2? | ")
    assert lines[0].endswith("word ⏎4") and lines[1].rstrip() == f"SIGINT: {long}".rstrip()
    assert len(text.splitlines()) == 2  # nothing wrapped at 80 columns, no table


def test_completions_table_plain_prompt():
    console = record_console()
    console.print(completions_table([{"step": 4, "prompt": "2+2?", "completion": "4", "reward": 1}], None))
    assert "2+2?" in console.export_text()


def test_jsonl_tail_partial_lines_and_truncation(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert tail.read_new() == [{"step": 1}]
    with path.open("a") as fh:
        fh.write('}\nnot json\n[1, 2]\n')
    assert tail.read_new() == [{"step": 2}]
    path.write_text('{"step": 7}\n')  # rewritten shorter: read from the start
    assert tail.read_new() == [{"step": 7}]
    assert JsonlTail.at_end(path).read_new() == []


def test_read_status(tmp_path):
    path = tmp_path / "status.json"
    assert read_status(path) is None
    path.write_text("{broken")
    assert read_status(path) is None
    path.write_text(json.dumps(STATUS))
    assert read_status(path)["step"] == 3
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert read_status(path, not_before=time.time() - 60) is None


def test_summary_and_checkpoints(tmp_path):
    rows = [window(s) for s in (1, 2, 3)]
    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-final-notes"):
        (tmp_path / name).mkdir()
    s = summarize(rows, 125.0, tmp_path, "finished", tmp_path / "training_curves.png")
    assert s.steps == 3 and s.final_reward == pytest.approx(0.2) and s.final_reward_windows == 3  # mean of 3
    assert s.final_model is None
    assert s.mean_generated_tokens_per_s == pytest.approx(12345.0) and s.mean_step_s == pytest.approx(10.0)
    assert [Path(c).name for c in s.checkpoints] == ["checkpoint-final-notes", "checkpoint-2", "checkpoint-10"]
    console = record_console()
    console.print(summary_panel(s))
    text = console.export_text()
    assert "finished" in text and "2m05s" in text and "checkpoint-10" in text and "training_curves.png" in text
    unscored = {k: v for k, v in window(4).items() if k != "reward"}  # trained only on queued samples
    gap = summarize([*rows, unscored, window(5)], 1.0, tmp_path, "finished")
    assert gap.final_reward_windows == 4 and gap.final_reward_steps == (1, 5)
    assert "(mean of the 4 logged steps with a reward among steps 1-5)" in "\n".join(summary_lines(gap))
    trailing = summarize([*rows, unscored], 1.0, tmp_path, "finished")
    assert trailing.final_reward == pytest.approx(0.2)  # the smoke job of the ninth session's trial: steps 3-4 unscored
    assert "(mean of the 3 logged steps with a reward among steps 1-4)" in "\n".join(summary_lines(trailing))
    assert "final reward          0.2 (mean of the 3 logged steps with a reward among steps 1-3)" in "\n".join(
        summary_lines(s))  # one phrasing for all three cases
    # a resumed run stopped after steps 9-10 where only step 9 scored (the twelfth-session trial printed a bare 0.1)
    stopped = summarize([window(9), {k: v for k, v in window(10).items() if k != "reward"}], 1.0, tmp_path, "stopped")
    assert "(the only logged step with a reward among steps 9-10)" in "\n".join(summary_lines(stopped))
    assert "final reward          0.1\n" in "\n".join(summary_lines(summarize([window(1)], 1.0, tmp_path, "finished")))
    many = [window(s) for s in range(1, 11)]  # the last 5 windows: steps 6..10
    assert summarize(many, 1.0, tmp_path, "finished").final_reward == pytest.approx(0.8)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    from asyncgrpo_cli.run.state import mark_final_model

    mark_final_model(tmp_path, 3)
    saved = summarize(rows, 1.0, tmp_path, "finished")
    assert saved.final_model == f'AutoModelForCausalLM.from_pretrained("{tmp_path}")' and saved.final_model_step == 3
    assert f'  final model           step 3; load it with AutoModelForCausalLM.from_pretrained("{tmp_path}")' \
        in summary_lines(saved)
    empty = summarize([], 1.0, tmp_path / "none", "failed")
    assert empty.steps is None and empty.final_reward is None and empty.checkpoints == []
    # a resumed run (the tenth session's trial: "steps 8" beside the 2m48s of steps 2-8)
    resumed = summarize([window(s) for s in range(2, 9)], 168.0, tmp_path, "finished")
    assert "  steps                 8 (steps 2-8 in this run)" in summary_lines(resumed)
    assert "  steps                 3" in summary_lines(s)


def test_summary_rates_are_tokens_over_time(tmp_path):
    # a 1 s step at 100 tok/s and a 9 s step at 10 tok/s: 190 tokens in 10 s = 19 tok/s (the mean of rates said 55)
    rows = [{**window(1), "perf/step_s": 1.0, "perf/wall_clock_trained_tokens_per_s": 100.0},
            {**window(2), "perf/step_s": 9.0, "perf/wall_clock_trained_tokens_per_s": 10.0}]
    s = summarize(rows, 10.0, tmp_path, "finished")
    assert s.mean_trained_tokens_per_s == pytest.approx(19.0)
    assert any(line.split() == ["trained", "tok/s", "19"] for line in summary_lines(s))


def test_training_curves_png(tmp_path):
    write_run(tmp_path, steps=4)
    rows = load_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 4
    png = plot_training_curves(rows, tmp_path / "training_curves.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
    assert plot_training_curves([{"step": 1, "grad_norm": 0.3}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_staleness_panel_and_curves_show_the_stale_waste_by_length(tmp_path):
    from asyncgrpo_cli.dashboard.panels import staleness_panel
    from asyncgrpo_cli.dashboard.plot import PANELS

    h = MetricsHistory()
    h.push({"step": 1, "sample/dropped_stale_token_frac": 0.39, "sample/trained_frac_short": 1.0,
            "sample/trained_frac_medium": 0.9, "sample/trained_frac_long": 0.55})
    view = DashboardView(status=None, history=h, diagnosis=diagnose(h), now=T0, started_at=T0)
    console = record_console()
    console.print(staleness_panel(view))
    text = console.export_text()
    assert "dropped stale tokens" in text and "39" in text
    assert "100% / 90% / 55%" in text.replace(".0%", "%")
    curves = {name for _, _, names in PANELS for name in names}
    assert {"sample/dropped_stale_token_frac", "sample/trained_frac_long"} <= curves


def test_the_trainer_busy_share_in_the_panels_and_the_plain_line():
    """Issue #33: 1 - perf/rollout_wait_s / perf/step_s, in the throughput panel, the compact rows and the
    plain line; absent when either metric is missing."""
    from asyncgrpo_cli.dashboard.panels import throughput_panel

    h = MetricsHistory()
    h.push({**window(1), "perf/rollout_wait_s": 5.9, "perf/step_s": 10.0})
    view = DashboardView(status=STATUS, history=h, diagnosis=diagnose(h), now=T0 + 30, started_at=T0)
    console = record_console()
    console.print(throughput_panel(view))
    assert any("trainer busy" in ln and "41%" in ln for ln in console.export_text().splitlines())
    console = record_console(80)
    console.print(render_dashboard(view, width=80, height=24))  # the compact layout
    assert any("trainer busy" in ln and "41%" in ln for ln in console.export_text().splitlines())
    line = plain_line(h.latest, None, max_steps=10)
    assert "| step 10.00 s | busy 41% | queue 6 |" in line
    # a wait longer than the step is clamped; without the wait the share is absent
    assert "| busy 0% |" in plain_line({**window(1), "perf/rollout_wait_s": 12.0})
    unknown = {k: v for k, v in window(1).items() if k != "perf/rollout_wait_s"}
    assert "busy" not in plain_line(unknown)
    h2 = MetricsHistory()
    h2.push(unknown)
    console = record_console()
    console.print(throughput_panel(DashboardView(status=None, history=h2, diagnosis=diagnose(h2), now=T0,
                                                 started_at=T0)))
    assert any("trainer busy" in ln and "—" in ln for ln in console.export_text().splitlines())


def plain_dashboard_on_a_clock(tmp_path, monkeypatch, start: float):
    """A plain-mode `Dashboard` over ``tmp_path/run`` whose monotonic clock is ``now["t"]`` (from ``start``)."""
    import asyncgrpo_cli.dashboard as dashboard

    out = tmp_path / "run"
    out.mkdir()
    now = {"t": start}
    monkeypatch.setattr(dashboard.time, "monotonic", lambda: now["t"])
    console = record_console()
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(), started_at=time.time() - 5)
    return out, now, console, dash


def test_plain_mode_prints_a_lasting_server_status_every_10_s_not_every_second(tmp_path, monkeypatch):
    """An outage's count-down changes every second: the plain log prints it when it appears or changes kind
    (unreachable, silent, re-push), then every 10 s, and says when the server answers again."""
    out, now, console, dash = plain_dashboard_on_a_clock(tmp_path, monkeypatch, 100.0)
    lines = ["server unreachable, retrying (60 s left)", "server unreachable, retrying (59 s left)",
             "server unreachable, retrying (51 s left)", "server unreachable, retrying (50 s left)",
             "server not answering: no answer to GET /health for 15 s (...) (30 s left)", None]
    for line in lines:
        (out / "status.json").write_text(json.dumps({"state": "running", "step": 3, "server_status": line}))
        dash.poll()
        now["t"] += 1.0 if line is None or "59" not in line else 8.0
    printed = [ln for ln in console.export_text().splitlines() if ln.strip()]
    assert printed == ["server unreachable, retrying (60 s left)", "server unreachable, retrying (50 s left)",
                       "server not answering: no answer to GET /health for 15 s (...) (30 s left)",
                       "sampler server: answering again after 12 s"], printed


def test_answering_again_counts_a_silence_from_the_last_answer_not_from_its_first_report(tmp_path, monkeypatch):
    """Twenty-fifth session's trial: a 40.7 s SIGSTOP of the server printed ``answering again after 29 s`` right
    after ``... for 36 s``: the count began at the first report, 16 s into the silence. It now starts at the last
    answer (status.json ``server_silent_s``), as trainer.log's ``answers again after 45 s silent`` does."""
    out, now, console, dash = plain_dashboard_on_a_clock(tmp_path, monkeypatch, 1000.0)
    line = "server not answering: no answer to GET /health for {} s (...) ({} s left)"
    for silent in (16, 26, 36, None):
        (out / "status.json").write_text(json.dumps({
            "state": "running", "step": 2, "server_status": line.format(silent, 120 - silent) if silent else None,
            "server_silent_s": silent}))
        dash.poll()
        now["t"] += 10.0 if silent != 36 else 9.0
    printed = [ln for ln in console.export_text().splitlines() if ln.strip()]
    assert printed[-1] == "sampler server: answering again after 45 s", printed


def test_plain_mode_says_answering_again_when_the_outage_ends_during_a_save_but_not_at_the_end(tmp_path,
                                                                                             monkeypatch):
    """A sync that waited out the outage is followed by the step's save: the status that clears the outage may
    first be seen in state ``saving`` (the smoke drill ``external-back`` printed no 'answering again')."""
    import asyncgrpo_cli.dashboard as dashboard

    monkeypatch.setattr(dashboard.time, "monotonic", lambda: 50.0)
    out = tmp_path / "run"
    out.mkdir()
    console = record_console()
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(), started_at=time.time() - 5)
    for state, line in (("running", "server unreachable, retrying (30 s left)"), ("saving", None),
                        ("running", "server unreachable, retrying (20 s left)"), ("failed: SamplerRetryError", None)):
        (out / "status.json").write_text(json.dumps({"state": state, "step": 2, "server_status": line}))
        dash.poll()
    printed = [ln for ln in console.export_text().splitlines() if ln.strip()]
    assert printed == ["server unreachable, retrying (30 s left)", "sampler server: answering again after 0 s",
                       "server unreachable, retrying (20 s left)"], printed


def test_plain_mode_prints_no_outage_line_once_the_supervisor_is_stopping_the_run(tmp_path):
    """Second fresh-user trial: after "the server (pid N) was killed by SIGKILL: stopping the trainer", the
    trainer's "server unreachable, retrying (1800 s left)" followed; once the stop has begun it is not printed."""
    out = tmp_path / "run"
    out.mkdir()
    console = record_console()
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(), started_at=time.time() - 5)
    (out / "status.json").write_text(json.dumps({"state": "running", "step": 2, "server_status": None}))
    dash.poll()
    dash.begin_stop()
    for state, line in (("running", "server unreachable, retrying (1800 s left)"), ("saving", None),
                        ("stopped", None)):
        (out / "status.json").write_text(json.dumps({"state": state, "step": 2, "server_status": line}))
        dash.poll()
    assert not [ln for ln in console.export_text().splitlines() if ln.strip()]


def test_plain_mode_says_when_the_rollout_worker_stops_beating(tmp_path, monkeypatch):
    """A stopped (SIGSTOP) worker: the trainer trains what is queued, then waits; the console said nothing until the
    worker timeout ended the run 5 minutes later (fresh-user trial). Now a line from 20 s of silence, every 10 s
    while it lasts, and one when the worker beats again."""
    import asyncgrpo_cli.dashboard as dashboard

    out = tmp_path / "run"
    out.mkdir()
    now = {"t": 100.0}
    monkeypatch.setattr(dashboard.time, "monotonic", lambda: now["t"])
    console = record_console()
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(rollout_worker_timeout=300.0),
                     started_at=time.time() - 5)
    for age, state in ((1.0, "running"), (19.0, "running"), (21.0, "running"), (25.0, "running"), (31.5, "saving"),
                       (0.5, "running"), (40.0, "running"), (45.0, "failed: RolloutWorkerError")):
        (out / "status.json").write_text(json.dumps({"state": state, "step": 3, "worker_heartbeat_age_s": age,
                                                     "worker_pid": 4242}))
        dash.poll()
        now["t"] += 5.0
    printed = [ln for ln in console.export_text().splitlines() if ln.startswith("rollout worker")]
    silent = ("rollout worker not answering: no heartbeat from the worker (pid 4242) for {} s (hung, stopped, or "
              "blocked by a slow reward function; if stopped, kill -CONT 4242 continues it); the run stops with a "
              "checkpoint at staleness.rollout_worker_timeout=300 s ({} s left)")
    assert printed == [silent.format(21, 279), silent.format(32, 268), "rollout worker: answering again",
                       silent.format(40, 260)], printed
    console = record_console()  # a stop ends generation: the worker's silence then says nothing new
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(rollout_worker_timeout=300.0),
                     started_at=time.time() - 5)
    for age in (25.0, 40.0, 60.0):
        (out / "status.json").write_text(json.dumps({"state": "running", "step": 3, "worker_heartbeat_age_s": age,
                                                     "worker_pid": 4242, "stopping": "SIGINT: saving the last "
                                                     "completed step (step 3) and stopping"}))
        dash.poll()
        now["t"] += 10.0
    assert not [ln for ln in console.export_text().splitlines() if ln.startswith("rollout worker")]


def test_the_summary_of_a_stopped_run_does_not_claim_an_earlier_runs_final_model(tmp_path):
    """A run resumed from checkpoint-8 and stopped at step 9: the top-level model.safetensors is the earlier
    run's step 8, not this run's; the summary says so and points at checkpoint-9 (it claimed "final model
    saved; load it with from_pretrained(output_dir)")."""
    from asyncgrpo_cli.run.state import mark_final_model

    (tmp_path / "model.safetensors").write_bytes(b"x")
    mark_final_model(tmp_path, 8)
    for step in (8, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
    rows = [window(9)]
    text = "\n".join(summary_lines(summarize(rows, 1.0, tmp_path, "stopped")))
    assert "from_pretrained" not in text and "saved; load it" not in text, text
    assert (f"  final model           not saved by this run (this run stopped at step 9); the model in {tmp_path} is "
            f"step 8's; its newest checkpoint: {tmp_path / 'checkpoint-9'}") in text, text
    mark_final_model(tmp_path, None)  # weights without a recorded step (an older run, or a cut save)
    text = "\n".join(summary_lines(summarize(rows, 1.0, tmp_path, "finished")))
    assert "from_pretrained" not in text and "has no recorded step" in text, text
    (tmp_path / "model.safetensors").unlink()  # a stopped run in a fresh folder: where its last step is
    text = "\n".join(summary_lines(summarize(rows, 1.0, tmp_path, "stopped")))
    assert f"final model           not saved (this run stopped at step 9); its newest checkpoint: " \
        f"{tmp_path / 'checkpoint-9'}" in text, text


def test_curves_with_the_same_values_are_drawn_once_with_every_name():
    """Nothing went stale: the trained shares of short, medium and long completions are all 1.0; the "stale drops
    by length" panel draws one line named after the three, not three lines on top of each other."""
    from asyncgrpo_cli.dashboard.plot import curve_panels

    rows = [{"step": s, "sample/dropped_stale_token_frac": 0.0, "sample/trained_frac_short": 1.0,
             "sample/trained_frac_medium": 1.0, "sample/trained_frac_long": 1.0} for s in (1, 2, 3)]
    panel = next(curves for title, _, curves in curve_panels(rows) if title == "stale drops by length")
    assert [label for label, _ in panel] == [
        "sample/dropped_stale_token_frac",
        "sample/trained_frac_short = sample/trained_frac_medium = sample/trained_frac_long"]
    rows[1]["sample/trained_frac_long"] = 0.5  # long completions dropped at step 2: its own line
    panel = next(curves for title, _, curves in curve_panels(rows) if title == "stale drops by length")
    assert [label for label, _ in panel] == ["sample/dropped_stale_token_frac",
                                             "sample/trained_frac_short = sample/trained_frac_medium",
                                             "sample/trained_frac_long"]


def test_curves_with_gaps_that_agree_where_both_have_values_are_drawn_once_over_all_their_points():
    """Fresh-user trial: the trained shares by length were all 1.0 wherever they had values, but some steps had no
    value for some of them (no completion of that length had its verdict), and the panel drew three lines on top of
    each other. They fold into one line through the union of their points; a gap says nothing against folding."""
    import math

    from asyncgrpo_cli.dashboard.plot import curve_panels, fold_identical

    def panel(rows):
        return next(curves for title, _, curves in curve_panels(rows) if title == "stale drops by length")

    rows = [{"step": s, "sample/dropped_stale_token_frac": 0.0} for s in (1, 2, 3, 4)]
    for s, name in ((1, "short"), (2, "short"), (4, "short"), (1, "medium"), (3, "medium"), (3, "long"),
                    (4, "long")):
        rows[s - 1][f"sample/trained_frac_{name}"] = 1.0
    curves = panel(rows)
    assert [label for label, _ in curves] == [
        "sample/dropped_stale_token_frac",
        "sample/trained_frac_short = sample/trained_frac_medium = sample/trained_frac_long"]
    assert curves[1][1] == ([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0])  # the union of the three curves' points
    rows[3]["sample/trained_frac_long"] = 0.5  # long completions dropped at step 4, where short ones logged 1.0
    assert [label for label, _ in panel(rows)] == ["sample/dropped_stale_token_frac",
                                                   "sample/trained_frac_short = sample/trained_frac_medium",
                                                   "sample/trained_frac_long"]
    nan = math.nan
    # No step where both have a value: nothing says they are the same curve.
    a, b = ([1, 2], [1.0, nan]), ([1, 2], [nan, 1.0])
    assert [label for label, _ in fold_identical([("a", a), ("b", b)])] == ["a", "b"]
    # c agrees with a (step 1) but not with the fold a = b (b has 0.5 at step 2): c is its own line.
    a, b, c = ([1, 2], [1.0, nan]), ([1, 2], [1.0, 0.5]), ([1, 2], [1.0, 1.0])
    folded = fold_identical([("a", a), ("b", b), ("c", c)])
    assert [label for label, _ in folded] == ["a = b", "c"] and folded[0][1] == ([1, 2], [1.0, 0.5])


def test_a_silent_server_and_a_stopped_server_process_show_in_the_panels():
    """status.json's server_status (here a hung server's) is a red row of the panels, full and compact; the
    supervisor's process table marks a server stopped with SIGSTOP."""
    line = ("server not answering: no answer to GET /health for 16 s (hung or stopped? a busy server still answers "
            "it); the run stops with a checkpoint at sampler.timeout=1800 s (1784 s left)")
    h = MetricsHistory()
    h.push(window(1))
    view = DashboardView(status={**STATUS, "server_status": line}, history=h, diagnosis=diagnose(h), now=T0 + 30,
                         started_at=T0, processes=[ProcessInfo("server", 7, True, "http://127.0.0.1:8000  log: "
                                                               "logs/server.log  (SIGSTOP or Ctrl-Z: kill -CONT -- -7 "
                                                               "continues its process group)", stopped=True)])
    for width, height in ((200, 60), (80, 24)):
        console = record_console(width)
        console.print(render_dashboard(view, width=width, height=height))
        flat = " ".join(console.export_text().split())
        assert "server not answering: no answer to GET /health" in flat, flat
        assert "STOPPED 7" in flat or "pid 7 STOPPED" in flat, flat


def test_a_process_a_signal_ended_reads_killed():
    """A fresh-user trial's `kill -9` of the server showed `exited` in the process table."""
    from asyncgrpo_cli.dashboard.panels import ProcessInfo, process_state

    assert process_state(ProcessInfo("server", 5, False, exit_code=-9), ended=False) == ("killed", "red")
    assert process_state(ProcessInfo("server", 5, False, exit_code=1), ended=False) == ("exited", "red")
    assert process_state(ProcessInfo("server", 5, False), ended=True) == ("exited", "red")


def test_while_the_supervisor_stops_the_run_the_state_says_so(tmp_path):
    """The trainer's own `stopped` in status.json read as the run's end for a few frames before `failed` (a
    fresh-user trial's server kill -9); from `begin_stop` the state line reads why the run is stopping."""
    from asyncgrpo_cli.dashboard import Dashboard
    from asyncgrpo_cli.dashboard.panels import run_state

    out = tmp_path / "run"
    out.mkdir()
    (out / "status.json").write_text(json.dumps({"state": "stopped"}))
    dash = Dashboard(out, mode="off", console=record_console(), started_at=T0)
    dash.poll()
    dash.begin_stop("the server was killed by SIGKILL")
    assert run_state(dash.view()) == "stopping: the server was killed by SIGKILL"
    dash.finish("failed")
    assert run_state(dash.view()) == "failed"


def test_the_panels_say_answering_again_for_a_while_after_an_outage_clears(tmp_path, monkeypatch):
    """Twenty-third session's trial: after a SIGCONT of the server the panels' red row just vanished (plain mode
    prints "answering again"). The processes panel and the compact panel now show it, green, for 30 s."""
    import asyncgrpo_cli.dashboard as dashboard
    from asyncgrpo_cli.dashboard.panels import SERVER_BACK_SHOW_S, compact_dashboard, processes_panel

    out = tmp_path / "run"
    out.mkdir()
    now = {"t": 1000.0}
    monkeypatch.setattr(dashboard.time, "time", lambda: now["t"])
    dash = Dashboard(out, mode="rich", console=record_console(), settings=RunSettings(), started_at=now["t"] - 5)

    def shown(render) -> str:
        console = record_console()
        console.print(render(dash.view()))
        return console.export_text()

    for line in ("server not answering: no answer to GET /health for 15 s (...) (30 s left)", None):
        (out / "status.json").write_text(json.dumps({"state": "running", "step": 3, "server_status": line,
                                                     "updated_at": now["t"]}))
        dash.poll()
    assert dash.view().server_back_at == 1000.0
    now["t"] += 12
    assert "answering again (12 s ago)" in shown(processes_panel)
    assert "sampler server: answering again (12 s ago)" in shown(compact_dashboard)
    now["t"] += SERVER_BACK_SHOW_S
    assert "answering again" not in shown(processes_panel)  # after a while: the row goes
    (out / "status.json").write_text(json.dumps({"state": "running", "step": 4, "server_status": "server "
                                                 "unreachable, retrying (60 s left)", "updated_at": now["t"]}))
    dash.poll()
    assert dash.view().server_back_at is None and "answering again" not in shown(processes_panel)
    (out / "status.json").write_text(json.dumps({"state": "failed: x", "step": 4, "server_status": None,
                                                 "updated_at": now["t"]}))
    dash.poll()  # the run ended: nothing is "answering again"
    assert "answering again" not in shown(processes_panel)
