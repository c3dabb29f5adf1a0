#!/usr/bin/env python3
"""End-to-end speed of the main job (issue #33, P12: asynchronous over on-policy): ``asyncgrpo train`` itself, one
variant after another, figures from each run's ``metrics.jsonl``.

    python scripts/bench/bench_e2e.py --recipe smoke --steps 20 \\
        --variant async= --variant sync=staleness.max_staleness=0 --out /tmp/benchout/p12_cpu.json

Each ``--variant NAME=OVERRIDES`` (space-separated Hydra overrides, may be empty) runs
``python -m asyncgrpo_cli train +recipe=RECIPE COMMON VARIANT trainer.max_steps=STEPS trainer.logging_steps=1
logging.dashboard=plain trainer.output_dir=WORK/NAME trainer.save_steps=1000000`` (``--server-url`` adds
``sampler.backend=external sampler.url=URL``: several variants share one server). A run still going at
``--deadline-s`` gets a SIGINT (it saves and stops) and its windows so far count. ``--repeats R`` alternates the
variants R times (A B A B ...), each repeat its own run.

Figures per run, over the logged windows after the first one (start-up and the first step excluded; with
``logging_steps=1`` a window is a step): steps/s and trained tokens/s over the wall clock between the first kept
window's end and the last one's, generated tokens/s, the trainer's waiting share (sum of ``perf/rollout_wait_s``
over sum of ``perf/step_s``), its busy share (1 − that), stale-dropped generated tokens, the importance ratio,
staleness, rollouts in flight, KV-cache usage, micro-batches per step, weight-sync time, and the reward of every
step. ``summary`` holds each variant's median over repeats and, with a variant named ``sync``, the ratios of every
other variant's steps/s and trained tokens/s over it.

Writes JSON (device, versions, date, command lines, workload, per-run figures, summary, ``target``) to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "asyncgrpo_cli"]
P12_TARGET = "asynchronous / on-policy (max_staleness=0) trained tokens/s >= 1.5 (issue #33 item 3)"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=OVERRIDES`` → (name, overrides split like a shell). Raises ValueError without a name."""
    name, _, overrides = text.partition("=")
    if not name.strip():
        raise ValueError(f"--variant {text!r}: give NAME=OVERRIDES (overrides may be empty: NAME=)")
    return name.strip(), shlex.split(overrides)


def train_argv(recipe: str, common: list[str], overrides: list[str], steps: int, run_dir: Path,
               server_url: str | None = None) -> list[str]:
    """The ``asyncgrpo train`` command line of one run (also composed and checked on CPU in CI)."""
    external = ["sampler.backend=external", f"sampler.url={server_url}"] if server_url else []
    return [*CLI, "train", f"+recipe={recipe}", *external, *common, *overrides, f"trainer.max_steps={steps}",
            "trainer.logging_steps=1", "logging.dashboard=plain", f"trainer.output_dir={run_dir}",
            "trainer.save_steps=1000000"]


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` ([] when it does not exist), a line cut by a stop left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the stop
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` windows (event markers such as ``{"event": "weight_sync_check", ...}`` left out)."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r]


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def _time_weighted(rows: list[dict], key: str) -> float | None:
    """The windows' rate ``key`` weighted by each window's ``perf/step_s``: the rate over the run's time. A plain mean
    of the windows' rates undercounts where finishes come in waves (issue #42: windows with none finished are 0, the
    next hold a burst in a short window): 7,572 against 9,028 tok/s on the twenty-second session's job."""
    pairs = [(r[key], r["perf/step_s"]) for r in rows if r.get(key) is not None and r.get("perf/step_s")]
    total = sum(w for _, w in pairs)
    return round(sum(v * w for v, w in pairs) / total, 4) if total > 0 else None


