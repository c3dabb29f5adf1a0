"""Issue #43 item 4: the ``flash`` tree-attention backend (flash-attn-4 on Hopper) against ``flex``, on the same rows.

    python scripts/bench/bench_attention.py --shape qwen3-1.7b --out scripts/bench/results
    python scripts/bench/bench_attention.py --shape qwen3-1.7b --compile --out scripts/bench/results
    python scripts/bench/bench_attention.py --device cpu --shape tiny --out /tmp/benchout    # checks the script only

The model and rows are P1's (``bench_packing``): the shape with random weights (bf16 on CUDA, fp32 on a CPU),
activation checkpointing, the loss inside the forward, tree rows of GRPO groups of 8 (prompt 4x the completion,
completions of 256 tokens ±50%, 6 groups, 16K-token budget; the ``tiny`` shape: 16-token completions, 3 groups,
512-token budget). Each backend of ``--backends`` (default ``flex,flash`` on CUDA, ``sdpa,flash`` on a CPU, where
FlexAttention has no backward) switches the same model with ``apply_tree_attention`` and runs the same rows:

- **checks before any timing** (a fast wrong kernel is not a result; exit 1):
  - packed = unpacked: the trained tokens' log-probs of one group forwarded as a packed row, against each of its
    samples forwarded alone through stock ``sdpa`` (max and mean absolute difference, nats, within
    ``PACKED_TOLERANCE`` of the weights' dtype: 0.25 / 0.05 in bf16);
  - the step's loss equals the first backend's within 2% (bf16).
- ``first_step_s``: the first fwd+bwd step, kernel compilation included (flex: inductor; flash-attn-4: its CuTe DSL
  kernels, cached on disk from the second run on).
- ``step_s``: median of ``--steps`` steps (on CUDA after two warm-up steps, timed with CUDA events),
  ``trained_tokens_per_s`` (the table's ``tok/s``) the rows' trained tokens over it, ``peak_gib`` its peak memory.

``flex_flash`` (screening, CUDA with flash-attn-4): ``flex`` with ``kernel_options={"BACKEND": "FLASH"}``, torch's
CuTe flash-attention kernel under the same block mask (no gather); a stack that cannot run it is recorded as the
entry's ``error`` and the other backends still run.

Writes ``attention_<shape>[_compiled].json`` (device, versions, the flash kernel's provider and version, one entry per
backend, and when both ran ``flash_over_flex`` = flex's step time / flash's, ``flex_flash_over_flex`` likewise) and
prints a table. On the CPU ``flash`` runs the gather plan
through ``tree_attention.varlen_attention_reference`` (the kernel is CUDA-only): that checks the script, not a kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_packing as bp

from asyncgrpo_cli.train import tree_attention as ta
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.flash_varlen import FlashVarlen
from asyncgrpo_cli.train.packing import pack_row

# packed = unpacked tolerance (max, mean; nats) by the weights' dtype. bf16: at the 1.7B shape on an H200 (28 layers,
# 1,024-token prompts) both kernels differ from stock sdpa alike, flex 0.109-0.115 / 0.026 and flash 0.120-0.125 /
# 0.027 (2026-12-05; the first bound, 0.15 / 0.02 from test_flash_varlen.py's small CPU shape, refused flex itself).
# fp32 (the CPU check) is exact to rounding
PACKED_TOLERANCE = {torch.bfloat16: (0.25, 0.05), torch.float32: (1e-4, 1e-5)}
LOSS_REL = 2e-2


def switch(model, backend: str) -> str:
    """``apply_tree_attention``; on the CPU ``flash`` is switched by hand with the pure-torch kernel. ``flex_flash``:
    ``flex`` with ``kernel_options={"BACKEND": "FLASH"}`` (`tree_attention.FLEX_KERNEL_OPTIONS`): torch's CuTe
    flash-attention kernel under FlexAttention's block mask, no gather (CUDA with flash-attn-4 only)."""
    ta.FLEX_KERNEL_OPTIONS.clear()
    if backend == "flex_flash":
        ta.FLEX_KERNEL_OPTIONS["BACKEND"] = "FLASH"
        return "flex_flash" if ta.apply_tree_attention(model, "flex") == "flex" else backend
    if backend == "flash" and bp.DEVICE != "cuda":
        reference = FlashVarlen(ta.varlen_attention_reference, "reference (pure torch)", None)
        ta.load_flash_varlen = lambda capability=None: reference  # this process only: the bench's CPU check
        ta.register_tree_attention()
        model.set_attn_implementation(ta.IMPLEMENTATION_NAMES["flash"])
        return "flash"
    return ta.apply_tree_attention(model, backend)


