"""How busy vLLM's engine core is on its CPU core: ``server/engine_core_cpu`` (issue #41).

For a small model vLLM's engine-core process runs its scheduling and bookkeeping loop on one CPU core, and
that loop, not the GPU, bounds generation: on one H200 with SmolLM2-135M the engine core used 0.96-1.03 cores in
every load of the 2026-12-04 screen while the GPU was 6-9% busy, and a second server on the GPU generated 2.0-2.3x
(``sampler.engines``, README: Several servers on one GPU). The trainer's server watch (`train.server_watch`) reads
the CPU seconds of every process under the server it was given (`read_tree_cpu`, psutil) at each probe, and
`EngineCoreLoad` turns two readings into the cores each engine core used between them. No I/O in
`EngineCoreLoad`: tests drive it with readings.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Process names of vLLM's engine cores (``VLLM::EngineCore``, with a data-parallel rank suffix when DP > 1).
ENGINE_CORE_PREFIX = "VLLM::EngineCore"

Reading = Mapping[int, tuple[str, float]]  # pid -> (process name, CPU seconds: user + system)


def read_tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of process ``pid`` and every process under it: pid -> (name, seconds). Processes
    that end while being read are left out; ``{}`` when ``pid`` is gone or psutil cannot read it."""
    import psutil

    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    out: dict[int, tuple[str, float]] = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (p.name(), t.user + t.system)
        except psutil.Error:
            continue
    return out


class EngineCoreLoad:
    """Cores used by the busiest engine core between the two newest readings of a server's process tree, and by
    the tree's other processes together (``server/frontend_cpu``: the API servers, the top ``vllm serve``
    process, the router of ``sampler.engines``).

    ``observe(reading, t)`` with ``t`` in monotonic seconds; `cores` is None until two readings at least
    ``min_gap_s`` apart both hold an engine core (an embedded or external server has none); `frontend_cores`
    is None until two such readings exist, whatever the tree holds."""

    def __init__(self, min_gap_s: float = 1.0) -> None:
        self.min_gap_s = min_gap_s
        self._last: tuple[Reading, float] | None = None
        self._cores: float | None = None
        self._frontend: float | None = None
        self.engines = 0  # engine cores seen in the newest reading

    def observe(self, reading: Reading, t: float) -> None:
        """Add a reading taken at ``t`` seconds."""
        cores = {pid: sec for pid, (name, sec) in reading.items() if name.startswith(ENGINE_CORE_PREFIX)}
        self.engines = len(cores)
        if self._last is not None:
            before, t0 = self._last
            if t - t0 < self.min_gap_s:
                return
            used = [(sec - before[pid][1]) / (t - t0) for pid, sec in cores.items() if pid in before]
            self._cores = round(max(used), 3) if used else None
            # The other processes: one that started in the interval counts from 0 (all its CPU time is in it).
            rest = sum(max(0.0, sec - before.get(pid, ("", 0.0))[1]) for pid, (name, sec) in reading.items()
                       if not name.startswith(ENGINE_CORE_PREFIX))
            self._frontend = round(rest / (t - t0), 3) if reading else None
        self._last = ({pid: ("", sec) for pid, (_, sec) in reading.items()}, t)

    def cores(self) -> float | None:
        """The busiest engine core's CPU use, in cores (1.0 = one core all the time), or None."""
        return self._cores

    def frontend_cores(self) -> float | None:
        """CPU use of every process of the tree but the engine cores, in cores, or None."""
        return self._frontend