def summarize(rows: list[dict]) -> dict:
    """Figures of one run from its ``metrics.jsonl`` rows (module docstring); the first window is left out."""
    def series(key, rs):
        return [r[key] for r in rs if r.get(key) is not None]

    out: dict = {"windows": len(rows), "last_step": rows[-1].get("step") if rows else None,
                 "reward_per_step": [round(r["reward"], 4) if r.get("reward") is not None else None for r in rows]}
    kept = rows[1:]
    if len(kept) < 2:
        out["note"] = "fewer than 3 logged windows: no steady-state figures"
        return out
    span_s = kept[-1]["time"] - rows[0]["time"]
    steps = kept[-1]["step"] - rows[0]["step"]
    trained = sum(series("batch/trained_tokens_per_step", kept))
    step_s, wait_s = series("perf/step_s", kept), series("perf/rollout_wait_s", kept)
    wait_frac = sum(wait_s) / sum(step_s) if step_s and sum(step_s) > 0 else None
    out.update({
        "steps_measured": steps,
        "wall_s": round(span_s, 2),
        "steps_per_s": round(steps / span_s, 4) if span_s > 0 else None,
        "trained_tokens_per_s": round(trained / span_s, 1) if span_s > 0 else None,
        "generated_tokens_per_s": _time_weighted(kept, "rollout/generated_tokens_per_s"),
        "trainer_wait_frac": round(wait_frac, 4) if wait_frac is not None else None,
        "trainer_busy_frac": round(1 - wait_frac, 4) if wait_frac is not None else None,
        "step_s_median": round(statistics.median(step_s), 4) if step_s else None,
        "dropped_stale_token_frac": _mean(series("sample/dropped_stale_token_frac", kept)),
        "dropped_stale_count": sum(series("sample/dropped_stale_count", kept)),
        "cancelled_stale_count": sum(series("rollout/cancelled_stale_count", kept)),
        "requeued_stale_count": sum(series("rollout/requeued_stale_count", kept)),
        "importance_sampling_ratio_mean": _mean(series("sampling/importance_sampling_ratio/mean", kept)),
        "staleness_mean": _mean(series("sample/staleness_mean", kept)),
        "concurrency_mean": _mean(series("rollout/concurrency", kept)),
        "concurrency_cap_mean": _mean(series("rollout/concurrency_cap", kept)),
        "kv_cache_usage_frac": _mean(series("rollout/vllm_kv_cache_usage_frac", kept)),
        "microbatches_per_step": _mean(series("batch/microbatches_per_step", kept)),
        "trained_tokens_per_step": _mean(series("batch/trained_tokens_per_step", kept)),
        "frac_reward_zero_std": _mean(series("frac_reward_zero_std", kept)),
        "weight_sync_s": _mean(series("perf/weight_sync_s", kept)),
        "fwd_bwd_s": _mean(series("perf/fwd_bwd_s", kept)),
        "backpressure_s": _mean(series("rollout/backpressure_s", kept)),
        "reward_first_3": _mean(series("reward", rows)[:3]),
        "reward_last_3": _mean(series("reward", rows)[-3:]),
    })
    return out


def run_until(argv: list[str], log: Path, deadline_s: float, grace_s: float, on_tick=None, env=None) -> dict:
    """Run ``argv`` (own process group, output to ``log``) to its end or ``deadline_s`` (SIGINT: the job saves and
    stops; SIGKILL to its group ``grace_s`` later); ``on_tick()`` every 10 s while it runs. Returns exit, wall
    seconds, whether it was stopped at the deadline and whether it had to be killed."""
    t0 = time.monotonic()
    stopped = killed = False
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        while True:
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                pass
            elapsed = time.monotonic() - t0
            if not stopped and elapsed > deadline_s:
                stopped = True
                os.killpg(proc.pid, signal.SIGINT)
            elif stopped and not killed and elapsed > deadline_s + grace_s:
                killed = True
                os.killpg(proc.pid, signal.SIGKILL)
            if on_tick:
                on_tick()
    return {"exit": proc.returncode, "run_wall_s": round(time.monotonic() - t0, 1), "stopped_at_deadline": stopped,
            "killed": killed}


