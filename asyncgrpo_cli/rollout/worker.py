"""The rollout worker process and the trainer's handle on it (SPEC §1.1, §2.11–12, §10.2, Appendix B.18).

Trainer rank 0 builds a `RolloutWorker`, which test-pickles everything the child needs, then spawns
(start method ``spawn``) one process with ``CUDA_VISIBLE_DEVICES=""`` and the distributed environment
variables removed. The child runs the configured `AsyncRolloutLoop` subclass. The handle exposes the
shared values (model version, token allowance, consumed tokens, heartbeat), the rollout queue, and
failure detection: the child's traceback, a dead process, or a heartbeat older than
``rollout_worker_timeout`` seconds.

Lifetime: the worker dies with its trainer however the trainer dies (kill -9 included, Python API as
CLI). The child makes itself the leader of a new process group (``setpgid``), so its reward pool (the
math-verify processes, spawned from it) lives in that group; it asks the kernel for SIGTERM when its
parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux) and, everywhere, runs a watchdog thread that polls the
parent's pid. Either way it then SIGKILLs its whole group (itself and the pool). On its own exit it
kills the processes it started, and the trainer's `RolloutWorker.stop` SIGKILLs what is left of the
group (a worker killed with kill -9 leaves its pool behind otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..run.log_lines import say
from ..run.orphans import set_parent_death_signal
from .completions import CompletionRecords
from .evaluation import EvalResult
from .loop import AsyncRolloutLoop
from .reward_runner import check_picklable
from .types import PromptOutcome

# Variables of torchrun / accelerate / SLURM that must not reach the worker (it is not a rank).
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                   "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                   "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                   "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_MIXED_PRECISION")


PARENT_POLL_S = 0.5
"""Seconds between the watchdog's checks that the trainer (the parent) is still alive."""

log = logging.getLogger(__name__)


def _kill_own_group() -> None:
    """SIGKILL this process's whole process group (the worker and its reward pool); never returns."""
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


def _watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Watchdog thread body: once the parent is gone (re-parented: ``getppid`` changed), kill the group."""
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    _kill_own_group()


def bind_to_parent(parent_pid: int, death_signal: bool = True) -> None:
    """Make this process die with ``parent_pid`` (the trainer), with everything it starts.

    Puts the process in a new process group (it leads it; children inherit it), sets the parent-death
    signal (SIGTERM, handled by killing the group; only when ``death_signal``: the kernel fires it when
    the parent *thread* that started us exits, so a trainer started from another thread gets only the
    watchdog), and starts a daemon watchdog thread polling ``getppid()`` every `PARENT_POLL_S` s.
    If the parent is already gone, the group is killed at once.
    """
    try:
        os.setpgid(0, 0)
    except OSError as exc:  # e.g. already a session leader
        log.warning("rollout worker: cannot start its own process group (%s)", exc)
    if death_signal and set_parent_death_signal(signal.SIGTERM):
        signal.signal(signal.SIGTERM, lambda signum, frame: _kill_own_group())
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        _kill_own_group()
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _reap_children(timeout_s: float = 5.0) -> None:
    """Terminate, then kill, the processes this one started (the reward pool) that are still alive."""
    children = mp.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed, died, or stopped beating. The message carries the child's traceback."""


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """Within the block, ``os.environ`` is what the spawned worker must inherit: no GPU, no rank variables."""
    saved = dict(os.environ)
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        for key in DISTRIBUTED_ENV:
            os.environ.pop(key, None)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _report_startup_failure(kwargs: dict[str, Any], exc: BaseException, loop_cls: Any = None) -> None:
    """Send an error raised while the child builds its loop to the trainer, as `AsyncRolloutLoop.report_failure`
    does for run-time errors (the traceback, or the message alone for a diagnosis meant for the user)."""
    import traceback

    if getattr(exc, "report_without_traceback", False):
        text = f"{type(exc).__name__}: {exc}"
    else:
        name = getattr(loop_cls, "__qualname__", None)
        text = (f"while building the rollout loop{' ' + name if name else ''}:\n"
                + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    try:
        kwargs["exception_info_queue"].put(text)
    finally:
        kwargs["failed_event"].set()


def unguarded_main_call() -> tuple[str, int] | None:
    """``(script, line)`` when the caller runs at the top level of the main script outside an
    ``if __name__ == "__main__":`` block, else None.

    The worker is started with ``spawn``, which imports the main script again in the child: code at its top
    level runs a second time there (a second trainer, a second worker) and the child dies while starting.
    Found from the main module's frame and the script's syntax tree (no file, or no readable source: None).
    """
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
                                     and os.path.abspath(frame.f_code.co_filename) == os.path.abspath(path)):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return None

    def is_main_test(test: ast.expr) -> bool:
        if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
            return False
        sides = [test.left, test.comparators[0]]
        return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and \
            any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides)

    for node in tree.body:
        if isinstance(node, ast.If) and is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or line):
            return None
    return str(path), line


