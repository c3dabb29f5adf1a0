"""The completions table (log_completions) shows the advantage and each reward function's reward."""

from __future__ import annotations

from rich.console import Console

from asyncgrpo_cli.dashboard.panels import completions_table


def test_table_has_advantage_and_per_function_columns():
    console = Console(record=True, width=200, force_terminal=False)
    console.print(completions_table([
        {"step": 3, "prompt": [{"role": "user", "content": "2+2?"}], "completion": "4", "reward": 1.5,
         "advantage": 0.25, "rewards": {"accuracy_reward": 1.0, "format_reward": 0.5}},
        {"step": 3, "prompt": "1+1?", "completion": "3", "reward": None, "advantage": None,
         "rewards": {"accuracy_reward": None}},
    ]))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "advantage" in line)
    assert "accuracy_reward" in header and "format_reward" in header
    row = next(line for line in text.splitlines() if "2+2?" in line)
    assert "1.5" in row and "0.25" in row and "0.5" in row
