"""The embedded sampler against the model itself: exact log-probs, batching, preemption, weights, LoRA, CLI."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys

import httpx
import pytest
import torch

from asyncgrpo_cli.sampler import SamplerClient, SamplerRequestError, SamplingParams

from .conftest import run, start_embedded

PROMPT = list(range(20, 44))


def load_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def reference_logprobs(model, prompt, output, temperature=1.0, top_k=0, top_p=1.0):
    """Processed log-probs of ``output`` after ``prompt`` from one plain forward (no cache)."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(logits, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist(), lp


def client(url, **kw):
    return SamplerClient(url, max_concurrency=32, timeout_s=120, backoff_base_s=0.05, **kw)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=7),
        dict(temperature=1.3, top_p=0.3),
    ],
    ids=["plain", "top_k", "top_p"],
)
def test_logprobs_exact_against_plain_forward(embedded_only, tiny_model_dir, params):
    model = load_model(tiny_model_dir)

    async def main():
        async with client(embedded_only.url) as c:
            # several at once so the batched decode path with left padding is exercised
            prompts = [PROMPT[: 8 + 3 * i] for i in range(5)]
            sampling = SamplingParams(max_tokens=20, logprobs=5, ignore_eos=True, **params)
            return await asyncio.gather(*(c.generate_turn(p, sampling) for p in prompts))

    turns = run(main())
    assert embedded_only.handle.server.runner.peak_decode_rows >= 2  # left-padded batches were used
    for turn in turns:
        ref, full = reference_logprobs(model, turn.prompt_ids, turn.output_ids, **params)
        assert turn.output_log_probs == pytest.approx(ref, abs=1e-4)
        for pos, top in enumerate(turn.top_logprobs):
            want_v, want_i = torch.topk(full[pos], 5)
            for tok, val in zip(want_i.tolist(), want_v.tolist()):
                if math.isfinite(val):
                    assert top[tok] == pytest.approx(val, abs=1e-4)


def test_repetition_penalty_and_greedy(embedded_only, tiny_model_dir):
    model = load_model(tiny_model_dir)

    async def main():
        async with client(embedded_only.url) as c:
            greedy = await c.generate_turn(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True))
            again = await c.generate_turn(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True))
            penalised = await c.generate_turn(
                PROMPT, SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=5.0, logprobs=1, ignore_eos=True)
            )
            return greedy, again, penalised

    greedy, again, penalised = run(main())
    assert greedy.output_ids == again.output_ids
    ref, full = reference_logprobs(model, greedy.prompt_ids, greedy.output_ids)
    assert greedy.output_ids == full.argmax(-1).tolist()
    assert greedy.output_log_probs == pytest.approx(ref, abs=1e-4)
    seen = set(PROMPT)
    for tok in penalised.output_ids:  # a strong penalty never repeats under greedy decoding here
        assert tok not in seen
        seen.add(tok)


def test_batched_and_sequential_runners_agree(tiny_model_dir):
    handle = start_embedded(tiny_model_dir)
    try:
        runner = handle.server.runner
        assert runner.batched

        async def sample(url):
            async with client(url) as c:
                sampling = [SamplingParams(max_tokens=15, seed=100 + i, logprobs=2, ignore_eos=True) for i in range(6)]
                return await asyncio.gather(*(c.generate_turn(PROMPT[: 5 + 2 * i], s) for i, s in enumerate(sampling)))

        batched = run(sample(handle.url))
        handle.call(handle.server.engine.exclusive, _force_sequential, runner)
        sequential = run(sample(handle.url))
    finally:
        handle.stop()
    for a, b in zip(batched, sequential):
        assert a.output_ids == b.output_ids
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-4)


def _force_sequential(runner):
    runner.reset()
    runner.batched = False


def test_preemption_under_kv_pressure_keeps_outputs(tiny_model_dir):
    # 8 requests of up to 24 + 100 tokens against 256 tokens of KV: growth forces preemptions
    handle = start_embedded(tiny_model_dir, max_model_len=128, kv_cache_tokens=256, block_size=16)
    try:
        async def main():
            async with client(handle.url) as c:
                sampling = [SamplingParams(max_tokens=100, seed=7 + i, logprobs=1, ignore_eos=True) for i in range(8)]
                crowd = await asyncio.gather(*(c.generate_turn(PROMPT, s) for s in sampling))
                load = await c.read_metrics()
                alone = [await c.generate_turn(PROMPT, s) for s in sampling[:3]]
                return crowd, load, alone

        crowd, load, alone = run(main())
    finally:
        handle.stop()
    assert load.num_preemptions_total > 0
    assert load.kv_cache_tokens == 256 and load.num_requests_running == 0
    assert all(len(t.output_ids) == 100 for t in crowd)
    for a, b in zip(crowd, alone):  # recomputation after preemption continues the same sample
        assert a.output_ids == b.output_ids
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-4)