def main_guard_message(script: str, line: int) -> str:
    """The error for `unguarded_main_call`."""
    return (f"{script}, line {line}, starts training at the top level of the script, outside "
            "`if __name__ == \"__main__\":`. The rollout worker is a spawned process, which imports the script "
            "again: that line would run a second time inside it. Fix: put the training code under "
            "`if __name__ == \"__main__\":` (or in a main() function called from there)")


def _drop_boot_signals() -> None:
    """In the worker, once it leads its own process group: discard a SIGINT/SIGTERM that reached the trainer's
    group while the worker booted with them blocked (`RolloutWorker.start`), then unblock them. SIGINT stays
    ignored (the trainer stops the worker through its stop flag); SIGTERM keeps the handler `bind_to_parent`
    set (or its default)."""
    term = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # pending ones are discarded
    signal.signal(signal.SIGTERM, term if term is not None else signal.SIG_DFL)


def _worker_main(loop_cls, kwargs: dict[str, Any], ready_event, stop_flag, parent_pid: int | None = None,
                 death_signal: bool = True, no_signal_value=None, stopping=None, rollouts_done_value=None) -> None:
    """Entry point of the spawned process: bind its lifetime to the trainer's (`bind_to_parent`), build
    the loop and run it until stopped or failed; the processes it started are reaped on the way out. An
    error while building the loop reaches the trainer through ``failed_event`` like a run-time one.
    ``stopping`` (`RolloutWorker.begin_stop`) stops the loop as ``stop_flag`` does."""
    if parent_pid is not None:
        bind_to_parent(parent_pid, death_signal)
    _drop_boot_signals()
    from ..run.log_lines import stamp_package_logs

    stamp_package_logs()  # its warnings go to the trainer's log: after their time, as the trainer's
    try:
        _run_loop(loop_cls, kwargs, ready_event, stop_flag, no_signal_value, stopping, rollouts_done_value)
    finally:
        _reap_children()


