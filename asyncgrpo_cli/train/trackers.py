"""``log_completions`` on the trainer's side (SPEC §16.3): each logging step, the completion records the
worker shipped (`rollout.completions`) go to ``<output_dir>/completions.jsonl`` (the dashboard prints
their tables) and to the ``report_to`` trackers that take a table: wandb (`wandb.Table`), trackio
(`trackio.Table` where the installed version has it) and tensorboard (a markdown table as text).
Scalars reach the trackers through `transformers.Trainer.log` and their callbacks, as before.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TABLE_KEY = "completions"  # the trackers' name of the table (tensorboard tag, wandb/trackio key)
_CLIP = 2000  # characters of a prompt or completion a tracker table keeps


def prompt_text(prompt: Any) -> str:
    """A prompt as text: the last user message of a conversation (its content), or the string itself."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        message = users[-1] if users else (prompt[-1] if prompt else {})
        content = message.get("content", "") if isinstance(message, Mapping) else message
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        return str(content)
    return "" if prompt is None else str(prompt)


def table_rows(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a completions table: step, prompt, completion, reward, advantage, then one column
    per reward function (names sorted; None where a record has no value)."""
    names = sorted({n for r in records for n in (r.get("rewards") or {})})
    columns = ["step", "prompt", "completion", "reward", "advantage", *names]
    rows = []
    for r in records:
        per_function = r.get("rewards") or {}
        rows.append([r.get("step"), prompt_text(r.get("prompt"))[:_CLIP], str(r.get("completion") or "")[:_CLIP],
                     r.get("reward"), r.get("advantage"), *(per_function.get(n) for n in names)])
    return columns, rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table (tensorboard renders its text summaries as markdown)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def send_to_trackers(callbacks: Iterable[Any], records: Sequence[Mapping[str, Any]], step: int) -> list[str]:
    """Give the completions table to every tracker callback among ``callbacks`` that is set up and takes one.

    Returns:
        The names of the trackers that got it (``"tensorboard"``, ``"wandb"``, ``"trackio"``).
    """
    if not records:
        return []
    columns, rows = table_rows(records)
    sent = []
    for cb in callbacks:
        kind = type(cb).__name__
        try:
            if kind == "TensorBoardCallback" and getattr(cb, "tb_writer", None) is not None:
                cb.tb_writer.add_text(TABLE_KEY, markdown_table(columns, rows), step)
                cb.tb_writer.flush()
                sent.append("tensorboard")
            elif kind == "WandbCallback" and getattr(getattr(cb, "_wandb", None), "run", None) is not None:
                cb._wandb.log({TABLE_KEY: cb._wandb.Table(columns=columns, data=rows), "train/global_step": step})
                sent.append("wandb")
            elif kind == "TrackioCallback" and getattr(cb, "_initialized", False):
                table = getattr(cb._trackio, "Table", None)
                if table is not None:  # a DataFrame: the form every trackio version with a Table reads
                    import pandas as pd

                    frame = pd.DataFrame(rows, columns=columns)
                    cb._trackio.log({TABLE_KEY: table(dataframe=frame), "train/global_step": step})
                    sent.append("trackio")
        except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop training
            warnings.warn(f"log_completions: the {kind} tracker did not take the completions table "
                          f"({type(exc).__name__}: {exc}); completions.jsonl still has it", UserWarning, stacklevel=2)
    return sent


def log_completions(records: list[dict[str, Any]], step: int, limit: int | None, live, callbacks) -> list[dict]:
    """Write one logging step's completion records: at most ``limit`` of them (``num_completions_to_print``;
    None = all), oldest first, each stamped with ``step``, appended to ``completions.jsonl`` (``live``: the
    trainer's `LiveFiles`) and sent to the trackers (`send_to_trackers`). Returns the records written."""
    shown = records if limit is None else records[: max(0, int(limit))]
    if not shown:
        return []
    for r in shown:
        r["step"] = int(step)
    if live is not None:
        live.append_completions(shown)
    send_to_trackers(callbacks, shown, step)
    return shown
