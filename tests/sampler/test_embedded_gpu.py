"""The embedded sampler on one CUDA GPU (skipped without one): exact fp32 log-probs, bf16 serving."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo_cli.sampler import SamplerClient, SamplingParams

from .conftest import run, start_embedded
from .test_embedded_model import PROMPT, reference_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def sample_many(url, **params):
    async def main():
        async with SamplerClient(url, max_concurrency=16, timeout_s=120) as c:
            sampling = [SamplingParams(max_tokens=24, seed=50 + i, logprobs=4, ignore_eos=True, **params) for i in range(6)]
            return await asyncio.gather(*(c.generate_turn(PROMPT[: 6 + 3 * i], s) for i, s in enumerate(sampling)))

    return run(main())


def test_cuda_float32_logprobs_match_plain_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    handle = start_embedded(tiny_model_dir, device="cuda", dtype="float32")
    try:
        assert handle.server.runner.device.startswith("cuda")
        turns = sample_many(handle.url, top_k=20, temperature=0.9)
        assert handle.server.runner.peak_decode_rows >= 2
    finally:
        handle.stop()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for turn in turns:
        ref, _ = reference_logprobs(model, turn.prompt_ids, turn.output_ids, temperature=0.9, top_k=20)
        assert turn.output_log_probs == pytest.approx(ref, abs=1e-3)


def test_cuda_bfloat16_serves_reproducibly(tiny_model_dir):
    handle = start_embedded(tiny_model_dir, device="cuda", dtype="bfloat16")
    try:
        first = sample_many(handle.url)
        second = sample_many(handle.url)
        info = handle.server.runner.dtype
    finally:
        handle.stop()
    assert info == torch.bfloat16
    assert all(len(t.output_ids) == 24 and len(t.top_logprobs[0]) == 4 for t in first)
    assert [t.output_ids for t in first] == [t.output_ids for t in second]
