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

The connection pool holds ``max_concurrency + 4`` connections (never httpx's default cap): at most
``max_concurrency`` generation requests run at once (an internal semaphore), and the 4 extra
connections keep ``/metrics`` and the control routes answering while generation saturates the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..rollout.types import TurnRecord
from .prometheus import ServerLoad, parse_server_load

log = logging.getLogger(__name__)

COMPLETIONS_ROUTE = "/v1/completions"
GENERATE_ROUTE = "/inference/v1/generate"
CONTROL_CONNECTIONS = 4


# ---------------------------------------------------------------------------------------------- errors
class SamplerError(RuntimeError):
    """Base of every sampler-boundary failure; ``route`` is the path that failed."""

    def __init__(self, message: str, route: str | None = None) -> None:
        super().__init__(message)
        self.route = route


class SamplerUnavailableError(SamplerError):
    """The server cannot be reached (refused connections past the deadline, or never became ready)."""


class SamplerRetryError(SamplerError):
    """A request kept failing (timeouts, 5xx, dropped connections) after every allowed retry."""


class SamplerRequestError(SamplerError):
    """The server rejected a request with a 4xx; ``status`` and ``server_message`` say why."""

    def __init__(self, message: str, route: str, status: int, server_message: str) -> None:
        super().__init__(message, route)
        self.status = status
        self.server_message = server_message


class SamplerProtocolError(SamplerError):
    """The server answered 2xx with a body this client cannot read (not JSON, missing fields)."""


# ---------------------------------------------------------------------------------------------- params
@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one turn, in vLLM's units (SPEC §7, §16.2).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: >= 0; 0 = greedy.
        top_p: in (0, 1]; 1 = off.
        top_k: 0 = off (vLLM's -1 is accepted and means the same).
        min_p: in [0, 1]; 0 or ``None`` = off.
        repetition_penalty: > 0; 1 = off.
        logprobs: top-N sampler log-probs per token (``num_sampler_logprobs``); 0 = only the
            sampled token's log-prob (always returned).
        return_sampling_mask: ask for each token's candidate set (routes the request to
            ``/inference/v1/generate``).
        seed: fixed seed; ``None`` = the client's unique per-request seed.
        stop_token_ids: extra token ids that end the turn.
        ignore_eos: keep generating past EOS (benchmarks).

    Raises:
        ValueError: a field out of range, naming it and the accepted range.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    logprobs: int = 0
    return_sampling_mask: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 or -1 = disabled)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        if self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs={self.logprobs} must be >= 0")


