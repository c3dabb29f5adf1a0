"""The dashboard at 80x24, the plain summary, and what training_curves.png draws (gaps, duplicates, resumes)."""

from __future__ import annotations

import dataclasses
import json
import math

from rich.console import Console

from asyncgrpo_cli.dashboard import LIVE_MARGIN, Dashboard
from asyncgrpo_cli.dashboard.panels import render_dashboard, summarize, summary_lines
from asyncgrpo_cli.dashboard.plot import (
    _series,
    isolated_points,
    curve_panels,
    plot_run,
    plot_training_curves,
    reward_curves,
    run_history,
    training_curves_figure,
)

from .test_panels import STATUS, view_of, window


def render(renderable, width: int, height: int) -> list[str]:
    console = Console(record=True, width=width, height=height, force_terminal=False)
    console.print(renderable)
    return console.export_text().splitlines()


def test_dashboard_fits_80x24_without_cutting_or_wrapping_a_value():
    view = view_of(status={**STATUS, "max_concurrent_rollouts": 16, "concurrency": 11, "concurrency_cap": 16})
    lines = render(render_dashboard(view, width=80, height=24), 80, 24)
    text = "\n".join(lines)
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
    assert "…" not in text and "..." not in text
    # Every value is whole on one line next to its label.
    for label, value in (("step", "3 / 10"), ("in flight/cap/max", "11/16/16"), ("trainer waits", "0.02 s"),
                         ("staleness", "1.25 (max 3) / 4"), ("gen tok/s", "12.3k"), ("accuracy_reward", "0.3"),
                         ("dropped stale", "2"), ("KV cache", "50%"), ("worker heartbeat", "0.4 s ago")):
        assert any(label in line and value in line for line in lines), (label, value)


def test_wide_terminal_keeps_the_panel_grid():
    text = "\n".join(render(render_dashboard(view_of(), width=160, height=60), 160, 60))
    assert "rollout queue & concurrency" in text and "throughput" in text


def test_live_dashboard_picks_the_layout_from_the_console(tmp_path):
    small = Dashboard(tmp_path, mode="plain", console=Console(width=80, height=24, force_terminal=False))
    assert "rollout queue" not in "\n".join(render(small.renderable(), 80, 24))
    big = Dashboard(tmp_path, mode="plain", console=Console(width=150, height=50, force_terminal=False))
    assert "rollout queue" in "\n".join(render(big.renderable(), 150, 50))


def test_the_live_frame_leaves_room_for_the_terminals_ctrl_c_echo(tmp_path):
    """A frame as wide as an 80-column terminal wraps when the terminal echoes ``^C`` after its last line,
    and the redraw then leaves the old top border above the stop message; the frame stays 2 columns in."""
    dash = Dashboard(tmp_path, mode="plain", console=Console(width=80, height=24, force_terminal=False))
    lines = render(dash.renderable(), 80, 24)
    assert lines and max(len(line.rstrip()) for line in lines) <= 80 - LIVE_MARGIN and LIVE_MARGIN >= 2
    assert len(lines) <= 24 and "…" not in "\n".join(lines)


def test_plain_summary_never_cuts_a_long_path(tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "run"
    (deep / "checkpoint-8").mkdir(parents=True)
    summary = summarize([window(1)], 10.0, deep, "finished", deep / "training_curves.png")
    lines = summary_lines(summary)
    assert any(str(deep) in line for line in lines)
    assert any(str(deep / "checkpoint-8") in line for line in lines)
    assert any(str(deep / "training_curves.png") in line for line in lines)


def test_reward_identical_to_the_only_reward_function_is_folded_into_its_label():
    rows = [{"step": s, "reward": 0.1 * s, "rewards/accuracy_reward/mean": 0.1 * s} for s in (1, 2, 3)]
    labels = [label for label, _ in reward_curves(rows)]
    assert labels == ["reward (= rewards/accuracy_reward/mean)"]
    rows2 = [{**r, "rewards/format_reward/mean": 0.5} for r in rows]
    assert [label for label, _ in reward_curves(rows2)] == ["reward (= rewards/accuracy_reward/mean)",
                                                            "rewards/format_reward/mean"]


def test_a_step_without_a_value_is_a_gap():
    rows = [{"step": 1, "reward_kept": 0.5}, {"step": 2}, {"step": 3, "reward_kept": 0.7}]
    xs, ys = _series(rows, "reward_kept")
    assert xs == [1, 2, 3] and ys[0] == 0.5 and math.isnan(ys[1]) and ys[2] == 0.7
    # A point alone between gaps draws no line segment: the figure marks it (with 30 windows or more, lines
    # carry no markers).
    assert isolated_points((xs, ys)) == ([1, 3], [0.5, 0.7])
    nan = math.nan
    assert isolated_points(([1, 2, 3, 4, 5], [0.1, 0.2, nan, 0.4, nan])) == ([4], [0.4])
    assert isolated_points(([1, 2], [nan, nan])) == ([], [])


def test_resume_keeps_the_whole_run_and_marks_it(tmp_path):
    records = [window(s) for s in range(1, 8)]  # the first run got to step 7, its last checkpoint was 4
    records.append({"event": "resume", "step": 4, "from": "checkpoint-4"})
    records += [window(s) for s in range(5, 9)]
    history = run_history(records)
    assert [r["step"] for r in history.rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert history.resumes == [(4.0, "checkpoint-4")]
    # A new run from scratch in a reused folder (steps restart without a marker) replaces the old one.
    assert [r["step"] for r in run_history([window(1), window(2), window(1)]).rows] == [1]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot_run(tmp_path, tmp_path / "training_curves.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_a_start_again_in_the_same_folder_is_marked_and_read_as_a_new_run(tmp_path):
    """An attempt that saved no checkpoint, started again in its folder (the failure's start-again command): the
    trainer marks the new start in ``metrics.jsonl``, and the curves drop the earlier attempt's windows even when
    the new run's first logged step is past them (``logging_steps`` 2 after an attempt that logged step 1)."""
    from asyncgrpo_cli.run.state import LiveFiles

    live = LiveFiles(tmp_path)
    live.mark_start(0, None)  # a first start: nothing to mark
    assert not (tmp_path / "metrics.jsonl").exists()
    live.append_metrics(window(1))
    live.mark_start(0, None)
    live.append_metrics(window(2))
    live.mark_start(4, str(tmp_path / "checkpoint-4"))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("event") for x in lines] == [None, "start", None, "resume"]
    assert lines[1]["step"] == 0 and "earlier attempt" in lines[1]["note"] and lines[3]["from"] == "checkpoint-4"
    assert [r["step"] for r in run_history(lines[:3]).rows] == [2]
    assert [r["step"] for r in run_history([window(1), window(2)]).rows] == [1, 2]  # no marker: one run


def test_dashboard_skips_event_records(tmp_path):
    from asyncgrpo_cli.train.sync_check import STARTED

    console = Console(record=True, width=200, force_terminal=False)
    dash = Dashboard(tmp_path, mode="plain", console=console)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"event": "resume", "step": 4, "from": "checkpoint-4"}) + "\n")
        fh.write(json.dumps({"event": "weight_sync_check_started", "time": 1.0, "message": STARTED}) + "\n")
        fh.write(json.dumps(window(5)) + "\n")
        fh.write(json.dumps({"event": "weight_sync_check", "step": 4, "status": "pass",
                             "message": "weight sync check passed: every sync took effect (...)"}) + "\n")
    new = dash.poll()
    assert [r["step"] for r in new] == [5] and [r["step"] for r in dash.history.rows] == [5]
    text = console.export_text()
    assert "resumed at step 4 from checkpoint-4" in text
    assert "weight sync check passed: every sync took effect" in text  # sampler.check_weight_sync
    assert text.index(STARTED) < text.index("weight sync check passed")  # said as it begins


