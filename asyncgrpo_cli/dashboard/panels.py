"""What the live dashboard shows: rich panels, the plain log line, completion tables and the end-of-run
summary (DESIGN.md §2; SPEC §4.4, §5, §15).

Everything here is a pure function of a `DashboardView` (the trainer's ``status.json``, the kept
metrics windows of ``metrics.jsonl``, the process table and the diagnosis) or of metrics rows: no file
or process is touched, so tests render into ``Console(record=True)``.

Live values (queue size, concurrency, KV usage, running/waiting requests) come from ``status.json``
(rewritten about once a second) and fall back to the newest metrics window.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..run.metrics_line import DASH, fmt, fmt_pct, fmt_rate, metrics_line  # noqa: F401 - re-exported
from ..run.metrics_line import request_breakdown
from ..run.state import final_model_step
from .diagnosis import DEFAULT_THRESHOLDS, Diagnosis, MetricsHistory, RunSettings, busy_share, num
from .completions import completion_lines, completions_table  # noqa: F401 - re-exported
from .findings import held_shares

SEVERITY_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "alert": "bold red"}
WORKER_SILENT_AFTER_S = 20.0  # seconds without a rollout worker heartbeat shown as a problem (red; plain: a line)
SERVER_BACK_SHOW_S = 30.0  # seconds the panels say "answering again" after a sampler server outage cleared


@dataclass
class ProcessInfo:
    """One row of the process table: ``alive`` None = not started by us (e.g. an external server); ``stopped``:
    alive but stopped (SIGSTOP, Ctrl-Z)."""

    name: str
    pid: int | None
    alive: bool | None
    detail: str = ""
    stopped: bool = False
    exit_code: int | None = None  # once ended, when known: minus the signal that killed it (subprocess's way)


@dataclass
class DashboardView:
    """Everything one frame of the dashboard shows.

    Attributes:
        status: the trainer's ``status.json`` (None before it is written).
        history: the metrics windows of this run (newest last).
        diagnosis: the one diagnosis line.
        processes: the process table of the supervisor.
        settings: config values (max_staleness, max_concurrent_rollouts, ...).
        started_at: when the supervisor started the run (unix seconds).
        now: the frame's time (unix seconds).
        title: panel title (run name / output dir).
        outcome: set on the last frame, once the run has ended (``finished``, ``stopped``, ``failed``):
            the state shows it, no ETA is shown, and processes still running are shown as being stopped.
        server_back_at: when the sampler server's last outage (``server_status``) cleared while the run went on
            (unix seconds; None: none did): the panels say ``answering again`` for `SERVER_BACK_SHOW_S` s after,
            as plain mode prints a line (twenty-third session's trial: after a SIGCONT the red row just vanished).
    """

    status: Mapping[str, Any] | None
    history: MetricsHistory
    diagnosis: Diagnosis
    processes: list[ProcessInfo] = field(default_factory=list)
    settings: RunSettings = field(default_factory=RunSettings)
    started_at: float = field(default_factory=time.time)
    now: float = field(default_factory=time.time)
    title: str = "asyncgrpo"
    outcome: str | None = None
    eval: Mapping[str, Any] | None = None  # the newest eval round record (README "Evaluation"), None = none yet
    server_back_at: float | None = None

    @property
    def server_back_text(self) -> str | None:
        """``answering again (N s ago)`` for `SERVER_BACK_SHOW_S` s after an outage cleared (`server_back_at`), while
        no new outage line shows and the run goes on; else None."""
        if self.server_back_at is None or (self.status or {}).get("server_status") or self.ended:
            return None
        ago = max(0.0, self.now - self.server_back_at)
        return f"answering again ({ago:.0f} s ago)" if ago < SERVER_BACK_SHOW_S else None

    @property
    def ended(self) -> bool:
        """Whether the run is over: an ``outcome``, or a final state in ``status.json`` (finished, stopped,
        failed)."""
        state = str((self.status or {}).get("state") or "")
        return bool(self.outcome) or state in ("finished", "stopped", "done") or state.startswith("failed")

    @property
    def metrics(self) -> dict[str, Any] | None:
        """The newest metrics window."""
        return self.history.latest

    def live(self, status_key: str, metric: str | None = None) -> float | None:
        """``status[status_key]`` when set, else the newest window's ``metric``."""
        value = num(self.status, status_key)
        if value is None and metric is not None:
            value = num(self.metrics, metric)
        return value


# ----------------------------------------------------------------------------------------------- format
def fmt_s(value: float | None, spec: str = ".2f") -> str:
    """Seconds with a unit (``1.50 s``), or ``—``."""
    return DASH if value is None else f"{format(value, spec)} s"


def fmt_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``1h02m``; ``—`` when unknown or negative."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return DASH
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"




# ------------------------------------------------------------------------------------------ run timing
def step_rate(rows: Sequence[Mapping[str, Any]], key: str = "step") -> float | None:
    """``key`` units per second between the first and the newest row that carry ``time`` and ``key``."""
    pts = [(num(r, "time"), num(r, key)) for r in rows]
    pts = [(t, s) for t, s in pts if t is not None and s is not None]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0] or pts[-1][1] <= pts[0][1]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def eta_seconds(view: DashboardView) -> float | None:
    """Seconds to the end from the step rate (``max_steps``) or else the epoch rate (``num_train_epochs``).

    With one window only, the rate is counted from the run's start.
    """
    rows = view.history.rows
    start = num(view.status, "started_at") or view.started_at
    for key, total_key in (("step", "max_steps"), ("epoch", "num_train_epochs")):
        total = num(view.status, total_key)
        done = view.live(key, key)
        if total is None or total <= 0 or done is None:
            continue
        rate = step_rate(rows, key)
        if rate is None and done > 0 and view.now > start:
            rate = done / (view.now - start)
        if rate:
            return max(0.0, (total - done) / rate)
        return None
    return None


