"""``<output_dir>/training_curves.png``: reward and throughput over steps, drawn from ``metrics.jsonl``
with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .diagnosis import num
from .jsonl import parse_json_lines
from .panels import reward_names

REWARD_CURVES = ("reward", "reward_kept")
THROUGHPUT_CURVES = ("rollout/generated_tokens_per_s", "perf/fwd_bwd_forwarded_tokens_per_s",
                     "perf/wall_clock_trained_tokens_per_s")


def load_metrics(path: str | Path, offset: int = 0) -> list[dict[str, Any]]:
    """The JSON objects of a ``metrics.jsonl`` file from byte ``offset`` on (blank or broken lines, e.g. a
    line still being written, are skipped). A missing file gives []."""
    p = Path(path)
    if not p.is_file():
        return []
    with p.open("rb") as fh:
        fh.seek(offset)
        return parse_json_lines(fh.read())


def _series(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(rows):
        y = num(r, name)
        if y is None:
            continue
        x = num(r, "step")
        xs.append(float(i + 1) if x is None else x)
        ys.append(y)
    return xs, ys


def plot_training_curves(rows: Sequence[Mapping[str, Any]], out_path: str | Path) -> Path | None:
    """Draw reward (``reward``, ``reward_kept``, each ``rewards/*/mean``) and throughput (generated,
    fwd+bwd forwarded and wall-clock trained tokens per second) against ``step``; save as PNG.

    Returns:
        The PNG path, or None when ``rows`` hold none of these metrics (nothing is written then).
    """
    reward_keys = [*REWARD_CURVES, *sorted({n for r in rows for n in reward_names(r)})]
    curves = {k: _series(rows, k) for k in (*reward_keys, *THROUGHPUT_CURVES)}
    if not any(xs for xs, _ in curves.values()):
        return None
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.figure import Figure  # Figure + Agg canvas: no pyplot global state

    fig = Figure(figsize=(10, 7), dpi=100)
    ax_r, ax_t = fig.subplots(2, 1, sharex=True)
    for key in reward_keys:
        xs, ys = curves[key]
        if xs:
            ax_r.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
    ax_r.set_ylabel("reward")
    ax_r.set_title("reward")
    for key in THROUGHPUT_CURVES:
        xs, ys = curves[key]
        if xs:
            ax_t.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
    ax_t.set_ylabel("tokens / s")
    ax_t.set_xlabel("step")
    ax_t.set_title("throughput")
    for ax in (ax_r, ax_t):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(out)
    return out
