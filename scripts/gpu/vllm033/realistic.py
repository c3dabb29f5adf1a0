"""Issue #42 on one GPU (an H100 or H200) with vLLM 0.33 (staged by `install.py`): a 1.7B-class job with
512-token completions, ours asynchronous and on-policy, against vLLM's offline ceiling and TRL's ``GRPOTrainer``,
with no network.

    python3 scripts/gpu/vllm033/realistic.py engine        # builds the stand-in, then vLLM's offline LLM.generate
    python3 scripts/gpu/vllm033/realistic.py job async     # our job as users run it (the supervisor starts vLLM)
    python3 scripts/gpu/vllm033/realistic.py job sync      # the same with staleness.max_staleness=0 (on-policy)
    python3 scripts/gpu/vllm033/realistic.py job async_clip_mps  # a variant (`JOB_TAGS`: _clip, _mps, _extmps,
                                                                 # _compile, _stale8, _kill9, _overlap, ...)
    python3 scripts/gpu/vllm033/realistic.py trl           # TRL's GRPOTrainer, colocated vLLM (server if it fails)
    python3 scripts/gpu/vllm033/realistic.py trl server    # TRL's GRPOTrainer against `vllm serve` on the same GPU
    python3 scripts/gpu/vllm033/realistic.py combine IN [OUT]  # here, no GPU: ours_over_trl from the fetched JSONs
                                                               # (OUT: scripts/gpu/results/vllm033 by default)
    python3 scripts/gpu/vllm033/realistic.py compare OUT A B ...  # here, no GPU: our runs of one session side by
                                                                  # side over the same steps, A the baseline
                                                                  # (COMPARE_WHAT=... sets the result's `what`)
    python3 scripts/gpu/vllm033/realistic.py preflight async   # here, no GPU: the job at a tiny shape, 2 CPU steps

The stand-in (built under `WORK` once per machine, by any phase that needs it; `build`): random weights of the
Qwen3-1.7B shape (``scripts/bench``'s ``qwen3-1.7b``, Qwen3-1.7B's vocabulary of 151,936 and tied embeddings; bf16
on disk; the default ``initializer_range`` 0.02, so that next-token distributions are near uniform and a
completion runs to the 512-token limit), `offline.make_tokenizer`'s word-level tokenizer over every id with a
chat template, `offline.make_deepmath_data`'s problems, and `offline.number_reward` (a random model's text holds
numbers at random: signal in every group). The job's choices are `job_overrides`; TRL gets the same model, data,
reward, ``num_generations``, completion length, learning rate, bf16 mixed precision (fp32 weights) and
activation (gradient) checkpointing (`trl_run.py`).

Each phase writes ``$OUT/realistic_<phase>.json`` (versions, date, exact commands, one row per step, GPU memory
per process from ``nvidia-smi`` polled every `POLL_S` seconds: `gpu_memory`), rewritten as it goes. A run still
going at `DEADLINE_S` (or earlier, so that the call ends within `CALL_S`) gets a SIGINT (ours saves and stops) and
a SIGKILL `GRACE_S` later.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
for _p in (ROOT, ROOT / "scripts" / "bench", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

OUT = Path(os.environ.get("OUT") or "gpu_out")
WORK = Path(os.environ.get("REALISTIC_WORK", "/tmp/asyncgrpo_realistic"))
CLI = [sys.executable, "-m", "asyncgrpo_cli"]
G = 8
COMPLETION = 512
MAX_MODEL_LEN = 1024  # a ~45-token prompt + 512 completion tokens, with room
TOKEN_BUDGET = int(os.environ.get("REALISTIC_TOKEN_BUDGET", 16384))
GRAD_ACCUM = int(os.environ.get("REALISTIC_GA", 2))  # a step of 2 x 16K forwarded tokens, about 7 groups of 8
LEARNING_RATE = 1e-6
STEPS = int(os.environ.get("REALISTIC_STEPS", 30))
DEADLINE_S = float(os.environ.get("REALISTIC_DEADLINE_S", 470))
GRACE_S = float(os.environ.get("REALISTIC_GRACE_S", 110))  # SIGINT's save of 1.7B fp32 weights + AdamW (~20 GB)
POLL_S = float(os.environ.get("REALISTIC_POLL_S", 3))
CALL_S = float(os.environ.get("REALISTIC_CALL_S", 570))  # what one device call may use (600 s a call)
T0 = time.monotonic()
VOCAB = 151936
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
TINY_VOCAB = 2048


def paths(work: Path = WORK) -> tuple[Path, Path]:
    """(model folder, data file) of the stand-in under ``work``."""
    return work / "model", work / "deepmath.jsonl"


def make_model(out: Path, shape: str = "qwen3-1.7b", device: str = "cuda") -> Path:
    """The random Qwen3 checkpoint (module docstring) in ``out``, kept when it exists. ``shape``: ``qwen3-1.7b``
    (151,936 ids) or ``tiny`` (`TINY`, 2,048 ids, for the CPU check). Raises KeyError for another shape."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import offline

    if (out / "config.json").exists():
        return out
    if shape == "tiny":
        dims, vocab = TINY, TINY_VOCAB
    else:
        from bench_packing import SHAPES

        dims, vocab = SHAPES[shape], VOCAB
    tokenizer = offline.make_tokenizer(vocab)
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=40960,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build(work: Path = WORK, shape: str = "qwen3-1.7b", device: str = "cuda", rows: int = 4000) -> dict:
    """Model and data under ``work`` (kept when there); returns their paths and the seconds it took. A model built
    on a GPU is built in a child process, so that this one holds no CUDA memory beside the job it then runs (on
    2026-12-06 the driver of `job async` held 8.3 GiB of the shared GPU for the whole run)."""
    import offline

    t0 = time.monotonic()
    model, data = paths(work)
    if not data.exists():
        offline.make_deepmath_data(data, n=rows)
    if device == "cpu" or (model / "config.json").exists():
        make_model(model, shape, device)
    else:
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import realistic; "
                f"realistic.make_model(realistic.Path({str(model)!r}), {shape!r}, {device!r})")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return {"model": str(model), "data": str(data), "build_s": round(time.monotonic() - t0, 1)}


