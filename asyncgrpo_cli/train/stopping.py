"""How `AsyncGRPOTrainer` stops: stop signals, a lost supervisor, and failures (rank 0 writes the status).

- SIGINT / SIGTERM (`StopHandling._on_stop_signal`): training stops after the step in progress and saves it.
  Any wait for the sampler server in progress or later is abandoned at once (`ServerOutage.abandon`): a
  weight sync retrying against a dead server ends within `sampler.retry.WAKE_S` s, the step it followed is
  complete and is saved. The rollout worker ends its generation at once (`RolloutWorker.begin_stop`: nothing
  it would generate is trained, and it no longer retries against a server that may be gone). ``status.json``
  says ``stopping`` with the reason meanwhile (the supervisor names
  it in `STOP_REASON_FILE` before it signals: "the server exited with code -9", "the supervisor is gone").
  A second signal stops at once, without saving.
- A failure (`StopHandling._on_failure`): the last completed step is saved when that is safe, then
  ``status.json`` gets its final ``failed: <reason>``.
"""

from __future__ import annotations

import re
import signal

from ..run.stop_reason import (STOP_REASON_FILE, clear_stop_reason, own_reason, read_stop_reason,  # noqa: F401
                               stop_fails, stop_reason, stop_under_way, write_stop_reason)