def test_curve_panels_put_each_metric_where_it_belongs_and_name_the_kv_source():
    rows = [window(s) for s in (1, 2, 3)]
    panels = {title: [label for label, _ in curves] for title, _, curves in curve_panels(rows, "embedded")}
    assert "frac_reward_zero_std" not in panels["clipped share"]
    assert panels["groups without reward spread"] == ["frac_reward_zero_std"]
    assert panels["KV cache usage vs cap"] == ["KV cache usage (embedded sampler)"]
    vllm = {title: [label for label, _ in curves] for title, _, curves in curve_panels(rows, "vllm")}
    assert vllm["KV cache usage vs cap"] == ["KV cache usage (vLLM)"]
    assert "tools & turns" not in panels  # no tool metrics: no tools panel


def test_a_run_with_tools_gets_a_tools_and_turns_panel(tmp_path):
    rows = [{**window(s), "tools/call_frequency": 0.5 * s, "tools/failure_frequency": 0.1, "rollout/turns_mean": 1.5}
            for s in (1, 2, 3)]
    panels = {title: [label for label, _ in curves] for title, _, curves in curve_panels(rows, "embedded")}
    assert panels["tools & turns"] == ["tools/call_frequency", "tools/failure_frequency", "rollout/turns_mean"]
    none_called = [{**window(s), "tools/call_frequency": 0.0} for s in (1, 2)]  # tools on, no call: still drawn
    assert "tools & turns" in {title for title, _, _ in curve_panels(none_called)}
    assert plot_training_curves(rows, tmp_path / "curves.png") is not None


def test_training_curve_legends_never_cover_the_plot_area():
    rows = [window(s) for s in range(1, 9)]
    fig = training_curves_figure(rows, resumes=[(4.0, "checkpoint-4")], sampler="embedded")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lays the figure out (constrained layout), so the extents are final
    renderer = canvas.get_renderer()
    legends = 0
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None or not ax.get_visible():
            continue
        legends += 1
        box = legend.get_window_extent(renderer)
        for other in fig.axes:  # neither its own plot area nor a neighbour's (nor the KV panel's twin)
            if other.get_visible():
                assert not box.overlaps(other.get_window_extent(renderer)), (ax.get_title(), other.get_title())
        assert fig.bbox.contains(box.x1 - 1, box.y0 + 1), ax.get_title()  # inside the image, not cut off
    assert legends >= 8


def test_the_last_frame_of_an_ended_run_shows_no_eta_and_nothing_alive():
    running = view_of()
    for width, height in ((160, 60), (80, 24)):  # the wide grid and the compact panel
        text = "\n".join(render(render_dashboard(running, width=width, height=height), width, height))
        assert "ETA" in text and "alive" in text and "stopped" not in text
        ended = dataclasses.replace(running, outcome="stopped")
        text = "\n".join(render(render_dashboard(ended, width=width, height=height), width, height))
        assert "ETA" not in text and "alive" not in text, text
        assert "stopped" in text and "stopping" in text  # the server still running is being stopped
    # A final state in status.json alone (the trainer stopped, the supervisor not yet): no ETA either.
    stopped = view_of(status={**STATUS, "state": "stopped"})
    assert "ETA" not in "\n".join(render(render_dashboard(stopped, width=160, height=60), 160, 60))
