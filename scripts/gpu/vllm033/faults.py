"""Issue #45 item 3 on one H200 with vLLM 0.33 (staged by `install.py`): the fault drills of docs/FAULTS.md
against the one-GPU job as users run it (the supervisor starts vLLM itself).

    FAULTS=server_kill_sync,supervisor_kill,sigint,server_stop,engine_kill_sync bash scripts/gpu/vllm033/run.sh faults

Each drill starts ``asyncgrpo train +recipe=arith_vllm_1gpu trainer.max_steps=40 ... logging.dashboard=plain
trainer.logging_steps=1`` (`job_argv`) in a session of its own, waits for step 1 in ``metrics.jsonl`` (at most
`FIRST_STEP_S`), finds the server (`pick_server`: the top ``vllm serve`` process of the job's tree; the API
servers and the engine core are its children), then:

server_kill_sync
  kill -9 of the server during a weight sync. The trainer logs nothing when a sync starts: the marker is vLLM's
  access-log line ``POST /pause?mode=keep`` in ``logs/server.log`` (the sync's first route; ~0.3 s of transfer
  follows), watched every 10 ms; without one within `MARK_S` s, right after a new metrics line (its sync is
  then over), and ``marker`` says so.
supervisor_kill
  kill -9 of the supervisor (``asyncgrpo train`` itself) once step 1 is logged.
sigint
  SIGINT to the supervisor's process group (Ctrl-C) once step 2 is logged.
server_stop
  SIGSTOP of the server's group and tree for `STOP_S` s, then SIGCONT: when status.json and the console showed
  the hang and its end, and the next step; then SIGINT (exit times count from it).
engine_kill_sync
  kill -9 of vLLM's engine core (``VLLM::EngineCore``, `engine_core`) at the same mark: what the out-of-memory
  killer takes (it holds the GPU's share). With 8 API servers the top ``vllm serve`` process only manages them,
  and killing it (server_kill_sync) leaves its children to finish the sync (the first GPU run's
  ``resume_logged_after_mark``).

Per drill: exit status (None when killed), seconds from the fault to the supervisor's exit and until no process
of the job is left, checkpoints, status.json, the console's cause lines, the end of ``logs/trainer.log``, the
processes left (then SIGKILLed with their groups), nvidia-smi before and ~5 s after. Every wait is bounded and
clipped to FAULTS_BUDGET_S (default 520); a drill is skipped when less than `MIN_LEFT_S` s is left.
``$OUT/faults_gpu.json`` is written after every drill and every 10 s; one JSON line is printed per drill. The
job's line is checked on CPU in CI (tests/test_gpu_script_configs.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
for _path in (ROOT, ROOT / "scripts" / "bench", ROOT / "scripts" / "drills", HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_e2e  # noqa: E402
from smoke_faults import Proc, checkpoints, lines_with, status, steps, wait_for  # noqa: E402

OUT = Path(os.environ.get("OUT") or "gpu_out")
WORK = Path("/tmp/asyncgrpo_faults")
RECIPE = "arith_vllm_1gpu"
STEPS = 40
DRILLS = ("server_kill_sync", "supervisor_kill", "sigint", "server_stop", "engine_kill_sync")
BUDGET_S = float(os.environ.get("FAULTS_BUDGET_S", 520))
MIN_LEFT_S = 150.0  # a drill needs vLLM's start (~100 s) and a step or two
RESERVE_S = 20.0  # kept from every wait for the clean-up (kill, nvidia-smi, the JSON)
# vLLM start + graph capture + the first step. On a fresh machine vLLM's first start compiles and autotunes
# (181-185 s on the H200, 85 s once its caches are warm) and the trainer needs ~60 s more: 240 s cut the
# 2026-12-04 engine_kill_sync drill before its first step (faults_gpu_3.json). FAULTS_FIRST_STEP_S overrides it.
FIRST_STEP_S = float(os.environ.get("FAULTS_FIRST_STEP_S", 330))
EXIT_S = 120.0  # the fault -> the supervisor's exit
GONE_S = 30.0  # its exit -> the last process of the job gone
MARK_S = 60.0
STOP_S = 60.0
SYNC_MARK = re.compile(r"POST /pause[?\s]")
SERVER_LINE = re.compile(r"started the server \(pid (\d+)\)")
STATUS_KEYS = ("state", "step", "model_version", "note", "stopping", "trainer_state", "server_status",
               "last_checkpoint", "resume_command")
T0 = time.monotonic()
result: dict = {"issue": 45, "phase": "faults", "drills": []}
_written = [0.0]


def job_argv(run_dir: Path) -> list[str]:
    """The drills' ``asyncgrpo train`` line (bench_e2e's, as rollouts.py's job: it adds
    ``trainer.save_steps=1000000``; the recipe's 1000 saves within 40 steps neither); checked on CPU in CI."""
    return bench_e2e.train_argv(RECIPE, [], [], STEPS, run_dir)


