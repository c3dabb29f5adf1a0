"""The trainer's GPU memory per step: ``perf/gpu_memory_peak_gib``, ``perf/gpu_memory_reserved_gib`` and
``perf/cuda_alloc_retries`` (issues #41, #42, #43).

Colocated with vLLM the trainer gets what the plan leaves it of the GPU (README: GPUs, weight sync and LoRA). When
its caching allocator runs short it frees its cache and retries ``cudaMalloc``, which synchronises the device: a
slow step with no other sign. From torch's allocator counters, per optimizer step:

- ``perf/gpu_memory_peak_gib``: the most memory the trainer's tensors held during the step (GiB);
- ``perf/gpu_memory_reserved_gib``: what its allocator holds from the device at the step's end (GiB; what
  ``nvidia-smi`` shows of the trainer, less the CUDA context);
- ``perf/cuda_alloc_retries``: allocations that had to free the cache and retry during the step (0 normally).

`MemoryWatch.observe` is pure (tests drive it with counter dicts); `MemoryWatch.step` reads and resets torch's
counters. Nothing is logged off CUDA.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MemoryWatch"]

GIB = 2**30


class MemoryWatch:
    """Per-step deltas of torch's CUDA allocator counters (one per trainer process)."""

    def __init__(self) -> None:
        self._retries: int | None = None

    def observe(self, stats: dict[str, Any]) -> dict[str, float]:
        """Metrics of one step from ``torch.cuda.memory_stats()`` taken at its end (its peak reset at the step
        before). The first step's retries count from the process start."""
        retries = int(stats.get("num_alloc_retries", 0))
        out = {"perf/gpu_memory_peak_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
               "perf/gpu_memory_reserved_gib": stats.get("reserved_bytes.all.current", 0) / GIB,
               "perf/cuda_alloc_retries": float(retries - (self._retries or 0))}
        self._retries = retries
        return out

    def step(self, device: Any) -> dict[str, float]:
        """The step's metrics on ``device`` (a ``torch.device``), then a new peak for the next step; ``{}`` off CUDA."""
        import torch

        if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
            return {}
        out = self.observe(torch.cuda.memory_stats(device))
        torch.cuda.reset_peak_memory_stats(device)
        return out
