#!/usr/bin/env bash
# The vLLM 0.33 runs on one H200, once install.py has staged /tmp/vsite (vLLM 0.33.0, torch 2.14.0) and
# /tmp/asyncgrpo_site (the project's missing wheels, the SmolLM2 GGUF):
#   bash scripts/gpu/vllm033/run.sh train   # Ctrl-C + resume with the printed command (one_gpu.py train)
#   bash scripts/gpu/vllm033/run.sh masks   # sampling masks at lr 0, doctor, serve --dry-run (runs.py masks)
#   bash scripts/gpu/vllm033/run.sh bench   # Qwen3-0.6B-shaped IPC sync timings (one_gpu.py bench, no embedded run);
#                                           # it leaves its packed-sync choice for JOB_PACKED=auto rollouts_job_* runs
#   bash scripts/gpu/vllm033/run.sh p9      # top-8 log-prob cost at API servers 8 and 1 (runs.py p9)
#   bash scripts/gpu/vllm033/run.sh speed_new   # issue #33: the job as shipped, on-policy, the recipe's choices
#   bash scripts/gpu/vllm033/run.sh speed_old   # issue #33: the baseline (main at 3199842, carried in .base/)
#   bash scripts/gpu/vllm033/run.sh speed_stop  # issue #33: stops the server a KEEP_SERVER=1 speed_new call left
#   bash scripts/gpu/vllm033/run.sh rollouts_engine     # issue #41: the engine's offline rollouts/s (rollouts.py)
#   bash scripts/gpu/vllm033/run.sh rollouts_screen     # issue #41: the request levers against one served recipe
#   bash scripts/gpu/vllm033/run.sh rollouts_job_async  # issue #41: the job as users run it (rollouts_job_sync: on-policy)
#   bash scripts/gpu/vllm033/run.sh rollouts_two        # issue #41: two vLLM servers on the one GPU against one (rollouts_two.py)
#   bash scripts/gpu/vllm033/run.sh rollouts_job_async_engines2  # issue #41: the job with sampler.engines=2 (sync_engines2: on-policy)
#   bash scripts/gpu/vllm033/run.sh cuda_tests   # the trainer's CUDA tests on the job's stack (flex in the trainer,
#                                                # kernels, host syncs, memory; ~2 min): before the first job
#   bash scripts/gpu/vllm033/run.sh e1t_shared   # issues #41/#43: E1t on the job's stack, beside an idle and a busy
#                                                # vLLM server, then with cores of its own (e1t_shared.py, ~5 min)
#   bash scripts/gpu/vllm033/run.sh realistic_engine     # issue #42: builds the 1.7B stand-in, vLLM's offline LLM.generate
#   bash scripts/gpu/vllm033/run.sh realistic_job_async  # issue #42: our job, asynchronous (realistic_job_sync: on-policy;
#                                                       # variants: realistic_job_async_clip, _async_mps, _sync_clip_mps...)
#   bash scripts/gpu/vllm033/run.sh realistic_start_async  # the same job detached: returns after a slice (270 s);
#                                                         # also _sync, _engine, _trl, _trl_server (realistic.DETACHED)
#   bash scripts/gpu/vllm033/run.sh realistic_follow_async # the next slice of it (exit 3: still runs; 0: ended)
#   bash scripts/gpu/vllm033/run.sh realistic_trl        # issue #42: TRL's GRPOTrainer, colocated vLLM (server if it fails)
#   bash scripts/gpu/vllm033/run.sh realistic_trl_server # issue #42: TRL's GRPOTrainer against `vllm serve` on the GPU
#   bash scripts/gpu/vllm033/run.sh flash    # issue #43 item 4: flash-attn-4 tree attention (part p55 staged): the CUDA
#                                            # tests of test_flash_varlen.py, then bench_attention.py (flex vs flash, 1.7B)
#   bash scripts/gpu/vllm033/run.sh faults   # issue #45: fault drills with the job's vLLM (FAULTS=server_kill_sync,supervisor_kill,sigint,server_stop: which, in order; faults.py, $OUT/faults_gpu.json)
# Results: $OUT/vllm033_<phase>.json (train/bench: $OUT/vllm033_<phase>.json through one_gpu.py's RESULT_PREFIX).
set -uo pipefail
VSITE="${VSITE:-/tmp/vsite}"
SITE="${ASYNCGRPO_SITE:-/tmp/asyncgrpo_site}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
if [ ! -f "$VSITE/.installed" ]; then
  echo "run.sh: vLLM 0.33 is not staged on this machine: see scripts/gpu/vllm033/install.py"; exit 1