def drill_names(text: str | None) -> list[str]:
    """The drills of ``FAULTS`` (comma-separated, in that order; empty or unset: `DRILLS`). Raises ValueError
    naming an unknown one."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()] or list(DRILLS)
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        raise ValueError(f"FAULTS: unknown drill(s) {', '.join(unknown)} (known: {', '.join(DRILLS)})")
    return names


def is_vllm_server(argv: list[str]) -> bool:
    """Whether a command line is ``vllm serve`` (the ``vllm`` script, or ``-m vllm.entrypoints.cli.main``)."""
    return "serve" in argv and any(os.path.basename(a) == "vllm" or a.startswith("vllm.entrypoints") for a in argv)


def pick_server(rows: list[dict]) -> int | None:
    """The server among a job's processes (dicts with ``pid``, ``ppid``, ``argv``): the ``vllm serve`` process
    whose parent is none (forked API servers keep its command line; spawned ones and the engine core are
    retitled ``VLLM::...``); the first in ``rows`` (`tree` lists parents first). None when there is none."""
    servers = [r for r in rows if is_vllm_server(r["argv"])]
    pids = {r["pid"] for r in servers}
    tops = [r for r in servers if r["ppid"] not in pids]
    return tops[0]["pid"] if tops else None


def tree(pid: int) -> list[dict]:
    """``pid`` and its descendants now: pid, ppid, pgid, argv."""
    rows = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return rows
    for p in procs:
        try:
            rows.append({"pid": p.pid, "ppid": p.ppid(), "pgid": os.getpgid(p.pid), "argv": p.cmdline()})
        except (psutil.Error, OSError):
            continue
    return rows


def signal_server(pid: int, sig: int) -> dict:
    """``sig`` to the server's process group (it is a session leader: `launch.child.Child`) and to any process of
    its tree outside that group (the engine core too); the pids it reached."""
    rows = tree(pid)
    grouped = False
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            grouped = True
    except OSError:
        pass
    for r in rows:
        if not grouped or r["pgid"] != pid:
            try:
                os.kill(r["pid"], sig)
            except OSError:
                pass
    return {"group": pid if grouped else None, "pids": [r["pid"] for r in rows]}


class Job(Proc):
    """`Proc` that also remembers the children of every remembered process still alive (after the supervisor's
    death its trainer is re-parented and may still start one: the status guard)."""

    def track(self) -> None:
        super().track()
        for pid in self.left():
            try:
                for c in psutil.Process(pid).children(recursive=True):
                    self.seen.setdefault(c.pid, c.create_time())
            except psutil.Error:
                continue


def left_s() -> float:
    """Seconds of FAULTS_BUDGET_S left."""
    return BUDGET_S - (time.monotonic() - T0)


def write(force: bool = False) -> None:
    """``$OUT/faults_gpu.json`` (and a copy in `WORK`), at most every 10 s unless ``force``."""
    if not force and time.monotonic() - _written[0] < 10:
        return
    _written[0] = time.monotonic()
    text = json.dumps(result, indent=1)
    for d in (OUT, WORK):
        d.mkdir(parents=True, exist_ok=True)
        (d / "faults_gpu.json").write_text(text)


def wait(cond, timeout: float, what: str, job: Job):
    """`wait_for` clipped to the budget (`RESERVE_S` kept), writing the JSON meanwhile."""
    def polled():
        write()
        return cond()
    return wait_for(polled, max(1.0, min(timeout, left_s() - RESERVE_S)), what, [job])


def stepped(run_dir: Path) -> int:
    """The last step in ``metrics.jsonl`` (0: none yet, or a line caught half-written)."""
    try:
        return max(steps(run_dir), default=0)
    except ValueError:
        return 0


def gpu() -> dict:
    """nvidia-smi's compute processes (pid, MiB) and the memory used."""
    out = {}
    for key, query in (("compute_apps", "--query-compute-apps=pid,used_memory"),
                       ("memory_used", "--query-gpu=memory.used")):
        try:
            out[key] = subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True,
                                      timeout=30).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError) as exc:
            out[key] = [repr(exc)]
    return out


