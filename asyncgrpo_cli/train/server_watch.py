"""Is the sampler server still answering? A `/health` probe on a timer (trainer rank 0; issue #36).

A server that is dead refuses connections: the sampler clients' outage clock sees that (SPEC B.17,
``server unreachable, retrying``). A server that is *hung* (stopped with SIGSTOP or Ctrl-Z, deadlocked,
swapping) still accepts connections, because the kernel does, and never answers: every request then
waits its whole timeout, and nothing else shows it. `ServerWatch` probes ``GET /health`` every
`PROBE_EVERY_S` seconds (each probe waits at most `PROBE_TIMEOUT_S`) on a daemon thread:

- after `REPORT_AFTER_S` seconds without an answer it reports the silence (`status`, shown by the trainer
  in ``status.json`` ``server_status`` and so in the panels and the plain log);
- while the server is silent, `budget` is what is left of the hang limit (below): the trainer's requests (a
  weight sync) wait at most that, so a hang costs the limit once, not once per request and attempt;
- once the silence has lasted the hang limit (`hang_limit`: ``vllm_server_hang_timeout``, CLI
  ``sampler.hang_timeout``, 120 s by default, or ``vllm_server_timeout`` when that is lower) it sets `problem`,
  which stops the run like a failed rollout worker: the last completed step is saved and the run fails with
  `ServerHungError` (the URL, how long, what a hang is and the fix). Before the hang limit existed a hung server
  kept the run for the whole ``sampler.timeout``, 30 minutes by default (a fresh user's SIGSTOP trial, NOTES,
  seventeenth session).

Any HTTP answer, whatever its status, ends the silence; a refused connection is not a hang (the server is
gone: the outage clock of B.17 handles it), so it ends the silence too.

When `asyncgrpo train` started the server, its supervisor gives the trainer the server's pid
(`run.state.SERVER_PID_ENV`, read by `server_pid_from_env`) and both lines name it, with the command that
continues a stopped server (its process group: vLLM's API servers and engine core are in it); an external
server (``sampler.backend=external``) has no pid here, and the lines do not name one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..run.state import server_pid_from_env  # noqa: F401 - re-exported (the trainer, tests)

PROBE_EVERY_S = 5.0
PROBE_TIMEOUT_S = 5.0
REPORT_AFTER_S = 15.0

ANSWERED, REFUSED, SILENT = "answered", "refused", "silent"


class ServerHungError(RuntimeError):
    """The sampler server stopped answering (not refusing) for the hang limit (`hang_limit`)."""


def hang_limit(args) -> tuple[float, str]:
    """``(seconds, field)``: the silence after which a server that has answered counts as hung, and the
    `AsyncGRPOConfig` field it comes from: ``vllm_server_hang_timeout``, or ``vllm_server_timeout`` when that is
    lower (a user who lowered the whole timeout waits no longer for a hang). ``args``: the `AsyncGRPOConfig`."""
    hang, whole = float(args.vllm_server_hang_timeout), float(args.vllm_server_timeout)
    return (whole, "vllm_server_timeout") if whole <= hang else (hang, "vllm_server_hang_timeout")


def probe_health(url: str, timeout_s: float) -> tuple[str, str]:
    """One ``GET <url>/health``: (`ANSWERED`, ""), (`REFUSED`, why) or (`SILENT`, why) for a timeout or a
    connection that was dropped without an answer."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.ConnectError as exc:
        return REFUSED, f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        return SILENT, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return ANSWERED, ""


def _say(line: str) -> None:
    """A line of the trainer's log (its stdout, ``logs/trainer.log``), with the time."""
    from .console_log import stamped

    print(stamped(line), flush=True)


