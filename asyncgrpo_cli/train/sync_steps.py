"""The weight syncs of `AsyncGRPOTrainer` (SPEC §3.1, §9, §15.8, B.17, B.23): the backend's set-up and its start-up
check, the push of a step's weights, the server's status line, the teardown, and the opt-in overlapped sync
(``sampler.weight_sync_overlap``, README "Overlapped weight sync"). A mixin, kept here so the trainer's module stays
under the project's size limit; it uses the trainer's ``args``, ``worker``, ``sampler``, ``weight_sync``, window and
state.

With overlap on, a step's sync runs on a background thread (`sync_overlap.PendingSync`) and the trainer's version
advances at once (it holds the new weights: the next step's staleness counts from it), while the rollout worker's
stays at the version the server serves until the push has ended (`_push_and_publish`, on the sync's thread).
The sync is settled (`_settle_sync`) before whatever
changes the parameters or reads the server's weights: the next optimizer step, the next sync or a re-push, an eval
round, a checkpoint, the run's end or failure, the teardown; and as soon as it is done while the next step pulls its
samples (`_settle_if_done`: a failure is found there). A sync that failed is then handled as a failed sync is
without overlap: abandoned by a stop (the step is saved), or logged and raised (`_raise_sync_failure`) so that the
last trained step is saved.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ..run.log_lines import say
from .sync_overlap import PendingSync

WAIT_METRIC = "perf/weight_sync_wait_s"
"""Seconds the trainer blocked waiting for an overlapped weight sync, in the window of the step where it settled."""


class WeightSyncing:
    """The weight-sync methods of `AsyncGRPOTrainer` (module docstring)."""

    def _make_weight_sync(self):
        """The weight sync of every rank; rank 0 picks the backend from the server (SPEC B.23, §9)."""
        from .weight_sync import WeightSync, dist_barrier, make_weight_sync, read_server_dtype

        args = self.args
        backend, mode, dtype = None, None, None
        if self.is_world_process_zero():
            peft_config = getattr(self.model, "peft_config", None)
            rank = next(iter(peft_config.values())).r if peft_config else None
            backend = make_weight_sync(self.sampler, output_dir=args.output_dir, lora_rank=rank,
                                       max_staleness=args.max_staleness, device=self.accelerator.device,
                                       master_address=args.weight_transfer_address,
                                       master_port=args.weight_transfer_port, packed=args.weight_sync_packed)
            dtype = read_server_dtype(self.sampler)
            mode = backend.mode
        mode, dtype = self._broadcast((mode, dtype))
        sync = WeightSync(self.model, backend, mode=mode, dtype=dtype, barrier=dist_barrier())
        sync.init()
        overlap = getattr(args, "weight_sync_overlap", False)
        self.pending_sync = PendingSync(self.accelerator.device) if overlap else None
        if self.pending_sync is not None and self.is_world_process_zero():  # the log says it is on (a trial)
            print("asyncgrpo trainer: weight sync overlapped with the next step (sampler.weight_sync_overlap=true): "
                  "perf/weight_sync_wait_s is what a step still waits for it", flush=True)
        self._version_lock, self._pushed_version = threading.Lock(), None  # `_push_and_publish`
        return sync

    def _check_weight_sync(self) -> None:
        """``sampler.check_weight_sync``: `sync_check.SyncCheck.check_at_start` on every rank (full-weight sync
        only); raises `sync_check.WeightSyncCheckError` when a sync did not take effect."""
        from .sync_check import STARTED, SyncCheck, probe_prompt, server_sample

        self.sync_check = None
        if not getattr(self.args, "check_weight_sync", False):
            return
        if self.weight_sync.mode == "adapter":
            print("asyncgrpo: sampler.check_weight_sync checks full-weight sync only; adapter (LoRA) sync is not "
                  "checked", flush=True)
            return
        sampler = getattr(self, "sampler", None) if self.is_world_process_zero() else None
        check = SyncCheck(self.model, self.weight_sync.sync, server_sample(sampler, self.model_id), self._broadcast,
                          probe_prompt(self.processing_class), self.accelerator.autocast)
        if self.is_world_process_zero():  # said before it runs (fresh-user trial, eleventh session)
            self.live.append_metrics({"event": "weight_sync_check_started", "time": time.time(), "message": STARTED})
        result = check.check_at_start(self.model_version)
        if self.is_world_process_zero():  # the log's line, the console's (`dashboard`), and step 1's window
            print(f"asyncgrpo: {result.message}", flush=True)
            self.live.append_metrics({"event": "weight_sync_check", "step": self.state.global_step,
                                      "time": time.time(), "status": result.status, "message": result.message})
            for name, value in result.metrics().items():
                self.window.add(name, value)
        self.sync_check = check

    def _probe_after_sync(self, version: int) -> dict[str, float]:
        """``weight_sync/probe_gap`` of the sync of ``version`` (`sync_check.SyncCheck.probe_metrics`)."""
        return self.sync_check.probe_metrics(version, say=self.is_world_process_zero())

    def _push_weights(self, version: int, again: bool = False) -> dict[str, float]:
        """Every rank: publish the weights as ``version`` (``again``: re-push the current version to a server
        that came back from an outage, `WeightSync.push_current`); then release the worker's generation
        if it waited for weights after an outage that ended before this push began. A push that generation
        waits for (the re-push, or a step's sync that does its work) says so in the log and in ``status.json``
        ``server_status``, and says when generation resumes."""
        seen = self.worker.server_returns_seen() if self.worker is not None else 0
        held = self.worker is not None and self.worker.needs_repush()  # rank 0: generation waits for this push
        url = self.args.vllm_server_base_url
        if held:
            how = "again" if again else "(this step's weight sync)"
            print(f"asyncgrpo: the sampler server at {url} answers again after an outage: pushing the weights of "
                  f"model version {version} {how} before generation resumes", flush=True)
            self._repush_status = f"server back: pushing the weights of model version {version}" + \
                (" again" if again else "")
        start = time.monotonic()
        try:
            sync = self.weight_sync.push_current(version) if again else self.weight_sync.sync(version)
            if getattr(self, "sync_check", None) is not None:  # sampler.check_weight_sync
                sync = {**sync, **self._probe_after_sync(version)}
        finally:
            self._repush_status = None
        if self.worker is not None:
            self.worker.ack_repush(seen)
            if held and not self.worker.needs_repush():
                print(f"asyncgrpo: {'re-pushed' if again else 'pushed'} model version {version} to {url} in "
                      f"{time.monotonic() - start:.1f} s; generation resumes", flush=True)
        return sync

    def _server_status(self) -> str | None:
        """``"server unreachable, retrying (N s left)"`` while the worker or the weight sync waits for the server
        (no wait promised once a stop is under way: `_stop_under_way`); ``"server not answering: ..."`` while it
        accepts connections but does not answer (`ServerWatch`); what the trainer does after an outage (re-push)."""
        from ..sampler.retry import unreachable_text

        sampler_outage = getattr(getattr(self, "sampler", None), "outage", None)
        left = [t for t in (self.worker.server_seconds_left(),
                            sampler_outage.seconds_left() if sampler_outage is not None else None) if t is not None]
        if left:
            return unreachable_text(min(left), self._stop_under_way())
        watch = getattr(self, "server_watch", None)
        return (watch.status() if watch is not None else None) or getattr(self, "_repush_status", None)

    def _teardown_rollouts(self) -> None:
        if getattr(self, "live", None) is not None:
            self.live.stop_ticker()
        self._settle_sync_quietly()  # sampler.weight_sync_overlap: the backend is closed below
        weight_sync = getattr(self, "weight_sync", None)
        if weight_sync is not None:
            weight_sync.close()
        if getattr(self, "server_watch", None) is not None:
            self.server_watch.stop()
        watch = getattr(self, "watch", None)
        if watch is not None:
            watch.stop()
        if self.worker is not None:
            hung = watch is not None and watch.problem is not None  # a dead or hung worker gets no long grace
            self.worker.stop(timeout_s=2.0 if hung else 10.0)
            self.worker = None
        if watch is not None:
            watch.reap()  # the reward pool of a worker that died is re-parented, not gone
        sampler = getattr(self, "sampler", None)
        if sampler is not None:
            sampler.close()

    def _raise_sync_failure(self, exc: BaseException) -> None:
        """Raise a failed weight sync (after its trained step was logged); when the server was silent meanwhile
        (`ServerWatch`), as `ServerHungError` naming that: a timed-out sync is then only the symptom."""
        from .server_watch import ServerHungError

        watch = getattr(self, "server_watch", None)
        silent = watch.silent_s() if watch is not None else None
        if watch is not None and (watch.problem or (silent is not None and silent >= watch.report_after_s)):
            hung = watch.problem or watch.hung_message(silent, gave_up=silent >= watch.timeout_s)
            raise ServerHungError(f"{hung}\n(step {self.state.global_step} is trained; its weight sync failed: "
                                  f"{exc})") from exc
        raise exc

    # ------------------------------------------------------------------------------------ a step's sync
    def _sync_after_step(self, overlap: bool) -> tuple[dict[str, float], BaseException | None]:
        """After an optimizer step: every ``weight_sync_steps`` steps, publish the weights as the next model version.

        ``overlap`` (``sampler.weight_sync_overlap`` on, and not the run's last step): start the sync on the
        background thread and advance ``model_version`` at once; its metrics come when it is settled. Otherwise the
        sync runs here, and the version advances when it succeeded.

        Returns:
            (the sync's ``perf/weight_sync_*`` metrics, seconds: empty when none ran here; a sync failure to raise
            once the step is logged, one process only, else None). A sync that a stop abandoned is said and dropped.

        Raises:
            WeightSyncError: the sync failed with several trainer processes.
        """
        from .weight_sync import WeightSyncError

        if self.state.global_step % self.args.weight_sync_steps != 0:
            return {}, None
        pending = getattr(self, "pending_sync", None)
        if overlap and pending is not None:
            self._settle_sync()  # one at a time (the step's optimizer step settled it already)
            self._sync_step = self.state.global_step
            pending.start(self.model_version + 1,
                          lambda version=self.model_version + 1: self._push_and_publish(version))
            self.model_version += 1
            return {}, None
        self._settle_sync()
        sync, sync_error = {}, None
        try:
            sync = self._push_weights(self.model_version + 1)
            self.model_version += 1
        except WeightSyncError as exc:  # a stop abandoned the wait for a dead server: save this step
            if not self._sync_failed_while_stopping(exc):
                if self.accelerator.num_processes > 1:
                    raise
                sync_error = exc  # the step is trained: log it (its metrics line), then fail and save it
            else:
                say(f"asyncgrpo: step {self.state.global_step} is trained; its weight sync was "
                    f"abandoned by the stop ({exc})")
        return sync, sync_error

    def _push_and_publish(self, version: int) -> dict[str, float]:
        """The overlapped sync's body, on `PendingSync`'s thread: `_push_weights`, then the worker stamps ``version``
        on new groups at once: the server serves it from the sync's ``/resume`` on, and a group started between
        then and the settle (up to a step's forward and backward later) would otherwise carry the version before
        and count one version staler than it is (SPEC B.23). Under `_version_lock`, so that `_tell_worker_served`
        on the trainer's thread cannot hand the worker the older version after it."""
        metrics = self._push_weights(version)
        with self._version_lock:
            self._pushed_version = version
            if self.worker is not None:
                self.worker.set_model_version(version)
        return metrics

    def _served_version(self) -> int:
        """The model version the server serves, which the worker stamps on new groups: the trainer's, but the one
        before while an overlapped sync of the trainer's is in flight and its push has not ended (read by the status
        ticker's thread too)."""
        in_flight = getattr(getattr(self, "pending_sync", None), "version", None)  # None once settled
        if in_flight is None or getattr(self, "_pushed_version", None) == in_flight:
            return self.model_version
        return int(in_flight) - 1

    def _tell_worker_served(self) -> None:
        """Give the worker `_served_version` (after each step), under `_version_lock` (`_push_and_publish`)."""
        with getattr(self, "_version_lock", None) or contextlib.nullcontext():
            self.worker.set_model_version(self._served_version())

    def _settle_sync(self) -> None:
        """Wait for the overlapped weight sync in flight, if any (``sampler.weight_sync_overlap``). Done: its metrics
        and ``perf/weight_sync_wait_s`` go into this step's window (the sync's thread gave the worker the version).
        Failed: the trainer's version goes back to the one the server served; a sync a stop abandoned is said, any
        other failure is raised as without overlap (the step it followed is logged first if it was not yet, then
        `_raise_sync_failure`): the failure path then saves that step, ``global_step`` being still that step.

        Raises:
            WeightSyncError / ServerHungError: the sync failed, and no stop abandoned it.
            BaseException: whatever else the sync raised.
        """
        from .weight_sync import WeightSyncError

        pending = getattr(self, "pending_sync", None)
        if pending is None or not pending.in_flight:
            return
        version = pending.version
        try:
            metrics, waited = pending.settle()
        except WeightSyncError as exc:
            self.model_version = version - 1
            if self._sync_failed_while_stopping(exc):
                say(f"asyncgrpo: step {self._sync_step} is trained; its weight sync was abandoned by the stop ({exc})")
                return
            if getattr(self, "_logged_step", None) != self.state.global_step:
                self._log_window()  # the trained step's metrics line first, as without overlap
            self._raise_sync_failure(exc)
        except BaseException:
            self.model_version = version - 1
            raise
        for name, value in metrics.items():
            self.window.add(name, value)
        self.window.add(WAIT_METRIC, waited)

    def _settle_if_done(self) -> None:
        """`_settle_sync` when the overlapped sync has already ended (no wait), while the next step waits for its
        samples: a failed sync is then raised there, not waited past (at ``max_staleness=0`` the step waits for
        samples of the version that sync never published)."""
        pending = getattr(self, "pending_sync", None)
        if pending is not None and pending.done:
            self._settle_sync()

    def _settle_sync_quietly(self) -> None:
        """On the failure and teardown paths: wait for an overlapped sync still in flight; its failure is said, not
        raised (another error is being reported, or the run ends)."""
        pending = getattr(self, "pending_sync", None)
        if pending is None or not pending.in_flight:
            return
        version = pending.version
        try:
            pending.settle()
        except Exception as exc:  # noqa: BLE001 - said: the run's own outcome is reported elsewhere
            self.model_version = version - 1
            why = "was abandoned by the stop" if self._sync_failed_while_stopping(exc) else "failed"
            say(f"asyncgrpo: step {self._sync_step} is trained; its weight sync {why} ({exc})")
