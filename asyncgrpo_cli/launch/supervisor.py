"""`asyncgrpo train`: the supervisor of the main job (DESIGN.md §1–2).

It prints the launch plan, then starts, in order:

1. the sampler (after `launch.mps`'s daemon): vLLM or the embedded server with the ONE builder's command
   (`server.command.build_server_command`); nothing for ``sampler.backend=external``. Before the
   model is loaded, `check_server_port` refuses a ``sampler.port`` another process holds, or where a
   server this job did not start already answers (use it with ``sampler.backend=external``);
2. waits until ``/health`` answers (deadline ``sampler.timeout``; a server that dies meanwhile stops
   the run with its last log lines);
3. runs the doctor checks (`server.checks.read_facts` + `evaluate`): any failure prints the table and
   the restart command and stops everything;
4. launches the trainer with ``accelerate launch`` (`launch.plan`), which spawns the rollout worker;
5. shows the live dashboard (`asyncgrpo_cli.dashboard`) until the trainer exits, then prints a summary
   and writes ``<output_dir>/training_curves.png``.

Children run in their own sessions (``start_new_session=True``), so each is the leader of a process
group holding what it spawns (accelerate's single-process trainer, the rollout worker). torchrun puts
each rank in a session of its own (and forwards signals to them itself), so the supervisor also keeps
track of every descendant it sees (psutil, polled every loop and before each signal). Stopping a child
signals its whole group; a final sweep SIGKILLs every group and every tracked descendant still there,
so no orphan survives. Logs go to ``<output_dir>/logs/{server,trainer}.log``.

One job per ``trainer.output_dir``: the supervisor takes ``<output_dir>/.asyncgrpo.lock`` before anything
starts (the trainer it launches shares it) and refuses an unwritable folder or an incomplete checkpoint to
resume from (exit 2). ``status.json`` always ends in a final state (``finished``, ``stopped``, ``failed: ...``).

SIGINT / SIGTERM: SIGINT goes to the trainer ranks first, the launcher's direct children, not to the
launcher (accelerate >= 1.16 answers a signal by terminating its tree and SIGKILLing it 5 s later, which
would cut the save; `Child.signal_ranks`): each saves a checkpoint of its last completed step. The supervisor
waits up to ``launch.stop_timeout`` s (default: the trainer's last step time + 3 × its last save time + 30 s,
or ``Timeouts.trainer_grace_s`` before the first save) for the launcher and the ranks, then sends SIGTERM to
the group, then SIGKILL; the server is stopped afterwards. A second signal skips the waits. The launcher gets
no parent-death signal for the same reason: the ranks follow the supervisor's pid themselves. Exit status: 0 when the trainer finished, 1 on a failure (with the
failing component's cause and last log lines), 2 on a configuration refusal (a config error, a plan
that cannot run here, a server the doctor refuses), 130 / 143 after SIGINT / SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..config.compose import server_url, to_yaml
from ..config.rules import ConfigError
from ..run.stop_reason import clear_stop_reason, read_stop_reason, write_stop_reason
from ..run.folder import earlier_checkpoints_note, resume_command, start_problem, train_command
from .plan import (LaunchPlan, accelerate_config_yaml, build_launch_plan, dry_run_resolved,  # noqa: F401
                   output_dir_of, resolved_config, run_size)
from .job_files import (exit_text, finalize_status, newest_checkpoint, server_death_cause, stop_grace,
                        write_summary_file)
from .mps import STOPPED_BEFORE_READY, keeper_argv, probe_argv, start_daemon, stop_daemon, without_mps
from .child import Child  # noqa: F401 - re-exported
from .log_tail import (cause_said_once, failure_cause, killed_by, launcher_reported_status, note_own_error_exit,
                       note_requested_stop, tail_lines, without_tracebacks)
from .preflight import (RUN_FOLDER_IN_USE, check_server_port, dry_run_refusals, folder_or_port_refusal,  # noqa: F401
                        free_port, health_refused, port_in_use, probe_health)
from ..server.command import server_exec_argv  # noqa: F401 - re-exported (cli serve)

REFUSED_BOUND_S = 20.0  # sampler.backend=external: how long a refused connection (nothing listens) is retried
READY_REPORT_S = 15.0  # a plain "still loading" line this often while the server loads (no terminal)
_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?(INFO|WARNING|DEBUG|ERROR)?\s*(\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?)?\s*"
                         r"(\[[^\]]*\]\s*)?")
PLOT_NAME = "training_curves.png"
FAILURE_LINES = 12  # log lines shown under a failure (tracebacks cut to their exception line)

#: ``_commands`` hook: (component name "server" / "trainer", argv) -> the argv actually started.
CommandHook = Callable[[str, list[str]], list[str]]


@dataclass
class Timeouts:
    """Seconds the supervisor waits at each stage.

    Attributes:
        trainer_grace_s: after SIGINT, for the trainer to save a checkpoint and exit.
        trainer_term_s: after SIGTERM, before SIGKILL (trainer).
        server_term_s: after SIGTERM, before SIGKILL (server).
        group_term_s: for the rest of a process group after its leader exited, before SIGKILL.
        poll_s: main-loop period (the dashboard redraws at every poll: at least once a second).
        health_probe_s: timeout of one ``/health`` request.
        doctor_s: timeout of each doctor request.
    """

    trainer_grace_s: float = 120.0
    trainer_term_s: float = 30.0
    server_term_s: float = 30.0
    group_term_s: float = 5.0
    poll_s: float = 0.5
    health_probe_s: float = 2.0
    doctor_s: float = 10.0


# ------------------------------------------------------------------------------------------ printing
def print_plan(console: Console, cfg: DictConfig, plan: LaunchPlan, *, resolved: bool,
               failed_keys: frozenset[str] = frozenset()) -> None:
    """Print the launch plan: output folder, GPU split, model, sampler, both commands, accelerate setup,
    notes and problems. One line per item, never wrapped by rich, so commands stay copy-pasteable.
    ``failed_keys``: config keys whose checks failed (``model.name``: the model row is marked failed)."""
    rows: list[tuple[str, str, str]] = [("output dir", f"{plan.output_dir}  (logs: {plan.logs_dir})", ""),
                                        ("GPUs", plan.gpus.describe(), "")]
    model = str(cfg.model.name)
    if not resolved and cfg.model.gguf_file:
        model += f"  (GGUF {cfg.model.gguf_file}: exported once to a safetensors folder at start; server and " \
                 "trainer load that folder)"
    failed = "model.name" in failed_keys or "model.gguf_file" in failed_keys
    rows.append(("model", model + ("  FAILED: its check failed (the problem below)" if failed else ""),
                 "bold red" if failed else ""))
    rows.append(("run", run_size(cfg), ""))
    backend = getattr(cfg.sampler.backend, "value", cfg.sampler.backend)
    rows.append(("sampler", f"{backend} at {plan.url}", ""))
    rows.append(("server", f"$ {plan.server.shell_line()}" if plan.server else plan.server_reason, ""))
    rows += [("", f"# {note}", "dim") for note in (plan.server.notes if plan.server else [])]
    rows.append(("trainer", f"$ {plan.trainer_shell_line()}", ""))
    acc = plan.accelerate
    kind = "FSDP2" if acc.get("distributed_type") == "FSDP" else "single process"
    rows.append(("accelerate", f"{kind}, {acc['num_processes']} process(es) on {acc['num_machines']} machine(s), "
                 f"mixed_precision={acc['mixed_precision']}, {'CPU' if acc.get('use_cpu') else 'GPU'}; config: "
                 f"{plan.accelerate_config_path}", ""))
    rows += [("note", note, "yellow") for note in [*plan.gpus.notes, *plan.gpus.unused]]
    rows += [("problem", problem, "bold red") for problem in plan.problems]
    console.print(Text("asyncgrpo train: launch plan", style="bold cyan"))
    for label, value, style in rows:
        console.print(Text.assemble((f"{label:<11}", "bold"), (value, style)), soft_wrap=True)


# ---------------------------------------------------------------------------------------- supervisor
class Supervisor:
    """Runs one `asyncgrpo train` job for a resolved config and its launch plan (see the module docstring).

    Args:
        cfg: the resolved config (`resolved_config`).
        plan: its `LaunchPlan`.
        console: where messages, the dashboard and the summary go.
        timeouts: waiting times.
        commands: optional hook rewriting each started argv (tests put stand-in programs there).
    """

    def __init__(self, cfg: DictConfig, plan: LaunchPlan, console: Console, timeouts: Timeouts | None = None,
                 commands: CommandHook | None = None) -> None:
        self.cfg, self.plan, self.console = cfg, plan, console
        self.timeouts = timeouts or Timeouts()
        self.commands = commands
        self.server: Child | None = None
        self.trainer: Child | None = None
        self.mps: Child | None = None  # the CUDA MPS daemon (launch.mps)
        self._mps_gone_said = False
        self.dashboard = None
        self.started = time.time()
        self._stop = threading.Event()
        self._escalate = threading.Event()
        self._signals: list[int] = []
        self._failures: list[tuple[str, list[str], str, str | None]] = []  # (message, log lines, log path, cause)
        self._monitoring = False
        self._trainer_paused: int | None = None  # the stopped trainer process last reported (_say_trainer_stopped)
        self._escalated_said = False
        self.lock = None
        self._checkpoints_before: str | None = None

    # -------------------------------------------------------------- signals
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals.append(signum)
        if len(self._signals) > 1:
            self._escalate.set()
        self._stop.set()

    def _install_signals(self) -> dict[int, Any]:
        old: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return old
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _interrupted_rc(self) -> int:
        return 143 if self._signals and self._signals[0] == signal.SIGTERM else 130

    # -------------------------------------------------------------- failures
    def _fail(self, message: str, child: Child | None = None, cause: str | None = None) -> int:
        """Record a failure to print at the end; ``cause``: the cause line when the child's log has none."""
        lines = child.tail() if child is not None else []
        self._failures.append((message, lines, str(child.log_path) if child else "", cause))
        return 1

    def _print_failures(self) -> None:
        """Each failure: the error, its cause in one line (the child's own ``error:`` line or its last
        exception, else what the supervisor knows: a signal from outside), then the log's last lines with
        every traceback cut to its exception line."""
        for message, lines, path, known in self._failures:
            self.console.print(Text(f"error: {message}", style="bold red"), soft_wrap=True)
            cause = failure_cause(lines) or known
            if cause:
                self.console.print(Text(f"cause: {cause}", style="red"), soft_wrap=True)
            short = cause_said_once(without_tracebacks(lines)[-FAILURE_LINES:], cause)  # the cause: once, above
            if short:
                self.console.print(Text(f"last lines of {path} (tracebacks: see the file):", style="red"),
                                   soft_wrap=True)
                self.console.print(Text("\n".join(short)), soft_wrap=True, markup=False, highlight=False)

    # -------------------------------------------------------------- stages
    def run(self) -> int:
        """Run the job; returns the exit status. Every child is gone when it returns."""
        old = self._install_signals()
        try:
            rc = self._run()
        except KeyboardInterrupt:
            rc = 130
        finally:
            # Normally everything is stopped already; after an early failure the server still runs.
            self._stop_child(self.trainer, signal.SIGTERM, self.timeouts.trainer_term_s)
            self._stop_child(self.server, signal.SIGTERM, self.timeouts.server_term_s)
            self._stop_all()
            if self.plan.mps is not None and self.mps is not None:  # after its clients: `quit` waits for them
                self.console.print(stop_daemon(self.plan.mps, self.mps, self._argv("mps-quit", [self.plan.mps.control]),
                                               clients_expected=2 if self.trainer else 1 if self.server else 0),
                                   soft_wrap=True, markup=False, highlight=False)
            for sig, handler in old.items():
                signal.signal(sig, handler)
            if self.trainer is not None:
                finalize_status(self.plan.output_dir, rc, self._failures[0][0] if self._failures else None)
            if self.lock is not None:
                self.lock.release()
        self._print_failures()
        newest = self._newest_checkpoint() if self.lock is not None and rc not in (0, 2) else None
        write_summary_file(self.plan.output_dir, [f"  {w}: {t}" for m, lines, _, known in self._failures for w, t in (
            ("error", m), ("cause", failure_cause(lines) or known)) if t] + (
            [f"  resume with: {resume_command(newest)}"] if newest else []), append=True)
        if newest:  # every stop and failure path that left a complete checkpoint
            self.console.print(Text(f"resume with: {resume_command(newest)}", style="cyan"), soft_wrap=True)
        elif self.trainer is not None and rc not in (0, 2) and (again := train_command([])):
            self.console.print("no checkpoint to resume from; the same command starts again in this folder:")
            self.console.print(Text(f"start again with: {again}", style="cyan"), soft_wrap=True)
        return rc

    def _argv(self, name: str, argv: list[str]) -> list[str]:
        return list(self.commands(name, list(argv))) if self.commands else list(argv)

    def _claim_output_dir(self) -> int | None:
        """Refuse an unwritable ``trainer.output_dir``, another job in it, or a checkpoint to resume from that
        is incomplete, before anything starts; take the run lock (released when the job ends)."""
        from ..run.state import RunLock, RunLockedError

        out = self.plan.output_dir
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock = RunLock(out)
            if self.plan.gpus.machine_rank == 0:  # other machines of a multi-node job share machine 0's lock
                lock.acquire()
        except RunLockedError as exc:  # taken since `folder_or_port_refusal` looked: not a config error either
            return self._refuse(f"trainer.output_dir={out}: {exc}", RUN_FOLDER_IN_USE)
        except OSError as exc:
            return self._refuse(f"trainer.output_dir={out} is not writable ({type(exc).__name__}: {exc}). "
                                "Fix: choose a writable folder with trainer.output_dir=...")
        self.lock = lock
        clear_stop_reason(out)
        problem = start_problem(self.cfg.trainer, out)
        if problem:
            return self._refuse(problem)
        self._checkpoints_before = self._newest_checkpoint()
        return None

    def _refuse(self, message: str, label: str = "error") -> int:
        self.console.print(Text(f"{label}: {message}", style="bold red"), soft_wrap=True)
        return 2

    def _newest_checkpoint(self) -> str | None:
        return newest_checkpoint(self.plan.output_dir)

    def _stop_grace(self) -> float:
        """`job_files.stop_grace` of ``launch.stop_timeout`` and the trainer's measured times."""
        return stop_grace(self.cfg.launch.get("stop_timeout"), self.plan.output_dir, self.timeouts.trainer_grace_s)

    def _run(self) -> int:
        plan, cfg = self.plan, self.cfg
        refused = self._claim_output_dir()
        if refused is not None:
            return refused
        plan.logs_dir.mkdir(parents=True, exist_ok=True)
        plan.config_path.write_text(to_yaml(cfg))
        plan.accelerate_config_path.write_text(accelerate_config_yaml(plan.accelerate))
        self._make_dashboard()
        self.console.print(f"this job: pid {os.getpid()} (Ctrl-C or `kill -INT {os.getpid()}` saves a checkpoint and "
                           "stops; a second signal stops at once)", markup=False, highlight=False, soft_wrap=True)
        if plan.mps is not None:
            self.mps, problem = start_daemon(plan.mps, plan.logs_dir / "mps.log",
                                             self._argv("mps", keeper_argv(plan.mps, self._stop_grace())), self._stop,
                                             probe=self._argv("mps-probe", probe_argv()))
            if problem == STOPPED_BEFORE_READY:
                return self._interrupted_rc()
            if problem and not plan.mps.automatic:
                return self._fail(f"launch.mps=true: {problem} (fix: launch.mps=false runs without it)", self.mps)
            if problem:  # chosen automatically: the job runs without it, as it would have without the choice
                self.console.print(without_mps(plan, self.mps, problem, self._argv("mps-quit", [plan.mps.control])),
                                   markup=False, highlight=False, soft_wrap=True)
                self.mps = None
            else:
                self.console.print(f"started CUDA MPS (pid {self.mps.pid}); log: {self.mps.log_path}", markup=False,
                                   highlight=False, soft_wrap=True)
        if plan.server is not None:
            try:
                argv = self._argv("server", server_exec_argv(plan.server))
            except ConfigError as exc:
                self._fail(str(exc))
                return 2
            self.server = Child("server", argv, {**plan.server.env, "PYTHONUNBUFFERED": "1"},
                                plan.logs_dir / "server.log").start()
            self.console.print(f"started the server (pid {self.server.pid}); log: {self.server.log_path}",
                               markup=False, highlight=False, soft_wrap=True)
        else:
            self.console.print(plan.server_reason, markup=False, highlight=False, soft_wrap=True)
        if plan.server is not None or plan.gpus.machine_rank == 0:
            rc = self._wait_ready()
            if rc is not None:
                return rc
            rc = self._doctor()
            if rc is not None:
                return rc
        if self._stop.is_set():
            return self._interrupted_rc()
        import json

        from ..run.folder import TRAIN_ARGV_ENV
        from ..run.state import LOCK_OWNER_ENV, SERVER_PID_ENV

        self.trainer = Child("trainer", self._argv("trainer", plan.trainer_argv),
                             {**plan.trainer_env, LOCK_OWNER_ENV: str(os.getpid()),
                              TRAIN_ARGV_ENV: json.dumps(sys.argv),
                              # the server's pid for the trainer's "not answering" line; "" for an external server
                              # (it replaces a value this process may have inherited)
                              SERVER_PID_ENV: str(self.server.pid) if self.server is not None else ""},
                             plan.logs_dir / "trainer.log", death_signal=False).start()
        # The pid is accelerate's launcher, the head of the trainer's process group; status.json's "pid" is the
        # training process it starts (fresh-user trial, eleventh session: two "trainer pids").
        self.console.print(f"started the trainer (pid {self.trainer.pid}, its launcher; status.json names the "
                           f"training process); log: {self.trainer.log_path}", markup=False, highlight=False,
                           soft_wrap=True)
        outcome, rc = self._monitor()
        self._stop_child(self.trainer, signal.SIGTERM, self.timeouts.group_term_s)  # leftovers of its group
        self._stop_child(self.server, signal.SIGTERM, self.timeouts.server_term_s)
        self._finish(outcome)
        return rc

    def _make_dashboard(self) -> None:
        from ..dashboard import Dashboard
        from ..dashboard.diagnosis import RunSettings

        log = self.cfg.logging
        self.dashboard = Dashboard(self.plan.output_dir, mode=log.dashboard, console=self.console,
                                   settings=RunSettings.from_config(self.cfg),
                                   log_completions=bool(log.log_completions),
                                   num_completions_to_print=log.num_completions_to_print, started_at=self.started,
                                   refresh_per_second=max(1.0, 1.0 / self.timeouts.poll_s))

    def _wait_ready(self) -> int | None:
        """Wait for ``/health``, showing what the server is doing (the last line of its log) meanwhile:
        a spinner with the elapsed time on a terminal, a plain line every `READY_REPORT_S` seconds
        otherwise. vLLM takes 70–110 s to load a small model on an H200 (import, weights, profiling,
        KV-cache allocation)."""
        url, timeout = self.plan.url, float(self.cfg.sampler.timeout)
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        vllm = self.server is not None and "vllm" in " ".join(self.server.argv[:3])
        what = "vLLM" if vllm else "the sampler"
        typical = " (vLLM usually needs 1-2 minutes to load)" if vllm else ""
        self.console.print(f"waiting for {what} at {url}/health{typical}; sampler.timeout={timeout:g} s",
                           markup=False, highlight=False, soft_wrap=True)
        terminal, last_report = self.console.is_terminal, t0
        refused_since: float | None = None
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console,
                      transient=True, disable=not terminal) as progress:
            task = progress.add_task(f"waiting for {what} at {url}", total=None)
            while True:
                if self._stop.is_set():
                    return self._interrupted_rc()
                if self.server is not None and self.server.poll() is not None:
                    return self._fail(f"{'vLLM' if vllm else 'the server'} exited with code {self.server.poll()} "
                                      "before it was ready", self.server)
                remaining = deadline - time.monotonic()
                if probe_health(url, max(0.1, min(self.timeouts.health_probe_s, remaining))):
                    break
                if self.server is None:  # external: a refused connection is not a server that loads
                    refused_since = self._refused_since(url, refused_since)
                    if refused_since is not None and time.monotonic() - refused_since >= REFUSED_BOUND_S:
                        return self._refuse_unreachable(url, time.monotonic() - t0)
                if time.monotonic() >= deadline:
                    hint = ("check the server log below" if self.server is not None else
                            "start it (asyncgrpo serve with the same overrides) or fix sampler.url")
                    return self._fail(f"no answer from {url}/health after {timeout:g} s (sampler.timeout). Fix: "
                                      f"{hint}, or raise sampler.timeout", self.server)
                if self.server is not None:
                    self.server.track()  # vLLM's engine-core children, for the final sweep
                status = self._server_status_line()
                progress.update(task, description=f"waiting for {what}" + (f": {status}" if status else ""))
                if not terminal and time.monotonic() - last_report >= READY_REPORT_S:
                    last_report = time.monotonic()
                    doing = f"connection refused at {url}" if refused_since is not None else "still loading"
                    self.console.print(f"  {doing} ({last_report - t0:.0f} s)" + (f": {status}" if status else ""),
                                       markup=False, highlight=False, soft_wrap=True)
                self._stop.wait(min(self.timeouts.poll_s, max(0.0, deadline - time.monotonic())))
        self.console.print(Text(f"{what} is ready at {url} ({time.monotonic() - t0:.1f} s)", style="green"))
        return None

    def _refused_since(self, url: str, since: float | None) -> float | None:
        """When the refusals at ``url`` began (kept while they go on), None once the port accepts connections."""
        if not health_refused(url, self.timeouts.health_probe_s):
            return None
        return since if since is not None else time.monotonic()

    def _refuse_unreachable(self, url: str, waited: float) -> int:
        """sampler.backend=external and nothing listens at ``url``: exit 2 with how to start the server."""
        self._fail(f"connection refused at {url}: no server listens there (sampler.backend=external starts none; "
                   f"retried {waited:.0f} s). Fix: start it in another shell with `asyncgrpo serve` and the same "
                   "model/sampler/rollout overrides (it prints the command it runs), then run this again; or fix "
                   "sampler.url")
        return 2

    def _server_status_line(self, width: int = 110) -> str:
        """The server log's last non-empty line, without vLLM's ``(APIServer pid=N) INFO 12-01 10:00:00
        [file.py:12]`` prefix, cut to ``width`` characters ('' without a server)."""
        if self.server is None:
            return ""
        for line in reversed(tail_lines(self.server.log_path, 5)):
            line = _LOG_PREFIX.sub("", line.strip())
            if line and not line.startswith("$ "):  # not the command line the supervisor wrote first
                return line if len(line) <= width else line[: width - 1] + "…"
        return ""

    def _doctor(self) -> int | None:
        from ..server.checks import FAIL, PASS, WARN, evaluate, read_facts, restart_command

        try:
            facts = read_facts(self.plan.url, timeout=min(self.timeouts.doctor_s, float(self.cfg.sampler.timeout)))
        except Exception as exc:  # e.g. a /metrics page that is not Prometheus text
            return self._fail(f"doctor could not read the server at {self.plan.url}: {exc}", self.server)
        started_vllm = self.plan.server is not None and "vllm" in " ".join(self.plan.server.argv[:3])
        colocated = True if self.plan.gpus.colocated else (False if started_vllm else None)
        cfg = self.cfg
        checks = evaluate(facts, colocated=colocated, model=cfg.model, rollout=cfg.rollout, sampler=cfg.sampler,
                          staleness=cfg.staleness, trainer=cfg.trainer, peft=cfg.peft, launch=cfg.launch)
        failed = [c for c in checks if c.status == FAIL]
        if failed:
            table = Table("check", "status", "detail", "fix", title=f"doctor: {facts.url}")
            for column in table.columns:  # wrap a fix on a narrow console, never cut it
                column.overflow = "fold"
            style = {PASS: "green", WARN: "yellow", FAIL: "bold red"}
            for c in checks:
                table.add_row(c.name, Text(c.status, style=style.get(c.status, "")), c.message, c.fix)
            self.console.print(table)
            restart = restart_command(self.cfg, facts)
            self.console.print(Text("The server does not match the config. Restart it with:", style="bold"))
            self.console.print(Text(restart.shell_line()), soft_wrap=True)
            self._fail(f"doctor: {len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")
            return 2  # the server does not match the config: a configuration refusal
        for c in checks:
            if c.status == WARN:
                self.console.print(Text.assemble(("doctor warning ", "yellow"), f"{c.name}: {c.message}",
                                                 f" (fix: {c.fix})" if c.fix else ""), soft_wrap=True)
        skipped = [c.name for c in checks if c.status not in (PASS, WARN, FAIL)]
        self.console.print(Text(f"doctor: {sum(c.status == PASS for c in checks)} checks passed, "
                                f"{sum(c.status == WARN for c in checks)} warning(s)"
                                + (f", not applicable here: {', '.join(skipped)}" if skipped else ""), style="green"))
        return None

    def _processes(self):
        from ..dashboard import ProcessInfo

        table = []
        if self.server is not None:
            stopped, src = self.server.stopped(), self.server.poll()
            table.append(ProcessInfo("server", self.server.pid, src is None,
                                     f"{self.plan.url}{f', {exit_text(src)}' if src is not None else ''}  log: logs/server.log" + (
                                         f"  (SIGSTOP or Ctrl-Z: kill -CONT -- -{self.server.pid} continues its process group)"
                                         if stopped else ""), stopped=stopped, exit_code=src))
        else:
            table.append(ProcessInfo("server", None, None, self.plan.url))
        if self.trainer is not None:
            n = self.plan.accelerate.get("num_processes", 1)
            rc = self.trainer.poll()
            paused = self.trainer.stopped_pid() if rc is None else None
            own = launcher_reported_status(self.trainer.log_path) if rc else None  # accelerate exits 1 for any
            table.append(ProcessInfo("trainer", self.trainer.pid, rc is None,
                                     f"{n} process(es)" + (f", exit code {rc}" if rc is not None else "")
                                     + (f" (the trainer's {own})" if own is not None else "")
                                     + "  log: logs/trainer.log" + (
                                         f"  (pid {paused} stopped by SIGSTOP or Ctrl-Z: kill -CONT {paused} "
                                         "continues it)" if paused is not None else ""), stopped=paused is not None))
        return table

    def _say_trainer_stopped(self, dash) -> None:
        """A line when a trainer process (launcher or rank) stops (SIGSTOP, Ctrl-Z), one when it runs again."""
        paused = self.trainer.stopped_pid() if self.trainer is not None else None
        if paused is not None and self._trainer_paused is None:  # the launcher: its rank runs until its relay fills
            who, then = (("'s launcher", "the trainer goes on a while, but the run cannot end")
                         if paused == self.trainer.pid else (" process", "training waits"))
            dash.print(Text(f"the trainer{who} {paused} is stopped (SIGSTOP or Ctrl-Z): {then} until "
                            f"`kill -CONT {paused}` continues it", style="red"))
        elif paused is None and self._trainer_paused is not None:
            dash.print(Text(f"the trainer process {self._trainer_paused} runs again", style="green"))
        self._trainer_paused = paused

    def _monitor(self) -> tuple[str, int]:
        """Follow the run until the trainer exits, a signal arrives or the server dies."""
        dash = self.dashboard
        trainer = self.trainer
        assert trainer is not None and dash is not None
        dash.start()
        self._monitoring = True
        try:
            while True:
                if self.mps is not None and self.mps.poll() is not None and not self._mps_gone_said:
                    self._mps_gone_said = True  # said once: the run goes on while its MPS server serves both
                    dash.print(Text(f"the CUDA MPS control daemon (pid {self.mps.pid}) {exit_text(self.mps.poll())} "
                                    f"during the run (its log: {self.mps.log_path}): a failure of vLLM or the trainer "
                                    "that follows may come from it", style="red"))
                rc = trainer.poll()
                if rc is not None:
                    if rc == 0:
                        outcome, status = "finished", 0
                    else:
                        sig = killed_by(trainer.log_path)
                        how = f"was killed by {sig}" if sig else exit_text(rc)
                        note_own_error_exit(trainer.log_path)  # its error is its log's end, not accelerate's report
                        outcome, status = "failed", self._fail(f"the trainer {how}; {self._checkpoint_report()}",
                                                               trainer)
                    break
                if self._stop.is_set():
                    sig = signal.Signals(self._signals[0]).name if self._signals else "signal"
                    write_stop_reason(self.plan.output_dir, f"asyncgrpo train got {sig}")
                    grace = self._stop_grace()
                    dash.print(Text(f"{sig}: asking the trainer to save a checkpoint and stop, after the step in "
                                    f"progress if one is (up to {grace:.0f} s, launch.stop_timeout; send it again to "
                                    "stop now, without saving)", style="yellow"))
                    before = self._newest_checkpoint()  # "saved" below means saved by this stop
                    dash.begin_stop(sig)
                    self._stop_child(trainer, signal.SIGINT, grace)
                    dash.print(Text(self._checkpoint_report(before), style="yellow"))
                    outcome, status = "stopped", self._interrupted_rc()
                    break
                if self.server is not None and self.server.poll() is not None:
                    code = self.server.poll()
                    write_stop_reason(self.plan.output_dir, f"the server (pid {self.server.pid}) "
                                      f"{exit_text(code)}", fails=True)
                    dash.print(Text(f"the server (pid {self.server.pid}) {exit_text(code)}: stopping the trainer "
                                    "(it saves its last completed step)", style="red"))
                    before = self._newest_checkpoint()
                    dash.begin_stop(f"the server {exit_text(code)}")
                    self._stop_child(trainer, signal.SIGINT, self._stop_grace())
                    outcome, status = "failed", self._fail(f"the server (pid {self.server.pid}) {exit_text(code)} "
                                                           "during training; " + self._checkpoint_report(before),
                                                           self.server, server_death_cause(code))
                    break
                trainer.track()
                if self.server is not None:
                    self.server.track()
                self._say_trainer_stopped(dash)
                dash.poll(self._processes())
                self._stop.wait(self.timeouts.poll_s)
            dash.finish(outcome, self._processes())  # the last frame: the outcome, no ETA, nothing "alive"
        finally:
            self._monitoring = False
            dash.stop()
        return outcome, status

    def _checkpoint_report(self, before: str | None | bool = False) -> str:
        """What the stopped (or dead) trainer left, never promising a checkpoint that is not there: ``checkpoint
        saved`` only for one written since ``before`` (the newest when the stop began; default: when the job
        started) that holds the last completed step (``status.json`` ``step``); otherwise the newest complete
        checkpoint with the step it holds, and the step that is not saved."""
        from ..run.checkpoints import checkpoint_step
        from .job_files import read_status

        newest = self._newest_checkpoint()
        if newest is None:
            return "no checkpoint was written"
        step, trained = checkpoint_step(newest), read_status(self.plan.output_dir).get("step")
        trained = trained if isinstance(trained, int) and not isinstance(trained, bool) else None
        new = newest != (self._checkpoints_before if before is False else before)
        if new and (trained is None or step is None or step >= trained):  # the step it holds: a later one was not done
            return f"checkpoint saved: {newest}" + (f" (step {step}, the last completed step)" if step else "")
        if not new and trained is not None and trained == step:
            return f"no new checkpoint was needed: {newest} holds the last completed step ({step})"
        cut = " (the second signal stopped the trainer before its save ended)" if self._escalate.is_set() else ""
        if trained is not None and step is not None and trained > step:
            return (f"the last completed step ({trained}) was not saved{cut}; the newest complete checkpoint is "
                    f"{newest} (step {step})")
        return f"no new checkpoint was written{cut}; the newest complete one is {newest} (step {step})"

    def _wait_exit(self, child: Child, timeout: float, *, interruptible: bool) -> bool:
        """Wait up to ``timeout`` s until neither the child's leader nor its direct children run (redrawing
        the dashboard); True if they all exited."""
        deadline = time.monotonic() + timeout
        while child.main_alive():
            child.track()
            if time.monotonic() >= deadline or (interruptible and self._escalate.is_set()):
                if interruptible and self._escalate.is_set() and not self._escalated_said:
                    self._escalated_said = True
                    say = self.dashboard.print if self._monitoring and self.dashboard is not None else \
                        self.console.print
                    say(Text(f"second {signal.Signals(self._signals[-1]).name}: stopping the {child.name} now, "
                             "without waiting for its checkpoint", style="bold yellow"))
                return False
            if self._monitoring and self.dashboard is not None:
                self.dashboard.poll(self._processes())
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return True

    def _stop_child(self, child: Child | None, first: int, grace: float) -> None:
        """Stop a child's whole group: ``first`` signal, ``grace`` s, SIGTERM, then SIGKILL."""
        if child is None or child.popen is None:
            return
        if child.main_alive():
            child.track()  # before any signal: once a parent dies its orphans leave the tree
            if child is self.trainer:  # the ranks, not accelerate's launcher (`Child.signal_ranks`)
                child.signal_ranks(first)
            else:
                child.signal_group(first)
            if not (in_time := self._wait_exit(child, grace, interruptible=True)):
                if child is self.trainer and not self._escalate.is_set():
                    say = self.dashboard.print if self._monitoring and self.dashboard is not None else \
                        self.console.print
                    say(Text(f"the trainer did not stop within {grace:.0f} s (launch.stop_timeout): SIGTERM, which "
                             "stops it without saving", style="bold yellow"))
                if first != signal.SIGTERM:
                    child.signal_group(signal.SIGTERM)
                    term = self.timeouts.trainer_term_s if child is self.trainer else self.timeouts.server_term_s
                    self._wait_exit(child, 0.0 if self._escalate.is_set() else term, interruptible=True)
                if child.main_alive():
                    child.kill_leftovers()
                    try:
                        child.popen.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
            if child is self.trainer and child.poll() is not None:  # its log ends with a line of ours
                note_requested_stop(child.log_path, read_stop_reason(self.plan.output_dir),
                                    forced=not in_time and self._escalate.is_set())
        # The leader and the ranks are gone: give the rest of the group a moment, then kill it.
        if child.group_alive():
            child.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + self.timeouts.group_term_s
            while child.group_alive() and time.monotonic() < deadline and not self._escalate.is_set():
                time.sleep(0.05)
        child.kill_leftovers()

    def _stop_all(self) -> None:
        """Final sweep: nothing we started may survive (SIGKILL to every group and tracked descendant)."""
        for child in (self.trainer, self.server):
            if child is None or child.popen is None:
                continue
            if child.poll() is None:
                child.track()
                child.signal_group(signal.SIGKILL)
            try:
                child.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            child.kill_leftovers()

    def _finish(self, outcome: str) -> None:
        """Summary panel and training curves (from this run's metrics.jsonl lines)."""
        from ..dashboard.panels import summarize, summary_lines, summary_panel
        from ..dashboard.plot import plot_run

        rows = self.dashboard.rows if self.dashboard is not None else []
        plot = None
        try:  # the whole run, across resumes (metrics.jsonl's resume markers)
            plot = plot_run(self.plan.output_dir, self.plan.output_dir / PLOT_NAME,
                            sampler=getattr(self.cfg.sampler.backend, "value", self.cfg.sampler.backend))
        except Exception as exc:  # a plotting problem must not hide the run's outcome
            self.console.print(Text(f"could not draw the training curves: {exc}", style="yellow"))
        summary = summarize(rows, time.time() - self.started, self.plan.output_dir, outcome, plot,
                            final_eval=getattr(self.dashboard, "eval", None))
        write_summary_file(self.plan.output_dir, summary_lines(summary))  # logs/summary.txt: kept with the run
        if self.console.is_terminal:
            self.console.print(summary_panel(summary))
        else:  # no box: a box of the console's width would cut long paths
            for line in summary_lines(summary):
                self.console.print(line, markup=False, highlight=False, soft_wrap=True, crop=False)


