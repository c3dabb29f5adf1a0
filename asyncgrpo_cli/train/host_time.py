"""Where the trainer's host time goes during a step's forward and backward: ``perf/fwd_bwd_cpu_s`` and
``perf/fwd_bwd_cpu_wait_s`` (issues #41 and #43 item 3).

On the one-GPU job the same 16K-token step takes 0.31 s on an idle H200 and 1.0-1.6 s beside vLLM. The GPU is shared
in time, but so are the host's cores: vLLM's API servers, its engine core, the rollout worker and the trainer all run
on them. Linux counts, per thread, the time it ran on a CPU and the time it was runnable but waited for one
(``/proc/<pid>/task/<tid>/schedstat``: on-CPU ns, run-queue wait ns, time slices). Summed over the trainer's threads
across the forward and backward:

- ``perf/fwd_bwd_cpu_s``: CPU seconds the trainer's threads used (the main thread launching kernels, autograd's
  device thread running the backward, others);
- ``perf/fwd_bwd_cpu_wait_s``: seconds they were ready to run and waited for a core. Near 0 on a quiet host; a
  sizeable share of ``perf/fwd_bwd_s`` means the host's cores, not the GPU, slow the step.
- ``perf/fwd_bwd_compile_count``: graphs ``torch.compile`` built in the meantime (FlexAttention's on CUDA, the layers with
  ``trainer.torch_compile``): a step after the first that compiles spends seconds of host time on it (a shape the
  compiled code had not seen; the plain line names it).

`ThreadTimes.read` is the only I/O; `host_time_metrics` is pure. On systems without ``schedstat`` (not Linux, or a
kernel without scheduler statistics) the reading is None and no metric is logged.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = ["ThreadTimes", "compiled_graphs", "host_time_metrics"]


@dataclass(frozen=True)
class ThreadTimes:
    """Per-thread scheduler counters of one process at one moment: tid -> (on-CPU ns, run-queue wait ns); ``graphs``:
    `compiled_graphs` at that moment."""

    threads: dict[int, tuple[int, int]]
    graphs: int | None = None

    @classmethod
    def read(cls, pid: int | None = None) -> ThreadTimes | None:
        """The counters of every thread of ``pid`` (default: this process); None where ``schedstat`` is missing.
        Threads that end while being read are left out."""
        base = f"/proc/{pid or os.getpid()}/task"
        try:
            tids = os.listdir(base)
        except OSError:
            return None
        threads: dict[int, tuple[int, int]] = {}
        for tid in tids:
            try:
                with open(f"{base}/{tid}/schedstat") as f:
                    fields = f.read().split()
                threads[int(tid)] = (int(fields[0]), int(fields[1]))
            except (OSError, ValueError, IndexError):
                continue
        return cls(threads, compiled_graphs()) if threads else None


def compiled_graphs() -> int | None:
    """Graphs ``torch.compile`` has built in this process so far (dynamo's ``unique_graphs`` count; a recompile adds
    to it); None while dynamo was never imported (nothing compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    try:
        return int(utils.counters["stats"]["unique_graphs"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def host_time_metrics(before: ThreadTimes | None, after: ThreadTimes | None) -> dict[str, float]:
    """``perf/fwd_bwd_cpu_s`` and ``perf/fwd_bwd_cpu_wait_s`` (seconds) between two readings of one process, and
    ``perf/fwd_bwd_compile_count`` (graphs) when the later one has a compile count (the earlier one's missing counts 0).

    A thread born between them counts from zero; one that ended is left out (its last interval is lost). Returns
    ``{}`` when either reading is missing.
    """
    if before is None or after is None:
        return {}
    cpu = wait = 0
    for tid, (cpu_ns, wait_ns) in after.threads.items():
        cpu0, wait0 = before.threads.get(tid, (0, 0))
        cpu += max(0, cpu_ns - cpu0)
        wait += max(0, wait_ns - wait0)
    out = {"perf/fwd_bwd_cpu_s": cpu / 1e9, "perf/fwd_bwd_cpu_wait_s": wait / 1e9}
    if after.graphs is not None:
        out["perf/fwd_bwd_compile_count"] = float(max(0, after.graphs - (before.graphs or 0)))
    return out
