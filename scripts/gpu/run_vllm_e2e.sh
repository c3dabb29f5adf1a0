#!/usr/bin/env bash
# Real vLLM 0.26 and the trainer together on a lent 2-GPU machine, through `asyncgrpo` (scripts/gpu/vllm_e2e.py).
#
# Here, once: python3 ../shared/device/build_parts.py . (vLLM parts in .stage/), cp ../shared/device/install_on_device.sh
# .stage/, and bash scripts/gpu/prepare.sh (.whl/, .gguf/). There, back to back on the same warm machine:
#   calls 1-7: carry [".stage/install_on_device.sh", ".stage/pNN"]            command: bash .stage/install_on_device.sh
#   call 8:    carry [".stage/install_on_device.sh", ".stage/p08", ".whl"]    command: bash .stage/install_on_device.sh; bash scripts/gpu/stage.sh
#   call 9:    carry [".gguf/p0"]                                             command: bash scripts/gpu/stage.sh
#   call 10:   carry [".gguf/p1"]                                             command: bash scripts/gpu/run_vllm_e2e.sh
# Results go to $OUT: vllm_e2e.json, train.txt, metrics.jsonl, training_curves.png, and extras.tgz (conformance and
# doctor outputs, logs, the server-load samples: the device returns only a handful of files per call).
# Extra arguments are Hydra overrides; E2E_SKIP_CHECKS=1 trains only; TRAIN_TIMEOUT_S bounds the training.
set -uo pipefail
SITE="${ASYNCGRPO_SITE:-/tmp/asyncgrpo_site}"
VSITE="${VSITE:-/tmp/vsite}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
if [ ! -f "$VSITE/vllm/__init__.py" ]; then
  echo "run_vllm_e2e: vLLM is not staged in $VSITE on this machine (it forgets everything once given back)."
  [ -d /tmp/vstage ] && ls /tmp/vstage/.ok 2>/dev/null | sed 's/^/  part received: /'
  echo "  re-send the parts bash .stage/install_on_device.sh lists as missing (carry .stage/install_on_device.sh with each)"
  exit 1
fi
bash scripts/gpu/stage.sh || exit $?   # our wheels and the SmolLM2 GGUF: says which piece to re-send
export PYTHONPATH="$SITE:$VSITE:$VSITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ASYNCGRPO_CACHE=/tmp/asyncgrpo_cache PYTHONUNBUFFERED=1 OUT
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
python3 scripts/gpu/vllm_e2e.py "$@"
status=$?
(cd "$OUT" && tar czf extras.tgz --remove-files $(ls | grep -vE '^(vllm_e2e.json|train.txt|metrics.jsonl|training_curves.png)$'))
exit $status
