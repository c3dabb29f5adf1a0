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
    metrics = ws.push_current(v)   # all ranks: re-push the current weights as version v now
                                   # (the server restarted and lost them, or a resume)

Server outages (SPEC B.17): every server call of a sync waits out refused connections for up to
``vllm_server_timeout`` (`SyncSamplerClient`). When a sync fails because the server went away during it
(an outage began, or a connection dropped mid-request), the whole sync is repeated against the server
that came back, after `WeightSyncBackend.reconnect` (new NCCL group, adapters it lost): at most
`MAX_PUSH_ATTEMPTS` attempts. Every rank repeats its gathers in step (rank 0's decision is broadcast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import logging

from ...sampler.protocol import SamplerConnectionLost, SamplerUnavailableError
from .base import SyncTimings, WeightSyncBackend, WeightSyncError, now
from .lora import AdapterSource
from .names import SkipFn, vision_tower_skip
from .params import DEFAULT_BUCKET_BYTES, FullWeightSource

MODES = ("full", "adapter")
MAX_PUSH_ATTEMPTS = 3
"""Attempts of one sync when the server goes away during it (each attempt waits out refusals itself)."""

log = logging.getLogger(__name__)


def server_went_away(exc: BaseException, outages_before: int | None, outage: Any) -> bool:
    """Whether a failed sync failed because the server went away (so repeating it on the server that
    came back can succeed): an outage began during it, or a request lost its connection. A server that
    stayed down past ``vllm_server_timeout`` (`SamplerUnavailableError`) is final."""
    chain, cause = [], exc
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__
    if any(isinstance(c, SamplerUnavailableError) for c in chain):
        return False
    if outage is not None and outages_before is not None and outage.started != outages_before:
        return True
    return any(isinstance(c, SamplerConnectionLost) for c in chain)


def _agree(flag: Any) -> Any:
    """Rank 0's ``flag`` on every rank (a no-op without a multi-rank process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [flag]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return flag


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
        return self._publish(version, again=False)

    def push_current(self, version: int) -> dict[str, float]:
        """Push the current weights (or adapter) now, as model ``version``: after the server lost them
        (a restart seen as an outage that ended) and on resume, before generation goes on. Call on
        every rank, in step, like `sync`.

        The backend first forgets its per-server state (`WeightSyncBackend.reconnect`); an adapter is
        loaded again under ``policy-v{version}`` (replacing one still loaded under that name).

        Returns:
            the ``perf/weight_sync_*`` metrics of the push, seconds.

        Raises:
            WeightSyncError: the push failed (the server stayed down past ``vllm_server_timeout``, or a
                route failed; named in the message).
        """
        if self.backend is not None:
            log.warning("pushing the current weights to the server again as model version %s", version)
            self.backend.reconnect()
        return self._publish(version, again=True)

    def _publish(self, version: int, again: bool) -> dict[str, float]:
        start = now()
        barrier_s = 0.0
        if self.barrier is not None:
            self.barrier()
            barrier_s = now() - start
        timings = SyncTimings()
        for attempt in range(1, MAX_PUSH_ATTEMPTS + 1):
            error: BaseException | None = None
            if self.backend is not None:
                outage = getattr(self.backend.client, "outage", None)
                before = outage.started if outage is not None else None
                try:
                    timings = (self.backend.push_current if again else self.backend.sync)(self.source, version)
                except WeightSyncError as exc:
                    error = exc
                retry = (error is not None and attempt < MAX_PUSH_ATTEMPTS and server_went_away(error, before, outage)
                         and not getattr(outage, "stopping", lambda: None)())  # a stopping job pushes no more
                decision = "ok" if error is None else "retry" if retry else "failed"
            else:
                t0 = now()
                self.source.drain()
                timings = SyncTimings(transfer_s=now() - t0)
                decision = None
            decision = _agree(decision)
            if decision == "ok":
                break
            if error is not None and decision == "failed":
                raise error
            if decision == "failed":
                raise WeightSyncError(f"weight sync to model version {version} failed on rank 0 (see its log)",
                                      "rank 0", version)
            if self.backend is not None:
                log.warning("weight sync to model version %s: the server went away during it (%s); pushing "
                            "the whole version again once the server answers (attempt %d of %d)",
                            version, error, attempt + 1, MAX_PUSH_ATTEMPTS)
                self.backend.reconnect()
            again = True
        timings.add_barrier(barrier_s)
        timings.total_s = now() - start
        return timings.as_metrics()

    def close(self) -> None:
        """Release the backend."""
        if self.backend is not None:
            self.backend.close()
