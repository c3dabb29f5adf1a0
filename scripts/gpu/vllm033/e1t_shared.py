"""Why the one-GPU job's trainer step is 3-4x slower than on an idle H200 (issues #41 item 6, #43 item 3).

    python3 scripts/gpu/vllm033/e1t_shared.py        # (bash scripts/gpu/vllm033/run.sh e1t_shared)

E1t (`scripts/bench/bench_small.py`: the 135M recipe's 16K-token early row, fwd+bwd) took 0.308 s on an idle H200
under the image's torch 2.11 (`scripts/bench/results/E1t_smollm2-135m_pack_numpy.json`, 49 groups: 6.3 ms a
group). In the job the same step took 17-25 ms a group (one server; 39 with two; on-policy 18-20; under CUDA MPS
17: `scripts/gpu/results/vllm033/rollouts_job_*.json`, steps 2-10). Four things differ between the two, and this
runs the same benchmark with each added in turn, back to back on one machine:

1. ``stack_idle``: the job's software (vLLM 0.33's torch 2.14 and its transformers, staged by ``install.py``),
   nothing else on the GPU; and ``stack_idle_sdpa``, the same with the sdpa tree backend (a dense ``[L, L]``
   mask per row), which every GPU job ran before 2026-12-05: the trainer resolved ``packing.attention=auto`` while
   its model was still on the CPU (`asyncgrpo_cli.train.tree_attention.apply_tree_attention`); ``sdpa_over_flex``
   says what that cost;
2. ``server_idle``: ``asyncgrpo serve +recipe=arith_vllm_1gpu`` up on the same GPU (the recipe's colocated memory
   share, CUDA graphs captured), no request;
3. ``server_busy``: the same server generating the job's early requests (one per group of 8, top-8 log-probs,
   per-request seeds, 64-token cap, `INFLIGHT` rollouts in flight, through the project's ``SamplerClient``) from
   a load process for as long as the benchmark runs;
4. ``server_busy_quiet_host``: as 3, with the benchmark's threads given `QUIET_CORES` cores of their own
   (``os.sched_setaffinity``; the server's processes and the load keep the others), which tells host contention
   from GPU sharing.

Each row keeps E1t's early and late rows (``fwd_bwd_s``, CUDA events), the benchmark's run-queue wait per step
(``cpu_wait_s_per_step``: waiting for a core), the machine's busy share, and for 3-4 the load's rollouts/s and the
server's CPU use. ``ratios`` divides each step by the one before. Writes ``$OUT/e1t_shared.json`` and the
benchmark's own files under ``$OUT/e1t_shared/``. The commands are checked on CPU in CI
(``tests/test_gpu_script_configs.py``).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rollouts.py adds the repository, scripts/gpu and bench

import rollouts as r  # noqa: E402

PORT = int(os.environ.get("E1T_PORT", 8000))
URL = f"http://127.0.0.1:{PORT}"
START_S = float(os.environ.get("E1T_START_S", 420))  # a cold first vLLM start took 181-185 s on the H200
INFLIGHT = 512  # the recipe's staleness.max_concurrent_rollouts
MAX_TOKENS = 64  # the recipe's max_completion_length (early completions are ~42 tokens)
BENCH_TIMEOUT_S = float(os.environ.get("E1T_BENCH_TIMEOUT_S", 150))
QUIET_CORES = int(os.environ.get("E1T_QUIET_CORES", 4))
PHASES = ("stack_idle", "server_idle", "server_busy", "server_busy_quiet_host")  # the chain of `ratios`
#: the committed idle figure under the image's torch 2.11 (early row, seconds)
IMAGE_IDLE_S = 0.308


def bench_argv(label: str, out: Path, attention: str = "auto") -> list[str]:
    """E1t's benchmark on the early and late rows, named ``label`` (``attention``: the tree backend)."""
    return [sys.executable, str(r.ROOT / "scripts" / "bench" / "bench_small.py"), "--rows", "early,late",
            "--steps", "10", "--label", label, "--attention", attention, "--out", str(out)]


