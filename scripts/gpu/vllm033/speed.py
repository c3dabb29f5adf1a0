"""Issue #33 on one H200 with vLLM 0.33 (staged by `install.py`): the one-GPU main job's speed, end to end.

    python3 scripts/gpu/vllm033/speed.py new   # the recipe as shipped now, on-policy, and the recipe's choices
    python3 scripts/gpu/vllm033/speed.py old   # the baseline: main at 3199842 (carried in .base/), same session

Every run is ``asyncgrpo train +recipe=arith_vllm_1gpu ...`` (`scripts/bench/bench_e2e.py`: figures over the
windows after the first one, one window per step). To spend the session's minutes on steps rather than on vLLM
starts, the variants of one server's flags train against one ``asyncgrpo serve`` of the recipe (the same command
line the job starts; ``sampler.backend=external``, the CUDA-IPC sync on the shared GPU as in the job).

new
  1. ``full``: the job exactly as a user runs it (the supervisor starts vLLM), `FULL_STEPS` steps;
  2. ``asyncgrpo serve +recipe=arith_vllm_1gpu``, then against it: ``async`` (the recipe, P12's asynchronous
     side), ``sync`` (``staleness.max_staleness=0``, P12's on-policy side), and the recipe's choices one at a time
     (`NEW_VARIANTS`: the token budget, the staleness bound);
old
  the code of 3199842 (``PYTHONPATH=.base``, its recipe: 1 API server, ``--enforce-eager``, token budget 4096,
  256 rollouts) serves and trains: ``old_async`` (as shipped), ``old_sync`` (``max_staleness=0``, a time window:
  it ran 0.034 steps/s), then this code against the same server with the old recipe's settings
  (`OLD_RECIPE_SETTINGS`): ``code_async`` and ``code_sync`` (what the code alone changed).

Each phase has `PHASE_BUDGET_S` seconds (env ``PHASE_BUDGET_S``); a variant gets its own deadline or what is left,
and is skipped when less than `MIN_RUN_S` is left. Writes ``$OUT/speed_<phase>.json`` after every run.
``SKIP_FULL=1`` leaves out phase new's ``full`` run; ``VARIANTS=async,sync`` picks phase new's runs; ``TAG=_a``
names the result ``speed_new_a.json``; ``KEEP_SERVER=1`` leaves phase new's server running for the next call
(which then uses it), ``speed.py stop`` stops it.

What a run costs on the H200 (2026-12-02): the first vLLM start of the recipe (8 API servers, CUDA graphs,
torch.compile) 179 s, later ones 94-106 s (compile cache); the trainer's own start 50-60 s before its first step;
a stop at the deadline (checkpoint of the step) 20-40 s. So 20 steps of the recipe take about 170 s against a
running server, and the ``full`` run about 330 s: one session (after the 7-minute stage) fits phase new with
SKIP_FULL=1 and about half of phase old.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import bench_e2e  # noqa: E402
import one_gpu  # noqa: E402

OUT = Path(os.environ.get("OUT") or "gpu_out")
WORK = Path("/tmp/asyncgrpo_speed")
CLI = [sys.executable, "-m", "asyncgrpo_cli"]
RECIPE = "arith_vllm_1gpu"
PORT = 8000
URL = f"http://127.0.0.1:{PORT}"
PHASE_BUDGET_S = float(os.environ.get("PHASE_BUDGET_S", 540))
MIN_RUN_S = 60.0
FULL_STEPS = 24
#: (name, overrides, steps, deadline seconds) against the served recipe; ``VARIANTS=a,b`` picks and orders them
#: (default: `DEFAULT_NEW`). Steps and deadlines leave 21+ windows (20 measured steps) at the 2026-12-02 rates.
WIDE = ["packing.token_budget=32768", "staleness.max_concurrent_rollouts=1024"]
ALL_NEW = {
    "async": ([], 24, 180),
    "sync": (["staleness.max_staleness=0"], 22, 215),
    # Twice the step and the rollout ceiling: the allowance (max_staleness x the step's tokens) lets about twice as
    # many rollouts run in vLLM's batch (the trainer waited 49-56% at 16K; vLLM's decode step, not its KV cache,
    # bounds generation: 2% KV used at ~400 in flight).
    "wide": (WIDE, 22, 200),
    "wide_sync": ([*WIDE, "staleness.max_staleness=0"], 22, 230),
    "tb4096": (["packing.token_budget=4096"], 20, 75),
    "staleness4": (["staleness.max_staleness=4"], 16, 75),
    "tb8192": (["packing.token_budget=8192"], 16, 75),
}
DEFAULT_NEW = ["async", "sync", "tb4096", "staleness4", "tb8192"]
NEW_VARIANTS = [(name, *ALL_NEW[name]) for name in
                (os.environ["VARIANTS"].split(",") if os.environ.get("VARIANTS") else DEFAULT_NEW)]
#: The settings the recipe had at 3199842, as overrides of today's recipe (the server side is the old serve's).
OLD_RECIPE_SETTINGS = ["packing.token_budget=4096", "staleness.max_concurrent_rollouts=256",
                       "sampler.api_server_count=1", "sampler.extra_args=[--enforce-eager]"]
OLD_VARIANTS = [
    ("old_async", "old", [], 24, 110),
    ("old_sync", "old", ["staleness.max_staleness=0"], 24, 110),
    ("code_async", "new", OLD_RECIPE_SETTINGS, 20, 80),
    ("code_sync", "new", [*OLD_RECIPE_SETTINGS, "staleness.max_staleness=0"], 20, 90),
]
TAG = os.environ.get("TAG", "")  # a suffix of the result file's name (several calls of one phase)
T0 = time.monotonic()
result: dict = {"issue": 33, "date": time.strftime("%Y-%m-%d"), "phase": None, "runs": [],
                "targets": {"p12": bench_e2e.P12_TARGET,
                            "on_policy": "sync: dropped stale generated tokens <= 5%, trained tokens/s >= 0.5x async",
                            "one_gpu_job": "async trained tokens/s >= 2x 1,936 (main at 3199842) with the trainer "
                                           "waiting <= 30% of the step, reward rising, importance ratio ~1"}}


def left() -> float:
    return PHASE_BUDGET_S - (time.monotonic() - T0)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    result["summary"] = bench_e2e.summary(result["runs"])
    (OUT / f"speed_{result['phase']}{TAG}.json").write_text(json.dumps(result, indent=1))


def old_env() -> dict:
    """The environment that runs main at 3199842: its package, conf and recipes from ``.base/`` first."""
    base = ROOT / ".base"
    if not (base / "asyncgrpo_cli").is_dir():
        raise SystemExit("speed.py old: .base/asyncgrpo_cli is missing: here, mkdir .base && git archive 3199842 "
                         "asyncgrpo_cli conf recipes | tar -x -C .base, then carry .base")
    # PYTHONSAFEPATH: ``python -m`` would put the working directory (this checkout, today's package) before
    # PYTHONPATH, in every process the job starts; on 2026-12-02 the "old" runs ran today's code for that reason.
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": f"{base}:{os.environ.get('PYTHONPATH', '')}"}


def serve_argv(overrides: list[str] | None = None) -> list[str]:
    """``asyncgrpo serve`` of the recipe on `PORT` (checked on CPU in CI)."""
    return [*CLI, "serve", f"+recipe={RECIPE}", f"sampler.port={PORT}", *(overrides or [])]


def start_server(name: str, env: dict | None = None, overrides: list[str] | None = None):
    import httpx

    log = open(WORK / f"serve_{name}.log", "w")
    t0 = time.monotonic()
    server = subprocess.Popen(serve_argv(overrides), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)

    def up() -> bool:
        try:
            return httpx.get(f"{URL}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return server.poll() is not None

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not up():
        time.sleep(1)
    entry = {"server": name, "start_s": round(time.monotonic() - t0, 1), "exit": server.poll(),
             "command": " ".join(serve_argv(overrides)[2:])}
    result.setdefault("servers", []).append(entry)
    if server.poll() is not None:
        entry["log_tail"] = (WORK / f"serve_{name}.log").read_text(errors="replace").splitlines()[-40:]
    save()
    return server, log


def run(name: str, overrides: list[str], steps: int, deadline: float, env: dict | None = None,
        external: bool = True) -> None:
    budget = min(deadline, left() - 15)
    if budget < MIN_RUN_S:
        result["runs"].append({"variant": name, "skipped": f"{left():.0f} s left in the phase"})
        save()
        return
    run_dir = WORK / name
    argv = bench_e2e.train_argv(RECIPE, [], overrides, steps, run_dir, URL if external else None)
    entry = bench_e2e.run_variant(name, argv, run_dir, budget, env=env, log=WORK / f"{name}.log")
    entry["overrides"] = overrides
    result["runs"].append(entry)
    save()
    print(json.dumps({k: entry.get(k) for k in ("variant", "exit", "steps_per_s", "trained_tokens_per_s",
                                                "generated_tokens_per_s", "trainer_wait_frac",
                                                "dropped_stale_token_frac", "importance_sampling_ratio_mean")}),
          flush=True)


def server_up() -> bool:
    import httpx

    try:
        return httpx.get(f"{URL}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def phase_new() -> None:
    """The variants against the served recipe. A server already answering at `URL` (``KEEP_SERVER=1`` left it
    from an earlier call on this machine) is used and left running; ``KEEP_SERVER=1`` leaves a started one running
    too (its pid in ``WORK/server.pid``) so that the next call spends no start on it."""
    if not os.environ.get("SKIP_FULL"):
        run("full", [], FULL_STEPS, 330, external=False)  # the supervisor starts vLLM: the job as shipped
    if server_up():
        result.setdefault("servers", []).append({"server": "recipe", "reused": True})
        server, log = None, None
    else:
        server, log = start_server("recipe")
        (WORK / "server.pid").write_text(str(server.pid))
    try:
        if server is None or server.poll() is None:
            for name, overrides, steps, deadline in NEW_VARIANTS:
                run(name, overrides, steps, deadline)
    finally:
        if server is not None and not os.environ.get("KEEP_SERVER"):
            one_gpu.stop_server(server)
        if log is not None:
            log.close()


def phase_old() -> None:
    env = old_env()
    server, log = start_server("old", env=env)
    try:
        if server.poll() is None:
            chosen = os.environ.get("VARIANTS", "").split(",") if os.environ.get("VARIANTS") else None
            for name, code, overrides, steps, deadline in OLD_VARIANTS:
                if chosen is not None and name not in chosen:
                    continue
                run(name, overrides, steps, deadline, env=env if code == "old" else None)
    finally:
        one_gpu.stop_server(server)
        log.close()


def phase_stop() -> None:
    """Stops the server a ``KEEP_SERVER=1`` call left (its process group, from ``WORK/server.pid``)."""
    import signal

    pid_file = WORK / "server.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        pid_file.unlink()


def main() -> int:
    phase = sys.argv[1] if len(sys.argv) > 1 else "new"
    result["phase"] = phase
    WORK.mkdir(parents=True, exist_ok=True)
    result["versions"] = one_gpu.versions()
    result["gpu_processes_before"] = one_gpu.gpu_processes()
    save()
    try:
        {"new": phase_new, "old": phase_old, "stop": phase_stop}[phase]()
    finally:
        result["gpu_processes_after"] = one_gpu.gpu_processes()
        result["phase_wall_s"] = round(time.monotonic() - T0, 1)
        save()
        subprocess.run(["tar", "czf", str(OUT / f"logs_speed_{phase}.tgz"), "-C", str(WORK), "--exclude=*.safetensors",
                        "--exclude=checkpoint-*", "."], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
