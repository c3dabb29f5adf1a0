"""MoE weight sync: the trainer sends per-expert checkpoint names (what vLLM's expert-parameter mapping reads);
the embedded sampler, whose transformers model holds fused experts, maps each one to its expert's slot and to
the gate or up half of the fused gate-up weight. Then an end-to-end CPU run of a tiny Qwen3-MoE.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from asyncgrpo_cli.sampler.client import SyncSamplerClient
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.train.weight_sync import WeightSync, make_weight_sync
from asyncgrpo_cli.train.weight_sync.params import FullWeightSource

EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe"), family="qwen3_moe")


def checkpoint_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def test_sent_names_are_the_checkpoint_names_vllm_maps(moe_dir):
    """Every name a sync sends (NCCL and IPC send the same metadata) is a checkpoint name; the expert weights
    are vLLM's ``experts.{e}.{gate,up,down}_proj.weight``, one per expert, for every layer."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())  # fused in memory
    source = FullWeightSource(model)
    sent = [m.name for m in source.metadata()]
    streamed = [name for name, _ in source.tensors()]
    assert sent == streamed
    on_disk = checkpoint_names(moe_dir)
    assert set(sent) == on_disk - {"lm_head.weight"} or set(sent) == on_disk
    experts = {(m[1], m[2]) for n in sent if (m := EXPERT.match(n))}
    assert experts == {(str(e), p) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}


def sample(url: str, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "logprobs": 0, "temperature": 1.0, "seed": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def logprobs(model, prompt: list[int], continuation: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + continuation])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(continuation)]


def test_embedded_server_takes_per_expert_weights(moe_dir, tmp_path):
    trained = AutoModelForCausalLM.from_pretrained(moe_dir)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    server = ServerThread(ServerConfig(model=str(moe_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=64, max_logprobs=4)).start()
    try:
        sync = WeightSync(trained, make_weight_sync(SyncSamplerClient(server.url, timeout_s=60.0), output_dir=tmp_path))
        sync.init()
        sync.sync(1)  # used to fail: 'model.layers.0.mlp.experts.0.down_proj.weight' is not a parameter
        sync.close()
        prompt = [1, 10, 20, 30]
        continuation, served = sample(server.url, str(moe_dir), prompt)
    finally:
        server.stop()
    expected = logprobs(trained, prompt, continuation)
    base = logprobs(AutoModelForCausalLM.from_pretrained(moe_dir), prompt, continuation)
    assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-3  # every expert, gate and up in place
    assert max(abs(a - b) for a, b in zip(served, base)) > 1e-2