@dataclass
class TurnResult:
    """What one generation request returned.

    Attributes:
        prompt_ids: the prompt sent.
        output_ids: generated token ids.
        output_log_probs: processed sampler log-prob of each output token (natural log).
        top_logprobs: per output token, the top-N log-probs keyed by token id (exactly N entries;
            fewer only if the server returned fewer); ``None`` when ``logprobs == 0``.
        finish_reason: ``"stop"``, ``"length"`` (or ``"abort"`` when the server aborted it).
        sampling_mask: per output token, the candidate token ids; ``None`` when not requested or
            not returned by the server (the trainer then uses the full vocabulary, SPEC §7).
        seed: the seed sent with the request.
        route: the route that answered.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    sampling_mask: list[list[int]] | None
    seed: int
    route: str

    def to_turn_record(self, output_mask: list[int] | None = None) -> TurnRecord:
        """This turn as the shared `TurnRecord` (SPEC §16.7)."""
        return TurnRecord(
            prompt_ids=list(self.prompt_ids),
            output_ids=list(self.output_ids),
            output_log_probs=list(self.output_log_probs),
            output_mask=output_mask,
            output_sampling_mask=self.sampling_mask,
            output_sampler_logprobs=self.top_logprobs,
            finish_reason=self.finish_reason,
        )


class SeedSequence:
    """Unique request seeds: ``(base + counter) mod 2**63`` with a random 63-bit ``base``.

    Args:
        base: fix the base (tests); default: drawn from the OS entropy source.
    """

    def __init__(self, base: int | None = None) -> None:
        self.base = random.SystemRandom().getrandbits(63) if base is None else int(base) % 2**63
        self.counter = 0

    def next(self) -> int:
        """The next seed, in [0, 2**63)."""
        seed = (self.base + self.counter) % 2**63
        self.counter += 1
        return seed


# ---------------------------------------------------------------------------------------------- bodies
def completion_body(prompt_ids: list[int], sampling: SamplingParams, model: str | None, seed: int) -> dict:
    """The ``/v1/completions`` JSON for one token-id prompt (only non-default fields are sent)."""
    body: dict[str, Any] = {
        "prompt": list(prompt_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": seed,
        "logprobs": sampling.logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    body.update(_optional_sampling(sampling))
    if model:
        body["model"] = model
    return body


def generate_body(prompt_ids: list[int], sampling: SamplingParams, model: str | None, seed: int) -> dict:
    """The ``/inference/v1/generate`` JSON (tokens in/out) for one prompt."""
    params: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": seed,
        "logprobs": sampling.logprobs,
    }
    params.update(_optional_sampling(sampling))
    body: dict[str, Any] = {"token_ids": list(prompt_ids), "sampling_params": params}
    if model:
        body["model"] = model
    return body


def _optional_sampling(sampling: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if sampling.top_k > 0:
        out["top_k"] = sampling.top_k
    if sampling.min_p:
        out["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1.0:
        out["repetition_penalty"] = sampling.repetition_penalty
    if sampling.stop_token_ids:
        out["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        out["ignore_eos"] = True
    return out


# ---------------------------------------------------------------------------------------------- parsing
def token_id_from_key(key: Any, route: str) -> int:
    """Token id of a top-log-prob key: an int, or a ``"token_id:N"`` string.

    Raises:
        SamplerProtocolError: any other key (the server ignored ``return_tokens_as_token_ids``).
    """
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.startswith("token_id:"):
        try:
            return int(key[len("token_id:"):])
        except ValueError:
            pass
    raise SamplerProtocolError(
        f"{route}: log-prob key {key!r} is not a token id ('token_id:N'); the server ignored "
        "return_tokens_as_token_ids",
        route,
    )


def keep_top_n(entries: dict[int, float], n: int) -> dict[int, float]:
    """The ``n`` largest entries of ``entries`` (by log-prob), most likely first."""
    ranked = sorted(entries.items(), key=lambda kv: kv[1], reverse=True)
    return dict(ranked[:n])


def _fail(route: str, what: str) -> SamplerProtocolError:
    return SamplerProtocolError(f"{route}: malformed response: {what}", route)


def _first_choice(route: str, data: Any) -> dict:
    if not isinstance(data, dict):
        raise _fail(route, f"expected a JSON object, got {type(data).__name__}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail(route, "no 'choices' list")
    return choices[0]


def _completion_style_logprobs(route: str, lp: dict, n: int, num_tokens: int) -> tuple[list[float], list[dict[int, float]] | None]:
    token_logprobs = lp.get("token_logprobs")
    if not isinstance(token_logprobs, list) or len(token_logprobs) != num_tokens:
        raise _fail(route, f"logprobs.token_logprobs must list one value per output token ({num_tokens})")
    if any(not isinstance(v, (int, float)) for v in token_logprobs):
        raise _fail(route, "logprobs.token_logprobs holds a non-number")
    tops = None
    if n > 0:
        raw = lp.get("top_logprobs")
        if not isinstance(raw, list) or len(raw) != num_tokens:
            raise _fail(route, f"logprobs.top_logprobs must list one entry per output token ({num_tokens})")
        tops = []
        for pos in raw:
            if not isinstance(pos, dict):
                raise _fail(route, "logprobs.top_logprobs entries must be objects")
            tops.append(keep_top_n({token_id_from_key(k, route): float(v) for k, v in pos.items()}, n))
    return [float(v) for v in token_logprobs], tops


def _content_style_logprobs(route: str, content: list, n: int, output_ids: list[int]) -> tuple[list[float], list[dict[int, float]] | None]:
    if len(content) != len(output_ids):
        raise _fail(route, f"logprobs.content has {len(content)} entries for {len(output_ids)} output tokens")
    sampled, tops = [], []
    for entry in content:
        if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), (int, float)):
            raise _fail(route, "logprobs.content entries need a numeric 'logprob'")
        sampled.append(float(entry["logprob"]))
        if n > 0:
            pos: dict[int, float] = {}
            for item in entry.get("top_logprobs") or []:
                key = item.get("token_id") if isinstance(item.get("token_id"), int) else item.get("token")
                pos[token_id_from_key(key, route)] = float(item["logprob"])
            tops.append(keep_top_n(pos, n))
    return sampled, (tops if n > 0 else None)


def parse_turn(route: str, data: Any, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> TurnResult:
    """Read one generation response (either route, either log-prob format) into a `TurnResult`.

    Raises:
        SamplerProtocolError: missing token ids or log-probs, or lengths that disagree.
    """
    choice = _first_choice(route, data)
    lp = choice.get("logprobs")
    output_ids = choice.get("token_ids")
    if output_ids is None and isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        output_ids = [token_id_from_key(t, route) for t in lp["tokens"]]
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise _fail(route, "no 'token_ids' in the choice (send return_token_ids=true)")
    if not isinstance(lp, dict):
        if not output_ids:
            lp = {"token_logprobs": [], "top_logprobs": []}
        else:
            raise _fail(route, "no 'logprobs' in the choice (the request asked for them)")
    n = sampling.logprobs
    if isinstance(lp.get("content"), list):
        sampled, tops = _content_style_logprobs(route, lp["content"], n, output_ids)
    else:
        sampled, tops = _completion_style_logprobs(route, lp, n, len(output_ids))
    mask = choice.get("sampling_mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(output_ids):
            raise _fail(route, f"sampling_mask must list one candidate set per output token ({len(output_ids)})")
        mask = [list(m) for m in mask]
    return TurnResult(
        prompt_ids=list(prompt_ids),
        output_ids=list(output_ids),
        output_log_probs=sampled,
        top_logprobs=tops,
        finish_reason=choice.get("finish_reason"),
        sampling_mask=mask if sampling.return_sampling_mask else None,
        seed=seed,
        route=route,
    )


def server_error_message(response: httpx.Response) -> str:
    """The server's error text: vLLM's ``error.message`` (or ``message``/``detail``), else the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:1000] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return json.dumps(body)[:1000]


