#!/usr/bin/env bash
# Issue #43 item 4: the `flash` tree-attention backend through flash-attn-4 (CuTe DSL) on a CUDA GPU (Hopper or newer).
#   test:  the CUDA tests of tests/train/test_flash_varlen.py (packed = unpacked in bf16 through the real kernel,
#          gradients against the sdpa tree path) and tests/train/test_tree_attention.py's
#   bench: scripts/bench/bench_attention.py, flex against flash on P1's rows, Qwen3-1.7B shape, eager then compiled
#   flex_flash: the same rows compiled, flex's Triton kernel against flex under torch's CuTe flash kernel
#          (kernel_options BACKEND=FLASH: the tree's block mask, no gather; screening for issue #43, ~3-5 min)
#
# On a GPU machine with network: pip install flash-attn-4 (into the environment that has torch and this project),
# then `bash scripts/gpu/run_flash.sh test` and `bash scripts/gpu/run_flash.sh bench`; nothing needs staging.
#
# On the lent H200 (no network; Python 3.12 with the image's torch, no vLLM) the wheels travel, cp312 builds of the
# same versions as the vLLM 0.33 stage holds (nvidia-cutlass-dsl 4.8.0, quack-kernels 0.6.5, apache-tvm-ffi 0.1.11):
# Here (a machine that reaches PyPI), once:   bash scripts/gpu/run_flash.sh prepare
#   -> .whl_fa4/core (flash-attn-4 and the small wheels, 17 MB), .whl_fa4/cu13a and .whl_fa4/cu13b (the CUTLASS DSL's
#      CUDA 13 library, a 92 MB wheel cut in two 46 MB pieces: a call carries 64 MiB with the working tree)
# There, three calls back to back on one warm machine (it is given back 30 s after a call; send them in ONE message):
#   carry [".whl_fa4/core"]    bash scripts/gpu/run_flash.sh stage
#   carry [".whl_fa4/cu13a"]   bash scripts/gpu/run_flash.sh stage
#   carry [".whl_fa4/cu13b"]   bash scripts/gpu/run_flash.sh stage && bash scripts/gpu/run_flash.sh test \
#                                && bash scripts/gpu/run_flash.sh bench
# Exit status of stage: 0 staged, 2 still waiting for a piece, 1 failure.
# Results: $OUT/results (default ./bench_out/results); commit the JSON under scripts/bench/results.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE="${ASYNCGRPO_FA4_SITE:-/tmp/asyncgrpo_fa4_site}"
PIECES=/tmp/asyncgrpo_fa4_pieces
OUT="${OUT:-$PWD/bench_out}"
limit="${BENCH_TIMEOUT_S:-560}"
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.0-cp312-cp312-manylinux_2_28_x86_64.whl
CU13_SHA256=463cd7f0c452ffeeecb530a15aeb1b10cbbd2c8da6c5aa2fecf65f836258a732
export PYTHONUNBUFFERED=1