def run_variant(name: str, argv: list[str], run_dir: Path, deadline_s: float, env: dict | None = None,
                log: Path | None = None) -> dict:
    """Run one ``asyncgrpo train`` to its end or to ``deadline_s`` seconds (then SIGINT: it saves and stops; a
    run still alive 120 s later is killed with its process group, `run_until`). Returns its summary with exit
    code and wall time."""
    log = log or run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    ran = run_until(argv, log, max(1.0, deadline_s), 120.0, env=env)
    rc = ran["exit"]
    result = {"variant": name, "exit": rc, "stopped_at_deadline": ran["stopped_at_deadline"],
              "run_wall_s": ran["run_wall_s"], "command": shlex.join(argv[2:])}
    result.update(summarize(read_metrics(run_dir)))
    if rc not in (0, 130) or result.get("windows", 0) == 0:
        result["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    return result


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine()}
    for dist in ("asyncgrpo", "torch", "vllm", "transformers", "accelerate"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    except ImportError:
        out["device"] = None
    return out


def summary(runs: list[dict]) -> dict:
    """Median of each variant over its repeats, and every variant's ratios over ``sync`` when there is one."""
    by: dict[str, dict] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    out: dict = {}
    for name, rs in by.items():
        med = {}
        for key in ("steps_per_s", "trained_tokens_per_s", "generated_tokens_per_s", "trainer_wait_frac",
                    "dropped_stale_token_frac", "importance_sampling_ratio_mean"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            med[key] = round(statistics.median(vals), 4) if vals else None
        med["runs"] = len(rs)
        out[name] = med
    base = out.get("sync")
    if base and base.get("trained_tokens_per_s"):
        for name, med in out.items():
            if name != "sync" and med.get("trained_tokens_per_s") is not None:
                med["over_sync_trained_tokens_per_s"] = round(med["trained_tokens_per_s"] / base["trained_tokens_per_s"], 3)
                if med.get("steps_per_s") and base.get("steps_per_s"):
                    med["over_sync_steps_per_s"] = round(med["steps_per_s"] / base["steps_per_s"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--recipe", default="smoke")
    parser.add_argument("--steps", type=int, default=20, help="trainer.max_steps of every run")
    parser.add_argument("--variant", action="append", required=True, help="NAME=OVERRIDES (repeatable)")
    parser.add_argument("--common", default="", help="overrides every run gets (space-separated)")
    parser.add_argument("--server-url", default=None, help="train against this running server (external)")
    parser.add_argument("--deadline-s", type=float, default=3600.0, help="SIGINT a run still going after this")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", default="/tmp/asyncgrpo_bench_e2e")
    parser.add_argument("--out", required=True, help="JSON file to write (e.g. /tmp/benchout/p12_cpu.json)")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    work = Path(args.work)
    result = {"bench": "e2e (issue #33, P12)", "date": time.strftime("%Y-%m-%d"), "versions": versions(),
              "workload": {"recipe": args.recipe, "steps": args.steps, "common": args.common,
                           "server_url": args.server_url, "repeats": args.repeats},
              "figures_over": "logged windows after the first one (one window per step)", "target": P12_TARGET,
              "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for repeat in range(args.repeats):
        for name, overrides in variants:
            run_dir = work / f"{name}-{repeat}"
            if run_dir.exists():
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            argv = train_argv(args.recipe, shlex.split(args.common), overrides, args.steps, run_dir, args.server_url)
            print(f"bench_e2e: {name} (repeat {repeat}): {shlex.join(argv[2:])}", flush=True)
            run = run_variant(name, argv, run_dir, args.deadline_s)
            result["runs"].append(run)
            result["summary"] = summary(result["runs"])
            out.write_text(json.dumps(result, indent=1))
            print(json.dumps({k: run.get(k) for k in ("variant", "exit", "steps_per_s", "trained_tokens_per_s",
                                                      "trainer_wait_frac", "dropped_stale_token_frac")}), flush=True)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
