"""Worker of the 2-process FSDP2 weight-sync test (run under ``torchrun --nproc_per_node 2``, gloo, CPU).

Each rank builds the same tiny Qwen3 (and a PEFT LoRA copy), records the unsharded reference
tensors, shards with ``fully_shard``, then gathers with `iter_full_parameter_buckets` and through
`WeightSync` (rank 0 with a collecting backend, rank 1 draining). Every rank checks its tensors
against the reference and against the other rank's; rank 0 writes the verdict as JSON to argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncgrpo_cli.train.weight_sync import (
    FullWeightSource,
    SyncTimings,
    WeightSync,
    WeightSyncBackend,
    iter_full_parameter_buckets,
)

BUCKET_BYTES = 8192


class Collect(WeightSyncBackend):
    """Rank 0's backend: keeps what it is sent."""

    def __init__(self) -> None:
        super().__init__(client=None)
        self.received: dict[str, torch.Tensor] = {}

    def sync(self, source, version):  # noqa: ANN001
        for bucket in source.buckets():
            self.received.update((n, t.clone()) for n, t in bucket)
        return SyncTimings()


def build() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    plain = Qwen3ForCausalLM(config)
    peft = get_peft_model(copy.deepcopy(plain), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return plain, peft


def shard(model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain, peft = build()
    ref_plain = {n: p.detach().clone() for n, p in plain.named_parameters()}
    ref_merged = {n: p.detach().clone() for n, p in copy.deepcopy(peft).merge_and_unload().named_parameters()}
    early = FullWeightSource(plain, bucket_bytes=BUCKET_BYTES)  # planned before sharding: must re-plan
    shard(plain, plain.model.layers)
    with torch.no_grad():  # changed after sharding, so a stale plan (old tensors) would show
        for p in plain.parameters():
            p.mul_(2.0)
    ref_plain = {n: t * 2.0 for n, t in ref_plain.items()}
    shard(peft, peft.base_model.model.model.layers)
    problems: list[str] = []
    if not all(isinstance(p, DTensor) for p in plain.parameters()):
        problems.append("fully_shard left non-DTensor parameters")

    results = {}
    passes = (("plain", list(early.buckets()), ref_plain),
              ("peft", list(iter_full_parameter_buckets(peft, bucket_bytes=BUCKET_BYTES)), ref_merged))
    for label, buckets, ref in passes:
        got = {n: t.clone() for b in buckets for n, t in b}
        results[label] = got
        if len(buckets) < 2:
            problems.append(f"{label}: expected several buckets, got {len(buckets)}")
        if list(got) != list(ref):
            problems.append(f"{label}: names {list(got)} != {list(ref)}")
        for name, tensor in got.items():
            if name in ref and (tensor.shape != ref[name].shape or not torch.allclose(tensor, ref[name], atol=1e-6)):
                problems.append(f"{label}: {name} differs from the unsharded model on rank {rank}")

    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    for label in results:
        for name, tensor in gathered[0][label].items():
            if not torch.equal(tensor, gathered[1][label][name]):
                problems.append(f"{label}: {name} differs between ranks")

    backend = Collect() if rank == 0 else None
    sync = WeightSync(peft, backend, mode="full", bucket_bytes=BUCKET_BYTES, barrier=dist.barrier)
    metrics = sync.sync(1)
    if rank == 0:
        if set(backend.received) != set(ref_merged):
            problems.append("WeightSync: rank 0 received other names")
        for name, tensor in backend.received.items():
            if not torch.allclose(tensor, ref_merged[name], atol=1e-6):
                problems.append(f"WeightSync: {name} differs")
    if sorted(metrics) != sorted(SyncTimings().as_metrics()):
        problems.append(f"WeightSync metrics {sorted(metrics)}")

    all_problems = [None, None]
    dist.all_gather_object(all_problems, problems)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"problems": [p for ps in all_problems for p in ps],
                       "names": sorted(results["plain"])}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
