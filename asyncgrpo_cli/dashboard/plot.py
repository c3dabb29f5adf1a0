"""``<output_dir>/training_curves.png``: the panels a user reads after a run, drawn from ``metrics.jsonl``
with matplotlib's Agg backend (no display needed).

The whole run shows, across resumes: `run_history` keeps the windows of the latest run in the folder and,
at each resume marker (``{"event": "resume", "step": N, ...}``, written by the trainer when it resumes),
replaces the windows after step N that the resumed run trains again; the plot marks each resume with a
vertical line. A step without a value leaves a gap in that curve (no line drawn across it).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .diagnosis import num
from .jsonl import parse_json_lines
from .panels import has_tool_metrics, reward_names

REWARD_CURVES = ("reward", "reward_kept")
THROUGHPUT_CURVES = ("rollout/generated_tokens_per_s", "perf/fwd_bwd_forwarded_tokens_per_s",
                     "perf/wall_clock_trained_tokens_per_s")
RESUME_EVENT = "resume"
START_EVENT = "start"  # a start from step 0 in a folder an earlier attempt logged into (`LiveFiles.mark_start`)
EVAL_EVENT = "eval"  # one record per eval round (train/evaluation.py; README "Evaluation")
KV_METRIC = "rollout/vllm_kv_cache_usage_frac"
#: ``sampler.backend`` -> what the KV usage curve is (the metric keeps its SPEC name, the legend says what it is).
KV_SOURCES = {"vllm": "vLLM", "embedded": "embedded sampler", "external": "server"}

#: (panel title, y label, metric names) of the fixed panels after the reward panel.
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("loss", "loss", ("loss",)),
    ("entropy", "nats / token", ("entropy",)),
    ("clipped share", "fraction", ("completions/clipped_ratio", "clip_ratio/region_mean")),
    ("groups without reward spread", "fraction of groups", ("frac_reward_zero_std",)),
    ("staleness", "model versions", ("sample/staleness_mean", "sample/staleness_max", "sample/dropped_stale_count")),
    ("stale drops by length", "fraction", ("sample/dropped_stale_token_frac", "sample/trained_frac_short",
                                           "sample/trained_frac_medium", "sample/trained_frac_long")),
    ("completion length", "tokens", ("completions/mean_length", "completions/max_length",
                                     "completions/mean_terminated_length")),
    ("throughput", "tokens / s", THROUGHPUT_CURVES),
    ("KV cache usage vs cap", "fraction of the KV cache", (KV_METRIC,)),
)
#: The panel added when the run logs tool metrics (a tool or an environment is configured, SPEC §15.4).
TOOLS_PANEL: tuple[str, str, tuple[str, ...]] = (
    "tools & turns", "per rollout", ("tools/call_frequency", "tools/failure_frequency", "tools/loop_exhausted_frac",
                                     "rollout/turns_mean", "rollout/turns_max"))
#: Drawn on a second y axis of the KV panel: in-flight rollouts against the adaptive cap.
CONCURRENCY_CURVES = ("rollout/concurrency", "rollout/concurrency_cap")


def load_metrics(path: str | Path, offset: int = 0) -> list[dict[str, Any]]:
    """The JSON objects of a ``metrics.jsonl`` file from byte ``offset`` on (blank or broken lines, e.g. a
    line still being written, are skipped). A missing file gives []."""
    p = Path(path)
    if not p.is_file():
        return []
    with p.open("rb") as fh:
        fh.seek(offset)
        return parse_json_lines(fh.read())


@dataclass
class RunHistory:
    """The metrics windows of one run, oldest first, and the steps it resumed at."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[tuple[float, str]] = field(default_factory=list)  # (step, checkpoint)


def is_event(record: Mapping[str, Any]) -> bool:
    """Whether a ``metrics.jsonl`` record is an event marker (``{"event": ...}``) rather than a window."""
    return "event" in record


def run_history(records: Sequence[Mapping[str, Any]]) -> RunHistory:
    """The latest run of a ``metrics.jsonl`` file, across its resumes.

    A resume marker at step N drops the kept windows after step N (the resumed run logs them again); a start
    marker, or a window whose step does not grow without a marker before it, starts a new run (a reused folder),
    so everything before it is dropped.
    """
    out = RunHistory()
    last_step: float | None = None
    for rec in records:
        if is_event(rec):
            if rec.get("event") == EVAL_EVENT:  # kept in place (a resume drops the rounds after its step)
                out.rows.append(dict(rec))
            elif rec.get("event") == START_EVENT:
                out, last_step = RunHistory(), None
            elif rec.get("event") == RESUME_EVENT:
                at = num(rec, "step") or 0.0
                out.rows = [r for r in out.rows if (num(r, "step") or 0.0) <= at]
                out.resumes = [r for r in out.resumes if r[0] <= at] + [(at, str(rec.get("from") or ""))]
                last_step = at
            continue
        step = num(rec, "step")
        if step is not None and last_step is not None and step <= last_step:
            out = RunHistory()
        out.rows.append(dict(rec))
        if step is not None:
            last_step = step
    return out


