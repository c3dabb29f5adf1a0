#!/usr/bin/env bash
# Issue #43 item 1: the trainer micro-benchmarks at c041d6b (.base43/, git-ignored: its asyncgrpo_cli/ and
# scripts/bench/) and at main, back to back on one lent H200, in one `run` call (kind nvidia-h200, timeout_s 600,
# carry [".whl", ".base43"]):   bash scripts/bench/results/rerun_2026-12-04/run.sh
# Each commit runs its own bench scripts through timed.py (figures logged and saved as they are measured).
# P1 rounds stop after P1 tree, P1 plain and the P4 padded baseline (STOP_AFTER=3: P2/M1 are not needed and a full
# run would not fit four rounds and the host benches into the call). Every step's timeout is capped so that all
# ends by END_S seconds after the start; a step with under 25 s left is skipped.
# At most 8 files come back from $OUT: everything is written under $W and packed into $OUT/results.tgz after each
# step (a step cut by the call's limit loses only itself); $OUT/steps.log is the running summary. (The first run
# of 2026-12-04 wrote 20 files straight under $OUT and got back only the first 8: see README.md.)
set -u
OUT="${OUT:-/tmp/out43}"; W="${W43:-/tmp/w43}"; END_S="${END_S:-580}"; D=scripts/bench/results/rerun_2026-12-04
mkdir -p "$OUT" "$W"; T0=$SECONDS
pack() { cp "$W/steps.log" "$OUT/steps.log"; tar czf "$OUT/results.tgz.part" -C "$W" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
bash scripts/gpu/stage.sh > "$W/stage.log" 2>&1; echo "stage rc=$? at $((SECONDS - T0)) s (2 = the .gguf piece, expected)" | tee "$W/steps.log"
nvidia-smi > "$W/nvidia-smi.txt" 2>&1; lscpu | head -20 > "$W/lscpu.txt"; nproc > "$W/nproc.txt"
cat /proc/loadavg > "$W/loadavg_start.txt"; top -bn1 | head -20 > "$W/top_start.txt" 2>&1; pack
export PYTHONUNBUFFERED=1
step() {  # step NAME ROOT LIMIT SCRIPT ARGS...
  local name=$1 root=$2 lim=$3 script=$4; shift 4
  local left=$((END_S - (SECONDS - T0))); (( left < lim )) && lim=$left
  if (( lim < 25 )); then echo "$name: skipped, ${left} s left" | tee -a "$W/steps.log"; pack; return; fi
  mkdir -p "$W/$name"; local t=$SECONDS
  PYTHONPATH="/tmp/asyncgrpo_site:$root" timeout "$lim" python3 "$D/timed.py" "$root/scripts/bench/$script" "$@" \
    --out "$W/$name" > "$W/$name/log.txt" 2>&1
  echo "$name: rc=$? in $((SECONDS - t)) s (limit $lim s) at $((SECONDS - T0)) s, loadavg $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$W/steps.log"
  pack
}
B=$PWD/.base43; M=$PWD
STOP_AFTER=3 step base_r1 "$B" 110 bench_packing.py --shape qwen3-0.6b
STOP_AFTER=3 step main_r1 "$M" 110 bench_packing.py --shape qwen3-0.6b
step host_base "$B" 90 bench_host.py --shape qwen3-0.6b
step host_main "$M" 90 bench_host.py --shape qwen3-0.6b
STOP_AFTER=3 step base_r2 "$B" 110 bench_packing.py --shape qwen3-0.6b
STOP_AFTER=3 step main_r2 "$M" 110 bench_packing.py --shape qwen3-0.6b
echo "done at $((SECONDS - T0)) s" | tee -a "$W/steps.log"; pack
