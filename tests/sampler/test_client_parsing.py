"""Pure parts of the sampler client: request bodies, both log-prob formats, seeds, /metrics parsing."""

from __future__ import annotations

import json

import pytest

from asyncgrpo_cli.sampler import SamplerProtocolError, SamplingParams, SeedSequence, parse_server_load
from asyncgrpo_cli.sampler.client import (
    COMPLETIONS_ROUTE,
    GENERATE_ROUTE,
    completion_body,
    generate_body,
    keep_top_n,
    parse_turn,
    request_summary,
    token_id_from_key,
    vllm_config_of,
)


def test_completion_body_sends_token_ids_and_only_set_filters():
    body = completion_body([1, 2], SamplingParams(max_tokens=5, logprobs=8), "m", seed=42)
    assert body == {
        "prompt": [1, 2],
        "max_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": 42,
        "logprobs": 8,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "model": "m",
    }
    full = completion_body([1], SamplingParams(max_tokens=5, top_k=50, min_p=0.1, repetition_penalty=1.1,
                                                stop_token_ids=(7,), ignore_eos=True), None, seed=1)
    assert full["top_k"] == 50 and full["min_p"] == 0.1 and full["repetition_penalty"] == 1.1
    assert full["stop_token_ids"] == [7] and full["ignore_eos"] is True and "model" not in full


def test_generate_body_nests_sampling_params():
    body = generate_body([3, 4], SamplingParams(max_tokens=9, top_k=5, logprobs=2, return_sampling_mask=True), "m", 7)
    assert body["token_ids"] == [3, 4] and body["model"] == "m"
    assert body["sampling_params"] == {"max_tokens": 9, "temperature": 1.0, "top_p": 1.0, "seed": 7, "logprobs": 2, "top_k": 5}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=4, temperature=-1), "temperature"),
        (dict(max_tokens=4, top_p=0.0), "top_p"),
        (dict(max_tokens=4, top_k=-2), "top_k"),
        (dict(max_tokens=4, min_p=1.5), "min_p"),
        (dict(max_tokens=4, repetition_penalty=0), "repetition_penalty"),
        (dict(max_tokens=4, logprobs=-1), "logprobs"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_completions_n_plus_one_entries_keep_exactly_top_n():
    data = {
        "choices": [
            {
                "token_ids": [5, 9],
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["token_id:5", "token_id:9"],
                    "token_logprobs": [-3.0, -0.1],
                    "top_logprobs": [
                        {"token_id:1": -0.5, "token_id:2": -1.0, "token_id:5": -3.0},  # sampled beside the top 2
                        {"token_id:9": -0.1, "token_id:3": -2.5},
                    ],
                },
            }
        ]
    }
    turn = parse_turn(COMPLETIONS_ROUTE, data, [1], SamplingParams(max_tokens=2, logprobs=2), seed=3)
    assert turn.output_ids == [5, 9] and turn.output_log_probs == [-3.0, -0.1]
    assert turn.top_logprobs == [{1: -0.5, 2: -1.0}, {9: -0.1, 3: -2.5}]
    assert turn.finish_reason == "length" and turn.seed == 3 and turn.sampling_mask is None
    record = turn.to_turn_record(output_mask=[1, 0])
    assert record.output_mask == [1, 0] and record.output_sampler_logprobs[0] == {1: -0.5, 2: -1.0}


def test_logprobs_zero_gives_no_top_dicts():
    data = {"choices": [{"token_ids": [5], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.2], "top_logprobs": [{"token_id:5": -0.2}]}}]}
    turn = parse_turn(COMPLETIONS_ROUTE, data, [1], SamplingParams(max_tokens=2), seed=0)
    assert turn.top_logprobs is None and turn.output_log_probs == [-0.2]


def test_generate_v026_string_tokens_and_mask():
    data = {
        "choices": [
            {
                "token_ids": [4, 6],
                "finish_reason": "stop",
                "sampling_mask": [[1, 4], [6, 7]],
                "logprobs": {
                    "content": [
                        {"token": "token_id:4", "logprob": -0.7, "bytes": None,
                         "top_logprobs": [{"token": "token_id:1", "logprob": -0.6}, {"token": "token_id:4", "logprob": -0.7}]},
                        {"token": "token_id:6", "logprob": -0.3, "bytes": None,
                         "top_logprobs": [{"token": "token_id:6", "logprob": -0.3}, {"token": "token_id:7", "logprob": -1.4}]},
                    ]
                },
            }
        ]
    }
    params = SamplingParams(max_tokens=2, top_k=2, logprobs=2, return_sampling_mask=True)
    turn = parse_turn(GENERATE_ROUTE, data, [1], params, seed=0)
    assert turn.output_log_probs == [-0.7, -0.3]
    assert turn.top_logprobs == [{1: -0.6, 4: -0.7}, {6: -0.3, 7: -1.4}]
    assert turn.sampling_mask == [[1, 4], [6, 7]]


