#!/usr/bin/env bash
# The trainer benchmarks on one CUDA GPU (they need torch and transformers only; no vLLM), one part per call so
# that each fits a 10-minute job. Results go to $OUT/results (JSON per target id), profiles to $OUT/prof;
# $OUT defaults to ./bench_out. The committed figures live in scripts/bench/results (see scripts/bench/NOTES.md).
#   bash scripts/gpu/run_benches.sh p0.6    P1/P2/P4/M1 (tree vs plain packing, vs padded SDPA, memory), Qwen3-0.6B shape
#   bash scripts/gpu/run_benches.sh p1.7    the same, Qwen3-1.7B shape
#   bash scripts/gpu/run_benches.sh p3      P3 (MFU, Qwen3-1.7B shape, 16K-token rows)
#   bash scripts/gpu/run_benches.sh prof    torch.profiler buckets of P1 (0.6B) and P3
#   bash scripts/gpu/run_benches.sh p3c     P3 with trainer.torch_compile=true (--compile), then P3 eager
#   bash scripts/gpu/run_benches.sh p3a     P3 eager as the recipes train (float32 weights, bf16 autocast:
#                                           P3_autocast_*), then with bf16 weights: what float32 weights cost
#   bash scripts/gpu/run_benches.sh p3e     P3 compiled with every 2nd, then every 4th layer checkpointed
#                                           (trainer.activation_checkpointing_kwargs.every_n_layers; P3_every<N>_*)
#   bash scripts/gpu/run_benches.sh p0.6c   P1/P2/P4/M1 at 0.6B with --compile (the padded baseline stays eager)
#   bash scripts/gpu/run_benches.sh p1.7c   P1/P2/P4/M1 at 1.7B with --compile
#   bash scripts/gpu/run_benches.sh profc   profiles of the compiled P1 (0.6B) and P3
#   bash scripts/gpu/run_benches.sh host    host (CPU) cost of one row's fwd+bwd, eager and compiled (bench_host.py)
#   bash scripts/gpu/run_benches.sh e1t     E1t: the one-GPU recipe's step (SmolLM2-135M, its 16K-token early row, late
#                                           rows), eager, compiled and with bf16 weights (bench_small.py)
#   bash scripts/gpu/run_benches.sh e1tprof profiles of E1t's early row, eager and compiled (its JSON in $OUT/prof)
#   bash scripts/gpu/run_benches.sh router  the sampler.engines router's CPU per request (bench_router.py; no GPU used)
# Compiled results are written beside the eager ones as <id>_<shape>_compiled.json. The rollout worker's ingest
# benchmark (P6) needs no GPU: python scripts/bench/bench_worker_ingest.py.
set -uo pipefail
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT/results" "$OUT/prof"
export PYTHONUNBUFFERED=1
limit="${BENCH_TIMEOUT_S:-560}"
case "${1:-}" in
  p0.6) timeout "$limit" python3 scripts/bench/bench_packing.py --shape qwen3-0.6b --out "$OUT/results" ;;
  p1.7) timeout "$limit" python3 scripts/bench/bench_packing.py --shape qwen3-1.7b --out "$OUT/results" ;;
  p3)   timeout "$limit" python3 scripts/bench/bench_mfu.py --out "$OUT/results" ;;
  prof) timeout "$limit" python3 scripts/bench/bench_packing.py --shape qwen3-0.6b --steps 4 --out "$OUT/results" \
          --profile "$OUT/prof" && timeout "$limit" python3 scripts/bench/bench_mfu.py --steps 4 --out "$OUT/results" \
          --profile "$OUT/prof" ;;
  p3c)  timeout 320 python3 scripts/bench/bench_mfu.py --compile --out "$OUT/results"
        timeout 220 python3 scripts/bench/bench_mfu.py --out "$OUT/results" ;;
  p3a)  timeout 170 python3 scripts/bench/bench_mfu.py --precision autocast --steps 5 --out "$OUT/results"
        timeout 150 python3 scripts/bench/bench_mfu.py --steps 5 --out "$OUT/results" ;;
  p3e)  timeout 280 python3 scripts/bench/bench_mfu.py --compile --every-n-layers 2 --out "$OUT/results"
        timeout 260 python3 scripts/bench/bench_mfu.py --compile --every-n-layers 4 --out "$OUT/results" ;;
  p0.6c) timeout "$limit" python3 scripts/bench/bench_packing.py --shape qwen3-0.6b --compile --out "$OUT/results" ;;
  p1.7c) timeout "$limit" python3 scripts/bench/bench_packing.py --shape qwen3-1.7b --compile --out "$OUT/results" ;;
  profc) timeout 300 python3 scripts/bench/bench_packing.py --shape qwen3-0.6b --compile --steps 4 --out "$OUT/results" \
          --profile "$OUT/prof"; timeout 250 python3 scripts/bench/bench_mfu.py --compile --steps 4 \
          --out "$OUT/results" --profile "$OUT/prof" ;;
  host)  timeout "$limit" python3 scripts/bench/bench_host.py --out "$OUT/results" ;;
  e1t)   timeout 150 python3 scripts/bench/bench_small.py --out "$OUT/results"
         timeout 270 python3 scripts/bench/bench_small.py --compile --out "$OUT/results"
         timeout 120 python3 scripts/bench/bench_small.py --precision bf16 --out "$OUT/results" ;;
  e1tprof) timeout 200 python3 scripts/bench/bench_small.py --rows early --steps 4 --out "$OUT/prof" \
          --profile "$OUT/prof"; timeout 300 python3 scripts/bench/bench_small.py --rows early --compile --steps 4 \
          --out "$OUT/prof" --profile "$OUT/prof" ;;
  router) timeout 120 python3 scripts/bench/bench_router.py --out "$OUT/results" ;;
  *) echo "usage: bash scripts/gpu/run_benches.sh p0.6|p1.7|p3|prof|p3c|p3a|p3e|p0.6c|p1.7c|profc|host|e1t|e1tprof|router" >&2; exit 2 ;;
esac
