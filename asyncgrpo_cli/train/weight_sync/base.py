"""What every weight-sync backend shares: timings, errors, and the pause → update → resume frame.

A backend runs on trainer rank 0 only and talks to the server through a `SyncSamplerClient`
(or anything with its methods). Its one per-sync entry point is ``sync(source, version)``:
``source`` is a `FullWeightSource` (``mode == "full"``) or an `AdapterSource`
(``mode == "adapter"``), ``version`` the model version being published (an int), and it returns
the `SyncTimings` of that sync (SPEC §15.8). ``init()`` does one-time setup (NCCL rendezvous,
stale adapter clean-up) and ``close()`` releases it.

Frame of a full-weight sync (SPEC B.23): ``/pause?mode=keep`` → transfer → ``/reset_prefix_cache``
(``reset_running_requests=true``, so frozen requests recompute their KV with the new weights) →
``/resume``. The server is resumed whatever fails in between, and the error names the route.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger(__name__)

METRIC_TOTAL = "perf/weight_sync_s"
METRIC_PAUSE = "perf/weight_sync_pause_s"
METRIC_BARRIER = "perf/weight_sync_barrier_s"
METRIC_TRANSFER = "perf/weight_sync_transfer_s"
METRIC_UPDATE = "perf/weight_sync_update_s"


@dataclass
class SyncTimings:
    """Durations of one weight sync, seconds (SPEC §15.8).

    Attributes:
        pause_s: waiting for the server to pause (``/pause``).
        barrier_s: waiting for the other trainer ranks (added by the caller, `add_barrier`).
        transfer_s: sending the weights (start → update(s) → finish, gathers included; adapter
            sync: save + load + unload).
        total_s: the whole sync (pause, transfer, cache reset, resume, barrier).
        update_s: the part of ``transfer_s`` spent inside the ``/update_weights`` requests (the server
            opening the handles and loading the weights, HTTP included); the rest of ``transfer_s`` is the
            trainer's side (gathers, casts to the server's dtype, building the handles). None where the
            backend does not measure it (only the CUDA-IPC backend does; it is then logged as
            ``perf/weight_sync_update_s``).
    """

    pause_s: float = 0.0
    barrier_s: float = 0.0
    transfer_s: float = 0.0
    total_s: float = 0.0
    update_s: float | None = None

    def add_barrier(self, seconds: float) -> None:
        """Count ``seconds`` spent waiting for other ranks (into ``barrier_s`` and ``total_s``)."""
        if seconds < 0:
            raise ValueError(f"barrier seconds={seconds} must be >= 0")
        self.barrier_s += seconds
        self.total_s += seconds

    def as_metrics(self) -> dict[str, float]:
        """``{"perf/weight_sync_s": ..., "perf/weight_sync_pause_s": ..., ...}`` (seconds), with
        ``perf/weight_sync_update_s`` only when ``update_s`` was measured."""
        metrics = {
            METRIC_TOTAL: self.total_s,
            METRIC_PAUSE: self.pause_s,
            METRIC_BARRIER: self.barrier_s,
            METRIC_TRANSFER: self.transfer_s,
        }
        if self.update_s is not None:
            metrics[METRIC_UPDATE] = self.update_s
        return metrics


class WeightSyncError(RuntimeError):
    """A weight sync failed; ``route`` is the server route (or step) that failed, ``version`` the
    model version that was being published. The original error is chained."""

    def __init__(self, message: str, route: str, version: int | None = None) -> None:
        super().__init__(message)
        self.route = route
        self.version = version


class Background:
    """Run ``fn()`` on a daemon thread (an HTTP call that blocks until a collective ends).

    A daemon thread, not an executor: when the trainer side of a collective fails, the HTTP
    call may never return, and waiting for it would hang the trainer.
    """

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # re-raised by result()
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        """True once ``fn`` returned or raised."""
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> Any:
        """``fn``'s result, re-raising its exception.

        Raises:
            TimeoutError: not finished within ``timeout_s``.
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self._thread.name} still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._result


def now() -> float:
    """Monotonic clock, seconds."""
    return time.perf_counter()


class WeightSyncBackend(ABC):
    """Base of the trainer-side weight-sync backends (rank 0 only).

    Subclasses set ``mode`` (``"full"`` or ``"adapter"``) and implement `sync`.

    Args:
        client: a `SyncSamplerClient` (or an object with the same methods).
    """

    mode: ClassVar[str] = "full"

    def __init__(self, client: Any) -> None:
        self.client = client

    def init(self) -> None:
        """One-time setup before the first sync (default: nothing)."""

    @abstractmethod
    def sync(self, source: Any, version: int) -> SyncTimings:
        """Publish ``source``'s weights as model ``version``; returns the timings.

        Raises:
            WeightSyncError: a server route failed (named in the message); the server has
                been resumed.
        """

    def close(self) -> None:
        """Release what `init` set up (default: nothing)."""

    def push_current(self, source: Any, version: int) -> SyncTimings:
        """Publish ``source`` as ``version`` again, a version the server may already have had (re-push
        after an outage, or on resume). Default: `sync`."""
        return self.sync(source, version)

    def reconnect(self) -> None:
        """Forget per-server state before a re-push to a server that may have restarted (it lost its
        weights, adapters and transfer group). Default: nothing (the next `sync` sends everything anyway)."""

    @property
    def current_adapter(self) -> str | None:
        """The LoRA adapter name requests should use (adapter sync), else None (the base model)."""
        return None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def call(route: str, version: int | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; any failure becomes a `WeightSyncError` naming ``route``."""
        try:
            return fn(*args, **kwargs)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync to model version {version} failed at {route}: {type(exc).__name__}: {exc}",
                route, version,
            ) from exc

    @contextmanager
    def paused(self, version: int, timings: SyncTimings) -> Iterator[None]:
        """``/pause?mode=keep`` on entry; on success ``/reset_prefix_cache`` then ``/resume``.

        On failure the server is still resumed; a failing ``/resume`` is then noted on the
        original error instead of replacing it.
        """
        start = now()
        try:
            self.call("/pause", version, self.client.pause, "keep")
            timings.pause_s = now() - start
            yield
            ok = self.call("/reset_prefix_cache", version, self.client.reset_prefix_cache,
                           reset_running_requests=True)
            if ok is False:
                log.warning("weight sync v%s: /reset_prefix_cache kept answering success=false; "
                            "cached KV of old weights may be reused", version)
        except BaseException as exc:
            try:
                self.call("/resume", version, self.client.resume)
            except WeightSyncError as resume_exc:
                exc.add_note(f"resuming the server afterwards failed too: {resume_exc}")
                # One line that names the route that failed first: a line naming only /resume, logged before the
                # caller's error about the failing route, read as a second failure (a server kill -9 mid-sync).
                first = f"failed at {exc.route}" if isinstance(exc, WeightSyncError) else \
                    f"failed ({type(exc).__name__}: {exc})"
                cause = resume_exc.__cause__
                log.error("weight sync to model version %s %s; resuming the server afterwards failed too (%s)",
                          version, first, f"{type(cause).__name__}: {cause}" if cause is not None else resume_exc)
            raise
        self.call("/resume", version, self.client.resume)


def drain_quietly(iterator: Iterator[Any]) -> None:
    """Exhaust ``iterator`` (keeps other ranks' gathers in step after a failure), ignoring errors."""
    try:
        for _ in iterator:
            pass
    except Exception as exc:  # noqa: BLE001 - the first error is the one reported
        log.debug("ignored while draining after a failed sync: %r", exc)
