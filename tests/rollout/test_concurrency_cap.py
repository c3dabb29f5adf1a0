"""ConcurrencyCap and reduce_vllm_metrics (SPEC §4.2, Appendix B.5)."""

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo_cli.rollout.concurrency import ConcurrencyCap, ServerLoad, reduce_vllm_metrics


def test_initial_value_and_clamp():
    assert ConcurrencyCap(512, kv_cache_tokens=100_000, max_model_len=4096).value == 24
    assert ConcurrencyCap(10, kv_cache_tokens=100_000, max_model_len=4096).value == 10
    assert ConcurrencyCap(512, kv_cache_tokens=1000, max_model_len=4096).value == 1  # floor of 1
    assert ConcurrencyCap(512, kv_cache_tokens=0, max_model_len=4096).value == 1


def test_fallback_without_metrics_is_static():
    cap = ConcurrencyCap(64)
    assert cap.value == 64 and not cap.adaptive
    assert cap.observe(0.99, 10) == 64
    cap = ConcurrencyCap.from_server_load(64, None, 4096)
    assert cap.value == 64 and not cap.adaptive
    assert cap.observe(0.99, 0) == 64


def test_metrics_without_capacity_start_at_ceiling_but_adapt():
    load = ServerLoad(0.1, 0, 0, 0, kv_cache_tokens=None, num_engines=1)
    cap = ConcurrencyCap.from_server_load(20, load, 4096)
    assert cap.value == 20 and cap.adaptive
    assert cap.observe(0.9, 0) == 14


def test_shrink_once_per_poll():
    cap = ConcurrencyCap(512, kv_cache_tokens=100 * 1000, max_model_len=1000)
    assert cap.value == 100
    assert cap.observe(0.81, 0) == 70  # floor(100 * 0.7)
    assert cap.observe(0.95, 0) == 49
    assert cap.observe(0.80, 0) == 49  # not above 0.8: hold
    assert cap.observe(0.70, 0) == 49  # in the dead band
    for _ in range(20):
        cap.observe(1.0, 5)
    assert cap.value == 1  # floor of 1, never 0


def test_growth_needs_a_caps_worth_of_completions():
    cap = ConcurrencyCap(512, kv_cache_tokens=8 * 100, max_model_len=100)
    assert cap.value == 8
    assert cap.observe(0.1, 0) == 8  # no completion yet
    cap.on_rollout_completed(7)
    assert cap.observe(0.1, 0) == 8  # 7 < cap
    cap.on_rollout_completed()
    assert cap.observe(0.1, 0) == 10  # max(8 + 1, floor(8 * 1.25)) = 10
    assert cap.completed_since_increase == 0
    assert cap.observe(0.1, 0) == 10  # counter restarted after the increase
    cap.on_rollout_completed(10)
    assert cap.observe(0.1, 0) == 12  # floor(12.5)
    # small caps grow by at least one
    small = ConcurrencyCap(512, kv_cache_tokens=100, max_model_len=100)
    assert small.value == 1
    small.on_rollout_completed()
    assert small.observe(0.0, 0) == 2


def test_no_growth_with_waiting_requests_or_high_usage():
    cap = ConcurrencyCap(512, kv_cache_tokens=800, max_model_len=100)
    cap.on_rollout_completed(100)
    assert cap.observe(0.1, 1) == 8  # requests waiting
    assert cap.observe(0.6, 0) == 8  # not below 0.6
    assert cap.observe(0.59, 0) == 10


def test_growth_clamped_to_max():
    cap = ConcurrencyCap(9, kv_cache_tokens=800, max_model_len=100)
    cap.on_rollout_completed(100)
    assert cap.observe(0.0, 0) == 9
    cap.on_rollout_completed(100)
    assert cap.observe(0.0, 0) == 9


def test_missing_usage_changes_nothing_and_bad_input_raises():
    cap = ConcurrencyCap(512, kv_cache_tokens=800, max_model_len=100)
    assert cap.observe(None, 0) == 8
    assert cap.observe(math.nan, 0) == 8
    with pytest.raises(ValueError, match="num_requests_waiting"):
        cap.observe(0.5, -1)
    with pytest.raises(ValueError, match="kv_cache_usage_frac"):
        cap.observe(80.0, 0)  # a percentage, not a fraction
    with pytest.raises(ValueError, match="max_concurrent_rollouts"):
        ConcurrencyCap(0)
    with pytest.raises(ValueError, match="max_model_len"):
        ConcurrencyCap(8, kv_cache_tokens=1000)


METRICS_TWO_ENGINES = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:num_preemptions_total{engine="1",model_name="m"} 6.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="100000",num_gpu_blocks="6250"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
# TYPE other_metric gauge
other_metric 42.0
"""


def _samples(text):
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def test_reduce_vllm_metrics_over_engines():
    load = reduce_vllm_metrics(_samples(METRICS_TWO_ENGINES))
    assert load == ServerLoad(
        kv_cache_usage_frac=0.75,  # max over engines
        num_requests_running=7,  # summed
        num_requests_waiting=3,
        num_preemptions_total=11,  # _created samples ignored
        kv_cache_tokens=100_000 + 1000 * 16,  # engine 1 falls back to blocks x block size
        num_engines=2,
    )
    cap = ConcurrencyCap.from_server_load(512, load, max_model_len=4096)
    assert cap.value == 116_000 // 4096


def test_reduce_vllm_metrics_without_vllm_metrics_is_none():
    assert reduce_vllm_metrics(_samples("# TYPE x gauge\nx 1.0\n")) is None
    assert reduce_vllm_metrics([]) is None


def test_reduce_vllm_metrics_unparseable_capacity_and_old_usage_name():
    samples = [
        ("vllm:gpu_cache_usage_perc", {}, 0.5),
        ("vllm:cache_config_info", {"num_gpu_blocks": "None", "block_size": "16"}, 1.0),
    ]
    load = reduce_vllm_metrics(samples)
    assert load.kv_cache_usage_frac == 0.5
    assert load.kv_cache_tokens is None
    assert load.num_engines == 1