def print_refused_plan(cfg: DictConfig, refused: list[ConfigError], *, console: Console | None = None,
                       gpu_count: int | None = None) -> int:
    """``train --dry-run`` when the config checks refused the config: the launch plan all the same, with each
    refusal as a problem and the rows of the keys they name marked failed (a Hub model that is not cached
    offline: the model row); starts nothing. Returns 2 (a configuration refusal)."""
    console = console or Console()
    try:
        external = getattr(cfg.sampler.backend, "value", cfg.sampler.backend) == "external"
        running = not external and probe_health(server_url(cfg), 1.0)
        plan = build_launch_plan(cfg, gpu_count, server_running=running)
    except ConfigError as exc:  # no plan to show: the refusals are all there is to say
        for problem in [*refused, exc]:
            console.print(Text(f"config error: {problem}", style="bold red"), soft_wrap=True)
        return 2
    plan.gpus.problems.extend(str(problem) for problem in refused)  # the row says "problem" already
    plan.gpus.problems.extend(dry_run_refusals(cfg, running, whole_commands=False))  # the overrides to add
    failed = frozenset(str(p.key) for p in refused)
    resolved = False
    if not failed & {"model.name", "model.gguf_file"}:  # the commands a start runs, as a plan without problems
        cfg, plan, resolved = dry_run_resolved(cfg, plan, running)
    print_plan(console, cfg, plan, resolved=resolved, failed_keys=failed)
    console.print(Text(f"{len(plan.problems)} problem(s): this plan cannot run.", style="bold red"))
    return 2


