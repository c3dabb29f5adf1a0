"""Host-side cost of one packed row's fwd+bwd: where a tree-packed step stops being GPU-bound.

    python scripts/bench/bench_host.py --shape qwen3-0.6b --out scripts/bench/results
    python scripts/bench/bench_host.py --device cpu --shape tiny --out /tmp/benchout      # checks the script

For rows of ``--lengths`` forwarded tokens (one GRPO group of G = 8 each, prompt 4× the completion), it times the
product's fwd+bwd of one row (``bench_packing.packed_step``) eagerly, then with ``trainer.torch_compile=true``'s
regional compile, and records for each the median step time next to the main thread's CPU time of the same steps
(``time.thread_time``; the backward's Python, checkpoint recomputation included, runs on autograd's device
thread and is not in it). A short row's step time is all host cost: Python, dynamo guards, kernel launches and
device syncs. When it approaches the GPU time of a long row, the GPU waits on the host (the NOTES.md section of
2026-11-30 explains why the 0.6B P1 step does).

Writes ``host_<shape>.json`` and prints a table. Imports torch, transformers and the product's train package only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_packing as bp

from asyncgrpo_cli.train.compile import compile_decoder_layers
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.packing import pack_row


def row_of(forwarded: int) -> object:
    """One tree-packed row of a G = 8 group with about ``forwarded`` tokens (prompt = 4 × completion)."""
    completion = max(1, round(forwarded / 12))  # prompt 4c + 8 completions of c ≈ 12c
    samples = bp.make_samples(1, 8, completion, 4 * completion, True, seed=forwarded)
    return pack_row(TokenBudgetBatcher(10**7, 1).plan(samples)[0].rows[0])


def time_row(model, row, cfg, steps: int) -> dict[str, float]:
    """Median wall seconds per step (after two warm-ups, synchronised) and the main thread's CPU seconds."""
    step = bp.packed_step(model, [row], cfg)
    for _ in range(2):
        step()
    bp.sync()
    walls, cpus = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        step()
        bp.sync()
        walls.append(time.perf_counter() - t)
        cpus.append(time.thread_time() - c)
    return {"step_s": statistics.median(walls), "main_thread_cpu_s": statistics.median(cpus)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(bp.SHAPES))
    ap.add_argument("--lengths", default=None, help="comma-separated forwarded tokens per row (default 384,1536,9216)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(bp.ROOT / "scripts" / "bench" / "results"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ns = ap.parse_args()
    bp.configure(ns.device, ns.shape)
    lengths = [int(x) for x in (ns.lengths or ("384,1536,9216" if ns.device == "cuda" else "96,384")).split(",")]
    rows = [row_of(n) for n in lengths]
    model, backend = bp.setup_model(ns.shape)
    results: dict[str, dict] = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            compile_decoder_layers(model)
        cfg = bp.loss_config(mode == "compiled", score_centering=False)
        results[mode] = {str(r.num_tokens): time_row(model, r, cfg, ns.steps) for r in rows}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(bp.run_meta(ns.shape), attention=backend, steps=ns.steps, row_tokens=[r.num_tokens for r in rows],
                  trained_tokens=[r.num_trained_tokens for r in rows], per_row=results)
    path = out / f"host_{ns.shape}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{'mode':9} {'row tokens':>10} {'step ms':>9} {'main-thread CPU ms':>19}")
    for mode, per in results.items():
        for tokens, r in per.items():
            print(f"{mode:9} {tokens:>10} {r['step_s'] * 1e3:9.1f} {r['main_thread_cpu_s'] * 1e3:19.1f}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
