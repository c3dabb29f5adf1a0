"""Can the server return the candidate sets that top-k/top-p/min-p need? (SPEC §7, issue #19)

Without a candidate set per sampled token the trainer normalises over the full vocabulary while the
sampler normalised over the set: every importance ratio is biased low (0.15 was measured), most tokens
fall under the masked-IS clip, and the run trains on nothing. So such a server is refused at start,
unless the user opts into SPEC §7's fallback (``rollout.sampling_mask_fallback``), which then warns.

`sampling_mask_verdict` is pure (used by ``asyncgrpo doctor``, the CLI's start-up doctor and the trainer);
`require_sampling_mask` raises on a failing verdict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config.rules import ConfigError

SAMPLING_MASK_MIN_VLLM = (0, 28)
EMBEDDED_SERVER = "asyncgrpo-embedded"

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass(frozen=True)
class MaskVerdict:
    """``status`` pass / warn / fail, what was found and what to do."""

    status: str
    message: str
    fix: str = ""


def _version_tuple(text: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(p) for p in parts) if parts else None


def scale_out_answer(status_code: int | None) -> bool | None:
    """What an empty ``POST /inference/v1/generate`` says about ``--enable-scale-out`` (no I/O).

    vLLM 0.33 mounts the route but answers 403 unless the server was started with ``--enable-scale-out``;
    a request it validates (400/422) means the route is on; 404 (an older vLLM, or another server) or no
    answer says nothing.
    """
    if status_code == 403:
        return False
    if status_code in (200, 400, 422):
        return True
    return None


def probe_scale_out(base_url: str, timeout_s: float = 10.0) -> bool | None:
    """`scale_out_answer` of the server at ``base_url`` (one request with an empty body; None on no answer)."""
    import httpx

    try:
        return scale_out_answer(httpx.post(f"{base_url.rstrip('/')}/inference/v1/generate", json={},
                                           timeout=timeout_s).status_code)
    except httpx.HTTPError:
        return None


def sampling_mask_verdict(uses_candidate_sets: bool, server_info: dict[str, Any] | None,
                          version: dict[str, Any] | None, *, fallback: bool,
                          fallback_key: str = "rollout.sampling_mask_fallback",
                          scale_out: bool | None = None) -> MaskVerdict | None:
    """Whether the server can return candidate sets when the config filters (no I/O).

    Args:
        uses_candidate_sets: top-k, top-p or min-p filtering is on.
        server_info: the engine config of ``/server_info?config_format=json`` (vLLM's ``vllm_config``), or
            None when the route is not served (nothing can be said; the dev-mode check reports it).
        version: the ``/version`` answer (``{"version": "0.28.1"}``; the embedded server adds
            ``"server": "asyncgrpo-embedded"``).
        fallback: the user accepts biased ratios (SPEC §7's fallback).
        fallback_key: the config key of ``fallback``, for the messages.
        scale_out: `scale_out_answer` of the server (None: not known). The candidate sets come back only
            from ``/inference/v1/generate``, which vLLM 0.33 refuses (403) without ``--enable-scale-out``.

    Returns:
        None when no filter is on or nothing is known; else a `MaskVerdict` (fail without the fallback,
        warn with it, pass when the server returns the sets).
    """
    if not uses_candidate_sets or server_info is None:
        return None
    model_config = server_info.get("model_config") if isinstance(server_info, dict) else None
    has_mask = bool((model_config or {}).get("return_sampling_mask"))
    if has_mask and scale_out is False:
        return MaskVerdict(FAIL, "the server computes candidate sets (--return-sampling-mask) but was started "
                           "without --enable-scale-out: /inference/v1/generate, the only route that returns them, "
                           "answers 403 to every rollout", "restart it with --enable-scale-out as well "
                           "(asyncgrpo serve with the same overrides passes both)")
    if has_mask:
        return MaskVerdict(PASS, "candidate sets are returned for top-k/top-p/min-p")
    embedded = (version or {}).get("server") == EMBEDDED_SERVER or server_info.get("server") == EMBEDDED_SERVER
    text = str((version or {}).get("version") or "")
    vllm = None if embedded else _version_tuple(text)
    why = ("top-k/top-p/min-p is on but the server does not return candidate sets: the trainer would normalise over "
           "the full vocabulary and every importance ratio would be biased (SPEC §7)")
    opt_in = f"or set {fallback_key}=true to train with biased ratios"
    if embedded:
        problem = f"{why}; the embedded sampler was started with --no-return-sampling-mask"
        fix = f"restart it without --no-return-sampling-mask (asyncgrpo serve with the same overrides), {opt_in}"
    elif vllm is not None and vllm < SAMPLING_MASK_MIN_VLLM:
        problem = f"{why}; vLLM {text} cannot return them (needs vLLM >= 0.28)"
        fix = ("pip install 'vllm>=0.28' on the server machine and restart with --return-sampling-mask "
               f"--enable-scale-out, {opt_in}")
    else:
        problem = f"{why}; the server was started without --return-sampling-mask"
        fix = ("restart with --return-sampling-mask --enable-scale-out (VLLM_USE_V2_MODEL_RUNNER=1 if vLLM rejects "
               f"the flag), {opt_in}")
    if fallback:
        return MaskVerdict(WARN, f"{problem}; {fallback_key}=true accepts this: watch "
                           "sampling/importance_sampling_ratio/mean in the panels (it should stay near 1)",
                           fix.split(", or set")[0])
    return MaskVerdict(FAIL, problem, fix)


def require_sampling_mask(uses_candidate_sets: bool, server_info: dict[str, Any] | None,
                          version: dict[str, Any] | None, *, fallback: bool, url: str = "",
                          fallback_key: str = "sampling_mask_fallback", scale_out: bool | None = None) -> str | None:
    """Refuse a server that cannot return candidate sets (the trainer's start-up check, SPEC §7).

    Returns:
        A warning to show when the fallback is accepted, else None.

    Raises:
        ConfigError: the verdict is fail; the message says why and how to restart the server.
    """
    verdict = sampling_mask_verdict(uses_candidate_sets, server_info, version, fallback=fallback,
                                    fallback_key=fallback_key, scale_out=scale_out)
    if verdict is None or verdict.status == PASS:
        return None
    where = f" at {url}" if url else ""
    if verdict.status == FAIL:
        raise ConfigError(f"the server{where}: {verdict.message}. Fix: {verdict.fix}", key=fallback_key)
    return f"the server{where}: {verdict.message}"