fi
export PYTHONPATH="$SITE:$VSITE:$VSITE/nvidia_cutlass_dsl/dsl_packages:$PWD"
export PATH="$VSITE/bin:$PATH" ASYNCGRPO_CACHE=/tmp/asyncgrpo_cache PYTHONUNBUFFERED=1 OUT RESULT_PREFIX=vllm033
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
case "${1:-train}" in
  train) MAX_STEPS="${MAX_STEPS:-24}" EXTRA_OVERRIDES="logging.log_completions=true logging.num_completions_to_print=8" \
           TRAIN_DEADLINE_S="${TRAIN_DEADLINE_S:-480}" python3 scripts/gpu/one_gpu.py train ;;
  bench) SKIP_EMBEDDED=1 python3 scripts/gpu/one_gpu.py bench ;;
  masks|p9) python3 scripts/gpu/vllm033/runs.py "$1" ;;
  speed_new|speed_old|speed_stop) python3 scripts/gpu/vllm033/speed.py "${1#speed_}" ;;
  rollouts_engine|rollouts_screen) python3 scripts/gpu/vllm033/rollouts.py "${1#rollouts_}" ;;
  rollouts_two) python3 scripts/gpu/vllm033/rollouts_two.py ;;
  e1t_shared) python3 scripts/gpu/vllm033/e1t_shared.py ;;
  cuda_tests) timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests/train/test_tree_attention.py \
                tests/train/test_cuda_kernels.py tests/train/test_host_syncs.py tests/train/test_cuda_memory.py \
                tests/train/test_compile.py tests/train/test_sync_overlap.py -k "cuda" 2>&1 | tee "$OUT/cuda_tests.txt" ;;
  rollouts_job_*) python3 scripts/gpu/vllm033/rollouts.py job "${1#rollouts_job_}" ;;
  realistic_engine) python3 scripts/gpu/vllm033/realistic.py engine ;;
  realistic_job_*) python3 scripts/gpu/vllm033/realistic.py job "${1#realistic_job_}" ;;
  realistic_start_*) python3 scripts/gpu/vllm033/realistic.py start "${1#realistic_start_}" ;;
  realistic_follow_*) python3 scripts/gpu/vllm033/realistic.py follow "${1#realistic_follow_}" ;;
  realistic_trl) python3 scripts/gpu/vllm033/realistic.py trl colocate ;;
  realistic_trl_server) python3 scripts/gpu/vllm033/realistic.py trl server ;;
  faults) python3 scripts/gpu/vllm033/faults.py ;;
  flash) [ -f "$SITE/.fa4_installed" ] || { echo "run.sh flash: flash-attn-4 is not staged: carry .stage033/p55"; exit 1; }
         export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_cute_cache
         timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/train/test_flash_varlen.py \
           tests/train/test_tree_attention.py -k cuda
         mkdir -p "$OUT/results" && timeout 300 python3 scripts/bench/bench_attention.py --shape qwen3-1.7b \
           --out "$OUT/results" ;;
  *) echo "run.sh: unknown phase $1 (train, masks, bench, p9, speed_*, rollouts_engine, rollouts_screen, rollouts_two, e1t_shared, cuda_tests, rollouts_job_NAME, realistic_engine, realistic_job_async|sync, realistic_start|follow_NAME, realistic_trl, realistic_trl_server, faults, flash)"; exit 2 ;;
esac
