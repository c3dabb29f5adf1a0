#!/usr/bin/env bash
# Gated DeltaNet tree packing on one CUDA GPU: the CUDA-only tests (bf16 packed vs unpacked on a Qwen3.5-2B shape)
# and the tree-vs-plain benchmark (scripts/bench/bench_gdn.py). The lent machine has no network, so the kernels'
# wheels travel with the command.
#
# Here (a machine that reaches PyPI), once:   bash scripts/gpu/run_gdn.sh prepare
#   -> .whl_gdn/core (fla-core 0.6.0, einops, pytest: ~2 MB, carry it in every call)
#      .whl_gdn/tl1  (tilelang 0.1.15, 49.5 MB) and .whl_gdn/tl2 (its dependencies): optional, one call each.
# There (each call ≤ 10 min; the machine forgets everything once given back, so keep the calls back to back):
#   carry [".whl_gdn/core"]                  bash scripts/gpu/run_gdn.sh test     CUDA tests of tests/train/test_gdn.py
#   carry [".whl_gdn/core"]                  bash scripts/gpu/run_gdn.sh bench    bench_gdn.py (fla kernel)
#   carry [".whl_gdn/core"]                  bash scripts/gpu/run_gdn.sh bench-torch   the same, plain-torch kernel
#   carry [".whl_gdn/core", ".whl_gdn/tl1"]  bash scripts/gpu/run_gdn.sh stage    (tilelang, part 1)
#   carry [".whl_gdn/core", ".whl_gdn/tl2"]  bash scripts/gpu/run_gdn.sh stage && bash scripts/gpu/run_gdn.sh bench
# With Triton < 3.7.1 on Hopper and no tilelang, fla-core refuses its backward: `test` then reports the training
# tests as skipped with that reason, and `bench` writes the refusal into its JSON and exits 3 (the product stops at
# trainer start with the same message). tilelang also needs a CUDA compiler (nvcc) on the machine.
# Results: $OUT/results (default ./bench_out/results); commit the JSON under scripts/bench/results.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE="${ASYNCGRPO_GDN_SITE:-/tmp/asyncgrpo_gdn_site}"
OUT="${OUT:-$PWD/bench_out}"
limit="${BENCH_TIMEOUT_S:-560}"
export PYTHONUNBUFFERED=1

prepare() {
  local plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  rm -rf .whl_gdn && mkdir -p .whl_gdn/core .whl_gdn/tl1 .whl_gdn/tl2
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whl_gdn/core fla-core==0.6.0 einops==0.8.1 pytest==8.4.2 \
    pluggy==1.6.0 iniconfig==2.1.0 pytest-timeout==2.4.0 || return 1
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whl_gdn/tl1 tilelang==0.1.15 || return 1
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whl_gdn/tl2 "apache-tvm-ffi>=0.1.11,<0.1.13" \
    torch-c-dlpack-ext "z3-solver>=4.13.0,<4.15.5" "ml-dtypes>=0.5.1" cloudpickle || return 1
  du -sh .whl_gdn/*
}

stage() {
  mkdir -p "$SITE"
  local wheels=()
  for part in core tl1 tl2; do
    compgen -G ".whl_gdn/$part/*.whl" >/dev/null && wheels+=(.whl_gdn/"$part"/*.whl)
  done
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "run_gdn: no wheels carried; run 'bash scripts/gpu/run_gdn.sh prepare' here and carry .whl_gdn/core" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    || { echo "run_gdn: pip could not install ${wheels[*]}" >&2; return 1; }
  PYTHONPATH="$SITE" python3 - <<'PY'
import importlib.metadata as md

import torch


def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


print("run_gdn:", ", ".join(f"{n} {v(n)}" for n in ("torch", "triton", "fla-core", "einops", "tilelang", "transformers")))
print("run_gdn: GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else "none", flush=True)
PY
}

export PYTHONPATH="$SITE:$PWD"
case "${1:-}" in
  prepare) prepare ;;
  stage) stage ;;
  test) stage && timeout "$limit" python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/train/test_gdn.py ;;
  bench) stage && mkdir -p "$OUT/results" && timeout "$limit" python3 scripts/bench/bench_gdn.py --out "$OUT/results" ;;
  bench-torch) stage && mkdir -p "$OUT/results" && ASYNCGRPO_GDN_KERNEL=torch timeout "$limit" \
      python3 scripts/bench/bench_gdn.py --steps 3 --out "$OUT/results/torch_kernel" ;;
  *) echo "usage: bash scripts/gpu/run_gdn.sh prepare|stage|test|bench|bench-torch" >&2; exit 2 ;;
esac
