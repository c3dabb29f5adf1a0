"""The one client of the sampler boundary (DESIGN §5): vLLM 0.26-0.33 or the embedded sampler over HTTP.

`SamplerClient` (asyncio, used by the rollout worker) generates one turn per call, reads the
server's load and limits, and drives weight transfer; `SyncSamplerClient` offers the reading and
weight-transfer routes to the CLI, doctor and the trainer's weight-sync thread.

Generation requests (SPEC §3.1, Appendix B.17):

- ``POST /v1/completions`` with a token-id prompt, ``logprobs: N``, ``return_token_ids`` and
  ``return_tokens_as_token_ids`` by default; ``POST /inference/v1/generate`` only when sampling
  masks are wanted (SPEC §7). Both top-log-prob formats are read: ``"token_id:N"`` string keys
  (vLLM <= 0.28) and 0.33's ``{"token_id", "logprob", "rank", "top_logprobs": [...]}`` entries.
  vLLM lists the sampled token beside the top N (N or N+1 entries); exactly the N most likely are
  kept, and the sampled token's log-prob is taken from its own field.
- every request carries a unique ``seed``: a random 63-bit base plus a per-client counter
  (modulo 2**63), so data-parallel engines never decode identical text.
- each attempt has a timeout of ``timeout_s`` (``vllm_server_timeout``). A connection error, a
  5xx or a timeout is retried with exponential backoff (``backoff_base_s`` doubling up to
  ``backoff_max_s``; 1 s and 30 s by default), at most ``max_retries`` (5) times. Connection
  refused is waited out instead, for at most ``timeout_s`` in total. Every retry adds one to
  ``retry_count`` (``rollout/vllm_retry_count``). A 4xx is not retried: `SamplerRequestError`
  carries the server's message, the route and a summary of the request.

The connection pool holds ``max_concurrency + 4`` connections (never a library's default cap): at most
``max_concurrency`` generation requests run at once (an internal semaphore), and the 4 extra
connections keep ``/metrics`` and the control routes answering while generation saturates the pool.
`SamplerClient`'s pool is an aiohttp session (`connection_pool.AiohttpPool`: constant time per request
at hundreds of connections, where httpx's async pool scans them all); `SyncSamplerClient` uses httpx.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from .connection_pool import AiohttpPool, HttpxPool
from .prometheus import ServerLoad

log = logging.getLogger(__name__)

CONTROL_CONNECTIONS = 4  # connections beyond max_concurrency, for /metrics and control routes

from .protocol import (  # noqa: F401 - re-exported: the client's public protocol types
    COMPLETIONS_ROUTE,
    GENERATE_ROUTE,
    SamplerError,
    SamplerUnavailableError,
    SamplerRetryError,
    SamplerConnectionLost,
    SamplerRequestError,
    SamplerProtocolError,
    SamplingParams,
    TurnResult,
    SeedSequence,
    completion_body,
    generate_body,
    vllm_config_of,
    _optional_sampling,
    token_id_from_key,
    keep_top_n,
    _fail,
    _first_choice,
    _completion_style_logprobs,
    _content_style_logprobs,
    parse_turn,
    parse_turns,
    server_error_message,
    request_summary,
    _json_body,
    _parse_models,
    _base_max_model_len,
    _server_load,
    _normalise_url,
    _pause_mode,
)

from .retry import (  # noqa: E402,F401 - the retry decisions (B.17) and their helpers, re-exported
    TRANSPORT_ERRORS as _TRANSPORT_ERRORS,
    ServerOutage,
    _classify,
    _raise_for_4xx,
    _Readiness,
    WAKE_S,
    _RetryState,
)

GENERATION_ROUTES = (COMPLETIONS_ROUTE, GENERATE_ROUTE)
PROBE_TIMEOUT_S = 5.0  # the longest /health probe while the server is unreachable
SILENT_MIN_TIMEOUT_S = 1.0  # the shortest request timeout `SyncSamplerClient.silence_budget` leaves
RETRY_SAY_EVERY_S = 10.0  # the least time between two retry warnings of one client (`SamplerClient._retry_level`)


# ---------------------------------------------------------------------------------------------- async
class SamplerClient:
    """Async client of one sampler server (vLLM or embedded); use inside one event loop.

    Args:
        base_url: e.g. ``http://localhost:8000`` (a trailing ``/v1`` is dropped).
        max_concurrency: most generation requests in flight (the worker's concurrency limit);
            the pool holds this many connections plus 4 for control routes.
        timeout_s: per-attempt timeout of generation and control requests (``vllm_server_timeout``).
        model: the ``model`` field sent when a call gives none (``None``: omitted, the server's base).
        max_retries: retries after timeouts, 5xx and dropped connections (SPEC B.17: 5).
        backoff_base_s / backoff_max_s: exponential backoff, first delay and cap (1 s, 30 s).
        metrics_timeout_s: timeout of one ``/metrics`` read (polled, never retried).
        seed_base: base of the request seeds (tests); default random.
        request_seeds: send a unique ``seed`` with every request (SPEC §3.1: data-parallel engines that share
            a sampler seed could otherwise decode identical text); False sends none and the server draws one
            per request (``rollout.request_seeds``).
        tokens_route: send every generation request to ``/inference/v1/generate`` (tokens in and out) with
            ``detokenize: false``, sparing the server the output text (the worker decodes what it needs); the server
            needs that route (vLLM 0.33: ``--enable-scale-out``). A lever of issue #41, screened by
            ``scripts/gpu/vllm033/rollouts.py``; the default is ``/v1/completions``.
        transport: an ``httpx.AsyncBaseTransport`` (tests); requests then go through httpx
            (`connection_pool.HttpxPool`) instead of the default aiohttp pool.
        after_outage: ``async () -> None`` run once when the server answers again after an outage
            (it may have restarted and lost its weights); generation requests wait for it before
            they are sent (the worker waits there for the trainer's re-push). Its exception fails
            every waiting generation request.

    Outages (SPEC B.17): after a refused connection every request first probes ``GET /health``
    (the generation request itself is not resent to a server that may have lost its weights) until
    the server answers or ``timeout_s`` has passed since the outage began; then `SamplerUnavailableError`
    names the URL, how long it waited and the fix.

    Attributes:
        retry_count: retries so far (``rollout/vllm_retry_count``), probes during an outage included.
        request_count: generation requests completed.
        outage: the client's `ServerOutage` (``outage.status()`` is the live status line).
        metrics_failure_count: ``/metrics`` reads of `poll_load` that failed (load unknown).
        limits: the pool's size as ``httpx.Limits`` (``max_concurrency + 4`` connections, all kept alive).

    Raises:
        ValueError: a bad ``base_url`` or a non-positive ``max_concurrency`` / ``timeout_s``.
    """

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        *,
        max_concurrency: int = 512,
        timeout_s: float = 1800.0,
        model: str | None = None,
        max_retries: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        metrics_timeout_s: float = 10.0,
        seed_base: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        after_outage: Any = None,
        request_seeds: bool = True,
        tokens_route: bool = False,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (vllm_server_timeout, seconds)")
        self.base_url = _normalise_url(base_url)
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        self.model = model
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.metrics_timeout_s = metrics_timeout_s
        self.seeds = SeedSequence(seed_base)
        self.request_seeds = bool(request_seeds)
        self.tokens_route = bool(tokens_route)
        self.retry_count = 0
        self.request_count = 0
        self._retry_said_at, self._retries_unsaid = -RETRY_SAY_EVERY_S, 0  # `_retry_level`
        self.outage = ServerOutage(self.base_url, self.timeout_s)
        self.metrics_failure_count = 0
        self.after_outage = after_outage
        self._recovery: asyncio.Future | None = None
        size = max_concurrency + CONTROL_CONNECTIONS
        self.limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        if transport is None:
            self._http: AiohttpPool | HttpxPool = AiohttpPool(self.base_url, size, self.timeout_s)
        else:
            self._http = HttpxPool(self.base_url, self.limits, self.timeout_s, transport)
        self._slots: asyncio.Semaphore | None = None

    async def __aenter__(self) -> "SamplerClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    # ------------------------------------------------------------------ transport
    async def _send(
        self,
        method: str,
        route: str,
        *,
        body: Any = None,
        params: dict | None = None,
        retry: bool = True,
        timeout_s: float | None = None,
        allow_404: bool = False,
    ) -> httpx.Response | None:
        timeout_s = timeout_s or self.timeout_s
        state = _RetryState(self.base_url, route, timeout_s, self.max_retries if retry else 0,
                            self.backoff_base_s, self.backoff_max_s, outage=self.outage)
        generation = route in GENERATION_ROUTES
        while True:
            if generation:
                await self._wait_for_recovery()
            if self.outage.active:  # don't resend the request itself until the server answers again
                failure = await self._probe()
                if failure is None:
                    self._server_answered()
                    continue
                delay = state.on_refused(failure, body)
            else:
                try:  # the pool bounds the whole attempt (connect, send, read) by timeout_s
                    response = await self._http.request(method, route, json=body, params=params,
                                                        timeout=timeout_s)
                except _TRANSPORT_ERRORS as exc:
                    delay = state.on_error(exc, body, retry)
                else:
                    self._server_answered()
                    done, delay = state.on_response(response, body, allow_404)
                    if done:
                        return response if response.status_code != 404 else None
            self.retry_count += 1
            # one warning per request's first retry and per backoff doubling, not one per request per try; none
            # while the server is unreachable: the outage logs its start and its end once (`ServerOutage`)
            level, unsaid = self._retry_level((state.retries + state.refusals) & (state.retries + state.refusals - 1)
                                              == 0 and not self.outage.active)
            if level >= logging.WARNING and not self.outage.active and self.outage.stopping():
                level = logging.DEBUG  # a stopping job: its outage and stop lines say it all, no wait is promised
            log.log(level, "sampler %s%s: retrying in %.1f s (retry %d)%s%s", self.base_url, route, delay,
                    self.retry_count, f"; {self.outage.status()}" if self.outage.active else "", unsaid)
            await asyncio.sleep(delay)

    def _retry_level(self, worth_a_warning: bool) -> tuple[int, str]:
        """The log level of a retry's line and what it adds: a WARNING at most every `RETRY_SAY_EVERY_S` seconds
        for the whole client (a server dying mid-request fails every request in flight at once: the first retry
        of each of 13 requests made 13 lines of one GPU drill's trainer.log), saying how many went unsaid."""
        if not worth_a_warning:
            return logging.DEBUG, ""
        now = time.monotonic()
        if now - self._retry_said_at < RETRY_SAY_EVERY_S:
            self._retries_unsaid += 1
            return logging.DEBUG, ""
        unsaid = f" (and {self._retries_unsaid} other retries since the last such line)" if self._retries_unsaid else ""
        self._retry_said_at, self._retries_unsaid = now, 0
        return logging.WARNING, unsaid

    async def _probe(self) -> Any:
        """One ``GET /health`` during an outage: None when the server answers (any status below 500: a
        server without the route answers 404), else what failed."""
        left = self.outage.seconds_left() or self.timeout_s
        try:
            response = await self._http.request("GET", "/health", timeout=max(0.05, min(PROBE_TIMEOUT_S, left)))
        except _TRANSPORT_ERRORS as exc:
            return exc
        return None if response.status_code < 500 else f"GET /health answered HTTP {response.status_code}"

    def _server_answered(self) -> None:
        """End the outage if one was on; start ``after_outage`` once for it."""
        if self.outage.answered():  # logged by the outage
            if self.after_outage is not None and (self._recovery is None or self._recovery.done()):
                self._recovery = asyncio.ensure_future(self.after_outage())

    async def _wait_for_recovery(self) -> None:
        """Wait for the ``after_outage`` hook of the last outage (re-raising its error)."""
        recovery = self._recovery
        if recovery is not None:
            await asyncio.shield(recovery)

    async def _get_json(self, route: str, *, params: dict | None = None, allow_404: bool = False) -> Any:
        response = await self._send("GET", route, params=params, allow_404=allow_404)
        return None if response is None else _json_body(route, response)

    async def _post(self, route: str, body: Any = None, params: dict | None = None) -> httpx.Response:
        return await self._send("POST", route, body=body, params=params, retry=False)

    # ------------------------------------------------------------------ readiness and reading
    async def wait_until_ready(self, deadline_s: float, poll_s: float = 0.5) -> float:
        """Poll ``GET /health`` until it answers 200; returns the seconds waited.

        Raises:
            SamplerUnavailableError: not healthy within ``deadline_s`` seconds (names the URL and
                the last error).
        """
        ready = _Readiness(self.base_url, deadline_s)
        while True:
            timeout = ready.next_timeout()
            try:
                waited = ready.answered((await self._http.request("GET", "/health", timeout=timeout)).status_code)
                if waited is not None:
                    return waited
            except httpx.HTTPError as exc:
                ready.failed(exc)
            await asyncio.sleep(ready.pause(poll_s))

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 now (no retries)."""
        try:
            response = await self._http.request("GET", "/health", timeout=min(self.timeout_s, 10.0))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def models(self) -> list[dict]:
        """``GET /v1/models`` → the model cards (``id``, ``max_model_len``, ``root``, ``parent``)."""
        return _parse_models("/v1/models", await self._get_json("/v1/models"))

    async def max_model_len(self) -> int:
        """The base model's ``max_model_len`` from ``/v1/models``."""
        return _base_max_model_len("/v1/models", await self.models())

    async def version(self) -> dict:
        """``GET /version`` → e.g. ``{"version": "0.26.0"}`` (embedded adds ``"server"``)."""
        return await self._get_json("/version")

    async def server_info(self) -> dict | None:
        """``GET /server_info?config_format=json`` (vLLM dev mode) → the engine config (vLLM's
        ``vllm_config``: ``model_config``, ``weight_transfer_config``, ...; `vllm_config_of`);
        ``None`` when the route is absent."""
        return vllm_config_of(await self._get_json("/server_info", params={"config_format": "json"},
                                                   allow_404=True))

    async def read_metrics(self) -> ServerLoad | None:
        """Read ``/metrics`` once (no retries, ``metrics_timeout_s``) into a `ServerLoad` (SPEC §4.2).

        Returns:
            the load, or ``None`` when the server has no ``/metrics`` (404) or it holds none of
            vLLM's load metrics (the caller then uses ``max_concurrent_rollouts``).

        Raises:
            SamplerError: unreachable, or text that is not Prometheus exposition.
        """
        try:
            response = await self._http.request("GET", "/metrics", timeout=self.metrics_timeout_s)
        except httpx.HTTPError as exc:
            raise SamplerUnavailableError(f"{self.base_url}/metrics: {type(exc).__name__}: {exc}", "/metrics") from exc
        return _server_load(self.base_url, response)

    async def poll_load(self) -> ServerLoad | None:
        """`read_metrics` for the periodic load poll (SPEC §4.2): a failed or slow read never raises.

        Returns:
            the load; ``None`` when it is unknown this time: no ``/metrics``, no load metrics, or the
            read failed (counted in ``metrics_failure_count`` and logged; the caller keeps its last
            cap). A refused connection also starts an outage (`ServerOutage`), and an answer after
            one ends it (so an outage seen only by the poll still triggers ``after_outage``).
        """
        try:
            load = await self.read_metrics()
        except SamplerError as exc:
            self.metrics_failure_count += 1
            if isinstance(exc.__cause__, httpx.ConnectError):
                self.outage.refused(exc.__cause__)
            if self.metrics_failure_count == 1 or self.metrics_failure_count % 10 == 0:
                log.warning("sampler %s: /metrics read failed (%d so far; load unknown, cap kept): %s",
                            self.base_url, self.metrics_failure_count, exc)
            return None
        self._server_answered()
        return load

    async def is_paused(self) -> bool:
        """``GET /is_paused``."""
        body = await self._get_json("/is_paused")
        if not isinstance(body, dict) or "is_paused" not in body:
            raise _fail("/is_paused", "no 'is_paused'")
        return bool(body["is_paused"])

    async def get_world_size(self) -> int:
        """``GET /get_world_size`` → TP × PP × DP of the server."""
        body = await self._get_json("/get_world_size")
        if not isinstance(body, dict) or not isinstance(body.get("world_size"), int):
            raise _fail("/get_world_size", "no integer 'world_size'")
        return body["world_size"]

    # ------------------------------------------------------------------ generation
    async def generate_turn(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None = None) -> TurnResult:
        """Generate one turn from ``prompt_ids`` (SPEC §3.1, B.17): `generate_turns` with ``n=1``.

        Args:
            prompt_ids: the full prompt of the turn, token ids.
            sampling: `SamplingParams`; ``return_sampling_mask`` selects ``/inference/v1/generate``.
            model: the served model or LoRA adapter name; default the client's ``model``.

        Returns:
            `TurnResult` with output ids, processed log-probs, top-N by token id, finish reason,
            (when asked and returned) the sampling mask, and the request's round trip and parse seconds.

        Raises:
            ValueError: empty or non-integer ``prompt_ids``.
            SamplerRequestError: the server rejected the request (4xx), e.g. too long for max_model_len.
            SamplerRetryError / SamplerUnavailableError: retries exhausted / server unreachable.
            SamplerProtocolError: an unreadable response.
        """
        return (await self.generate_turns(prompt_ids, sampling, 1, model))[0]

    async def generate_turns(self, prompt_ids: list[int], sampling: SamplingParams, n: int,
                             model: str | None = None) -> list[TurnResult]:
        """Generate ``n`` independent turns from one prompt in ONE request (``n`` on ``/v1/completions``, or on
        ``/inference/v1/generate`` with ``tokens_route``).

        One request per group instead of ``n`` (issue #41): the server fans it out into ``n`` engine requests
        that share the prompt, and the worker pays one HTTP round trip and one response for the group.
        ``n > 1`` with ``return_sampling_mask`` needs ``tokens_route`` (else ValueError: send ``n`` single
        requests instead). Seeds: the request's seed (``sampling.seed``, else
        the client's next block of ``n`` seeds when ``request_seeds`` is on, else none) and ``seed + i`` for
        completion ``i``.

        Returns:
            ``n`` `TurnResult`, completion ``i`` at index ``i``; each carries the request's ``request_s`` (HTTP
            round trip, retries included) and ``parse_s`` (JSON decoding and reading, the whole response's).

        Raises:
            ValueError: empty or non-integer ``prompt_ids``, ``n < 1``, or ``n > 1`` with sampling masks off the
                tokens route.
            SamplerRequestError / SamplerRetryError / SamplerUnavailableError / SamplerProtocolError: as
            `generate_turn`.
        """
        if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise ValueError("prompt_ids must be a non-empty list of int token ids")
        if n < 1:
            raise ValueError(f"n={n}: at least one completion per request")
        if n > 1 and sampling.return_sampling_mask and not self.tokens_route:
            raise ValueError(f"n={n} with sampling masks: send n requests of n=1 (or use the tokens route, "
                             "tokens_route=True, which answers n completions with their masks)")
        if sampling.seed is not None:
            seed: int | None = sampling.seed
        else:
            seed = self.seeds.next(n) if self.request_seeds else None
        model = model or self.model
        if self.tokens_route:
            route, body = GENERATE_ROUTE, generate_body(prompt_ids, sampling, model, seed, n, detokenize=False)
        elif sampling.return_sampling_mask:
            route, body = GENERATE_ROUTE, generate_body(prompt_ids, sampling, model, seed)
        else:
            route, body = COMPLETIONS_ROUTE, completion_body(prompt_ids, sampling, model, seed, n)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrency)
        async with self._slots:
            sent = time.perf_counter()
            response = await self._send("POST", route, body=body)
            received = time.perf_counter()
        results = parse_turns(route, _json_body(route, response), prompt_ids, sampling, seed, n)
        parse_s = time.perf_counter() - received
        for result in results:
            result.request_s = received - sent
            result.parse_s = parse_s
        self.request_count += 1
        return results

    # ------------------------------------------------------------------ weight transfer
    async def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=...``: ``keep`` freezes in-flight requests until `resume` (SPEC B.23)."""
        await self._post("/pause", params={"mode": _pause_mode(mode)})

    async def resume(self) -> None:
        """``POST /resume``."""
        await self._post("/resume")

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, max_attempts: int = 10, retry_delay_s: float = 0.5
    ) -> bool:
        """``POST /reset_prefix_cache``, retried while the server answers ``success: false``.

        Args:
            reset_running_requests: also drop the KV of running requests (they are recomputed with
                the current weights; vLLM counts them as preemptions, SPEC B.23).
            max_attempts: attempts before giving up.
            retry_delay_s: pause between attempts.

        Returns:
            the last ``success`` value (True when the server sends no body, as older vLLM does).
        """
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        success = False
        for attempt in range(max_attempts):
            response = await self._post("/reset_prefix_cache", params=params)
            success = _reset_success(response)
            if success:
                return True
            if attempt + 1 < max_attempts:
                await asyncio.sleep(retry_delay_s)
        return success

    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        """``POST /init_weight_transfer_engine`` ``{"init_info": ...}`` (blocks until the NCCL group forms)."""
        await self._post("/init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(self) -> None:
        """``POST /start_weight_update``."""
        await self._post("/start_weight_update", {})

    async def update_weights(self, update_info: dict) -> None:
        """``POST /update_weights`` ``{"update_info": ...}`` (``names``, ``dtype_names``, ``shapes``; embedded: ``path``)."""
        await self._post("/update_weights", {"update_info": update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update`` (``weight_version`` is sent when given; vLLM 0.27+)."""
        await self._post("/finish_weight_update", {"weight_version": weight_version} if weight_version else {})

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """``POST /v1/load_lora_adapter``; requests then select it with ``model=name``."""
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace})

    async def unload_lora_adapter(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``."""
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})


def _reset_success(response: httpx.Response) -> bool:
    if not response.content:
        return True
    try:
        body = response.json()
    except ValueError:
        return True
    return bool(body.get("success", True)) if isinstance(body, dict) else True


# ---------------------------------------------------------------------------------------------- sync
class SyncSamplerClient:
    """Blocking client for the CLI, doctor and the trainer's weight-sync thread.

    Offers the reading routes (health, models, version, server_info, metrics, is_paused,
    world size) and the weight-transfer and LoRA routes, with the same errors and retry rules as
    `SamplerClient`: reading routes retried per B.17; control routes are not resent after a timeout,
    5xx or dropped connection (they change server state), but a refused connection is waited out on
    every route, for at most ``timeout_s`` per outage (`ServerOutage`, ``outage`` attribute; its
    ``recoveries`` tell the weight sync that the server came back and may have lost its weights).

    Args:
        base_url / timeout_s / max_retries / backoff_base_s / backoff_max_s / metrics_timeout_s:
            as in `SamplerClient`.
        transport: an ``httpx.BaseTransport`` (tests).
    """

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        *,
        timeout_s: float = 1800.0,
        max_retries: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        metrics_timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (vllm_server_timeout, seconds)")
        self.base_url = _normalise_url(base_url)
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.metrics_timeout_s = metrics_timeout_s
        self.retry_count = 0
        self.outage = ServerOutage(self.base_url, self.timeout_s)
        self.silence_budget: Callable[[], float | None] | None = None
        """Optional ``() -> seconds or None``: how much longer the server may stay silent (the trainer's
        ``ServerWatch``: ``timeout_s`` minus how long ``/health`` has gone unanswered); a request waits at most
        that (at least `SILENT_MIN_TIMEOUT_S`), so a hung server costs ``timeout_s`` in all, not per request."""
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(self.timeout_s), transport=transport)

    def __enter__(self) -> "SyncSamplerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _send(self, method: str, route: str, *, body: Any = None, params: dict | None = None, retry: bool = True,
              allow_404: bool = False) -> httpx.Response | None:
        state = _RetryState(self.base_url, route, self.timeout_s, self.max_retries if retry else 0,
                            self.backoff_base_s, self.backoff_max_s, outage=self.outage)
        while True:
            budget = self.silence_budget() if self.silence_budget is not None else None
            state.timeout_s = self.timeout_s if budget is None else \
                max(SILENT_MIN_TIMEOUT_S, min(self.timeout_s, budget))
            try:
                response = self._request(state, method, route, json=body, params=params,
                                         timeout=httpx.USE_CLIENT_DEFAULT if budget is None else state.timeout_s)
            except _TRANSPORT_ERRORS as exc:
                delay = state.on_error(exc, body, retry)
            else:
                self.outage.answered()  # an outage's end is logged by the outage
                done, delay = state.on_response(response, body, allow_404)
                if done:
                    return response if response.status_code != 404 else None
            self.retry_count += 1
            if self.outage.active:  # the outage logged its start once; the countdown is its status()
                log.debug("sampler %s%s: %s", self.base_url, route, self.outage.status())
            self._pause(delay)

    def _request(self, state: _RetryState, method: str, route: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request. With a `silence_budget` (the trainer's `ServerWatch`) it runs on a daemon thread and
        this one waits in slices of `WAKE_S` s: once the outage is abandoned (the watch found the server hung, a
        stop signal, the supervisor saw the server die) it raises `SamplerUnavailableError` at once, where a
        request already blocked on a server that went silent waited its whole timeout (``sampler.timeout``, 30
        minutes by default: a fresh user's trial with ``sampler.hang_timeout``, eighteenth session). The
        abandoned request ends at its own timeout or with the process."""
        if self.silence_budget is None:
            return self._http.request(method, route, **kwargs)
        import threading

        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["response"] = self._http.request(method, route, **kwargs)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"sampler-request {route}", daemon=True).start()
        while not done.wait(WAKE_S):
            state._raise_if_abandoned(f"no answer to {method} {route} yet; the request was left waiting")
        if "error" in box:
            raise box["error"]
        return box["response"]

    def _pause(self, delay: float) -> None:
        """Sleep ``delay`` s between tries, in slices of `WAKE_S` s, ending early once the outage was
        abandoned (a stop signal: the next decision then raises)."""
        deadline = time.monotonic() + delay
        while self.outage.abandoned is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(WAKE_S, left))

    def _get_json(self, route: str, params: dict | None = None, allow_404: bool = False) -> Any:
        response = self._send("GET", route, params=params, allow_404=allow_404)
        return None if response is None else _json_body(route, response)

    def _post(self, route: str, body: Any = None, params: dict | None = None) -> httpx.Response:
        return self._send("POST", route, body=body, params=params, retry=False)

    def wait_until_ready(self, deadline_s: float, poll_s: float = 0.5) -> float:
        """Poll ``GET /health`` until 200; returns seconds waited.

        Raises:
            SamplerUnavailableError: not healthy within ``deadline_s`` (names the URL and last error).
        """
        ready = _Readiness(self.base_url, deadline_s)
        while True:
            timeout = ready.next_timeout()
            try:
                waited = ready.answered(self._http.get("/health", timeout=timeout).status_code)
                if waited is not None:
                    return waited
            except httpx.HTTPError as exc:
                ready.failed(exc)
            time.sleep(ready.pause(poll_s))

    def health(self) -> bool:
        """True when ``GET /health`` answers 200 now."""
        try:
            return self._http.get("/health", timeout=min(self.timeout_s, 10.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[dict]:
        """``GET /v1/models`` → model cards."""
        return _parse_models("/v1/models", self._get_json("/v1/models"))

    def max_model_len(self) -> int:
        """The base model's ``max_model_len``."""
        return _base_max_model_len("/v1/models", self.models())

    def version(self) -> dict:
        """``GET /version``."""
        return self._get_json("/version")

    def server_info(self) -> dict | None:
        """``GET /server_info?config_format=json`` → the engine config (vLLM's ``vllm_config``);
        ``None`` when absent (vLLM without dev mode)."""
        return vllm_config_of(self._get_json("/server_info", params={"config_format": "json"}, allow_404=True))

    def read_metrics(self) -> ServerLoad | None:
        """``GET /metrics`` → `ServerLoad`; ``None`` without a metrics route or vLLM's load metrics."""
        try:
            response = self._http.get("/metrics", timeout=self.metrics_timeout_s)
        except httpx.HTTPError as exc:
            raise SamplerUnavailableError(f"{self.base_url}/metrics: {type(exc).__name__}: {exc}", "/metrics") from exc
        return _server_load(self.base_url, response)

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        body = self._get_json("/is_paused")
        if not isinstance(body, dict) or "is_paused" not in body:
            raise _fail("/is_paused", "no 'is_paused'")
        return bool(body["is_paused"])

    def get_world_size(self) -> int:
        """``GET /get_world_size``."""
        body = self._get_json("/get_world_size")
        if not isinstance(body, dict) or not isinstance(body.get("world_size"), int):
            raise _fail("/get_world_size", "no integer 'world_size'")
        return body["world_size"]

    def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=...``."""
        self._post("/pause", params={"mode": _pause_mode(mode)})

    def resume(self) -> None:
        """``POST /resume``."""
        self._post("/resume")

    def reset_prefix_cache(self, reset_running_requests: bool = False, max_attempts: int = 10,
                           retry_delay_s: float = 0.5) -> bool:
        """``POST /reset_prefix_cache`` retried while ``success: false``; returns the last success."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        success = False
        for attempt in range(max_attempts):
            success = _reset_success(self._post("/reset_prefix_cache", params=params))
            if success:
                return True
            if attempt + 1 < max_attempts:
                time.sleep(retry_delay_s)
        return success

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """``POST /init_weight_transfer_engine``."""
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``POST /start_weight_update``."""
        self._post("/start_weight_update", {})

    def update_weights(self, update_info: dict) -> None:
        """``POST /update_weights`` (blocks until the server has the weights)."""
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``."""
        self._post("/finish_weight_update", {"weight_version": weight_version} if weight_version else {})

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """``POST /v1/load_lora_adapter``."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace})

    def unload_lora_adapter(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``."""
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def complete(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None = None) -> TurnResult:
        """One completion of ``prompt_ids`` on ``/v1/completions``, blocking, with ``sampling.seed`` as its seed
        (none when None): the trainer's weight-sync check (`asyncgrpo_cli.train.sync_check`), not the rollouts.

        Raises:
            SamplerRequestError / SamplerRetryError / SamplerUnavailableError / SamplerProtocolError: as
            `AsyncSamplerClient.generate_turn`.
        """
        body = completion_body(prompt_ids, sampling, model, sampling.seed, 1)
        response = self._send("POST", COMPLETIONS_ROUTE, body=body)
        return parse_turns(COMPLETIONS_ROUTE, _json_body(COMPLETIONS_ROUTE, response), prompt_ids, sampling,
                           sampling.seed, 1)[0]