def _series(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """(steps, values) over every window: NaN where ``name`` has no value, so the line has a gap."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        x = num(r, "step")
        y = num(r, name)
        xs.append(float(i + 1) if x is None else x)
        ys.append(math.nan if y is None else y)
    return xs, ys


def isolated_points(series: tuple[list[float], list[float]]) -> tuple[list[float], list[float]]:
    """The points of ``series`` with no value on either side (NaN or the end): a line with gaps does not draw
    them, so the figure marks them (``sample/trained_frac_long`` logs only in windows where a long sample had
    its verdict)."""
    xs, ys = series
    finite = [not math.isnan(y) for y in ys]
    keep = [i for i, ok in enumerate(finite)
            if ok and (i == 0 or not finite[i - 1]) and (i == len(ys) - 1 or not finite[i + 1])]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _has(series: tuple[list[float], list[float]]) -> bool:
    return any(not math.isnan(y) for y in series[1])


def _same(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a[1], b[1]))


def reward_curves(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, tuple[list[float], list[float]]]]:
    """(label, series) of the reward panel: ``reward``, ``reward_kept`` and each ``rewards/<f>/mean``; a
    per-function curve identical to ``reward`` (one reward function) is folded into its label."""
    base = _series(rows, "reward")
    curves: list[tuple[str, tuple[list[float], list[float]]]] = []
    same_as_reward: list[str] = []
    for name in sorted({n for r in rows for n in reward_names(r)}):
        s = _series(rows, name)
        if _has(base) and _same(s, base):
            same_as_reward.append(name)
        elif _has(s):
            curves.append((name, s))
    if _has(base):
        label = "reward" + (f" (= {', '.join(same_as_reward)})" if same_as_reward else "")
        curves.insert(0, (label, base))
    kept = _series(rows, "reward_kept")
    if _has(kept):
        curves.insert(1 if _has(base) else 0, ("reward_kept", kept))
    return curves


def _agree(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]]) -> bool:
    """Whether ``a`` and ``b`` have the same value at every step where both have one, and share at least one
    such step (a step where either has no value says nothing against folding them)."""
    both = [(x, y) for x, y in zip(a[1], b[1]) if not math.isnan(x) and not math.isnan(y)]
    return a[0] == b[0] and bool(both) and all(x == y for x, y in both)


def _union(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]]) -> tuple[list[float], list[float]]:
    """The points of ``a`` and ``b`` together (they `_agree`): ``a``'s value where it has one, else ``b``'s."""
    return a[0], [y if math.isnan(x) else x for x, y in zip(a[1], b[1])]


def fold_identical(curves: list[tuple[str, tuple[list[float], list[float]]]]
                   ) -> list[tuple[str, tuple[list[float], list[float]]]]:
    """One curve per distinct series: curves with the same values at every step where both have one
    (``sample/trained_frac_short``, ``_medium`` and ``_long`` are all 1.0 while nothing goes stale, each logged
    only in windows where a completion of its length had its verdict) are drawn once, as the union of their
    points, labelled ``a = b = c``, instead of as lines hidden under each other. Curves fold only when they share
    at least one step with a value; a curve joins a fold when it agrees with the fold's union of points, so the
    drawn line holds every member's values."""
    folded: list[tuple[list[str], tuple[list[float], list[float]]]] = []
    for label, series in curves:
        i = next((i for i, f in enumerate(folded) if _agree(f[1], series)), None)
        if i is None:
            folded.append(([label], series))
        else:
            labels, union = folded[i]
            folded[i] = ([*labels, label], _union(union, series))
    return [(" = ".join(labels), series) for labels, series in folded]


def eval_curves(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, tuple[list[float], list[float]]]]:
    """(label, series) of the eval panel from the eval round records (``{"event": "eval", "step": S, ...}``):
    ``eval/reward``, ``eval/pass_rate`` and each ``eval/rewards/<f>/mean`` against the evaluated step, one point
    per round (joined: the rounds are sparse, not windows with gaps)."""
    rounds = [r for r in rows if r.get("event") == EVAL_EVENT and num(r, "step") is not None]
    names = ["eval/reward", "eval/pass_rate",
             *sorted({k for r in rounds for k in r if k.startswith("eval/rewards/") and k.endswith("/mean")})]
    curves = []
    for name in names:
        points = [(num(r, "step"), num(r, name)) for r in rounds if num(r, name) is not None]
        if points:
            curves.append((name, ([float(x) for x, _ in points], [float(y) for _, y in points])))
    return curves


