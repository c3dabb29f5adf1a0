"""Rank 0's pull of one optimizer step from the rollout queue (SPEC §3.1, §6.3, B.6; issues #28, #33): outcomes
are taken until ``gradient_accumulation_steps`` micro-batches of rows are full (or, at ``max_staleness=0``, until
the worker's on-policy round is done), samples too old for ``max_staleness`` are dropped and counted, and the
step's `StepPlan` is made. A mixin of `AsyncGRPOTrainer`, kept here so the trainer's module stays under the
project's size limit; it uses the trainer's ``args``, ``worker``, ``watch``, ``batcher``, positions and window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..rollout.types import PromptOutcome, TrainingSequence
from .batcher import (OVERSIZE_STREAK_LIMIT, MicroBatchPlan, oversize_stop_message, plan_edge_first,
                      record_stale_verdict)

POLL_S = 0.25  # rollout-queue poll while waiting, seconds
ROUND_POLL_S = 0.02  # at max_staleness=0: the poll that also sees a done on-policy round (issue #33), seconds
#: A poll that returns this much later than its timeout did not wait for samples: the trainer's process did not run
#: (SIGSTOP, Ctrl-Z, a frozen machine), seconds. A fresh-user trial's 48 s SIGSTOP counted as waiting, and the idle
#: finding then blamed generation for it over six windows.
STOPPED_OVER_S = 5.0


@dataclass
class StepPlan:
    """What rank 0 decided for one optimizer step, sent to every rank.

    ``rows[m][r]`` are the samples of rank ``r`` in micro-batch ``m``; ``global_trained[m]`` the trained
    tokens of micro-batch ``m`` over all ranks; ``stop`` ends training after this step (a stop or a failure
    plan has no rows: every rank saves the last completed step, then stops or raises ``error``).
    """

    rows: list[list[list[TrainingSequence]]] = field(default_factory=list)
    global_trained: list[int] = field(default_factory=list)
    stop: bool = False
    stop_reason: str = ""  # "epochs done" (train the rest), "stopped" (a signal) or "failed"
    error: str = ""  # with "failed": the rollout worker's traceback or exit signal
    repush: bool = False  # the server came back from an outage: push the current weights, then go on


def pull_outcome(get: Callable[[float], Any], poll_s: float,
                 clock: Callable[[], float] = time.monotonic) -> tuple[Any, float]:
    """Take the next prompt outcome from the rollout queue, and how long training waited for it.

    An outcome already queued costs no wait; otherwise all the time blocked in ``get(poll_s)`` counts,
    whether an outcome arrives during it or not (SPEC §15 ``perf/rollout_wait_s``: time training
    waited because the queue was empty), up to ``poll_s``: a block that ends more than `STOPPED_OVER_S` after
    its timeout is a process that was stopped, not waiting, and counts as ``poll_s``.

    Args:
        get: ``timeout_s -> outcome or None`` (`RolloutWorker.get_outcome`).
        poll_s: longest single block, seconds.

    Returns:
        (the outcome or None, seconds waited).
    """
    outcome = get(0.0)
    if outcome is not None:
        return outcome, 0.0
    start = clock()
    outcome = get(poll_s)
    blocked = clock() - start
    return outcome, poll_s if blocked > poll_s + STOPPED_OVER_S else blocked


class StepPulling:
    """The methods of `AsyncGRPOTrainer` that pull a step's samples (module docstring)."""

    def _target_positions(self) -> int | None:
        if self.args.max_steps > 0 or self.num_prompts is None:
            return None
        return math.ceil(self.args.num_train_epochs * self.num_prompts)

    def _next_step_plan(self) -> StepPlan:
        """Rank 0: pull outcomes until ``gradient_accumulation_steps`` micro-batches are full (SPEC §6.3).

        A step whose every sample went stale while it waited in the batcher (each dropped and counted, B.6) is
        not trained: an optimizer step on no sample would still move the weights (AdamW's momentum on zero
        gradients) and age everything in flight by one version. Pulling starts again instead."""
        oversize_before = self.batcher.dropped_oversize_count
        while True:
            plan = self._pull_step_plan()
            if plan.stop or plan.repush or any(s for rows in plan.rows for row in rows for s in row):
                self._step_oversize = self.batcher.dropped_oversize_count - oversize_before  # over every attempt
                return plan

    def _pull_step_plan(self) -> StepPlan:
        """One attempt of `_next_step_plan`: its rows may all be empty (every pulled sample went stale).

        At ``max_staleness=0`` a step followed by a weight sync takes the worker's whole on-policy round (issue
        #33, `OnPolicyRounds`): it does not close when ``gradient_accumulation_steps`` micro-batches are full (a
        sample left for the next step would be one version too old, i.e. dropped), but when the round is done
        (`_round_done`), with as many micro-batches as the round's samples need."""
        args = self.args
        plans: list[MicroBatchPlan] = getattr(self, "_carried_plans", [])  # kept across a re-push
        self._carried_plans = []
        waited = 0.0
        stop, reason, round_done = False, "", False
        target = self._target_positions()
        on_policy = args.max_staleness == 0 and (self.state.global_step + 1) % args.weight_sync_steps == 0
        poll_s = ROUND_POLL_S if args.max_staleness == 0 else POLL_S
        while on_policy or len(plans) < args.gradient_accumulation_steps:
            self._settle_if_done()  # sampler.weight_sync_overlap: a failed sync is raised, not waited past
            if self._stop_requested:  # save first: the pulled samples stay untrained in the position's accounting
                return StepPlan(stop=True, stop_reason="stopped")
            problem = self.watch.problem if self.watch is not None else None
            if problem is not None:  # found by the timer, even while the queue still holds samples
                return StepPlan(stop=True, stop_reason="failed", error=problem)
            if target is not None and self.pulled.value >= target:
                stop, reason = True, "epochs done"  # every prompt of the last epoch is pulled: train the rest
                break
            outcome, blocked_s = pull_outcome(self.worker.get_outcome, poll_s)
            waited += blocked_s
            if outcome is None:
                if self.watch is not None and self.watch.check() is not None:
                    continue
                if self._round_done(plans):
                    round_done = True  # max_staleness=0: nothing more of this version comes; train what is here
                    break
                self._update_status()
                if self.worker.needs_repush():  # generation waits for it: push before filling the step
                    self._carried_plans = plans
                    self.window.add("perf/rollout_wait_s", waited)
                    return StepPlan(repush=True)
                continue
            self._outcomes_taken += 1
            closed = self._take(outcome)
            plans.extend(closed)
        self._carried_plans = [] if stop or round_done else \
            plan_edge_first(plans, self.batcher, self.model_version, args.max_staleness)
        if stop or round_done:
            last = self.batcher.flush()
            if last is not None:
                plans.append(last)
        for s in self.batcher.dropped[:]:
            self._sample_finished(s)
        self.batcher.dropped.clear()
        for p in plans:  # samples that went stale while waiting in the batcher are not trained either
            p.rows = [[s for s in row if not self._drop_if_stale(s)] for row in p.rows]
        self.window.add("perf/rollout_wait_s", waited)
        return StepPlan(rows=[p.rows for p in plans],
                        global_trained=[sum(s.num_trained_tokens for row in p.rows for s in row) for p in plans],
                        stop=stop, stop_reason=reason)

    def _take(self, outcome: PromptOutcome) -> list[MicroBatchPlan]:
        """Account one outcome; returns micro-batches it closed."""
        target = self._target_positions()
        if target is not None and outcome.position >= target:  # past the last epoch: not trained
            self.worker.mark_consumed(sum(s.num_tokens for s in outcome.samples))
            return []
        self.pulled.finish(outcome.position)
        if outcome.kind != "kept":
            self.position.finish(outcome.position)
            return []
        now = time.monotonic()
        closed = []
        self.position.add_samples(outcome.position, len(outcome.samples))
        self.worker.mark_consumed(sum(s.num_tokens for s in outcome.samples))
        for s in outcome.samples:
            self.sample_position[id(s)] = outcome.position
            self.window.add("sample/time_in_queue_s", now - s.queued_at)
            if self._drop_if_stale(s):
                continue
            plan = self.batcher.add(s)
            if plan is not None:
                closed.append(plan)
            if self.batcher.oversize_streak >= OVERSIZE_STREAK_LIMIT:  # every sample dropped: no step ever fills
                from ..config.rules import ConfigError

                raise ConfigError(oversize_stop_message(self.token_budget, len(s.input_ids),
                                                        self.batcher.oversize_streak,
                                                        key="token_budget (CLI: packing.token_budget)"),
                                  key="token_budget")
        return closed

    def _round_done(self, plans: list[MicroBatchPlan]) -> bool:
        """At ``max_staleness=0``: the worker finished its on-policy round at the current version and every
        outcome it put is taken (issue #33, `OnPolicyRounds`): the step trains now with the rows it has, full or
        not. A done round that left nothing trainable here (its samples were over the token budget) is
        reopened: the worker generates again at this version."""
        if self.args.max_staleness != 0 or self.worker is None:
            return False
        outcomes = self.worker.round_done_outcomes(self.model_version)
        if outcomes is None or self._outcomes_taken < outcomes or self._round_flushed == (self.model_version, outcomes):
            return False
        self._round_flushed = (self.model_version, outcomes)
        if not plans and self.batcher.pending_samples == 0:
            self.worker.reopen_round(self.model_version)
            return False
        return True

    def _drop_if_stale(self, sample: TrainingSequence) -> bool:
        """Drop (and count) a sample more than ``max_staleness`` weight updates behind the policy it would
        train (SPEC §3.1, B.6); returns whether it was dropped."""
        if self.model_version - sample.model_version <= self.args.max_staleness:
            return False
        record_stale_verdict(self.window, sample.num_trained_tokens, self.args.max_completion_length, trained=False)
        if self.worker is not None:
            self.worker.mark_dropped_stale()  # the worker's deadline admission turns on (issue #28)
        self._sample_finished(sample)
        return True

    def _sample_finished(self, sample: TrainingSequence) -> None:
        position = self.sample_position.pop(id(sample), None)
        if position is not None:
            self.position.sample_done(position)
