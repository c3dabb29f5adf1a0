"""E1t of issue #43: the one-GPU recipe's trainer step, fwd+bwd of a 16K forwarded-token row of the 135M arith job.

    python scripts/bench/bench_small.py --out scripts/bench/results              # SmolLM2-135M shape, the job's rows
    python scripts/bench/bench_small.py --compile --out scripts/bench/results    # trainer.torch_compile=true
    python scripts/bench/bench_small.py --device cpu --shape tiny --out /tmp/benchout   # checks the script only
    python scripts/bench/bench_small.py --pack-only --device cpu --label NAME --out DIR   # pack_row alone, host

The model: ``recipes/arith_vllm_1gpu.yaml`` trains SmolLM2-135M-Instruct (``bench_packing.SHAPES["smollm2-135m"]``,
a Llama: hidden 576, 30 layers, 9 query / 3 KV heads of 64, intermediate 1536, vocabulary 49,152, tied embeddings,
rope theta 100,000), here with random weights. As the recipe trains it: the weights in fp32 (``model.dtype:
float32``) with the forward under bf16 autocast (``trainer.bf16: true``: accelerate's mixed precision wraps the
forward; ``--precision bf16`` loads bf16 weights instead), activation checkpointing off, tree attention (flex on
CUDA), the loss inside the forward (score centering, the default objective), one row a step.

The rows, built by the product's ``TokenBudgetBatcher`` (``packing.token_budget=16384``,
``packing.max_groups_per_step=64``) from GRPO groups of 8 completions shaped like the job's (token counts from the
exported model's tokenizer and chat template): a 42-token prompt of which the first 29 (chat template and system
prompt) are the same in every group, completions starting with the 4 tokens of ``The answer is``:

- ``early``: completions of ~42 tokens (21-63), all different: 49 groups fill the 16K tokens (the job's first
  steps hold 46-51 groups of ~40-token completions). Its time is **E1t**, ``fwd_bwd_s`` (target: 0.35 s or less on an idle H200).
- ``late``: completions of ~10 tokens (7-13), 80% of a group's completions repeating an earlier one (late in the
  run a group's answers are mostly identical): the step closes at 64 groups, far below 16K tokens.
- ``late_full``: the same completions without the group bound, 16K tokens of several hundred groups (the step the
  job took before issue #41's bound; many tiny segments).

A step is what the trainer's loop times as ``perf/fwd_bwd_s``: ``pack_row`` of the plan's row, ``row_loss``,
``backward`` and the one read of the losses and metrics after it (``bench_packing.packed_step(..., as_trainer=True)``;
NOTES_host_syncs.md), timed with CUDA
events after warm-up, median of ``--steps``. ``mfu_as_logged`` is ``perf/fwd_bwd_mfu``'s formula
(``asyncgrpo_cli.train.perf``). Each row also records the benchmark's threads' CPU seconds and run-queue wait per step (``cpu_s_per_step``,
``cpu_wait_s_per_step``, as the trainer's ``perf/fwd_bwd_cpu_*``) and the machine's busy share while it ran
(``host_cpu_busy_frac``). Writes ``E1t_<shape>[_bf16][_compiled][_<label>].json`` and prints a table. ``--profile DIR``
writes the bucketed torch.profiler tables of the early row (``bench_packing.profile_variant``).

``--pack-only`` times the host half alone: ``pack_row`` of each row, median of ``--steps`` calls, no model and no
GPU; it writes ``E1t_pack_<shape>[_<label>].json`` (run one code tree, then another, on one machine to compare).

Imports: torch, transformers, ``asyncgrpo_cli.train`` and ``bench_packing`` only (no hydra/omegaconf/datasets).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_packing as bp

from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.host_load import read_host_cpu
from asyncgrpo_cli.train.host_time import ThreadTimes, host_time_metrics
from asyncgrpo_cli.train.perf import PEAK_BF16_FLOPS, step_flops

TARGET_S = 0.35
RECIPE = "recipes/arith_vllm_1gpu.yaml"
G = 8
# Per shape: token budget, group bound, prompt tokens, of them shared by every group, completion tokens every
# completion starts with. SmolLM2's tokenizer: the chat template with the recipe's system prompt and a
# basic_arithmetic question is 41-45 tokens (29 of them the same for every question); "The answer is 7." is 6.
JOB = {"full": dict(budget=16384, max_groups=64, prompt=42, common=29, completion_common=4),
       "tiny": dict(budget=512, max_groups=4, prompt=12, common=8, completion_common=2)}
# Row kind -> (completion mean, spread, duplicates, bounded by max_groups, groups generated) per size.
ROWS = {"full": {"early": (42, 0.5, 0.0, True, 96), "late": (10, 0.3, 0.8, True, 96),
                 "late_full": (10, 0.3, 0.8, False, 1200)},
        "tiny": {"early": (8, 0.5, 0.0, True, 16), "late": (4, 0.3, 0.8, True, 16),
                 "late_full": (4, 0.3, 0.8, False, 64)}}


def job_row(kind: str, size: str = "full", seed: int = 1) -> list:
    """The samples of one step's row of ``kind`` (`ROWS`), as the trainer's batcher plans it (module docstring).

    Raises:
        ValueError: unknown ``kind`` or ``size``; the generated groups did not fill the row (it must close on the
            budget or the group bound, as a job's step does).
    """
    if size not in JOB or kind not in ROWS[size]:
        raise ValueError(f"row {kind!r} of size {size!r}: use one of {sorted(ROWS['full'])} and size full or tiny")
    job = JOB[size]
    completion, spread, duplicates, bounded, groups = ROWS[size][kind]
    samples = bp.make_samples(groups, G, completion, job["prompt"], True, seed=seed, spread=spread,
                              common=job["common"], duplicates=duplicates, completion_common=job["completion_common"])
    plans = TokenBudgetBatcher(job["budget"], 1, job["max_groups"] if bounded else None).plan(samples)
    if len(plans) < 2:
        raise ValueError(f"{groups} groups did not fill one {kind} row; generate more")
    return plans[0].rows[0]


def row_stats(samples: list) -> dict:
    """What a row holds: groups, samples, forwarded / trained / sample tokens, repeated completions."""
    row = pack_row(samples)
    per_group: dict[int, list] = {}
    for s in samples:
        per_group.setdefault(s.group_id, []).append(tuple(s.input_ids))
    repeats = sum(len(v) - len(set(v)) for v in per_group.values())
    return dict(groups=len(per_group), samples=len(samples), forwarded_tokens=row.num_tokens,
                trained_tokens=row.num_trained_tokens, sample_tokens=row.sample_tokens,
                packing_ratio=row.sample_tokens / row.num_tokens, repeated_completions=repeats / len(samples),
                mean_completion=row.num_trained_tokens / len(samples), segments=row.num_segments)


def peak_flops() -> float | None:
    """The device's bf16 peak as the trainer's ``perf/fwd_bwd_mfu`` takes it (None on a CPU or an unlisted GPU)."""
    if bp.DEVICE != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def pack_seconds(samples: list, repeats: int = 5) -> float:
    """Median host seconds of ``pack_row`` of the row (inside the trainer's timed step)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        pack_row(samples)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pack_only(ns: argparse.Namespace, size: str, kinds: list[str]) -> int:
    """``--pack-only``: ``pack_row`` seconds per row kind (median of ``ns.steps`` calls) to
    ``E1t_pack_<shape>[_<label>].json``; the git commit of the tree that ran is in the file."""
    import subprocess

    figures = {}
    for kind in kinds:
        samples = job_row(kind, size)
        pack_row(samples)  # warm-up
        figures[kind] = dict(**row_stats(samples), pack_row_s=pack_seconds(samples, max(ns.steps, 3)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bp.ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "asyncgrpo_cli"], cwd=bp.ROOT,
                                capture_output=True, text=True).stdout.strip())
    result = dict(bp.run_meta(ns.shape), target_id="E1t_pack", label=ns.label or None, commit=commit,
                  uncommitted_changes=dirty, steps=max(ns.steps, 3), timing="perf_counter, median",
                  command=" ".join(sys.argv), figures=figures,
                  pack_row_s={k: v["pack_row_s"] for k, v in figures.items()})
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"E1t_pack_{ns.shape}{'_' + ns.label if ns.label else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    for kind, f in figures.items():
        print(f"{kind:10} {f['groups']:6} groups {f['forwarded_tokens']:7} fwd tokens {f['segments']:5} segments "
              f"pack_row {f['pack_row_s'] * 1e3:7.1f} ms")
    print(f"-> {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(bp.SHAPES))
    ap.add_argument("--rows", default="early,late,late_full", help="row kinds to time, comma-separated (default all)")
    ap.add_argument("--precision", default="autocast", choices=("autocast", "bf16"),
                    help="autocast: fp32 weights, bf16 autocast forward (the recipe's); bf16: bf16 weights")
    ap.add_argument("--activation-checkpointing", action="store_true", help="turn it on (the recipe has it off)")
    ap.add_argument("--attention", default="auto", choices=("auto", "flex", "sdpa", "flash"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(bp.ROOT / "scripts" / "bench" / "results"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda, or cpu to check the script")
    ap.add_argument("--pack-only", action="store_true", help="time pack_row of each row alone (host; no model)")
    ap.add_argument("--label", default="", help="a name for the run, in the file name (--pack-only: the code tree)")
    bp.add_profile_args(ap)
    ns = ap.parse_args()
    bp.configure(ns.device, ns.shape)
    size = "tiny" if ns.shape == "tiny" else "full"
    kinds = [k for k in ns.rows.split(",") if k]
    if ns.pack_only:
        return pack_only(ns, size, kinds)
    if "early" not in kinds:
        sys.exit(f"--rows {ns.rows}: the early row is E1t's figure; keep it")
    # --precision on a CPU: fp32 weights either way (as the other benches), bf16 autocast only with "autocast"
    weights = torch.float32 if ns.precision == "autocast" or ns.device == "cpu" else torch.bfloat16
    autocast = torch.bfloat16 if ns.precision == "autocast" else None
    model, backend = bp.setup_model(ns.shape, ns.attention, ns.activation_checkpointing, compile=ns.compile,
                                    dtype=weights)
    if ns.profile:
        bp.install_markers(model)
    cfg = bp.loss_config(ns.compile, score_centering=True)
    peak = peak_flops()
    rows, figures, steps = {}, {}, {}
    for kind in kinds:
        samples = job_row(kind, size)
        rows[kind] = row_stats(samples)
        step = steps[kind] = bp.packed_step(model, [samples], cfg, as_trainer=True, autocast=autocast)
        loss = step()
        if not math.isfinite(loss):
            sys.exit(f"E1t: the {kind} row's loss is {loss}; not timing a broken step")
        bp.sync()
        if ns.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        warmup = 2 if ns.device == "cuda" else 0  # bp.time_fn's warm-up steps (none on a CPU)
        threads0, host0 = ThreadTimes.read(), read_host_cpu()
        t_med, t_min = bp.time_fn(step, ns.steps, warmup)
        host_times = host_time_metrics(threads0, ThreadTimes.read())  # this process's threads, all timed steps
        host1 = read_host_cpu()
        flops = step_flops(model, pack_row(samples))
        figures[kind] = dict(
            fwd_bwd_s=t_med, fwd_bwd_min_s=t_min, pack_row_s=pack_seconds(samples),
            forwarded_tokens_per_s=rows[kind]["forwarded_tokens"] / t_med,
            trained_tokens_per_s=rows[kind]["trained_tokens"] / t_med, model_flops=flops,
            mfu_as_logged=flops / t_med / peak if peak else None, loss=loss,
            peak_memory_allocated_bytes=torch.cuda.max_memory_allocated() if ns.device == "cuda" else None,
            # per step, as the trainer logs perf/fwd_bwd_cpu_s and perf/fwd_bwd_cpu_wait_s (warm-up steps included)
            **{k.replace("perf/fwd_bwd_", "") + "_per_step": v / (ns.steps + warmup) for k, v in host_times.items()},
            host_cpu_busy_frac=(round((host1[0] - host0[0]) / (host1[1] - host0[1]), 4)
                                if host0 and host1 and host1[1] > host0[1] else None))
    early = figures["early"]["fwd_bwd_s"]
    suffix = "_bf16" if ns.precision == "bf16" else ""
    result = dict(
        bp.run_meta(ns.shape), target_id="E1t", recipe=RECIPE, precision=ns.precision,
        weights_dtype=str(weights).replace("torch.", ""), autocast_dtype=str(autocast).replace("torch.", "") if autocast else None,
        attention=backend, activation_checkpointing=ns.activation_checkpointing, torch_compile=ns.compile,
        objective="centering", vocab=bp.VOCAB, parameters=sum(p.numel() for p in model.parameters()),
        steps=ns.steps, timing="CUDA events, median after 2 warm-up steps" if ns.device == "cuda" else "perf_counter",
        workload=dict(G=G, **JOB[size], rows={k: dict(zip(("completion", "spread", "duplicates", "group_bound",
                                                          "groups_generated"), ROWS[size][k]), **rows[k])
                                              for k in kinds}),
        figures=figures, fwd_bwd_s=early, fwd_bwd_s_per_row={k: v["fwd_bwd_s"] for k, v in figures.items()},
        target=f"fwd_bwd_s (early row) <= {TARGET_S} on an idle H200", target_s=TARGET_S, met=early <= TARGET_S,
        ratio=TARGET_S / early)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / bp.result_name("E1t", ns.shape + suffix, ns.compile)
    if ns.label:  # e.g. the GPU shared with a vLLM server (scripts/gpu/vllm033/e1t_shared.py)
        path = path.with_name(f"{path.stem}_{ns.label}.json")
    path.write_text(json.dumps(result, indent=1))
    if ns.profile:
        bp.profile_variant(steps["early"], f"{ns.shape}{suffix}_E1t_early{'_compiled' * ns.compile}", Path(ns.profile),
                           ns.profile_steps, ns.trace)
    print(f"{'row':10} {'groups':>6} {'fwd tok':>8} {'trained':>8} {'fwd+bwd ms':>11} {'min ms':>8} {'pack ms':>8} "
          f"{'fwd tok/s':>10} {'MFU (as logged)':>16}")
    for kind, f in figures.items():
        r = rows[kind]
        mfu = f"{f['mfu_as_logged'] * 100:.2f}%" if f["mfu_as_logged"] is not None else "n/a"
        print(f"{kind:10} {r['groups']:6} {r['forwarded_tokens']:8} {r['trained_tokens']:8} {f['fwd_bwd_s'] * 1e3:11.1f} "
              f"{f['fwd_bwd_min_s'] * 1e3:8.1f} {f['pack_row_s'] * 1e3:8.1f} {f['forwarded_tokens_per_s']:10.0f} {mfu:>16}")
    print(f"E1t fwd_bwd_s {early:.3f} s (target <= {TARGET_S} s: {'met' if early <= TARGET_S else 'missed'}; "
          f"{ns.precision}, {'compiled' if ns.compile else 'eager'}) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
