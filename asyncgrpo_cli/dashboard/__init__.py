"""The live dashboard of `asyncgrpo train` (DESIGN.md §2): it follows the trainer's files in the run's
output folder and shows them as rich panels, plain log lines, or nothing.

- ``status.json`` (rewritten atomically about once a second by trainer rank 0): live state;
- ``metrics.jsonl`` (one line per logging step, SPEC §15 names): the windows behind the panels, the
  diagnosis (`diagnosis.steady_diagnosis`), the plain lines and the end-of-run summary and curves;
- ``completions.jsonl`` (with ``logging.log_completions``): completion tables.

Only what the trainer writes after the dashboard starts is read, so a reused output folder does not
mix runs. `Dashboard.poll` does one round of reading and drawing; the supervisor calls it from its
loop (at least once a second).
"""

from __future__ import annotations

from .jsonl import parse_json_lines

import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from .diagnosis import Diagnosis, MetricsHistory, RunSettings, num, steady_diagnosis
from .panels import (WORKER_SILENT_AFTER_S, DashboardView, ProcessInfo, completion_lines, completions_table,
                     plain_line, render_dashboard)
from .plain_repeats import PlainRepeats

#: Columns the live frame leaves free on the right (room for the terminal's ``^C`` echo).
LIVE_MARGIN = 2

__all__ = ["Dashboard", "JsonlTail", "ProcessInfo", "read_status", "resolve_mode", "STATUS_FILE", "METRICS_FILE",
           "COMPLETIONS_FILE"]

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
MODES = ("auto", "rich", "plain", "off")
SERVER_STATUS_EVERY_S = 10.0  # plain mode: a lasting server_status line is printed again this often
WAITING_EVERY_S = 30.0  # plain mode: before the first logged step, a line on generation this often