# A job name is ``async`` or ``sync`` with optional tags: ``_clip`` = the clipped objective, whose requests ask
# vLLM for no top log-probs (the sampled token's only, as TRL asks; the engine's offline rate was 3.3x higher
# without them on 2026-12-06), ``_mps`` = the job under CUDA MPS as users run it, ``launch.mps=true`` (the trainer's
# and vLLM's kernels may then run at once; without it the two processes take turns on the GPU), ``_extmps`` = the
# same with the daemon started here (`rollouts.start_mps`, ``-d``; what the nineteenth session's ``_mps`` runs
# measured, before ``launch.mps`` existed), ``_compile`` = ``trainer.torch_compile=true``,
# ``_stale8`` = ``staleness.max_staleness=8`` (the 2026-12-06 asynchronous run kept ~49 rollouts in flight under
# deadline admission: a 512-token completion decoded beside the trainer takes steps to finish, and small decode
# batches cost the shared GPU as much per step as large ones), ``_kill9`` = the run goes on past its `STEPS`
# measured steps and its supervisor is killed with SIGKILL once step `STEPS` + 1 is logged (`kill9.Kill9`: what is
# left, a minute on; with ``_mps``, whether CUDA MPS's daemon and server go too). Since 2026-12-06 (twenty-first
# session) ``launch.mps`` is automatic (null): a plain ``async`` job runs under MPS as users' jobs do, ``_nomps``
# (``launch.mps=false``) is the asynchronous job without it, and ``sync`` stays without it (automatic MPS is off
# on-policy). ``_observed`` = ``staleness.deadline_order=observed`` (twenty-second session: deadline admission counts
# the groups started after a group in flight at the share seen to finish first, ~0 where every completion runs to
# 512 tokens; `scripts/bench/bench_deadline_waves.py --order observed`). ``_release4`` =
# ``staleness.deadline_release_versions=4`` (twenty-fourth session: deadline admission turns off again after 4
# weight updates without a stale drop; simulated at staleness 4, busy 86% with no stale drop against 72%,
# `bench_deadline_waves.py --release 4`, a model with no drop at all; on the GPU the s24 `_clip` job, admission
# on, dropped 14 samples at steps 6-7 and 3 at step 19: whether released admission drops more is the GPU's to say).
# ``_overlap`` = ``sampler.weight_sync_overlap=true`` (each step's weight sync runs on a background thread while the
# next step pulls, forwards and backwards, settled before its optimizer step; the one-H100 1.7B job spent 0.30 s
# of a 3.25 s step in the sync, the trainer waiting: compare ``async_clip_overlap`` with ``async_clip``, and
# ``perf/weight_sync_wait_s``, the wait left, with ``perf/weight_sync_s``).
# ``_lowprio`` = ``launch.mps_trainer_priority=below_normal`` (the trainer an MPS client of priority below normal:
# the GPU runs vLLM's pending kernels first; compare ``async_clip_compile_lowprio`` with ``async_clip_compile``:
# generated tok/s against the engine's, the busy share, trained tok/s).
JOB_TAGS = {"clip": ["loss.score_centering=false", "rollout.num_sampler_logprobs=0"], "mps": ["launch.mps=true"],
            "extmps": ["launch.mps=false"], "nomps": ["launch.mps=false"],
            "compile": ["trainer.torch_compile=true"], "stale8": ["staleness.max_staleness=8"],
            "observed": ["staleness.deadline_order=observed"], "kill9": [],
            "release4": ["staleness.deadline_release_versions=4"], "overlap": ["sampler.weight_sync_overlap=true"],
            "lowprio": ["launch.mps_trainer_priority=below_normal"]}
