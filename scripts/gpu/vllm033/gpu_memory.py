"""GPU memory of each process during a run, from ``nvidia-smi`` polled every few seconds (issue #42).

`Poller` runs a thread that reads ``nvidia-smi --query-compute-apps=pid,process_name,used_memory`` and
``--query-gpu=memory.used,memory.total`` every ``interval_s`` seconds and keeps one sample per read: the wall
time (``time.time()``, the clock of ``metrics.jsonl``'s ``time``), MiB per process and the GPU's MiB in use.
Each process is given a role from its command line or its nearest ancestor's (`role_of_pid`): ``vllm`` (the
engine core and its workers), ``trainer`` (the asyncgrpo/accelerate/TRL trainer; TRL's colocated vLLM lives in
the trainer's process), ``mps`` (CUDA MPS's server) or ``other``.

`peaks` gives the peak MiB of each role over the samples in a time window (one step's), and `summary` the run's
peak per role and per process, the largest sum of the processes' MiB against the GPU's own used MiB at the same
read (the check: what nvidia-smi charges to processes should account for the GPU's use, bar the driver's share),
and the peaks against a planned split when one is given.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time

QUERY_APPS = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]
QUERY_GPU = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"]


def parse_apps(text: str) -> dict[int, tuple[str, float]]:
    """``pid, name, MiB`` lines of ``QUERY_APPS`` -> {pid: (name, MiB)}; a line that does not parse is skipped
    (``[N/A]`` memory under MIG, a header from another format)."""
    out = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3:
            continue
        try:
            out[int(fields[0])] = (",".join(fields[1:-1]), float(fields[-1]))
        except ValueError:
            continue
    return out


def parse_gpu(text: str) -> tuple[float, float] | None:
    """The first GPU's ``used, total`` MiB from ``QUERY_GPU``'s output, or None when it does not parse."""
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            return float(fields[0]), float(fields[1])
        except (ValueError, IndexError):
            continue
    return None


def role_of(cmdline: str) -> str:
    """``vllm``, ``trainer``, ``mps`` or ``other`` from a process's command line (``""`` when it is not visible).
    CUDA MPS's server first (``nvidia-cuda-mps-server``: under ``launch.mps`` its ancestor is the job, whose
    command line would make it the trainer's), then vLLM's own signatures (``VLLM::EngineCore``, ``vllm serve``,
    ``vllm.entrypoints``): this folder's name holds "vllm" too."""
    low = cmdline.lower()
    if "nvidia-cuda-mps" in low:
        return "mps"
    if "enginecore" in low or "vllm.entrypoints" in low or re.search(r"(^|[/\s])vllm\s+serve", low):
        return "vllm"
    if any(k in low for k in ("asyncgrpo", "accelerate", "trl_run", "grpo")):
        return "trainer"
    return "vllm" if re.search(r"(^|[/\s.])vllm([\s.]|$)", low) else "other"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""  # another PID namespace (a container): nvidia-smi's pid is not ours


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def role_of_pid(pid: int, depth: int = 6) -> tuple[str, str]:
    """(role, command line) of ``pid``: its own command line's role, else its nearest ancestor's (a spawned
    worker's command line is Python's ``multiprocessing`` one); ``other`` when none tells."""
    own = cmdline = _cmdline(pid)
    for _ in range(depth):
        role = role_of(cmdline)
        if role != "other" or pid is None or pid <= 1:
            return role, own
        pid = _parent(pid)
        cmdline = _cmdline(pid) if pid else ""
    return "other", own


class Poller:
    """A daemon thread polling ``nvidia-smi`` every ``interval_s`` seconds until `stop`; `samples` holds
    ``{"t": wall s, "apps": {pid: MiB}, "gpu_used_mib", "gpu_total_mib"}`` per read, `processes` the
    ``{pid: {"name", "cmdline", "role"}}`` seen."""

    def __init__(self, interval_s: float = 3.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0 seconds (e.g. 3)")
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.processes: dict[int, dict] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Poller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def read_once(self) -> None:
        try:
            apps = parse_apps(subprocess.run(QUERY_APPS, capture_output=True, text=True, timeout=20).stdout)
            gpu = parse_gpu(subprocess.run(QUERY_GPU, capture_output=True, text=True, timeout=20).stdout)
        except (OSError, subprocess.SubprocessError) as exc:
            if len(self.errors) < 5:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        for pid, (name, _) in apps.items():
            if pid not in self.processes:
                role, cmd = role_of_pid(pid)
                self.processes[pid] = {"name": name, "cmdline": cmd[:300],
                                       "role": role if cmd else role_of(name)}
        self.samples.append({"t": time.time(), "apps": {pid: mib for pid, (_, mib) in apps.items()},
                             "gpu_used_mib": gpu[0] if gpu else None, "gpu_total_mib": gpu[1] if gpu else None})

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read_once()
            self._stop.wait(self.interval_s)  # an Event wait, so that stop() ends it at once


def peaks(samples: list[dict], processes: dict[int, dict], t0: float | None, t1: float) -> dict[str, float]:
    """Peak MiB per role (the sum of its processes at one read) over the samples with ``t0 < t <= t1``
    (``t0`` None: from the first)."""
    out: dict[str, float] = {}
    for s in samples:
        if (t0 is not None and s["t"] <= t0) or s["t"] > t1:
            continue
        by_role: dict[str, float] = {}
        for pid, mib in s["apps"].items():
            role = processes.get(pid, {}).get("role", "other")
            by_role[role] = by_role.get(role, 0.0) + mib
        for role, mib in by_role.items():
            out[role] = max(out.get(role, 0.0), mib)
    return out


def summary(samples: list[dict], processes: dict[int, dict], planned_vllm_frac: float | None = None) -> dict:
    """The run's figures (module docstring). ``planned_vllm_frac``: vLLM's ``--gpu-memory-utilization``, for the
    check of vLLM's peak against its share and the trainer's against the rest."""
    if not samples:
        return {"samples": 0}
    per_pid = {pid: max(s["apps"].get(pid, 0.0) for s in samples) for pid in processes}
    role_peaks = peaks(samples, processes, None, float("inf"))
    total = next((s["gpu_total_mib"] for s in samples if s.get("gpu_total_mib")), None)
    widest = max(samples, key=lambda s: sum(s["apps"].values()))
    out = {"samples": len(samples), "span_s": round(samples[-1]["t"] - samples[0]["t"], 1),
           "gpu_total_mib": total, "peak_mib_by_role": role_peaks,
           "peak_mib_by_process": {str(pid): {**processes[pid], "peak_mib": per_pid[pid]} for pid in processes},
           "gpu_used_peak_mib": max((s["gpu_used_mib"] or 0.0) for s in samples),
           "at_widest_read": {"processes_sum_mib": sum(widest["apps"].values()),
                              "gpu_used_mib": widest["gpu_used_mib"]}}
    if planned_vllm_frac is not None and total:
        vllm_share = planned_vllm_frac * total
        out["planned"] = {"vllm_frac": planned_vllm_frac, "vllm_mib": round(vllm_share),
                          "trainer_mib": round(total - vllm_share),
                          "vllm_within_share": role_peaks.get("vllm", 0.0) <= vllm_share,
                          "trainer_within_rest": role_peaks.get("trainer", 0.0) <= total - vllm_share}
    return out
