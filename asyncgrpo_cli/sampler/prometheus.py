"""Reading a sampler's load from its Prometheus ``/metrics`` text (SPEC §4.2, Appendix B.5).

vLLM (and the embedded sampler) expose, labelled by ``model_name`` and ``engine``:
``vllm:kv_cache_usage_perc`` (gauge, fraction 0-1), ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` (gauges), ``vllm:num_preemptions_total`` (counter) and
``vllm:cache_config_info`` (an info gauge whose labels carry ``kv_cache_size_tokens`` or
``num_gpu_blocks`` and ``block_size``).

Parsing goes through ``prometheus_client.parser.text_string_to_metric_families``. That parser names a
counter family without its ``_total`` suffix and may give an info metric the type gauge or unknown,
so metrics are matched by **sample** name, which keeps the suffix whatever the family looks like.
The reduction over engines (max usage; summed running, waiting, preemptions and KV capacity) is
`asyncgrpo_cli.sampler.server_load.reduce_vllm_metrics`, shared with the rollout side's adaptive cap, so there is
one `ServerLoad` in the project.
"""

from __future__ import annotations

from .server_load import ServerLoad, reduce_vllm_metrics

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_INFO = "vllm:cache_config_info"

__all__ = ["CACHE_INFO", "KV_USAGE", "PREEMPTIONS", "RUNNING", "WAITING", "ServerLoad", "parse_server_load"]


def parse_server_load(text: str) -> ServerLoad | None:
    """Parse Prometheus exposition text into a `ServerLoad` (SPEC Appendix B.5 aggregation).

    Returns:
        the load (usage: max over engines; running, waiting, preemptions: summed; KV capacity in
        tokens: summed over engines), or ``None`` when the text holds none of vLLM's load metrics.

    Raises:
        ValueError: the text is not Prometheus exposition format (the parser's message is kept).
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
    except Exception as exc:  # the parser raises ValueError and others on malformed lines
        raise ValueError(f"not Prometheus text: {exc}") from exc
    return reduce_vllm_metrics(samples)