def run_state(view: DashboardView) -> str:
    """The state line: the run's outcome on the last frame, else ``status.json``'s state."""
    if view.outcome:
        return view.outcome
    return str((view.status or {}).get("state") or "starting")


STATE_STYLES = {"running": "green", "saving": "cyan", "finished": "bold green", "done": "bold green",
                "failed": "bold red", "stopped": "yellow"}


def process_state(p: ProcessInfo, ended: bool) -> tuple[str, str]:
    """(text, style) of a process row: ``external``, ``alive``, ``exited``, ``killed`` (a signal ended it, e.g. a
    ``kill -9``: a fresh-user trial read ``exited`` for its SIGKILL), ``STOPPED`` (SIGSTOP), or ``stopping`` for one
    still running once the run has ended (``ended``: the supervisor stops it next)."""
    if p.alive is None:
        return "external", "cyan"
    if not p.alive:
        return ("killed", "red") if p.exit_code is not None and p.exit_code < 0 else ("exited", "red")
    if p.stopped:
        return "STOPPED", "bold red"
    return ("stopping", "yellow") if ended else ("alive", "green")


# ---------------------------------------------------------------------------------------------- panels
def _kv_table(rows: Sequence[tuple[str, Any]]) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")  # a path or command longer than the line wraps, never ends in "…"
    for label, value in rows:
        table.add_row(label, value if isinstance(value, Text) else str(value))
    return table


def run_panel(view: DashboardView) -> Panel:
    """State, step/max, epoch, elapsed, ETA, model version and trainer processes."""
    s = view.status or {}
    step = view.live("step", "step")
    max_steps = num(s, "max_steps")
    epoch = view.live("epoch", "epoch")
    epochs = num(s, "num_train_epochs")
    step_txt = fmt(step, ".0f") + (f" / {max_steps:.0f}" if max_steps and max_steps > 0 else "")
    # "/ num_train_epochs" only when the epochs end the run: with max_steps set, transformers stops there
    epoch_txt = fmt(epoch, ".2f") + (f" / {epochs:g}" if epochs and not (max_steps and max_steps > 0) else "")
    state = run_state(view)
    rows = [
        ("state", Text(state, style=STATE_STYLES.get(state.split(":")[0], "yellow"))),
        ("step", step_txt),
        ("epoch", epoch_txt),
        ("elapsed", fmt_duration(view.now - view.started_at)),
        ("ETA", fmt_duration(eta_seconds(view))),
        ("model version", fmt(num(s, "model_version"), ".0f")),
        ("trainer processes", fmt(num(s, "num_processes"), ".0f")),
    ]
    if view.ended:  # the run has ended: nothing is left to estimate
        rows = [r for r in rows if r[0] != "ETA"]
    return Panel(_kv_table(rows), title="run", border_style="blue")


def queue_panel(view: DashboardView) -> Panel:
    """Rollout queue and backpressure (SPEC §4, §5.1): queue size, both waits, in-flight rollouts against
    the adaptive cap and ``max_concurrent_rollouts``, KV usage, and where the in-flight rollouts are
    (running / waiting in the engine; elsewhere = in tools, between turns or in the API server, B.22)."""
    m = view.metrics
    conc = view.live("concurrency", "rollout/concurrency")
    cap = view.live("concurrency_cap", "rollout/concurrency_cap")
    ceiling = view.live("max_concurrent_rollouts") or view.settings.max_concurrent_rollouts
    kv = view.live("kv_cache_usage_frac", "rollout/vllm_kv_cache_usage_frac")
    running = view.live("requests_running", "rollout/vllm_running_requests")
    waiting = view.live("requests_waiting", "rollout/vllm_queued_requests")
    elsewhere = None
    if conc is not None and running is not None:
        elsewhere = max(0.0, conc - running - (waiting or 0.0))
    kv_style = "red" if kv is not None and kv > 0.8 else "green" if kv is not None and kv < 0.6 else "yellow"
    rows = [
        ("queue (samples)", fmt(view.live("queue_size", "rollout/queue_size"), ".0f")),
        ("trainer waits", fmt_s(num(m, "perf/rollout_wait_s"))),
        ("generation waits", fmt_s(num(m, "rollout/backpressure_s"))),
        ("generation held by", held_text(m)),
        ("in flight / cap / max", f"{fmt(conc, '.0f')} / {fmt(cap, '.0f')} / {ceiling:.0f}"),
        ("KV cache", Text(fmt_pct(kv), style=kv_style if kv is not None else "")),
        ("engine running / waiting", f"{fmt(running, '.0f')} / {fmt(waiting, '.0f')}"),
        (_elsewhere_label(m), fmt(elsewhere, ".0f")),
        ("score queue", fmt(num(m, "rollout/score_queue_size"), ".0f")),
    ]
    return Panel(_kv_table(rows), title="rollout queue & concurrency", border_style="blue")