prepare() {
  local plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  local tmp
  tmp=$(mktemp -d) && rm -rf .whl_fa4 && mkdir -p .whl_fa4/core .whl_fa4/cu13a .whl_fa4/cu13b || return 1
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whl_fa4/core flash-attn-4==4.0.0b40 \
    nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 quack-kernels==0.6.5 \
    apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1 \
    protobuf==7.36.2 einops==0.8.2 pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0 pytest-timeout==2.4.0 || return 1
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.0 || return 1
  [ "$(sha256sum "$tmp/$CU13" | cut -d' ' -f1)" = "$CU13_SHA256" ] || { echo "prepare: $CU13 sha256 differs" >&2; return 1; }
  local half=$(( ($(stat -c %s "$tmp/$CU13") + 1) / 2 ))
  split -b "$half" -d -a 1 "$tmp/$CU13" "$tmp/piece."
  mv "$tmp/piece.0" ".whl_fa4/cu13a/$CU13.part0"
  mv "$tmp/piece.1" ".whl_fa4/cu13b/$CU13.part1"
  rm -rf "$tmp"
  du -sh .whl_fa4/*
  echo "prepare: .whl_fa4/ is git-ignored; a call carries 64 MiB with the tracked tree: check" \
       "git ls-files -z | xargs -0 du -cb | tail -1 plus 46 MB"
}

stage() {
  # One pip call for every wheel: `pip install --target --upgrade` replaces a top-level folder a second call
  # brings again, and the CUTLASS DSL's three wheels share nvidia_cutlass_dsl/ (a first try lost base and core).
  mkdir -p "$SITE" "$PIECES/core"
  for piece in .whl_fa4/cu13a/* .whl_fa4/cu13b/*; do
    [ -f "$piece" ] && cp "$piece" "$PIECES/" && echo "stage: received $(basename "$piece")"
  done
  if compgen -G ".whl_fa4/core/*.whl" >/dev/null; then
    cp .whl_fa4/core/*.whl "$PIECES/core/" && echo "stage: received $(ls .whl_fa4/core | wc -l) wheels of core"
  fi
  if [ ! -f "$SITE/.installed" ]; then
    local missing=""
    compgen -G "$PIECES/core/*.whl" >/dev/null || missing="$missing .whl_fa4/core"
    [ -f "$PIECES/$CU13.part0" ] || missing="$missing .whl_fa4/cu13a"
    [ -f "$PIECES/$CU13.part1" ] || missing="$missing .whl_fa4/cu13b"
    if [ -n "$missing" ]; then echo "stage: waiting for$missing (carry it in the next call)"; return 2; fi
    cat "$PIECES/$CU13.part0" "$PIECES/$CU13.part1" > "$PIECES/$CU13"
    [ "$(sha256sum "$PIECES/$CU13" | cut -d' ' -f1)" = "$CU13_SHA256" ] \
      || { rm -rf "$PIECES"; echo "stage: $CU13 is corrupted; re-send core, cu13a and cu13b" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$PIECES"/core/*.whl "$PIECES/$CU13" || { echo "stage: pip could not install the wheels" >&2; return 1; }
    : > "$SITE/.installed"
    echo "stage: installed $(ls "$PIECES"/core/*.whl | wc -l) + 1 wheels into $SITE"
  fi
  python3 - <<'PY'
import importlib.metadata as md

import torch


def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


import flash_attn.cute  # noqa: F401  (imports the CUTLASS DSL: fails here, not in the tests, when a piece is off)

print("run_flash:", ", ".join(f"{n} {v(n)}" for n in ("torch", "triton", "transformers", "flash-attn-4",
                                                       "nvidia-cutlass-dsl-libs-cu13", "quack-kernels",
                                                       "apache-tvm-ffi", "cuda-bindings")))
print("run_flash: GPU", torch.cuda.get_device_name(), torch.cuda.get_device_capability(), flush=True)
PY
}

export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4_cute_cache}"
case "${1:-}" in
  prepare) prepare ;;
  stage) stage ;;
  test) timeout "$limit" python3 -m pytest -q -rs -p no:cacheprovider tests/train/test_flash_varlen.py \
          tests/train/test_tree_attention.py -k "cuda" ;;
  bench) mkdir -p "$OUT/results"
         timeout 280 python3 scripts/bench/bench_attention.py --shape qwen3-1.7b --out "$OUT/results"
         timeout 280 python3 scripts/bench/bench_attention.py --shape qwen3-1.7b --compile --out "$OUT/results" ;;
  # screening: flex under torch's CuTe flash kernel (kernel_options BACKEND=FLASH) against flex's Triton kernel
  flex_flash) mkdir -p "$OUT/results"
         timeout 400 python3 scripts/bench/bench_attention.py --shape qwen3-1.7b --compile --backends flex,flex_flash \
           --out "$OUT/results" ;;
  *) echo "usage: bash scripts/gpu/run_flash.sh prepare|stage|test|bench|flex_flash" >&2; exit 2 ;;
esac
