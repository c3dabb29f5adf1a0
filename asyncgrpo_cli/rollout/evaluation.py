"""Evaluation rounds in the rollout worker (issue #27 item 6, README "Evaluation").

The trainer asks for a round by raising a shared counter to the optimizer step whose weights are to be
evaluated (`RolloutWorker.request_eval`). The worker's ``eval`` task (`EvalRounds._eval_rounds`, started by
`AsyncRolloutLoop.run_async` only when an eval dataset was given) sees the new value, generates one
completion per eval prompt with the weights the server holds now, through the loop's own ``generate_one``
hook, scores them with the same reward functions (and ``reward_weights``), and sends one `EvalResult` to the
trainer on the metrics queue.

Eval rollouts are never training samples: they go to no rollout queue, take nothing from and add nothing to
the staleness token allowance (`allowance.TokenAllowance`), start no group and so move no prompt position.
They share the server with training: each holds one of the loop's concurrency slots (the adaptive cap) while
it runs, and at most half the cap is ever held by eval rollouts, so training groups keep starting.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .advantages import total_rewards, weighted_rewards
from .reward_runner import RewardInputs

EVAL_POLL_S = 0.05  # how often the worker looks for a new eval request, seconds


@dataclass
class EvalResult:
    """One finished eval round, sent from the worker to the trainer on the metrics queue.

    ``step``: the optimizer step the trainer asked the round for; ``model_version``: the policy version the
    server sampled with when the round started; ``metrics``: `eval_metrics`'s dict; ``duration_s``: wall time.
    """

    step: int
    model_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0


def eval_metrics(per_function: Mapping[str, Sequence[float | None]], totals: Sequence[float]) -> dict[str, float]:
    """The logged metrics of one eval round (README "Evaluation").

    Args:
        per_function: reward-function name -> one reward per eval completion (``None`` = the function
            gave none), unweighted, as the functions returned them.
        totals: the total reward of each completion (``reward_weights`` applied, SPEC §3.2's sum), NaN
            when no source scored it; shape ``(N,)``.

    Returns:
        ``eval/reward``: mean total reward over the scored completions; ``eval/rewards/<f>/mean``: mean of
        each function over the completions it scored; ``eval/pass_rate``: share of the scored completions
        whose total reward is > 0; ``eval/num_completions``: completions generated; ``eval/num_scored``:
        those with a total. A value over no completion is NaN (JSON null in metrics.jsonl).
    """
    t = np.asarray(list(totals), dtype=np.float64)
    scored = t[~np.isnan(t)]
    out = {"eval/reward": float(scored.mean()) if scored.size else math.nan,
           "eval/pass_rate": float((scored > 0).mean()) if scored.size else math.nan,
           "eval/num_completions": float(t.size), "eval/num_scored": float(scored.size)}
    for name, values in per_function.items():
        kept = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
        out[f"eval/rewards/{name}/mean"] = sum(kept) / len(kept) if kept else math.nan
    return out


def eval_slot_limit(cap: int) -> int:
    """Most eval rollouts in flight at once under a concurrency cap of ``cap``: half of it, at least one."""
    return max(1, int(cap) // 2)


class EvalRounds:
    """Mixin of `AsyncRolloutLoop`: the ``eval`` task. Needs the loop's ``config``, ``reward_runner``,
    ``generate_one``, ``tools``, ``metrics_queue``, ``model_version_value``, ``cap``, ``_slot_changed``,
    ``_in_flight`` and ``_stop``; ``eval_dataset`` (rows with a ``prompt`` column; other columns reach the
    reward functions) and ``eval_request_value`` (a shared integer: the last step asked for) are set by
    `init_eval`."""

    eval_dataset: Any = None
    eval_request_value: Any = None

    def init_eval(self, eval_dataset, eval_request_value) -> None:
        """Keep the eval prompts and the request counter (both None: no eval task)."""
        self.eval_dataset = eval_dataset
        self.eval_request_value = eval_request_value
        self._eval_done = 0

    @property
    def has_eval(self) -> bool:
        return self.eval_dataset is not None and self.eval_request_value is not None

    async def _eval_rounds(self) -> None:
        """Serve eval requests until the loop stops: one round per new request value (a request raised again
        while a round runs is served by the next round, with the then-current weights)."""
        while not self._stop:
            requested = int(self.eval_request_value.value)
            if requested > self._eval_done:
                result = await self.run_eval_round(requested)
                self._eval_done = requested
                self.metrics_queue.put(result)
            await asyncio.sleep(EVAL_POLL_S)

    async def run_eval_round(self, step: int) -> EvalResult:
        """Generate one completion per eval prompt with the current weights, score them, aggregate.

        Raises:
            whatever a reward function or the sampler raised (the loop reports it like a training failure).
        """
        start = time.monotonic()
        version = int(self.model_version_value.value)
        rows = [self.eval_dataset[i] for i in range(len(self.eval_dataset))]
        limit = asyncio.Semaphore(eval_slot_limit(self.cap.value if self.cap is not None else 1))
        rollouts = await asyncio.gather(*(self._eval_rollout(row, limit) for row in rows))
        columns = {k: [row[k] for row in rows] for k in (rows[0] if rows else {}) if k != "prompt"}
        inputs = RewardInputs([row["prompt"] for row in rows], [r.completion for r in rollouts],
                              [r.completion_ids for r in rollouts], columns)
        result = (await self.reward_runner.score_many([inputs]))[0]
        if isinstance(result, BaseException):
            raise result
        weights = getattr(self.config, "reward_weights", None)
        rollout_rewards = [r.reward for r in rollouts]
        totals = total_rewards(weighted_rewards(list(result.per_function.values()), weights), None,
                               rollout_rewards if any(v is not None for v in rollout_rewards) else None, len(rows))
        return EvalResult(step=step, model_version=version, metrics=eval_metrics(result.per_function, totals),
                          duration_s=time.monotonic() - start)

    async def _eval_rollout(self, row: Mapping[str, Any], limit: asyncio.Semaphore):
        """One eval completion under the eval limit and a concurrency slot of the loop; no allowance, no group."""
        async with limit:
            async with self._slot_changed:
                await self._slot_changed.wait_for(lambda: self._stop or self._in_flight < self.cap.value)
                self._in_flight += 1
                self._slot_changed.notify_all()
            try:
                return await self.generate_one(row["prompt"], self.tools, -1)
            finally:
                async with self._slot_changed:
                    self._in_flight -= 1
                    self._slot_changed.notify_all()