def describe(pid: int) -> dict:
    try:
        p = psutil.Process(pid)
        return {"pid": pid, "status": p.status(), "cmdline": " ".join(p.cmdline())[:200]}
    except psutil.Error:
        return {"pid": pid, "status": "gone"}


# ---------------------------------------------------------------------------------------------- the faults
def engine_core(rows: list[dict]) -> int | None:
    """vLLM's engine core among a server's processes (`tree` rows: it is retitled ``VLLM::EngineCore``); it holds
    the model and the KV cache, so it is what the out-of-memory killer picks. None when there is none."""
    cores = [r["pid"] for r in rows if any("EngineCore" in a for a in r["argv"])]
    return cores[0] if cores else None


def kill_in_sync(job: Job, run_dir: Path, rec: dict, server: int, victim: int | None = None) -> float:
    """kill -9 of ``victim`` (default: the server) at the sync's mark (`SYNC_MARK`)."""
    victim = server if victim is None else victim
    log = run_dir / "logs" / "server.log"
    offset, tail = log.stat().st_size, ""
    deadline = time.monotonic() + max(1.0, min(MARK_S, left_s() - RESERVE_S - EXIT_S))
    while time.monotonic() < deadline:
        with log.open("rb") as f:
            f.seek(offset)
            data = f.read()
        offset += len(data)
        tail = (tail + data.decode(errors="replace"))[-8192:]  # a line split across two reads is still seen
        if SYNC_MARK.search(tail):
            os.kill(victim, signal.SIGKILL)
            t = time.monotonic()
            rec["marker"] = "vLLM's access-log line 'POST /pause' in logs/server.log (the sync's first route)"
            break
        write()
        time.sleep(0.01)
    else:
        before = stepped(run_dir)
        wait(lambda: stepped(run_dir) > before, 60, "a new step", job)
        os.kill(victim, signal.SIGKILL)
        t = time.monotonic()
        rec["marker"] = ("fallback: no 'POST /pause' line in logs/server.log within 60 s; killed right after a new "
                         "metrics line, whose sync is then over (not during a sync)")
    time.sleep(1)
    text = log.read_text(errors="replace")
    after = text[text.rfind("\n", 0, max(0, text.rfind("POST /pause"))) + 1:] if "POST /pause" in text else ""
    rec["server_log_after_mark"] = [ln[-90:] for ln in after.splitlines() if '"POST /' in ln][:8]
    # True: the sync reached /resume (it ended before the kill, or vLLM's API servers outlived their parent)
    rec["resume_logged_after_mark"] = "POST /resume" in after
    return t


def kill_supervisor(job: Job, run_dir: Path, rec: dict, server: int) -> float:
    job.track()  # its children now: they are re-parented once it is gone
    os.kill(job.popen.pid, signal.SIGKILL)
    return time.monotonic()


