"""Continuous batching of the embedded sampler: a pure scheduler and the async engine loop around it.

`Scheduler` is a state machine with no I/O and no torch: it holds the waiting queue and the running
set and accounts the KV cache in blocks the way vLLM does, so ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:num_preemptions_total`` mean
what they mean there:

- KV capacity is ``num_blocks`` blocks of ``block_size`` tokens (``--kv-cache-tokens`` rounded
  down to whole blocks). A running request holds ``ceil(tokens / block_size)`` blocks, where
  ``tokens`` = prompt + output tokens whose KV exists after the coming step; it grows by one token
  per step (no up-front reservation of ``max_tokens``).
- Each step, running requests grow first. When their blocks no longer fit, the most recently
  admitted request is preempted (its KV dropped, back to the front of the waiting queue, counted
  in ``num_preemptions``) until they fit. A preempted request is recomputed (prompt and the output
  so far re-prefilled) when it is admitted again; its sampling generator is kept, so its output is
  the one it would have had anyway.
- Then waiting requests are admitted first come, first served while the running set has fewer than
  ``max_num_seqs`` requests and the blocks for their tokens are free.

The server refuses to start when ``max_model_len`` exceeds the capacity, so a lone request always
fits and the scheduler always makes progress.

`Engine` runs the scheduler in an asyncio task and the model (a `ModelRunner`-like object with a
``step(plan)`` method) on one dedicated thread, so the HTTP routes stay responsive. Every step and
every control operation (pause, weight update, adapter load) holds one asyncio lock: control
operations happen between steps, never during one.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .sampling import SamplingOptions

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    """Where a request is in its life: waiting for admission, running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclass(eq=False)
class EngineRequest:
    """One generation request inside the engine (one choice of an HTTP request).

    Attributes:
        request_id: the id reported back (``cmpl-...`` / ``generate-tokens-...``).
        prompt_ids: prompt token ids.
        options: validated sampling parameters.
        adapter: LoRA adapter name, ``None`` for the base model.
        max_model_len: the request finishes with ``"length"`` when prompt + output reach it.
        output_ids / output_logprobs: generated tokens and their processed log-probs.
        top_ids / top_logprobs: per output token, the top-``options.logprobs`` ids and log-probs.
        sampling_masks: per output token, the candidate set (``None`` entries: full vocabulary).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished.
        stop_reason: the stop token id that ended the request, if one did (EOS gives ``None``).
        has_kv: the model holds this request's KV for all tokens but the last output token.
        blocks: KV blocks currently held.
        num_preemptions: times this request was preempted.
        generator: the request's sampling generator (set by the model runner).
    """

    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    adapter: str | None = None
    max_model_len: int | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    sampling_masks: list[list[int] | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    has_kv: bool = False
    blocks: int = 0
    num_preemptions: int = 0
    generator: Any = None
    arrival: int = field(default_factory=lambda: next(_arrival))

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens, in tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.status is RequestStatus.FINISHED


@dataclass
class SchedulePlan:
    """What one engine step computes.

    Attributes:
        decode: running requests whose KV is held; each feeds its last output token.
        prefill: running requests without KV (new, or recomputed after a preemption); each feeds
            its prompt plus its output so far.
        preempted: requests preempted while planning this step (already back in the queue).
    """

    decode: list[EngineRequest]
    prefill: list[EngineRequest]
    preempted: list[EngineRequest] = field(default_factory=list)

    @property
    def rows(self) -> list[EngineRequest]:
        """All requests that get one new token this step: decode rows first, then prefill rows."""
        return self.decode + self.prefill


class Scheduler:
    """Admission, growth and preemption of requests against a KV budget in blocks (no I/O).

    Args:
        num_blocks: KV capacity in blocks (>= 1).
        block_size: tokens per block (>= 1).
        max_num_seqs: most requests running at once (>= 1).

    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if value < 1:
                raise ValueError(f"Scheduler: {name}={value} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0

    @property
    def capacity_tokens(self) -> int:
        """KV capacity in tokens (``num_blocks × block_size``)."""
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens of KV."""
        return math.ceil(tokens / self.block_size)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests."""
        return sum(r.blocks for r in self.running)

    @property
    def usage(self) -> float:
        """KV cache usage as a fraction in [0, 1] (``vllm:kv_cache_usage_perc``)."""
        return self.used_blocks / self.num_blocks

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add(self, request: EngineRequest) -> None:
        """Queue a new request at the back of the waiting queue.

        Raises:
            ValueError: the request can never fit (more tokens than the whole KV capacity).
        """
        longest = len(request.prompt_ids) + request.options.max_tokens
        if request.max_model_len is not None:
            longest = min(longest, request.max_model_len)
        if self.blocks_for(longest) > self.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs up to {longest} tokens of KV but the cache holds "
                f"{self.capacity_tokens}; lower max_tokens or raise --kv-cache-tokens"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulePlan:
        """Plan the next step: grow running requests (preempting if needed), then admit waiting ones."""
        preempted: list[EngineRequest] = []
        need = {id(r): self.blocks_for(r.num_tokens) for r in self.running}
        while len(self.running) > 1 and sum(need.values()) > self.num_blocks:
            victim = self.running.pop()
            del need[id(victim)]
            self._preempt(victim)
            self.waiting.appendleft(victim)
            preempted.append(victim)
        for r in self.running:
            r.blocks = need[id(r)]
        used = sum(need.values())
        while self.waiting and len(self.running) < self.max_num_seqs:
            candidate = self.waiting[0]
            blocks = self.blocks_for(candidate.num_tokens)
            if used + blocks > self.num_blocks:
                break
            self.waiting.popleft()
            candidate.status = RequestStatus.RUNNING
            candidate.has_kv = False
            candidate.blocks = blocks
            self.running.append(candidate)
            used += blocks
        decode = [r for r in self.running if r.has_kv]
        prefill = [r for r in self.running if not r.has_kv]
        return SchedulePlan(decode=decode, prefill=prefill, preempted=preempted)

    def _preempt(self, request: EngineRequest) -> None:
        request.status = RequestStatus.WAITING
        request.has_kv = False
        request.blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1

    def preempt_all_running(self) -> int:
        """Drop the KV of every running request (recomputed next step); each counts as a preemption.

        Used by ``/reset_prefix_cache?reset_running_requests=true``. Returns how many were preempted.
        """
        count = 0
        for r in self.running:
            if r.has_kv:
                r.has_kv = False
                r.num_preemptions += 1
                self.num_preemptions += 1
                count += 1
        return count

    def finish(self, request: EngineRequest, reason: str, stop_reason: int | None = None) -> None:
        """Mark ``request`` finished with ``reason`` and free its blocks (waiting or running)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.blocks = 0
        request.has_kv = False


def finish_reason_after_token(request: EngineRequest, token: int, eos_token_ids: frozenset[int]) -> tuple[str | None, int | None]:
    """Whether ``request`` ends after its newest output ``token`` (already appended).

    Returns:
        ``(finish_reason, stop_reason)``: ``("stop", None)`` at EOS (unless ``ignore_eos``),
        ``("stop", token)`` at a stop token, ``("length", None)`` at ``max_tokens`` or
        ``max_model_len``, else ``(None, None)``.
    """
    opts = request.options
    if not opts.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in opts.stop_token_ids:
        return "stop", token
    if len(request.output_ids) >= opts.max_tokens:
        return "length", None
    if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
        return "length", None
    return None, None


@dataclass
class TokenOutput:
    """What the model produced for one request in one step.

    Attributes:
        token_id: the sampled token.
        logprob: its processed log-prob (natural log).
        top_ids / top_logprobs: top-N ids and processed log-probs (empty when not requested).
        sampling_mask: the candidate set the token was drawn from, or ``None``.
    """

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    sampling_mask: list[int] | None = None


class StepRunner(Protocol):
    """The model side of the engine (see ``runner.ModelRunner``); runs on the model thread."""

    def step(self, plan: SchedulePlan) -> list[TokenOutput]:
        """Compute one token for each of ``plan.rows``, in that order."""
        ...

    def reset(self) -> None:
        """Forget all KV (after a failed step)."""
        ...


@dataclass
class EngineStats:
    """A snapshot of the engine for ``/metrics`` (vLLM's meanings)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    kv_cache_size_tokens: int
    num_gpu_blocks: int
    block_size: int
    running_adapters: list[str]
    waiting_adapters: list[str]


class EngineError(RuntimeError):
    """A request failed inside the engine (the model raised); the message says why."""


class Engine:
    """Asyncio driver of `Scheduler` + a model runner on one thread.

    Args:
        runner: object with ``step(plan) -> list[TokenOutput]`` and ``reset()``.
        scheduler: the `Scheduler`.
        eos_token_ids: token ids that end a request with ``"stop"``.

    Use ``await start()`` inside the serving event loop, ``await generate(request)`` per request,
    and ``await close()`` at shutdown.
    """

    def __init__(self, runner: StepRunner, scheduler: Scheduler, eos_token_ids: frozenset[int]) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedded-model")
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._held: list[EngineRequest] = []  # arrivals while draining for pause(mode="wait")
        self._paused = False
        self._draining = False
        self._closed = False
        self._pending_unload: set[str] = set()
        self.on_adapter_idle: Callable[[str], None] | None = None  # runs on the model thread
        self.num_steps = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine task on the running event loop."""
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="embedded-engine")

    async def close(self) -> None:
        """Abort everything, stop the engine task and the model thread."""
        self._closed = True
        for request in list(self.scheduler.running) + list(self.scheduler.waiting) + self._held:
            self._finish(request, "abort")
        self._held.clear()
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def paused(self) -> bool:
        """True while paused (``/pause``) and not yet resumed."""
        return self._paused

    # ------------------------------------------------------------------ requests
    async def generate(self, request: EngineRequest) -> EngineRequest:
        """Queue ``request`` and wait until it finishes; returns it with its outputs.

        Cancelling the caller (client disconnect) aborts the request.

        Raises:
            ValueError: the request can never fit the KV cache.
            EngineError: the model failed while computing it.
        """
        if self._closed:
            raise EngineError("the engine is shutting down")
        future = asyncio.get_running_loop().create_future()
        self._futures[id(request)] = future
        try:
            if self._draining:
                self._held.append(request)
            else:
                self.scheduler.add(request)
        except ValueError:
            self._futures.pop(id(request), None)
            raise
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request)
            raise
        if request.finish_reason == "error":
            raise EngineError(request.error or "the model failed")
        return request

    def abort(self, request: EngineRequest) -> None:
        """Finish ``request`` with ``"abort"`` now (no effect once finished)."""
        if request.finished:
            return
        if request in self._held:
            self._held.remove(request)
        self._finish(request, "abort")

    def _finish(self, request: EngineRequest, reason: str, stop_reason: int | None = None) -> None:
        self.scheduler.finish(request, reason, stop_reason)
        future = self._futures.pop(id(request), None)
        if future is not None and not future.done():
            future.set_result(None)

    # ------------------------------------------------------------------ control
    async def pause(self, mode: str = "keep") -> None:
        """Pause generation (``/pause``).

        Args:
            mode: ``"keep"``: running and waiting requests freeze and continue after `resume`;
                ``"abort"``: every request finishes now with ``"abort"``; ``"wait"``: new arrivals
                are held, the requests already queued or running finish, then the engine pauses.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode={mode!r} is not one of 'keep', 'abort', 'wait'")
        if mode == "wait":
            if not self._paused:
                self._drained.clear()
                self._draining = True
                self._wake.set()
                await self._drained.wait()
            return
        async with self._lock:
            self._paused = True
            if mode == "abort":
                for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(request, "abort")
                await self._on_model_thread(self.runner.reset)

    async def resume(self) -> None:
        """Resume after `pause`; frozen requests continue where they stopped."""
        async with self._lock:
            self._paused = False
            self._release_held()
        self._wake.set()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for request in held:
            try:
                self.scheduler.add(request)
            except ValueError as exc:  # cannot happen: checked the same way on arrival
                request.error = str(exc)
                self._finish(request, "error")

    async def preempt_running(self) -> int:
        """Drop the KV of all running requests so it is recomputed (with the current weights)."""
        async with self._lock:
            return self.scheduler.preempt_all_running()

    async def exclusive(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the model thread between steps (weight loads, adapter loads)."""
        async with self._lock:
            return await self._on_model_thread(fn, *args)

    async def _on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def adapter_in_use(self, name: str) -> bool:
        """True while an unfinished request uses LoRA adapter ``name``."""
        pending = itertools.chain(self.scheduler.running, self.scheduler.waiting, self._held)
        return any(r.adapter == name for r in pending)

    async def release_adapter(self, name: str, unload: Callable[[str], None]) -> bool:
        """Unload adapter ``name`` now if unused, else once its last request finishes.

        Returns True when it was unloaded at once.
        """
        async with self._lock:
            if self.adapter_in_use(name):
                self._pending_unload.add(name)
                self.on_adapter_idle = unload
                return False
            await self._on_model_thread(unload, name)
            return True

    def stats(self) -> EngineStats:
        """Current numbers for ``/metrics``."""
        s = self.scheduler
        return EngineStats(
            num_requests_running=len(s.running),
            num_requests_waiting=len(s.waiting) + len(self._held),
            kv_cache_usage=s.usage,
            num_preemptions=s.num_preemptions,
            kv_cache_size_tokens=s.capacity_tokens,
            num_gpu_blocks=s.num_blocks,
            block_size=s.block_size,
            running_adapters=sorted({r.adapter for r in s.running if r.adapter}),
            waiting_adapters=sorted({r.adapter for r in itertools.chain(s.waiting, self._held) if r.adapter}),
        )

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            while not self._closed and not self._paused and self.scheduler.has_work():
                async with self._lock:
                    if self._paused or not self.scheduler.has_work():
                        break
                    await self._step()
                await asyncio.sleep(0)  # let HTTP handlers and control operations in
            if self._draining and not self.scheduler.has_work():
                self._paused = True
                self._draining = False
                self._release_held()
                self._drained.set()

    async def _step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan.rows:
            return
        try:
            outputs = await self._on_model_thread(self.runner.step, plan)
        except Exception as exc:  # the model failed: fail what it was computing, start clean
            log.exception("embedded engine step failed")
            await self._on_model_thread(self.runner.reset)
            for request in plan.rows:
                request.error = f"{type(exc).__name__}: {exc}"
                self._finish(request, "error")
            return
        self.num_steps += 1
        for request, out in zip(plan.rows, outputs):
            if request.finished:  # aborted while the step ran
                continue
            request.has_kv = True
            request.output_ids.append(out.token_id)
            request.output_logprobs.append(out.logprob)
            request.top_ids.append(out.top_ids)
            request.top_logprobs.append(out.top_logprobs)
            request.sampling_masks.append(out.sampling_mask)
            reason, stop_reason = finish_reason_after_token(request, out.token_id, self.eos_token_ids)
            if reason is not None:
                self._finish(request, reason, stop_reason)
        await self._unload_idle_adapters()

    async def _unload_idle_adapters(self) -> None:
        for name in list(self._pending_unload):
            if not self.adapter_in_use(name) and self.on_adapter_idle is not None:
                self._pending_unload.discard(name)
                await self._on_model_thread(self.on_adapter_idle, name)
