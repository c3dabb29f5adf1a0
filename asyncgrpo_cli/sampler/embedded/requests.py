"""Reading vLLM-shaped request bodies for the embedded sampler: numbers, token-id prompts and sampling
parameters checked with vLLM's 400 error shape (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .sampling import SamplingOptions

_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)

class BadRequest(Exception):
    """A request the server rejects; becomes a vLLM-style error body with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return web.json_response(body, status=status)


# ---------------------------------------------------------------------------------------------- parsing
def _number(body: dict, key: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} must be a number, got {value!r}", param=key)
    value = float(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise BadRequest(f"{key} must be {'>' if lo_open else '>='} {lo}, got {value}", param=key)
    if hi is not None and value > hi:
        raise BadRequest(f"{key} must be <= {hi}, got {value}", param=key)
    return value


def _integer(body: dict, key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}", param=key)
    return value


def _token_ids(value: Any, key: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{key} must be a non-empty list of token ids", param=key)
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise BadRequest(f"{key} must hold integers, got {tok!r}", param=key)
        if not 0 <= tok < vocab_size:
            raise BadRequest(f"Token id {tok} is out of vocabulary (size {vocab_size})", param=key)
    return list(value)


def parse_sampling(
    body: dict,
    *,
    prompt_len: int,
    max_model_len: int,
    max_logprobs: int,
    default_max_tokens: int,
    strict_length: bool,
    want_mask: bool,
) -> SamplingOptions:
    """Validate vLLM sampling fields of ``body`` into `SamplingOptions`.

    Args:
        body: the request (completions) or its ``sampling_params`` (generate).
        prompt_len: prompt tokens.
        max_model_len: the server's limit.
        max_logprobs: the server's ``--max-logprobs``.
        default_max_tokens: used when ``max_tokens`` is absent.
        strict_length: ``/v1/completions``: prompt + max_tokens > max_model_len is a 400;
            otherwise (generate) output is cut at max_model_len and only a prompt of
            ``max_model_len`` tokens or more is a 400 (SPEC §8.3).
        want_mask: record candidate sets.

    Raises:
        BadRequest: a field out of range, naming it and the value.
    """
    if prompt_len >= max_model_len and not strict_length:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} prompt tokens, which leaves no room for output. Please shorten the prompt."
        )
    max_tokens = _integer(body, "max_tokens", None)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if strict_length and prompt_len + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in max_tokens). "
            "Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
        )
    top_k = _integer(body, "top_k", 0)
    if top_k < -1:
        raise BadRequest(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {top_k}", param="top_k")
    seed = _integer(body, "seed", None)
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise BadRequest(f"seed must fit in a signed 64-bit integer, got {seed}", param="seed")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):  # chat-style flag: True means the sampled token only
        logprobs = 0 if logprobs else None
    if logprobs is not None:
        if not isinstance(logprobs, int):
            raise BadRequest(f"logprobs must be an integer, got {logprobs!r}", param="logprobs")
        if logprobs < 0:
            raise BadRequest(f"logprobs must be >= 0, got {logprobs}", param="logprobs")
        if logprobs > max_logprobs:
            raise BadRequest(
                f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {max_logprobs}",
                param="logprobs",
            )
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest(f"stop_token_ids must be a list of integers, got {stop_ids!r}", param="stop_token_ids")
    temperature = _number(body, "temperature", 1.0, lo=0.0)
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    min_p = _number(body, "min_p", 0.0, lo=0.0, hi=1.0)
    repetition_penalty = _number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        logprobs=logprobs,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)),
        return_sampling_mask=want_mask,
    )


# ---------------------------------------------------------------------------------------------- server