class JsonlTail:
    """Follows a JSONL file: each `read_new` returns the objects of the complete lines appended since
    the previous call (a partly written last line waits for its newline).

    Args:
        path: the file (it may not exist yet).
        offset: byte offset to start from. A file that shrinks below it is read again from 0.
    """

    def __init__(self, path: str | Path, offset: int = 0) -> None:
        self.path = Path(path)
        self.offset = offset

    @classmethod
    def at_end(cls, path: str | Path) -> JsonlTail:
        """A tail starting at the current end of ``path`` (0 when it does not exist)."""
        p = Path(path)
        return cls(p, p.stat().st_size if p.is_file() else 0)

    def read_new(self) -> list[dict[str, Any]]:
        """New complete lines as dicts (blank lines, non-objects and broken JSON are skipped)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:
            self.offset = 0
        if size == self.offset:
            return []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read(size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return parse_json_lines(data[: end + 1])


def read_status(path: str | Path, not_before: float | None = None) -> dict[str, Any] | None:
    """The trainer's ``status.json`` as a dict; None when missing, unreadable, or last written before
    ``not_before`` (unix seconds: a file left by an earlier run)."""
    p = Path(path)
    try:
        if not_before is not None and p.stat().st_mtime < not_before:
            return None
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve_mode(mode: str, console: Console) -> str:
    """``auto`` → ``rich`` on a terminal, else ``plain``; other modes unchanged.

    Raises:
        ValueError: for a mode other than auto, rich, plain, off.
    """
    mode = getattr(mode, "value", mode)
    if mode not in MODES:
        raise ValueError(f"logging.dashboard={mode!r}: unknown mode. Fix: one of {', '.join(MODES)}")
    if mode == "auto":
        return "rich" if console.is_terminal else "plain"
    return mode


class Dashboard:
    """Reads the trainer's files and shows them.

    Args:
        output_dir: the run folder holding ``status.json``, ``metrics.jsonl``, ``completions.jsonl``.
        mode: ``auto``, ``rich`` (a `rich.live.Live` panel), ``plain`` (one line per logging step) or ``off``.
        console: where to draw (default: stdout).
        settings: config values for the panels and the diagnosis.
        log_completions: print tables of new ``completions.jsonl`` lines.
        num_completions_to_print: at most this many completions per logging step (None = all).
        started_at: run start (unix s) for the elapsed time; files older than it are ignored.
        title: the panel title.
        refresh_per_second: redraw rate of the rich panel (the caller polls at least this often).
    """

    def __init__(self, output_dir: str | Path, *, mode: str = "auto", console: Console | None = None,
                 settings: RunSettings | None = None, log_completions: bool = False,
                 num_completions_to_print: int | None = None, started_at: float | None = None,
                 title: str | None = None, refresh_per_second: float = 2.0) -> None:
        self.console = console or Console()
        self.mode = resolve_mode(mode, self.console)
        self.output_dir = Path(output_dir)
        self.settings = settings or RunSettings()
        self.log_completions = log_completions
        self.num_completions_to_print = num_completions_to_print
        self.started_at = time.time() if started_at is None else started_at
        self.title = title or f"asyncgrpo train: {self.output_dir}"
        self.refresh_per_second = refresh_per_second
        self.history = MetricsHistory()
        self.rows: list[dict[str, Any]] = []
        self.status: dict[str, Any] | None = None
        self.diagnosis = steady_diagnosis(self.history, self.settings)
        self._repeats = PlainRepeats()
        self._metrics = JsonlTail.at_end(self.output_dir / METRICS_FILE)
        self._completions = JsonlTail.at_end(self.output_dir / COMPLETIONS_FILE)
        self._live: Live | None = None
        self._processes: list[ProcessInfo] = []
        self.outcome: str | None = None
        self.eval: dict[str, Any] | None = None  # the newest eval round record
        self._outage_kind: str | None = None  # the server_status line printed last, digits masked
        self._outage_printed_at = 0.0
        self._outage_since: float | None = None  # when the outage now shown was first seen (monotonic s)
        self._server_back_at: float | None = None  # when an outage last cleared while the run went on (unix s)
        self._waiting_since: float | None = None  # first status seen before any logged step (monotonic)
        self._waiting_printed_at = 0.0
        self._waiting_from_step = 0  # status.json's step when the waiting began (a resumed run's start step)
        self._worker_silent_printed_at: float | None = None  # the last "rollout worker not answering" line
        self._stopping = False  # the supervisor is stopping the run (`begin_stop`)
        self._stop_state: str | None = None  # the state line while it does

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the rich live panel (rich mode); nothing for the other modes."""
        if self.mode == "rich" and self._live is None:
            self._live = Live(self.renderable(), console=self.console, auto_refresh=False,
                              refresh_per_second=self.refresh_per_second, redirect_stdout=True,
                              redirect_stderr=True)
            self._live.start(refresh=True)

    def stop(self) -> None:
        """Draw the last frame and stop the live panel."""
        if self._live is not None:
            self._live.update(self.renderable(), refresh=True)
            self._live.stop()
            self._live = None

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ reading and drawing
    def view(self) -> DashboardView:
        """The current frame's data."""
        return DashboardView(status=self.status, history=self.history, diagnosis=self.diagnosis,
                             processes=list(self._processes), settings=self.settings, started_at=self.started_at,
                             now=time.time(), title=self.title, outcome=self.outcome or self._stop_state,
                             eval=self.eval, server_back_at=self._server_back_at)

    def renderable(self):
        """The rich renderable of the current frame, `LIVE_MARGIN` columns narrower than the console: the
        terminal echoes Ctrl-C as ``^C`` after the frame's last line, and on a frame as wide as the terminal
        that wraps, so the live display's redraw misses its top line (a stale border above the messages)."""
        from rich.constrain import Constrain

        width, height = self.console.size
        inner = max(20, width - LIVE_MARGIN)
        return Constrain(render_dashboard(self.view(), width=inner, height=height), inner)

    def poll(self, processes: Sequence[ProcessInfo] | None = None) -> list[dict[str, Any]]:
        """Read what the trainer wrote since the last call and draw it.

        Args:
            processes: the supervisor's process table (kept from the previous call when None).

        Returns:
            The new metrics windows (oldest first).
        """
        if processes is not None:
            self._processes = list(processes)
        status = read_status(self.output_dir / STATUS_FILE, not_before=self.started_at - 1.0)
        if status is not None:
            self.status = status
            self._print_server_status(status)
            self._print_worker_status(status)
            self._print_waiting(status)
        new = []
        for row in self._metrics.read_new():
            if "event" in row:  # a marker such as {"event": "resume", "step": N, "from": ...}, not a window
                self._print_event(row)
                continue
            new.append(row)
            self.history.push(row)
            self.rows.append(row)
            self.diagnosis = steady_diagnosis(self.history, self.settings)
            if self.mode == "plain":  # a finding said in full once, then by its words (`PlainRepeats`)
                step = num(row, "step")
                shown = self._repeats.text(self.diagnosis, None if step is None else int(step))
                carried = dataclasses.replace(self.diagnosis, text=shown) if shown is not None else None
                self.console.print(plain_line(row, carried, num(self.status, "max_steps")),
                                   markup=False, highlight=False, soft_wrap=True)
        if self.log_completions:
            self._print_completions(self._completions.read_new())
        if self._live is not None:
            self._live.update(self.renderable(), refresh=True)
        return new

    def finish(self, outcome: str, processes: Sequence[ProcessInfo] | None = None) -> None:
        """The run has ended with ``outcome`` (``finished``, ``stopped``, ``failed``): read the last
        files and draw the final frame, which shows the outcome, no ETA, and the processes still running
        as being stopped (the supervisor stops them next)."""
        self.outcome = outcome
        self.poll(processes)

    def begin_stop(self, why: str = "") -> None:
        """The supervisor is stopping the run (a signal, a dead server) and has said why: the trainer's outage
        line (``server unreachable, retrying (1800 s left)``) no longer describes what happens, so plain mode
        prints it no more (second fresh-user trial: it followed "the server was killed: stopping the trainer").
        The state reads ``stopping: <why>`` until the outcome: the trainer's own ``stopped`` in status.json read
        as the run's end for a few frames before ``failed`` (twenty-third session's trial)."""
        self._stopping = True
        self._stop_state = f"stopping: {why}" if why else "stopping"

    def _print_server_status(self, status: dict[str, Any]) -> None:
        """Plain mode: the trainer's ``server_status`` line (an outage, a silent server, a re-push) when it
        appears or changes kind, then every `SERVER_STATUS_EVERY_S` s while it lasts (not every second: the
        count-down changes each time), and a line when it clears while the run goes on, with its seconds
        (``answering again after N s``: from the last answer of a silent server, ``server_silent_s``, as
        trainer.log counts; from the first report of an unreachable one, which comes within a retry)."""
        import re

        line = status.get("server_status")
        kind = re.sub(r"\d+", "N", str(line)) if line else None
        now = time.monotonic()
        if line:  # a silence is reported 15-20 s in: count from the last answer (``server_silent_s``)
            silent = num(status, "server_silent_s") or 0.0
            self._outage_since = min(now if self._outage_since is None else self._outage_since, now - silent)
        if self._stopping:
            self._outage_kind = kind
            return
        if self.mode == "plain" and line and (kind != self._outage_kind or
                                              now - self._outage_printed_at >= SERVER_STATUS_EVERY_S):
            self.console.print(str(line), markup=False, highlight=False, soft_wrap=True)
            self._outage_printed_at = now
        elif not line and self._outage_kind and not str(status.get("state", "")).startswith(
                ("finished", "stopped", "failed")):  # it cleared while the run goes on (running, or saving)
            self._server_back_at = time.time()  # the panels show it for a while (`SERVER_BACK_SHOW_S`)
            if self.mode == "plain":
                lasted = now - (self._outage_since if self._outage_since is not None else now)
                self.console.print(f"sampler server: answering again after {lasted:.0f} s", markup=False,
                                   highlight=False, soft_wrap=True)
        if line:
            self._server_back_at = None
        else:
            self._outage_since = None
        self._outage_kind = kind

    def _print_worker_status(self, status: dict[str, Any]) -> None:
        """Plain mode: a line once the rollout worker's heartbeat (``worker_heartbeat_age_s``) is
        `WORKER_SILENT_AFTER_S` s old, again every `SERVER_STATUS_EVERY_S` s while it lasts, and one when it beats
        again while the run goes on; the trainer stops the run at ``staleness.rollout_worker_timeout`` (before, a
        stopped worker left the console silent until then: 5 minutes by default)."""
        if self.mode != "plain":
            return
        age = num(status, "worker_heartbeat_age_s")
        # A stop ends generation (`RolloutWorker.begin_stop`): a silent worker is then expected, not news
        ended = str(status.get("state", "")).startswith(("finished", "stopped", "failed")) or bool(status.get("stopping"))
        now = time.monotonic()
        if age is not None and age >= WORKER_SILENT_AFTER_S and not ended:
            if self._worker_silent_printed_at is None or now - self._worker_silent_printed_at >= SERVER_STATUS_EVERY_S:
                timeout = self.settings.rollout_worker_timeout
                pid = status.get("worker_pid")
                cont = f"; if stopped, kill -CONT {pid} continues it" if pid else ""
                self.console.print(
                    f"rollout worker not answering: no heartbeat{f' from the worker (pid {pid})' if pid else ''} for "
                    f"{age:.0f} s (hung, stopped, or blocked by a slow reward function{cont}); the run stops with a "
                    f"checkpoint at staleness.rollout_worker_timeout={timeout:g} s ({max(0.0, timeout - age):.0f} s "
                    "left)", markup=False, highlight=False, soft_wrap=True)
                self._worker_silent_printed_at = now
        elif self._worker_silent_printed_at is not None:
            self._worker_silent_printed_at = None
            if not ended:
                self.console.print("rollout worker: answering again", markup=False, highlight=False, soft_wrap=True)

    def _print_waiting(self, status: dict[str, Any]) -> None:
        """Plain mode, before the first logged step of this run: every `WAITING_EVERY_S` s of the trainer's
        running state, what generation has done so far (rollouts in flight, finished, queue, consecutive groups
        dropped without reward spread), so a slow first
        step (a cold server, a stalled worker) is not a silent minute. The seconds count from the first
        ``running`` status seen (training, not the trainer's start-up); once status.json's step has moved past
        the one it waited from, that step's line is on its way (``metrics.jsonl`` may trail status.json by a
        poll) and nothing more is printed."""
        if self.mode != "plain" or self.rows or status.get("state") != "running":
            return
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = self._waiting_printed_at = now
            self._waiting_from_step = int(status.get("step") or 0)
            return
        if int(status.get("step") or 0) > self._waiting_from_step or now - self._waiting_printed_at < WAITING_EVERY_S:
            return
        self._waiting_printed_at = now
        parts = [f"{int(status.get('concurrency') or 0)} rollouts in flight"]
        if status.get("rollouts_finished") is not None:
            parts.append(f"{int(status['rollouts_finished'])} finished")
        if status.get("queue_size") is not None:
            parts.append(f"queue {int(status['queue_size'])}")
        dropped = int(status.get("groups_without_signal") or 0)
        if dropped:  # why finished rollouts are not in the queue: their groups had no reward spread (SPEC §3.2)
            limit = int(status.get("max_groups_without_signal") or 0)
            parts.append(f"the last {dropped} group(s) dropped without reward spread"
                         + (f" (the run stops at {limit}: rollout.max_groups_without_signal)" if limit else ""))
        self.console.print(f"waiting for step {self._waiting_from_step + 1} ({now - self._waiting_since:.0f} s "
                           f"since training started): {', '.join(parts)}", markup=False, highlight=False,
                           soft_wrap=True)

    def _print_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "eval":  # one eval round (README "Evaluation"): the rewards panel shows it
            self.eval = event
            if self.mode == "plain":
                from .panels import eval_rows

                label, value = eval_rows(event)[0]
                self.console.print(f"{label} | eval reward {value}", markup=False, highlight=False, soft_wrap=True)
            return
        if event.get("event") == "resume" and self.mode != "off":
            self.console.print(f"resumed at step {event.get('step')} from {event.get('from')}", markup=False,
                               highlight=False, soft_wrap=True)
        if event.get("event") == "weight_sync_check" and self.mode != "off":  # sampler.check_weight_sync
            self.console.print(str(event.get("message")), markup=False, highlight=False, soft_wrap=True,
                               style="green" if event.get("status") == "pass" else "yellow")
        if event.get("event") == "weight_sync_check_started" and self.mode != "off":
            self.console.print(str(event.get("message")), markup=False, highlight=False, soft_wrap=True)

    def _print_completions(self, records: list[dict[str, Any]]) -> None:
        by_step: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for rec in records:
            by_step[rec.get("step")].append(rec)
        for _, recs in by_step.items():
            if self.mode == "plain":  # a log file: one line per record, not a table squeezed to 80 columns
                for line in completion_lines(recs, self.num_completions_to_print):
                    self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                self.console.print(completions_table(recs, self.num_completions_to_print))

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Print a message above the live panel (or plainly: one line per message, not wrapped at 80 columns)."""
        if self.mode == "plain":
            kwargs.setdefault("soft_wrap", True)
        self.console.print(*objects, **kwargs)

    @property
    def last_diagnosis(self) -> Diagnosis:
        """The diagnosis of the newest window."""
        return self.diagnosis
