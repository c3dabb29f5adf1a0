"""The rollout loop's side of `StaleSchedule` (issue #28) and `OnPolicyRounds` (issue #33): re-queued prompts
first, deadline admission, groups that come back stale, groups cancelled once they can no longer be trained, and
the on-policy rounds of ``max_staleness=0`` (SPEC §3.1, §4.1, B.6). A mixin of `AsyncRolloutLoop`, kept here so
the loop's module stays under the project's size limit; it uses the loop's ``schedule``, ``rounds``,
``allowance``, ``config``, ``metrics``, the shared values and its group bookkeeping.
"""

from __future__ import annotations

from typing import Any

from .stale_schedule import record_stale_verdict
from .types import PromptOutcome, TrainingSequence


class EpochExhaustedError(RuntimeError):
    """Every prompt of an epoch was rejected by ``filter_prompt`` (SPEC §11): no batch could ever form."""


class StaleScheduling:
    """Methods of `AsyncRolloutLoop` that apply its `StaleSchedule` (see `asyncgrpo_cli.rollout.stale_schedule`)."""

    def _prompt_stream(self):
        """Yields ``(position, row_index, row)`` of accepted prompts from ``dataset_start_index`` on, epoch after
        epoch; a rejected prompt goes to the rollout queue as a ``filtered`` outcome (it counts as consumed)."""
        if not hasattr(self.dataset, "__len__"):  # IterableDataset: restarts from its first prompt (SPEC §12)
            yield from self._stream_prompts()
            return
        n = len(self.dataset)
        epoch, index = divmod(self.dataset_start_index, n) if n else (0, 0)
        accepted_this_epoch = 0
        while True:
            if index >= n:
                if accepted_this_epoch == 0:
                    raise EpochExhaustedError(f"filter_prompt rejected every one of the {n} prompts of epoch {epoch}; "
                                              "no batch could ever reach the trainer (README: Packing and the token budget)")
                epoch, index, accepted_this_epoch = epoch + 1, 0, 0
            row = self.dataset[index]
            position = epoch * n + index
            if self.filter_prompt(index, row, epoch):
                accepted_this_epoch += 1
                yield position, index, row
            else:
                self._put_outcome(PromptOutcome(position=position, row_index=index, kind="filtered"))
            index += 1

    def _stream_prompts(self):
        """`_prompt_stream` of an ``IterableDataset``: epoch after epoch from its first row; positions count
        rows from the start of the run."""
        position, epoch = 0, 0
        while True:
            accepted = seen = 0
            for index, row in enumerate(self.dataset):
                seen += 1
                if self.filter_prompt(index, row, epoch):
                    accepted += 1
                    yield position, index, row
                else:
                    self._put_outcome(PromptOutcome(position=position, row_index=index, kind="filtered"))
                position += 1
            if accepted == 0:
                raise EpochExhaustedError(f"filter_prompt rejected every one of the {seen} prompts of epoch {epoch} "
                                          "of the stream; no batch could ever reach the trainer")
            epoch += 1

    def _prompts_with_retries(self):
        """`_prompt_stream`, with prompts whose group came back stale first (`StaleSchedule.requeue`)."""
        stream = self._prompt_stream()
        while True:
            yield self.schedule.next_retry() or next(stream)

    def _admission_gate(self, allowance: float) -> str | None:
        """None when a new group may start: the allowance (SPEC §4.1) and the deadline of the groups in flight
        (`StaleSchedule.can_admit`) agree; at ``max_staleness=0`` the on-policy round decides instead
        (`OnPolicyRounds.can_start`; its first group still runs alone, SPEC §4.1). Else the gate that holds it
        (`asyncgrpo_cli.rollout.holds.HOLD_GATES`): ``round``, ``allowance`` or ``deadline``.

        Deadline admission counts rollouts in flight at what they are expected to put in the queue
        (`TokenAllowance.expected_queue_tokens`), whichever ``in_flight_estimate`` the allowance uses: a
        group's headroom is in tokens the trainer pulls, and a group dropped for zero reward std is never
        pulled (the one-GPU job, 65-75% of groups dropped, held generation at 100-220 rollouts of 1,024 when
        every rollout in flight counted at the plain mean)."""
        if self.rounds is not None:
            if self.rounds.closed:
                return "round"
            if not self.allowance.first_group_finished:
                return None if self.allowance.can_start_group(allowance) else "allowance"
            return None if self.rounds.can_start(self.allowance.tokens_per_rollout or 0.0) else "round"
        if not self.allowance.can_start_group(allowance):
            return "allowance"
        new = self.config.num_generations * (self.allowance.expected_kept_tokens_per_rollout or 0.0)
        per_version = allowance / max(int(getattr(self.config, "max_staleness", 4)), 1)
        return None if self.schedule.can_admit(self.allowance.expected_queue_tokens, new, per_version) \
            else "deadline"

    def _retry_if_stale(self, group_id: int, stamp: int, position: int, row_index: int, row: dict[str, Any],
                        sequences: list[list[TrainingSequence]]) -> bool:
        """A group back already stale (the trainer would drop all of it, SPEC §3.1) goes back to the front of
        the prompt order instead of being scored; returns whether it did (`StaleSchedule`). Its samples count
        as dropped stale (``sample/dropped_stale_count``, ``sample/dropped_stale_token_frac``, and
        ``sample/trained_frac_*`` of their length class); ``rollout/requeued_stale_count`` counts the group."""
        if not (self.schedule.on_group_finished(group_id, int(self.model_version_value.value), stamp)
                and self.schedule.requeue(position, (position, row_index, row))):
            self.metrics.add("rollout/requeued_stale_count", 0)  # present (0) in windows without a re-queue
            return False
        self.allowance.on_samples_discarded(sum(s.num_tokens for seqs in sequences for s in seqs),
                                            rollouts=len(sequences))
        for s in (s for seqs in sequences for s in seqs):
            record_stale_verdict(self.metrics, s.num_trained_tokens, self.config.max_completion_length, False)
        self.metrics.add("rollout/requeued_stale_count", 1)
        return True

    # ----------------------------------------------------------------------------------- outcomes and rounds
    def _put_outcome(self, outcome: PromptOutcome) -> None:
        """Put one prompt outcome in the rollout queue and count it (the trainer compares the count it took with
        the one a done round published, `_publish_round_done`)."""
        self.rollout_buffer.put(outcome)
        self._outcomes_put += 1

    def _group_resolved(self, group_id: int, kept_tokens: float) -> None:
        """A scored group's outcome is in the queue with ``kept_tokens`` sample tokens (0: dropped)."""
        if self.rounds is not None:
            self.rounds.on_group_resolved(group_id, kept_tokens)
            self._publish_round_done()

    def _group_task_done(self, group_id: int, _task) -> None:
        self._group_tasks.pop(group_id, None)
        self._group_stamps.pop(group_id, None)
        self._cancelling.discard(group_id)

    def _observe_rounds(self) -> None:
        """Feed the round the trainer's versions and step capacity (shared values), then publish a done round."""
        if self.rounds is None:
            return
        version = int(self.model_version_value.value)
        pull = int(self.pull_version_value.value) if self.pull_version_value is not None else version
        capacity = float(self.capacity_value.value) if self.capacity_value is not None else \
            float(self.token_allowance.value)
        if self.rounds.observe(version, max(pull, version), capacity):
            self.metrics.add("rollout/on_policy_round_count", 1)
        if self.round_done_value is not None and int(self.round_done_value[2]) == version:
            with self.round_done_value.get_lock():
                self.round_done_value[2] = -1
            self.rounds.reopen()  # the trainer found nothing trainable in the done round (`reopen_round`)
        self._publish_round_done()

    def _publish_round_done(self) -> None:
        """Once the round is done (`OnPolicyRounds.take_done`), publish ``(version, outcomes put)``: the trainer
        trains the step when it has taken that many outcomes, rows full or not (issue #33)."""
        if self.rounds is None or not self.rounds.take_done():
            return
        value = self.round_done_value
        if value is not None:
            with value.get_lock():
                value[1] = self._outcomes_put
                value[0] = self.rounds.version

    def _doomed(self, stamp: int, pull_version: int) -> bool:
        """A group stamped ``stamp`` can no longer be trained: what the trainer pulls from now on trains at
        ``pull_version`` or later, more than ``max_staleness`` versions past it (SPEC §3.1, B.6)."""
        return pull_version - stamp > int(getattr(self.config, "max_staleness", 4))

    def _cancel_doomed(self) -> None:
        """Cancel the groups in flight that can no longer be trained (`_doomed`): their rollouts stop taking the
        server's time, their prompts go back to the front (`_requeue_cancelled`). Not with an environment: an
        instance interrupted mid-episode could not be handed to another rollout; those groups finish and are
        re-queued when they come back stale, as before (issue #28)."""
        if self.environment_factory is not None or not self._group_tasks:
            return
        version = int(self.model_version_value.value)
        pull = max(version, int(self.pull_version_value.value) if self.pull_version_value is not None else version)
        for group_id, stamp in list(self._group_stamps.items()):
            if stamp and group_id not in self._cancelling and self._doomed(stamp[0], pull):
                task = self._group_tasks.get(group_id)
                if task is not None and not task.done():
                    self._cancelling.add(group_id)
                    task.cancel()

    def _requeue_cancelled(self, group_id: int, stamp: list[int], position: int, row_index: int,
                           row: dict[str, Any]) -> None:
        """Bookkeeping of a group cancelled by `_cancel_doomed` (none of its rollouts was reported): out of the
        allowance, the stale schedule and the round; its prompt back to the front of the prompt order (at most
        ``max_retries`` times, then it reaches the trainer as a ``stale`` outcome: consumed, not trained).
        ``rollout/cancelled_stale_count`` counts the rollouts cancelled."""
        G = self.config.num_generations
        self.allowance.on_group_cancelled(G)
        version = int(self.model_version_value.value)
        pull = max(version, int(self.pull_version_value.value) if self.pull_version_value is not None else version)
        self.schedule.on_group_finished(group_id, pull, stamp[0] if stamp else None)
        if self.rounds is not None:
            self.rounds.on_group_abandoned(group_id)
        self.metrics.add("rollout/cancelled_stale_count", G)
        if not self.schedule.requeue(position, (position, row_index, row)):
            self._put_outcome(PromptOutcome(position=position, row_index=row_index, kind="stale", group_id=group_id))
