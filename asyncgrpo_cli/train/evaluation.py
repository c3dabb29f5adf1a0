"""The trainer's side of evaluation (issue #27 item 6, README "Evaluation").

`EvalSchedule` (pure) decides when a round is asked for: with ``eval_strategy="steps"`` after every
``eval_steps``-th optimizer step, and once more after the last step of a run that ends normally (``max_steps``
reached or the epochs done) unless that step already had one. One round at a time: a round due while the
previous one still runs is skipped (counted in ``eval/skipped_rounds``), never queued behind it.

`TrainerEvaluation` is the glue on rank 0: it asks the rollout worker (`RolloutWorker.request_eval`), collects
`EvalResult`s after each step, and writes each round once: one ``metrics.jsonl`` record (`EVAL_EVENT`) and one
log to the trackers. At the end of a run the trainer waits for the last rounds (at most
``vllm_server_timeout`` seconds each) before it saves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..config.eval_rules import strategy_name

WAIT_POLL_S = 0.1  # polling the worker's metrics queue while the run's last rounds finish, seconds


@dataclass
class EvalSchedule:
    """When eval rounds are asked for. ``eval_steps`` 0 = evaluation off. Steps are optimizer steps (>= 1).

    ``requested``: the step of the last round asked for (0 = none); ``received``: the step of the last round
    whose result arrived; ``skipped``: rounds that were due while another one ran.
    """

    eval_steps: int = 0
    requested: int = 0
    received: int = 0
    skipped: int = 0

    @property
    def enabled(self) -> bool:
        return self.eval_steps > 0

    @property
    def in_flight(self) -> bool:
        """A round was asked for and its result has not arrived."""
        return self.requested > self.received

    def due(self, step: int, final: bool = False) -> bool:
        """Whether to ask for a round after optimizer step ``step`` (``final``: the run's last step). A periodic
        round due while one is in flight is counted as skipped; the final one waits for it (the caller waits)."""
        if not self.enabled or step <= self.requested:
            return False
        if not (final or step % self.eval_steps == 0):
            return False
        if self.in_flight:
            if not final:
                self.skipped += 1
            return False
        return True

    def request(self, step: int) -> None:
        self.requested = max(self.requested, int(step))

    def receive(self, step: int) -> None:
        self.received = max(self.received, int(step))


def nan_to_none(logs: dict[str, Any]) -> dict[str, Any]:
    """NaN values (a round with no scored completion) as None, so metrics.jsonl holds null, not NaN."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in logs.items()}


def eval_log(result, skipped: int = 0) -> dict[str, float]:
    """The ``metrics.jsonl`` / tracker entries of one `EvalResult`: its metrics, ``eval/step`` (the step whose
    weights were evaluated), ``eval/model_version``, ``eval/duration_s`` and ``eval/skipped_rounds``."""
    return nan_to_none({**result.metrics, "eval/step": float(result.step), "eval/model_version": float(result.model_version),
            "eval/duration_s": float(result.duration_s), "eval/skipped_rounds": float(skipped)})


EVAL_EVENT = "eval"
"""``metrics.jsonl`` records of eval rounds: ``{"event": "eval", "step": S, "time": t, "eval/...": ...}``, ``S`` the
optimizer step whose weights were evaluated (an event record, so the windows' step sequence stays as it is)."""


class TrainerEvaluation:
    """Rank 0's eval rounds for `AsyncGRPOTrainer` (see the module docstring).

    Args:
        args: the `AsyncGRPOConfig` (``eval_strategy``, ``eval_steps``, ``vllm_server_timeout``).
        has_eval_dataset: whether an eval dataset was given (without one evaluation is off).
    """

    def __init__(self, args, has_eval_dataset: bool) -> None:
        on = has_eval_dataset and strategy_name(args.eval_strategy) == "steps"
        self.schedule = EvalSchedule(int(args.eval_steps) if on else 0)
        self.wait_s = float(args.vllm_server_timeout)

    def collect(self, trainer) -> None:
        """Drain the worker's metrics queue (window snapshots go to the trainer's window) and write each eval
        result that arrived: one ``metrics.jsonl`` record (`EVAL_EVENT`) and one tracker log per round."""
        worker = trainer.worker
        if worker is None:
            return
        for snapshot in worker.drain_metrics():
            trainer.window.merge(snapshot)
        for result in worker.take_eval_results():
            self.schedule.receive(result.step)
            logs = eval_log(result, self.schedule.skipped)
            trainer.log({k: v for k, v in logs.items() if v is not None})
            if trainer.live is not None:
                trainer.live.append_metrics({"event": EVAL_EVENT, "step": result.step, "time": time.time(), **logs})

    def after_step(self, trainer, step: int, final: bool = False) -> None:
        """After optimizer step ``step``: write the rounds that came back, ask for one when due. ``final`` (the
        run ends normally after this step): wait for the round in flight, ask for the last one unless ``step``
        had one, and wait for it (at most ``vllm_server_timeout`` seconds each)."""
        if not self.schedule.enabled or trainer.worker is None:
            return
        self.collect(trainer)
        if final:
            self._wait(trainer)
        if self.schedule.due(step, final=final):
            settle = getattr(trainer, "_settle_sync", None)
            if settle is not None:  # an overlapped weight sync first (sampler.weight_sync_overlap): the round
                settle()  # samples this step's weights, under its version
            self.schedule.request(step)
            trainer.worker.request_eval(step)
            if final:
                self._wait(trainer)

    def _wait(self, trainer) -> None:
        deadline = time.monotonic() + self.wait_s
        while self.schedule.in_flight:
            self.collect(trainer)
            if not self.schedule.in_flight:
                return
            trainer.worker.check_alive()  # an eval round that failed fails the run (RolloutWorkerError)
            if time.monotonic() > deadline:
                print(f"asyncgrpo: the eval round of step {self.schedule.requested} did not finish within "
                      f"vllm_server_timeout={self.wait_s:g} s; the run ends without it", flush=True)
                self.schedule.receive(self.schedule.requested)
                return
            time.sleep(WAIT_POLL_S)


def check_eval_inputs(args, eval_dataset, reward_funcs, environment_factory=None) -> None:
    """The constructor's eval checks (`AsyncGRPOTrainer`): the strategy and steps, the eval dataset's rows and
    the reward functions' columns in it (ground truth included). An eval dataset with ``eval_strategy="no"``
    is kept but never evaluated (a warning says so).

    Raises:
        ConfigError / ConfigErrors (ValueErrors): naming the field, the value and the fix.
    """
    import warnings

    from ..config.eval_rules import check_eval_dataset, check_eval_setup

    check_eval_setup(args.eval_strategy, args.eval_steps, eval_dataset is not None,
                     eval_on_start=bool(getattr(args, "eval_on_start", False)),
                     environment=environment_factory is not None and eval_dataset is not None)
    if eval_dataset is None:
        return
    check_eval_dataset(eval_dataset, list(reward_funcs or []), "eval_dataset")
    if strategy_name(args.eval_strategy) == "no":
        warnings.warn("eval_dataset is given but eval_strategy='no': it is never evaluated. Set "
                      "eval_strategy='steps' and eval_steps=N to evaluate it", UserWarning, stacklevel=3)
