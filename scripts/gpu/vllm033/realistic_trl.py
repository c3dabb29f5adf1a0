"""The TRL side of issue #42 (``realistic.py trl [colocate|server]``) and the comparisons (``realistic.py combine``,
``realistic.py compare``).

``trl``: TRL's ``GRPOTrainer`` through `trl_run.py` in a child process (so that its failure, its GPU memory and
a deadline are the parent's to record), over the same number of completions as our asynchronous run
(`trl_plan`), with ``nvidia-smi`` polled as for our job. ``colocate`` first; when it trains no step, its exact
error is kept and, if the call has `SERVER_MIN_S` left, the server mode runs on the same GPU: TRL's own
``vllm serve`` line (``trl.scripts.vllm_serve.build_command``: NCCL weight transfer, processed log-probs,
``VLLM_SERVER_DEV_MODE=1``) at TRL's colocated memory share, then the trainer with ``vllm_mode="server"``.
Writes ``$OUT/realistic_trl.json``.

``combine IN [OUT]``: from ``realistic_job_async.json``, ``realistic_job_sync.json``, ``realistic_trl.json`` and
``realistic_engine.json`` in ``IN`` (the fetched results; symbolic links to dated files are followed, and each
source's file name is recorded), writes ``realistic_async_sync.json`` (our pair, the engine's ceiling,
``ours_over_trl``, the issue's targets, and each variant ``realistic_job_<name>.json`` in ``IN`` against the same
on-policy run and TRL) and ``realistic_trl.json`` (TRL's, with
``ours_over_trl``) into ``OUT`` (default ``scripts/gpu/results/vllm033``). ``realistic_job_sync.json`` and
``realistic_engine.json`` may be missing (a session whose device time held no on-policy run or no engine run):
the figures that need them are then None.

``compare OUT BASE OTHER...``: our job runs of one session side by side, without TRL (`compare_jobs`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import realistic as R

SERVER_MIN_S = float(os.environ.get("TRL_SERVER_MIN_S", 330))  # vLLM start + trainer start + a few steps
SERVER_PORT = int(os.environ.get("TRL_SERVER_PORT", 8011))
TRL_GPU_UTIL = float(os.environ.get("TRL_GPU_UTIL", 0.3))  # TRL's default vllm_gpu_memory_utilization
DEFAULT_COMPLETIONS, DEFAULT_PER_STEP = 20 * 48, 48
# Our asynchronous run's result: this machine's (same call series), else the committed one (it travels with the tree).
ASYNC_RESULTS = [R.WORK / "realistic_job_async.json",
                 R.ROOT / "scripts" / "gpu" / "results" / "vllm033" / "realistic_job_async.json",
                 R.ROOT / "scripts" / "gpu" / "results" / "vllm033" / "realistic_job_async_s18.json"]  # 2026-12-06


def async_result_path(work: Path | None = None) -> Path | None:
    """The asynchronous run TRL's plan follows: this machine's newest ``realistic_job_async*.json`` in ``work``
    (default `realistic.WORK`; a variant such as ``_clip_release4`` included: the s26 TRL run, finding no plain
    ``realistic_job_async.json`` there, planned from s18's committed run and ran 29 steps against our 20), else the
    first of `ASYNC_RESULTS` that exists."""
    here = sorted((work or R.WORK).glob("realistic_job_async*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return here[0] if here else next((p for p in ASYNC_RESULTS[1:] if p.exists()), None)


def trl_plan(async_result: dict | None) -> dict:
    """Steps and completions per step for TRL: as many completions as our asynchronous run trained, in steps of
    about its completions per step (rounded to a multiple of 8). The run is `async_result_path`'s; without one,
    960 in steps of 48. ``TRL_COMPLETIONS`` / ``TRL_PER_STEP`` win over both."""
    total, per_step, source = DEFAULT_COMPLETIONS, DEFAULT_PER_STEP, "default"
    rows = (async_result or {}).get("rows") or []
    done = [r["completions"] for r in rows if r.get("completions")]
    if done:
        total, source = int(sum(done)), "async run"
        per_step = max(R.G, R.G * round(sum(done) / len(done) / R.G))
    total = int(os.environ.get("TRL_COMPLETIONS", total))
    per_step = int(os.environ.get("TRL_PER_STEP", per_step))
    return {"completions": total, "per_step": per_step, "steps": max(2, math.ceil(total / per_step)),
            "source": source if "TRL_COMPLETIONS" not in os.environ else "TRL_COMPLETIONS"}


def trl_argv(mode: str, rows: Path, plan: dict, server_url: str | None = None) -> list[str]:
    model, data = R.paths()
    argv = [sys.executable, str(R.HERE / "trl_run.py"), "--mode", mode, "--model", str(model), "--data", str(data),
            "--steps", str(plan["steps"]), "--per-step", str(plan["per_step"]), "--rows", str(rows),
            "--output-dir", str(R.WORK / f"trl_{mode}_out"), "--learning-rate", str(R.LEARNING_RATE),
            "--completion", str(R.COMPLETION), "--max-model-len", str(R.MAX_MODEL_LEN),
            "--gpu-memory-utilization", str(TRL_GPU_UTIL)]
    cpu_check = ["--no-bf16"] if os.environ.get("TRL_BF16", "1") == "0" else []  # TRL refuses bf16 without a GPU
    return argv + cpu_check + (["--server-url", server_url] if server_url else [])


def read_records(path: Path) -> list[dict]:
    """The runner's JSON lines (`bench_e2e.read_jsonl`)."""
    import bench_e2e

    return bench_e2e.read_jsonl(path)


def trl_figures(records: list[dict]) -> dict:
    """From `trl_run.py`'s records: trained (completion) tokens per second and seconds per 1,000 completions
    over the steps after the first (wall clock from step 1's end to the last step's, as ours), the share of a
    step spent training (after the reward call), and every step's row."""
    steps = [r for r in records if "step" in r and "time" in r]
    out: dict = {"steps": len(steps), "rows": steps,
                 "completions_total": sum(r["completions"] for r in steps)}
    if len(steps) < 3:
        out["note"] = "fewer than 3 steps: no steady-state figures"
        return out
    kept, span = steps[1:], steps[-1]["time"] - steps[0]["time"]
    tokens, completions = sum(r["completion_tokens"] for r in kept), sum(r["completions"] for r in kept)
    step_s = sum(r["generate_s"] + r["train_s"] for r in kept)
    out.update({"steps_measured": len(kept), "wall_s": round(span, 2),
                "trained_tokens_per_s": round(tokens / span, 1) if span > 0 else None,
                "s_per_1000_completions": round(1000 * span / completions, 2) if completions else None,
                "completions_after_step1": completions,
                "train_frac": round(sum(r["train_s"] for r in kept) / step_s, 4) if step_s else None,
                "completion_mean_length": round(tokens / completions, 1) if completions else None})
    return out


def exact_error(records: list[dict], log_text: str) -> str | None:
    """The child's own error record, else the last ``...Error: ...`` line of its log, else None."""
    for r in reversed(records):
        if r.get("error"):
            return r["error"]
    for line in reversed(log_text.splitlines()):
        if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]:
            return line.strip()[:2000]
    return None