def run_train(cfg: DictConfig, dry_run: bool = False, *, console: Console | None = None,
              gpu_count: int | None = None, timeouts: Timeouts | None = None,
              _commands: CommandHook | None = None) -> int:
    """`asyncgrpo train`: print the launch plan, then run the sampler, the doctor checks and the trainer
    with the live dashboard (module docstring).

    Args:
        cfg: composed config (`asyncgrpo_cli.config.compose.compose`).
        dry_run: print the plan only: no model export, no file, no process.
        console: where to print (default: stdout).
        gpu_count: visible GPUs (None = ``torch.cuda.device_count()``).
        timeouts: waiting times (`Timeouts`).
        _commands: test hook ``(name, argv) -> argv`` applied to the server and trainer commands.

    Returns:
        The exit status: 0 success (or a clean dry run), 1 failure, 2 config error (also a plan that cannot
        run here, and a server the doctor checks refuse), 130 / 143 after SIGINT / SIGTERM.
    """
    console = console or Console()
    if not cfg.model.name:
        console.print(Text("config error: model.name=None: the trainer needs a model. Fix: add +recipe=NAME or "
                           "model.name=HUB_ID_OR_DIR", style="bold red"), soft_wrap=True)
        return 2
    backend = getattr(cfg.sampler.backend, "value", cfg.sampler.backend)
    url = server_url(cfg)
    running = backend != "external" and probe_health(url, timeout=1.0)
    typed = Path(str(cfg.trainer.output_dir or output_dir_of(cfg.trainer))).expanduser()  # as the user wrote it
    if not dry_run and int(cfg.launch.machine_rank) == 0:
        refused = folder_or_port_refusal(cfg, answering=running)  # another job in the folder, a busy port
        if refused:
            console.print(Text(refused, style="bold red"), soft_wrap=True)
            return 2
        problem = start_problem(cfg.trainer, typed)  # a used folder: refused before the plan and the model
        if problem:
            console.print(Text(f"error: {problem}", style="bold red"), soft_wrap=True)
            return 2
    try:
        plan = build_launch_plan(cfg, gpu_count, server_running=running)
    except ConfigError as exc:
        console.print(Text(f"config error: {exc}", style="bold red"), soft_wrap=True)
        return 2
    if dry_run:  # what the real run would refuse before loading anything (its fixes: overrides, after others)
        plan.gpus.problems.extend(dry_run_refusals(cfg, running, whole_commands=not plan.problems))
    if dry_run:  # the commands the start runs, also next to a problem (a used folder planned the package name)
        cfg, plan, resolved = dry_run_resolved(cfg, plan, running)
    else:
        resolved = False
    if dry_run or plan.problems:
        print_plan(console, cfg, plan, resolved=resolved)
        if plan.problems:
            console.print(Text(f"{len(plan.problems)} problem(s): this plan cannot run.",
                               style="bold red"))
            return 2  # a configuration refusal, as every other
        console.print(Text("dry run: nothing started.", style="dim"))
        return 0

    from ..config.models import resolve_model_path

    output_dir = output_dir_of(cfg.trainer)
    try:
        model_path = resolve_model_path(str(cfg.model.name), cfg.model.gguf_file)
        rcfg = resolved_config(cfg, model_path, output_dir)
        port = free_port() if plan.gpus.num_machines == 1 and cfg.launch.main_process_port is None \
            and plan.gpus.num_processes > 1 else None
        plan = build_launch_plan(rcfg, plan.gpus.gpu_count, server_running=running, main_process_port=port)
    except ConfigError as exc:
        console.print(Text(f"config error: {exc}", style="bold red"), soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print(Text("interrupted before anything started", style="yellow"))
        return 130
    print_plan(console, rcfg, plan, resolved=True)
    from ..config.compose import public_host_warning

    if plan.server is not None and public_host_warning(rcfg):
        console.print(Text(public_host_warning(rcfg), style="bold yellow"), soft_wrap=True)
    earlier = earlier_checkpoints_note(rcfg.trainer)
    if earlier:
        console.print(Text(earlier, style="yellow"), soft_wrap=True)
    return Supervisor(rcfg, plan, console, timeouts, _commands).run()