def held_text(metrics: Mapping[str, Any] | None) -> str:
    """What held the rollout producer over the window, the gates at 5% of the time or more, largest first
    (``deadline 62% · cap 11%``; `asyncgrpo_cli.rollout.holds`), ``nothing`` when none did, ``—`` when not logged."""
    shares = held_shares(metrics)
    if not shares:
        return "—"
    shown = [f"{gate} {share:.0%}" for gate, share in shares if share >= 0.05]
    return " · ".join(shown) if shown else "nothing"


def _elsewhere_label(metrics: Mapping[str, Any] | None) -> str:
    """What the in-flight rollouts that are neither running nor waiting in the engine are doing: in a tool
    call, or (no tool called in this window) in transit: the API server, HTTP, tokenizing, scoring."""
    calls = num(metrics, "tools/call_frequency")
    return "elsewhere (tools, API server)" if calls else "elsewhere (API server, HTTP)"


def _ratio_text(ratio: float | None) -> Text:
    """The mean importance ratio, red when far from 1 (a biased ratio masks tokens, SPEC §7)."""
    style = "" if ratio is None else "green" if 0.8 <= ratio <= 1.25 else "red" if not 0.5 <= ratio <= 2 else "yellow"
    return Text(fmt(ratio, ".3f"), style=style)


def staleness_panel(view: DashboardView) -> Panel:
    """Staleness of trained samples against ``max_staleness`` and the samples dropped for it (SPEC §4.1)."""
    m = view.metrics
    limit = view.settings.max_staleness
    smax = num(m, "sample/staleness_max")
    rows = [
        ("staleness mean", fmt(num(m, "sample/staleness_mean"), ".2f") + f" / {limit}"),
        ("staleness max", Text(fmt(smax, ".0f") + f" / {limit}",
                               style="yellow" if smax is not None and smax >= limit else "")),
        ("dropped stale (step)", fmt(num(m, "sample/dropped_stale_count"), ".0f")),
        ("dropped stale tokens", fmt_pct(num(m, "sample/dropped_stale_token_frac"))),
        ("trained short/med/long", " / ".join(fmt_pct(num(m, f"sample/trained_frac_{c}"))
                                              for c in ("short", "medium", "long"))),
        ("time in queue", fmt_s(num(m, "sample/time_in_queue_s"))),
        ("importance ratio", _ratio_text(num(m, "sampling/importance_sampling_ratio/mean"))),
    ]
    return Panel(_kv_table(rows), title="staleness", border_style="blue")


def reward_names(metrics: Mapping[str, Any] | None) -> list[str]:
    """The ``rewards/<func>/mean`` names in ``metrics``, sorted."""
    return sorted(k for k in (metrics or {}) if re.fullmatch(r"rewards/.+/mean", k))


def _no_signal_text(view: DashboardView) -> Text:
    """Consecutive groups dropped without signal against ``rollout.max_groups_without_signal`` (issue #19)."""
    n, limit = num(view.status, "groups_without_signal"), num(view.status, "max_groups_without_signal")
    if n is None:
        return Text(DASH)
    share = n / limit if limit else 0.0
    style = "red" if share >= 0.5 else "yellow" if share >= 0.25 else ""
    return Text(f"{n:.0f} / {limit:.0f}" if limit else f"{n:.0f} / never", style=style)


def rewards_panel(view: DashboardView) -> Panel:
    """Reward, kept/dropped, zero-std fraction, duplicates and every reward function's mean (SPEC §5.2)."""
    m = view.metrics
    rows: list[tuple[str, Any]] = [
        ("reward", fmt(num(m, "reward"), ".4g")),
        ("reward kept / dropped", f"{fmt(num(m, 'reward_kept'), '.3g')} / {fmt(num(m, 'reward_dropped'), '.3g')}"),
        ("groups without signal", fmt_pct(num(m, "frac_reward_zero_std"))),
        ("  in a row / stop at", _no_signal_text(view)),
        ("duplicates", fmt_pct(num(m, "completions/duplicate_frac"))),
        ("clipped completions", fmt_pct(num(m, "completions/clipped_ratio"))),
        ("entropy", fmt(num(m, "entropy"), ".3g")),
    ]
    rows += [(name[len("rewards/"):-len("/mean")], fmt(num(m, name), ".3g")) for name in reward_names(m)]
    rows += eval_rows(view.eval)
    return Panel(_kv_table(rows), title="rewards", border_style="blue")