def trained_logprobs(model, row) -> torch.Tensor:
    """``[N]`` float32 log-probs of a packed row's trained tokens (full softmax over the vocabulary)."""
    hidden = ta.forward_packed(model, row)
    logits = (hidden[row.predict_index] @ model.lm_head.weight.T).float()
    return torch.log_softmax(logits, -1).gather(1, row.target_ids[:, None])[:, 0]


def unpacked_logprobs(model, samples) -> torch.Tensor:
    """The same tokens, each sample forwarded alone through the model's stock ``sdpa``."""
    out = []
    for s in samples:
        ids = torch.tensor([s.input_ids], device=bp.DEVICE)
        logp = torch.log_softmax(model.plain_forward(input_ids=ids).logits[0].float(), -1)
        out += [logp[t - 1, s.input_ids[t]] for t in range(1, len(s.input_ids)) if s.trained_mask[t]]
    return torch.stack(out)


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if bp.DEVICE == "cuda" else None


def _one_backend(model, backend, rows, cfg, check_row, unpacked, trained, ns, result, first_loss) -> dict:
    """One backend's checks and timing (the module docstring); sets ``result["refused"]`` when a check fails."""
    got = switch(model, backend)
    entry: dict = {"backend": got}
    if got == "flash":
        entry["kernel"] = ta.load_flash_varlen(ta._capability(next(model.parameters()).device)).name
    with torch.no_grad():
        err = (trained_logprobs(model, check_row.to(bp.DEVICE)) - unpacked).abs()
    entry.update(packed_vs_unpacked_max=err.max().item(), packed_vs_unpacked_mean=err.mean().item(),
                 unpacked_std=unpacked.std().item())
    tol_max, tol_mean = PACKED_TOLERANCE[next(model.parameters()).dtype]
    if entry["packed_vs_unpacked_max"] > tol_max or entry["packed_vs_unpacked_mean"] > tol_mean:
        result["refused"] = f"{backend}: packed != unpacked (max {err.max().item():.3g}, mean {err.mean().item():.3g})"
        return entry
    step = bp.packed_step(model, rows, cfg)
    if bp.DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = step()
    bp.sync()
    entry.update(first_step_s=time.perf_counter() - start, loss=loss)
    anchor = loss if first_loss is None else first_loss
    if abs(loss - anchor) > LOSS_REL * max(1.0, abs(anchor)):
        result["refused"] = f"{backend}: loss {loss} != {anchor} of {ns.backends.split(',')[0]}"
        return entry
    median, best = bp.time_fn(step, ns.steps)
    entry.update(step_s=median, step_min_s=best, trained_tokens_per_s=trained / median, peak_gib=peak_gib())
    return entry


