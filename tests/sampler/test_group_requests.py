"""One request per group (issue #41): request bodies with ``n`` and without a seed, reading ``n`` choices,
seed blocks, and the client's refusals. Pure: no server."""

from __future__ import annotations

import httpx
import pytest

from asyncgrpo_cli.sampler import SamplerProtocolError, SamplingParams, SeedSequence
from asyncgrpo_cli.sampler.client import SamplerClient, completion_body, generate_body, parse_turns

from .conftest import run


def choice(index: int, tokens: list[int]) -> dict:
    return {"index": index, "token_ids": tokens, "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5] * len(tokens),
                         "top_logprobs": [{f"token_id:{t}": -0.5, "token_id:9": -1.0} for t in tokens]}}


def test_bodies_with_n_and_without_seed():
    params = SamplingParams(max_tokens=5, logprobs=1)
    body = completion_body([1, 2], params, "m", seed=None, n=8)
    assert body["n"] == 8 and "seed" not in body
    assert "n" not in completion_body([1, 2], params, "m", seed=3) and completion_body([1], params, None, 3)["seed"] == 3
    assert "seed" not in generate_body([1], params, None, None)["sampling_params"]


def test_parse_turns_orders_choices_and_gives_each_its_seed():
    data = {"choices": [choice(2, [7]), choice(0, [5, 6]), choice(1, [8])]}
    turns = parse_turns("/v1/completions", data, [1], SamplingParams(max_tokens=4, logprobs=1), 100, 3)
    assert [t.output_ids for t in turns] == [[5, 6], [8], [7]]
    assert [t.seed for t in turns] == [100, 101, 102]
    assert [t.top_logprobs[0] for t in turns] == [{5: -0.5}, {8: -0.5}, {7: -0.5}]
    unseeded = parse_turns("/v1/completions", data, [1], SamplingParams(max_tokens=4, logprobs=1), None, 3)
    assert [t.seed for t in unseeded] == [None] * 3


@pytest.mark.parametrize("choices, needle", [
    ([choice(0, [5]), choice(1, [6])], "asked for n=3 completions, the answer holds 2"),
    ([choice(0, [5]), choice(0, [6]), choice(2, [7])], "are not 0..2"),
])
def test_parse_turns_refuses_a_wrong_answer(choices, needle):
    with pytest.raises(SamplerProtocolError, match=needle):
        parse_turns("/v1/completions", {"choices": choices}, [1], SamplingParams(max_tokens=4, logprobs=1), 1, 3)


def test_seed_blocks_never_overlap_and_stay_in_int64():
    seq = SeedSequence(base=10)
    assert [seq.next(8), seq.next(8), seq.next()] == [10, 18, 26]
    top = SeedSequence(base=2**63 - 3)
    first = top.next(8)  # 2**63 - 3 + 7 would pass int64: the block starts at 0
    assert first == 0 and first + 7 < 2**63 and top.next(2) == 8


def test_client_sends_n_and_reads_every_completion():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json={"choices": [choice(i, [20 + i]) for i in range(body.get("n", 1))]})

    async def main(**kw):
        async with SamplerClient("http://x", transport=httpx.MockTransport(handler), seed_base=50, **kw) as c:
            group = await c.generate_turns([1, 2], SamplingParams(max_tokens=4, logprobs=1), 4)
            one = await c.generate_turn([1, 2], SamplingParams(max_tokens=4, logprobs=1))
            return group, one

    group, one = run(main())
    assert seen[0]["n"] == 4 and seen[0]["seed"] == 50 and "n" not in seen[1] and seen[1]["seed"] == 54
    assert [t.output_ids for t in group] == [[20], [21], [22], [23]] and [t.seed for t in group] == [50, 51, 52, 53]
    assert one.seed == 54 and all(t.request_s >= 0 and t.parse_s >= 0 for t in group)
    seen.clear()
    group, _ = run(main(request_seeds=False))
    assert "seed" not in seen[0] and [t.seed for t in group] == [None] * 4


def test_client_refuses_n_with_sampling_masks():
    async def main():
        async with SamplerClient("http://x", transport=httpx.MockTransport(lambda r: httpx.Response(500))) as c:
            await c.generate_turns([1], SamplingParams(max_tokens=4, top_k=5, return_sampling_mask=True), 2)

    with pytest.raises(ValueError, match="send n requests of n=1"):
        run(main())
