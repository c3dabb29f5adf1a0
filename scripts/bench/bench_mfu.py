"""Trainer fwd+bwd MFU benchmark P3 of the performance issue (one GPU, random weights).

    python scripts/bench/bench_mfu.py --out scripts/bench/results            # Qwen3-1.7B shape, 16K-token rows
    python scripts/bench/bench_mfu.py --device cpu --shape tiny --out /tmp/benchout   # checks the script only
    python scripts/bench/bench_mfu.py --compile --every-n-layers 2   # checkpoint every other layer (P3_every2_*)
    python scripts/bench/bench_mfu.py --precision autocast   # float32 weights, bf16 autocast (P3_autocast_*)

Workload: GRPO groups of G = 8 samples (prompt ``--prompt`` tokens shared by the group, ``--completion`` trained
tokens each) tree-packed by the product's ``TokenBudgetBatcher`` + ``pack_row`` into ``--rows`` rows of at most
``--budget`` forwarded tokens (defaults: 1017 + 8 × 384 + 7 branch copies = 4096 forwarded tokens a group, 4
groups = 16 384 tokens a row, 2 rows a step, 24 576 trained tokens), bf16
random weights, activation checkpointing on (non-reentrant, the trainer's default: SPEC §16.4), tree attention
(flex on CUDA), the loss computed inside the forward (``row_loss``, chunked over the vocabulary), backward; exactly
``bench_packing.packed_step``. Median of ``--steps`` steps after warm-up, CUDA-event timing.

Model FLOPs of one step (recomputation not counted; all multiply-adds = 2 FLOPs):

    F = 6 · P · T  +  6 · H · V · N  +  3 · 4 · d · h · n_layers · A

- ``P``: non-embedding parameters (every parameter except the input embedding matrix; the lm_head is tied to
  it in the Qwen3-1.7B shape and counted by the second term). Norm weights are included (0.003 % of P).
- ``T``: forwarded tokens of the step's rows (unique trie tokens, not sample tokens).
- ``H · V · N``: the lm_head matmul, which the product runs only at the ``N`` trained tokens' prediction
  positions (``packed_loss`` gathers ``predict_index``; one per trained token, counted per sample) against the
  whole vocabulary ``V``; ×6 = forward + grad-input + grad-weight.
- ``A``: allowed (query, key) pairs of the rows' tree masks, counted exactly from the mask structure: key ``j``
  is visible to query ``i`` iff ``j <= i <= dfs_leave[j]`` (``tree_attention``), so ``A = Σ_j (dfs_leave[j] − j
  + 1)`` (checked equal to ``PackedRow.attention_cost = Σ (position + 1)``). ``4 · d · h`` per pair and layer
  (QKᵀ and PV, ``h`` query heads of dimension ``d``), ×3 for forward + backward.

MFU = F / step seconds / peak, the peak being the best bf16 dense ``torch.matmul`` throughput measured on this
device (square n × n, n in 4096/8192/16384, CUDA events, best of several). HFU adds what the step really runs
again: checkpointing's layer recomputation (``2 · P_layers · T + 4 · d · h · n_layers · A``) and the loss kernel's
recomputed lm_head GEMM (``2 · H · V · N``).

``--profile DIR`` writes the same bucketed torch.profiler tables as ``bench_packing.py`` for this step.
Imports: torch, transformers, ``asyncgrpo_cli.train`` and ``bench_packing`` only (no hydra/omegaconf/datasets).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_packing as bp

from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.checkpointing import checkpointed_layers
from asyncgrpo_cli.train.packing import (
    PackedRow,
    count_forwarded_tokens,
    pack_row,
)

TARGET = 0.50  # issue #43 item 5
G = 8
# (completion, prompt, budget, rows) per shape; tiny keeps the CPU check to seconds.
# Full: a group forwards 1017 + 8 x 384 + 7 = 4096 tokens, so 4 groups fill a 16 384-token row exactly.
WORKLOAD_DEFAULTS = {"tiny": (16, 57, 384, 2)}
FULL_WORKLOAD = (384, 1017, 16384, 2)


def tree_mask_pairs(row: PackedRow) -> int:
    """Allowed (query, key) pairs of the row's tree mask: ``Σ_j (dfs_leave[j] − j + 1)`` (key ``j`` is seen by
    the queries ``j .. dfs_leave[j]``, its DFS subtree).

    Raises:
        ValueError: the count disagrees with ``row.attention_cost`` (``Σ (position + 1)``, the same pairs
            counted per query); the row's layout is then inconsistent.
    """
    idx = torch.arange(row.num_tokens, dtype=torch.int64)
    pairs = int((row.dfs_leave.to(torch.int64) - idx + 1).sum())
    if pairs != row.attention_cost:
        raise ValueError(f"tree mask pairs {pairs} != row.attention_cost {row.attention_cost}: inconsistent row")
    return pairs


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts: ``total`` (shared tensors once), ``embedding`` (input embedding matrix), ``non_embedding``
    (total − embedding − an untied lm_head), ``layers`` (decoder layers only: what checkpointing recomputes)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    non_emb = total - emb.numel() - (head.numel() if head is not emb else 0)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model.model
    layers = sum(p.numel() for p in decoder.layers.parameters())
    return {"total": total, "embedding": emb.numel(), "non_embedding": non_emb, "layers": layers}


def step_flops(params: dict[str, int], hidden: int, vocab: int, head_dim: int, heads: int, layers: int,
               forwarded_tokens: int, trained_tokens: int, mask_pairs: int, checkpointing: bool | float
               ) -> dict[str, float]:
    """Model and hardware FLOPs of one fwd+bwd step (module docstring formula).

    Args:
        params: :func:`count_parameters`; hidden, vocab, head_dim, heads (query heads), layers: the shape.
        forwarded_tokens: ``T``; trained_tokens: ``N`` (lm_head rows, per sample); mask_pairs: ``A`` summed
            over the step's rows; checkpointing: whether layers are recomputed, or the share of the layers that
            are (``every_n_layers`` > 1) (HFU only).

    Returns:
        ``dense``, ``lm_head``, ``attention``, ``model`` (their sum; MFU numerator) and ``hardware`` (``model`` +
        recomputation) in FLOPs.
    """
    dense = 6.0 * params["non_embedding"] * forwarded_tokens
    lm_head = 6.0 * hidden * vocab * trained_tokens
    attn_fwd = 4.0 * head_dim * heads * layers * mask_pairs
    model = dense + lm_head + 3.0 * attn_fwd
    recompute = 2.0 * hidden * vocab * trained_tokens
    if checkpointing:
        recompute += float(checkpointing) * (2.0 * params["layers"] * forwarded_tokens + attn_fwd)
    return {"dense": dense, "lm_head": lm_head, "attention": 3.0 * attn_fwd, "model": model,
            "hardware": model + recompute}


def measure_matmul_peak(device: str, dtype: torch.dtype, sizes: tuple[int, ...], iters: int = 10,
                        repeats: int = 5) -> tuple[float, dict[int, float]]:
    """Best dense ``torch.matmul`` throughput (FLOP/s) of square ``n × n`` operands of ``dtype``.

    Each measurement times ``iters`` back-to-back matmuls into a preallocated output (CUDA events on CUDA,
    ``perf_counter`` on the CPU) after a warm-up; the best of ``repeats`` counts, ``2 n³`` FLOPs each.

    Returns:
        ``(best FLOP/s over sizes, {n: FLOP/s})``.
    """
    per_size = {}
    for n in sizes:
        gen = torch.Generator(device=device).manual_seed(n)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        c = torch.empty(n, n, device=device, dtype=dtype)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        best = math.inf
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    torch.matmul(a, b, out=c)
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end) / 1000
            else:
                t = time.perf_counter()
                for _ in range(iters):
                    torch.matmul(a, b, out=c)
                elapsed = time.perf_counter() - t
            best = min(best, elapsed)
        per_size[n] = 2.0 * n ** 3 * iters / best
        del a, b, c
    if device == "cuda":
        torch.cuda.empty_cache()
    return max(per_size.values()), per_size


def build_rows(completion: int, prompt: int, budget: int, rows: int) -> list[PackedRow]:
    """``rows`` tree-packed rows, each holding as many whole GRPO groups (G = 8) as fit ``budget`` forwarded
    tokens, through the product's batcher and ``pack_row``. A group forwards ``prompt + 8 × completion + 7``
    tokens (the trie branches one token early: each later sample re-forwards the last shared token).

    Raises:
        ValueError: one group does not fit the budget.
    """
    group_tokens = count_forwarded_tokens(s.input_ids for s in bp.make_samples(1, G, completion, prompt, True, seed=0))
    per_row = budget // group_tokens
    if per_row < 1:
        raise ValueError(f"one group forwards {group_tokens} tokens (--prompt {prompt}, 8 x --completion {completion})"
                         f" but --budget is {budget}; raise --budget or shorten the samples")
    samples = bp.make_samples(per_row * rows, G, completion, prompt, True, seed=1)
    # random ids can collide (tiny vocabulary), shrinking a group and moving a later sample forward: keep `rows`
    return [pack_row(p.rows[0]) for p in TokenBudgetBatcher(budget, 1).plan(samples)][:rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(bp.SHAPES))
    ap.add_argument("--completion", type=int, default=None, help="trained tokens per sample (default 384; tiny 16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens shared by a group (default 1017; tiny 57)")
    ap.add_argument("--budget", type=int, default=None, help="forwarded tokens per row (default 16384; tiny 384)")
    ap.add_argument("--rows", type=int, default=None, help="rows per step (default 2)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention", default="auto", choices=("auto", "flex", "sdpa", "flash"))
    ap.add_argument("--no-activation-checkpointing", action="store_true",
                    help="turn checkpointing off (the default config has it on)")
    ap.add_argument("--every-n-layers", type=int, default=1,
                    help="checkpoint every N-th layer only (trainer.activation_checkpointing_kwargs.every_n_layers)")
    ap.add_argument("--objective", default="centering", choices=("centering", "clipped"),
                    help="loss objective (default: score centering, the config default)")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "autocast"),
                    help="bf16: bf16 weights (the default; a CPU check keeps float32 weights, as weights_dtype "
                         "records); autocast: float32 weights, the forward under bf16 autocast (the recipes' "
                         "model.dtype=float32 with trainer.bf16)")
    ap.add_argument("--out", default=str(bp.ROOT / "scripts" / "bench" / "results"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda, or cpu to check the script")
    bp.add_profile_args(ap)
    ns = ap.parse_args()
    bp.configure(ns.device, ns.shape)
    completion, prompt, budget, n_rows = WORKLOAD_DEFAULTS.get(ns.shape, FULL_WORKLOAD)
    completion = ns.completion if ns.completion is not None else completion
    prompt = ns.prompt if ns.prompt is not None else prompt
    budget = ns.budget if ns.budget is not None else budget
    n_rows = ns.rows if ns.rows is not None else n_rows
    checkpointing = not ns.no_activation_checkpointing

    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    sizes = (4096, 8192, 16384) if ns.device == "cuda" else (128, 256)
    peak, peak_by_size = measure_matmul_peak(ns.device, dtype, sizes)

    autocast = ns.precision == "autocast"
    model, backend = bp.setup_model(ns.shape, ns.attention, checkpointing, compile=ns.compile,
                                    every_n_layers=ns.every_n_layers, dtype=torch.float32 if autocast else None)
    on, of = checkpointed_layers(model)
    if ns.profile:
        bp.install_markers(model)
    cfg = bp.loss_config(ns.compile, score_centering=ns.objective == "centering")
    rows = build_rows(completion, prompt, budget, n_rows)
    shape = bp.SHAPES[ns.shape]
    params = count_parameters(model)
    forwarded = sum(r.num_tokens for r in rows)
    trained = sum(r.num_trained_tokens for r in rows)
    sample_tokens = sum(r.sample_tokens for r in rows)
    pairs = sum(tree_mask_pairs(r) for r in rows)
    flops = step_flops(params, shape["hidden_size"], bp.VOCAB, shape["head_dim"], shape["num_attention_heads"],
                       shape["num_hidden_layers"], forwarded, trained, pairs, on / of if of else checkpointing)

    step = bp.packed_step(model, rows, cfg, autocast=torch.bfloat16 if autocast else None)
    loss = step()
    if not math.isfinite(loss):
        sys.exit(f"P3: the loss is {loss}; not timing a broken step")
    if ns.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t_med, t_min = bp.time_fn(step, ns.steps)
    peak_alloc = torch.cuda.max_memory_allocated() if ns.device == "cuda" else None
    peak_reserved = torch.cuda.max_memory_reserved() if ns.device == "cuda" else None
    mfu = flops["model"] / t_med / peak
    result = dict(
        bp.run_meta(ns.shape), target_id="P3", attention=backend, activation_checkpointing=checkpointing,
        every_n_layers=ns.every_n_layers if checkpointing else None, checkpointed_layers=[on, of],
        objective=ns.objective, torch_compile=ns.compile, dtype=str(dtype).replace("torch.", ""),
        precision=ns.precision, weights_dtype="float32" if autocast else str(dtype).replace("torch.", ""), G=G,
        prompt=prompt, completion=completion,
        token_budget=budget, rows=len(rows), row_tokens=[r.num_tokens for r in rows], steps=ns.steps,
        forwarded_tokens=forwarded, trained_tokens=trained, sample_tokens=sample_tokens,
        packing_ratio=sample_tokens / forwarded, tree_mask_pairs=pairs, parameters=params,
        vocab=bp.VOCAB, hidden=shape["hidden_size"], layers=shape["num_hidden_layers"],
        query_heads=shape["num_attention_heads"], head_dim=shape["head_dim"],
        flops_formula=("model = 6*P_non_embedding*T_forwarded + 6*H*V*N_trained (lm_head at trained positions) "
                       "+ 3*4*head_dim*query_heads*layers*A (A = tree-mask pairs = sum_j dfs_leave[j]-j+1); "
                       "recomputation not counted. hardware = model + 2*H*V*N_trained (loss kernel recompute) "
                       "+ [checkpointing, times the share of layers checkpointed] 2*P_layers*T_forwarded + "
                       "4*head_dim*query_heads*layers*A"),
        flops_per_step=flops, matmul_peak_flops=peak,
        matmul_peak_by_size={str(k): v for k, v in peak_by_size.items()}, matmul_peak_dtype=str(dtype).replace("torch.", ""),
        step_s=t_med, step_min_s=t_min, step_ms=t_med * 1e3,
        forwarded_tokens_per_s=forwarded / t_med, trained_tokens_per_s=trained / t_med,
        sample_tokens_per_s=sample_tokens / t_med, achieved_flops=flops["model"] / t_med,
        mfu=mfu, hfu=flops["hardware"] / t_med / peak, mfu_at_min_step=flops["model"] / t_min / peak,
        peak_memory_allocated_bytes=peak_alloc, peak_memory_reserved_bytes=peak_reserved, loss=loss,
        ratio=mfu / TARGET, target=f"mfu >= {TARGET}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    every = f"_every{ns.every_n_layers}" if checkpointing and ns.every_n_layers > 1 else ""
    precision = "_autocast" if autocast else ""
    path = out / bp.result_name(f"P3{every}{precision}", ns.shape, ns.compile)
    path.write_text(json.dumps(result, indent=1))
    if ns.profile:
        bp.profile_variant(step, f"{ns.shape}_P3_tree{'_compiled' * ns.compile}", Path(ns.profile), ns.profile_steps, ns.trace)
    gib = (peak_alloc or 0) / 2**30
    print(f"{'id':4} {'MFU':>7} {'HFU':>7} {'target':>7} {'step ms':>9} {'fwd tok/s':>11} {'trained tok/s':>14} "
          f"{'peak GiB':>9} {'matmul peak TFLOP/s':>20}")
    print(f"{'P3':4} {mfu * 100:6.1f}% {result['hfu'] * 100:6.1f}% {TARGET * 100:6.0f}% {t_med * 1e3:9.1f} "
          f"{forwarded / t_med:11.0f} {trained / t_med:14.0f} {gib:9.2f} {peak / 1e12:20.1f}")
    print(f"FLOPs/step: dense {flops['dense']:.3e}, lm_head {flops['lm_head']:.3e}, attention {flops['attention']:.3e}"
          f" -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