KILL9_EXTRA_STEPS = 10  # max_steps of a ``_kill9`` run: `STEPS` + this, so that it is still running at the kill


def job_variant(name: str) -> tuple[str, list[str]]:
    """``(mode, tags)`` of a job name such as ``async``, ``sync_clip`` or ``async_clip_mps``.

    Raises:
        ValueError: the mode is not async/sync, or a tag is not in `JOB_TAGS`.
    """
    mode, *tags = name.split("_")
    if mode not in ("async", "sync") or any(t not in JOB_TAGS for t in tags) or len(set(tags)) != len(tags):
        raise ValueError(f"job name {name!r}: use async or sync, with optional tags {', '.join('_' + t for t in JOB_TAGS)}")
    return mode, tags


def job_overrides(model_dir: Path | str, data_file: Path | str, run_dir: Path | str, name: str = "async",
                  steps: int = STEPS) -> list[str]:
    """Our job's Hydra overrides (``sync``: on-policy). No recipe: every choice is here. One GPU shared with vLLM
    (colocated, CUDA-IPC sync); fp32 weights with bf16 autocast and activation checkpointing (the defaults, set
    so the record shows them; TRL's too); 16K-token rows, `GRAD_ACCUM` of them a step; the default staleness
    (4) and concurrency ceiling (512) for ``async``. No checkpoint but the one a stop writes, and that one holds
    the weights only (6.8 GB, not 20 GB with AdamW's state): the first try on a GPU lost its machine at about the
    time of that save (NOTES, fourteenth session)."""
    mode, tags = job_variant(name)
    return [f"model.name={model_dir}", "model.dtype=float32", f"data.name={data_file}",
            "rewards=[{func:offline:number_reward}]", f"rollout.num_generations={G}",
            f"rollout.max_completion_length={COMPLETION}", "sampler.backend=vllm",
            f"sampler.max_model_len={MAX_MODEL_LEN}",
            "launch.colocate=true", f"packing.token_budget={TOKEN_BUDGET}",
            f"trainer.gradient_accumulation_steps={GRAD_ACCUM}", f"trainer.learning_rate={LEARNING_RATE}",
            "trainer.bf16=true", "trainer.activation_checkpointing=true",
            *(["staleness.max_staleness=0"] if mode == "sync" else []),
            *(o for t in tags for o in JOB_TAGS[t]),
            f"trainer.max_steps={steps + (KILL9_EXTRA_STEPS if 'kill9' in tags else 0)}", "trainer.logging_steps=1",
            "logging.dashboard=plain",
            f"trainer.output_dir={run_dir}", "trainer.save_strategy=no", "trainer.save_only_model=true"]


def versions() -> dict:
    import rollouts

    return rollouts.versions()


