"""Conformance of a sampler server to the vLLM 0.26 protocol subset the project uses (DESIGN §5).

Every test talks HTTP to ``conformance.url``: the embedded sampler by default, or a real vLLM when
``ASYNCGRPO_CONFORMANCE_URL`` is set (see conftest). The same assertions hold for both; tests of
embedded-only features (``update_info.path``, LoRA on a local folder) skip on another server.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from asyncgrpo_cli.sampler import (
    SamplerClient,
    SamplerRequestError,
    SamplingParams,
    SyncSamplerClient,
)
from asyncgrpo_cli.sampler.prometheus import CACHE_INFO, KV_USAGE, PREEMPTIONS, RUNNING, WAITING

from .conftest import run

PROMPT = list(range(10, 30))


async def wait_for_condition(probe, ok, deadline_s: float = 60.0):
    """Poll ``await probe()`` until ``ok(value)``; fail after ``deadline_s`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        value = await probe()
        if ok(value):
            return value
        assert loop.time() < end, f"condition not reached within {deadline_s} s (last: {value})"
        await asyncio.sleep(0.01)


def client(target, **kw) -> SamplerClient:
    return SamplerClient(target.url, max_concurrency=16, timeout_s=120, model=target.model, backoff_base_s=0.05, **kw)


def test_health_version_models(conformance):
    assert httpx.get(f"{conformance.url}/health", timeout=30).status_code == 200
    version = httpx.get(f"{conformance.url}/version", timeout=30).json()
    assert isinstance(version["version"], str) and version["version"]
    if conformance.embedded:
        assert version["server"] == "asyncgrpo-embedded"
    cards = httpx.get(f"{conformance.url}/v1/models", timeout=30).json()["data"]
    base = [c for c in cards if c["id"] == conformance.model]
    assert base and base[0]["max_model_len"] == conformance.max_model_len
    assert "root" in base[0]
    with SyncSamplerClient(conformance.url, timeout_s=30) as sync:
        assert sync.max_model_len() == conformance.max_model_len
        assert sync.wait_until_ready(10) >= 0
        assert sync.get_world_size() == 1


def test_completions_shape_and_token_id_keys(conformance):
    n = 5
    body = {
        "model": conformance.model,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
        "logprobs": n,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    data = httpx.post(f"{conformance.url}/v1/completions", json=body, timeout=60).json()
    choice = data["choices"][0]
    ids = choice["token_ids"]
    assert choice["prompt_token_ids"] == PROMPT
    assert 1 <= len(ids) <= 12
    assert choice["finish_reason"] in ("stop", "length")
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) == len(lp["top_logprobs"]) == len(lp["tokens"])
    for pos, token in enumerate(ids):
        entry = lp["top_logprobs"][pos]
        assert all(k.startswith("token_id:") for k in entry)
        assert len(entry) in (n, n + 1)  # the sampled token is listed beside the top N
        key = f"token_id:{token}"
        assert lp["tokens"][pos] == key
        assert math.isclose(entry[key], lp["token_logprobs"][pos], abs_tol=1e-5)
        top_n = sorted(entry.values(), reverse=True)[:n]
        assert lp["token_logprobs"][pos] <= top_n[0] + 1e-6


def test_generate_turn_top_n_exact(conformance):
    async def main():
        async with client(conformance) as c:
            return await c.generate_turn(PROMPT, SamplingParams(max_tokens=10, logprobs=4))

    turn = run(main())
    assert turn.route == "/v1/completions"
    assert len(turn.output_ids) == len(turn.output_log_probs) == len(turn.top_logprobs)
    for token, lp, top in zip(turn.output_ids, turn.output_log_probs, turn.top_logprobs):
        assert len(top) == 4  # vLLM sends the sampled token first, then the top-N: N + 1 entries at times
        assert all(isinstance(k, int) for k in top)
        if token in top:
            assert math.isclose(top[token], lp, abs_tol=1e-5)
        else:
            assert lp <= min(top.values()) + 1e-6
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4
    record = turn.to_turn_record()
    assert record.output_sampler_logprobs == turn.top_logprobs and record.prompt_ids == PROMPT


def test_seeds_reproducible_and_distinct(conformance):
    async def main():
        async with client(conformance) as c:
            params = SamplingParams(max_tokens=16, logprobs=1, seed=777, ignore_eos=True)
            a = await c.generate_turn(PROMPT, params)
            b = await c.generate_turn(PROMPT, params)
            others = await asyncio.gather(
                *(c.generate_turn(PROMPT, SamplingParams(max_tokens=16, logprobs=1, ignore_eos=True)) for _ in range(3))
            )
            return a, b, others

    a, b, others = run(main())
    assert a.output_ids == b.output_ids
    assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a.output_log_probs, b.output_log_probs))
    seeds = {t.seed for t in others}
    assert len(seeds) == 3 and 777 not in seeds
    outputs = {tuple(t.output_ids) for t in others} | {tuple(a.output_ids)}
    assert len(outputs) >= 3  # unique seeds decode different text


def test_processed_logprobs_renormalised_over_top_k(conformance):
    async def main():
        async with client(conformance) as c:
            return await c.generate_turn(PROMPT, SamplingParams(max_tokens=8, top_k=3, temperature=0.8, logprobs=3))

    turn = run(main())
    for token, top in zip(turn.output_ids, turn.top_logprobs):
        assert token in top
        mass = sum(math.exp(v) for v in top.values())
        if conformance.embedded:
            assert math.isclose(mass, 1.0, abs_tol=1e-3)
        else:
            # vLLM's top-k mask keeps every logit equal to the k-th (ties are common in bf16), so the
            # renormalised mass can spread over a few more than k tokens (0.983 seen on vLLM 0.26).
            assert 0.9 <= mass <= 1.0 + 1e-3


def test_generate_route_sampling_mask(conformance):
    async def main():
        async with client(conformance) as c:
            params = SamplingParams(max_tokens=8, top_k=5, temperature=1.0, logprobs=2, return_sampling_mask=True)
            return await c.generate_turn(PROMPT, params)

    turn = run(main())
    assert turn.route == "/inference/v1/generate"
    assert len(turn.output_log_probs) == len(turn.output_ids)
    assert all(len(top) == 2 for top in turn.top_logprobs)
    if turn.sampling_mask is None:
        assert not conformance.embedded, "the embedded sampler must return sampling masks"
        return
    for token, candidates in zip(turn.output_ids, turn.sampling_mask):
        assert len(candidates) == 5 and token in candidates


def test_max_model_len_is_a_400_naming_route(conformance):
    async def main():
        async with client(conformance) as c:
            with pytest.raises(SamplerRequestError) as err:
                await c.generate_turn([11] * 10, SamplingParams(max_tokens=conformance.max_model_len))
            return err.value, c.retry_count

    error, retries = run(main())
    assert error.status == 400 and retries == 0
    assert "/v1/completions" in str(error)
    assert str(conformance.max_model_len) in error.server_message


def test_scale_out_route_cuts_at_max_model_len(conformance):
    prompt = [12] * (conformance.max_model_len - 4)

    async def main():
        async with client(conformance) as c:
            params = SamplingParams(max_tokens=50, top_k=4, ignore_eos=True, return_sampling_mask=True)
            return await c.generate_turn(prompt, params)

    turn = run(main())
    assert turn.finish_reason == "length"
    assert len(prompt) + len(turn.output_ids) <= conformance.max_model_len


def test_bad_requests(conformance):
    url = f"{conformance.url}/v1/completions"
    too_many = httpx.post(url, json={"model": conformance.model, "prompt": PROMPT, "max_tokens": 2, "logprobs": 10**6}, timeout=30)
    assert too_many.status_code == 400
    assert "error" in too_many.json()
    unknown = httpx.post(url, json={"model": "no-such-model", "prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert unknown.status_code == 404


def test_metrics_names_and_server_load(conformance):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{conformance.url}/metrics", timeout=30).text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for name in (KV_USAGE, RUNNING, WAITING, PREEMPTIONS, CACHE_INFO):
        assert name in names, name

    async def main():
        async with client(conformance) as c:
            return await c.read_metrics()

    load = run(main())
    assert load.kv_cache_tokens and load.kv_cache_tokens >= conformance.max_model_len
    assert 0.0 <= load.kv_cache_usage_frac <= 1.0
    assert load.num_requests_running >= 0 and load.num_requests_waiting >= 0


def test_server_info_when_dev_mode(conformance):
    with SyncSamplerClient(conformance.url, timeout_s=30) as sync:
        info = sync.server_info()
    if info is None:
        assert not conformance.embedded
        pytest.skip("server not in dev mode")
    assert info["model_config"]["max_model_len"] == conformance.max_model_len
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert "weight_transfer_config" in info
    if conformance.embedded:
        assert info["cache_config"]["kv_cache_size_tokens"] >= conformance.max_model_len
        assert info["lora_config"] == {"max_loras": 2, "max_lora_rank": 8}


def test_pause_keep_freezes_and_resume_continues(conformance):
    async def main():
        async with client(conformance) as c:
            params = SamplingParams(max_tokens=120, ignore_eos=True, logprobs=0)
            task = asyncio.create_task(c.generate_turn(PROMPT, params))
            await wait_for_condition(lambda: c.read_metrics(), lambda load: load.num_requests_running >= 1)
            await c.pause("keep")
            progress = None
            if conformance.embedded:
                running = conformance.handle.server.scheduler.running
                progress = [len(r.output_ids) for r in running]
            for _ in range(5):  # the server keeps answering while paused; the request does not finish
                load = await c.read_metrics()
                assert load.num_requests_running >= 1
                assert not task.done()
            if conformance.embedded:
                assert await c.is_paused()
                assert [len(r.output_ids) for r in running] == progress
            await c.resume()
            turn = await asyncio.wait_for(task, 120)
            if conformance.embedded:
                assert not await c.is_paused()
            return turn

    turn = run(main())
    assert len(turn.output_ids) == 120 and turn.finish_reason == "length"


def test_reset_prefix_cache_when_idle(conformance):
    with SyncSamplerClient(conformance.url, timeout_s=30) as sync:
        assert sync.reset_prefix_cache(max_attempts=3, retry_delay_s=0.05) is True


def test_group_request_n_completions_match_single_requests(conformance):
    """One request with ``n`` (issue #41) returns ``n`` completions, completion ``i`` sampled with ``seed + i``:
    the same text as a single request with that seed (vLLM's parallel-sampling rule, and the embedded server's)."""
    async def main():
        async with client(conformance) as c:
            params = SamplingParams(max_tokens=12, logprobs=3, seed=4242, ignore_eos=True)
            group = await c.generate_turns(PROMPT, params, 4)
            singles = [await c.generate_turn(PROMPT, SamplingParams(max_tokens=12, logprobs=3, seed=4242 + i,
                                                                     ignore_eos=True)) for i in (0, 3)]
            unseeded = await c.generate_turns(PROMPT, SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True), 4)
            return group, singles, unseeded, c.seeds.counter

    group, singles, unseeded, counter = run(main())
    assert [t.seed for t in group] == [4242, 4243, 4244, 4245]
    assert group[0].output_ids == singles[0].output_ids and group[3].output_ids == singles[1].output_ids
    assert all(len(t.top_logprobs) == len(t.output_ids) == 12 and t.request_s > 0 for t in group)
    assert len({tuple(t.output_ids) for t in unseeded}) >= 3  # four distinct seeds, four samples
    assert len({t.seed for t in unseeded}) == 4 and counter == 4  # the client reserved a block of 4 seeds


def test_group_request_without_seeds(conformance):
    """``request_seeds=False`` sends no seed: the server draws one per completion, still distinct text."""
    async def main():
        async with client(conformance, request_seeds=False) as c:
            return await c.generate_turns(PROMPT, SamplingParams(max_tokens=12, logprobs=1, ignore_eos=True), 4)

    turns = run(main())
    assert [t.seed for t in turns] == [None] * 4
    assert len({tuple(t.output_ids) for t in turns}) >= 3


def test_tokens_route_group_request(conformance):
    """``tokens_route=True`` (issue #41's lever): ``/inference/v1/generate`` with ``n`` and no detokenizing gives
    the same completions as ``/v1/completions`` with the same seeds."""
    async def main():
        params = SamplingParams(max_tokens=10, logprobs=3, seed=9090, ignore_eos=True)
        async with client(conformance, tokens_route=True) as c:
            tokens = await c.generate_turns(PROMPT, params, 3)
        async with client(conformance) as c:
            text = await c.generate_turns(PROMPT, params, 3)
        return tokens, text

    tokens, text = run(main())
    assert [t.route for t in tokens] == ["/inference/v1/generate"] * 3 and [t.seed for t in tokens] == [9090, 9091, 9092]
    assert [t.output_ids for t in tokens] == [t.output_ids for t in text]
    for a, b in zip(tokens, text):
        assert len(a.top_logprobs) == len(a.output_ids) and all(len(top) == 3 for top in a.top_logprobs)
        assert all(math.isclose(x, y, abs_tol=1e-3) for x, y in zip(a.output_log_probs, b.output_log_probs))
