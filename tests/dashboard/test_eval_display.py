"""Eval rounds (README "Evaluation") in the live panels, the plain log and training_curves.png: each round is a
``{"event": "eval", "step": S, ...}`` record of metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console

from asyncgrpo_cli.dashboard import Dashboard
from asyncgrpo_cli.dashboard.panels import render_dashboard, summarize, summary_lines
from asyncgrpo_cli.dashboard.plot import curve_panels, plot_run, run_history

from .test_panels import STATUS, view_of, window


def eval_record(step, reward, pass_rate):
    return {"event": "eval", "step": step, "time": 0.0, "eval/reward": reward, "eval/pass_rate": pass_rate,
            "eval/rewards/accuracy_reward/mean": reward, "eval/step": float(step)}


def render(renderable, width, height):
    console = Console(record=True, width=width, height=height, force_terminal=False)
    console.print(renderable)
    return console.export_text().splitlines()


def test_the_rewards_panel_shows_the_newest_round_in_both_layouts():
    view = dataclasses.replace(view_of(status={**STATUS, "max_concurrent_rollouts": 16}),
                               eval=eval_record(4, 0.375, 0.5))
    for width, height in ((80, 24), (160, 60)):
        lines = render(render_dashboard(view, width=width, height=height), width, height)
        assert len(lines) <= height and all(len(line) <= width for line in lines)
        assert any("eval @ step 4" in line and "0.375 (pass 50%)" in line for line in lines), (width, height)
    assert not any("eval @" in line for line in render(render_dashboard(view_of(), width=80, height=24), 80, 24))


def test_plain_log_prints_each_round_and_the_history_keeps_only_windows(tmp_path):
    console = Console(record=True, width=200, force_terminal=False)
    dash = Dashboard(tmp_path, mode="plain", console=console)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        for record in (window(1), window(2), eval_record(2, 0.25, 0.25), window(3)):
            fh.write(json.dumps(record) + "\n")
    new = dash.poll()
    assert [r["step"] for r in new] == [1, 2, 3] and dash.eval["step"] == 2
    assert "eval @ step 2 | eval reward 0.25 (pass 25%)" in console.export_text()


def test_the_end_of_run_plot_has_an_eval_curve(tmp_path):
    records = [window(1), window(2), eval_record(2, 0.25, 0.25), window(3), window(4), eval_record(4, 0.5, 0.75),
               eval_record(5, 0.6, 0.8)]
    history = run_history(records)
    panels = {title: dict(curves) for title, _, curves in curve_panels(history.rows)}
    curves = panels["eval (held-out prompts)"]
    assert curves["eval/reward"] == ([2.0, 4.0, 5.0], [0.25, 0.5, 0.6])
    assert curves["eval/pass_rate"][1] == [0.25, 0.75, 0.8] and "eval/rewards/accuracy_reward/mean" in curves
    resumed = run_history([*records, {"event": "resume", "step": 2, "from": "checkpoint-2"}])
    assert [r["step"] for r in resumed.rows if r.get("event") == "eval"] == [2]  # the later rounds are redone
    assert "eval (held-out prompts)" not in {t for t, _, _ in curve_panels([window(1), window(2)])}
    with (tmp_path / "metrics.jsonl").open("w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    assert plot_run(tmp_path, tmp_path / "curves.png").is_file()


def test_the_end_of_run_summary_names_the_last_round(tmp_path):
    lines = summary_lines(summarize([window(1)], 10.0, tmp_path, "finished", final_eval=eval_record(3, 0.5, 0.25)))
    assert any("final eval @ step 3" in line and "0.5 (pass 25%)" in line for line in lines)
    assert not any("eval" in line for line in summary_lines(summarize([window(1)], 10.0, tmp_path, "finished")))