def write(name: str, result: dict) -> None:
    text = json.dumps(result, indent=1)
    for folder in (OUT, WORK):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def child_env() -> dict:
    """The environment of a child: this folder on PYTHONPATH (``offline:number_reward``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def run_until(argv: list[str], log: Path, deadline_s: float, grace_s: float, on_tick=None, env=None) -> dict:
    """`bench_e2e.run_until` (the job to its end or a deadline: SIGINT, then SIGKILL of its group)."""
    import bench_e2e

    return bench_e2e.run_until(argv, log, deadline_s, grace_s, on_tick, env)


# ---------------------------------------------------------------------------------------------- our job
def step_rows(rows: list[dict], memory: list[dict] | None = None, processes: dict | None = None) -> list[dict]:
    """One row per logged step: trained tok/s, the trainer's busy share, generated tok/s, weight sync, and the
    GPU memory peak of each process role over the step (from the `gpu_memory` samples)."""
    from gpu_memory import peaks

    out, prev_t = [], None
    t1 = rows[0]["time"] if rows else 0.0
    for r in rows:
        step_s, wait = r.get("perf/step_s"), r.get("perf/rollout_wait_s")
        row = {"step": r.get("step"), "t_since_step1_s": round(r["time"] - t1, 3), "step_s": step_s,
               "trained_tokens": r.get("batch/trained_tokens_per_step"),
               "trained_tok_s": r.get("perf/wall_clock_trained_tokens_per_s"),
               "busy_frac": round(1 - wait / step_s, 4) if step_s and wait is not None else None,
               "generated_tok_s": r.get("rollout/generated_tokens_per_s"),
               "weight_sync_s": r.get("perf/weight_sync_s"), "weight_sync_pause_s": r.get("perf/weight_sync_pause_s"),
               "weight_sync_transfer_s": r.get("perf/weight_sync_transfer_s"), "fwd_bwd_s": r.get("perf/fwd_bwd_s"),
               "completions": r.get("batch/samples_per_step"), "groups": r.get("batch/groups_per_step"),
               "reward": r.get("reward"), "staleness_mean": r.get("sample/staleness_mean"),
               "dropped_stale_count": r.get("sample/dropped_stale_count"),
               "completion_mean_length": r.get("completions/mean_length"),
               "rollouts_in_flight": r.get("rollout/concurrency"),
               "kv_cache_usage_frac": r.get("rollout/vllm_kv_cache_usage_frac")}
        if memory:
            row["gpu_peak_mib"] = peaks(memory, processes or {}, prev_t, r["time"])
        prev_t = r["time"]
        out.append({k: v for k, v in row.items() if v is not None})
    return out


def completion_figures(rows: list[dict]) -> dict:
    """Completions trained over the steps after the first, and seconds per 1,000 of them (wall clock from the
    first step's end to the last's: start-up and step 1 left out, as `bench_e2e.summarize` does)."""
    kept = [r for r in rows[1:] if r.get("completions")]
    if not kept:
        return {"completions_total": sum(r.get("completions", 0) for r in rows)}
    span = rows[-1]["t_since_step1_s"] - rows[0]["t_since_step1_s"]
    n = sum(r["completions"] for r in kept)
    return {"completions_total": sum(r.get("completions", 0) for r in rows), "completions_after_step1": n,
            "s_per_1000_completions": round(1000 * span / n, 2) if n and span > 0 else None}


def planned_vllm_frac(log_text: str) -> float | None:
    """vLLM's ``--gpu-memory-utilization`` as the job's log prints it (the plan's share), or None."""
    m = re.search(r"--gpu-memory-utilization[ =]([0-9.]+)", log_text)
    return float(m.group(1)) if m else None


def vllm_memory_lines(log_text: str) -> list[str]:
    """vLLM's own memory report (weights, KV cache, CUDA graphs) from a log."""
    keys = ("Model loading took", "KV cache", "Memory profiling", "CUDA graph", "memory usage")
    return [line.strip()[:300] for line in log_text.splitlines() if any(k in line for k in keys)][:20]


def phase_job(name: str) -> int:
    import bench_e2e
    import gpu_memory
    import kill9

    result: dict = {"issue": 42, "phase": f"job {name}", "versions": versions(), "stand_in": build()}
    model, data = paths()
    run_dir = WORK / f"job_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [*CLI, "train", *job_overrides(model, data, run_dir, name)]
    deadline = min(DEADLINE_S, CALL_S - (time.monotonic() - T0) - GRACE_S)  # the build counts against the call
    result.update({"command": "PYTHONPATH=scripts/gpu/vllm033:$PYTHONPATH asyncgrpo " + " ".join(argv[3:]),
                   "deadline_s": round(deadline, 1), "poll_s": POLL_S})
    log = WORK / f"job_{name}.log"
    env = child_env()
    if "extmps" in job_variant(name)[1]:
        import rollouts

        result["mps"] = rollouts.start_mps()
        if not result["mps"]["ok"]:
            result["mps"]["control_log_after"] = rollouts.stop_mps()
            write(f"realistic_job_{name}.json", result)
            print(json.dumps(result["mps"]), flush=True)
            return 1
        env = {**env, **rollouts.mps_env()}
    poller = gpu_memory.Poller(POLL_S).start()
    tags = job_variant(name)[1]
    drill = kill9.Kill9(STEPS + 1, run_dir) if "kill9" in tags else None

    def tick() -> None:
        rows = bench_e2e.read_metrics(run_dir)
        result["rows"] = step_rows(rows, poller.samples, poller.processes)
        if drill is not None and drill.fire(max((r.get("step") or 0 for r in rows), default=0)):
            result["kill9"] = drill.record
        write(f"realistic_job_{name}.json", result)

    try:
        result.update(run_until(argv, log, deadline, GRACE_S, tick, env))
    finally:
        poller.stop()
        if "mps" in result:
            import rollouts

            result["mps"]["control_log_after"] = rollouts.stop_mps()
    if drill is not None:
        result["kill9"] = drill.observe()
    rows = bench_e2e.read_metrics(run_dir)
    text = log.read_text(errors="replace")
    if "mps" in tags:
        result["mps_check"] = kill9.mps_check(run_dir, text)
    result["rows"] = step_rows(rows, poller.samples, poller.processes)
    result["summary"] = {**bench_e2e.summarize(rows), **completion_figures(result["rows"])}
    result["gpu_memory"] = {**gpu_memory.summary(poller.samples, poller.processes, planned_vllm_frac(text)),
                            "poll_errors": poller.errors}
    result["vllm_memory_log"] = vllm_memory_lines(text)
    result["plain_tail"] = [line for line in text.splitlines() if line.startswith("step ")][-6:]
    import rollouts

    result["tree_attention"] = rollouts.tree_attention_line(run_dir / "logs" / "trainer.log")
    if result["exit"] not in (0, 130) or not rows or drill is not None:
        result["log_tail"] = text.splitlines()[-40:]
    write(f"realistic_job_{name}.json", result)
    subprocess.run(["tar", "czf", str(OUT / f"logs_realistic_{name}.tgz"), "-C", str(WORK), log.name,
                    f"{run_dir.name}/metrics.jsonl", f"{run_dir.name}/status.json", f"{run_dir.name}/logs"],
                   capture_output=True)
    for ckpt in run_dir.glob("checkpoint-*"):  # ~20 GB each: the machine's disk holds 64 GiB
        shutil.rmtree(ckpt, ignore_errors=True)
    print(json.dumps(result["summary"]), flush=True)
    if drill is not None:
        print(json.dumps(result["kill9"]), flush=True)
        return 0 if result["kill9"].get("fired") and rows else 1
    return 0 if result["exit"] in (0, 130) and rows else 1


def cpu_overrides(overrides: list[str], port: int = 8150) -> list[str]:
    """A job's overrides (`job_overrides`) for the tiny stand-in on this machine's CPU: the embedded sampler in
    vLLM's place, fp32, 16-token completions and 256-token rows, neither colocation nor CUDA MPS (GPU only);
    every other choice as the GPU job's."""
    swap = {"sampler.backend": "embedded", "trainer.bf16": "false", "rollout.max_completion_length": "16",
            "packing.token_budget": "256", "sampler.max_model_len": "128"}
    out = [f"{o.split('=', 1)[0]}={swap[o.split('=', 1)[0]]}" if o.split("=", 1)[0] in swap else o
           for o in overrides if not o.startswith(("launch.colocate=", "launch.mps="))]
    return [*out, f"sampler.port={port}"]


def phase_preflight(name: str, work: Path = Path("/tmp/asyncgrpo_realistic_cpu")) -> int:
    """Issue #42's job at the tiny shape, 2 steps on CPU through the embedded sampler, before a GPU session:
    with ``PYTHONPATH`` holding the device image's transformers (5.17: ``pip install --no-deps --target DIR
    transformers==5.17.0 'huggingface-hub<2' 'tokenizers<0.24'``) it finds what CI's newer transformers hides
    (the seventeenth session's first GPU run died at start on such a difference). Exit status: the job's."""
    build(work, shape="tiny", device="cpu", rows=64)
    run_dir = work / f"job_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [*CLI, "train", *cpu_overrides(job_overrides(*paths(work), run_dir, name, steps=2))]
    print("realistic preflight:", shlex.join(argv[3:]), flush=True)
    return subprocess.run(argv, env={**child_env(), "ASYNCGRPO_CACHE": str(work / "cache")}).returncode


# ---------------------------------------------------------------------------------------------- engine
def rendered_prompts(model_dir: Path, data_file: Path, groups: int) -> list[list[int]]:
    """The first ``groups`` prompts as token ids, through the chat template with a generation prompt (as the
    rollout worker and TRL render them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in data_file.read_text().splitlines()[:groups]:
        ids = tok.apply_chat_template(json.loads(line)["prompt"], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


# name -> top log-probs: our default job asks for 8; a ``_clip`` job and TRL for 0 (the sampled token's only).
ENGINE_VARIANTS = {"job": 8, "sampled_only": 0, "no_logprobs": None}
ENGINE_WARMUP_TOKENS = 16  # each variant's warm-up: every request at once, this long (2026-12-07: an 8-group
# warm-up left vLLM to JIT-compile its top-k log-softmax kernel inside the timed logprobs=8 run)


def phase_engine() -> int:
    from vllm import LLM, SamplingParams

    groups = int(os.environ.get("ENGINE_GROUPS", 64))
    util = float(os.environ.get("ENGINE_GPU_UTIL", 0.45))
    result: dict = {"issue": 42, "phase": "engine", "versions": versions(), "stand_in": build(), "runs": []}
    model, data = paths()
    prompts = rendered_prompts(model, data, groups)
    result["workload"] = {"groups": len(prompts), "n": G, "max_tokens": COMPLETION, "temperature": 1.0,
                          "seed_per_request": True,
                          "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
                          "dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN, "gpu_memory_utilization": util,
                          "logprobs_mode": "processed_logprobs"}
    write("realistic_engine.json", result)
    t0 = time.monotonic()
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_logprobs=8,
              logprobs_mode="processed_logprobs", gpu_memory_utilization=util, seed=0)
    result["start_s"] = round(time.monotonic() - t0, 1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    seed = 1
    for name, logprobs in ENGINE_VARIANTS.items():
        params = []
        for _ in inputs:
            params.append(SamplingParams(n=G, temperature=1.0, max_tokens=COMPLETION, logprobs=logprobs, seed=seed))
            seed += G
        warm = [SamplingParams(n=G, temperature=1.0, max_tokens=ENGINE_WARMUP_TOKENS, logprobs=logprobs, seed=i)
                for i in range(len(inputs))]
        llm.generate(inputs, warm, use_tqdm=False)  # the timed run's batch shapes and log-prob kernels
        t = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        completions = sum(len(o.outputs) for o in outputs)
        row = {"variant": name, "logprobs": logprobs, "wall_s": round(wall, 3), "completions": completions,
               "generated_tokens": tokens, "generated_tok_s": round(tokens / wall, 1),
               "completion_mean_length": round(tokens / max(1, completions), 1)}
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
        write("realistic_engine.json", result)
    result["engine_generated_tok_s"] = result["runs"][0]["generated_tok_s"]
    write("realistic_engine.json", result)
    return 0


# ---------------------------------------------------------------------------------------------- detached runs
# A call that loses its machine returns nothing, not even what its run had logged (the first GPU try of `job
# async` did). `start NAME` runs a phase in a session of its own, which outlives the call, and returns after
# `SLICE_S` seconds with what the run has written so far; each `follow NAME` returns the next slice. A machine that
# dies mid-run then costs one slice's figures, not the run's.
SLICE_S = float(os.environ.get("REALISTIC_SLICE_S", 270))
DETACHED_S = float(os.environ.get("REALISTIC_DETACHED_S", 900))  # a detached run's `CALL_S`: what bounds it
# name -> (realistic.py's arguments, its result file, its run's log under WORK, its step rows under WORK or None)
DETACHED = {"async": (["job", "async"], "realistic_job_async.json", "job_async.log", None),
            "sync": (["job", "sync"], "realistic_job_sync.json", "job_sync.log", None),
            "engine": (["engine"], "realistic_engine.json", None, None),
            "trl": (["trl", "colocate"], "realistic_trl.json", "trl_colocate.log", "trl_colocate_rows.jsonl"),
            "trl_server": (["trl", "server"], "realistic_trl.json", "trl_server.log", "trl_server_rows.jsonl")}


def detached_spec(name: str) -> tuple[list[str], str, str | None, str | None] | None:
    """`DETACHED`'s entry for ``name``, or a job variant's (`job_variant`: ``async_clip``, ``sync_mps``, ...);
    None for an unknown name."""
    if name in DETACHED:
        return DETACHED[name]
    try:
        job_variant(name)
    except ValueError:
        return None
    return ["job", name], f"realistic_job_{name}.json", f"job_{name}.log", None


def detached_dir(name: str, work: Path | None = None) -> Path:
    """Where `start` keeps the detached run's driver log, exit status and result files (under `WORK`)."""
    return (work or WORK) / f"detached_{name}"


def phase_start(name: str, argv: list[str] | None = None) -> int:
    """Start the phase of `DETACHED` ``name`` (or ``argv``) detached: its own session, ``OUT`` under
    `detached_dir`, ``CALL_S`` = `DETACHED_S` (our job's deadline stays `DEADLINE_S`); then `phase_follow` for one
    slice. Refused (exit 1) while another detached run is alive: they would share the GPU."""
    folder = detached_dir(name)
    for there in sorted(WORK.glob("detached_*")):  # job variants too
        other = there.name[len("detached_"):]
        if (there / "pid").exists() and finished(there) is None and alive(int((there / "pid").read_text())):
            print(f"realistic: {other} still runs detached; start {name} once it ends: "
                  f"bash scripts/gpu/vllm033/run.sh realistic_follow_{other}")
            return 1
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "out").mkdir(parents=True)
    env = {**os.environ, "OUT": str(folder / "out"), "REALISTIC_CALL_S": str(DETACHED_S)}
    argv = argv or [sys.executable, str(Path(__file__).resolve()), *detached_spec(name)[0]]
    script = f'{shlex.join(argv)}; echo $? > {shlex.quote(str(folder / "exit"))}'
    with open(folder / "driver.log", "w") as log:
        proc = subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
    (folder / "pid").write_text(str(proc.pid))
    print(f"realistic: {name} started detached (pid {proc.pid}, a session of its own, at most {DETACHED_S:.0f} s); "
          f"follow it with: bash scripts/gpu/vllm033/run.sh realistic_follow_{name}", flush=True)
    return phase_follow(name)


