"""`WeightSync`: one weight sync, run on every trainer rank (SPEC §3.1, §15.8).

Rank 0 holds the backend (it talks to the server); every other rank holds none and only joins
the gathers of the same source, in the same order. Usage::

    # rank 0
    backend = make_weight_sync(client, output_dir=..., ...)
    ws = WeightSync(model, backend, dtype=server_dtype, barrier=dist_barrier())
    # other ranks (mode broadcast from rank 0: backend.mode)
    ws = WeightSync(model, None, mode=mode, dtype=server_dtype, barrier=dist_barrier())

    ws.init()                      # all ranks (NCCL rendezvous on rank 0)
    metrics = ws.sync(version)     # all ranks, every weight_sync_steps steps
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import SyncTimings, WeightSyncBackend, now
from .lora import AdapterSource
from .names import SkipFn, vision_tower_skip
from .params import DEFAULT_BUCKET_BYTES, FullWeightSource

MODES = ("full", "adapter")


def dist_barrier() -> Callable[[], None] | None:
    """``torch.distributed.barrier`` when a process group with more than one rank exists, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.barrier
    return None


class WeightSync:
    """Runs weight syncs for one trainer rank.

    Args:
        model: the training model (plain, FSDP2 and/or PEFT).
        backend: the rank-0 backend (`make_weight_sync`), ``None`` on every other rank.
        mode: ``"full"`` or ``"adapter"``; required when ``backend`` is None (use rank 0's
            ``backend.mode``), checked against it otherwise.
        bucket_bytes / dtype / skip: of the `FullWeightSource` (full mode); ``skip=None`` skips the frozen vision
            tower (`vision_tower_skip`, SPEC §14).
        barrier: called before each sync on every rank and timed as
            ``perf/weight_sync_barrier_s`` (e.g. `dist_barrier`); None = no barrier.

    Raises:
        ValueError: ``mode`` missing or unknown, or disagreeing with the backend.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: WeightSyncBackend | None = None,
        *,
        mode: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        skip: SkipFn | None = None,
        barrier: Callable[[], Any] | None = None,
    ) -> None:
        if backend is not None:
            if mode is not None and mode != backend.mode:
                raise ValueError(f"mode={mode!r} but the backend {type(backend).__name__} syncs in mode {backend.mode!r}")
            mode = backend.mode
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES} (pass rank 0's backend.mode on other ranks)")
        self.backend = backend
        self.mode = mode
        self.barrier = barrier
        if mode == "full":
            self.source: FullWeightSource | AdapterSource = FullWeightSource(
                model, bucket_bytes=bucket_bytes, dtype=dtype, skip=skip if skip is not None else vision_tower_skip(model))
        else:
            self.source = AdapterSource(model)

    @property
    def is_sender(self) -> bool:
        """True on the rank that holds the backend."""
        return self.backend is not None

    @property
    def adapter_name(self) -> str | None:
        """The adapter requests should name (adapter sync), else None (the base model)."""
        return self.backend.current_adapter if self.backend is not None else None

    def init(self) -> None:
        """One-time setup (rank 0: the backend's `init`, e.g. the NCCL rendezvous)."""
        if self.backend is not None:
            self.backend.init()

    def sync(self, version: int) -> dict[str, float]:
        """Publish the current weights as model ``version``; call on every rank, in step.

        Returns:
            the ``perf/weight_sync_*`` metrics of SPEC §15.8, seconds (on other ranks the
            transfer is the time spent in the gathers).

        Raises:
            WeightSyncError: rank 0's backend failed at a server route (named).
        """
        start = now()
        barrier_s = 0.0
        if self.barrier is not None:
            self.barrier()
            barrier_s = now() - start
        if self.backend is not None:
            timings = self.backend.sync(self.source, version)
        else:
            t0 = now()
            self.source.drain()
            timings = SyncTimings(transfer_s=now() - t0)
        timings.add_barrier(barrier_s)
        timings.total_s = now() - start
        return timings.as_metrics()

    def close(self) -> None:
        """Release the backend."""
        if self.backend is not None:
            self.backend.close()
