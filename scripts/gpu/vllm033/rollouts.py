"""Issue #41 on one H200 with vLLM 0.33 (staged by `install.py`): rollouts per second of the one-GPU job.

    python3 scripts/gpu/vllm033/rollouts.py engine        # the engine's own ceiling: offline LLM.generate
    python3 scripts/gpu/vllm033/rollouts.py screen        # the request levers against one `asyncgrpo serve`
    python3 scripts/gpu/vllm033/rollouts.py job async     # the job as users run it (the supervisor starts vLLM)
    python3 scripts/gpu/vllm033/rollouts.py job sync      # the same with staleness.max_staleness=0 (on-policy)
    python3 scripts/gpu/vllm033/rollouts.py combine A S [OUT [SCREEN [ENGINE]]]   # here: the pair's JSON (no GPU)
    python3 scripts/gpu/vllm033/rollouts.py served SCREEN JOB.json...  # here: each job against the served engine

engine
  ``vllm.LLM`` on the recipe's exported model (bf16, ``max_model_len`` 512, processed log-probs, CUDA graphs),
  nothing else on the GPU, the recipe's prompts rendered with the chat template, every group at once. Variants
  (`ENGINE_VARIANTS`): ``job`` (n = 8, temperature 1, 64 tokens, top-8 log-probs, a seed per request: the job's
  requests), ``job_noseed``, ``no_logprobs``, and ``short`` (12 tokens: the shape of the late steps, where
  completions are ~10 tokens). Writes ``$OUT/rollouts_engine.json``: rollouts/s and generated tok/s of each.
screen
  ``asyncgrpo serve +recipe=arith_vllm_1gpu`` (the job's own server line, colocated share included), then one
  load generator per variant through the project's `SamplerClient` (its parse included): the recipe's 512
  rollouts in flight for `SCREEN_S` seconds after a warm-up. Variants (`SCREEN_VARIANTS`): one request per
  rollout (the job before issue #41) or one per group (``n = 8``), with and without per-request seeds, top-8
  or no log-probs, 12-token completions, two load processes instead of one (the worker's CPU), and the tokens route
  (``/inference/v1/generate`` with ``n`` and no detokenizing; the served line adds ``--enable-scale-out``). Each row:
  rollouts/s, generated tok/s, the load process's CPU share, the worker's request and parse times, and vLLM's
  own per-request stage means from ``/metrics`` over the variant. Writes ``$OUT/rollouts_screen.json`` and the
  job overrides of the measured winner to ``/tmp/asyncgrpo_rollouts/winner.txt`` (read by ``job``).
job NAME
  ``asyncgrpo train +recipe=arith_vllm_1gpu trainer.max_steps=40`` (``sync``: ``staleness.max_staleness=0``),
  plain log, one window per step, stopped with SIGINT at `JOB_DEADLINE_S` if still running. Writes
  ``$OUT/rollouts_job_NAME.json``: one row per step (time since step 1, step time, reward, rollouts/s, groups/s,
  request breakdown, ...) and the issue's figures (`job_figures`). ``JOB_MPS=1``: under CUDA MPS (`start_mps`);
  ``JOB_EXTRA``: more overrides; ``JOB_CEILING=1``: the rollout ceiling the screen chose (`ceiling_choice`);
  ``JOB_PACKED=auto``: the packed-sync choice ``run.sh bench`` left on the machine (`one_gpu.packed_choice`), so that
  the bench and the pair can be sent together.
  `JOB_DEADLINE_S` counts from the job's start, vLLM's included: the first vLLM start on a fresh machine took
  181 s (85 s once its compile caches were warm), so a job that starts vLLM first on the machine needs 480 s or
  more for 40 steps (2026-12-03: 300 s cut such a run before its first step).

Every command line here is composed and checked on CPU in CI (``tests/test_gpu_script_configs.py``).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(HERE.parent))

OUT = Path(os.environ.get("OUT") or "gpu_out")
WORK = Path("/tmp/asyncgrpo_rollouts")
RECIPE = "arith_vllm_1gpu"
PORT = int(os.environ.get("ROLLOUTS_PORT", 8000))
URL = f"http://127.0.0.1:{PORT}"
STEPS = 40
JOB_DEADLINE_S = float(os.environ.get("JOB_DEADLINE_S", 540))
SCREEN_S = float(os.environ.get("SCREEN_S", 10))
WARMUP_S = 3.0
INFLIGHT = 512  # the recipe's staleness.max_concurrent_rollouts
SCREEN_MAX_NUM_SEQS = int(os.environ.get("SCREEN_MAX_NUM_SEQS", 2048))
SCREEN_CONFORMANCE = os.environ.get("SCREEN_CONFORMANCE", "1") != "0"  # 0: skip the group-request conformance tests
G = 8
ENGINE_GROUPS = int(os.environ.get("ENGINE_GROUPS", 1024))
#: name -> (n per request, per-request seeds, top log-probs, max tokens, load processes[, tokens route[, in flight]])
SCREEN_VARIANTS: dict[str, tuple] = {  # in order of importance (a cut call keeps the first)
    "per_rollout": (1, True, 8, 64, 1),           # the job's requests before issue #41
    "group": (G, True, 8, 64, 1),                 # one request per group (n = 8)
    "per_rollout_short": (1, True, 8, 12, 1),     # the late steps' shape: ~10-token completions
    "group_short": (G, True, 8, 12, 1),
    "group_logprobs0": (G, True, 0, 64, 1),       # what top-8 log-probs cost (score centering needs them)
    "group_noseed": (G, False, 8, 64, 1),
    "group_2proc": (G, True, 8, 64, 2),           # two worker processes
    "group_tokens": (G, True, 8, 64, 1, True),    # /inference/v1/generate, tokens in and out, no detokenizing
    "group_tokens_short": (G, True, 8, 12, 1, True),
    # The rollout ceiling (staleness.max_concurrent_rollouts): the job held 512 in flight, every one running in vLLM,
    # with its KV cache 1.2% used, so rollouts/s = 512 / a request's time (the afternoon session's job pair).
    "group_1024": (G, True, 8, 64, 1, False, 1024),
    "group_short_1024": (G, True, 8, 12, 1, False, 1024),
    "group_2048": (G, True, 8, 64, 1, False, 2048),
    "group_short_2048": (G, True, 8, 12, 1, False, 2048),
}
ENGINE_VARIANTS: dict[str, dict] = {
    "job": {"seed": True, "logprobs": 8, "max_tokens": 64},
    "job_noseed": {"seed": False, "logprobs": 8, "max_tokens": 64},
    "no_logprobs": {"seed": True, "logprobs": None, "max_tokens": 64},
    "short": {"seed": True, "logprobs": 8, "max_tokens": 12},
}
#: The job's overrides for each screen variant that can win (what the product offers).
WINNER_OVERRIDES = {
    "per_rollout": ["rollout.group_requests=false"],
    "group": [],
    "group_noseed": ["rollout.request_seeds=false"],
}


def job_argv(name: str, run_dir: Path, extra: list[str] | None = None) -> list[str]:
    """The job's ``asyncgrpo train`` line (``sync``: on-policy); checked on CPU in CI."""
    import bench_e2e

    overrides = ["staleness.max_staleness=0"] if name.startswith("sync") else []
    if "_engines" in name:  # e.g. async_engines2: sampler.engines=2 (several servers on the GPU, issue #41)
        overrides.append(f"sampler.engines={int(name.rsplit('_engines', 1)[1])}")
    return bench_e2e.train_argv(RECIPE, [], [*overrides, *(extra or [])], STEPS, run_dir)


