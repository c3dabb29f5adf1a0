"""Real vLLM end to end through `asyncgrpo` on a 2-GPU machine (run by scripts/gpu/run_vllm_e2e.sh).

1. ``asyncgrpo serve +recipe=arith_vllm`` starts vLLM on GPU 0 with the builder's flags.
2. The sampler conformance suite runs against it (``ASYNCGRPO_CONFORMANCE_URL``).
3. ``asyncgrpo doctor`` passes; then the same doctor with one setting the server was not started for
   (``--max-logprobs`` too small, LoRA off) must fail and print the restart line.
4. ``asyncgrpo train +recipe=arith_vllm sampler.backend=external sampler.url=...``: trainer on GPU 1,
   full-weight sync over vLLM's NCCL engine. A thread samples the server's ``/metrics`` meanwhile.
5. ``$OUT/vllm_e2e.json``: versions, GPUs, steps, model versions, sync seconds, generated and trained
   tokens/s, step seconds and the fraction of time each side waited.

Environment: OUT (results folder), TRAIN_TIMEOUT_S (default 300), SERVER_START_TIMEOUT_S (240),
E2E_SKIP_CHECKS=1 (train only: skip steps 2 and 3, e.g. when a previous run on the machine showed them).
Extra arguments are passed to both `serve` and `train` as Hydra overrides.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import importlib.metadata as md

import httpx
from prometheus_client.parser import text_string_to_metric_families

OUT = Path(os.environ.get("OUT") or "gpu_out")
PORT = 8000
URL = f"http://127.0.0.1:{PORT}"
RUN_DIR = Path("/tmp/asyncgrpo_vllm_e2e")
RECIPE = ["+recipe=arith_vllm", f"sampler.port={PORT}", *sys.argv[1:]]
EXTERNAL = ["sampler.backend=external", f"sampler.url={URL}"]
CLI = [sys.executable, "-m", "asyncgrpo_cli"]
result: dict = {"date": time.strftime("%Y-%m-%d"), "recipe": "arith_vllm", "overrides": sys.argv[1:]}


def save() -> None:
    (OUT / "vllm_e2e.json").write_text(json.dumps(result, indent=1))


def run(name: str, argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run a command to completion; its output goes to $OUT/NAME.txt and is returned."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = 124, f"{exc.stdout or ''}{exc.stderr or ''}\n[timed out after {timeout} s]"
    (OUT / f"{name}.txt").write_text(text if isinstance(text, str) else text.decode(errors="replace"))
    print(f"== {name}: exit {rc} in {time.monotonic() - t0:.1f} s", flush=True)
    return rc, text


class LoadSampler(threading.Thread):
    """Samples vLLM's /metrics every ``period_s``: running and waiting requests, generated tokens."""

    def __init__(self, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period_s, self.samples, self.halt = period_s, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.halt.wait(self.period_s):
                try:
                    text = http.get(f"{URL}/metrics").text
                except httpx.HTTPError:
                    continue
                row = {"t": time.time(), "running": 0.0, "waiting": 0.0, "generated": 0.0}
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        key = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                               "vllm:generation_tokens_total": "generated"}.get(s.name)
                        if key:
                            row[key] += s.value
                self.samples.append(row)


def wait_for_server(server: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited with {server.returncode} before it was ready; see {OUT}/serve.txt")
        try:
            if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"vLLM was not ready after {timeout} s; see {OUT}/serve.txt")


