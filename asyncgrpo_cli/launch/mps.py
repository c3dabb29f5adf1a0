"""CUDA MPS for a colocated job (``launch.mps``: true, false, or null = automatic: on for an asynchronous job whose
server it starts on the trainer's GPU, `plan_mps_auto`).

Without MPS, one GPU runs the kernels of one process at a time: vLLM's decode steps and the trainer's
forward and backward take turns in time slices, so an asynchronous job on one GPU gains at most what the
idle gaps of each leave (about 1.2x at the 1.7B shape of README "How fast, against what"). Under the
Multi-Process Service both processes are clients of one MPS server and their kernels run at the same time.

The supervisor starts the control daemon in the foreground (``nvidia-cuda-mps-control -f``) under a keeper
(`mps_keeper`, `keeper_argv`), a child of its own like the server, checks that a client gets a CUDA context
through it (`probe_daemon`, `mps_probe`), with a pipe folder of this run
(`MpsPlan.pipe_dir`, short: the daemon's socket path must fit 108 bytes) and its log folder under the run's
``logs/mps``. vLLM and the trainer get ``CUDA_MPS_PIPE_DIRECTORY`` (`MpsPlan.client_env`), so they join this
daemon and no other, and all three name the shared GPU by its UUID. At the end the supervisor asks it to quit
(``quit`` on its control pipe, after the server and the trainer are gone), then stops what is left, removes the
pipe folder and says how many processes joined it (`stop_daemon`).

The daemon outlives a killed supervisor (even by SIGKILL) until its clients are gone, bounded in time: the keeper
gets the supervisor's parent-death signal in its place and keeps the daemon until no client is left (at most
`mps_keeper.DRAIN_S` seconds, or the job's stop grace when longer), so that a trainer saving its checkpoint on
the GPU after its supervisor died still reaches its MPS server; then it quits the daemon and exits, leaving no
process (a SIGKILL of the keeper ends the daemon at once, by its own parent-death signal).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .child import Child
from .mps_keeper import DRAIN_S, KEEPER_PID, QUIT_S  # QUIT_S: for the daemon and its server to exit after ``quit``

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"  # a client's priority among the daemon's: 0 normal, 1 below normal
READY_S = 30.0  # for the daemon's control socket to appear


@dataclass
class MpsPlan:
    """Where this run's MPS daemon lives.

    Attributes:
        control: the ``nvidia-cuda-mps-control`` program (absolute path).
        pipe_dir: the pipe folder (``CUDA_MPS_PIPE_DIRECTORY``) of this run's daemon and its clients.
        log_dir: the daemon's log folder (``CUDA_MPS_LOG_DIRECTORY``), under the run's ``logs``.
        device: the shared GPU's UUID (`gpu_uuid`), the ``CUDA_VISIBLE_DEVICES`` of the daemon and of both
            clients. The MPS server renumbers the devices its daemon sees from 0, so an index would name another
            GPU in a client (or, for a client that failed to reach the daemon, the machine's GPU of that number);
            a UUID names the same GPU everywhere (NVIDIA's MPS guide recommends them). The daemon sees that GPU
            only, so its server opens no context on the machine's other GPUs.
    """

    control: str
    pipe_dir: Path
    log_dir: Path
    device: str = "0"
    automatic: bool = False  # chosen by launch.mps=null (`plan_mps_auto`): a daemon that cannot start is skipped
    probe_pids: set[int] = field(default_factory=set)  # `probe_daemon`'s clients, left out of `joined_clients`
    client_env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.client_env = {PIPE_ENV: str(self.pipe_dir), "CUDA_VISIBLE_DEVICES": self.device}

    @property
    def daemon_env(self) -> dict[str, str]:
        """The environment the daemon adds to the supervisor's (both folders, the shared GPU)."""
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir), "CUDA_VISIBLE_DEVICES": self.device}

    @property
    def stdout_log(self) -> Path:
        """The daemon's output (its keeper's and the foreground daemon's own lines): ``mps.log`` beside
        `log_dir`, the file the supervisor gives `start_daemon`."""
        return self.log_dir.parent / "mps.log"

    def note(self) -> str:
        """The launch plan's line about it."""
        which = AUTO + ", as this job is asynchronous and shares one GPU" if self.automatic else "launch.mps=true"
        return (f"CUDA MPS ({which}): `{self.control} -f` starts before the server; vLLM and the trainer "
                f"run their kernels at the same time through it ({PIPE_ENV}={self.pipe_dir}; its log: "
                f"{self.stdout_log}); if the job is killed, its keeper (mps_keeper) keeps it until they are gone")