def serve_argv() -> list[str]:
    """``asyncgrpo serve`` of the recipe (the job's own server line, plus ``--enable-scale-out``: the tokens route
    the ``*_tokens`` variants use; it only adds routes; and ``--max-num-seqs`` `SCREEN_MAX_NUM_SEQS`: vLLM 0.33's
    default on an H200 is 1,024 running sequences, which would cap the 2,048 variants; the CUDA-graph sizes stay
    as in the job, min(2 x max_num_seqs, 512)); checked on CPU in CI."""
    return [sys.executable, "-m", "asyncgrpo_cli", "serve", f"+recipe={RECIPE}", f"sampler.port={PORT}",
            f"sampler.extra_args=[--enable-scale-out,--max-num-seqs,{SCREEN_MAX_NUM_SEQS}]"]


def versions() -> dict:
    import bench_e2e

    out = bench_e2e.versions()
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = None
    return out


def write(name: str, result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    (OUT / name).write_text(text)
    (WORK / name).write_text(text)


def recipe_prompts(limit: int) -> tuple[str, list[list[int]]]:
    """The recipe's exported model folder and its first ``limit`` prompts as token ids (chat template)."""
    from transformers import AutoTokenizer

    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.config.models import resolve_model_path
    from asyncgrpo_cli.data import load_prompts

    cfg = compose([f"+recipe={RECIPE}"])
    model = resolve_model_path(str(cfg.model.name), cfg.model.gguf_file)
    tok = AutoTokenizer.from_pretrained(model)
    rows = load_prompts(cfg)
    prompts = []
    for i in range(min(limit, len(rows))):
        ids = tok.apply_chat_template(rows[i]["prompt"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    while len(prompts) < limit:
        prompts.extend(prompts[: limit - len(prompts)])
    return model, prompts


def mps_probe() -> dict:
    """Whether CUDA MPS could be started here (its control binary on PATH); nothing is started."""
    return {"nvidia-cuda-mps-control": shutil.which("nvidia-cuda-mps-control"),
            "nvidia-cuda-mps-server": shutil.which("nvidia-cuda-mps-server")}


# ---------------------------------------------------------------------------------------------- engine
def phase_engine() -> int:
    from vllm import LLM, SamplingParams

    result: dict = {"issue": 41, "phase": "engine", "versions": versions(), "mps": mps_probe(), "runs": []}
    model, prompts = recipe_prompts(ENGINE_GROUPS)
    result["workload"] = {"model": model, "groups": len(prompts), "n": G, "temperature": 1.0,
                          "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                          "dtype": "bfloat16", "max_model_len": 512, "logprobs_mode": "processed_logprobs",
                          "gpu_memory_utilization": float(os.environ.get("ENGINE_GPU_UTIL", 0.3))}
    write("rollouts_engine.json", result)
    t0 = time.monotonic()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_logprobs=8, logprobs_mode="processed_logprobs",
              gpu_memory_utilization=result["workload"]["gpu_memory_utilization"], seed=0)
    result["start_s"] = round(time.monotonic() - t0, 1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    seed = 1
    for name, v in ENGINE_VARIANTS.items():
        def params(count: int):
            nonlocal seed
            out = []
            for _ in range(count):
                out.append(SamplingParams(n=G, temperature=1.0, max_tokens=v["max_tokens"], logprobs=v["logprobs"],
                                          seed=seed if v["seed"] else None))
                seed += G
            return out

        llm.generate(inputs[:64], params(64), use_tqdm=False)  # warm-up of this shape
        t = time.perf_counter()
        outputs = llm.generate(inputs, params(len(inputs)), use_tqdm=False)
        wall = time.perf_counter() - t
        completions = [c for o in outputs for c in o.outputs]
        tokens = sum(len(c.token_ids) for c in completions)
        row = {"variant": name, **v, "wall_s": round(wall, 3), "rollouts": len(completions),
               "rollouts_per_s": round(len(completions) / wall, 1), "generated_tokens_per_s": round(tokens / wall, 1),
               "groups_per_s": round(len(outputs) / wall, 2),
               "completion_tokens_mean": round(tokens / max(1, len(completions)), 2)}
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
        write("rollouts_engine.json", result)
    result["engine_rollouts_per_s"] = result["runs"][0]["rollouts_per_s"]
    write("rollouts_engine.json", result)
    return 0


# ---------------------------------------------------------------------------------------------- screen
async def _load(n: int, seeds: bool, logprobs: int, max_tokens: int, inflight: int, seconds: float,
                prompts: list[list[int]], model: str, tokens_route: bool = False, url: str = URL) -> dict:
    """Keep ``inflight`` rollouts in flight at ``url`` for ``seconds`` (after `WARMUP_S`), as the worker does."""
    from asyncgrpo_cli.sampler.client import SamplerClient, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=logprobs)
    client = SamplerClient(url, max_concurrency=max(1, inflight // n) + 4, timeout_s=300, request_seeds=seeds,
                           tokens_route=tokens_route)
    stats = {"rollouts": 0, "tokens": 0, "request_s": [], "parse_s": []}
    measuring = False
    stop = False
    index = 0

    async def one() -> None:
        nonlocal index
        while not stop:
            prompt = prompts[index % len(prompts)]
            index += 1
            turns = await client.generate_turns(prompt, sampling, n, model=model)
            if measuring:
                stats["rollouts"] += len(turns)
                stats["tokens"] += sum(len(t.output_ids) for t in turns)
                stats["request_s"].append(turns[0].request_s)
                stats["parse_s"].append(turns[0].parse_s)

    tasks = [asyncio.create_task(one()) for _ in range(max(1, inflight // n))]
    await asyncio.sleep(WARMUP_S)
    measuring = True
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    measuring = False
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()
    return {"rollouts": stats["rollouts"], "tokens": stats["tokens"], "wall_s": wall, "cpu_s": cpu,
            "request_s": stats["request_s"], "parse_s": stats["parse_s"]}


def _load_process(args: tuple, queue) -> None:
    queue.put(asyncio.run(_load(*args)))


def _metrics() -> "object | None":
    from asyncgrpo_cli.sampler.client import SyncSamplerClient

    with SyncSamplerClient(URL, timeout_s=30) as c:
        return c.read_metrics()


def screen_variant(name: str, prompts: list[list[int]], model: str) -> dict:
    from asyncgrpo_cli.sampler.server_load import request_time_means

    n, seeds, logprobs, max_tokens, procs, *rest = SCREEN_VARIANTS[name]
    tokens_route = bool(rest and rest[0])
    inflight = rest[1] if len(rest) > 1 else INFLIGHT
    before = _metrics()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (n, seeds, logprobs, max_tokens, inflight // procs, SCREEN_S, prompts, model, tokens_route)
    workers = [ctx.Process(target=_load_process, args=(args, queue)) for _ in range(procs)]
    for w in workers:
        w.start()
    parts: list[dict] = []
    running, waiting, kv = [], [], []  # vLLM's gauges every ~0.5 s while the load runs (the ceiling it reached)
    deadline = time.monotonic() + SCREEN_S + 240
    while len(parts) < procs and time.monotonic() < deadline:
        try:
            parts.append(queue.get(timeout=0.5))
        except Exception:  # noqa: BLE001 - queue.Empty: poll the gauges, then wait again
            now = _metrics()
            if now is not None:
                running.append(now.num_requests_running)
                waiting.append(now.num_requests_waiting)
                kv.append(now.kv_cache_usage_frac or 0.0)
    if len(parts) < procs:
        raise TimeoutError(f"{procs - len(parts)} load process(es) gave no result")
    for w in workers:
        w.join(30)
    after = _metrics()
    wall = max(p["wall_s"] for p in parts)
    rollouts, tokens = sum(p["rollouts"] for p in parts), sum(p["tokens"] for p in parts)
    request_s = [x for p in parts for x in p["request_s"]]
    parse_s = [x for p in parts for x in p["parse_s"]]
    row = {"variant": name, "n": n, "request_seeds": seeds, "logprobs": logprobs, "max_tokens": max_tokens,
           "load_processes": procs, "tokens_route": tokens_route, "inflight_rollouts": inflight, "wall_s": round(wall, 2),
           "rollouts_per_s": round(rollouts / wall, 1), "generated_tokens_per_s": round(tokens / wall, 1),
           "completion_tokens_mean": round(tokens / max(1, rollouts), 2),
           "load_cpu_frac": round(sum(p["cpu_s"] for p in parts) / wall / procs, 3),
           "request_s_mean": round(statistics.fmean(request_s), 4) if request_s else None,
           "parse_ms_mean": round(1000 * statistics.fmean(parse_s), 3) if parse_s else None}
    if before is not None and after is not None:  # warm-up requests finished in the window count too
        row["vllm_stage_s"] = {k: round(v, 4) for k, v in request_time_means(before, after).items()}
        row["vllm_running_after"] = after.num_requests_running
    if running:
        row["vllm_running_max"], row["vllm_waiting_max"] = max(running), max(waiting)
        row["vllm_running_median"] = statistics.median(running)
        row["kv_cache_usage_max"] = round(max(kv), 4)
    return row


def phase_screen() -> int:
    import httpx

    import one_gpu

    WORK.mkdir(parents=True, exist_ok=True)
    result: dict = {"issue": 41, "phase": "screen", "versions": versions(), "mps": mps_probe(),
                    "command": " ".join(serve_argv()[2:]), "runs": []}
    model, prompts = recipe_prompts(2048)
    result["workload"] = {"prompts": len(prompts), "inflight_rollouts": INFLIGHT, "seconds": SCREEN_S,
                          "warmup_s": WARMUP_S, "temperature": 1.0}
    write("rollouts_screen.json", result)
    log = open(WORK / "serve_screen.log", "w")
    t0 = time.monotonic()
    server = subprocess.Popen(serve_argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while time.monotonic() - t0 < 300 and server.poll() is None:
            try:
                if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        result["server_start_s"] = round(time.monotonic() - t0, 1)
        if server.poll() is not None:
            result["server_log_tail"] = (WORK / "serve_screen.log").read_text(errors="replace").splitlines()[-40:]
            write("rollouts_screen.json", result)
            return 1
        served = httpx.get(f"{URL}/v1/models", timeout=10).json()["data"][0]["id"]
        result["metrics_names"] = sorted({line.split("{")[0].split(" ")[0] for line in
                                          httpx.get(f"{URL}/metrics", timeout=10).text.splitlines()
                                          if line.startswith("vllm:") and "_seconds" in line})
        # The group request against vLLM itself: n completions, completion i sampled with seed + i (conformance).
        check = None if not SCREEN_CONFORMANCE else subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "group_request or tokens_route",
                                str(ROOT / "tests" / "sampler" / "test_conformance.py")], capture_output=True, text=True,
                               timeout=240, env={**os.environ, "ASYNCGRPO_CONFORMANCE_URL": URL})
        result["conformance_group_requests"] = (None if check is None else  # passed in the morning screen
                                                {"exit": check.returncode, "tail": check.stdout.splitlines()[-3:]})
        write("rollouts_screen.json", result)
        for name in (os.environ.get("SCREEN", "").split(",") if os.environ.get("SCREEN") else SCREEN_VARIANTS):
            try:
                row = screen_variant(name, prompts, served)
            except Exception as exc:  # noqa: BLE001 - one failed variant must not lose the others
                row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"}
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
            write("rollouts_screen.json", result)
        contenders = [r for r in result["runs"] if r.get("variant") in WINNER_OVERRIDES and r.get("rollouts_per_s")]
        if contenders:
            best = max(contenders, key=lambda r: r["rollouts_per_s"])
            result["winner"] = {"variant": best["variant"], "overrides": WINNER_OVERRIDES[best["variant"]],
                                "rollouts_per_s": best["rollouts_per_s"]}
            (WORK / "winner.txt").write_text(" ".join(WINNER_OVERRIDES[best["variant"]]))
        result["ceiling"] = ceiling_choice(result["runs"])
        (WORK / "ceiling.txt").write_text(" ".join(result["ceiling"]["overrides"]))
        write("rollouts_screen.json", result)
    finally:
        one_gpu.stop_server(server)
        log.close()
        result["gpu_processes_after"] = one_gpu.gpu_processes()
        write("rollouts_screen.json", result)
    return 0


def ceiling_choice(runs: list[dict], min_gain: float = 1.05) -> dict:
    """The rollout ceiling (``staleness.max_concurrent_rollouts``) the screen measured best: for each in-flight
    value with both a 64-token and a 12-token row (``group*``), its gain over the recipe's `INFLIGHT` is the
    geometric mean of the two rollouts/s ratios. The best wins if it gains at least ``min_gain``; else the recipe's
    stays. Above vLLM 0.33's default of 1,024 running sequences on an H200 the server also needs
    ``--max-num-seqs``. Returns ``{"inflight", "gain", "gains", "overrides"}`` (overrides: the job's, maybe [])."""
    rate = {(r.get("inflight_rollouts"), r.get("max_tokens")): r["rollouts_per_s"] for r in runs
            if r.get("variant", "").startswith("group") and r.get("n") == G and r.get("logprobs") == 8
            and not r.get("tokens_route") and r.get("load_processes") == 1 and r.get("rollouts_per_s")
            and r.get("request_seeds")}
    gains: dict[int, float] = {}
    for inflight in sorted({k[0] for k in rate}):
        if inflight == INFLIGHT or not all((x, t) in rate for x in (inflight, INFLIGHT) for t in (64, 12)):
            continue
        gains[inflight] = round(((rate[(inflight, 64)] / rate[(INFLIGHT, 64)])
                                 * (rate[(inflight, 12)] / rate[(INFLIGHT, 12)])) ** 0.5, 3)
    best = max(gains, key=gains.get, default=None)
    if best is None or gains[best] < min_gain:
        return {"inflight": INFLIGHT, "gain": 1.0, "gains": gains, "overrides": []}
    overrides = [f"staleness.max_concurrent_rollouts={best}"]
    if best > 1024:
        overrides.append(f"sampler.extra_args=[--max-num-seqs,{best}]")
    return {"inflight": best, "gain": gains[best], "gains": gains, "overrides": overrides}


# ---------------------------------------------------------------------------------------------- job
def _first_at(rows: list[dict], threshold: float, t1: float) -> float | None:
    for r in rows:
        if r.get("reward") is not None and r["reward"] >= threshold:
            return round(r["time"] - t1, 2)
    return None


#: Steps the sustained time to a reward averages (`time_to_reward_mean`).
REWARD_WINDOW = 3


def time_to_reward_mean(rows: list[dict], threshold: float, window: int = REWARD_WINDOW) -> float | None:
    """Seconds from step 1 to the first step whose mean ``reward`` over it and the ``window - 1`` steps before it
    (steps that logged one) reaches ``threshold``; ``None`` if none does.

    A step's ``reward`` is the mean of the rollouts scored in its window: a window with few scored groups can
    read far from the run's level (2026-12-04 fifth session: 0.500 at step 2 of a run at 0.11-0.13, one or two
    groups scored while the allowance held generation), and the first-crossing figure then reads 1.8 s. Rows
    are a job's (``t_since_step1_s``) or metrics.jsonl's (``time``, counted from the first row)."""
    scored = [r for r in rows if r.get("reward") is not None]
    if not rows:
        return None
    t1 = rows[0].get("time")
    for i in range(window - 1, len(scored)):
        if statistics.fmean(r["reward"] for r in scored[i - window + 1:i + 1]) >= threshold - 1e-9:  # float sums
            r = scored[i]
            return round(r["t_since_step1_s"] if "t_since_step1_s" in r else r["time"] - t1, 2)
    return None


def job_rows(rows: list[dict]) -> list[dict]:
    """One row per logged step with the figures the issue reads (time from step 1's log line)."""
    from asyncgrpo_cli.rollout.holds import HOLD_GATES, held_metric
    from asyncgrpo_cli.run.metrics_line import request_breakdown

    if not rows:
        return []
    t1 = rows[0]["time"]
    keys = ("perf/step_s", "perf/rollout_wait_s", "perf/fwd_bwd_s", "perf/optimizer_s", "reward", "rollout/rollouts_per_s", "rollout/groups_per_s",
            "rollout/generated_tokens_per_s", "batch/groups_per_step", "batch/trained_tokens_per_step",
            "frac_reward_zero_std", "completions/mean_length", "completions/duplicate_frac",
            "rollout/concurrency", "rollout/vllm_kv_cache_usage_frac",  # and every perf/weight_sync_* (below)
            "sample/staleness_mean", "sample/dropped_stale_count", "sampling/importance_sampling_ratio/mean",
            "rollout/request_s", "rollout/parse_s", "rollout/vllm_queue_s", "rollout/vllm_prefill_s",
            "rollout/vllm_decode_s", "rollout/vllm_request_s", "rollout/assembly_s", "rollout/score_s",
            # what held the producer, who used the host's cores, the trainer's host time (issues #41, #43)
            *(held_metric(g) for g in HOLD_GATES), "rollout/deadline_admission", "server/engine_core_cpu",
            "perf/fwd_bwd_cpu_s", "perf/fwd_bwd_cpu_wait_s", "perf/fwd_bwd_compile_count", "perf/gpu_memory_peak_gib", "perf/gpu_memory_reserved_gib",
            "perf/cuda_alloc_retries", "server/frontend_cpu", "rollout/worker_cpu", "rollout/worker_main_cpu",
            "host/cpu_busy_cores", "host/cpu_busy_frac")
    out = []
    for r in rows:
        row = {"step": r.get("step"), "t_since_step1_s": round(r["time"] - t1, 3)}
        row.update({k: r.get(k) for k in keys if r.get(k) is not None})
        row.update({k: v for k, v in r.items() if k.startswith("perf/weight_sync") and v is not None})
        b = request_breakdown(r)
        if b and b.get("binding"):
            row["request_binding"] = b["binding"]
            row["request_shares"] = {k: round(v, 3) for k, v in b["shares"].items()}
        out.append(row)
    return out


def job_figures(rows: list[dict], engine_rollouts_per_s: float | None = None) -> dict:
    """The issue's figures of one run: median step time of steps 2-10 and 31-40 (and their ratio), steps/s over
    steps 2-20 and 2-40, seconds from step 1 to reward 0.40 and 0.45 (first step at it, and the sustained
    `time_to_reward_mean` over `REWARD_WINDOW` steps), generation while training against the engine's offline
    rollouts/s."""
    by_step = {r["step"]: r for r in rows if r.get("step") is not None}

    def med(lo: int, hi: int) -> float | None:
        vals = [by_step[s]["perf/step_s"] for s in range(lo, hi + 1) if s in by_step and "perf/step_s" in by_step[s]]
        return round(statistics.median(vals), 3) if vals else None

    def steps_per_s(lo: int, hi: int) -> float | None:
        if lo in by_step and hi in by_step and by_step[hi]["time"] > by_step[lo]["time"]:
            return round((hi - lo) / (by_step[hi]["time"] - by_step[lo]["time"]), 4)
        return None

    t1 = by_step[min(by_step)]["time"] if by_step else None
    early, late = med(2, 10), med(31, 40)
    rates = [r["rollout/rollouts_per_s"] for r in rows[1:] if r.get("rollout/rollouts_per_s") is not None]
    gen = round(statistics.fmean(rates), 1) if rates else None
    return {
        "steps_logged": len(rows), "last_step": max(by_step) if by_step else None,
        "step_s_median_2_10": early, "step_s_median_31_40": late,
        "late_over_early_step_s": round(late / early, 3) if early and late else None,
        "steps_per_s_2_20": steps_per_s(2, 20), "steps_per_s_2_40": steps_per_s(2, 40),
        "time_to_reward_040_s": _first_at(rows, 0.40, t1) if t1 is not None else None,
        "time_to_reward_045_s": _first_at(rows, 0.45, t1) if t1 is not None else None,
        "time_to_reward_040_mean3_s": time_to_reward_mean(rows, 0.40),
        "time_to_reward_045_mean3_s": time_to_reward_mean(rows, 0.45),
        "generation_rollouts_per_s": gen,
        "generation_frac_of_engine": round(gen / engine_rollouts_per_s, 3) if gen and engine_rollouts_per_s else None,
    }


MPS_DIR = Path("/tmp/asyncgrpo_mps")


def mps_env() -> dict:
    """The CUDA MPS pipe and log folders of `start_mps` (clients find the daemon through the pipe folder)."""
    return {"CUDA_MPS_PIPE_DIRECTORY": str(MPS_DIR / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(MPS_DIR / "log")}


def start_mps() -> dict:
    """Start the CUDA MPS control daemon (``nvidia-cuda-mps-control -d``) and check that a CUDA client runs under
    it (a tensor on the GPU within 90 s). Returns what happened, ``ok`` among it; the job is only run when ok."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return {"ok": False, "why": "nvidia-cuda-mps-control is not on PATH"}
    for d in ("pipe", "log"):
        (MPS_DIR / d).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **mps_env()}
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=60)
    probe = subprocess.run([sys.executable, "-c", "import torch; x = torch.ones(1024, device='cuda'); "
                            "print(float(x.sum()))"], env=env, capture_output=True, text=True, timeout=90)
    log = MPS_DIR / "log" / "control.log"
    return {"ok": started.returncode == 0 and probe.returncode == 0, "control_exit": started.returncode,
            "probe_exit": probe.returncode, "probe_tail": (probe.stdout + probe.stderr).splitlines()[-3:],
            "control_log": log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []}


def stop_mps() -> list[str]:
    """Quit the MPS control daemon of `start_mps`; returns the tail of its control log (its clients, servers)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is not None:
        subprocess.run([control], input="quit\n", env={**os.environ, **mps_env()}, capture_output=True, text=True,
                       timeout=60)
    log = MPS_DIR / "log" / "control.log"
    return log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []


def phase_job(name: str) -> int:
    """``job NAME``: with ``JOB_MPS=1`` the job runs under CUDA MPS (started here, quit after), so vLLM's kernels
    and the trainer's can run at once on the one GPU (issue #41 item 3)."""
    import bench_e2e

    import one_gpu

    WORK.mkdir(parents=True, exist_ok=True)
    winner = (WORK / "winner.txt").read_text().split() if (WORK / "winner.txt").exists() else []
    # JOB_CEILING=1: the rollout ceiling the screen chose (`ceiling_choice`), as the next lever after the winner.
    ceiling_file = WORK / "ceiling.txt"
    ceiling = ceiling_file.read_text().split() if os.environ.get("JOB_CEILING") == "1" and ceiling_file.exists() else []
    # JOB_PACKED=auto: the packed-sync choice `run.sh bench` left on this machine (`one_gpu.packed_choice`).
    packed, packed_why = [], ""
    if os.environ.get("JOB_PACKED") == "auto":
        if one_gpu.PACKED_CHOICE.exists():
            packed_why = one_gpu.PACKED_CHOICE.read_text().strip()
            packed = [line for line in packed_why.splitlines() if line and line[0] != "#"]
        else:  # the bench did not run or failed before choosing: the pair still runs, plain
            packed_why = f"no {one_gpu.PACKED_CHOICE} (run.sh bench did not choose on this machine): plain sync"
            print(f"rollouts.py job: JOB_PACKED=auto: {packed_why}", flush=True)
    extra = [*winner, *ceiling, *packed, *os.environ.get("JOB_EXTRA", "").split()]
    run_dir = WORK / f"job_{name}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = job_argv(name, run_dir, extra)
    result: dict = {"issue": 41, "phase": f"job {name}", "versions": versions(), "command": " ".join(argv[2:]),
                    "gpu_processes_before": one_gpu.gpu_processes()}
    if packed_why:
        result["packed_choice"] = packed_why
    engine = WORK / "rollouts_engine.json"
    engine_rate = json.loads(engine.read_text()).get("engine_rollouts_per_s") if engine.exists() else None
    env = None
    if os.environ.get("JOB_MPS") == "1":
        result["mps"] = start_mps()
        if not result["mps"]["ok"]:
            result["mps"]["control_log_after"] = stop_mps()
            write(f"rollouts_job_{name}.json", result)
            print(json.dumps(result["mps"]), flush=True)
            return 1
        env = {**os.environ, **mps_env()}
    write(f"rollouts_job_{name}.json", result)
    log = WORK / f"job_{name}.log"

    def tick() -> None:  # the rows so far, every 10 s: a call cut by the device's limit still returns them
        rows = bench_e2e.read_metrics(run_dir)
        result.update({"figures": job_figures(rows, engine_rate), "rows": job_rows(rows)})
        write(f"rollouts_job_{name}.json", result)

    try:
        ran = bench_e2e.run_until(argv, log, JOB_DEADLINE_S, 90.0, tick, env=env)
    finally:
        if env is not None:
            result.setdefault("mps", {})["control_log_after"] = stop_mps()
    rows = bench_e2e.read_metrics(run_dir)
    result.update({**ran, "summary": bench_e2e.summarize(rows),
                   "figures": job_figures(rows, engine_rate), "engine_rollouts_per_s": engine_rate,
                   "rows": job_rows(rows), "gpu_processes_after": one_gpu.gpu_processes()})
    plain = (WORK / f"job_{name}.log").read_text(errors="replace").splitlines()
    result["plain_tail"] = [line for line in plain if line.startswith("step ")][-6:]
    result["tree_attention"] = tree_attention_line(run_dir / "logs" / "trainer.log")
    write(f"rollouts_job_{name}.json", result)
    print(json.dumps(result["figures"]), flush=True)
    subprocess.run(["tar", "czf", str(OUT / f"logs_job_{name}.tgz"), "-C", str(WORK), f"job_{name}.log",
                    f"job_{name}/metrics.jsonl", f"job_{name}/status.json", f"job_{name}/logs"], capture_output=True)
    return 0


def tree_attention_line(trainer_log: Path) -> str | None:
    """What the trainer said it trains with (``tree attention: flex (packing.attention=auto on cuda)``), from its
    log; None when the log or the line is missing (a trainer before 2026-12-05 printed none)."""
    try:
        text = trainer_log.read_text(errors="replace")
    except OSError:
        return None
    return next((line.split("asyncgrpo: ", 1)[1].strip() for line in text.splitlines()
                 if "asyncgrpo: tree attention: " in line), None)


def served_rate(screen: dict, tokens: float) -> float | None:
    """The served engine's rollouts/s alone (the screen's one-request-per-group rows at ~44 and ~12 tokens) at a
    mean completion length of ``tokens``: a rollout's time taken as linear in its tokens between the two rows (a
    per-request cost plus a per-token cost), clamped to their range."""
    rows = {r["variant"]: r for r in screen.get("runs", []) if r.get("rollouts_per_s")}
    if "group" not in rows or "group_short" not in rows:
        return None
    (l1, r1), (l2, r2) = ((rows[v]["completion_tokens_mean"], rows[v]["rollouts_per_s"]) for v in ("group_short", "group"))
    x = min(max(tokens, l1), l2)
    t = 1 / r1 + (x - l1) * (1 / r2 - 1 / r1) / (l2 - l1)
    return 1 / t


def generation_against_served(rows: list[dict], screen: dict) -> dict:
    """Per step, the job's generation rate over the served engine's alone at the step's completion length
    (`served_rate`); medians over steps 2-10 and 31-40 and over every step after the first."""
    fracs = {}
    for r in rows:
        rate, length = r.get("rollout/rollouts_per_s"), r.get("completions/mean_length")
        if r.get("step", 0) >= 2 and rate and length:
            served = served_rate(screen, length)
            if served:
                fracs[r["step"]] = rate / served

    def med(lo: int, hi: int) -> float | None:
        vals = [v for k, v in fracs.items() if lo <= k <= hi]
        return round(statistics.median(vals), 3) if vals else None

    return {"steps_2_10": med(2, 10), "steps_31_40": med(31, 40), "all": med(2, 10_000)}


STALL_OVER_MEDIAN = 4.0


def trainer_stalls(rows: list[dict], lo: int, hi: int) -> list[dict]:
    """Steps in ``(lo, hi]`` whose ``perf/step_s`` is `STALL_OVER_MEDIAN` times the median of those steps or more, with
    their forward and backward and the graphs compiled in them: one such step (a recompile: 14.8 s in the seventh
    session's on-policy run) moves a pair's steps/s by 10-15%, so the pair's JSON names it."""
    steps = [r for r in rows if r.get("step") and lo < r["step"] <= hi and r.get("perf/step_s")]
    if not steps:
        return []
    median = statistics.median(r["perf/step_s"] for r in steps)
    return [{"step": r["step"], "step_s": round(r["perf/step_s"], 2),
             "median_step_s": round(median, 2), "fwd_bwd_s": r.get("perf/fwd_bwd_s"),
             "compile_count": r.get("perf/fwd_bwd_compile_count")}
            for r in steps if r["perf/step_s"] >= STALL_OVER_MEDIAN * median]


def step_budget(rows: list[dict], lo: int, hi: int) -> dict | None:
    """Mean seconds a step over ``(lo, hi]``: the whole step (``step``), the trainer's own work (``train``: forward,
    backward and optimizer), the weight sync (``weight_sync``: generation is paused through it) and the rest
    (``rest``: waiting for rollouts, and the host's work around them). None without rows in the range."""
    steps = [r for r in rows if r.get("step") and lo < r["step"] <= hi and r.get("perf/step_s")]
    if not steps:
        return None
    mean = (lambda key: sum(r.get(key) or 0.0 for r in steps) / len(steps))
    step, wsync = mean("perf/step_s"), mean("perf/weight_sync_s")
    train = mean("perf/fwd_bwd_s") + mean("perf/optimizer_s")
    return {"steps": len(steps), "step": round(step, 3), "train": round(train, 3), "weight_sync": round(wsync, 3),
            "rest": round(step - train - wsync, 3)}


def one_gpu_bound(sync_rows: list[dict], lo: int, hi: int) -> dict | None:
    """Issue #41 item 6: what bounds asynchronous over on-policy steps/s on one GPU, from the on-policy run's own
    step budget (`step_budget`, its stalls left out). An asynchronous step overlaps generation with training but
    not with the weight sync (the server is paused through it), so even with generation as fast while training as
    alone it takes at least ``max(rest, train) + weight_sync``: the ratio is at most ``step / that``
    (``async_over_sync_steps_per_s_max``); ``without_the_pause`` is the same bound had the sync not paused
    generation. A generation-bound run (``rest`` well above ``train``) gains little from the overlap."""
    stalls = {s["step"] for s in trainer_stalls(sync_rows, lo, hi)}
    budget = step_budget([r for r in sync_rows if r.get("step") not in stalls], lo, hi)
    if not budget:
        return None
    rest, train, wsync, step = budget["rest"], budget["train"], budget["weight_sync"], budget["step"]
    return {"sync_step_budget_s": budget, "stalls_left_out": sorted(stalls),
            "async_over_sync_steps_per_s_max": round(step / (max(rest, train) + wsync), 3),
            "without_the_pause": round(step / max(rest, train + wsync), 3)}


def combine(async_path: str, sync_path: str, out_path: str, screen_path: str | None = None,
            engine_path: str | None = None) -> dict:
    """The async/sync pair's JSON (issue #41 item 4): both runs' rows and figures and the ratios; with the screen's
    JSON, generation while training against the served engine alone at the same completion length
    (`generation_against_served`), and with the engine's JSON, its offline rows beside them."""
    a, s = json.loads(Path(async_path).read_text()), json.loads(Path(sync_path).read_text())
    fa, fs = a["figures"], s["figures"]

    def ratio(x, y):
        return round(x / y, 3) if x and y else None

    lo, hi = 2, min(fa.get("last_step") or 0, fs.get("last_step") or 0, STEPS)
    pa = {r["step"]: r["t_since_step1_s"] for r in a["rows"]}
    ps = {r["step"]: r["t_since_step1_s"] for r in s["rows"]}
    seconds = (lambda p: p[hi] - p[lo] if lo in p and hi in p and p[hi] > p[lo] else None)
    span = (lambda p: (hi - lo) / seconds(p) if seconds(p) else None)
    stalls = {"async": trainer_stalls(a["rows"], lo, hi), "sync": trainer_stalls(s["rows"], lo, hi)}

    def span_without_stalls(p, name):  # each stall step counted at its run's median step instead
        if not seconds(p):
            return None
        return (hi - lo) / (seconds(p) - sum(x["step_s"] - x["median_step_s"] for x in stalls[name]))
    # Steps of the two modes differ in size: an on-policy round ends once its wave is back with half its target
    # (`rollout.on_policy.MIN_FILL`), so late on-policy steps held 37-43 groups against the asynchronous 64.
    # Trained groups per second over the same step range compares the work done.
    trained = (lambda run, p: sum(r.get("batch/groups_per_step") or 0 for r in run["rows"] if lo < r["step"] <= hi)
               / seconds(p) if seconds(p) else None)
    ga, gs = trained(a, pa), trained(s, ps)
    out = {"issue": 41, "steps_compared": [lo, hi],
           "async_over_sync_steps_per_s": ratio(span(pa), span(ps)),
           # the same with each stall (`trainer_stalls`: a recompile, not the mode) at its run's median step
           "async_over_sync_steps_per_s_without_stalls": ratio(span_without_stalls(pa, "async"),
                                                               span_without_stalls(ps, "sync")),
           "async_over_sync_groups_per_s": ratio(ga, gs),
           "trained_groups_per_s": {"async": round(ga, 2) if ga else None, "sync": round(gs, 2) if gs else None},
           "async_over_sync_time_to_reward": ratio(fs.get("time_to_reward_040_s"), fa.get("time_to_reward_040_s")),
           # the same from the rows, sustained over REWARD_WINDOW steps (older files lack the figure)
           "time_to_reward_mean3_s": {f"{x:.2f}": {"async": time_to_reward_mean(a["rows"], x),
                                                   "sync": time_to_reward_mean(s["rows"], x)} for x in (0.40, 0.45)},
           "async_over_sync_time_to_reward_mean3": ratio(time_to_reward_mean(s["rows"], 0.40),
                                                         time_to_reward_mean(a["rows"], 0.40)),
           "targets": {"generation_frac_of_served_engine": ">= 0.70 (the served engine alone at the step's "
                                                           "completion length; see engine_offline for why not the "
                                                           "offline figure)",
                       "late_over_early_step_s": "<= 2.0", "time_to_reward_045_s": "<= 40",
                       "async_over_sync_steps_per_s": ">= 1.3",
                       "async_over_sync_time_to_reward": ">= 1.5 (to reward 0.40)"},
           "measured": {"late_over_early_step_s": fa.get("late_over_early_step_s"),
                        "time_to_reward_045_s": fa.get("time_to_reward_045_s"),
                        "time_to_reward_045_mean3_s": time_to_reward_mean(a["rows"], 0.45)},
           "trainer_stalls": stalls,
           "one_gpu_bound": one_gpu_bound(s["rows"], lo, hi),
           "async_step_budget_s": step_budget(a["rows"], lo, hi),
           "async": a, "sync": s}
    if screen_path:
        screen = json.loads(Path(screen_path).read_text())
        out["generation_frac_of_served_engine"] = {"screen": Path(screen_path).name, "screen_date": screen["versions"].get("date"),
                                                   "async": generation_against_served(a["rows"], screen),
                                                   "sync": generation_against_served(s["rows"], screen)}
        out["measured"]["generation_frac_of_served_engine"] = out["generation_frac_of_served_engine"]["async"]["all"]
    if engine_path:
        engine = json.loads(Path(engine_path).read_text())
        out["engine_offline"] = {"file": Path(engine_path).name, "runs": engine.get("runs"),
                                 "start_s": engine.get("start_s"), "workload": engine.get("workload"),
                                 "note": "vLLM's offline LLM.generate builds every token's top-k log-prob objects in "
                                         "one process; the job's server spreads that over its API servers, so the "
                                         "job's figures 'generation_frac_of_engine' (against this) exceed 1 and the "
                                         "served engine alone is the anchor"}
    Path(out_path).write_text(json.dumps(out, indent=1))
    return out


def main() -> int:
    phase = sys.argv[1] if len(sys.argv) > 1 else "screen"
    if phase == "engine":
        return phase_engine()
    if phase == "screen":
        return phase_screen()
    if phase == "job":
        return phase_job(sys.argv[2] if len(sys.argv) > 2 else "async")
    if phase == "served":  # served SCREEN JOB.json...: each job's generation against the served engine, stored in it
        screen = json.loads(Path(sys.argv[2]).read_text())
        for path in sys.argv[3:]:
            job = json.loads(Path(path).read_text())
            job["generation_frac_of_served_engine"] = {"screen": Path(sys.argv[2]).name,
                                                       **generation_against_served(job["rows"], screen)}
            Path(path).write_text(json.dumps(job, indent=1))
            print(path, json.dumps(job["generation_frac_of_served_engine"]))
        return 0
    if phase == "combine":
        rest = sys.argv[4:] + [None] * 3
        out = combine(sys.argv[2], sys.argv[3], rest[0] or "rollouts_async_sync.json", rest[1], rest[2])
        print(json.dumps({k: v for k, v in out.items() if k not in ("async", "sync", "engine_offline")}, indent=1))
        return 0
    print(f"rollouts.py: unknown phase {phase!r} (engine, screen, job NAME, combine A S [OUT [SCREEN [ENGINE]]])")
    return 2


if __name__ == "__main__":
    sys.exit(main())