def run(ns) -> dict:
    bp.configure(ns.device, ns.shape)
    completion, prompt_ratio, groups, budget = bp.WORKLOAD_DEFAULTS.get(ns.shape, bp.FULL_WORKLOAD)
    prompt = int(completion * prompt_ratio)
    samples = bp.make_samples(groups, 8, completion, prompt, True, seed=1, spread=ns.completion_spread)
    rows = [pack_row(p.rows[0]) for p in TokenBudgetBatcher(budget, 1).plan(samples)]
    check_group = samples[:8]
    check_row = pack_row(check_group)
    model, _ = bp.setup_model(ns.shape, backend="sdpa", compile=ns.compile)
    cfg = bp.loss_config(ns.compile, score_centering=False)
    trained = sum(r.num_trained_tokens for r in rows)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        unpacked = unpacked_logprobs(model, check_group)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result = dict(bp.run_meta(ns.shape), target=f"flash faster than flex on the same rows; packed = unpacked ({dtype})",
                  weights_dtype=dtype,
                  G=8, completion=completion, prompt=prompt, groups=groups, token_budget=budget, steps=ns.steps,
                  completion_spread=ns.completion_spread, torch_compile=ns.compile, rows=len(rows),
                  forwarded_tokens=sum(r.num_tokens for r in rows), trained_tokens=trained,
                  packing_ratio=sum(s.num_tokens for s in samples) / sum(r.num_tokens for r in rows), backends={})
    first_loss = None
    for backend in ns.backends.split(","):
        try:
            entry = _one_backend(model, backend, rows, cfg, check_row, unpacked, trained, ns, result, first_loss)
        except Exception as exc:  # noqa: BLE001 - a screened kernel this stack cannot run is recorded; others still run
            if backend != "flex_flash":
                raise
            result["backends"][backend] = {"backend": backend, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        result["backends"][backend] = entry
        if "refused" in result:
            return result
        first_loss = entry["loss"] if first_loss is None else first_loss
    ta.FLEX_KERNEL_OPTIONS.clear()
    b = result["backends"]
    if "flex" in b and "flash" in b:
        result["flash_over_flex"] = b["flex"]["step_s"] / b["flash"]["step_s"]
    if "step_s" in b.get("flex", {}) and "step_s" in b.get("flex_flash", {}):
        result["flex_flash_over_flex"] = b["flex"]["step_s"] / b["flex_flash"]["step_s"]
    return result


def table(result: dict) -> str:
    lines = [f"{'backend':8} {'kernel':36} {'first s':>8} {'step s':>8} {'tok/s':>9} {'peak GiB':>9} {'packed err':>11}"]
    for name, e in result["backends"].items():
        if "error" in e:
            lines.append(f"{name:8} could not run: {e['error'][:200]}")
            continue
        peak = f"{e['peak_gib']:.2f}" if e.get("peak_gib") is not None else "n/a"
        lines.append(f"{name:8} {e.get('kernel', '-')[:36]:36} {e.get('first_step_s', float('nan')):8.2f} "
                     f"{e.get('step_s', float('nan')):8.3f} {e.get('trained_tokens_per_s', float('nan')):9.0f} "
                     f"{peak:>9} {e['packed_vs_unpacked_max']:11.4f}")
    if "flash_over_flex" in result:
        lines.append(f"flash over flex: {result['flash_over_flex']:.2f}x")
    if "flex_flash_over_flex" in result:
        lines.append(f"flex_flash over flex: {result['flex_flash_over_flex']:.2f}x")
    if "refused" in result:
        lines.append(f"REFUSED: {result['refused']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(bp.SHAPES))
    ap.add_argument("--backends", default=None,
                    help="comma-separated, the first is the loss anchor (default flex,flash on CUDA, sdpa,flash on a "
                         "CPU; flex_flash: flex with torch's CuTe flash kernel, CUDA with flash-attn-4)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--completion-spread", type=float, default=0.5)
    ap.add_argument("--compile", action="store_true", help="regional compile of the decoder layers and loss tiles")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=str(bp.ROOT / "scripts" / "bench" / "results"))
    ns = ap.parse_args(argv)
    if ns.backends is None:
        ns.backends = "flex,flash" if ns.device == "cuda" else "sdpa,flash"
    result = run(ns)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"attention_{ns.shape}{'_compiled' if ns.compile else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"-> {path}")
    return 1 if "refused" in result else 0


if __name__ == "__main__":
    sys.exit(main())