def ctrl_c(job: Job, run_dir: Path, rec: dict, server: int) -> float:
    os.killpg(job.popen.pid, signal.SIGINT)  # the supervisor's group: its children run in sessions of their own
    return time.monotonic()


def stop_server(job: Job, run_dir: Path, rec: dict, server: int) -> float:
    def hung() -> bool:
        return str(status(run_dir).get("server_status") or "").startswith("server not answering")

    def note(prefix: str, conds: dict, since: float) -> None:
        for name, cond in conds.items():
            if f"{prefix}_{name}_s" not in rec and cond():
                rec[f"{prefix}_{name}_s"] = round(time.monotonic() - since, 1)

    shown_conds = {"status": hung, "console": lambda: "server not answering" in job.output()}
    rec["sigstop"] = signal_server(server, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        def stop_over() -> bool:
            note("hang_shown", shown_conds, t0)
            if hung():
                rec["server_status_during"] = status(run_dir).get("server_status")
            return job.popen.poll() is not None or time.monotonic() - t0 >= STOP_S
        wait(stop_over, STOP_S + 10, "the stop", job)
    finally:
        rec["sigcont"] = signal_server(server, signal.SIGCONT)
    t1, before = time.monotonic(), stepped(run_dir)
    back = {"status": lambda: not hung(), "console": lambda: "sampler server: answering again" in job.output(),
            "step": lambda: stepped(run_dir) > before}

    def recovered() -> bool:
        note("recovered", back, t1)
        return job.popen.poll() is not None or all(f"recovered_{k}_s" in rec for k in back)
    try:
        wait(recovered, 90, "the recovery", job)
    except TimeoutError as exc:
        rec["recovery_error"] = str(exc)
    if job.popen.poll() is not None:
        rec["ended_by"] = "the job itself, before the SIGINT"
        return t1
    os.killpg(job.popen.pid, signal.SIGINT)
    rec["ended_by"] = "SIGINT to the supervisor once recovered (exit times count from it)"
    return time.monotonic()


def kill_engine_in_sync(job: Job, run_dir: Path, rec: dict, server: int) -> float:
    core = engine_core(tree(server))
    if core is None:
        raise RuntimeError("no VLLM::EngineCore process under the server")
    rec["engine_core_pid"] = core
    return kill_in_sync(job, run_dir, rec, server, core)


FAULTS = {"server_kill_sync": kill_in_sync, "supervisor_kill": kill_supervisor, "sigint": ctrl_c,
          "server_stop": stop_server, "engine_kill_sync": kill_engine_in_sync}


# ---------------------------------------------------------------------------------------------- a drill
def drill(name: str, rec: dict) -> None:
    base = WORK / name
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    run_dir = base / "run"
    rec.update(gpu_before=gpu(), command=" ".join(job_argv(run_dir)[2:]))
    start = time.monotonic()
    job, server, t_fault = Job(job_argv(run_dir), base / "job.log"), None, None
    try:
        need = 2 if name == "sigint" else 1
        wait(lambda: stepped(run_dir) >= need or job.popen.poll() is not None, FIRST_STEP_S + 60 * (need - 1),
             f"step {need}", job)
        if stepped(run_dir) < need:
            raise RuntimeError(f"the job ended (exit {job.popen.returncode}) before step {need}")
        rec["step_reached_after_start_s"] = round(time.monotonic() - start, 1)
        rows = tree(job.popen.pid)
        m = SERVER_LINE.search(job.output())
        rec["server_pid_console"] = int(m.group(1)) if m else None
        rec["server_pid_tree"] = pick_server(rows)
        server = rec["server_pid_tree"] or rec["server_pid_console"]
        rec["server_tree"] = [{**r, "argv": " ".join(r["argv"])[:200]} for r in (tree(server) if server else [])]
        if server is None and name in ("server_kill_sync", "server_stop", "engine_kill_sync"):
            raise RuntimeError("no vllm serve process in the job's tree and no 'started the server' line")
        rec["step_at_fault"] = stepped(run_dir)
        t_fault = FAULTS[name](job, run_dir, rec, server)
        rec["step_after_fault"] = stepped(run_dir)
        if name != "supervisor_kill":
            wait(lambda: job.popen.poll() is not None, EXIT_S, "the supervisor's exit", job)
        else:
            job.popen.wait(10)
        rec["exit_after_fault_s"] = round(time.monotonic() - t_fault, 1)
        rec["rc"] = None if name == "supervisor_kill" else job.popen.returncode
        wait(lambda: not job.left(), t_fault + EXIT_S + GONE_S - time.monotonic(), "every process gone", job)
        rec["all_gone_after_fault_s"] = round(time.monotonic() - t_fault, 1)
    except Exception as exc:  # noqa: BLE001 - recorded; the clean-up below still runs
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        job.track()
        if rec.get("rc") is None and name != "supervisor_kill":
            rec["rc"] = job.popen.poll()
        trainer_log = run_dir / "logs" / "trainer.log"
        rec.update(checkpoints=checkpoints(run_dir), partial=[p.name for p in run_dir.glob(".checkpoint-*")],
                   last_step=stepped(run_dir), status={k: status(run_dir).get(k) for k in STATUS_KEYS},
                   console=lines_with(job.output(), "error:", "cause:", "checkpoint saved", "resume with",
                                      "no new checkpoint", "not saved", "killed by", "server not answering",
                                      "answering again", "SIGINT", "stopping", "outcome")[-20:],
                   trainer_log_tail=(trainer_log.read_text(errors="replace").splitlines()[-15:]
                                     if trainer_log.exists() else []),
                   processes_left=[describe(pid) for pid in job.left()])
        job.kill()
        if server:
            try:
                os.killpg(server, signal.SIGKILL)  # the server's group (a session of its own)
            except OSError:
                pass
        try:
            wait_for(lambda: not job.left(), 15, "the kill")
        except TimeoutError:
            rec["left_after_kill"] = [describe(pid) for pid in job.left()]
        time.sleep(5)
        rec.update(gpu_after=gpu(), drill_wall_s=round(time.monotonic() - start, 1))
        subprocess.run(["tar", "czf", str(OUT / f"logs_faults_{name}.tgz"), "-C", str(base), "job.log",
                        "run/metrics.jsonl", "run/status.json", "run/logs"], capture_output=True)


def versions() -> dict:
    try:
        from rollouts import versions as rollouts_versions

        return rollouts_versions()
    except Exception:  # noqa: BLE001 - rollouts.py is edited elsewhere: bench_e2e's then
        return {**bench_e2e.versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cut call still kills its jobs (finally)
    try:
        names = drill_names(os.environ.get("FAULTS"))
    except ValueError as exc:
        print(f"faults.py: {exc}")
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    result.update(versions=versions(), date=time.strftime("%Y-%m-%d %H:%M:%S"), budget_s=BUDGET_S,
                  commands={"call": f"FAULTS={','.join(names)} bash scripts/gpu/vllm033/run.sh faults",
                            "job": " ".join(job_argv(WORK / "DRILL" / "run")[2:])})
    long = ("console", "trainer_log_tail", "server_tree", "gpu_before", "gpu_after", "command", "status")
    try:
        for name in names:
            rec: dict = {"drill": name}
            result["drills"].append(rec)
            if left_s() < MIN_LEFT_S:
                rec["skipped"] = f"{left_s():.0f} s of FAULTS_BUDGET_S={BUDGET_S:g} left (a drill needs {MIN_LEFT_S:g})"
            else:
                write(force=True)
                drill(name, rec)
            write(force=True)
            print(json.dumps({**{k: v for k, v in rec.items() if k not in long},
                              "state": (rec.get("status") or {}).get("state")}), flush=True)
    finally:
        write(force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