def serve_argv(port: int = SERVER_PORT) -> list[str]:
    """TRL's own ``vllm serve`` line for the stand-in (the trainer on the same GPU keeps 1 - `TRL_GPU_UTIL`)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    model, _ = R.paths()
    return build_command(ScriptArguments(model=str(model), host="127.0.0.1", port=port,
                                         gpu_memory_utilization=TRL_GPU_UTIL, max_model_len=R.MAX_MODEL_LEN))


def start_server(argv: list[str], log: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, float | None]:
    """Start the server and wait for ``/health`` (or its exit); returns it and the seconds it took (None: not up)."""
    import httpx

    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{SERVER_PORT}/health", timeout=2).status_code == 200:
                return proc, round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        try:
            proc.wait(timeout=2)  # the pause between polls, ended early by the server's exit
        except subprocess.TimeoutExpired:
            pass
    return proc, None


def run_mode(mode: str, plan: dict) -> dict:
    """One TRL run in ``mode`` (``server`` starts and stops its server); the record of it."""
    import gpu_memory

    rows, log = R.WORK / f"trl_{mode}_rows.jsonl", R.WORK / f"trl_{mode}.log"
    rows.unlink(missing_ok=True)
    out: dict = {"mode": mode}
    server = None
    poller = gpu_memory.Poller(R.POLL_S).start()
    try:
        url = None
        if mode == "server":
            argv = serve_argv()
            out["server_command"] = "VLLM_SERVER_DEV_MODE=1 " + " ".join(argv)
            server_log = R.WORK / "trl_vllm_server.log"  # not trl_server.log: the trainer's log in this mode
            server, out["server_start_s"] = start_server(argv, server_log)
            if out["server_start_s"] is None:
                out["error"] = "the server did not answer /health"
                out["server_log_tail"] = server_log.read_text(errors="replace").splitlines()[-40:]
                return out
            url = f"http://127.0.0.1:{SERVER_PORT}"
        argv = trl_argv(mode, rows, plan, url)
        out["command"] = "PYTHONPATH=scripts/gpu/vllm033:$PYTHONPATH " + " ".join(["python3", *argv[1:]])
        deadline = max(60.0, R.CALL_S - (time.monotonic() - R.T0) - 30)
        out["deadline_s"] = round(deadline, 1)
        out.update(R.run_until(argv, log, deadline, 30, env=R.child_env()))
    finally:
        poller.stop()
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    records = read_records(rows)
    text = log.read_text(errors="replace") if log.exists() else ""
    out["versions"] = next((r["versions"] for r in records if "versions" in r), None)
    out["grpo_config"] = next((r["grpo_config"] for r in records if "grpo_config" in r), None)
    out["figures"] = trl_figures(records)
    out["logs"] = [r["log"] for r in records if "log" in r]
    out["vllm_version_warning"] = next((ln.strip() for ln in text.splitlines() if "TRL currently supports" in ln), None)
    out["gpu_memory"] = {**gpu_memory.summary(poller.samples, poller.processes,
                                              TRL_GPU_UTIL if mode == "server" else None),
                         "poll_errors": poller.errors}
    if out.get("exit") not in (0, None) or out["figures"]["steps"] == 0:
        out["error"] = exact_error(records, text)
        out["traceback"] = next((r["traceback"] for r in records if r.get("traceback")), None)
        out["log_tail"] = text.splitlines()[-60:]
    return out


def phase_trl(mode: str = "colocate") -> int:
    if mode not in ("colocate", "server"):
        print(f"realistic.py trl {mode!r}: use colocate or server")
        return 2
    async_json = async_result_path()
    async_result = json.loads(async_json.read_text()) if async_json else None
    result: dict = {"issue": 42, "phase": f"trl {mode}", "versions": R.versions(), "stand_in": R.build(),
                    "plan": {**trl_plan(async_result), "from": str(async_json) if async_json else None}, "runs": {}}
    R.write("realistic_trl.json", result)
    result["runs"][mode] = run_mode(mode, result["plan"])
    R.write("realistic_trl.json", result)
    left = R.CALL_S - (time.monotonic() - R.T0)
    if mode == "colocate" and result["runs"]["colocate"]["figures"]["steps"] == 0:
        if left >= SERVER_MIN_S:
            result["runs"]["server"] = run_mode("server", result["plan"])
        else:
            result["runs"]["server"] = {"not_run": f"{left:.0f} s left of the call, {SERVER_MIN_S:.0f} needed: "
                                                   "run `bash scripts/gpu/vllm033/run.sh realistic_trl_server`"}
    ran = [r for r in result["runs"].values() if r.get("figures", {}).get("steps")]
    result["figures"] = ran[0]["figures"] if ran else None
    result["mode_measured"] = ran[0]["mode"] if ran else None
    R.write("realistic_trl.json", result)
    print(json.dumps({k: v for k, v in (result["figures"] or {}).items() if k != "rows"}), flush=True)
    return 0 if ran else 1


# ---------------------------------------------------------------------------------------------- combine
# The busy target is the "at least 70% of each step": the lowest step's share after the first.
TARGETS = {"async_over_sync_trained_tok_s": 1.5, "ours_over_trl_trained_tok_s": 2.0, "async_busy_frac_min_step": 0.70,
           "generation_frac_of_engine": 0.60}


def _ratio(x, y):
    return round(x / y, 3) if x and y else None


def _job_logprobs(run: dict) -> int:
    """The top log-probs one of our jobs asked vLLM for: its command's ``rollout.num_sampler_logprobs=N``, else the
    default 8."""
    for arg in (run.get("command") or "").split():
        if arg.startswith("rollout.num_sampler_logprobs="):
            return int(arg.split("=", 1)[1])
    return 8


def engine_for(engine: dict | None, run: dict) -> tuple[float | None, str | None]:
    """The engine's offline generated tok/s that ``run`` compares with, and which engine row it is: the row asking
    as many top log-probs as the job did; for a job asking none (``_clip``: the sampled token's only) without such
    a row, the row asking for no log-probs at all (an upper bound, so the job's share reads low); else the engine's
    headline (its first row, 8 log-probs)."""
    if not engine:
        return None, None
    rows = engine.get("runs") or []
    want = _job_logprobs(run)
    for r in rows:
        if r.get("logprobs") == want and r.get("generated_tok_s"):
            return r["generated_tok_s"], f"{r.get('variant')} (logprobs={want})"
    if want == 0:
        for r in rows:
            if r.get("logprobs") is None and r.get("generated_tok_s"):
                return r["generated_tok_s"], (f"{r.get('variant')} (no log-probs; the job asks the sampled token's: "
                                              "an upper bound)")
    return engine.get("engine_generated_tok_s"), "headline (logprobs=8)"


def ours_figures(run: dict, engine_tok_s: float | None, engine_row: str | None = None) -> dict:
    """Our run's figures over the steps after the first: trained tok/s (wall clock), busy share (whole run, and the
    least of a step: the issue asks 70% of each step), generated tok/s
    (the steps' windows weighted by their time, from the rows; the summary's figure without rows) and its share of
    the engine's offline rate, weight sync, s per 1,000 completions,
    and each process role's peak GPU memory."""
    s = run.get("summary") or {}
    gen = s.get("generated_tokens_per_s")
    timed = [(r["generated_tok_s"], r["step_s"]) for r in (run.get("rows") or [])[1:]
             if r.get("generated_tok_s") is not None and r.get("step_s")]
    if timed:  # the steps' rates weighted by their time (runs summarized before bench_e2e weighted them)
        gen = round(sum(v * t for v, t in timed) / sum(t for _, t in timed), 1)
    busy = [r["busy_frac"] for r in (run.get("rows") or [])[1:] if r.get("busy_frac") is not None]
    return {"steps_measured": s.get("steps_measured"), "trained_tokens_per_s": s.get("trained_tokens_per_s"),
            "busy_frac": s.get("trainer_busy_frac"), "busy_frac_min_step": min(busy) if busy else None,
            "generated_tokens_per_s": gen,
            "generation_frac_of_engine": _ratio(gen, engine_tok_s), "engine_row": engine_row,
            "engine_generated_tokens_per_s": engine_tok_s, "weight_sync_s": s.get("weight_sync_s"),
            "s_per_1000_completions": s.get("s_per_1000_completions"),
            "completions_after_step1": s.get("completions_after_step1"),
            "peak_mib_by_role": (run.get("gpu_memory") or {}).get("peak_mib_by_role")}


def _window_tok_s(rows: list[dict], last: int, tokens_key: str, time_key: str, first: int = 2) -> float | None:
    """Trained tokens per second of steps ``first``..``last`` of one run's rows (wall clock from step ``first - 1``'s
    end)."""
    by_step = {r.get("step"): r for r in rows}
    start = first - 1
    if start not in by_step or last not in by_step or any(by_step[k].get(time_key) is None for k in (start, last)):
        return None
    span = by_step[last][time_key] - by_step[start][time_key]
    tokens = sum(by_step[k].get(tokens_key) or 0 for k in range(first, last + 1) if k in by_step)
    return round(tokens / span, 1) if span > 0 else None


def same_steps(async_rows: list[dict], sync_rows: list[dict] | None, trl_rows: list[dict],
               steady: bool = False) -> dict | None:
    """Each run's trained tok/s over the same steps, 2..N with N the last step all of them logged (steps slow down
    as a policy learns, so runs of different lengths compare over their common range); None when a run has fewer
    than 3 steps or lacks the rows' times. ``steady``: over the second half, N/2..N (issue #42: steps 2-5 of the
    asynchronous run drained the queue its 26 s first step let build up, 9,898 tok/s over 2-20, 9,207 over 10-20).
    ``sync_rows`` None: no on-policy run on this machine (twenty-seventh session), so its figure and the ratios
    that take it are None and the window is the asynchronous run's and TRL's."""
    runs = (async_rows, trl_rows) if sync_rows is None else (async_rows, sync_rows, trl_rows)
    last = min(max((r.get("step") or 0 for r in rows), default=0) for rows in runs)
    if last < 3:
        return None
    first = max(2, last // 2) if steady else 2
    a = _window_tok_s(async_rows, last, "trained_tokens", "t_since_step1_s", first)
    s = None if sync_rows is None else _window_tok_s(sync_rows, last, "trained_tokens", "t_since_step1_s", first)
    t = _window_tok_s(trl_rows, last, "completion_tokens", "time", first)
    if None in (a, t) or (s is None and sync_rows is not None):
        return None
    return {"steps": f"{first}-{last}", "async_trained_tokens_per_s": a, "sync_trained_tokens_per_s": s,
            "trl_trained_tokens_per_s": t, "async_over_sync_trained_tok_s": _ratio(a, s),
            "ours_over_trl_trained_tok_s": _ratio(a, t), "sync_over_trl_trained_tok_s": _ratio(s, t)}


def targets_of(measured: dict) -> dict:
    """Each of `TARGETS` with its measured value and whether it is met (None: not measured)."""
    return {k: {"target": f">= {v}", "measured": measured.get(k),
                "met": None if measured.get(k) is None else measured[k] >= v} for k, v in TARGETS.items()}


def variants(folder: Path, sync_rows: list[dict] | None, trl_rows: list[dict], engine: dict | None) -> dict:
    """Each job variant in ``folder`` (``realistic_job_<mode>_<tags>.json``, tags of `realistic.JOB_TAGS`, such
    as ``async_mps``): its figures (`ours_figures`) and its trained tok/s over the same steps as the on-policy
    default and TRL (`same_steps`), keyed by the variant's name."""
    out = {}
    for path in sorted(folder.glob("realistic_job_*_*.json")):
        name = path.stem.removeprefix("realistic_job_")
        try:
            R.job_variant(name)
        except ValueError:
            continue
        run = json.loads(path.read_text())
        window = same_steps(run.get("rows") or [], sync_rows, trl_rows) or {}
        figures = ours_figures(run, *engine_for(engine, run))
        measured = {"async_over_sync_trained_tok_s": window.get("async_over_sync_trained_tok_s"),
                    "ours_over_trl_trained_tok_s": window.get("ours_over_trl_trained_tok_s"),
                    "async_busy_frac_min_step": figures["busy_frac_min_step"],
                    "generation_frac_of_engine": figures["generation_frac_of_engine"]}
        out[name] = {"file": path.resolve().name, "command": run.get("command"), "note": run.get("variant_note"),
                     "figures": figures,
                     "same_steps": {k.replace("async_", "variant_", 1).replace("ours_", "variant_", 1): v
                                    for k, v in window.items()} or None,
                     "targets": targets_of(measured)}
    return out


def combine(folder: Path, out_dir: Path | None = None) -> dict:
    """The issue's comparison from the fetched JSONs (module docstring). Raises FileNotFoundError naming a missing
    result and the phase that writes it."""
    folder = Path(folder)
    out_dir = Path(out_dir or R.ROOT / "scripts" / "gpu" / "results" / "vllm033")

    def load(name: str, phase: str, required: bool = True) -> dict | None:
        path = folder / name
        if not path.exists():
            if required:
                raise FileNotFoundError(f"{path}: missing; it is written by `run.sh {phase}` on the GPU")
            return None
        return {**json.loads(path.read_text()), "_file": path.resolve().name}

    a = load("realistic_job_async.json", "realistic_job_async")
    s = load("realistic_job_sync.json", "realistic_job_sync", False)  # None: no on-policy run on this machine
    trl, engine = load("realistic_trl.json", "realistic_trl"), load("realistic_engine.json", "realistic_engine", False)
    engine_tok_s = (engine or {}).get("engine_generated_tok_s")
    fa = ours_figures(a, *engine_for(engine, a))
    fs = ours_figures(s, *engine_for(engine, s)) if s is not None else None
    sync_tok_s = fs["trained_tokens_per_s"] if fs else None
    sync_rows = (s.get("rows") or []) if s is not None else None
    ft = {k: v for k, v in (trl.get("figures") or {}).items() if k != "rows"}
    trl_rows = (trl.get("figures") or {}).get("rows") or []
    window = same_steps(a.get("rows") or [], sync_rows, trl_rows)
    figures = {"async": fa, "sync": fs, "trl": {**ft, "mode": trl.get("mode_measured")},
               "engine_generated_tokens_per_s": engine_tok_s,
               "async_over_sync_trained_tok_s": _ratio(fa["trained_tokens_per_s"], sync_tok_s),
               "ours_over_trl_trained_tok_s": _ratio(fa["trained_tokens_per_s"], ft.get("trained_tokens_per_s")),
               "sync_over_trl_trained_tok_s": _ratio(sync_tok_s, ft.get("trained_tokens_per_s")),
               "same_steps": window,
               "steady_steps": same_steps(a.get("rows") or [], sync_rows, trl_rows, steady=True)}
    if window:  # the ratios the targets take: over the same steps when every run has its rows' times
        figures.update({k: window[k] for k in ("async_over_sync_trained_tok_s", "ours_over_trl_trained_tok_s",
                                               "sync_over_trl_trained_tok_s")})
    figures["variants"] = variants(folder, sync_rows, trl_rows, engine)
    ours_over_trl = figures["ours_over_trl_trained_tok_s"]
    measured = {"async_over_sync_trained_tok_s": figures["async_over_sync_trained_tok_s"],
                "ours_over_trl_trained_tok_s": ours_over_trl, "async_busy_frac_min_step": fa["busy_frac_min_step"],
                "generation_frac_of_engine": fa["generation_frac_of_engine"]}
    targets = targets_of(measured)
    sources = {k: {"file": v.get("_file"), "date": (v.get("versions") or {}).get("date"),
                   "gpu": (v.get("versions") or {}).get("gpu")} for k, v in
               (("async", a), ("sync", s or {}), ("trl", trl), ("engine", engine or {}))}
    out = {"issue": 42, "sources": sources,
           "how_to_read": "figures.<run> are each run's own summary (every step after the first, its busy share the "
                          "whole run's); same_steps are trained tok/s over the steps every run logged, and the ratios "
                          "and the targets use those; steady_steps are the same over the second half of those steps "
                          "(after the queue the first step left is drained), for reading only; each variant has its "
                          "own same_steps and targets against the same on-policy run and TRL; "
                          "figures.engine_generated_tokens_per_s is the engine's headline row (8 top log-probs), "
                          "while each run's generation_frac_of_engine compares with the row asking what the run "
                          "asks (its engine_row); figures.trl is TRL's own summary over all its steps after the "
                          "first, same_steps its steps in common with ours",
           "figures": figures, "ours_over_trl": ours_over_trl,
           "targets": targets, "async": a, "sync": s, "engine": engine}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "realistic_async_sync.json").write_text(json.dumps(out, indent=1))
    (out_dir / "realistic_trl.json").write_text(json.dumps({**trl, "source": trl.get("_file"),
                                                            "ours_over_trl": ours_over_trl,
                                                            "ours_async_figures": fa}, indent=1))
    return out


def compare_jobs(files: list[Path], out: Path, what: str = "") -> dict:
    """Our job runs of one machine and session side by side, without TRL (``realistic.py compare OUT A B ...``):
    each run's `ours_figures` (no engine), its trained tok/s over the same steps (2..N, N the last step every run
    logged) and over their second half, the median time of the steps whose trainer was busy throughout (busy >= 99%:
    the step without waiting, where a change to the trainer's own step shows) and the share of generated tokens
    dropped as too stale; then each run's ratio to the first (the baseline) over the same steps, and, where one run
    is on-policy (its name starts with ``sync``), each asynchronous run's ``async_over_sync_trained_tok_s`` with the
    issue's target. Writes ``out`` (JSON) and returns it. Raises ValueError with fewer than two files, for a file
    that is not one of our job results (no step rows with their times), for an ``out`` that is one of the inputs or
    named like a job result (``realistic_job_*``: a forgotten OUT would overwrite the first run), or when the runs
    share fewer than 3 steps; OSError for a file that cannot be read."""
    import statistics

    if len(files) < 2:
        raise ValueError("compare needs two job results or more (the first is the baseline)")
    out = Path(out)
    if out.name.startswith("realistic_job_") or out.resolve() in {Path(f).resolve() for f in files}:
        raise ValueError(f"OUT={out} is named like a job result (the first argument is where the comparison goes, "
                         "e.g. realistic_async_sync_..._sNN.json): it would be overwritten")
    runs = {}
    for path in map(Path, files):
        run = json.loads(path.read_text())
        if not isinstance(run, dict) or not any("t_since_step1_s" in r for r in run.get("rows") or []):
            raise ValueError(f"{path} is not one of our job results (realistic_job_*.json: step rows with "
                             "t_since_step1_s), e.g. an engine or TRL result")
        runs[path.stem.removeprefix("realistic_job_")] = (path, run)
    rows = {name: run.get("rows") or [] for name, (_p, run) in runs.items()}
    last = min(max((r.get("step") or 0 for r in rs), default=0) for rs in rows.values())
    if last < 3:
        raise ValueError(f"the runs share {last} step(s): at least 3 are needed (step 1 compiles)")
    windows = {"same_steps": 2, "steady_steps": max(2, last // 2)}
    tok_s = {w: {name: _window_tok_s(rs, last, "trained_tokens", "t_since_step1_s", first)
                 for name, rs in rows.items()} for w, first in windows.items()}
    base = next(iter(runs))
    sync = next((name for name in runs if name.startswith("sync")), None)
    table = {}
    for name, (path, run) in runs.items():
        later = [r for r in rows[name] if 2 <= (r.get("step") or 0) <= last]  # the same steps as the tok/s
        full = [r["step_s"] for r in later if (r.get("busy_frac") or 0) >= 0.99 and r.get("step_s")]
        summary = run.get("summary") or {}
        table[name] = {"file": path.name, "command": run.get("command"), "note": run.get("variant_note"),
                       "figures": ours_figures(run, None),
                       "same_steps_trained_tokens_per_s": tok_s["same_steps"][name],
                       "steady_steps_trained_tokens_per_s": tok_s["steady_steps"][name],
                       "busy_steps": len(full), "busy_step_s_median": round(statistics.median(full), 3) if full else None,
                       "fwd_bwd_s": summary.get("fwd_bwd_s"),
                       "dropped_stale_token_frac": summary.get("dropped_stale_token_frac"),
                       f"over_{base}_same_steps": _ratio(tok_s["same_steps"][name], tok_s["same_steps"][base]),
                       f"over_{base}_steady_steps": _ratio(tok_s["steady_steps"][name], tok_s["steady_steps"][base])}
    over_sync = ({name: _ratio(tok_s["same_steps"][name], tok_s["same_steps"][sync]) for name in runs if name != sync}
                 if sync else {})
    versions = next(iter(runs.values()))[1].get("versions") or {}
    result = {"issue": 42, "what": what, "date": versions.get("date"), "device": versions.get("gpu"),
              "same_steps": f"2-{last}", "steady_steps": f"{windows['steady_steps']}-{last}", "baseline": base,
              "how_to_read": "One run each, back to back on one machine, in the order listed. Trained tok/s over the "
                             "same steps are the tokens of those steps over the wall time from the step before the "
                             "first to the last (step 1 compiles and is left out); steady_steps are the second half "
                             "of them. busy_step_s_median is the median step of the steps the trainer was busy "
                             "throughout. The run-to-run spread of this job is not measured; its steps come in waves.",
              "runs": table, "async_over_sync_trained_tok_s": over_sync,
              "targets": {name: {k: v for k, v in targets_of(
                  {"async_over_sync_trained_tok_s": r,
                   "async_busy_frac_min_step": table[name]["figures"]["busy_frac_min_step"]}).items()
                  if v["measured"] is not None} for name, r in over_sync.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result