def pipe_dir_of(output_dir: Path) -> Path:
    """The run's pipe folder: ``<temp dir>/asyncgrpo-mps-<12 hex digits of the run folder's path>`` (one job per
    run folder holds the lock, so no two daemons share it; a resume finds the same one)."""
    digest = hashlib.sha1(str(Path(output_dir).expanduser().resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"asyncgrpo-mps-{digest}"


def gpu_uuid(device: str) -> str | None:
    """The UUID (``GPU-...``, or a MIG device's ``MIG-...``) of ``device`` (an index or a UUID as
    ``CUDA_VISIBLE_DEVICES`` names it), read with ``nvidia-smi`` (no CUDA context); None when it cannot be read."""
    if device.startswith(("GPU-", "MIG-")):
        return device
    try:
        out = subprocess.run(["nvidia-smi", "-i", device, "--query-gpu=uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    uuid = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return uuid if uuid.startswith(("GPU-", "MIG-")) else None


def plan_mps(output_dir: Path, *, colocated: bool, starts_server: bool, device: str = "0", on_cpu: bool = False,
             which=None) -> tuple[MpsPlan | None, str | None]:
    """``(plan, None)`` for ``launch.mps=true``, or ``(None, problem)`` when it cannot apply here: vLLM and the
    trainer not on one GPU, no server started by this job (an external or running server is not this job's to
    put under MPS), or ``nvidia-cuda-mps-control`` not on PATH (``which``: the lookup, default `shutil.which`).
    ``device``: the shared GPU's ``CUDA_VISIBLE_DEVICES`` entry (an unreadable UUID is a problem too); ``on_cpu``:
    the trainer runs on the CPU. The problem names the field and the fix."""
    if not starts_server:
        return None, ("launch.mps=true: this job starts no server (an external or already running one), and MPS "
                      "must start before both processes. Fix: launch.mps=false, or let the job start vLLM "
                      "(sampler.backend=vllm and a free sampler.port)")
    if not colocated:
        where = ("runs the trainer on the CPU (no GPU is visible here)" if on_cpu else
                 "puts the server and the trainer on separate GPUs")
        fix = "" if on_cpu else ", or launch.colocate=true sampler.backend=vllm (one GPU for both)"
        return None, (f"launch.mps=true: CUDA MPS lets the server and the trainer share one GPU's compute, and this "
                      f"plan {where}. Fix: launch.mps=false{fix}")
    control = (which or shutil.which)(CONTROL)
    if control is None:
        return None, (f"launch.mps=true: `{CONTROL}` is not on PATH (it comes with the NVIDIA driver's utilities). "
                      "Fix: launch.mps=false, or add the folder that holds it to PATH")
    uuid = gpu_uuid(device)
    if uuid is None:
        return None, (f"launch.mps=true: could not read the UUID of GPU {device} with `nvidia-smi -i {device} "
                      "--query-gpu=uuid` (MPS renumbers the GPUs its clients see, so they are named by UUID). "
                      "Fix: launch.mps=false, or put nvidia-smi on PATH")
    out = Path(output_dir)
    return MpsPlan(control=control, pipe_dir=pipe_dir_of(out), log_dir=out / "logs" / "mps", device=uuid), None


AUTO = "launch.mps=null (automatic)"


def plan_mps_auto(output_dir: Path, *, colocated: bool, starts_server: bool, asynchronous: bool, device: str = "0",
                  on_cpu: bool = False, which=None) -> tuple[MpsPlan | None, str | None, str | None]:
    """``launch.mps=null``: MPS where it applies and pays. Returns ``(plan, None, None)`` for an asynchronous job
    (``staleness.max_staleness > 0``) whose server this job starts on the GPU the trainer uses, with
    ``nvidia-cuda-mps-control`` on PATH and the GPU's UUID readable; else ``(None, note, why)``, the plan's line
    saying why not and that reason alone (other notes quote it), or ``(None, None, None)`` when nothing shares a
    GPU (a CPU run, separate GPUs, an external server).
    On-policy training takes turns on the GPU by design: under MPS it trained 3.7% fewer tok/s (README "How fast,
    against what"), so it stays off there unless ``launch.mps=true``. Arguments as `plan_mps`."""
    if on_cpu or not colocated or not starts_server:
        return None, None, None
    if not asynchronous:
        why = ("on-policy training (staleness.max_staleness=0) takes turns on the GPU anyway, and trained 3.7% fewer "
               "tok/s under MPS")
        return None, f"CUDA MPS off ({AUTO}): {why}; launch.mps=true forces it", why
    plan, problem = plan_mps(output_dir, colocated=colocated, starts_server=starts_server, device=device,
                             on_cpu=on_cpu, which=which)
    if plan is None:
        why = (problem or "").removeprefix("launch.mps=true: ").split(" Fix: ")[0]
        return None, f"CUDA MPS off ({AUTO}): {why} (launch.mps=false says nothing)", why
    plan.automatic = True
    return plan, None, None


def keeper_argv(plan: MpsPlan, stop_grace_s: float | None = None) -> list[str]:
    """The command that runs the daemon under its keeper: ``python -m asyncgrpo_cli.launch.mps_keeper <control>
    --drain-timeout S``, S (seconds) the longer of `mps_keeper.DRAIN_S` and ``stop_grace_s`` (the supervisor's
    wait for a trainer's save), so that a save the supervisor would wait for is waited for when it is dead."""
    drain_s = max(DRAIN_S, stop_grace_s or 0.0)
    return [sys.executable, "-m", f"{__package__}.mps_keeper", plan.control, "--drain-timeout", f"{drain_s:g}"]


def draining_keeper(pipe_dir: Path) -> int | None:
    """The pid of a keeper (`mps_keeper`) that still keeps a daemon in ``pipe_dir`` (its ``keeper.pid``), or None:
    after its job was killed it waits there for the daemon's clients, bounded by its drain timeout."""
    try:
        pid = int((Path(pipe_dir) / KEEPER_PID).read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # empty for a zombie
    except (OSError, ValueError, IndexError):
        return None
    return pid if b"mps_keeper" in cmdline and pid != os.getpid() else None


#: `start_daemon`'s reason when the job's stop signal came before the daemon was ready.
STOPPED_BEFORE_READY = "a stop signal came before the CUDA MPS control daemon was ready"


def start_daemon(plan: MpsPlan, log_path: Path, argv: list[str] | None = None, stop: threading.Event | None = None,
                 probe: list[str] | None = None) -> tuple[Child | None, str | None]:
    """Start the daemon (``argv``: the command, default `keeper_argv`: the daemon under its keeper) and wait up to
    `READY_S` seconds for its control socket, or until ``stop`` is set (the job got a stop signal: then the child and
    `STOPPED_BEFORE_READY`); then, with ``probe`` (a command, `probe_argv`), check that a client gets a context
    through it (`probe_daemon`). Returns the child and None, or the child and why it is not ready (it exited, no
    socket came, the probe failed): the caller stops it with `stop_daemon`. The pipe folder starts empty (one job
    per run folder holds the lock, so what is there is a killed job's), unless a killed job's keeper still drains
    its daemon there (`draining_keeper`): then None and why, and nothing is started or removed."""
    stop = stop or threading.Event()
    keeper = draining_keeper(plan.pipe_dir)
    if keeper is not None:
        return None, (f"the CUDA MPS daemon of a job killed in this run folder still waits for its clients (its "
                      f"keeper, pid {keeper}, quits it once they are gone, within its drain timeout; "
                      f"{plan.pipe_dir}). Fix: wait for pid {keeper} to exit, or end it with kill {keeper}")
    shutil.rmtree(plan.pipe_dir, ignore_errors=True)  # a socket left by a daemon killed with its job
    plan.pipe_dir.mkdir(parents=True)
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    child = Child("mps", argv or keeper_argv(plan), plan.daemon_env, log_path).start()
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if (plan.pipe_dir / "control").exists():
            return child, probe_daemon(plan, probe, stop=stop) if probe is not None else None
        if child.poll() is not None:
            return child, f"the CUDA MPS control daemon exited ({child.poll()}) before it was ready"
        if stop.wait(0.1):
            return child, STOPPED_BEFORE_READY
    return child, f"the CUDA MPS control daemon made no control socket in {plan.pipe_dir} within {READY_S:.0f} s"


PROBE_S = 60.0  # for the probe's one context (well under a second when the server starts)


def probe_argv() -> list[str]:
    """The probe's command (`mps_probe`): one CUDA context through the daemon."""
    return [sys.executable, "-m", f"{__package__}.mps_probe"]


def probe_daemon(plan: MpsPlan, argv: list[str] | None = None, env: dict[str, str] | None = None,
                 stop: threading.Event | None = None) -> str | None:
    """Run the probe (``argv``, default `probe_argv`) as a client of ``plan``'s daemon (`MpsPlan.client_env` added
    to ``env``, default this process's). Returns None when it created its context, or could not probe (no CUDA
    driver library: exit 3); `STOPPED_BEFORE_READY` when ``stop`` is set meanwhile (the probe is killed); else why
    not (its last line, or its exit status, or the timeout `PROBE_S`): the MPS server cannot serve a client, so
    vLLM would fail at its start."""
    from .mps_probe import NOT_PROBED

    try:
        proc = subprocess.Popen(argv or probe_argv(), env={**(env or os.environ), **plan.client_env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        return f"the MPS probe could not run: {exc}"
    plan.probe_pids.add(proc.pid)
    deadline, stop = time.monotonic() + PROBE_S, stop or threading.Event()
    while proc.poll() is None:  # its output is one line: no pipe fills while it runs
        if stop.wait(0.05) or time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            return STOPPED_BEFORE_READY if stop.is_set() else (
                f"a CUDA context through the daemon took over {PROBE_S:.0f} s (mps probe)")
    stdout, stderr = proc.communicate()
    if proc.returncode in (0, NOT_PROBED):
        return None
    last = (stdout.strip() or stderr.strip()).splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return f"a CUDA context through the daemon failed ({last[0].removeprefix('mps probe: ')})"


NEW_CLIENT = re.compile(r"NEW CLIENT (\d+)")


def joined_clients(plan: MpsPlan) -> int | None:
    """How many processes joined the daemon: the distinct pids of its ``NEW CLIENT <pid>`` lines (a process that
    opens several contexts connects more than once), in its log: `MpsPlan.stdout_log` (the foreground daemon the
    job runs logs to its stdout) and ``control.log`` in `MpsPlan.log_dir` (where a background daemon logs), less
    the probe's (`MpsPlan.probe_pids`). None when neither file exists."""
    texts = [p.read_text(errors="replace") for p in (plan.stdout_log, plan.log_dir / "control.log") if p.is_file()]
    if not texts:
        return None
    return len({int(m.group(1)) for text in texts for m in NEW_CLIENT.finditer(text)} - plan.probe_pids)


def stop_daemon(plan: MpsPlan, child: Child | None, quit_argv: list[str] | None = None,
                clients_expected: int = 2) -> str:
    """Ask the daemon to quit (``echo quit | nvidia-cuda-mps-control`` with its pipe folder; ``quit_argv``
    replaces the command) and wait up to `QUIT_S` seconds for ``child`` (the keeper, which exits with the daemon);
    then SIGTERM its group (the keeper and the daemon: the clients are gone by now, so the keeper's drain ends at
    once) and 5 s later SIGKILL what is left of the group and its descendants (the MPS server), and remove the
    pipe folder.

    Returns:
        The line for the console: how many processes joined it (`joined_clients`) against ``clients_expected``
        (the server's engine and the trainer; one when the trainer never started). A CUDA process that cannot
        reach the daemon runs without MPS, unannounced: fewer is said with a warning."""
    if child is not None and child.poll() is None:
        child.track()
        try:
            subprocess.run(quit_argv or [plan.control], input="quit\n", text=True, capture_output=True,
                           env={**os.environ, **plan.daemon_env}, timeout=QUIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        deadline = time.monotonic() + QUIT_S
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.poll() is None:
            child.signal_group(signal.SIGTERM)
            try:
                child.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    if child is not None:
        child.kill_leftovers()
    shutil.rmtree(plan.pipe_dir, ignore_errors=True)
    joined = joined_clients(plan)
    log = plan.stdout_log
    if joined is None:
        return f"CUDA MPS: stopped; its log ({log}) is missing, so who joined it is unknown"
    if joined < clients_expected:
        return (f"warning: CUDA MPS: {joined} process(es) joined the daemon, {clients_expected} expected (vLLM's "
                f"engine and the trainer): a process that cannot reach it runs without MPS. See {log}")
    return (f"CUDA MPS: {joined} CUDA process(es) joined the daemon (vLLM's engine and the trainer at least; some of "
            f"vLLM's API servers and a process of the trainer's join too: 6 on a GPU); log: {log}")


def without_mps(plan, child: Child | None, problem: str, quit_argv: list[str] | None = None) -> str:
    """A daemon `plan_mps_auto` chose did not start: stop what is left of it (`stop_daemon`), take its pipe
    folder out of the server's and the trainer's environment (``plan``: the `LaunchPlan`, changed in place:
    its ``mps`` becomes None) and return the console's line. The job then runs as with ``launch.mps=false``."""
    mps = plan.mps
    if child is not None:
        stop_daemon(mps, child, quit_argv, clients_expected=0)
    for env in (plan.server.env if plan.server is not None else {}, plan.trainer_env):
        env.pop(PIPE_ENV, None)  # CUDA_VISIBLE_DEVICES keeps the GPU's UUID: it names the same GPU without MPS
    plan.mps = None
    return (f"CUDA MPS could not start ({problem}; its log: {mps.stdout_log}); this job runs without it "
            "(launch.mps=false skips the try, launch.mps=true makes it an error)")

