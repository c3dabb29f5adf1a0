"""Completion records (``completions.jsonl`` lines) as the console shows them: a table in the panels, one line each
in plain output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from ..run.metrics_line import fmt
from .diagnosis import num


def _prompt_text(prompt: Any) -> str:
    """A prompt as text: the last user message of a conversation, or the string itself."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        msg = users[-1] if users else (prompt[-1] if prompt else {})
        content = msg.get("content", "") if isinstance(msg, Mapping) else msg
        if isinstance(content, list):  # multimodal parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        return str(content)
    return "" if prompt is None else str(prompt)


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _completion_text(completion: Any) -> str:
    if isinstance(completion, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, Mapping) else str(m) for m in completion)
    return str(completion or "")


def completion_lines(rows: Sequence[Mapping[str, Any]], limit: int | None = None) -> list[str]:
    """Plain output's form of `completions_table`: one line per record (newlines shown as ``⏎``), so a log
    stays one record per line at any width.

    Example: ``completion step 3 | reward 0.5 | advantage 0.87 | f 0.5 | prompt: what is 2+3? | completion: 5``
    """
    out = []
    for r in list(rows)[: limit] if limit is not None else list(rows):
        per_function = r.get("rewards") if isinstance(r.get("rewards"), Mapping) else {}
        scores = [f"reward {fmt(num(r, 'reward'), '.3g')}", f"advantage {fmt(num(r, 'advantage'), '.3g')}",
                  *(f"{n} {fmt(num(per_function, n), '.3g')}" for n in sorted(per_function))]
        prompt = _clip(_prompt_text(r.get("prompt"))).replace("\n", "⏎")
        completion = _clip(_completion_text(r.get("completion"))).replace("\n", "⏎")
        out.append(f"completion step {r.get('step', '')} | {' | '.join(scores)} | prompt: {prompt} | "
                   f"completion: {completion}")
    return out


def completions_table(rows: Sequence[Mapping[str, Any]], limit: int | None = None) -> Table:
    """A table of completion records (``completions.jsonl`` lines: step, prompt, completion, total reward,
    advantage, and each reward function's reward under ``rewards``), at most ``limit`` rows (None = all)."""
    shown = list(rows)[: limit] if limit is not None else list(rows)
    steps = sorted({r.get("step") for r in shown if r.get("step") is not None})
    title = "completions" + (f" (step {', '.join(map(str, steps))})" if steps else "")
    names = sorted({n for r in shown if isinstance(r.get("rewards"), Mapping) for n in r["rewards"]})
    table = Table("step", "prompt", "completion", "reward", "advantage", *names, title=title, show_lines=True,
                  expand=True)
    for r in shown:
        per_function = r.get("rewards") if isinstance(r.get("rewards"), Mapping) else {}
        table.add_row(str(r.get("step", "")), _clip(_prompt_text(r.get("prompt"))),
                      _clip(_completion_text(r.get("completion"))),
                      fmt(num(r, "reward"), ".3g"), fmt(num(r, "advantage"), ".3g"),
                      *(fmt(num(per_function, n), ".3g") for n in names))
    return table
