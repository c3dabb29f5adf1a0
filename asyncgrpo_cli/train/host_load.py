"""Who uses the host's cores during a run: ``host/cpu_busy_cores``, ``host/cpu_busy_frac``,
``rollout/worker_cpu`` and ``rollout/worker_main_cpu`` (issue #41).

On the one-GPU job the host's cores are shared by vLLM's API servers and engine core(s) (``server/frontend_cpu``
and ``server/engine_core_cpu``, `train.engine_cpu`), the rollout worker and the trainer (``perf/fwd_bwd_cpu_wait_s``,
`train.host_time`). With two engines behind the router the job generated about 1,100 rollouts/s late in the run and
the one rollout worker parses every answer, scores it and builds the samples; whether that worker, or the host as a
whole, becomes the bound is what these figures say:

- ``rollout/worker_cpu``: cores the rollout worker's process tree (the worker and its reward processes, such as
  math-verify's pool) used between two steps.
- ``rollout/worker_main_cpu``: cores of the worker's own process, its threads included. Its event loop parses
  every answer and builds the samples, and its Python runs one thread at a time, so near 1.0 means the worker,
  not vLLM, paces generation (the reward processes beside it can take more cores without that).
- ``host/cpu_busy_cores``: cores of the whole machine busy (user, system, nice, irq) between two steps, and
  ``host/cpu_busy_frac`` the same over the machine's cores; near 1.0 with a sizeable ``perf/fwd_bwd_cpu_wait_s``
  means every process waits for a core, the trainer included.

`ProcessTreeLoad` and `HostCpuLoad` are pure (tests drive them with readings); `HostLoadWatch` reads ``/proc``
through psutil once per step (about a millisecond), outside the timed forward and backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

__all__ = ["HostCpuLoad", "HostLoadWatch", "ProcessTreeLoad", "read_host_cpu"]

#: Readings closer together than this (seconds) keep the previous figure: CPU times tick every 10 ms, so a shorter
#: interval measures the tick.
MIN_GAP_S = 0.25


class ProcessTreeLoad:
    """Cores used by a process tree between its two newest readings.

    ``observe(reading, t)``: ``reading`` maps pid -> CPU seconds so far (user + system), ``t`` is monotonic
    seconds. A pid absent from the older reading started after it, so all its CPU seconds fall in the interval;
    one absent from the newer reading ended, and its last interval is lost. `cores` is None until two readings at
    least ``min_gap_s`` apart exist, and while the tree is gone (an empty reading)."""

    def __init__(self, min_gap_s: float = MIN_GAP_S) -> None:
        self.min_gap_s = min_gap_s
        self._last: tuple[Mapping[int, float], float] | None = None
        self._cores: float | None = None

    def observe(self, reading: Mapping[int, float], t: float) -> None:
        """Add a reading taken at ``t`` seconds."""
        if not reading:
            self._last, self._cores = None, None
            return
        if self._last is not None:
            before, t0 = self._last
            if t - t0 < self.min_gap_s:
                return
            used = sum(max(0.0, sec - before.get(pid, 0.0)) for pid, sec in reading.items())
            self._cores = round(used / (t - t0), 3)
        self._last = (dict(reading), t)

    def cores(self) -> float | None:
        """CPU use of the tree, in cores (1.0 = one core all the time), or None."""
        return self._cores


class HostCpuLoad:
    """Busy cores of the whole machine between its two newest readings.

    ``observe(busy_s, total_s, t)``: the machine's CPU seconds so far summed over its cores, busy ones (not idle,
    not waiting for I/O) and all, at monotonic ``t``. `busy_cores` is busy seconds over wall seconds,
    `busy_frac` busy over all CPU seconds of the interval (0-1)."""

    def __init__(self, min_gap_s: float = MIN_GAP_S) -> None:
        self.min_gap_s = min_gap_s
        self._last: tuple[float, float, float] | None = None
        self._cores: float | None = None
        self._frac: float | None = None

    def observe(self, busy_s: float, total_s: float, t: float) -> None:
        """Add a reading taken at ``t`` seconds."""
        if self._last is not None:
            busy0, total0, t0 = self._last
            if t - t0 < self.min_gap_s:
                return
            busy, total = busy_s - busy0, total_s - total0
            if busy < 0 or total <= 0:  # counters reset (or a stuck clock): start again from this reading
                self._cores = self._frac = None
            else:
                self._cores = round(busy / (t - t0), 3)
                self._frac = round(min(1.0, busy / total), 4)
        self._last = (busy_s, total_s, t)

    def busy_cores(self) -> float | None:
        """Busy cores of the machine, or None."""
        return self._cores

    def busy_frac(self) -> float | None:
        """Busy share of the machine's cores (0-1), or None."""
        return self._frac


def read_host_cpu() -> tuple[float, float] | None:
    """The machine's (busy, total) CPU seconds so far, summed over its cores (psutil), or None where psutil
    cannot tell. Busy: user, nice, system, interrupts and steal; not idle, not I/O wait."""
    try:
        import psutil

        t = psutil.cpu_times()
    except Exception:  # noqa: BLE001 - a figure, never a failure
        return None
    # Linux's guest times are already inside user and nice: not added again.
    busy = sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    return busy, busy + t.idle + getattr(t, "iowait", 0.0)


def read_tree_seconds(pid: int) -> dict[int, float]:
    """CPU seconds so far of ``pid`` and every process under it (pid -> seconds; `engine_cpu.read_tree_cpu`)."""
    from .engine_cpu import read_tree_cpu

    return {p: sec for p, (_, sec) in read_tree_cpu(pid).items()}


class HostLoadWatch:
    """The step's host figures: ``host/cpu_busy_cores``, ``host/cpu_busy_frac`` and, with ``worker_pid``,
    ``rollout/worker_cpu`` and ``rollout/worker_main_cpu``. `step` reads once and returns what is known (``{}`` at
    first).

    Args:
        worker_pid: a callable giving the rollout worker's pid (None while there is none: a rank without the
            worker, or before it starts).
        read_host, read_tree, clock: the readers (injected by tests).
    """

    def __init__(self, worker_pid: Callable[[], int | None] = lambda: None,
                 read_host: Callable[[], tuple[float, float] | None] = read_host_cpu,
                 read_tree: Callable[[int], Mapping[int, float]] = read_tree_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_pid, self.read_host, self.read_tree, self.clock = worker_pid, read_host, read_tree, clock
        self.host = HostCpuLoad()
        self.worker = ProcessTreeLoad()
        self.worker_main = ProcessTreeLoad()

    def step(self) -> dict[str, float]:
        """Take this step's readings; the figures between the last readings at least `MIN_GAP_S` apart."""
        now = self.clock()
        out: dict[str, float] = {}
        host = self.read_host()
        if host is not None:
            self.host.observe(host[0], host[1], now)
            if self.host.busy_cores() is not None:
                out["host/cpu_busy_cores"] = self.host.busy_cores()
                out["host/cpu_busy_frac"] = self.host.busy_frac()
        pid = self.worker_pid()
        if pid is not None:
            tree = self.read_tree(pid)
            self.worker.observe(tree, now)
            self.worker_main.observe({pid: tree[pid]} if pid in tree else {}, now)
            if self.worker.cores() is not None:
                out["rollout/worker_cpu"] = self.worker.cores()
            if self.worker_main.cores() is not None:
                out["rollout/worker_main_cpu"] = self.worker_main.cores()
        return out