def test_generate_v033_integer_token_ids():
    data = {
        "choices": [
            {
                "token_ids": [8],
                "finish_reason": "length",
                "logprobs": {
                    "content": [
                        {"token_id": 8, "logprob": -2.0, "rank": 3,
                         "top_logprobs": [{"token_id": 2, "logprob": -0.4, "rank": 1},
                                          {"token_id": 3, "logprob": -1.1, "rank": 2},
                                          {"token_id": 8, "logprob": -2.0, "rank": 3}]},
                    ]
                },
            }
        ]
    }
    turn = parse_turn(GENERATE_ROUTE, data, [1], SamplingParams(max_tokens=1, logprobs=2), seed=0)
    assert turn.output_log_probs == [-2.0] and turn.top_logprobs == [{2: -0.4, 3: -1.1}]


@pytest.mark.parametrize(
    "choice, needle",
    [
        ({"finish_reason": "stop"}, "token_ids"),
        ({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [{}]}}, "one value per output token"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [{"hello": -1.0}]}}, "token_id:N"),
        ({"token_ids": [1]}, "logprobs"),
    ],
)
def test_malformed_choices_name_the_route(choice, needle):
    with pytest.raises(SamplerProtocolError, match=needle) as err:
        parse_turn(COMPLETIONS_ROUTE, {"choices": [choice]}, [1], SamplingParams(max_tokens=2, logprobs=1), seed=0)
    assert err.value.route == COMPLETIONS_ROUTE and COMPLETIONS_ROUTE in str(err.value)
    with pytest.raises(SamplerProtocolError, match="choices"):
        parse_turn(COMPLETIONS_ROUTE, {"id": "x"}, [1], SamplingParams(max_tokens=2), seed=0)


def test_helpers():
    assert token_id_from_key("token_id:17", "/r") == 17 and token_id_from_key(3, "/r") == 3
    assert keep_top_n({1: -3.0, 2: -1.0, 3: -2.0}, 2) == {2: -1.0, 3: -2.0}
    summary = request_summary({"prompt": [1, 2, 3], "max_tokens": 4, "sampling_params": {"seed": 1}})
    assert "prompt=<3 items>" in summary and "max_tokens=4" in summary and "seed=1" in summary


def test_seed_sequence_unique_and_in_range():
    seq = SeedSequence(base=2**63 - 2)
    seeds = [seq.next() for _ in range(5)]
    assert seeds == [2**63 - 2, 2**63 - 1, 0, 1, 2]
    a, b = SeedSequence(), SeedSequence()
    assert a.base != b.base
    assert len({a.next() for _ in range(1000)}) == 1000


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000",gpu_memory_utilization="0.9"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="500",gpu_memory_utilization="0.9"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
"""


def test_parse_server_load_aggregates_engines():
    load = parse_server_load(VLLM_METRICS)
    assert load.kv_cache_usage_frac == 0.75  # max over engines
    assert load.num_requests_running == 7 and load.num_requests_waiting == 1  # sums
    assert load.num_preemptions_total == 7
    assert load.kv_cache_tokens == 1500 * 16
    assert load.num_engines == 2


def test_parse_server_load_without_type_lines_and_with_token_label():
    text = (
        'vllm:num_preemptions_total{engine="0"} 4\n'
        'vllm:cache_config_info{engine="0",kv_cache_size_tokens="4096",num_gpu_blocks="1",block_size="16"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    )
    load = parse_server_load(text)
    assert load.num_preemptions_total == 4 and load.kv_cache_tokens == 4096 and load.kv_cache_usage_frac == 0.5
    assert parse_server_load("# nothing here\nother_metric 1\n") is None
    with pytest.raises(ValueError, match="Prometheus"):
        parse_server_load("this is { not prometheus")


def test_vllm_top_logprobs_sampled_token_first_and_n_plus_one():
    # vLLM 0.26 puts the sampled token first, then the top-N; outside the top-N it makes N + 1 entries.
    choice = {"token_ids": [7, 5], "finish_reason": "length", "logprobs": {
        "tokens": ["token_id:7", "token_id:5"], "token_logprobs": [-3.0, -0.5],
        "top_logprobs": [{"token_id:7": -3.0, "token_id:1": -0.2, "token_id:2": -1.9},
                         {"token_id:5": -0.5, "token_id:9": -1.5}]}}
    turn = parse_turn("/v1/completions", {"choices": [choice]}, [1], SamplingParams(max_tokens=2, logprobs=2), 3)
    assert turn.top_logprobs == [{1: -0.2, 2: -1.9}, {5: -0.5, 9: -1.5}]
    assert turn.output_log_probs == [-3.0, -0.5]


def test_vllm_config_of_server_info_shapes():
    config = {"model_config": {"logprobs_mode": "processed_logprobs"}, "weight_transfer_config": {"backend": "nccl"}}
    assert vllm_config_of({"vllm_config": config, "vllm_env": {}, "system_env": {}}) == config
    assert vllm_config_of({"vllm_config": json.dumps(config)}) == config
    assert vllm_config_of({"vllm_config": "VllmConfig(model='x', ...)"}) == {}  # config_format=text
    assert vllm_config_of(None) is None