def finished(folder: Path) -> int | None:
    """The detached run's exit status, or None while it runs."""
    try:
        return int((folder / "exit").read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (the project's one liveness test of a pid)."""
    from asyncgrpo_cli.run.state import _pid_alive

    return _pid_alive(pid, None)


def host_report() -> list[str]:
    """Host memory, /tmp's disk and the largest processes (what a machine that stops answering runs out of)."""
    out = []
    for argv in (["free", "-m"], ["df", "-h", "/tmp"], ["sh", "-c", "ps -eo pid,rss,etime,args --sort=-rss | head -8"]):
        try:
            out += subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.splitlines()
        except (OSError, subprocess.SubprocessError) as exc:
            out.append(f"{argv[0]}: {exc}")
    return [line[:200] for line in out]


def progress_rows(name: str, folder: Path) -> list[dict]:
    """The step rows written so far: our job's result ``rows``, TRL's step records, the engine's ``runs``."""
    _args, result_name, _log, rows_name = detached_spec(name) or (None, f"realistic_job_{name}.json", None, None)
    if rows_name:
        path = WORK / rows_name
        out = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:  # the line being written
                continue
            if isinstance(record, dict) and "step" in record:
                out.append(record)
        return out
    result_file = folder / "out" / result_name
    try:
        result = json.loads(result_file.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return []
    return result.get("rows") or result.get("runs") or []


def phase_follow(name: str) -> int:
    """Wait up to `SLICE_S` seconds for the detached run, then copy its result files to ``$OUT`` and print its
    progress. Exit status: 0 the run ended well, 3 it still runs (follow again), 1 it failed or was never started."""
    folder = detached_dir(name)
    if not (folder / "pid").exists():
        print(f"realistic: no detached {name} on this machine: start it with run.sh realistic_start_{name}")
        return 1
    t0, pid = time.monotonic(), int((folder / "pid").read_text())
    while finished(folder) is None and alive(pid) and time.monotonic() - t0 < SLICE_S:
        time.sleep(max(0.05, min(1.0, SLICE_S - (time.monotonic() - t0))))
    rc = finished(folder)
    if rc is None and not alive(pid):
        rc = -9  # its driver is gone without an exit status (killed)
    OUT.mkdir(parents=True, exist_ok=True)
    for f in (folder / "out").glob("*"):
        if f.is_file():
            shutil.copy2(f, OUT / f.name)
    rows = progress_rows(name, folder)
    log_name = (detached_spec(name) or (None, None, f"job_{name}.log", None))[2]
    run_log = WORK / log_name if log_name else None
    progress = {"run": name, "state": "running" if rc is None else f"exit {rc}", "steps_logged": len(rows),
                "last_rows": rows[-3:], "log_tail": run_log.read_text(errors="replace").splitlines()[-15:]
                if run_log and run_log.exists() else [], "driver_log_tail": (folder / "driver.log").read_text(
                    errors="replace").splitlines()[-10:], "host": host_report()}
    (OUT / f"realistic_follow_{name}.json").write_text(json.dumps(progress, indent=1))
    print(json.dumps(progress, indent=1), flush=True)
    if rc is None:
        print(f"realistic: {name} still runs: bash scripts/gpu/vllm033/run.sh realistic_follow_{name}")
        return 3
    return 0 if rc == 0 else 1


def main() -> int:
    phase = sys.argv[1] if len(sys.argv) > 1 else ""
    if phase == "build":
        print(json.dumps(build()))
        return 0
    if phase == "engine":
        return phase_engine()
    if phase == "job":
        return phase_job(sys.argv[2] if len(sys.argv) > 2 else "async")
    if phase in ("start", "follow"):
        name = sys.argv[2] if len(sys.argv) > 2 else "async"
        if detached_spec(name) is None:
            print(f"realistic.py {phase}: {name!r}: use one of {', '.join(DETACHED)}, or a job variant "
                  f"(async or sync with tags {', '.join('_' + t for t in JOB_TAGS)}: async_clip, sync_mps, ...)")
            return 2
        return phase_start(name) if phase == "start" else phase_follow(name)
    if phase == "preflight":
        return phase_preflight(sys.argv[2] if len(sys.argv) > 2 else "async")
    if phase == "trl":
        import realistic_trl

        return realistic_trl.phase_trl(sys.argv[2] if len(sys.argv) > 2 else "colocate")
    if phase == "combine":
        import realistic_trl

        try:
            out = realistic_trl.combine(Path(sys.argv[2] if len(sys.argv) > 2 else OUT),
                                        Path(sys.argv[3]) if len(sys.argv) > 3 else None)
        except FileNotFoundError as exc:  # a folder without the plain names: say which and how, no traceback
            print(f"realistic.py combine: {exc}. IN must hold realistic_job_async.json and realistic_trl.json "
                  "(realistic_job_sync.json and realistic_engine.json optional): the files a run fetched, or symbolic links "
                  "to dated ones, e.g. realistic_job_async.json -> .../realistic_job_async_clip_release4_s26.json",
                  file=sys.stderr)
            return 2
        print(json.dumps({k: out[k] for k in ("figures", "ours_over_trl", "targets")}, indent=1))
        return 0
    if phase == "compare":
        import realistic_trl

        if len(sys.argv) < 5:
            print("realistic.py compare OUT.json BASE.json OTHER.json [...]: our runs of one machine side by side, "
                  "BASE the baseline (COMPARE_WHAT=... sets the result's `what`)", file=sys.stderr)
            return 2
        try:
            out = realistic_trl.compare_jobs([Path(a) for a in sys.argv[3:]], Path(sys.argv[2]),
                                             os.environ.get("COMPARE_WHAT", ""))
        except (OSError, ValueError) as exc:
            print(f"realistic.py compare: {exc}", file=sys.stderr)
            return 2
        print(json.dumps({k: out[k] for k in ("same_steps", "async_over_sync_trained_tok_s", "targets")}, indent=1))
        for name, run in out["runs"].items():
            print(f"{name}: {run['same_steps_trained_tokens_per_s']} tok/s over {out['same_steps']} "
                  f"({run['over_' + out['baseline'] + '_same_steps']}x {out['baseline']}), busy "
                  f"{run['figures']['busy_frac']}, busy steps' median "
                  f"{'-' if run['busy_step_s_median'] is None else str(run['busy_step_s_median']) + ' s'}, "
                  f"dropped stale {run['dropped_stale_token_frac']}")
        return 0
    print(f"realistic.py: unknown phase {phase!r}: use build, engine, job async|sync, start|follow NAME, "
          "trl [colocate|server], combine IN [OUT], compare OUT A B [...], preflight async|sync")
    return 2


if __name__ == "__main__":
    sys.exit(main())
