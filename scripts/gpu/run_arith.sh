#!/usr/bin/env bash
# The main job on a lent 2-GPU machine: `asyncgrpo train +recipe=arith` (embedded sampler on GPU 0, trainer on
# GPU 1), after scripts/gpu/stage.sh. Results (metrics.jsonl, status.json, training_curves.png, log tails and a
# summary JSON) go to $OUT (or ./gpu_out).
set -uo pipefail
SITE="${ASYNCGRPO_SITE:-/tmp/asyncgrpo_site}"
OUT="${OUT:-$PWD/gpu_out}"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" ASYNCGRPO_CACHE=/tmp/asyncgrpo_cache PYTHONUNBUFFERED=1
run=/tmp/asyncgrpo_arith
rm -rf "$run"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
timeout "${RUN_TIMEOUT_S:-480}" python3 -m asyncgrpo_cli train +recipe=arith logging.dashboard=plain \
  trainer.output_dir="$run" "$@" 2>&1 | tee "$OUT/train_stdout.txt"
status=${PIPESTATUS[0]}
for f in metrics.jsonl status.json training_curves.png; do [ -f "$run/$f" ] && cp "$run/$f" "$OUT/"; done
for f in server trainer; do [ -f "$run/logs/$f.log" ] && tail -n 200 "$run/logs/$f.log" > "$OUT/${f}_log_tail.txt"; done
python3 - "$run/metrics.jsonl" "$OUT/summary.json" "$status" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
def series(k): return [r[k] for r in rows if r.get(k) is not None]
def mean(xs): return statistics.fmean(xs) if xs else None
rw = series("reward")
out = {"exit_status": int(sys.argv[3]), "logged_windows": len(rows), "last_step": rows[-1]["step"] if rows else None,
       "reward_first_windows": mean(rw[:3]), "reward_last_windows": mean(rw[-3:]),
       "generated_tokens_per_s": mean(series("rollout/generated_tokens_per_s")),
       "fwd_bwd_forwarded_tokens_per_s": mean(series("perf/fwd_bwd_forwarded_tokens_per_s")),
       "wall_clock_trained_tokens_per_s": mean(series("perf/wall_clock_trained_tokens_per_s")),
       "step_s": mean(series("perf/step_s")), "weight_sync_s": mean(series("perf/weight_sync_s")),
       "packing_ratio": mean(series("batch/packing_ratio")), "rollout_wait_s": mean(series("perf/rollout_wait_s")),
       "backpressure_s": mean(series("rollout/backpressure_s")), "mfu": mean(series("perf/fwd_bwd_mfu"))}
json.dump(out, open(sys.argv[2], "w"), indent=1); print(json.dumps(out, indent=1))
PY
exit $status