def test_kv_usage_and_queue_reflect_the_batch(tiny_model_dir):
    handle = start_embedded(tiny_model_dir, max_num_seqs=2, kv_cache_tokens=2048)
    try:
        async def main():
            async with client(handle.url) as c:
                await c.pause("keep")  # requests queue up but do not run yet
                sampling = SamplingParams(max_tokens=200, logprobs=0, ignore_eos=True)
                tasks = [asyncio.create_task(c.generate_turn(PROMPT, sampling)) for _ in range(5)]
                deadline = asyncio.get_running_loop().time() + 60
                while (load := await c.read_metrics()).num_requests_waiting < 5:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
                assert load.num_requests_running == 0 and load.kv_cache_usage_frac == 0.0
                await c.resume()
                while (load := await c.read_metrics()).num_requests_running < 2:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
                busy = load
                await asyncio.gather(*tasks)
                return busy, await c.read_metrics()

        busy, idle = run(main())
    finally:
        handle.stop()
    assert busy.num_requests_running == 2 and busy.num_requests_waiting == 3
    assert 0 < busy.kv_cache_usage_frac <= 2 * math.ceil((len(PROMPT) + 200) / 16) * 16 / 2048 + 1e-9
    assert idle.kv_cache_usage_frac == 0.0 and idle.num_requests_waiting == 0


