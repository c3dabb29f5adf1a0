"""Issue #41's next lever, screened before anything is built: two vLLM engines on the one GPU.

    python3 scripts/gpu/vllm033/rollouts_two.py      # (bash scripts/gpu/vllm033/run.sh rollouts_two)

Late in the one-GPU job both training modes wait on generation, and vLLM's engine-core step is host-bound for the
135M model (24 ms per output token at 512 running sequences, 87-92 ms at 2,048: `rollouts_screen_ceiling.json`),
so more requests in flight buy little. Two servers on the GPU each have an engine core of their own. This starts
``asyncgrpo serve +recipe=arith_vllm_1gpu`` twice (ports `PORTS`, the recipe's colocated memory share each, the
second once the first answers, so the second start finds vLLM's compile caches warm), then, for `SCREEN_S` s after
a warm-up, keeps rollouts in flight through the project's `SamplerClient` (one request per group, top-8
log-probs, per-request seeds: the job's requests), one load process per server:

- ``one_*``: everything to the first server (the baseline of this session);
- ``two_*``: half to each server at once (the sum of both).

at 44- and 12-token completions (the early and late steps' shapes) and 1,024 / 2,048 rollouts in flight in all.
Writes ``$OUT/rollouts_two_engines.json``: rollouts/s, generated tok/s and each server's vLLM gauges per variant,
and ``two_over_one`` (the sum of both servers over one, at the same total in flight). The job cannot use two
servers yet (one sampler URL, one weight sync): this only says whether building that is worth it. The served
line is checked on CPU in CI (``tests/test_gpu_script_configs.py``).
"""

from __future__ import annotations

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

PORTS = (int(os.environ.get("TWO_PORT_A", 8000)), int(os.environ.get("TWO_PORT_B", 8001)))
START_S = float(os.environ.get("TWO_START_S", 420))  # a cold first start took 181-185 s on the H200
#: name -> (servers, rollouts in flight in all, max tokens)
VARIANTS: dict[str, tuple[int, int, int]] = {
    "one_1024": (1, 1024, 64), "two_1024": (2, 1024, 64),
    "one_1024_short": (1, 1024, 12), "two_1024_short": (2, 1024, 12),
    "one_2048_short": (1, 2048, 12), "two_2048_short": (2, 2048, 12),
    "one_2048": (1, 2048, 64), "two_2048": (2, 2048, 64),
}


def serve_argv(port: int) -> list[str]:
    """One server of the pair: the recipe's own ``asyncgrpo serve`` line on ``port`` (its colocated share, ~0.1 of
    the GPU), with vLLM's running-sequence cap at 2,048 so the 2,048 variants are not capped by vLLM's default."""
    return [sys.executable, "-m", "asyncgrpo_cli", "serve", f"+recipe={r.RECIPE}", f"sampler.port={port}",
            "sampler.extra_args=[--max-num-seqs,2048]"]


def wait_healthy(server: subprocess.Popen, url: str, seconds: float) -> float | None:
    """Seconds until ``url``/health answers 200, or None when the server exits or ``seconds`` pass."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return None


def gauges(url: str) -> dict:
    """vLLM's running / waiting requests and KV-cache use at ``url`` now ({} when unreadable)."""
    from asyncgrpo_cli.sampler.client import SyncSamplerClient

    try:
        with SyncSamplerClient(url, timeout_s=10) as c:
            m = c.read_metrics()
    except Exception:  # noqa: BLE001 - a gauge is a best-effort extra
        return {}
    return {} if m is None else {"running": m.num_requests_running, "waiting": m.num_requests_waiting,
                                 "kv": round(m.kv_cache_usage_frac or 0.0, 4)}


def cpu_seconds(server: subprocess.Popen | None) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of ``server`` and every process under it: pid -> (name, seconds)
    (`asyncgrpo_cli.train.engine_cpu.read_tree_cpu`). vLLM names its processes (``VLLM::EngineCore``,
    ``ApiServer_N``), so the engine core's share shows."""
    from asyncgrpo_cli.train.engine_cpu import read_tree_cpu

    return {} if server is None else read_tree_cpu(server.pid)


def cpu_use(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float) -> dict:
    """Cores each process used over ``wall`` seconds: the busiest three by name, and the sum over the tree."""
    used = sorted(((after[pid][0], (after[pid][1] - before[pid][1]) / wall) for pid in after if pid in before),
                  key=lambda x: -x[1])
    return {"busiest": [[n, round(c, 2)] for n, c in used[:3]], "cores_all": round(sum(c for _, c in used), 2)}