class StopHandling:
    """Mixin of `AsyncGRPOTrainer`: the stop and failure paths (module docstring)."""

    def _on_stop_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        """First signal: stop after this step and save it; abandon any wait for the server. Second: stop now.
        Only sets attributes (no lock is taken: the main thread may hold any)."""
        if self._stop_requested:  # a second signal: stop now, without saving
            self._second_signal = signum
            raise KeyboardInterrupt
        self._stop_requested = True
        self._signal = signum
        self._stop_reason = stop_reason(self.args.output_dir, signum)
        outage = getattr(getattr(self, "sampler", None), "outage", None)
        if outage is not None:
            outage.abandon(f"{self._stop_reason}: the trainer stops")
        worker = getattr(self, "worker", None)
        if worker is not None:  # nothing it generates now would be trained: it stops retrying, and ends
            worker.begin_stop()

    def _stop_under_way(self) -> str | None:
        """Why the job is already stopping, for a line about the server's outage (which then promises no wait): a
        stop signal's reason, or the supervisor's, which saw the server it started exit and is about to signal
        (`run.stop_reason.stop_under_way`); None otherwise."""
        if self._stop_requested:
            return getattr(self, "_stop_reason", None) or "stop requested"
        return stop_under_way(self.args.output_dir)

    def _stopping_status(self) -> dict:
        """``status.json`` fields while a stop is under way (merged by the status ticker)."""
        if not self._stop_requested:
            return {}
        return {"stopping": f"{getattr(self, '_stop_reason', 'stop requested')}: saving the last completed "
                            f"step (step {self.state.global_step}) and stopping"}

    def _stopped_status(self) -> dict:
        """``status.json``'s final fields after a stop: ``state: stopped``; or, when the supervisor stopped the
        trainer because the job failed (its server died: `run.stop_reason.stop_fails`), ``failed: <its reason>``
        with ``trainer_state: stopped``, which the supervisor then completes (`launch.job_files.finalize_status`).
        Before, the file read ``stopped`` for the seconds until the supervisor wrote ``failed`` (a fresh-user
        trial's ``kill -9`` of the server)."""
        reason = getattr(self, "_stop_reason", None) or "stop requested"
        said = read_stop_reason(self.args.output_dir)
        if not own_reason and said and stop_fails(self.args.output_dir):
            return {"state": f"failed: {said}", "trainer_state": "stopped", "note": f"stopped by {reason}"}
        return {"state": "stopped", "note": f"stopped by {reason}"}

    @property
    def exit_code(self) -> int:
        """What the CLI returns after `train`: 0, or 130 / 143 when SIGINT / SIGTERM stopped it."""
        if not self._stop_requested:
            return 0
        return 143 if getattr(self, "_signal", None) == signal.SIGTERM else 130

    def _sync_failed_while_stopping(self, exc: BaseException) -> bool:
        """Whether a failed weight sync only failed because a stop abandoned the wait for the server (one
        process: the step is complete and is saved; with more ranks the others may wait in a collective).

        A stop is under way from a signal (``_stop_requested``), or from this process's own watchdog, which has
        seen the supervisor gone and is about to send this process SIGTERM (`own_reason`, filled before the
        signal): the server the supervisor started dies with it, and a sync that then fails before the signal's
        handler has run is the same stop (a suite run under load had the trainer take the failure path instead and
        die of that SIGTERM once the failure path had given the default handler back)."""
        stopping = self._stop_requested or bool(own_reason)
        return bool(stopping and self.accelerator.num_processes == 1)

    def _on_failure(self, model, trial, exc: BaseException) -> None:
        """A failure left the loop: save the last completed step when that is safe (one process, not inside
        the optimizer step), then write the final ``failed: <reason>`` (or ``stopped``) status."""
        from .checkpoint import CheckpointError

        saved = None
        if isinstance(exc, KeyboardInterrupt):
            if self.live is not None:
                second = getattr(self, "_second_signal", None)
                name = signal.Signals(second).name if second is not None else "signal"
                self.live.update(force=True, state="stopped", step=self.state.global_step,
                                 note=f"a second stop signal ({name}) while saving the last completed step: "
                                      "stopped without saving")
            return
        self._settle_sync_quietly()  # sampler.weight_sync_overlap: a sync still in flight ends before the save
        can_save = (self.accelerator.num_processes == 1 and not getattr(self, "_in_optimizer_step", False)
                    and self.state.global_step > getattr(self, "_last_saved_step", 0)
                    and getattr(self, "position", None) is not None and not isinstance(exc, CheckpointError))
        note = ""
        if can_save:
            try:
                saved = self._save_checkpoint_with_position(model, trial)
                note = f"; checkpoint {saved} saved"
            except Exception as save_exc:  # noqa: BLE001 - report the original failure
                note = f"; no checkpoint could be written ({save_exc})"
        elif self.state.global_step <= getattr(self, "_last_saved_step", 0):
            note = "; nothing trained since the last checkpoint"
        else:
            note = f"; no checkpoint written: {self._why_not_saved(exc)}"
        if self.live is not None:
            reason = f"{type(exc).__name__}: {exc}"
            lines = reason.splitlines()
            cause = [ln for ln in lines[1:] if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", ln)]
            summary = lines[0] + (f" {cause[-1]}" if cause else "")
            self.live.update(force=True, state=f"failed: {summary[:300]}",
                             last_error=(reason + note)[:4000], step=self.state.global_step)
        if saved is not None and hasattr(exc, "add_note"):
            exc.add_note(f"asyncgrpo: checkpoint {saved} (step {self.state.global_step}) was saved before exiting")

    def _why_not_saved(self, exc: BaseException) -> str:
        """Why `_on_failure` could not save after a failure, and which checkpoint holds the last saved step."""
        from .checkpoint import CheckpointError

        if isinstance(exc, CheckpointError):
            why = "the checkpoint write itself failed"
        elif self.accelerator.num_processes > 1:
            why = (f"with {self.accelerator.num_processes} trainer processes, the others may be inside a collective "
                   f"the failed one never joins, so a save could hang or tear")
        elif getattr(self, "_in_optimizer_step", False):
            why = "the failure came inside the optimizer step, so the weights may be half updated"
        else:
            why = "no rollout position to resume from yet"
        last = getattr(self, "_last_saved_step", 0)
        return why + (f"; checkpoint-{last} holds the last saved step" if last > 0 else "; no earlier checkpoint")