def summarize_metrics(rows: list[dict], samples: list[dict]) -> dict:
    def series(key):
        return [r[key] for r in rows if r.get(key) is not None]

    def mean(xs):
        return round(statistics.fmean(xs), 4) if xs else None

    step_s, wait_s = series("perf/step_s"), series("perf/rollout_wait_s")
    out = {
        "logged_windows": len(rows),
        "last_step": rows[-1].get("step") if rows else None,
        "reward_first_windows": mean(series("reward")[:3]),
        "reward_last_windows": mean(series("reward")[-3:]),
        "weight_sync_s": mean(series("perf/weight_sync_s")),
        "weight_sync_transfer_s": mean(series("perf/weight_sync_transfer_s")),
        "weight_sync_pause_s": mean(series("perf/weight_sync_pause_s")),
        "generated_tokens_per_s": mean(series("rollout/generated_tokens_per_s")),
        "trained_tokens_per_s": mean(series("perf/wall_clock_trained_tokens_per_s")),
        "fwd_bwd_forwarded_tokens_per_s": mean(series("perf/fwd_bwd_forwarded_tokens_per_s")),
        "step_s": mean(step_s),
        "step_s_median": round(statistics.median(step_s), 4) if step_s else None,
        "trainer_wait_frac": round(sum(wait_s) / sum(step_s), 4) if step_s and sum(step_s) else None,
        "backpressure_s": mean(series("rollout/backpressure_s")),
        "sampling_logp_difference_mean": mean(series("sampling/sampling_logp_difference/mean")),
        "sampling_logp_difference_max": max(series("sampling/sampling_logp_difference/max"), default=None),
        "importance_sampling_ratio_mean": mean(series("sampling/importance_sampling_ratio/mean")),
        "staleness_mean": mean(series("sample/staleness_mean")),
        "packing_ratio": mean(series("batch/packing_ratio")),
        "kv_cache_usage_frac": mean(series("rollout/vllm_kv_cache_usage_frac")),
    }
    # The sampler's side, from its own /metrics: idle = no request running (between the first and
    # the last sample that had one), and generated tokens/s over that span.
    busy = [i for i, s in enumerate(samples) if s["running"] > 0]
    if busy:
        span = samples[busy[0]:busy[-1] + 1]
        out["sampler_idle_frac"] = round(sum(s["running"] == 0 for s in span) / len(span), 4)
        seconds = span[-1]["t"] - span[0]["t"]
        if seconds > 0:
            out["sampler_generated_tokens_per_s"] = round((span[-1]["generated"] - span[0]["generated"]) / seconds, 1)
        out["sampler_running_requests_mean"] = round(statistics.fmean(s["running"] for s in span), 1)
    return out


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    import torch

    result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    result["versions"] = {"torch": torch.__version__}
    for dist in ("vllm", "transformers", "accelerate"):
        try:
            result["versions"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            result["versions"][dist] = None
    save()

    serve_log = open(OUT / "serve.txt", "w")
    server = subprocess.Popen([*CLI, "serve", *RECIPE], stdout=serve_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        result["server_start_s"] = round(wait_for_server(server, float(os.environ.get("SERVER_START_TIMEOUT_S", 240))), 1)
        result["server_version"] = httpx.get(f"{URL}/version", timeout=10).json()
        save()

        if os.environ.get("E2E_SKIP_CHECKS") == "1":  # conformance and doctor already shown on this server
            return train_and_measure(server)
        env = dict(os.environ, ASYNCGRPO_CONFORMANCE_URL=URL)
        rc, text = run("conformance", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                       "tests/sampler/test_conformance.py"], 300, env)
        result["conformance"] = {"exit": rc, "summary": text.strip().splitlines()[-1] if text.strip() else ""}
        save()

        rc, text = run("doctor_ok", [*CLI, "doctor", *RECIPE, *EXTERNAL], 120)
        result["doctor_ok"] = {"exit": rc}
        checks = {}
        for name, extra in (("doctor_max_logprobs", ["rollout.num_sampler_logprobs=20"]),
                            ("doctor_lora", ["peft.enabled=true"])):
            rc, text = run(name, [*CLI, "doctor", *RECIPE, *EXTERNAL, *extra], 120)
            checks[name] = {"overrides": extra, "exit": rc,
                            "restart_line": next((ln.strip() for ln in text.splitlines() if "vllm serve" in ln), None)}
        result["doctor_misconfigured"] = checks
        save()

        return train_and_measure(server)
    finally:
        stop_server(server)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (SIGKILL after 30 s); a no-op once it is gone."""
    if server.poll() is None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        except ProcessLookupError:
            pass
    save()


def train_and_measure(server: subprocess.Popen) -> int:
    """Train against the running server while sampling its /metrics; record the figures."""
    sampler = LoadSampler()
    sampler.start()
    t0 = time.monotonic()
    train_log = open(OUT / "train.txt", "w")
    train = subprocess.Popen([*CLI, "train", *RECIPE, *EXTERNAL, "logging.dashboard=plain",
                              f"trainer.output_dir={RUN_DIR}"], stdout=train_log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    stopped_at_limit = False
    try:
        rc = train.wait(float(os.environ.get("TRAIN_TIMEOUT_S", 300)))
    except subprocess.TimeoutExpired:
        stopped_at_limit = True
        train.send_signal(signal.SIGINT)  # graceful: the supervisor saves and prints its summary
        try:
            rc = train.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(train.pid, signal.SIGKILL)
            rc = train.wait()
    sampler.halt.set()
    result["train"] = {"exit": rc, "wall_s": round(time.monotonic() - t0, 1), "stopped_at_limit": stopped_at_limit}
    rows = []
    metrics = RUN_DIR / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    status = json.loads((RUN_DIR / "status.json").read_text()) if (RUN_DIR / "status.json").exists() else {}
    result["final_model_version"] = status.get("model_version")
    result["final_step"] = status.get("step")
    result.update(summarize_metrics(rows, sampler.samples))
    for name in ("metrics.jsonl", "status.json", "training_curves.png"):
        if (RUN_DIR / name).exists():
            (OUT / name).write_bytes((RUN_DIR / name).read_bytes())
    for name in ("trainer.log", "server.log"):
        log = RUN_DIR / "logs" / name
        if log.exists():
            (OUT / f"{name}.tail.txt").write_text("\n".join(log.read_text(errors="replace").splitlines()[-300:]))
    (OUT / "server_load.jsonl").write_text("\n".join(json.dumps(s) for s in sampler.samples))
    stop_server(server)
    print(json.dumps(result, indent=1))
    checks_ok = os.environ.get("E2E_SKIP_CHECKS") == "1" or (
        result.get("conformance", {}).get("exit") == 0 and result.get("doctor_ok", {}).get("exit") == 0
        and all(c["exit"] != 0 and c["restart_line"] for c in result.get("doctor_misconfigured", {}).values()))
    # 130 = stopped by this runner's SIGINT at TRAIN_TIMEOUT_S (checkpoint saved); it must have trained.
    trained = rc == 0 or (result["train"]["stopped_at_limit"] and rc == 130 and (result["final_step"] or 0) > 0)
    ok = checks_ok and trained
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