def _run_loop(loop_cls, kwargs: dict[str, Any], ready_event, stop_flag, no_signal_value=None,
              stopping=None, rollouts_done_value=None) -> None:
    try:
        loop = loop_cls(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything must reach the trainer
        _report_startup_failure(kwargs, exc, loop_cls)
        raise SystemExit(1) from None
    loop.ready_event = ready_event
    loop.no_signal_value = no_signal_value
    loop.rollouts_done_value = rollouts_done_value

    def watch_stop() -> None:
        # A polled flag, not an mp.Event: setting an Event whose waiter died can block the setter forever.
        while not stop_flag.value and not (stopping is not None and stopping.value):
            time.sleep(0.2)
        if not stop_flag.value:  # the trainer began a stop: nothing generated now would be trained
            say("asyncgrpo rollout worker: the trainer is stopping: generation ends (no request is retried "
                "any more)", sys.stderr)
        loop.stop()

    threading.Thread(target=watch_stop, name="stop-watch", daemon=True).start()
    try:
        loop.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    except BaseException:  # noqa: BLE001 - already reported through failed_event by loop.run
        pass


def _kill_group(pgid: int | None) -> None:
    """SIGKILL what is left of the worker's process group (ignored when it is gone or not ours)."""
    if pgid is None or pgid == os.getpgrp():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class RolloutWorker:
    """Trainer-side handle of the spawned rollout worker.

    Args:
        config: the `AsyncGRPOConfig` (picklable).
        model_name: model (or LoRA adapter) name on the server.
        dataset: prompt dataset with a conversational ``prompt`` column.
        reward_funcs: reward callables (module-level functions, partials or callable instances).
        processing_class: the tokenizer (pickled into the child).
        eos_token_ids: ids that end a completion.
        loop_cls: `AsyncRolloutLoop` or a subclass defined at module level.
        dataset_start_index: prompt index to resume from (SPEC §12).
        eval_dataset: eval prompts (README "Evaluation"); None = no eval rounds.

    Raises:
        TypeError: a reward function, tool, environment factory or the loop class cannot be pickled
            (lambda, closure, local class); the message names it and says what to use instead.
    """

    def __init__(self, config, model_name: str, dataset, reward_funcs, processing_class, eos_token_ids,
                 loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop, tools=None, environment_factory=None,
                 lora_name: str | None = None, dataset_start_index: int = 0, score_queue_maxsize: int = 16,
                 initial_allowance: float = 0.0, eval_dataset=None, step_capacity_tokens: float = 0.0) -> None:
        for func in reward_funcs or []:
            check_picklable(func, "reward function")
        for tool in tools or []:
            check_picklable(tool, "tool")
        if environment_factory is not None:
            check_picklable(environment_factory, "environment_factory")
        check_picklable(loop_cls, "loop_cls")
        self.config = config
        self.timeout_s = float(config.rollout_worker_timeout)
        ctx = mp.get_context("spawn")
        self._ctx = ctx
        self.rollout_buffer = ctx.Queue()
        self.model_version_value = ctx.Value("q", 0)
        self.token_allowance = ctx.Value("d", float(initial_allowance))
        self.consumed_tokens_value = ctx.Value("d", 0.0)
        self.stale_dropped_value = ctx.Value("q", 0)  # samples the trainer dropped as too old (issue #28)
        # issue #33: the version samples pulled from now on train at (ahead of model_version while a closed step
        # trains and syncs), the sample tokens a step of full rows holds, and the last on-policy round the worker
        # finished at max_staleness=0: [model version, prompt outcomes it had put by then, a version the trainer
        # asks to be generated again because the done round left it nothing to train] (-1: none)
        self.pull_version_value = ctx.Value("q", 0)
        self.capacity_value = ctx.Value("d", float(step_capacity_tokens))
        self.round_done_value = ctx.Array("q", [-1, 0, -1])
        self.heartbeat_value = ctx.Value("d", 0.0)
        self.concurrency_value = ctx.Value("q", 0)
        self.cap_value = ctx.Value("q", 0)
        self.no_signal_value = ctx.Value("q", 0)  # consecutive groups without learning signal (rollout/no_signal.py)
        self.rollouts_done_value = ctx.Value("q", 0)  # rollouts finished since the start (status.json, plain line)
        self.failed_event = ctx.Event()
        self.ready_event = ctx.Event()
        self.stop_flag = ctx.Value("b", 0)
        # set by the trainer's stop-signal handler (`begin_stop`): a plain shared byte, no lock to take there
        self.stopping_value = ctx.RawValue("b", 0)
        # server outages (SPEC B.17): the worker's give-up time while its server is unreachable (wall
        # clock, 0 = reachable), outages it saw end, and the last of those the trainer re-pushed after
        self.server_down_until = ctx.Value("d", 0.0)
        self.server_returns = ctx.Value("q", 0)
        self.server_repushed = ctx.Value("q", 0)
        self.exception_info_queue = ctx.Queue()
        self.metrics_queue = ctx.Queue()
        self._completions: list[dict[str, Any]] = []  # drained completion records (take_completions)
        self.eval_request_value = ctx.Value("q", 0)  # the last step an eval round was asked for (request_eval)
        self._eval_results: list[EvalResult] = []  # drained eval rounds (take_eval_results)
        self._loop_cls = loop_cls
        self._kwargs = dict(
            config=config, model_name=model_name, dataset=dataset, reward_funcs=list(reward_funcs or []),
            processing_class=processing_class, eos_token_ids=list(eos_token_ids),
            rollout_buffer=self.rollout_buffer, model_version_value=self.model_version_value,
            token_allowance=self.token_allowance, heartbeat_value=self.heartbeat_value,
            failed_event=self.failed_event, exception_info_queue=self.exception_info_queue,
            metrics_queue=self.metrics_queue, tools=tools, environment_factory=environment_factory,
            score_queue_maxsize=score_queue_maxsize, lora_name=lora_name, dataset_start_index=dataset_start_index,
            consumed_tokens_value=self.consumed_tokens_value, concurrency_value=self.concurrency_value,
            cap_value=self.cap_value, stale_dropped_value=self.stale_dropped_value,
            pull_version_value=self.pull_version_value, capacity_value=self.capacity_value,
            round_done_value=self.round_done_value,
            server_values=(self.server_down_until, self.server_returns, self.server_repushed))
        if eval_dataset is not None:  # only then: a custom loop_cls without these arguments keeps working
            self._kwargs.update(eval_dataset=eval_dataset, eval_request_value=self.eval_request_value)
        self.process: mp.process.BaseProcess | None = None
        self._consumed = 0.0

    # ------------------------------------------------------------------------------------ lifetime
    def start(self, ready_timeout_s: float | None = None) -> None:
        """Spawn the worker and wait until it is connected to the server and set up, or until `begin_stop` (a stop
        signal while it boots: the wait would last until the deadline when the server is gone too).

        Raises:
            RolloutWorkerError: the child failed, died, or was not ready within ``ready_timeout_s``
                (default: ``vllm_server_timeout`` + 60 s).
        """
        if getattr(mp.current_process(), "_inheriting", False):  # we are a spawned child importing the script
            where = unguarded_main_call()
            raise RolloutWorkerError(main_guard_message(*where) if where else
                                     "the rollout worker was started while a spawned process imported the main "
                                     "script. Fix: put the training code under `if __name__ == \"__main__\":`")
        where = unguarded_main_call()
        if where is not None:
            raise RolloutWorkerError(main_guard_message(*where))
        if ready_timeout_s is None:
            ready_timeout_s = float(self.config.vllm_server_timeout) + 60.0
        # Not a daemon: the accuracy reward runs math-verify in its own process pool (daemons cannot fork).
        death_signal = threading.current_thread() is threading.main_thread()
        self.process = self._ctx.Process(target=_worker_main, args=(self._loop_cls, self._kwargs, self.ready_event,
                                                                    self.stop_flag, os.getpid(), death_signal,
                                                                    self.no_signal_value, self.stopping_value,
                                                                    self.rollouts_done_value),
                                         name="asyncgrpo-rollout-worker", daemon=False)
        # A stop signal sent to the trainer's process group (the CLI's SIGINT/SIGTERM) must not reach the worker
        # while it boots, still in that group: it would die half-started (or hang the start). Blocked here, the
        # signals stay blocked in the child across fork and exec; `_worker_main` drops them once it leads its own
        # group. The trainer gets its own pending signal as soon as the start returns.
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        try:
            with worker_environment():
                self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.heartbeat_value.value = time.time()
        deadline = time.monotonic() + ready_timeout_s
        while not self.ready_event.wait(0.2):
            self.check_alive()
            if self.stopping:  # a stop began while it boots (the supervisor gone, a Ctrl-C): nothing it would
                return  # generate is trained, and its server may be gone too; the trainer's teardown stops it
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutWorkerError(f"the rollout worker was not ready after {ready_timeout_s:.0f} s "
                                         f"(is the server at {self.config.vllm_server_base_url} up?)")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: ask its loop to stop (it runs ``close``), wait ``timeout_s`` seconds, then
        terminate, then kill. Safe to call twice."""
        proc = self.process
        if proc is None:
            return
        if proc.pid is None:  # a stop signal interrupted `start` before the process existed
            self.process = None
            return
        self.stop_flag.value = 1
        proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        _kill_group(proc.pid)  # its reward pool, when the worker itself was killed (kill -9)
        for q in (self.rollout_buffer, self.metrics_queue, self.exception_info_queue):
            q.cancel_join_thread()
        self.process = None

    def begin_stop(self) -> None:
        """The trainer begins a stop (a stop signal): the worker ends its generation now, without retrying any
        request against a server that may be gone (nothing generated from now on would be trained). Only
        writes a shared byte, so it is safe in a signal handler; the worker's exit is then no failure."""
        self.stopping_value.value = 1

    @property
    def stopping(self) -> bool:
        """Whether `begin_stop` was called."""
        return bool(self.stopping_value.value)

    def server_returns_seen(self) -> int:
        """Outages of the server that the worker saw end (each may have cost the server its weights)."""
        return int(self.server_returns.value)

    def needs_repush(self) -> bool:
        """True when the worker saw the server come back and waits for the trainer to push its weights."""
        return int(self.server_returns.value) > int(self.server_repushed.value)

    def ack_repush(self, returns_seen: int) -> None:
        """The trainer pushed its weights after ``returns_seen`` outages had ended: waiting generation resumes."""
        self.server_repushed.value = max(int(self.server_repushed.value), int(returns_seen))

    def server_seconds_left(self) -> float | None:
        """Seconds before the worker gives up on an unreachable server, None while the server answers (or once a
        stop began: the worker no longer waits for it)."""
        until = float(self.server_down_until.value)
        if self.stopping:
            return None
        return None if until <= 0 else until - time.time()

    # ------------------------------------------------------------------------------------ health
    def heartbeat_age_s(self) -> float:
        """Seconds since the worker's last heartbeat."""
        return max(0.0, time.time() - float(self.heartbeat_value.value))

    def check_alive(self) -> None:
        """Raise if the worker failed, died, or has not beaten for ``rollout_worker_timeout`` seconds.

        Raises:
            RolloutWorkerError: with the child's traceback when it reported one.
        """
        if self.failed_event.is_set():
            try:
                text = self.exception_info_queue.get(timeout=5.0)
            except queue.Empty:
                text = "(no traceback was received)"
            raise RolloutWorkerError(f"the rollout worker failed:\n{text}")
        if self.process is not None and not self.process.is_alive():
            if self.stopping and self.process.exitcode == 0:
                return  # it ended its generation because the trainer stops (`begin_stop`)
            raise RolloutWorkerError(f"the rollout worker exited with code {self.process.exitcode} "
                                     "without reporting an error: it died before running any code of ours (its "
                                     "stderr, above in this log, has the cause: often the main script runs training "
                                     "outside `if __name__ == \"__main__\":`, or something passed to the worker "
                                     "could not be imported in a fresh process)")
        age = self.heartbeat_age_s()
        if self.ready_event.is_set() and age > self.timeout_s:
            raise RolloutWorkerError(f"the rollout worker has not sent a heartbeat for {age:.0f} s "
                                     f"(rollout_worker_timeout={self.timeout_s:.0f}); it is hung or stopped")

    # ------------------------------------------------------------------------------------ data
    def get_outcome(self, timeout_s: float) -> PromptOutcome | None:
        """The next prompt outcome (kept samples, or a dropped/filtered marker), or None after ``timeout_s`` s."""
        try:
            return self.rollout_buffer.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def mark_consumed(self, sample_tokens: float) -> None:
        """Tell the worker the trainer pulled ``sample_tokens`` sample tokens (trained or dropped stale)."""
        self._consumed += float(sample_tokens)
        self.consumed_tokens_value.value = self._consumed

    def mark_dropped_stale(self) -> None:
        """Tell the worker the trainer dropped one sample as more than ``max_staleness`` versions old: its
        deadline admission turns on (`StaleSchedule.on_dropped_stale`, issue #28)."""
        with self.stale_dropped_value.get_lock():
            self.stale_dropped_value.value += 1

    def publish_allowance(self, tokens: float) -> None:
        """Publish the staleness token allowance (SPEC §4.1)."""
        self.token_allowance.value = float(tokens)

    def set_model_version(self, version: int) -> None:
        """Publish the policy version the server now samples with (and, if ahead, as the pull version)."""
        self.pull_version_value.value = max(int(self.pull_version_value.value), int(version))
        self.model_version_value.value = int(version)

    def set_pull_version(self, version: int) -> None:
        """Publish that samples the trainer pulls from now on train at ``version`` or later (issue #33): a step
        just closed and will be followed by a weight sync. Groups in flight that this makes too old for
        ``max_staleness`` are cancelled by the worker instead of finishing for nothing."""
        self.pull_version_value.value = max(int(self.pull_version_value.value), int(version))

    def publish_capacity(self, tokens: float) -> None:
        """Publish the sample tokens one weight version's steps hold with full rows (`step_capacity`): the size
        of an on-policy round at ``max_staleness=0`` (issue #33)."""
        self.capacity_value.value = float(tokens)

    def round_done_outcomes(self, version: int) -> int | None:
        """At ``max_staleness=0``: the number of prompt outcomes the worker had put in the rollout queue when it
        finished its round at model ``version`` (nothing more of that version will come), else ``None``."""
        with self.round_done_value.get_lock():
            done_version, outcomes = int(self.round_done_value[0]), int(self.round_done_value[1])
        return outcomes if done_version == int(version) else None

    def reopen_round(self, version: int) -> None:
        """Ask the worker to generate again at ``version``: its done round left the trainer nothing to train
        (every sample over the token budget)."""
        with self.round_done_value.get_lock():
            self.round_done_value[2] = int(version)

    def drain_metrics(self) -> list[dict[str, tuple]]:
        """All metric snapshots the worker shipped since the last call (completion records that came with
        them are kept for `take_completions`)."""
        out = []
        while True:
            try:
                item = self.metrics_queue.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, CompletionRecords):
                self._completions.extend(item.records)
            elif isinstance(item, EvalResult):
                self._eval_results.append(item)
            else:
                out.append(item)

    def take_completions(self) -> list[dict[str, Any]]:
        """The completion records (``log_completions``, `rollout.completions`) drained so far, oldest first;
        the next call returns only newer ones."""
        records, self._completions = self._completions, []
        return records

    def request_eval(self, step: int) -> None:
        """Ask for an eval round with the current weights, labelled with optimizer step ``step`` (README
        "Evaluation"); its `EvalResult` comes back through `drain_metrics` / `take_eval_results`."""
        self.eval_request_value.value = max(int(self.eval_request_value.value), int(step))

    def take_eval_results(self) -> list[EvalResult]:
        """The eval rounds drained so far (`drain_metrics`), oldest first; the next call returns only newer ones."""
        results, self._eval_results = self._eval_results, []
        return results
