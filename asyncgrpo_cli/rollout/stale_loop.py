"""The rollout loop's side of `StaleSchedule` (issue #28): re-queued prompts first, deadline admission, and
groups that come back stale (SPEC §3.1, §4.1, B.6). A mixin of `AsyncRolloutLoop`, kept here so the loop's
module stays under the project's size limit; it uses the loop's ``schedule``, ``allowance``, ``config``,
``metrics`` and ``model_version_value``.
"""

from __future__ import annotations

from typing import Any

from .stale_schedule import record_stale_verdict
from .types import TrainingSequence


class StaleScheduling:
    """Methods of `AsyncRolloutLoop` that apply its `StaleSchedule` (see `asyncgrpo_cli.rollout.stale_schedule`)."""

    def _prompts_with_retries(self):
        """`_prompt_stream`, with prompts whose group came back stale first (`StaleSchedule.requeue`)."""
        stream = self._prompt_stream()
        while True:
            yield self.schedule.next_retry() or next(stream)

    def _may_start_group(self, allowance: float) -> bool:
        """The allowance (SPEC §4.1) and the deadline of the groups in flight (`StaleSchedule.can_admit`) agree."""
        if not self.allowance.can_start_group(allowance):
            return False
        new = self.config.num_generations * (self.allowance.tokens_per_rollout or 0.0)
        per_version = allowance / max(int(getattr(self.config, "max_staleness", 4)), 1)
        return self.schedule.can_admit(self.allowance.committed_tokens, new, per_version)

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
        self.allowance.on_samples_discarded(sum(s.num_tokens for seqs in sequences for s in seqs))
        for s in (s for seqs in sequences for s in seqs):
            record_stale_verdict(self.metrics, s.num_trained_tokens, self.config.max_completion_length, False)
        self.metrics.add("rollout/requeued_stale_count", 1)
        return True