def kv_label(sampler: str | None) -> str:
    """The legend of the KV usage curve: what it measures (``sampler``: ``sampler.backend``; None = unknown)."""
    source = KV_SOURCES.get(str(sampler or ""))
    return f"KV cache usage ({source})" if source else "KV cache usage"


def curve_panels(rows: Sequence[Mapping[str, Any]], sampler: str | None = None
                 ) -> list[tuple[str, str, list[tuple[str, tuple[list[float], list[float]]]]]]:
    """(title, y label, [(legend label, series)]) of each panel, reward panel first (`PANELS` after it, then
    `TOOLS_PANEL` when a window logs tool metrics, then the eval panel when the run has eval rounds).

    ``sampler`` (``sampler.backend``) names the KV usage curve (`kv_label`). Event records are skipped.
    """
    evals = eval_curves(rows)
    rows = [r for r in rows if not is_event(r)]
    panels = [("reward", "reward", reward_curves(rows))]
    with_tools = any(has_tool_metrics(r) for r in rows)
    for title, ylabel, names in (*PANELS, *([TOOLS_PANEL] if with_tools else [])):
        curves = [(kv_label(sampler) if n == KV_METRIC else n, s) for n in names if _has(s := _series(rows, n))]
        panels.append((title, ylabel, fold_identical(curves)))
    if evals:
        panels.append(("eval (held-out prompts)", "reward / share", evals))
    return panels


def training_curves_figure(rows: Sequence[Mapping[str, Any]], resumes: Sequence[tuple[float, str]] = (),
                           sampler: str | None = None):
    """The matplotlib `Figure` of `plot_training_curves` (Agg, no pyplot state), or None when ``rows``
    hold none of its metrics. Each panel's legend sits outside its plot area, on the right, so no curve
    is hidden under it."""
    panels = curve_panels(rows, sampler)
    rows = [r for r in rows if not is_event(r)]
    concurrency = [(n, s) for n in CONCURRENCY_CURVES if _has(s := _series(rows, n))]
    if not any(curves for _, _, curves in panels) and not concurrency:
        return None
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.figure import Figure  # Figure + Agg canvas: no pyplot global state
    from matplotlib.ticker import MaxNLocator

    ncols = 2
    nrows = (len(panels) + ncols - 1) // ncols
    fig = Figure(figsize=(17, 3.0 * nrows), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()
    marker = "o" if len(rows) < 30 else None
    for ax, (title, ylabel, curves) in zip(axes, panels):
        for label, (xs, ys) in curves:
            (line,) = ax.plot(xs, ys, marker=marker, markersize=3, label=label)
            if marker is None and (lone := isolated_points((xs, ys)))[0]:
                ax.plot(*lone, linestyle="none", marker="o", markersize=3, color=line.get_color())
        handles, labels = ax.get_legend_handles_labels()
        if title.startswith("KV") and concurrency:
            twin = ax.twinx()
            for label, (xs, ys) in concurrency:
                twin.plot(xs, ys, marker=marker, markersize=3, linestyle="--", label=label,
                          color="tab:red" if label.endswith("cap") else "tab:green")
            twin.set_ylabel("rollouts in flight")
            more = twin.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        if not curves and not (title.startswith("KV") and concurrency):
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        for step, checkpoint in resumes:
            line = ax.axvline(step, color="gray", linestyle=":", linewidth=1,
                              label=f"resumed from {Path(checkpoint).name or 'a checkpoint'}")
            handles, labels = handles + [line], labels + [line.get_label()]
        if handles:  # outside the plot area (right of the twin axis, if any): it never covers a curve
            offset = 1.12 if title.startswith("KV") and concurrency else 1.01
            ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(offset, 1.0),
                      borderaxespad=0.0, frameon=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-ncols:]:
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)
    return fig


def plot_training_curves(rows: Sequence[Mapping[str, Any]], out_path: str | Path,
                         resumes: Sequence[tuple[float, str]] = (), sampler: str | None = None) -> Path | None:
    """Draw the run's panels against ``step`` and save them as a PNG: reward (and each reward function),
    loss, entropy, clipped share, groups without reward spread, staleness, completion length, throughput,
    KV cache usage (named for ``sampler``, ``sampler.backend``) against the concurrency cap. Each resume
    step gets a dashed vertical line. Event records in ``rows`` are skipped.

    Returns:
        The PNG path, or None when ``rows`` hold none of these metrics (nothing is written then).
    """
    fig = training_curves_figure(rows, resumes, sampler)
    if fig is None:
        return None
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(out)
    return out


def plot_run(output_dir: str | Path, out_path: str | Path, sampler: str | None = None) -> Path | None:
    """`plot_training_curves` of the whole latest run in ``output_dir/metrics.jsonl`` (`run_history`);
    ``sampler``: ``sampler.backend``, to name the KV usage curve."""
    history = run_history(load_metrics(Path(output_dir) / "metrics.jsonl"))
    return plot_training_curves(history.rows, out_path, history.resumes, sampler)
