"""The tools & environments panel and the tool diagnosis (SPEC §13, §15.4–15.5)."""

from __future__ import annotations

from rich.console import Console

from asyncgrpo_cli.dashboard.diagnosis import MetricsHistory, diagnose, tool_use
from asyncgrpo_cli.dashboard.panels import DashboardView, render_dashboard


def frame(metrics):
    history = MetricsHistory()
    history.push(metrics)
    console = Console(record=True, width=160)
    console.print(render_dashboard(DashboardView(status=None, history=history, diagnosis=diagnose(history))))
    return console.export_text()


def test_panel_only_with_tool_metrics():
    assert "tools & environments" not in frame({"step": 1, "reward": 0.5})
    text = frame({"step": 1, "reward": 0.5, "tools/call_frequency": 2.0, "tools/failure_frequency": 0.4,
                  "tools/unknown_name_count": 3, "tools/calc/call_count": 7, "tools/calc/failure_count": 2,
                  "tools/calc/latency_s": 0.05, "env/reset_s": 0.002, "rollout/fork_frac": 0.1})
    assert "tools & environments" in text and "7 calls, 2 failed" in text and "40%" in text
    assert "tool failures 40%, 3 to unknown names: read the tool messages" in text


def test_tool_diagnosis_rules():
    assert tool_use({"reward": 1.0}) is None
    assert tool_use({"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0}).severity == "ok"
    d = tool_use({"tools/call_frequency": 3.0, "tools/failure_frequency": 0.0, "tools/loop_exhausted_frac": 0.5})
    assert d.rule == "tool_loop_exhausted" and "max_tool_calling_iterations" in d.text
    d = tool_use({"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0, "rollout/fork_frac": 0.6})
    assert d.rule == "tool_forks" and "prefix-preserving" in d.text


def test_the_elsewhere_row_says_what_it_counts_when_no_tool_ran():
    assert "elsewhere (API server, HTTP)" in frame({"step": 1, "reward": 0.5})  # no tools: only in transit
    assert "elsewhere (API server, HTTP)" in frame({"step": 1, "tools/call_frequency": 0.0})  # tools, none called
    assert "elsewhere (tools, API server)" in frame({"step": 1, "tools/call_frequency": 1.5})