def gpu_util() -> int | None:
    """``nvidia-smi``'s GPU utilisation now, in percent (None when unreadable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def variant(name: str, urls: list[str], prompts: list[list[int]], model: str,
            procs_of: list[subprocess.Popen] | None = None) -> dict:
    """One variant: a load process per server used, each with its share of the rollouts in flight. With the
    servers' processes (``procs_of``), it also reports each server's CPU use (cores) and the GPU's utilisation."""
    servers, inflight, max_tokens = VARIANTS[name]
    tops = list(procs_of or [])[:servers]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=r._load_process,
                         args=((r.G, True, 8, max_tokens, inflight // servers, r.SCREEN_S, prompts, model, False, url),
                               queue)) for url in urls[:servers]]
    for p in procs:
        p.start()
    started = time.monotonic()
    # The CPU window opens once the servers run requests and the load's warm-up has passed (or, with no gauge
    # showing running requests, 5 s after the warm-up), and closes at the first load process's result (the end
    # of its measured seconds).
    cpu0: list | None = None
    t0, busy_since, util, cpu = 0.0, None, [], []
    parts, seen = [], {url: [] for url in urls[:servers]}
    deadline = time.monotonic() + r.SCREEN_S + 240
    while len(parts) < servers and time.monotonic() < deadline:
        try:
            parts.append(queue.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: read the gauges, then wait again
            for url in seen:
                g = gauges(url)
                if g:
                    seen[url].append(g)
                    if busy_since is None and g.get("running"):
                        busy_since = time.monotonic()
            now = time.monotonic()
            if cpu0 is None and ((busy_since is not None and now - busy_since >= r.WARMUP_S)
                                 or now - started >= r.WARMUP_S + 5):
                cpu0, t0 = [cpu_seconds(t) for t in tops], time.monotonic()
            u = gpu_util() if tops and cpu0 is not None else None
            if u is not None:
                util.append(u)
        if parts and cpu0 is not None and not cpu:
            cpu = [cpu_use(b, cpu_seconds(t), max(1e-3, time.monotonic() - t0)) for b, t in zip(cpu0, tops)]
    for p in procs:
        p.join(30)
    if len(parts) < servers:
        return {"variant": name, "error": f"{servers - len(parts)} load process(es) gave no result"}
    wall = max(p["wall_s"] for p in parts)
    rollouts, tokens = sum(p["rollouts"] for p in parts), sum(p["tokens"] for p in parts)
    return {"variant": name, "servers": servers, "inflight_rollouts": inflight, "max_tokens": max_tokens,
            "wall_s": round(wall, 2), "rollouts_per_s": round(rollouts / wall, 1),
            "generated_tokens_per_s": round(tokens / wall, 1),
            "completion_tokens_mean": round(tokens / max(1, rollouts), 2),
            "per_server_rollouts_per_s": [round(p["rollouts"] / p["wall_s"], 1) for p in parts],
            "vllm_running_max": {u: max((g["running"] for g in v), default=None) for u, v in seen.items()},
            "kv_max": {u: max((g["kv"] for g in v), default=None) for u, v in seen.items()},
            "server_cpu_cores": cpu, "gpu_util_pct_mean": round(sum(util) / len(util), 1) if util else None,
            "gpu_util_samples": len(util)}


def two_over_one(runs: list[dict]) -> dict:
    """Each ``two_X`` variant's rollouts/s over its ``one_X`` baseline (same total in flight, same length)."""
    by = {x["variant"]: x.get("rollouts_per_s") for x in runs}
    return {k[4:]: round(by[k] / by["one_" + k[4:]], 3) for k in by
            if k.startswith("two_") and by.get(k) and by.get("one_" + k[4:])}


def main() -> int:
    import one_gpu

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cut call still stops both servers (finally)
    r.WORK.mkdir(parents=True, exist_ok=True)
    urls = [f"http://127.0.0.1:{p}" for p in PORTS]
    result: dict = {"issue": 41, "phase": "two engines on one GPU", "versions": r.versions(),
                    "commands": [" ".join(serve_argv(p)[2:]) for p in PORTS], "runs": []}
    model, prompts = r.recipe_prompts(2048)
    result["workload"] = {"prompts": len(prompts), "seconds": r.SCREEN_S, "warmup_s": r.WARMUP_S, "n": r.G,
                          "logprobs": 8, "request_seeds": True, "temperature": 1.0}
    servers: list[subprocess.Popen] = []
    logs = [open(r.WORK / f"serve_two_{p}.log", "w") for p in PORTS]
    try:
        for port, url, log in zip(PORTS, urls, logs):
            servers.append(subprocess.Popen(serve_argv(port), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
            result.setdefault("server_start_s", []).append(wait_healthy(servers[-1], url, START_S))
            r.write("rollouts_two_engines.json", result)
            if result["server_start_s"][-1] is None:
                result["server_log_tail"] = (r.WORK / f"serve_two_{port}.log").read_text(
                    errors="replace").splitlines()[-40:]
                r.write("rollouts_two_engines.json", result)
                return 1
        result["gpu_processes"] = one_gpu.gpu_processes()
        import httpx

        served = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        for name in (os.environ.get("TWO", "").split(",") if os.environ.get("TWO") else VARIANTS):
            try:
                row = variant(name, urls, prompts, served, servers)
            except Exception as exc:  # noqa: BLE001 - one failed variant must not lose the others
                row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"}
            result["runs"].append(row)
            result["two_over_one"] = two_over_one(result["runs"])
            print(json.dumps(row), flush=True)
            r.write("rollouts_two_engines.json", result)
    finally:
        for server in servers:
            one_gpu.stop_server(server)
        for log in logs:
            log.close()
        result["gpu_processes_after"] = one_gpu.gpu_processes()
        r.write("rollouts_two_engines.json", result)
    print(json.dumps(result.get("two_over_one")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
