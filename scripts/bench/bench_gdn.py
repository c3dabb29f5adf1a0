"""Tree vs plain packing on a Gated DeltaNet hybrid (Qwen3.5-2B shape, random weights), one GPU (SPEC §6.5, §6.6).

    python scripts/bench/bench_gdn.py --out scripts/bench/results

A GRPO batch of ``--groups`` prompts × G = 8 rollouts, prompt = 4 × completion, so that tree packing forwards
about 1/3.3 of the sample tokens (packing ratio ≈ 3.3). The product's fwd+bwd (``row_loss``: tree attention, the
trie-aware Gated DeltaNet kernels of ``asyncgrpo_cli.train.gated_deltanet``, the loss inside the forward) is timed
on:

- **tree**: rows of at most ``--token-budget`` forwarded tokens, groups' prompts shared (``TokenBudgetBatcher``);
- **plain**: the same samples with nothing shared (each sample its own root segment: padding-free packing, the
  recurrent state reset at every sample), rows of the same budget.

Reported: trained tokens per second of each (target: tree ≥ 2.5 × plain) and peak memory of one step (target:
tree ≤ 1.2 × plain); the two variants' losses are checked equal (bf16 tolerance) before timing. Writes
``GDN_<shape>.json`` with the device, versions (torch, Triton, fla-core, tilelang, transformers), date, the
Gated DeltaNet kernel used and the figures. When the kernel cannot train here (fla's refused backward on Hopper
with Triton < 3.7.1 and no tilelang) the JSON records that refusal and the script exits 3.

Check the script on a CPU (seconds)::

    python scripts/bench/bench_gdn.py --device cpu --shape tiny --steps 1 --out /tmp/benchout

Imports: torch, transformers and ``asyncgrpo_cli.train`` / ``asyncgrpo_cli.rollout.types`` only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train.gated_deltanet import GatedDeltaNetUnavailable
from asyncgrpo_cli.train.loss import LossConfig
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.checkpointing import enable_activation_checkpointing
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention

# Qwen3.5-2B text stack as its config.json gives it (random weights are fine for speed): 24 layers, every 4th full
# attention; "tiny" checks the script on a CPU.
SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3.5-2b": dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
}
# (completion, groups, token_budget): 8 rollouts per prompt, prompt = 4 × completion → packing ratio 3.33
WORKLOADS = {"tiny": (12, 2, 512), "qwen3.5-2b": (512, 8, 16384)}
GROUP = 8
PROMPT_RATIO = 4
TARGET_SPEEDUP = 2.5
TARGET_MEMORY = 1.2


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run_meta(device: str, shape: str) -> dict:
    """Device, versions and date recorded in the result JSON."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": _version("triton"),
        "fla-core": _version("fla-core"), "tilelang": _version("tilelang"), "transformers": _version("transformers"),
        "python": platform.python_version(), "shape": shape, "date": datetime.date.today().isoformat(),
    }