class ServerWatch:
    """Probes the server's ``/health`` and tells how long it has been silent (module docstring).

    Args:
        url: the server's base URL.
        timeout_s: the silence after which the run stops, seconds (`hang_limit`).
        limit_field: the `AsyncGRPOConfig` field ``timeout_s`` comes from: the lines name it and its CLI key
            (`config.compose.hydra_path`).
        probe: ``(url, timeout_s) -> (outcome, why)`` (default `probe_health`; tests pass their own).
        on_problem: called once with `problem` when it is set (the trainer abandons its client's waits).
        clock: monotonic clock, seconds.
        server_pid: the pid of the server when this job started it (`server_pid_from_env`): the lines name it;
            None for an external server.
        every_s / probe_timeout_s / report_after_s: the probe period, one probe's timeout, and the silence
            before `status` reports it.
        say: where the log's two lines of a silence go (default: the trainer's log, `console_log.stamped`): `status`
            once when it is first reported, and ``... answers again after N s silent`` when it ends (before, only
            the console's plain lines said so: a trial's trainer.log held no trace of a 45 s SIGSTOP but
            ``server silent 45 s`` in a step line).
    """

    def __init__(self, url: str, timeout_s: float, *, probe: Callable[[str, float], tuple[str, str]] | None = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float = PROBE_EVERY_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, report_after_s: float = REPORT_AFTER_S,
                 on_problem: Callable[[str], None] | None = None, server_pid: int | None = None,
                 limit_field: str = "vllm_server_timeout", say: Callable[[str], None] | None = None) -> None:
        from ..config.compose import hydra_path

        self.url, self.timeout_s = url.rstrip("/"), float(timeout_s)
        self.limit_field, self.limit_key = limit_field, hydra_path(limit_field)
        self.server_pid = server_pid
        self.on_problem = on_problem
        self.probe = probe or probe_health
        self.clock = clock
        self.every_s, self.probe_timeout_s = every_s, probe_timeout_s
        self.report_after_s = min(report_after_s, self.timeout_s)
        self.last_answer = clock()
        self.silent_since: float | None = None  # the last answer before an unanswered probe
        self._silent_done = 0.0  # seconds of the silences that ended (`take_silent_s`)
        self._silent_taken = 0.0
        self._lock = threading.Lock()
        self.last_failure = ""
        self.say = say or _say
        self._reported = False  # the ongoing silence was said in the log
        self.problem: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        from .engine_cpu import EngineCoreLoad

        self.engine_load = EngineCoreLoad()  # the server's engine core on its CPU core (`read_cpu` per probe)
        self.read_cpu = None
        if server_pid is not None:
            from .engine_cpu import read_tree_cpu

            self.read_cpu = lambda: read_tree_cpu(server_pid)

    def start(self) -> ServerWatch:
        """Start the daemon thread."""
        self._thread = threading.Thread(target=self._run, name="sampler-server-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (idempotent; a probe in flight ends at its own timeout)."""
        self._stop.set()
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.check() is not None:
                    return
                if self.read_cpu is not None:
                    self.engine_load.observe(self.read_cpu(), self.clock())
            except Exception:  # noqa: BLE001 - the watch must never break training
                pass
            self._stop.wait(self.every_s)

    def check(self) -> str | None:
        """One probe now (also run by the thread); returns `problem` (None while the server answers or refuses)."""
        if self.problem is not None:
            return self.problem
        outcome, why = self.probe(self.url, self.probe_timeout_s)
        now = self.clock()
        if outcome != SILENT:
            with self._lock:
                silent = None if self.silent_since is None else now - self.silent_since
                if silent is not None:
                    self._silent_done += silent
                self.last_answer, self.silent_since = now, None
            if self._reported and silent is not None:
                self._reported = False
                how = "answers again" if outcome == ANSWERED else "refuses connections now (gone?)"
                self.say(f"sampler server at {self.url}{self._pid_text()}: {how} after {silent:.0f} s silent")
            return None
        self.last_failure = why
        with self._lock:  # `take_silent_s` reads it from the training thread
            if self.silent_since is None:
                self.silent_since = self.last_answer
        if not self._reported and now - self.silent_since >= self.report_after_s:
            line = self.status()
            if line:
                self._reported = True
                self.say(line)
        if now - self.silent_since >= self.timeout_s:
            self.problem = self.hung_message(now - self.silent_since)
            if self.on_problem is not None:
                self.on_problem(self.problem)
        return self.problem

    def _pid_text(self) -> str:
        return f" (pid {self.server_pid})" if self.server_pid else ""

    def budget(self) -> float | None:
        """How much longer the server may stay silent before the run stops (None while it answers): the
        longest a request should still wait for it (`SyncSamplerClient.silence_budget`)."""
        silent = self.silent_s()
        return None if silent is None else self.timeout_s - silent

    def take_silent_s(self) -> float:
        """Seconds the server was silent since the last call (silences that ended, and the part of one going on):
        a step's share, ``server/silent_s``, so that the step a stall held says so."""
        with self._lock:
            ongoing = 0.0 if self.silent_since is None else self.clock() - self.silent_since
            total = self._silent_done + ongoing
            delta, self._silent_taken = max(0.0, total - self._silent_taken), total
        return delta

    def step_metrics(self) -> dict[str, float]:
        """A step's figures of the server: ``server/silent_s`` (`take_silent_s`), and the busiest engine core's
        and the front end's CPU use in cores (``server/engine_core_cpu``, ``server/frontend_cpu``; issue #41,
        `engine_cpu`) when known."""
        out = {"server/silent_s": self.take_silent_s()}
        engine, frontend = self.engine_load.cores(), self.engine_load.frontend_cores()
        if engine is not None:
            out["server/engine_core_cpu"] = engine
        if frontend is not None:
            out["server/frontend_cpu"] = frontend
        return out

    def silent_s(self) -> float | None:
        """Seconds since the server last answered, while it does not (None while it answers or refuses)."""
        return None if self.silent_since is None else self.clock() - self.silent_since

    def shown_silence_s(self) -> float | None:
        """Seconds since the last answer while `status` reports the silence, else None (``status.json``
        ``server_silent_s``: the console's ``answering again after N s`` counts from there, not from when it
        first saw the line, 15-20 s into the silence)."""
        silent = self.silent_s()
        return None if silent is None or silent < self.report_after_s else round(silent, 1)

    def status(self) -> str | None:
        """The live line once the silence has lasted `report_after_s` (``status.json`` ``server_status``)."""
        silent = self.silent_s()
        if silent is None or silent < self.report_after_s:
            return None
        left = max(0.0, self.timeout_s - silent)
        pid = self.server_pid
        return (f"server not answering: no answer to GET /health{f' from the server (pid {pid})' if pid else ''} "
                f"for {silent:.0f} s (hung or stopped? a busy server still answers it"
                f"{f'; if stopped, kill -CONT -- -{pid} continues its process group' if pid else ''}); the run "
                f"stops with a checkpoint at {self.limit_key}={self.timeout_s:g} s ({left:.0f} s left)")

    def hung_message(self, silent_s: float, gave_up: bool = True) -> str:
        """The failure: the URL, how long, what it means and the fix (``gave_up``: the silence reached the
        timeout; else another failure ended the wait first, e.g. a weight sync)."""
        named = f"{self.limit_field}={self.timeout_s:g} s (CLI: {self.limit_key})"
        limit = (f"gave up after {named}" if gave_up else
                 f"the run stops before {named} because a request to it failed")
        pid = self.server_pid
        # The job's own server (a pid) is stopped with the run, so by the time this is read there is nothing to
        # continue (the second trial of the nineteenth session); an external one is still the user's to look at.
        fix = (f"find why it stopped answering in its log (the job stops it with the run), then resume from the last "
               f"checkpoint" if pid else "look at the server (its log; `kill -CONT PID` if it was stopped), restart "
               "it if needed, and resume from the last checkpoint")
        return (f"the sampler server at {self.url}{f' (pid {pid})' if pid else ''} has not answered for "
                f"{silent_s:.0f} s: it accepts connections but GET /health times out "
                f"({self.last_failure or 'no answer'}), so it is hung (stopped with SIGSTOP or Ctrl-Z, deadlocked, "
                f"or swapping), not dead; {limit}. Fix: {fix}; raise {self.limit_key} to wait longer")