def test_weight_update_from_safetensors_path(embedded_only, tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    model = load_model(tiny_model_dir)
    name = "model.embed_tokens.weight"  # tied with lm_head: changes every logit
    original = model.get_parameter(name).detach().clone()
    torch.manual_seed(3)
    new = torch.randn_like(original) * 0.5
    greedy = SamplingParams(max_tokens=10, seed=5, logprobs=1, ignore_eos=True)  # same draws each time

    def update_info(tensor, path):
        save_file({name: tensor.contiguous()}, str(path))
        return {"names": [name], "dtype_names": ["float32"], "shapes": [list(tensor.shape)], "path": str(path)}

    folder = embedded_only.handle.server.weights_dir  # the only folder it reads weight files from

    async def main():
        async with client(embedded_only.url, model=embedded_only.model) as c:
            before = await c.generate_turn(PROMPT, greedy)
            await c.pause("keep")
            await c.start_weight_update()
            await c.update_weights(update_info(new, folder / "new.safetensors"))
            await c.finish_weight_update("v1")
            assert await c.reset_prefix_cache()
            await c.resume()
            after = await c.generate_turn(PROMPT, greedy)
            with pytest.raises(SamplerRequestError) as bad:  # a wrong shape is refused, nothing copied
                await c.update_weights(update_info(new[:-1], folder / "bad.safetensors"))
            await c.update_weights(update_info(original, folder / "orig.safetensors"))
            restored = await c.generate_turn(PROMPT, greedy)
            return before, after, restored, bad.value

    before, after, restored, bad = run(main())
    assert after.output_log_probs[0] != pytest.approx(before.output_log_probs[0], abs=1e-3)
    assert restored.output_ids == before.output_ids
    assert restored.output_log_probs == pytest.approx(before.output_log_probs, abs=1e-5)
    assert bad.status == 400 and "shape" in bad.server_message
    with torch.no_grad():
        model.get_parameter(name).copy_(new)
    ref, _ = reference_logprobs(model, after.prompt_ids, after.output_ids)
    assert after.output_log_probs == pytest.approx(ref, abs=1e-4)


def test_reset_running_requests_recomputes_with_new_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    handle = start_embedded(tiny_model_dir, weights_dir=str(tmp_path / ".weights"))
    model = load_model(tiny_model_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    torch.manual_seed(5)
    new = torch.randn_like(model.get_parameter(name)) * 0.3
    (tmp_path / ".weights").mkdir()
    path = tmp_path / ".weights" / "w.safetensors"
    save_file({name: new}, str(path))
    try:
        async def main():
            async with client(handle.url) as c:
                task = asyncio.create_task(c.generate_turn(PROMPT, SamplingParams(max_tokens=80, logprobs=0, ignore_eos=True)))
                running = handle.server.scheduler.running
                deadline = asyncio.get_running_loop().time() + 60
                while not (running and len(running[0].output_ids) >= 10):
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.005)
                await c.pause("keep")
                assert await c.reset_prefix_cache(max_attempts=2, retry_delay_s=0.01) is False  # KV held
                await c.update_weights({"names": [name], "path": str(path)})
                assert await c.reset_prefix_cache(reset_running_requests=True)
                split = len(running[0].output_ids)
                await c.resume()
                return await task, split, await c.read_metrics()

        turn, split, load = run(main())
    finally:
        handle.stop()
    assert load.num_preemptions_total == 1
    with torch.no_grad():
        model.get_parameter(name).copy_(new)
    ref, _ = reference_logprobs(model, turn.prompt_ids, turn.output_ids)
    # tokens after the sync come from the new weights, recomputed over the whole prefix
    assert turn.output_log_probs[split:] == pytest.approx(ref[split:], abs=1e-4)


def test_lora_load_serve_unload(embedded_only, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(
        load_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    greedy = SamplingParams(max_tokens=10, seed=11, logprobs=1, ignore_eos=True)

    async def main():
        async with client(embedded_only.url, model=embedded_only.model) as c:
            base = await c.generate_turn(PROMPT, greedy)
            await c.load_lora_adapter("policy-v1", str(tmp_path / "adapter"))
            with pytest.raises(SamplerRequestError) as twice:
                await c.load_lora_adapter("policy-v1", str(tmp_path / "adapter"))
            names = {m["id"] for m in await c.models()}
            mixed = await asyncio.gather(c.generate_turn(PROMPT, greedy, model="policy-v1"), c.generate_turn(PROMPT, greedy))
            await c.unload_lora_adapter("policy-v1")
            with pytest.raises(SamplerRequestError) as gone:
                await c.generate_turn(PROMPT, greedy, model="policy-v1")
            after = await c.generate_turn(PROMPT, greedy)
            return base, mixed, after, names, twice.value, gone.value

    base, (lora, base_again), after, names, twice, gone = run(main())
    assert "policy-v1" in names
    assert twice.status == 400
    assert gone.status == 404
    assert lora.output_log_probs[0] != pytest.approx(base.output_log_probs[0], abs=1e-3)
    assert base_again.output_ids == base.output_ids == after.output_ids
    assert base_again.output_log_probs == pytest.approx(base.output_log_probs, abs=1e-4)
    ref, _ = reference_logprobs(peft_model, lora.prompt_ids, lora.output_ids)
    assert lora.output_log_probs == pytest.approx(ref, abs=1e-4)


def test_lora_rank_and_count_limits(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    for rank in (4, 16):
        get_peft_model(load_model(tiny_model_dir), LoraConfig(r=rank, target_modules=["q_proj"])).save_pretrained(
            tmp_path / f"r{rank}"
        )
    handle = start_embedded(tiny_model_dir, enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        async def main():
            async with client(handle.url) as c:
                with pytest.raises(SamplerRequestError) as too_big:
                    await c.load_lora_adapter("big", str(tmp_path / "r16"))
                await c.load_lora_adapter("a", str(tmp_path / "r4"))
                with pytest.raises(SamplerRequestError) as too_many:
                    await c.load_lora_adapter("b", str(tmp_path / "r4"))
                return too_big.value, too_many.value

        too_big, too_many = run(main())
    finally:
        handle.stop()
    assert "max-lora-rank" in too_big.server_message
    assert "max-loras" in too_many.server_message


def test_module_entry_point(tiny_model_dir):
    cmd = [sys.executable, "-m", "asyncgrpo_cli.sampler.embedded", "--model", str(tiny_model_dir), "--port", "0",
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--served-model-name", "cli-tiny",
           "--log-level", "WARNING"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving cli-tiny at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.strip().rsplit(" ", 1)[-1]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 128
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run(cmd[:-2] + ["--kv-cache-tokens", "64"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "--kv-cache-tokens 64" in bad.stderr and "--max-model-len 128" in bad.stderr
