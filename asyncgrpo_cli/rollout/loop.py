"""`AsyncRolloutLoop`: generates, scores and queues rollouts in the spawned worker (SPEC §3.1, §4, §11, §16.5).

One asyncio event loop runs four kinds of tasks:

- the *producer* walks the prompts (epochs, ``filter_prompt``), waits while the staleness token allowance
  is used up (``rollout/backpressure_s``), and starts one task per group;
- each *group task* stamps the model version, runs ``num_generations`` rollouts (each holds a concurrency
  slot under the adaptive cap while it runs), reconciles turns into samples and hands the group to the
  bounded score queue (``rollout/score_block_s`` while it is full);
- the *scorer* runs the reward functions, ``compute_advantages`` and the drop rule, and puts kept samples
  into the cross-process rollout queue;
- the *monitor* beats the heartbeat, reads the server's ``/metrics`` every 5 s for the adaptive cap, reads
  the trainer's consumption counter, and ships metric windows to the trainer.

The hooks (``filter_prompt``, ``generate_one``, ``generate_one_turn``, ``compute_advantages``, ``setup``,
``close``) are the customisation points of SPEC §11; Appendix B.19 fixes which are coroutines.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import math
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .metrics import MetricsWindow
from ..config.multimodal import check_text_only
from .advantages import group_advantages, group_reward_std, should_drop_group, total_rewards, weighted_rewards
from .allowance import TokenAllowance
from .concurrency import ConcurrencyCap
from .holds import HoldClock, held_metric
from .completions import ship_group_records
from .evaluation import EvalRounds
from .environments import (ENVIRONMENT_COLUMN, EnvironmentHookError, EnvironmentPool, compose_prompt,
                           environment_tools, route_environment)
from .no_signal import NoLearningSignalError, NoSignalWatch
from .reward_runner import RewardInputs, RewardRunner
from .sequences import ReconcileStats, rollout_to_sequences, untrained_stub
from .stale_loop import EpochExhaustedError, StaleScheduling  # noqa: F401 - EpochExhaustedError: public here
from .stale_schedule import StaleSchedule
from .on_policy import OnPolicyRounds
from .rollout_metrics import record_rollout_metrics
from .requests import RequestPaths, _RolloutResult
from ..run.stop_reason import stop_under_way
from ..sampler.server_load import request_time_means
from .tool_loop import run_tool_loop, static_tool_names
from .tools import ToolBox, is_async_tool
from .types import PromptOutcome, Rollout, RolloutGroup, TrainingSequence, TurnRecord

logger = logging.getLogger(__name__)

METRICS_POLL_S = 5.0       # SPEC §4.2: /metrics every 5 seconds
HEARTBEAT_S = 1.0          # heartbeat and consumption-counter period, seconds
METRICS_SHIP_S = 1.0       # how often a metrics snapshot goes to the trainer, seconds
#: The generation rates of a window (`AsyncRolloutLoop.ship_metrics`): amounts of finished rollouts over the
#: seconds the worker generated; a window that a stop cut short leaves them out (`AsyncGRPOTrainer._log_window`).
GENERATION_RATES = ("rollout/generated_tokens_per_s", "rollout/rollouts_per_s", "rollout/groups_per_s")
SCORERS = 4                # scoring batches at once: slow rewards (math-verify) left generation blocked otherwise


class AsyncRolloutLoop(EvalRounds, StaleScheduling, RequestPaths):
    """Generates and scores rollouts for `AsyncGRPOTrainer` in the spawned worker process (SPEC §16.5).

    Subclass it, override a hook, and set the subclass as the trainer's ``loop_cls``. Hooks read
    ``self.config`` (the `AsyncGRPOConfig`) and ``self.tokenizer``.

    Beyond SPEC §16.5's arguments:
        consumed_tokens_value: shared counter of sample tokens the trainer has pulled from the rollout
            queue (monotonic); the worker subtracts it from its queued tokens (Appendix B.4).
        concurrency_value / cap_value: shared values the worker publishes for the dashboard.
        client: a ready `SamplerClient` (tests); None = one built from the config in ``run``.
        server_values: ``(down_until, returns, repushed)`` shared values of server outages (SPEC B.17):
            the worker publishes when it gives up on an unreachable server (wall clock, 0 = reachable)
            and counts the outages it saw end; after each, generation waits until the trainer has
            re-pushed its weights (``repushed`` reaches the count) for at most ``vllm_server_timeout``.
        eval_dataset / eval_request_value: eval prompts and the shared step counter the trainer raises to ask
            for an eval round (`rollout.evaluation.EvalRounds`; never trained, outside the allowance).
        stale_dropped_value: shared running count of samples the trainer dropped as too old; each new drop turns
            deadline admission on or restarts its release count (`StaleSchedule.on_dropped_stale`, issue #28).
        scorers: scoring batches in flight at once (default `SCORERS`). Each scorer takes every group
            waiting when it wakes (one batch: cheap rewards cost one thread hop per batch); several let a
            slow reward (math-verify, a judge) work on more than one batch. Synchronous reward functions
            run in threads, so with ``scorers > 1`` one may be called for two batches at once: keep it
            thread-safe, or pass ``scorers=1``.

    Agent training (SPEC §13): ``tools`` are shown to the model through the chat template and run between
    turns (sync ones on a thread pool of ``max_concurrent_rollouts`` threads, async ones on the loop);
    ``environment_factory`` gives each in-flight rollout an environment instance whose public methods are
    tools, whose ``reset`` makes the prompt and whose ``get_reward`` is one more reward source.
    """

    metrics_poll_s: float = METRICS_POLL_S
    """Seconds between ``/metrics`` reads (SPEC §4.2); a class attribute so tests can shorten it."""

    freeze_startup_heap: bool = True
    """After ``setup``, move every object alive (modules, tokenizer, dataset, reward functions) out of the
    cyclic garbage collector's reach (``gc.freeze``) until the loop stops. The loop allocates per-token
    lists fast enough to trigger a full collection once or twice a second, and each one rescanned the
    ~430k start-up objects of a worker (transformers, tokenizer, datasets): 20-30% of the loop's time on
    a 2-core machine (P6 in scripts/bench/NOTES.md)."""

    def __init__(self, config, model_name: str, dataset, reward_funcs, processing_class, eos_token_ids: list[int],
                 rollout_buffer, model_version_value, token_allowance, heartbeat_value, failed_event,
                 exception_info_queue, metrics_queue, tools=None, environment_factory=None,
                 score_queue_maxsize: int = 16, lora_name: str | None = None, dataset_start_index: int = 0,
                 consumed_tokens_value=None, concurrency_value=None, cap_value=None, client=None,
                 scorers: int = SCORERS, server_values=None, eval_dataset=None, eval_request_value=None,
                 stale_dropped_value=None, pull_version_value=None, capacity_value=None,
                 round_done_value=None) -> None:
        self.config = config
        self.init_eval(eval_dataset, eval_request_value)  # README "Evaluation" (rollout/evaluation.py)
        self.model_name = model_name
        self.dataset = dataset
        self.reward_runner = RewardRunner(list(reward_funcs or []))
        self.tokenizer = processing_class
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.rollout_buffer = rollout_buffer
        self.model_version_value = model_version_value
        self.token_allowance = token_allowance
        self.heartbeat_value = heartbeat_value
        self.failed_event = failed_event
        self.exception_info_queue = exception_info_queue
        self.metrics_queue = metrics_queue
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.environments: EnvironmentPool | None = None
        self.tool_executor: ThreadPoolExecutor | None = None
        self._toolboxes: dict[tuple, ToolBox] = {}
        self._tool_names = static_tool_names(self.tools, environment_factory)  # counters logged as 0 when idle
        self.score_queue_maxsize = score_queue_maxsize
        if int(scorers) < 1:
            raise ValueError(f"scorers={scorers!r}: at least one group must be scored at a time; use 1 or more")
        self.scorers = int(scorers)
        self.lora_name = lora_name
        self.dataset_start_index = dataset_start_index
        self.consumed_tokens_value = consumed_tokens_value
        self.stale_dropped_value = stale_dropped_value
        self._stale_drops_seen = 0
        self.concurrency_value = concurrency_value
        self.cap_value = cap_value
        self.client = client
        self._own_client = client is None
        self.server_values = server_values
        self.allowance = TokenAllowance(str(getattr(config, "in_flight_estimate", "mean")))  # mean (B.4) or kept
        self.holds = HoldClock()  # what holds the producer, per gate (rollout/held_{gate}_frac)
        self.schedule = StaleSchedule(int(getattr(config, "max_staleness", 4)),  # issue #28: no prompt left behind
                                      release_after_versions=getattr(config, "deadline_release_versions", None),
                                      order=str(getattr(config, "deadline_order", "pessimistic")))
        self.pull_version_value = pull_version_value
        self.capacity_value = capacity_value
        self.round_done_value = round_done_value
        # max_staleness=0: one round of generation per model version (issue #33, rollout/on_policy.py)
        self.rounds = OnPolicyRounds() if int(getattr(config, "max_staleness", 4)) == 0 else None
        self._outcomes_put = 0  # prompt outcomes put in the rollout queue (the trainer counts what it took)
        self._group_stamps: dict[int, list[int]] = {}  # group id -> [model version], once its first rollout starts
        self._group_tasks: dict[int, asyncio.Task] = {}
        self._cancelling: set[int] = set()
        self.no_signal = NoSignalWatch(int(getattr(config, "max_groups_without_signal", 0) or 0))
        self.cap: ConcurrencyCap | None = None
        self.metrics = MetricsWindow()
        self._in_flight = 0
        self._waiting_rollouts = 0  # rollouts of started groups still waiting for a concurrency slot
        self._slot_changed: asyncio.Condition | None = None
        self._group_counter = 0
        self._groups_in_progress: set[asyncio.Task] = set()
        self._last_preemptions: int | None = None
        self._last_load = None  # the previous /metrics scrape (its request-time counters)
        self._generated_tokens = 0
        self._rollouts_done = 0  # rollouts / groups generated since the last metrics shipment
        self._groups_done = 0
        self._last_ship = time.monotonic()
        self._stop = False
        self.ready_event = None  # set by the worker process; signalled once connected and set up
        self._group_error: BaseException | None = None
        self._rendered: dict[str, list[int]] = {}  # prompt rendering cache (render_prompt)

    # ----------------------------------------------------------------------------------- hooks
    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Return False to skip this prompt for this epoch (it still counts as consumed). Default: accept all."""
        return True

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list, group_id: int = 0) -> Rollout:
        """One rollout of ``prompt``: the multi-turn tool loop (SPEC §13.1, §16.5).

        Each turn renders the whole conversation with the chat template (``tools`` passed to it) and samples
        one reply. Without tools that single reply is the rollout. With tools, the reply's calls run one after
        the other in emitted order, each result appended as a ``tool`` message, and the next turn is generated;
        the loop ends at a reply without calls, a reply cut at ``max_completion_length``, or when a reply still
        calls tools after ``max_tool_calling_iterations`` tool turns (``Rollout.loop_exhausted``; its calls
        are not run). Tool failures (unknown name, malformed JSON, an exception, a timeout) are tool messages
        the model reads, counted in ``Rollout.tool_failure_count``. The tool turns are
        `asyncgrpo_cli.rollout.tool_loop.run_tool_loop`.
        """
        toolbox = self.toolbox(tools)
        if not toolbox:
            turn = await self.generate_one_turn(self.render_prompt(prompt))
            text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
            return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=list(turn.output_ids),
                           turns=[turn])
        return await run_tool_loop(self, prompt, toolbox)

    @property
    def tool_call_timeout(self) -> float | None:
        """Seconds a tool call may run (``tool_call_timeout``; None = no limit)."""
        return getattr(self.config, "tool_call_timeout", None)

    def toolbox(self, tools: list) -> ToolBox:
        """The `ToolBox` of ``tools`` (cached for the standalone tools; environment methods are bound per
        instance, their schemas cached per class)."""
        if not tools:
            return ToolBox()
        key = tuple(id(t) if not hasattr(t, "__self__") else (id(t.__self__), t.__name__) for t in tools)
        box = self._toolboxes.get(key)
        if box is None:
            box = ToolBox(tools)
            self._tool_names.update(box.names)
            if len(self._toolboxes) >= 4096:
                self._toolboxes.pop(next(iter(self._toolboxes)))
            self._toolboxes[key] = box
        return box

    def render_prompt(self, prompt: list[dict[str, Any]], tools: list[dict] | None = None,
                      cache: bool = True) -> list[int]:
        """Token ids of ``prompt`` through the chat template with a generation prompt; ``tools`` are the tool
        schemas shown to the model (the template's ``tools=``). The last few renderings are cached: the
        ``num_generations`` rollouts of a group render the same prompt (``cache=False``: a one-off rendering)."""
        key = json.dumps([prompt, [t["function"]["name"] for t in tools or []]], sort_keys=True, default=str) \
            if cache else None
        ids = self._rendered.get(key) if cache else None
        if ids is None:
            check_text_only([prompt], "prompt")  # images are not supported (SPEC §14)
            kwargs = dict(self.config.chat_template_kwargs or {})
            if tools:
                kwargs["tools"] = tools
            encoded = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **kwargs)
            ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
            if not cache:
                return ids
            if len(self._rendered) >= 256:
                self._rendered.pop(next(iter(self._rendered)))
            self._rendered[key] = ids
        return list(ids)

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's sampling settings (SPEC §16.5) → a `TurnRecord`.

        A request that named an adapter a restarted server no longer has (HTTP 404 after an outage ended
        while it waited; only the current adapter is re-pushed, SPEC B.17) is sent once more under the
        current adapter."""
        result = (await self._request(lambda model: self.client.generate_turn(prompt_ids, self.sampling,
                                                                              model=model)))
        self._record_request(result)
        return result.to_turn_record()

    def served_model(self) -> str:
        """The ``model`` a request names: the current adapter (``lora_name`` formatted with the model version,
        adapter sync, SPEC §9) once one exists, else the base model."""
        version = int(self.model_version_value.value)
        if self.lora_name and version > 0:
            return self.lora_name.format(version=version)
        return self.model_name

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: reward standardised within the group (``scale_rewards``), NaN → 0 (SPEC §3.2, B.7)."""
        return group_advantages(group.rewards, getattr(self.config, "scale_rewards", "group"))

    async def setup(self) -> None:
        """Create resources the other hooks need; runs on the loop before the first prompt."""

    async def close(self) -> None:
        """Release what ``setup`` created; runs when the loop stops, failure included."""

    # ----------------------------------------------------------------------------------- running
    @functools.cached_property
    def sampling(self):
        """The config's sampling settings as `SamplingParams` (built once)."""
        from ..sampler.client import SamplingParams

        c = self.config
        return SamplingParams(max_tokens=c.max_completion_length, temperature=c.temperature, top_p=c.top_p,
                              top_k=c.top_k, min_p=c.min_p, repetition_penalty=c.repetition_penalty,
                              logprobs=c.num_sampler_logprobs,
                              return_sampling_mask=bool(c.top_k > 0 or c.top_p < 1 or (c.min_p or 0) > 0))

    def run(self) -> None:
        """Run until stopped or failed; a failure sets ``failed_event`` with the traceback queued."""
        try:
            asyncio.run(self.run_async())
        except BaseException as exc:  # noqa: BLE001 - everything must reach the trainer
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                self.report_failure(exc)
            raise

    def report_failure(self, exc: BaseException) -> None:
        """Queue the traceback for the trainer and set the failure event."""
        if getattr(exc, "report_without_traceback", False):  # a diagnosis for the user, not a bug
            text = f"{type(exc).__name__}: {exc}"
        else:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            self.exception_info_queue.put(text)
        finally:
            self.failed_event.set()

    async def run_async(self) -> None:
        """The worker's main coroutine: connect, set up, then produce/score until stopped."""
        from ..sampler.client import SamplerClient

        self._slot_changed = asyncio.Condition()
        if self.client is None:
            self.client = SamplerClient(self.config.vllm_server_base_url,
                                        max_concurrency=self.config.max_concurrent_rollouts,
                                        timeout_s=self.config.vllm_server_timeout,
                                        after_outage=self._wait_for_repush if self.server_values else None,
                                        request_seeds=bool(getattr(self.config, "request_seeds", True)))
            # the supervisor saw the server it started exit: the outage's line promises no wait then
            self.client.outage.stop_under_way = functools.partial(stop_under_way,
                                                                   getattr(self.config, "output_dir", None))
        score_queue: asyncio.Queue = asyncio.Queue(maxsize=self.score_queue_maxsize)
        self._running_loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        tasks: list[asyncio.Task] = []
        frozen = False
        if self.tools or self.environment_factory is not None:
            # SPEC §13.1: sync tools (and reset/get_reward) on a pool of max_concurrent_rollouts threads.
            self.tool_executor = ThreadPoolExecutor(max_workers=int(self.config.max_concurrent_rollouts),
                                                    thread_name_prefix="asyncgrpo-tool")
            from .chat_templates import training_chat_template

            patched = training_chat_template(self.tokenizer)
            if patched is not None:
                self.tokenizer.chat_template = patched
        if self.environment_factory is not None:
            self.environments = EnvironmentPool(self.environment_factory, self.tool_executor)
        try:
            await self.client.wait_until_ready(self.config.vllm_server_timeout)
            load = await self._poll_load()
            self.cap = ConcurrencyCap.from_server_load(self.config.max_concurrent_rollouts, load,
                                                        await self._server_max_model_len())
            await self.setup()
            if self.freeze_startup_heap:
                gc.collect()  # start-up garbage first: frozen objects are never collected
                gc.freeze()
                frozen = True
            if self.ready_event is not None:
                self.ready_event.set()
            tasks = [asyncio.create_task(self._monitor(), name="monitor"),
                     *(asyncio.create_task(self._scorer(score_queue), name=f"scorer-{i}") for i in range(self.scorers)),
                     asyncio.create_task(self._producer(score_queue), name="producer"),
                     *([asyncio.create_task(self._eval_rounds(), name="eval")] if self.has_eval else [])]
            stopper = asyncio.create_task(self._stop_event.wait(), name="stop")
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            for task in done:
                if task is not stopper and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            if self._group_error is not None:
                raise self._group_error
        finally:
            self._stop = True
            for task in [*tasks, *self._groups_in_progress]:
                task.cancel()
            await asyncio.gather(*tasks, *self._groups_in_progress, return_exceptions=True)
            try:
                await self.close()
            finally:
                if frozen:
                    gc.unfreeze()  # back to the oldest generation: collectable again
                if self._own_client and self.client is not None:
                    await self.client.aclose()
                if self.tool_executor is not None:  # a hung sync tool must not hold the worker's exit
                    self.tool_executor.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        """Ask a running loop to stop (thread-safe); ``run_async`` then cancels its tasks and calls ``close``."""
        self._stop = True
        loop = getattr(self, "_running_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._stop_event.set)

    async def _wait_for_repush(self) -> None:
        """The server answers again after an outage (it may have restarted with its original weights):
        count it for the trainer and hold generation until the trainer has pushed its current weights.

        Raises:
            RuntimeError: no re-push within ``vllm_server_timeout`` seconds.
        """
        _, returns, repushed = self.server_values
        with returns.get_lock():
            returns.value += 1
            ticket = int(returns.value)
        timeout_s = float(self.config.vllm_server_timeout)
        deadline = time.monotonic() + timeout_s
        while int(repushed.value) < ticket and not self._stop:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sampler server at {self.config.vllm_server_base_url} came back after an "
                                   f"outage, but the trainer did not push its weights to it within "
                                   f"vllm_server_timeout={timeout_s:g} s; generation cannot go on with the "
                                   "server's original weights")
            await asyncio.sleep(0.05)

    async def _server_max_model_len(self) -> int | None:
        """The served model's ``max_model_len`` from ``/v1/models`` (the unit of the initial cap, SPEC §4.2)."""
        try:
            return int(await self.client.max_model_len())
        except Exception:  # noqa: BLE001 - a server without it still works; the cap then starts at the ceiling
            return None

    # ----------------------------------------------------------------------------------- producer
    async def _producer(self, score_queue: asyncio.Queue) -> None:
        G = self.config.num_generations
        for position, row_index, row in self._prompts_with_retries():
            while True:
                waited = None
                while not self._stop:
                    self._sync_consumed()
                    gate = self._admission_gate(float(self.token_allowance.value))
                    self.holds.hold(gate)  # rollout/held_{gate}_frac (rollout/holds.py)
                    if gate is None:
                        break
                    waited = waited if waited is not None else time.monotonic()
                    await asyncio.sleep(0.02)
                if waited is not None:
                    self.metrics.add("rollout/backpressure_s", time.monotonic() - waited)
                if score_queue.full():  # SPEC §16.5 score_queue_maxsize: scoring is behind, generation holds
                    blocked = time.monotonic()
                    self.holds.hold("score")
                    while score_queue.full() and not self._stop:
                        await asyncio.sleep(0.01)
                    self.metrics.add("rollout/score_block_s", time.monotonic() - blocked)
                # A group starts only when its first rollout can: no rollout of an earlier group still waits for a
                # slot under the concurrency cap (otherwise groups would pile up with stale version stamps).
                async with self._slot_changed:
                    self.holds.hold("cap")
                    await self._slot_changed.wait_for(
                        lambda: self._stop or (self._waiting_rollouts == 0 and self._in_flight < self.cap.value))
                self.holds.hold(None)
                if self._stop:
                    return
                self._sync_consumed()
                if self.rounds is None or not self.rounds.closed:
                    break  # else the trainer closed its step while this group waited: wait for the next round
            self.allowance.on_group_started(G)
            self.schedule.on_group_started(self._group_counter, int(self.model_version_value.value),
                                           G * (self.allowance.expected_kept_tokens_per_rollout or 0.0))
            if self.rounds is not None:
                self.rounds.on_group_started(self._group_counter, int(self.model_version_value.value), G)
            self._waiting_rollouts += G
            group_id = self._group_counter
            self._group_counter += 1
            self._group_stamps[group_id] = []
            task = asyncio.create_task(self._run_group(group_id, position, row_index, row, score_queue))
            self._groups_in_progress.add(task)
            self._group_tasks[group_id] = task
            task.add_done_callback(self._groups_in_progress.discard)
            task.add_done_callback(functools.partial(self._group_task_done, group_id))
            task.add_done_callback(self._raise_group_error)
            await asyncio.sleep(0)

    def _raise_group_error(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._group_error is None:
            self._group_error = task.exception()
            self._stop_event.set()

    async def _one_rollout(self, row: dict[str, Any], group_id: int, stamp: list[int]) -> "_RolloutResult":
        await self._acquire_slot()
        self._stamp(group_id, stamp)
        start = time.monotonic()
        try:
            if self.environments is None:
                prompt = row["prompt"]
                result = _RolloutResult(await self.generate_one(prompt, self.tools, group_id), prompt)
            else:
                result = await self._environment_rollout(row, group_id)
        finally:
            await self._release_slot()
        self.cap.on_rollout_completed()
        result.duration = time.monotonic() - start
        return result

    async def _environment_rollout(self, row: dict[str, Any], group_id: int) -> "_RolloutResult":
        """One rollout with an environment (SPEC §13.2): take an instance, ``reset(**columns)``, generate
        with its tools, ``get_reward()``, give the instance back. A raising ``reset``/``get_reward`` fails
        only this rollout (logged, no samples, unscored); its instance is dropped, not reused."""
        name = route_environment(self.environment_factory, row)
        env = await self.environments.acquire(name)
        loop = asyncio.get_running_loop()
        cls = type(env).__name__
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", ENVIRONMENT_COLUMN)}  # B.1; env consumed
        try:
            t0 = time.monotonic()
            try:
                if is_async_tool(env.reset):
                    text = await env.reset(**kwargs)
                else:
                    text = await loop.run_in_executor(self.tool_executor, functools.partial(env.reset, **kwargs))
            except Exception as exc:
                raise EnvironmentHookError(f"{cls}.reset raised {type(exc).__name__}: {exc}") from exc
            finally:
                self.metrics.add("env/reset_s", time.monotonic() - t0)
            prompt = compose_prompt(row.get("prompt"), text)
            rollout = await self.generate_one(prompt, [*self.tools, *environment_tools(env)], group_id)
            env_reward = None
            get_reward = getattr(env, "get_reward", None)
            if callable(get_reward):
                t0 = time.monotonic()
                try:
                    if is_async_tool(get_reward):
                        value = await get_reward()
                    else:
                        value = await loop.run_in_executor(self.tool_executor, get_reward)
                    value = float(value)
                except Exception as exc:
                    raise EnvironmentHookError(f"{cls}.get_reward raised {type(exc).__name__}: {exc}") from exc
                finally:
                    self.metrics.add("env/reward_s", time.monotonic() - t0)
                env_reward = (type(env), value)
        except EnvironmentHookError as exc:
            logger.warning("rollout of group %d failed, it is left unscored and untrained: %s", group_id, exc)
            self.metrics.add("env/failure_count", 1)
            return _RolloutResult(Rollout(completion=[], completion_ids=[], turns=[]), list(row.get("prompt") or []),
                                  failed=str(exc))
        self.environments.release(name, env)
        return _RolloutResult(rollout, prompt, env_reward=env_reward)

    async def _run_group(self, group_id: int, position: int, row_index: int, row: dict[str, Any],
                         score_queue: asyncio.Queue) -> None:
        G = self.config.num_generations
        stamp: list[int] = []
        try:
            if self.group_requests_apply:
                results = await self._group_rollouts(row, group_id, stamp)
            else:
                results = await asyncio.gather(*(self._one_rollout(row, group_id, stamp) for _ in range(G)))
        except asyncio.CancelledError:
            if self._stop or group_id not in self._cancelling:
                raise
            self._requeue_cancelled(group_id, stamp, position, row_index, row)  # rollout/stale_loop.py
            return
        model_version = stamp[0]
        assembling = time.perf_counter()
        self._rollouts_done += len(results)
        self._groups_done += 1
        sequences, stats = [], []
        for res in results:
            rollout = res.rollout
            seqs, st = rollout_to_sequences(rollout, group_id=group_id, row_index=row_index,
                                            model_version=model_version)
            if res.failed:
                seqs = []
            sequences.append(seqs)
            stats.append(st)
            self.allowance.on_rollout_finished(sum(s.num_tokens for s in seqs))
            self.metrics.add("rollout/duration_s", res.duration)
            self._generated_tokens += sum(len(t.output_ids) for t in rollout.turns)
        self.allowance.on_group_finished()
        if self.rounds is not None:
            self.rounds.on_group_generated(group_id, sum(s.num_tokens for seqs in sequences for s in seqs))
        if self._retry_if_stale(group_id, model_version, position, row_index, row, sequences):
            if self.rounds is not None:
                self.rounds.on_group_abandoned(group_id)
            return
        rollouts = [r.rollout for r in results]
        columns = {k: [v] * G for k, v in row.items() if k != "prompt"}  # B.1 (``environment`` included)
        group = RolloutGroup(prompts=[r.prompt for r in results], reward_kwargs=columns,
                             completions=[r.completion for r in rollouts],
                             completions_ids=[r.completion_ids for r in rollouts], completions_sequences=sequences,
                             tool_call_counts=[r.tool_call_count for r in rollouts],
                             tool_failure_counts=[r.tool_failure_count for r in rollouts], model_version=model_version,
                             group_id=group_id, row_index=row_index, env_rewards=[r.env_reward for r in results],
                             rollout_rewards=[r.reward for r in rollouts],
                             failed=[r.failed is not None for r in results])
        self._record_rollout_metrics(rollouts, stats, sequences)
        self.metrics.add("rollout/assembly_s", time.perf_counter() - assembling)
        blocked = time.monotonic()
        group.queued_at = blocked
        await score_queue.put((group, rollouts, position))
        self.metrics.add("rollout/score_block_s", time.monotonic() - blocked)

    # ----------------------------------------------------------------------------------- scoring
    async def _scorer(self, score_queue: asyncio.Queue) -> None:
        """Scores batches of groups (one of `scorers` such tasks). Every group waiting when the scorer wakes
        is scored in one batch, in queue order
        (`RewardRunner.score_many`): a group's wait is then one batch, not one thread hop per group ahead
        of it. ``rollout/score_s`` is the batch's time divided by its groups (scorer seconds per group)."""
        while True:
            batch = [await score_queue.get()]
            waiting = score_queue.qsize()
            while not score_queue.empty():
                batch.append(score_queue.get_nowait())
            start = time.monotonic()
            for i, (group, _, _) in enumerate(batch):
                self.metrics.add("rollout/score_queue_size", waiting - i)  # as if taken one by one
                self.metrics.add("rollout/score_wait_s", start - group.queued_at)
            await self._score_groups(batch)
            per_group = (time.monotonic() - start) / len(batch)
            for _ in batch:
                self.metrics.add("rollout/score_s", per_group)

    async def _score_groups(self, batch: list[tuple[RolloutGroup, list[Rollout], int]]) -> None:
        """Reward, advantages and queueing of each group of ``batch``, in order; the first group whose
        scoring failed raises (the groups before it are queued)."""
        results = await self.reward_runner.score_many(
            [RewardInputs(g.prompts, g.completions, g.completions_ids, g.reward_kwargs) for g, _, _ in batch])
        for (group, rollouts, position), result in zip(batch, results):
            if isinstance(result, BaseException):
                raise result
            self._finish_group(group, rollouts, position, result)

    def _finish_group(self, group: RolloutGroup, rollouts: list[Rollout], position: int, result) -> None:
        """Advantages, the drop rule, metrics and the rollout-queue entry of one scored group (SPEC §3.2)."""
        G = len(rollouts)
        self.schedule.forget(position)
        env_rewards = [None if e is None else e[1] for e in group.env_rewards]
        weights = getattr(self.config, "reward_weights", None)  # reward_weights: one per function (README: Loss variants)
        group.rewards = total_rewards(weighted_rewards(list(result.per_function.values()), weights),
                                      env_rewards if any(e is not None for e in env_rewards) else None,
                                      group.rollout_rewards, G)
        failed = group.failed or [False] * G
        group.rewards[np.asarray(failed, dtype=bool)] = np.nan  # a failed environment rollout is unscored
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (G,):
            raise ValueError(f"compute_advantages returned shape {advantages.shape}; it must return one advantage "
                             f"per rollout, shape ({G},)")
        dropped = should_drop_group(group.rewards)
        scored = group.rewards[~np.isnan(group.rewards)]
        trained = self._trained_completions(rollouts)  # mask_truncated_completions (README: Loss variants)
        diagnosis = self.no_signal.observe(not dropped, int(scored.size), result.per_function,
                                           sum(trained) if getattr(self.config, "mask_truncated_completions", False)
                                           else None)
        if getattr(self, "no_signal_value", None) is not None:  # shared with the trainer (its panels)
            self.no_signal_value.value = self.no_signal.consecutive
        if diagnosis is not None:
            raise NoLearningSignalError(diagnosis)
        ship_group_records(self.config, self.metrics_queue, group, advantages, result.per_function, dropped)
        m = self.metrics
        m.add_many("reward", scored.tolist())
        for i, (name, values) in enumerate(result.per_function.items()):
            m.add_many(f"rewards/{name}/mean", [v for v in values if v is not None])
            if weights is not None:
                m.add(f"rewards/{name}/weight", float(weights[i]))
        for env_reward in group.env_rewards:  # SPEC §13.2: logged under the environment's class name
            if env_reward is not None:
                m.add(f"rewards/{env_reward[0].__name__}/mean", env_reward[1])
        m.add("frac_reward_zero_std", 1.0 if dropped else 0.0)
        tokens = sum(s.num_tokens for seqs in group.completions_sequences for s in seqs)
        if dropped:
            if scored.size:
                m.add("reward_dropped", float(scored.mean()))
            self.allowance.on_samples_discarded(tokens, rollouts=len(group.completions_sequences))
            self.ship_metrics()
            self._put_outcome(PromptOutcome(position=position, row_index=group.row_index, kind="dropped",
                                                  group_id=group.group_id))
            self._group_resolved(group.group_id, 0.0)
            return
        if getattr(self.config, "mask_truncated_completions", False):
            m.add_many("completions/masked_truncated_frac", [0.0 if k else 1.0 for k in trained])
        samples: list[TrainingSequence] = []
        for seqs, adv, keep, reward in zip(group.completions_sequences, advantages, trained, group.rewards):
            for s in seqs:
                s.advantage = 0.0 if math.isnan(adv) else float(adv)
                s.reward = None if math.isnan(reward) else float(reward)
                samples.append(s if keep else untrained_stub(s))  # a cut one still counts as a sequence (TRL)
        if not all(trained):
            tokens = sum(s.num_tokens for s in samples)
            self.allowance.on_samples_discarded(sum(s.num_tokens for seqs in group.completions_sequences
                                                    for s in seqs) - tokens)
        m.add_many("reward_kept", [float(r) for r, seqs in zip(group.rewards, group.completions_sequences)
                                   for _ in seqs if not math.isnan(r)])
        std = group_reward_std(group.rewards)
        m.add_many("reward_group_std", [std] * len(samples))
        for name, values in result.per_function.items():
            m.add_many(f"rewards/{name}/group_std", [group_reward_std(values)] * len(samples))
        now = time.monotonic()
        for s in samples:
            s.queued_at = now
        self.allowance.on_samples_queued(tokens, rollouts=len(group.completions_sequences))
        self.ship_metrics()  # before the samples, so the trainer's window holds their group's metrics
        self._put_outcome(PromptOutcome(position=position, row_index=group.row_index, kind="kept",
                                              samples=samples, group_id=group.group_id))
        self._group_resolved(group.group_id, float(tokens))

    # ----------------------------------------------------------------------------------- metrics
    def _record_rollout_metrics(self, rollouts: list[Rollout], stats: list[ReconcileStats],
                                sequences: list[list[TrainingSequence]]) -> None:
        record_rollout_metrics(self.metrics, rollouts, stats, sequences, self._ends_with_eos,
                               bool(self.tools or self.environment_factory is not None), self._tool_names)

    def _trained_completions(self, rollouts: list[Rollout]) -> list[bool]:
        """Which completions are trained: all, or with ``mask_truncated_completions`` those ending with EOS (a
        cut one is scored and counts in its group's advantage, but not trained; ``completions/masked_truncated_frac``)."""
        if not getattr(self.config, "mask_truncated_completions", False):
            return [True] * len(rollouts)
        return [bool(r.turns) and self._ends_with_eos(r.turns[-1]) for r in rollouts]

    def _ends_with_eos(self, turn: TurnRecord) -> bool:
        if turn.finish_reason is not None:
            return turn.finish_reason == "stop"
        return bool(turn.output_ids) and turn.output_ids[-1] in self.eos_token_ids

    def _sync_consumed(self) -> None:
        if self.consumed_tokens_value is not None:
            self.allowance.sync_consumed_total(float(self.consumed_tokens_value.value))
        self.schedule.observe(int(self.model_version_value.value), self.allowance.consumed_total_seen)
        if self.stale_dropped_value is not None and self.stale_dropped_value.value > self._stale_drops_seen:
            self._stale_drops_seen = int(self.stale_dropped_value.value)  # a running count: act on new drops only
            self.schedule.on_dropped_stale()
        self._observe_rounds()  # rollout/stale_loop.py
        self._cancel_doomed()

    async def _monitor(self) -> None:
        last_poll = -math.inf
        while True:
            now = time.monotonic()
            self.heartbeat_value.value = time.time()
            self._sync_consumed()
            if now - last_poll >= self.metrics_poll_s:
                last_poll = now
                load = await self._poll_load()
                if load is not None:
                    async with self._slot_changed:
                        self.cap.observe_load(load)
                        self._slot_changed.notify_all()
                    m = self.metrics
                    if load.kv_cache_usage_frac is not None:
                        m.add("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage_frac)
                    m.add("rollout/vllm_running_requests", load.num_requests_running)
                    m.add("rollout/vllm_queued_requests", load.num_requests_waiting)
                    if self._last_preemptions is not None:
                        m.add("rollout/vllm_preemption_count",
                              max(0, load.num_preemptions_total - self._last_preemptions))
                    self._last_preemptions = load.num_preemptions_total
                    if self._last_load is not None:  # vLLM's own time per request, by stage (issue #41)
                        for stage, seconds in request_time_means(self._last_load, load).items():
                            m.add(f"rollout/vllm_{stage}_s", seconds)
                    self._last_load = load
            self.metrics.add("rollout/concurrency", self._in_flight)
            self.metrics.add("rollout/concurrency_cap", self.cap.value)
            held, elapsed = self.holds.take()
            for gate, seconds in held.items():
                self.metrics.add_rate(held_metric(gate), seconds, elapsed)
            self.metrics.add("rollout/deadline_admission", 1.0 if self.schedule.deadline_admission else 0.0)
            self.metrics.add("rollout/deadline_overtake_share", self.schedule.overtake_share)
            if self.allowance.in_flight_tokens_per_rollout is not None:  # staleness.in_flight_estimate's figure
                self.metrics.add("rollout/in_flight_tokens_per_rollout", self.allowance.in_flight_tokens_per_rollout)
            if self.concurrency_value is not None:
                self.concurrency_value.value = self._in_flight
            if getattr(self, "rollouts_done_value", None) is not None:  # set by the worker process (status.json)
                self.rollouts_done_value.value = self.allowance.finished_rollouts_total
            if self.cap_value is not None:
                self.cap_value.value = self.cap.value
            if self.server_values is not None:
                outage = getattr(self.client, "outage", None)
                self.server_values[0].value = outage.deadline_wall() if outage is not None else 0.0
            if now - self._last_ship >= METRICS_SHIP_S:
                self.ship_metrics(now)
            await asyncio.sleep(min(HEARTBEAT_S, METRICS_SHIP_S, self.metrics_poll_s))

    async def _poll_load(self):
        """The server's load for the cap, None when unknown: a failed or slow ``/metrics`` read never stops
        the worker (`SamplerClient.poll_load`; the cap keeps its last value)."""
        poll = getattr(self.client, "poll_load", None)
        return await (poll() if poll is not None else self.client.read_metrics())

    def ship_metrics(self, now: float | None = None) -> None:
        """Send the worker's metrics since the last shipment to the trainer (a mergeable snapshot)."""
        now = time.monotonic() if now is None else now
        self.metrics.add_rate("rollout/generated_tokens_per_s", self._generated_tokens, now - self._last_ship)
        self.metrics.add_rate("rollout/rollouts_per_s", self._rollouts_done, now - self._last_ship)
        self.metrics.add_rate("rollout/groups_per_s", self._groups_done, now - self._last_ship)
        retries = getattr(self.client, "retry_count", 0)
        self.metrics.add("rollout/vllm_retry_count", retries - getattr(self, "_retries_shipped", 0))
        self._retries_shipped = retries
        self._generated_tokens = 0
        self._rollouts_done = self._groups_done = 0
        self._last_ship = now
        self.metrics_queue.put(self.metrics.snapshot(reset=True))
