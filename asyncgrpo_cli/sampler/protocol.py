"""The vLLM request/response protocol the sampler client speaks (VLLM.md): sampling parameters, request
bodies of ``/v1/completions`` and ``/inference/v1/generate``, parsing of both top-log-prob formats into a
`TurnResult`, the errors a route can raise, and request seeds. Pure functions and data, no I/O.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from .turn_record import TurnRecord
from .prometheus import ServerLoad, parse_server_load

try:  # orjson decodes a generation answer (top log-probs of every token) 2-3x faster than the json module
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - a dependency; the json module reads the same answers
    _loads = json.loads

COMPLETIONS_ROUTE = "/v1/completions"
GENERATE_ROUTE = "/inference/v1/generate"



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


class SamplerConnectionLost(SamplerRetryError):
    """A `SamplerRetryError` whose last failure was the transport (a dropped connection or a timeout), not
    an HTTP answer: the server may have gone away mid-request (SPEC B.17)."""


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
        seed: the seed of this completion (the request's, ``+ i`` for choice ``i`` of an ``n``-request);
            ``None`` when the request sent none (the server drew it).
        route: the route that answered.
        request_s: seconds of the HTTP round trip of the request that returned it (send to body read, retries
            included); shared by the ``n`` turns of one ``n``-request.
        parse_s: seconds spent decoding and reading the response body, the request's total (not per turn).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    sampling_mask: list[list[int]] | None
    seed: int | None
    route: str
    request_s: float = 0.0
    parse_s: float = 0.0

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

    def next(self, count: int = 1) -> int:
        """The next seed, in [0, 2**63); ``count`` reserves that many consecutive seeds (an ``n``-request's
        completions are sampled with ``seed + i``), so no two completions share one."""
        count = max(1, int(count))
        seed = (self.base + self.counter) % 2**63
        if seed + count > 2**63:  # the n seeds would pass vLLM's int64: start this block at 0 instead
            self.counter += 2**63 - seed
            seed = 0
        self.counter += count
        return seed


# ---------------------------------------------------------------------------------------------- bodies
def completion_body(prompt_ids: list[int], sampling: SamplingParams, model: str | None, seed: int | None,
                    n: int = 1) -> dict:
    """The ``/v1/completions`` JSON for one token-id prompt (only non-default fields are sent).

    ``n > 1`` asks for ``n`` completions of the prompt in one request (vLLM fans it out into ``n`` engine
    requests sharing the prompt; with a ``seed``, completion ``i`` is sampled with ``seed + i``). ``seed=None``
    sends none: the server draws one per request."""
    body: dict[str, Any] = {
        "prompt": list(prompt_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "logprobs": sampling.logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    if n != 1:
        body["n"] = int(n)
    body.update(_optional_sampling(sampling))
    if model:
        body["model"] = model
    return body


def generate_body(prompt_ids: list[int], sampling: SamplingParams, model: str | None, seed: int | None,
                  n: int = 1, detokenize: bool = True) -> dict:
    """The ``/inference/v1/generate`` JSON (tokens in/out) for one prompt; ``seed=None`` sends none, ``n > 1``
    asks for ``n`` completions (``seed + i`` each), ``detokenize=False`` spares the server the output text."""
    params: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "logprobs": sampling.logprobs,
    }
    if seed is not None:
        params["seed"] = seed
    if n != 1:
        params["n"] = int(n)
    if not detokenize:
        params["detokenize"] = False
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
    try:
        sampled = [float(v) for v in token_logprobs]  # float(True) passes: vLLM never sends a boolean here
    except (TypeError, ValueError):
        raise _fail(route, "logprobs.token_logprobs holds a non-number") from None
    tops = None
    if n > 0:
        raw = lp.get("top_logprobs")
        if not isinstance(raw, list) or len(raw) != num_tokens:
            raise _fail(route, f"logprobs.top_logprobs must list one entry per output token ({num_tokens})")
        prefix = len("token_id:")
        # The worker's hot path (issue #41): with "token_id:N" keys (the request asks for them; checked on the first
        # key of the answer) one int() per key, the values as decoded, and no per-position type checks: a position
        # that is not an object, or a key that is not a token id, falls to the checked path below.
        first = raw[0] if raw and isinstance(raw[0], dict) else None
        fast = first is not None and next(iter(first), "token_id:")[:prefix] == "token_id:"
        tops = []
        append = tops.append
        for pos in raw:
            entries = None
            if fast:
                try:
                    entries = {int(k[prefix:]): v for k, v in pos.items()}
                except (AttributeError, TypeError, ValueError):
                    entries = None
            if entries is None or len(entries) != len(pos):
                if not isinstance(pos, dict):
                    raise _fail(route, "logprobs.top_logprobs entries must be objects")
                entries = {token_id_from_key(k, route): float(v) for k, v in pos.items()}
            append(entries if len(entries) <= n else keep_top_n(entries, n))
    return sampled, tops


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


def parse_turn(route: str, data: Any, prompt_ids: list[int], sampling: SamplingParams, seed: int | None) -> TurnResult:
    """Read one generation response (either route, either log-prob format) into a `TurnResult` (its first choice).

    Raises:
        SamplerProtocolError: missing token ids or log-probs, or lengths that disagree.
    """
    return _parse_choice(route, _first_choice(route, data), prompt_ids, sampling, seed)


def parse_turns(route: str, data: Any, prompt_ids: list[int], sampling: SamplingParams, seed: int | None,
                n: int) -> list[TurnResult]:
    """Read the ``n`` choices of one ``n``-completion response into ``n`` `TurnResult`, in ``index`` order.

    Choice ``i``'s ``seed`` is ``seed + i`` (vLLM's rule for its child requests), or None without a seed.

    Raises:
        SamplerProtocolError: not exactly ``n`` choices with the indices 0..n-1, or a choice `parse_turn` refuses.
    """
    if n == 1:
        return [parse_turn(route, data, prompt_ids, sampling, seed)]
    _first_choice(route, data)
    choices = data["choices"]
    if len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise _fail(route, f"asked for n={n} completions, the answer holds {len(choices)} choices")
    by_index = sorted(choices, key=lambda c: c.get("index", -1) if isinstance(c.get("index"), int) else -1)
    if [c.get("index") for c in by_index] != list(range(n)):
        raise _fail(route, f"choice indices {[c.get('index') for c in choices]} are not 0..{n - 1}")
    return [_parse_choice(route, c, prompt_ids, sampling, None if seed is None else (seed + i) % 2**63)
            for i, c in enumerate(by_index)]


def _parse_choice(route: str, choice: dict, prompt_ids: list[int], sampling: SamplingParams,
                  seed: int | None) -> TurnResult:
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


def vllm_config_of(info: Any) -> dict | None:
    """The engine config inside a ``GET /server_info?config_format=json`` answer.

    vLLM (0.26 and later) answers ``{"vllm_config": {...}, "vllm_env": {...}, "system_env": {...}}``
    with ``model_config``, ``weight_transfer_config``, ``lora_config``, ... inside ``vllm_config``
    (a JSON-encoded string is accepted too); the embedded server answers the same shape.

    Returns:
        the ``vllm_config`` dict; ``None`` when ``info`` is ``None`` (no dev-mode route), and ``{}``
        when the answer holds no JSON config (e.g. ``config_format=text``).
    """
    if info is None:
        return None
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return {}
    return config if isinstance(config, dict) else {}


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
        return _loads(response.content)
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