def serve_argv() -> list[str]:
    """The recipe's own server line (its colocated share) on `PORT`."""
    return [sys.executable, "-m", "asyncgrpo_cli", "serve", f"+recipe={r.RECIPE}", f"sampler.port={PORT}"]


async def _load_until(stop, prompts: list[list[int]], model: str, out) -> None:
    """Keep `INFLIGHT` rollouts in flight at `URL` until ``stop`` is set; put (rollouts, wall s) on ``out``."""
    from asyncgrpo_cli.sampler.client import SamplerClient, SamplingParams

    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, logprobs=8)
    client = SamplerClient(URL, max_concurrency=INFLIGHT // r.G + 4, timeout_s=300, request_seeds=True)
    done, index, errors = [0], [0], []

    async def one() -> None:
        while not stop.is_set():
            prompt = prompts[index[0] % len(prompts)]
            index[0] += 1
            try:
                done[0] += len(await client.generate_turns(prompt, sampling, r.G, model=model))
            except Exception as exc:  # noqa: BLE001 - counted and named: a load that fails must not pass as light
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(one()) for _ in range(INFLIGHT // r.G)]
    await asyncio.sleep(r.WARMUP_S)
    t0, n0 = time.perf_counter(), done[0]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    out.put((done[0] - n0, time.perf_counter() - t0, len(errors), errors[:3]))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()


def _load_process(stop, prompts, model, out) -> None:
    asyncio.run(_load_until(stop, prompts, model, out))


def run_bench(label: str, out: Path, cores: set[int] | None = None, attention: str = "auto") -> dict:
    """One benchmark run (``cores``: the CPUs it may use); its figures, or an error."""
    t0 = time.monotonic()
    kwargs = {"preexec_fn": (lambda: os.sched_setaffinity(0, cores))} if cores else {}
    try:
        done = subprocess.run(bench_argv(label, out, attention), capture_output=True, text=True,
                              timeout=BENCH_TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired:
        return {"error": f"the benchmark ran past {BENCH_TIMEOUT_S:g} s"}
    files = sorted(out.glob(f"E1t_*_{label}.json"))
    if done.returncode != 0 or not files:
        return {"error": f"exit {done.returncode}", "tail": (done.stdout + done.stderr).splitlines()[-15:]}
    data = json.loads(files[-1].read_text())
    keep = ("fwd_bwd_s", "fwd_bwd_min_s", "pack_row_s", "cpu_s_per_step", "cpu_wait_s_per_step", "host_cpu_busy_frac")
    rows = {k: {f: v.get(f) for f in keep} for k, v in data["figures"].items()}
    return {"fwd_bwd_s": data["fwd_bwd_s"], "rows": rows, "torch": data.get("torch"), "cores": sorted(cores or []),
            "groups_early": data["workload"]["rows"]["early"]["groups"], "wall_s": round(time.monotonic() - t0, 1)}


def quiet_cores(server_pids: list[int]) -> set[int] | None:
    """`QUIET_CORES` CPUs for the benchmark: the last ones of this process's set, taken from the server's
    processes (their affinity set to the rest). None when the machine has too few."""
    from asyncgrpo_cli.train.engine_cpu import read_tree_cpu

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < QUIET_CORES + 4:
        return None
    quiet, rest = set(mine[-QUIET_CORES:]), set(mine[:-QUIET_CORES])
    for top in server_pids:
        for pid in read_tree_cpu(top):
            try:
                os.sched_setaffinity(pid, rest)
            except OSError:
                pass
    os.sched_setaffinity(0, rest)  # this process and the load it starts from now on
    return quiet


def ratios(phases: dict) -> dict:
    """Each phase's early-row step over the one before (the first over `IMAGE_IDLE_S`)."""
    out, before, name_before = {}, IMAGE_IDLE_S, "image_idle"
    for name in PHASES:
        s = phases.get(name, {}).get("fwd_bwd_s")
        if s:
            out[f"{name}_over_{name_before}"] = round(s / before, 3)
            before, name_before = s, name
    return out


def main() -> int:
    import one_gpu

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cut call still stops the server (finally)
    out = r.OUT / "e1t_shared"
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"issue": [41, 43], "phase": "E1t beside vLLM", "versions": r.versions(),
                    "commands": {"bench": " ".join(bench_argv("LABEL", Path("OUT"))[1:]),
                                 "serve": " ".join(serve_argv()[2:])},
                    "image_idle_fwd_bwd_s": IMAGE_IDLE_S, "load": {"inflight": INFLIGHT, "max_tokens": MAX_TOKENS,
                                                                    "n": r.G, "logprobs": 8, "seeds": True},
                    "phases": {}}
    result["phases"]["stack_idle"] = run_bench("stack_idle", out)
    r.write("e1t_shared.json", result)
    sdpa = result["phases"]["stack_idle_sdpa"] = run_bench("stack_idle_sdpa", out, attention="sdpa")
    flex = result["phases"]["stack_idle"].get("fwd_bwd_s")
    if flex and sdpa.get("fwd_bwd_s"):
        result["sdpa_over_flex"] = round(sdpa["fwd_bwd_s"] / flex, 3)
    r.write("e1t_shared.json", result)
    log = open(r.WORK / "serve_e1t.log", "w")
    server = subprocess.Popen(serve_argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ctx = mp.get_context("spawn")
    stop, loads = ctx.Event(), []
    try:
        import rollouts_two

        result["server_start_s"] = rollouts_two.wait_healthy(server, URL, START_S)
        if result["server_start_s"] is None:
            result["server_log_tail"] = (r.WORK / "serve_e1t.log").read_text(errors="replace").splitlines()[-40:]
            r.write("e1t_shared.json", result)
            return 1
        result["gpu_processes"] = one_gpu.gpu_processes()
        result["phases"]["server_idle"] = run_bench("server_idle", out)
        r.write("e1t_shared.json", result)
        import httpx

        model = httpx.get(f"{URL}/v1/models", timeout=10).json()["data"][0]["id"]
        _, prompts = r.recipe_prompts(2048)
        for name in ("server_busy", "server_busy_quiet_host"):
            cores = quiet_cores([server.pid]) if name == "server_busy_quiet_host" else None
            if name == "server_busy_quiet_host" and cores is None:
                result["phases"][name] = {"error": f"fewer than {QUIET_CORES + 4} CPUs here"}
                break
            stop.clear()
            queue = ctx.Queue()
            load = ctx.Process(target=_load_process, args=(stop, prompts, model, queue))
            load.start()
            loads.append(load)
            cpu0, t0 = rollouts_two.cpu_seconds(server), time.monotonic()
            time.sleep(r.WARMUP_S + 2)
            row = run_bench(name, out, cores)
            server_cpu = rollouts_two.cpu_use(cpu0, rollouts_two.cpu_seconds(server), time.monotonic() - t0)
            stop.set()
            try:
                rollouts, wall, failed, first_errors = queue.get(timeout=60)
                row["load_rollouts_per_s"] = round(rollouts / max(wall, 1e-3), 1)
                row["load_errors"], row["load_first_errors"] = failed, first_errors  # 2026-12-05: 5.7 rollouts/s
            except Exception:  # noqa: BLE001 - queue.Empty: the load gave no figure
                row["load_rollouts_per_s"] = None
            load.join(30)
            row["server_cpu_cores"] = server_cpu
            result["phases"][name] = row
            result["ratios"] = ratios(result["phases"])
            print(json.dumps({name: row}), flush=True)
            r.write("e1t_shared.json", result)
    finally:
        stop.set()
        for load in loads:
            if load.is_alive():
                load.terminate()
        one_gpu.stop_server(server)
        log.close()
        result["gpu_processes_after"] = one_gpu.gpu_processes()
        result["ratios"] = ratios(result["phases"])
        r.write("e1t_shared.json", result)
    print(json.dumps(result["ratios"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