def request_summary(body: Any) -> str:
    """A short description of a request body for error messages (lists shown by length)."""
    if not isinstance(body, dict):
        return "no body"
    parts = []
    for key, value in body.items():
        if isinstance(value, list):
            parts.append(f"{key}=<{len(value)} items>")
        elif isinstance(value, dict):
            parts.append(f"{key}={{{request_summary(value)}}}")
        else:
            parts.append(f"{key}={value!r}")
    return ", ".join(parts)


def _json_body(route: str, response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        snippet = response.text[:200]
        raise SamplerProtocolError(
            f"{route}: the server answered HTTP {response.status_code} with a body that is not JSON: {snippet!r}",
            route,
        ) from None


def _parse_models(route: str, body: Any) -> list[dict]:
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise _fail(route, "no 'data' list")
    return body["data"]


def _base_max_model_len(route: str, models: list[dict]) -> int:
    for card in models:
        if card.get("parent") is None and isinstance(card.get("max_model_len"), int):
            return card["max_model_len"]
    raise _fail(route, "no base model with 'max_model_len'")


def _server_load(base_url: str, response: httpx.Response) -> ServerLoad | None:
    """The `ServerLoad` of a ``/metrics`` answer; None for 404 or no vLLM load metrics.

    Raises:
        SamplerError: an HTTP error status; SamplerProtocolError: text that is not Prometheus exposition.
    """
    route = "/metrics"
    if response.status_code == 404:
        return None
    if response.status_code >= 400:
        raise SamplerError(f"{base_url}{route}: HTTP {response.status_code}", route)
    try:
        return parse_server_load(response.text)
    except ValueError as exc:
        raise SamplerProtocolError(f"{base_url}{route}: {exc}", route) from exc


def _normalise_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url={url!r} must start with http:// or https:// (e.g. http://localhost:8000)")
    return url


def _pause_mode(mode: str) -> str:
    if mode not in ("keep", "abort", "wait"):
        raise ValueError(f"pause mode={mode!r} must be 'keep', 'abort' or 'wait'")
    return mode


# ---------------------------------------------------------------------------------------------- retries
class _RetryState:
    """The retry decisions of SPEC Appendix B.17 for one request (no I/O: callers sleep)."""

    def __init__(self, url: str, route: str, timeout_s: float, max_retries: int, base_s: float, max_s: float) -> None:
        self.url, self.route = url, route
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.base_s, self.max_s = base_s, max_s
        self.retries = 0  # retries after timeouts / 5xx / dropped connections
        self.refusals = 0
        self.refused_since: float | None = None

    def _backoff(self, n: int) -> float:
        return min(self.base_s * (2**n), self.max_s)

    def on_refused(self, exc: Exception, body: Any) -> float:
        """Connection refused: the delay before the next try, or raise once ``timeout_s`` has passed."""
        now = time.monotonic()
        if self.refused_since is None:
            self.refused_since = now
        waited = now - self.refused_since
        remaining = self.timeout_s - waited
        if remaining <= 0:
            raise SamplerUnavailableError(
                f"{self.url}{self.route}: the server refused connections for {waited:.1f} s "
                f"(vllm_server_timeout={self.timeout_s:g} s); is it running? last error: {exc!r}; "
                f"request: {request_summary(body)}",
                self.route,
            )
        delay = min(self._backoff(self.refusals), remaining)
        self.refusals += 1
        return delay

    def on_failure(self, reason: str, body: Any) -> float:
        """Timeout, 5xx or dropped connection: the delay before retrying, or raise when exhausted."""
        self.refused_since = None
        if self.retries >= self.max_retries:
            tried = f" after {self.retries} retries" if self.retries else ""
            raise SamplerRetryError(
                f"{self.url}{self.route}: failed{tried}: {reason}; "
                f"request: {request_summary(body)}",
                self.route,
            )
        delay = self._backoff(self.retries)
        self.retries += 1
        return delay


def _classify(exc: Exception, timeout_s: float) -> str:
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        return f"timed out after {timeout_s:g} s ({type(exc).__name__})"
    return f"connection error ({type(exc).__name__}: {exc})"


def _raise_for_4xx(url: str, route: str, response: httpx.Response, body: Any) -> None:
    message = server_error_message(response)
    hint = ""
    route_missing = response.status_code == 403 or (response.status_code == 404 and "model" not in message.lower())
    if route == GENERATE_ROUTE and route_missing:
        hint = " (this vLLM needs --enable-scale-out for /inference/v1/generate, or is older than 0.26)"
    raise SamplerRequestError(
        f"{url}{route} rejected the request with HTTP {response.status_code}: {message}{hint}; "
        f"request: {request_summary(body)}",
        route,
        response.status_code,
        message,
    )


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
        transport: an ``httpx.AsyncBaseTransport`` (tests).

    Attributes:
        retry_count: retries so far (``rollout/vllm_retry_count``).
        request_count: generation requests completed.

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
        self.retry_count = 0
        self.request_count = 0
        size = max_concurrency + CONTROL_CONNECTIONS
        self.limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            limits=self.limits,
            timeout=httpx.Timeout(self.timeout_s),
            transport=transport,
        )
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
                            self.backoff_base_s, self.backoff_max_s)
        while True:
            try:
                response = await asyncio.wait_for(
                    self._http.request(method, route, json=body, params=params, timeout=timeout_s), timeout_s
                )
            except httpx.ConnectError as exc:
                if not retry:
                    raise SamplerUnavailableError(f"{self.base_url}{route}: cannot connect: {exc!r}", route) from exc
                delay = state.on_refused(exc, body)
            except (httpx.TimeoutException, httpx.TransportError, asyncio.TimeoutError) as exc:
                delay = state.on_failure(_classify(exc, timeout_s), body)
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 404 and allow_404:
                    return None
                if response.status_code < 500:
                    _raise_for_4xx(self.base_url, route, response, body)
                delay = state.on_failure(f"HTTP {response.status_code}: {server_error_message(response)}", body)
            self.retry_count += 1
            log.warning("sampler %s%s: retrying in %.1f s (retry %d)", self.base_url, route, delay, self.retry_count)
            await asyncio.sleep(delay)

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
        start = time.monotonic()
        last = "no answer yet"
        while True:
            remaining = deadline_s - (time.monotonic() - start)
            if remaining <= 0:
                raise SamplerUnavailableError(
                    f"sampler at {self.base_url} not ready after {deadline_s:g} s (GET /health): {last}", "/health"
                )
            try:
                response = await self._http.get("/health", timeout=max(min(5.0, remaining), 0.05))
                if response.status_code == 200:
                    return time.monotonic() - start
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(min(poll_s, max(deadline_s - (time.monotonic() - start), 0)))

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 now (no retries)."""
        try:
            response = await self._http.get("/health", timeout=min(self.timeout_s, 10.0))
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
        """``GET /server_info?config_format=json`` (vLLM dev mode); ``None`` when the route is absent."""
        return await self._get_json("/server_info", params={"config_format": "json"}, allow_404=True)

    async def read_metrics(self) -> ServerLoad | None:
        """Read ``/metrics`` once (no retries, ``metrics_timeout_s``) into a `ServerLoad` (SPEC §4.2).

        Returns:
            the load, or ``None`` when the server has no ``/metrics`` (404) or it holds none of
            vLLM's load metrics (the caller then uses ``max_concurrent_rollouts``).

        Raises:
            SamplerError: unreachable, or text that is not Prometheus exposition.
        """
        try:
            response = await self._http.get("/metrics", timeout=self.metrics_timeout_s)
        except httpx.HTTPError as exc:
            raise SamplerUnavailableError(f"{self.base_url}/metrics: {type(exc).__name__}: {exc}", "/metrics") from exc
        return _server_load(self.base_url, response)

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
        """Generate one turn from ``prompt_ids`` (SPEC §3.1, B.17).

        Args:
            prompt_ids: the full prompt of the turn, token ids.
            sampling: `SamplingParams`; ``return_sampling_mask`` selects ``/inference/v1/generate``.
            model: the served model or LoRA adapter name; default the client's ``model``.

        Returns:
            `TurnResult` with output ids, processed log-probs, top-N by token id, finish reason
            and (when asked and returned) the sampling mask.

        Raises:
            ValueError: empty or non-integer ``prompt_ids``.
            SamplerRequestError: the server rejected the request (4xx), e.g. too long for max_model_len.
            SamplerRetryError / SamplerUnavailableError: retries exhausted / server unreachable.
            SamplerProtocolError: an unreadable response.
        """
        if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise ValueError("prompt_ids must be a non-empty list of int token ids")
        seed = sampling.seed if sampling.seed is not None else self.seeds.next()
        model = model or self.model
        if sampling.return_sampling_mask:
            route, body = GENERATE_ROUTE, generate_body(prompt_ids, sampling, model, seed)
        else:
            route, body = COMPLETIONS_ROUTE, completion_body(prompt_ids, sampling, model, seed)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrency)
        async with self._slots:
            response = await self._send("POST", route, body=body)
        result = parse_turn(route, _json_body(route, response), prompt_ids, sampling, seed)
        self.request_count += 1
        return result

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
    `SamplerClient` (reading routes retried per B.17; control routes single attempt).

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
                            self.backoff_base_s, self.backoff_max_s)
        while True:
            try:
                response = self._http.request(method, route, json=body, params=params)
            except httpx.ConnectError as exc:
                if not retry:
                    raise SamplerUnavailableError(f"{self.base_url}{route}: cannot connect: {exc!r}", route) from exc
                delay = state.on_refused(exc, body)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                delay = state.on_failure(_classify(exc, self.timeout_s), body)
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 404 and allow_404:
                    return None
                if response.status_code < 500:
                    _raise_for_4xx(self.base_url, route, response, body)
                delay = state.on_failure(f"HTTP {response.status_code}: {server_error_message(response)}", body)
            self.retry_count += 1
            time.sleep(delay)

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
        start = time.monotonic()
        last = "no answer yet"
        while True:
            remaining = deadline_s - (time.monotonic() - start)
            if remaining <= 0:
                raise SamplerUnavailableError(
                    f"sampler at {self.base_url} not ready after {deadline_s:g} s (GET /health): {last}", "/health"
                )
            try:
                response = self._http.get("/health", timeout=max(min(5.0, remaining), 0.05))
                if response.status_code == 200:
                    return time.monotonic() - start
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(min(poll_s, max(deadline_s - (time.monotonic() - start), 0)))

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
        """``GET /server_info?config_format=json``; ``None`` when absent (vLLM without dev mode)."""
        return self._get_json("/server_info", params={"config_format": "json"}, allow_404=True)

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
