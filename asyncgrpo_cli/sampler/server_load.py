"""The server's load as read from its Prometheus ``/metrics`` (SPEC §4.2, Appendix B.5).

`ServerLoad` is one scrape reduced over engines; `reduce_vllm_metrics` makes it from already-parsed
samples. This module depends on nothing of the project: the sampler boundary (`sampler.prometheus`
parses the text) and the rollout side (`rollout.concurrency`'s adaptive cap) both use it. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["REQUEST_STAGES", "ServerLoad", "reduce_vllm_metrics", "request_time_means"]

_KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_CACHE_INFO = "vllm:cache_config_info"
#: Per-request time histograms of vLLM (0.26-0.33 names), by the stage they time (seconds per request).
REQUEST_STAGES: dict[str, tuple[str, ...]] = {
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "request": ("vllm:e2e_request_latency_seconds",),
    "first_token": ("vllm:time_to_first_token_seconds",),
    "per_output_token": ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds"),
}
_STAGE_OF = {name + suffix: (stage, suffix) for stage, names in REQUEST_STAGES.items() for name in names
             for suffix in ("_sum", "_count")}


@dataclass(frozen=True)
class ServerLoad:
    """One ``/metrics`` scrape of the inference server, reduced over engines (SPEC §4.2, B.5).

    Attributes:
        kv_cache_usage_frac: KV-cache usage in [0, 1], the maximum over engines; ``None`` when absent.
        num_requests_running: requests being decoded, summed over engines.
        num_requests_waiting: requests accepted but not scheduled, summed over engines.
        num_preemptions_total: cumulative preempted (restarted) requests, summed over engines. A
            counter: the per-window ``rollout/vllm_preemption_count`` is the difference between scrapes.
        kv_cache_tokens: KV-cache capacity in tokens summed over engines, from
            ``vllm:cache_config_info`` (``kv_cache_size_tokens``, else ``num_gpu_blocks × block_size``);
            ``None`` when no engine reports it.
        num_engines: distinct engines seen (by the ``engine`` label).
        request_times: ``{stage: (seconds summed, requests counted)}`` of vLLM's per-request histograms
            (`REQUEST_STAGES`: queue, prefill, decode, request = end to end, first_token, per_output_token),
            summed over engines; cumulative counters, so a window's mean per request is the difference of two
            scrapes' sums over the difference of their counts (`request_time_means`). Empty when absent.
    """

    kv_cache_usage_frac: float | None
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions_total: int
    kv_cache_tokens: int | None
    num_engines: int
    request_times: Mapping[str, tuple[float, float]] = field(default_factory=dict)


def request_time_means(before: ServerLoad | None, after: ServerLoad) -> dict[str, float]:
    """Mean seconds per request of each stage between two scrapes: ``{stage: Δsum / Δcount}`` for the stages
    with requests finished in between (a counter that went back, a restarted server, gives nothing)."""
    out: dict[str, float] = {}
    for stage, (total, count) in after.request_times.items():
        prev_total, prev_count = (before.request_times.get(stage, (0.0, 0.0)) if before is not None else (0.0, 0.0))
        finished = count - prev_count
        if finished > 0 and total >= prev_total:
            out[stage] = (total - prev_total) / finished
    return out


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        value = int(float(raw))
    except (TypeError, ValueError):
        return None  # e.g. "None" before the engine has profiled its memory
    return value if value > 0 else None


def reduce_vllm_metrics(
    samples: Iterable[tuple[str, Mapping[str, str], float]],
) -> ServerLoad | None:
    """Reduce parsed Prometheus samples of vLLM's ``/metrics`` to a :class:`ServerLoad`.

    Args:
        samples: ``(sample_name, labels, value)`` triples, e.g. from
            ``[(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]`` (``prometheus_client.parser``).
            Names are sample names (``vllm:num_preemptions_total``, not the family name). Samples of
            other metrics are ignored.

    Returns:
        The reduced load: KV usage is the maximum over engines; running, waiting and preemptions are
        summed; KV capacity is summed over engines (each engine counted once, by its ``engine`` label).
        ``None`` when the scrape holds none of vLLM's load metrics (the caller then falls back to
        ``max_concurrent_rollouts``, SPEC §4.2).
    """
    usage_by_name: dict[str, list[float]] = {name: [] for name in _KV_USAGE_NAMES}
    running = 0.0
    waiting = 0.0
    preemptions = 0.0
    seen_any = False
    engines: set[str] = set()
    capacity_by_engine: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    for index, (name, labels, value) in enumerate(samples):
        labels = labels or {}
        engine = labels.get("engine")
        value = float(value)
        stage = _STAGE_OF.get(name)
        if stage is not None:
            if not math.isnan(value):
                pair = times.setdefault(stage[0], [0.0, 0.0])
                pair[0 if stage[1] == "_sum" else 1] += value
            continue
        if name in usage_by_name:
            if not math.isnan(value):
                usage_by_name[name].append(value)
        elif name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        elif name in _PREEMPTIONS:
            preemptions += value
        elif name == _CACHE_INFO:
            tokens = _label_int(labels, "kv_cache_size_tokens")
            if tokens is None:
                blocks = _label_int(labels, "num_gpu_blocks")
                block_size = _label_int(labels, "block_size")
                if blocks is not None and block_size is not None:
                    tokens = blocks * block_size
            if tokens is not None:
                capacity_by_engine[engine if engine is not None else f"#{index}"] = tokens
        else:
            continue
        seen_any = True
        if engine is not None:
            engines.add(engine)
    if not seen_any:
        return None
    usage_values = next((v for v in usage_by_name.values() if v), [])
    return ServerLoad(
        kv_cache_usage_frac=max(usage_values) if usage_values else None,
        num_requests_running=int(running),
        num_requests_waiting=int(waiting),
        num_preemptions_total=int(preemptions),
        kv_cache_tokens=sum(capacity_by_engine.values()) if capacity_by_engine else None,
        num_engines=max(1, len(engines)),
        request_times={stage: (pair[0], pair[1]) for stage, pair in times.items()},
    )