def eval_rows(record: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """The eval row of the rewards panel: the newest round's mean reward and pass rate, and its step."""
    if not record:
        return []
    return [(f"eval @ step {fmt(num(record, 'step'), '.0f')}",
             f"{fmt(num(record, 'eval/reward'), '.3g')} (pass {fmt_pct(num(record, 'eval/pass_rate'))})")]


def busy_text(metrics: Mapping[str, Any] | None) -> Text:
    """The trainer's busy share of the step (`diagnosis.busy_share`), yellow when its wait is "high" (the
    idle-trainer diagnosis); ``—`` when ``perf/rollout_wait_s`` or ``perf/step_s`` is missing."""
    busy = busy_share(metrics)
    idle = busy is not None and 1 - busy > DEFAULT_THRESHOLDS.high_wait_frac
    return Text(fmt_pct(busy), style="yellow" if idle else "")


def throughput_panel(view: DashboardView) -> Panel:
    """Generation and training throughput, step time, the trainer's busy share of it and MFU when logged
    (SPEC §15.3, §15.8)."""
    m = view.metrics
    rows: list[tuple[str, Any]] = [
        ("generated tok/s", fmt_rate(num(m, "rollout/generated_tokens_per_s"))),
        ("fwd+bwd forwarded tok/s", fmt_rate(num(m, "perf/fwd_bwd_forwarded_tokens_per_s"))),
        ("wall-clock trained tok/s", fmt_rate(num(m, "perf/wall_clock_trained_tokens_per_s"))),
        ("step time", fmt_s(num(m, "perf/step_s"))),
        ("trainer busy", busy_text(m)),
    ]
    rows.extend(request_rows(m))
    mfu = num(m, "perf/fwd_bwd_mfu")
    if mfu is not None:
        rows.append(("fwd+bwd MFU", fmt_pct(mfu)))
    return Panel(_kv_table(rows), title="throughput", border_style="blue")


def request_rows(m: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """The throughput panel's rows of where a generation request's time goes (issue #41,
    `run.metrics_line.request_breakdown`): rollouts and groups per second, then the request's mean time with
    each stage's share (vLLM's queue, prefill, decode; the API server and HTTP; the worker's parse)."""
    b = request_breakdown(m)
    if b is None:
        return []
    rows: list[tuple[str, Any]] = [("rollouts/s · groups/s", f"{fmt_rate(b['rollouts_per_s'])} · "
                                                             f"{fmt_rate(b['groups_per_s'])}")]
    if b["request_s"] is not None:
        shares = " ".join(f"{k} {v:.0%}" for k, v in b["shares"].items())
        rows.append(("request", f"{fmt_s(b['request_s'])} ({shares})" if shares else
                     f"{fmt_s(b['request_s'])} (no per-stage times from this server)"))
    return rows


def has_tool_metrics(metrics: Mapping[str, Any] | None) -> bool:
    """True when the run logs tool or environment metrics (a tool or environment is configured, SPEC §15.4)."""
    return any(k.startswith(("tools/", "env/")) for k in (metrics or {}))


def tools_panel(view: DashboardView) -> Panel:
    """Tools and environments (SPEC §13, §15.4, §15.5): calls per rollout, failures, unknown names, the
    iteration cap, reconciliation (forks, drift, samples per rollout), environment times, per-tool calls."""
    m = view.metrics
    fail = num(m, "tools/failure_frequency")
    exhausted = num(m, "tools/loop_exhausted_frac")
    fork = num(m, "rollout/fork_frac")
    rows: list[tuple[str, Any]] = [
        ("tool calls / rollout", fmt(num(m, "tools/call_frequency"), ".3g")),
        ("calls / tool turn", fmt(num(m, "tools/parallel_calls_mean"), ".3g")),
        ("tool failures", Text(fmt_pct(fail), style="yellow" if fail is not None and fail > 0.2 else "")),
        ("unknown tool names", fmt(num(m, "tools/unknown_name_count"), ".0f")),
        ("cut at iteration cap", Text(fmt_pct(exhausted),
                                      style="yellow" if exhausted is not None and exhausted > 0.2 else "")),
        ("tool latency", fmt_s(num(m, "tools/latency_s"), ".3f")),
        ("turns mean / max", f"{fmt(num(m, 'rollout/turns_mean'), '.3g')} / {fmt(num(m, 'rollout/turns_max'), '.0f')}"),
        ("forks / drift tokens", Text(f"{fmt_pct(fork)} / {fmt(num(m, 'rollout/drift_tokens_mean'), '.3g')}",
                                      style="yellow" if fork is not None and fork > 0.2 else "")),
        ("samples / rollout", fmt(num(m, "rollout/samples_per_rollout"), ".3g")),
    ]
    if num(m, "env/reset_s") is not None or num(m, "env/reward_s") is not None:
        rows.append(("env reset / reward", f"{fmt_s(num(m, 'env/reset_s'), '.3f')} / "
                                           f"{fmt_s(num(m, 'env/reward_s'), '.3f')}"))
    for name in sorted(k for k in (m or {}) if re.fullmatch(r"tools/[^/]+/call_count", k)):
        tool = name.split("/")[1]
        rows.append((f"  {tool}", f"{fmt(num(m, name), '.0f')} calls, "
                                  f"{fmt(num(m, f'tools/{tool}/failure_count'), '.0f')} failed, "
                                  f"{fmt_s(num(m, f'tools/{tool}/latency_s'), '.3f')}"))
    return Panel(_kv_table(rows), title="tools & environments", border_style="blue")


def processes_panel(view: DashboardView) -> Panel:
    """The process table, the rollout worker's heartbeat age and the trainer's last error."""
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column()
    for p in view.processes:
        state = Text(*process_state(p, bool(view.outcome)))
        table.add_row(p.name, Text(f"pid {p.pid}" if p.pid else DASH), Text.assemble(state, " ", p.detail))
    age = num(view.status, "worker_heartbeat_age_s")
    red = min(WORKER_SILENT_AFTER_S, view.settings.rollout_worker_timeout / 2)
    style = "green" if age is not None and age < 10 else "red" if age is not None and age >= red else "yellow"
    table.add_row("rollout worker", "", Text(f"heartbeat {fmt(age, '.1f')} s ago" if age is not None else
                                            "heartbeat —", style=style if age is not None else "dim"))
    server_status = (view.status or {}).get("server_status")
    if server_status:  # "server unreachable, retrying (N s left)" while an outage lasts (SPEC B.17)
        table.add_row("sampler server", "", Text(str(server_status), style="bold red"))
    elif view.server_back_text:
        table.add_row("sampler server", "", Text(view.server_back_text, style="green"))
    updated = num(view.status, "updated_at")
    if updated is not None and view.now - updated > 10:
        table.add_row("status.json", "", Text(f"not updated for {fmt_duration(view.now - updated)}", style="yellow"))
    error = (view.status or {}).get("last_error")
    if error and not view.outcome:  # the last frame: the supervisor prints the error and its cause under it
        table.add_row("last error", "", Text(str(error)[-300:], style="red"))
    return Panel(table, title="processes", border_style="blue")


def diagnosis_text(diagnosis: Diagnosis) -> Text:
    """The diagnosis as one styled line."""
    return Text.assemble(("diagnosis: ", "bold"), (diagnosis.text, SEVERITY_STYLE.get(diagnosis.severity, "")))


#: Below this terminal width or height (lines) the dashboard uses the compact one-panel layout.
WIDE_MIN_WIDTH = 110
WIDE_MIN_HEIGHT = 36


def render_dashboard(view: DashboardView, width: int | None = None, height: int | None = None) -> RenderableType:
    """The whole frame: run | processes, queue | staleness, rewards | throughput, then the diagnosis line.

    With the terminal's ``width`` / ``height`` (characters / lines) below `WIDE_MIN_WIDTH` /
    `WIDE_MIN_HEIGHT` (plus the per-function reward rows), the compact layout (`compact_dashboard`) is
    drawn instead: it fits 80x24 without truncating or wrapping a value. None = wide.
    """
    extra = len(reward_names(view.metrics)) + len(eval_rows(view.eval))
    if (width is not None and width < WIDE_MIN_WIDTH) or (height is not None and height < WIDE_MIN_HEIGHT + extra):
        return compact_dashboard(view)
    grid = Table.grid(expand=True, padding=(0, 1))
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(run_panel(view), processes_panel(view))
    grid.add_row(queue_panel(view), staleness_panel(view))
    grid.add_row(rewards_panel(view), throughput_panel(view))
    if has_tool_metrics(view.metrics):
        grid.add_row(tools_panel(view), Text(""))
    return Panel(Group(grid, diagnosis_text(view.diagnosis)), title=f"[bold]{view.title}[/]", border_style="cyan")


def _compact_rows(view: DashboardView) -> list[tuple[str, Any]]:
    """(label, value) pairs of the compact layout: short labels, values as short as the wide panels'."""
    s, m = view.status or {}, view.metrics
    step, max_steps = view.live("step", "step"), num(s, "max_steps")
    conc = view.live("concurrency", "rollout/concurrency")
    cap = view.live("concurrency_cap", "rollout/concurrency_cap")
    ceiling = view.live("max_concurrent_rollouts") or view.settings.max_concurrent_rollouts
    kv = view.live("kv_cache_usage_frac", "rollout/vllm_kv_cache_usage_frac")
    limit = view.settings.max_staleness
    state = run_state(view)
    rows: list[tuple[str, Any]] = [
        ("state", Text(state, style=STATE_STYLES.get(state.split(":")[0], "yellow"))),
        ("step", fmt(step, ".0f") + (f" / {max_steps:.0f}" if max_steps and max_steps > 0 else "")),
        ("elapsed", fmt_duration(view.now - view.started_at)),
    ]
    if not view.ended:  # no ETA once the run has ended
        rows.append(("ETA", fmt_duration(eta_seconds(view))))
    rows += [
        ("reward", fmt(num(m, "reward"), ".4g")),
        ("kept / dropped", f"{fmt(num(m, 'reward_kept'), '.3g')} / {fmt(num(m, 'reward_dropped'), '.3g')}"),
        ("no-signal groups", fmt_pct(num(m, "frac_reward_zero_std"))),
        ("clipped", fmt_pct(num(m, "completions/clipped_ratio"))),
        ("entropy", fmt(num(m, "entropy"), ".3g")),
        ("duplicates", fmt_pct(num(m, "completions/duplicate_frac"))),
    ]
    rows += [(name[len("rewards/"):-len("/mean")], fmt(num(m, name), ".3g")) for name in reward_names(m)]
    rows += eval_rows(view.eval)
    rows += [
        ("queue", fmt(view.live("queue_size", "rollout/queue_size"), ".0f")),
        ("in flight/cap/max", f"{fmt(conc, '.0f')}/{fmt(cap, '.0f')}/{ceiling:.0f}"),
        ("trainer waits", fmt_s(num(m, "perf/rollout_wait_s"))),
        ("gen waits", fmt_s(num(m, "rollout/backpressure_s"))),
        ("KV cache", fmt_pct(kv)),
        ("engine run/wait", f"{fmt(view.live('requests_running', 'rollout/vllm_running_requests'), '.0f')}/"
                            f"{fmt(view.live('requests_waiting', 'rollout/vllm_queued_requests'), '.0f')}"),
        ("staleness", f"{fmt(num(m, 'sample/staleness_mean'), '.2f')} (max {fmt(num(m, 'sample/staleness_max'), '.0f')})"
                      f" / {limit}"),
        ("dropped stale", fmt(num(m, "sample/dropped_stale_count"), ".0f")),
        ("gen tok/s", fmt_rate(num(m, "rollout/generated_tokens_per_s"))),
        ("train tok/s", fmt_rate(num(m, "perf/wall_clock_trained_tokens_per_s"))),
        ("step time", fmt_s(num(m, "perf/step_s"))),
        ("trainer busy", busy_text(m)),
        ("model version", fmt(num(s, "model_version"), ".0f")),
    ]
    for p in view.processes:
        state_txt, style = process_state(p, bool(view.outcome))
        rows.append((p.name, Text(f"{state_txt} {p.pid or ''}".rstrip(), style=style)))
    age = num(view.status, "worker_heartbeat_age_s")
    rows.append(("worker heartbeat", DASH if age is None else f"{age:.1f} s ago"))
    return rows


def compact_dashboard(view: DashboardView) -> RenderableType:
    """One panel of label/value pairs in two columns (fits 80x24: about 20 lines), then the diagnosis and
    the trainer's last error folded onto whole lines; no value is cut or wrapped."""
    rows = _compact_rows(view)
    table = Table.grid(padding=(0, 1), expand=True)
    for _ in range(2):
        table.add_column(style="dim", no_wrap=True)
        table.add_column(no_wrap=True, overflow="fold", ratio=1)
    half = (len(rows) + 1) // 2
    left, right = rows[:half], rows[half:]
    for i, (label, value) in enumerate(left):
        r_label, r_value = right[i] if i < len(right) else ("", "")
        table.add_row(label, value if isinstance(value, Text) else str(value), r_label,
                      r_value if isinstance(r_value, Text) else str(r_value))
    parts: list[RenderableType] = [table, diagnosis_text(view.diagnosis)]
    server_status = (view.status or {}).get("server_status")
    if server_status:  # unreachable, not answering, re-push: folded onto whole lines like the error
        parts.append(Text(f"sampler server: {server_status}", style="bold red"))
    elif view.server_back_text:
        parts.append(Text(f"sampler server: {view.server_back_text}", style="green"))
    error = (view.status or {}).get("last_error")
    if error and not view.outcome:  # the last frame: the supervisor prints the error and its cause under it
        parts.append(Text(f"last error: {str(error)[-300:]}", style="red"))
    title = view.title if len(view.title) <= 60 else view.title.rstrip("/").rsplit("/", 1)[-1]
    return Panel(Group(*parts), title=Text(title, style="bold"), border_style="cyan")


def plain_line(metrics: Mapping[str, Any], diagnosis: Diagnosis | None = None, max_steps: float | None = None) -> str:
    """One log line per logging step: `run.metrics_line.metrics_line` (step, reward, key throughput numbers, the
    trainer's busy share of the step, queue, staleness) with the diagnosis at its end.

    Example: ``step 3/8 | reward 0.25 | gen 1.2k tok/s | train 3.4k tok/s | step 2.10 s | busy 41% | queue 5 | ...``
    """
    return metrics_line(metrics, max_steps, diagnosis.text if diagnosis is not None else None)


# --------------------------------------------------------------------------------------------- summary
@dataclass
class RunSummary:
    """End-of-run numbers.

    Attributes:
        outcome: ``finished``, ``failed`` or ``stopped``.
        steps: the last logged step (None without metrics); first_step: this run's first (above 1 after a resume:
            the summary then says which steps this run trained, since ``elapsed_s`` is this run's time).
        elapsed_s: wall time of the run (seconds).
        final_reward: the mean ``reward`` of the last `FINAL_REWARD_WINDOWS` windows that scored a group (a
            window that trained only on samples already queued has none); one step of a short run says little.
        final_reward_windows: how many windows that mean is over; final_reward_steps: the first and last step of
            them (a step without a reward in between is skipped, and the summary says so).
        final_model: the ``from_pretrained`` line that loads the saved final model (or LoRA adapter), None when
            ``output_dir`` holds none; final_model_step: the step it holds (`run.state.final_model_step`).
        mean_generated_tokens_per_s: ``rollout/generated_tokens_per_s`` over the windows, each weighted by its
            step time (``perf/step_s``): the tokens over the time, not a mean of rates (a short fast step and a
            long slow one do not count alike).
        mean_trained_tokens_per_s: ``perf/wall_clock_trained_tokens_per_s``, weighted the same way.
        mean_step_s: mean of ``perf/step_s``.
        output_dir: the run folder; checkpoints: its ``checkpoint-*`` folders (oldest first).
        plot_path: the training-curves PNG, when written.
        final_eval: the run's last eval round (``{"event": "eval", "step": S, ...}``), None without eval.
    """

    outcome: str
    steps: int | None
    elapsed_s: float
    final_reward: float | None
    mean_generated_tokens_per_s: float | None
    mean_trained_tokens_per_s: float | None
    mean_step_s: float | None
    output_dir: str
    checkpoints: list[str] = field(default_factory=list)
    plot_path: str | None = None
    final_reward_windows: int = 0
    final_reward_steps: tuple[int, int] | None = None
    final_model: str | None = None
    final_model_step: int | None = None  # the step it holds (``final_model.json``), None when not recorded
    final_eval: Mapping[str, Any] | None = None  # the last eval round record (README "Evaluation")
    first_step: int | None = None  # this run's first logged step: above 1 when it resumed a checkpoint


def _mean(rows: Sequence[Mapping[str, Any]], name: str) -> float | None:
    vals = [v for v in (num(r, name) for r in rows) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _time_weighted(rows: Sequence[Mapping[str, Any]], name: str) -> float | None:
    """A rate over the windows weighted by their ``perf/step_s`` (tokens over time); the plain mean of the
    windows without a step time."""
    pairs = [(v, t) for v, t in ((num(r, name), num(r, "perf/step_s")) for r in rows) if v is not None]
    timed = [(v, t) for v, t in pairs if t is not None and t > 0]
    if timed and len(timed) == len(pairs):
        return sum(v * t for v, t in timed) / sum(t for _, t in timed)
    return _mean(rows, name)


def list_checkpoints(output_dir: str | Path) -> list[str]:
    """``checkpoint-N`` folders of ``output_dir``, by N."""
    out = Path(output_dir)
    found = [p for p in out.glob("checkpoint-*") if p.is_dir()]

    def key(p: Path) -> tuple[int, str]:
        tail = p.name.split("-", 1)[-1]
        return (int(tail) if tail.isdigit() else -1, p.name)

    return [str(p) for p in sorted(found, key=key)]


FINAL_REWARD_WINDOWS = 5


def final_model_line(output_dir: str | Path) -> str | None:
    """``AutoModelForCausalLM.from_pretrained("<output_dir>")`` (``PeftModel...`` for a LoRA adapter) when the
    final model was saved into ``output_dir``; None otherwise."""
    out = Path(output_dir)
    if (out / "adapter_model.safetensors").exists() or (out / "adapter_model.bin").exists():
        return f'PeftModel.from_pretrained(base_model, "{out}")'
    if any((out / n).exists() for n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
        return f'AutoModelForCausalLM.from_pretrained("{out}")'
    return None


def final_model_text(summary: RunSummary) -> str | None:
    """The summary's "final model" row: the step the model in ``output_dir`` holds and how to load it when this
    run wrote it (it finished); otherwise that it is not this run's, and where this run's last step is."""
    newest = summary.checkpoints[-1] if summary.checkpoints else None
    this = f"this run {summary.outcome} at step {summary.steps}" if summary.steps is not None else \
        f"this run {summary.outcome}"
    load = f"; its newest checkpoint: {newest}" if newest else ""
    step = summary.final_model_step
    if summary.final_model is None:
        return f"not saved ({this}){load}" if summary.outcome != "finished" and newest else None
    if step is None:
        return (f"not claimed: the model in {summary.output_dir} has no recorded step (an earlier run's, or a save "
                f"that did not end){load}")
    if summary.outcome != "finished":  # a stopped or failed run writes no final model: it is an earlier run's
        return f"not saved by this run ({this}); the model in {summary.output_dir} is step {step}'s{load}"
    return f"step {step}; load it with {summary.final_model}"


def summarize(rows: Sequence[Mapping[str, Any]], elapsed_s: float, output_dir: str | Path, outcome: str,
              plot_path: str | Path | None = None, final_eval: Mapping[str, Any] | None = None) -> RunSummary:
    """Summarize the metrics rows of a run (``metrics.jsonl`` lines, oldest first); ``final_eval``: its last
    eval round record."""
    last = rows[-1] if rows else {}
    step = num(last, "step")
    scored = [(num(r, "step"), v) for r, v in ((r, num(r, "reward")) for r in rows) if v is not None]
    scored = scored[-FINAL_REWARD_WINDOWS:]
    rewards = [v for _, v in scored]
    span = (int(scored[0][0]), int(scored[-1][0])) if scored and None not in (scored[0][0], scored[-1][0]) else None
    first = next((num(r, "step") for r in rows if num(r, "step") is not None), None)
    return RunSummary(outcome=outcome, steps=None if step is None else int(step), elapsed_s=elapsed_s,
                      first_step=None if first is None else int(first),
                      final_reward=sum(rewards) / len(rewards) if rewards else None,
                      final_reward_windows=len(rewards), final_reward_steps=span,
                      final_model=final_model_line(output_dir),
                      final_model_step=final_model_step(output_dir),
                      mean_generated_tokens_per_s=_time_weighted(rows, "rollout/generated_tokens_per_s"),
                      mean_trained_tokens_per_s=_time_weighted(rows, "perf/wall_clock_trained_tokens_per_s"),
                      mean_step_s=_mean(rows, "perf/step_s"), output_dir=str(output_dir),
                      checkpoints=list_checkpoints(output_dir), plot_path=str(plot_path) if plot_path else None,
                      final_eval=final_eval)


def _reward_span(summary: RunSummary) -> str:
    """One phrasing whatever the rows: `` (mean of the 5 logged steps with a reward among steps 36-40)``. The range
    runs from the first step averaged to the run's last step, so a step in it without a reward (one that trained
    only on queued samples) shows as the count falling short of the range, and a logged step is a window of
    ``logging_steps`` steps where that is above 1. One logged step with a reward among several: `` (the only logged
    step with a reward among steps 9-10)``; empty when the run logged one step."""
    n, span = summary.final_reward_windows, summary.final_reward_steps
    if n < 1:
        return ""
    if span is None:
        return f" (mean of the last {n} logged steps with a reward)" if n > 1 else ""
    last = max(span[1], summary.steps) if summary.steps is not None else span[1]
    if n == 1:
        first = min(span[0], summary.first_step) if summary.first_step is not None else span[0]
        return f" (the only logged step with a reward among steps {first}-{last})" if first < last else ""
    return f" (mean of the {n} logged steps with a reward among steps {span[0]}-{last})"


def _steps_text(summary: RunSummary) -> str:
    """``8``; after a resume ``8 (steps 2-8 in this run)``: the time beside it is this run's."""
    if summary.steps is None:
        return DASH
    if summary.first_step is not None and 1 < summary.first_step <= summary.steps:
        return f"{summary.steps} (steps {summary.first_step}-{summary.steps} in this run)"
    return str(summary.steps)


def summary_rows(summary: RunSummary, compact: bool = False) -> list[tuple[str, Any]]:
    """(label, value) rows of the end-of-run summary: every checkpoint path in full, or (``compact``, for the
    boxed panel) the last three checkpoint names on one row."""
    style = {"finished": "green", "failed": "red", "stopped": "yellow"}.get(summary.outcome, "")
    rows: list[tuple[str, Any]] = [
        ("outcome", Text(summary.outcome, style=style)),
        ("steps", _steps_text(summary)),
        ("time", fmt_duration(summary.elapsed_s)),
        ("final reward", fmt(summary.final_reward, ".4g") + _reward_span(summary)),
        *[("final " + label, value) for label, value in eval_rows(summary.final_eval)],
        ("generated tok/s", fmt_rate(summary.mean_generated_tokens_per_s)),
        ("trained tok/s", fmt_rate(summary.mean_trained_tokens_per_s)),
        ("mean step time", fmt_s(summary.mean_step_s)),
        ("output", summary.output_dir),
    ]
    model = final_model_text(summary)
    if model:
        rows.append(("final model", model))
    if compact:
        ckpts = ", ".join(Path(c).name for c in summary.checkpoints[-3:]) or "none"
        rows.append(("checkpoints", f"… {ckpts}" if len(summary.checkpoints) > 3 else ckpts))
    else:
        rows += [("checkpoint", c) for c in summary.checkpoints[-3:]] or [("checkpoints", "none")]
    if summary.plot_path:
        rows.append(("training curves", summary.plot_path))
    return rows


def summary_lines(summary: RunSummary) -> list[str]:
    """The summary as plain lines (no box) for output that is not a terminal: a path is never cut."""
    rows = summary_rows(summary)
    return ["asyncgrpo train: summary"] + [f"  {label:<21} {value}" for label, value in rows]


def summary_panel(summary: RunSummary) -> Panel:
    """The end-of-run panel: steps, time, final reward, mean throughput, checkpoints, curves."""
    style = {"finished": "green", "failed": "red", "stopped": "yellow"}.get(summary.outcome, "")
    rows = summary_rows(summary, compact=True)
    return Panel(_kv_table(rows), title="[bold]asyncgrpo train: summary[/]", border_style=style or "blue")
