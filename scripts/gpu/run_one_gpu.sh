#!/usr/bin/env bash
# One GPU, real vLLM 0.26 started by `asyncgrpo train` (scripts/gpu/one_gpu.py); staging: scripts/gpu/stage_one_gpu.sh.
#   bash scripts/gpu/run_one_gpu.sh train   # Ctrl-C run + resumed run to the end (~8 min)
#   bash scripts/gpu/run_one_gpu.sh bench   # Qwen3-0.6B-shaped IPC sync timings + the embedded-sampler run (~5 min)
# Results go to $OUT: one_gpu_<phase>.json, the captured panels, metrics.jsonl, logs_<phase>.tgz.
set -uo pipefail
SITE="${ASYNCGRPO_SITE:-/tmp/asyncgrpo_site}"
VSITE="${VSITE:-/tmp/vsite}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
if [ ! -f "$VSITE/vllm/__init__.py" ] || [ ! -d "$SITE/ray" ]; then
  echo "run_one_gpu: vLLM or ray is not staged on this machine (it forgets everything once given back):"
  echo "  see scripts/gpu/stage_one_gpu.sh"; exit 1
fi
export PYTHONPATH="$SITE:$VSITE:$VSITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ASYNCGRPO_CACHE=/tmp/asyncgrpo_cache PYTHONUNBUFFERED=1 OUT
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 scripts/gpu/one_gpu.py "${1:-train}"