def build_model(shape: str, device: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    spec = dict(SHAPES[shape])
    layers = spec["num_hidden_layers"]
    config = Qwen3_5TextConfig(
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        tie_word_embeddings=True, max_position_embeddings=40960, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    return model


def make_samples(shape: str, seed: int = 0) -> list[TrainingSequence]:
    """``groups`` GRPO groups of 8 samples sharing a prompt of 4 × the completion length."""
    completion, groups, _ = WORKLOADS[shape]
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(seed)
    prompt = PROMPT_RATIO * completion
    out = []
    for g in range(groups):
        base = [rng.randrange(vocab) for _ in range(prompt)]
        for _ in range(GROUP):
            ids = base + [rng.randrange(vocab) for _ in range(completion)]
            trained = [0] * prompt + [1] * completion
            out.append(TrainingSequence(
                input_ids=ids, trained_mask=trained, sampler_logprobs=[-math.log(vocab) if t else 0.0 for t in trained],
                advantage=rng.choice([-1.0, 1.0]), group_id=g, row_index=g, model_version=0,
                sampler_top_ids=[[rng.randrange(vocab) for _ in range(8)] if t else [] for t in trained],
                sampler_top_logprobs=[[-3.0] * 8 if t else [] for t in trained]))
    return out


def tree_rows(samples, budget: int):
    """Rows of the product's batcher (groups' prompts shared), at most ``budget`` forwarded tokens each."""
    rows = []
    for plan in TokenBudgetBatcher(budget, 1).plan(samples):
        rows.extend(pack_row(r) for r in plan.rows)
    return rows


def plain_rows(samples, budget: int):
    """The same samples with nothing shared (plain padding-free packing): each sample packed alone, the single-sample
    rows laid side by side (``bench_packing.concat_rows``) into rows of at most ``budget`` tokens. Tokens, positions
    and targets are those of the tree rows; every sample is a root segment, so the recurrent state restarts."""
    from bench_packing import concat_rows

    rows, current, tokens = [], [], 0
    for s in samples:
        if current and tokens + s.num_tokens > budget:
            rows.append(concat_rows(current))
            current, tokens = [], 0
        current.append(pack_row([s]))
        tokens += s.num_tokens
    if current:
        rows.append(concat_rows(current))
    return rows


def step_fn(model, rows, cfg):
    """One step's fwd+bwd over ``rows`` through ``row_loss``; returns the loss sum."""
    total = sum(r.num_trained_tokens for r in rows)

    def run():
        loss_sum = 0.0
        for row in rows:
            loss, _ = row_loss(model, row, cfg, total, 1)
            loss.backward()
            loss_sum += float(loss.detach())
        model.zero_grad(set_to_none=True)
        return loss_sum

    return run


def measure(fn, device: str, steps: int) -> tuple[float, int | None]:
    """Median seconds per call over ``steps`` (after one warm-up on CUDA) and peak allocated bytes (CUDA)."""
    if device == "cuda":
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return statistics.median(times), peak


def _progress(path: Path, result: dict, what: str, started: float) -> None:
    """Write what is measured so far (``"complete": false``) and say so: a call cut short by its time limit
    (kernel compilation on first use can take minutes) still leaves its figures."""
    result["elapsed_s"] = round(time.perf_counter() - started, 2)
    path.write_text(json.dumps({**result, "complete": False, "last_phase": what}, indent=2) + "\n")
    print(f"bench_gdn: {what} ({result['elapsed_s']:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda, or cpu to check the script")
    ap.add_argument("--shape", default="qwen3.5-2b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="bench_out", help="folder for GDN_<shape>.json")
    ap.add_argument("--no-activation-checkpointing", action="store_true",
                    help="keep every layer's activations (the trainer checkpoints every layer by default, SPEC "
                         "§16.4; without it the 2B shape's 16K-token tree row ran out of an H100's 80 GB)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda (the default): no CUDA GPU is visible here. This benchmark times a GPU; "
                         "to check the script on a CPU, add --device cpu --shape tiny")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"GDN_{args.shape}.json"
    meta = run_meta(args.device, args.shape)
    completion, groups, budget = WORKLOADS[args.shape]
    meta["workload"] = dict(group=GROUP, groups=groups, prompt=PROMPT_RATIO * completion, completion=completion,
                            token_budget=budget, steps=args.steps,
                            activation_checkpointing=not args.no_activation_checkpointing)
    started = time.perf_counter()
    partial = dict(meta)
    model = build_model(args.shape, args.device)
    model.train()
    if not args.no_activation_checkpointing:  # as the trainer does (non-reentrant, every layer)
        enable_activation_checkpointing(model)
    _progress(path, partial, "model built", started)
    try:
        backend = apply_tree_attention(model, "flex" if args.device == "cuda" else "sdpa")
    except GatedDeltaNetUnavailable as exc:
        path.write_text(json.dumps({**meta, "error": str(exc)}, indent=2) + "\n")
        print(f"Gated DeltaNet kernel unavailable: {exc}\nwrote {path}", file=sys.stderr)
        return 3
    from asyncgrpo_cli.train import gated_deltanet

    meta["tree_attention"] = backend
    meta["gdn_kernel"] = gated_deltanet.resolve_gdn_kernel(args.device)
    install_loss_head(model)
    cfg = LossConfig()
    samples = make_samples(args.shape)
    tree = tree_rows(samples, budget)
    plain = plain_rows(samples, budget)
    trained = sum(r.num_trained_tokens for r in tree)
    assert trained == sum(r.num_trained_tokens for r in plain)
    sample_tokens = sum(s.num_tokens for s in samples)
    ratio = sample_tokens / sum(r.num_tokens for r in tree)
    tree_fn, plain_fn = step_fn(model, tree, cfg), step_fn(model, plain, cfg)
    partial.update(meta, packing_ratio=round(ratio, 3), rows={"tree": len(tree), "plain": len(plain)})
    first = time.perf_counter()
    lt = tree_fn()
    partial["first_step_s"] = {"tree": time.perf_counter() - first}  # includes kernel compilation on first use
    _progress(path, partial, "first tree step (kernels compiled)", started)
    first = time.perf_counter()
    lp = plain_fn()
    partial["first_step_s"]["plain"] = time.perf_counter() - first
    partial["loss"] = {"tree": lt, "plain": lp}
    _progress(path, partial, "first plain step", started)
    tol = 2e-2 if args.device == "cuda" else 1e-4
    if not math.isclose(lt, lp, rel_tol=tol, abs_tol=tol):
        raise SystemExit(f"tree and plain packing disagree on the loss ({lt} vs {lp}); not timing a wrong result")
    if args.device == "cuda":
        torch.cuda.empty_cache()
    t_tree, m_tree = measure(tree_fn, args.device, args.steps)
    partial.update(step_s={"tree": t_tree}, peak_memory_bytes={"tree": m_tree})
    _progress(path, partial, "tree steps timed", started)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    t_plain, m_plain = measure(plain_fn, args.device, args.steps)
    speedup = t_plain / t_tree
    result = {
        **meta,
        "packing_ratio": round(ratio, 3),
        "rows": {"tree": len(tree), "plain": len(plain)},
        "forwarded_tokens": {"tree": sum(r.num_tokens for r in tree), "plain": sum(r.num_tokens for r in plain)},
        "trained_tokens": trained,
        "loss": {"tree": lt, "plain": lp},
        "step_s": {"tree": t_tree, "plain": t_plain},
        "trained_tokens_per_s": {"tree": trained / t_tree, "plain": trained / t_plain},
        "speedup": speedup,
        "peak_memory_bytes": {"tree": m_tree, "plain": m_plain},
        "memory_ratio": (m_tree / m_plain) if m_tree and m_plain else None,
        "targets": {"speedup_min": TARGET_SPEEDUP, "memory_ratio_max": TARGET_MEMORY},
        "first_step_s": partial["first_step_s"], "elapsed_s": round(time.perf_counter() - started, 2),
        "complete": True,
    }
    if args.device == "cuda":
        result["meets_targets"] = bool(speedup >= TARGET_SPEEDUP and result["memory_ratio"] <= TARGET_MEMORY)
    path.write_text(json.dumps(result, indent=2) + "\n")
    mem = (f", peak memory {m_tree / 2**30:.2f} vs {m_plain / 2**30:.2f} GiB ({result['memory_ratio']:.2f}x)"
           if m_tree and m_plain else "")
    print(f"{args.shape} on {meta['device']} (GDN kernel {meta['gdn_kernel']}): packing ratio {ratio:.2f}, "
          f"trained tokens/s tree {trained / t_tree:,.0f} vs plain {trained / t_plain:,.0f} ({speedup:.2f}x){mem}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
