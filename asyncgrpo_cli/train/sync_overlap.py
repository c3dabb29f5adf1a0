"""One weight sync in flight on a background thread (``sampler.weight_sync_overlap``, README "Overlapped weight sync").

With the option on, the trainer starts the sync of step N (`AsyncGRPOTrainer._push_weights`) here right after step
N's optimizer step, and goes on with step N+1: it pulls its samples and runs its forward and backward while the
server loads the new weights. It settles the sync (`PendingSync.settle`: waits for it, takes its metrics or its
error) before anything that changes the parameters or depends on the server's weights: step N+1's optimizer step,
the next sync, a re-push, an eval round, a checkpoint, the run's end. The rollout worker learns the new version
when the push has ended, from the sync's thread (SPEC §3.1, B.23: a group's version is the one the server served
when its first rollout started).

On a CUDA trainer the sync's GPU work runs on a stream of its own, which first waits for what the trainer's stream
held when the sync started (the optimizer step): on the trainer's stream, the sync's copies and the CUDA-IPC event the
server's load waits for would queue behind the next step's forward and backward, which the trainer launches meanwhile.
The stream is synchronized before the sync counts as done, so the parameters are free to change once it is settled.

Nothing here knows the trainer: ``fn`` is any callable that returns the sync's metrics, so tests drive it directly.
A plain daemon thread per sync, not an executor, as `weight_sync.base.Background`: a sync that never returns (a
hung server) must not keep the process from exiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class PendingSync:
    """At most one weight sync running on a background thread, and its outcome until it is settled.

    Args:
        device: the trainer's device; when it is a CUDA device, the thread selects it first
            (``torch.cuda.set_device``: the current device is per thread; ``cuda`` without an index, as accelerate
            gives one process, is the caller's current device at `start`) and runs ``fn`` on a stream of its own that
            waits for the caller's stream as it was at `start` (module docstring). None or a CPU device: neither.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, device: torch.device | str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device = torch.device(device) if device is not None else None
        self.clock = clock
        self.version: int | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._metrics: dict[str, float] = {}
        self._error: BaseException | None = None
        self._stream: Any = None  # CUDA: the syncs' own stream, made by the first sync's thread

    @property
    def in_flight(self) -> bool:
        """A sync was started and not settled yet (it may have finished already: `done`)."""
        return self._thread is not None

    @property
    def done(self) -> bool:
        """A sync is in flight and has returned or raised: `settle` does not wait."""
        return self._thread is not None and self._done.is_set()

    def start(self, version: int, fn: Callable[[], dict[str, float]]) -> None:
        """Run ``fn()`` (the sync of model ``version``) on a new background thread and return at once.

        Raises:
            RuntimeError: a sync is still in flight (settle it first: one at a time).
        """
        if self._thread is not None:
            raise RuntimeError(f"the weight sync of model version {self.version} is still in flight; settle it "
                               f"before starting the one of version {version}")
        ready = None
        if self._cuda:  # what the caller's stream holds now (the optimizer step): the sync reads after it
            if self.device.index is None:  # accelerate's one-process device is "cuda": the caller's current device,
                # read here on its thread (the sync's thread starts on device 0; torch.cuda.set_device("cuda") raises)
                self.device = torch.device("cuda", torch.cuda.current_device())
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.version = int(version)
        self._metrics, self._error = {}, None
        self._done.clear()
        self._thread = threading.Thread(target=self._run, args=(fn, ready), name=f"weight-sync-v{version}",
                                         daemon=True)
        self._thread.start()

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _run(self, fn: Callable[[], dict[str, float]], ready: Any) -> None:
        try:
            if not self._cuda:
                self._metrics = dict(fn() or {})
                return
            torch.cuda.set_device(self.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_event(ready)
            try:
                with torch.cuda.stream(self._stream):
                    self._metrics = dict(fn() or {})
            finally:
                self._stream.synchronize()  # its reads of the parameters are over before the sync counts as done
        except BaseException as exc:  # noqa: BLE001 - re-raised on the trainer's thread by settle()
            self._error = exc
        finally:
            self._done.set()

    def settle(self, timeout_s: float | None = None) -> tuple[dict[str, float], float]:
        """Wait for the sync in flight and end it: after this, nothing is in flight (also when it raises).

        Args:
            timeout_s: longest wait, seconds (None: until the sync ends).

        Returns:
            (the sync's ``perf/weight_sync_*`` metrics of SPEC §15.8, seconds; the seconds this call blocked),
            ``({}, 0.0)`` when nothing is in flight.

        Raises:
            TimeoutError: the sync did not end within ``timeout_s`` (it stays in flight).
            BaseException: whatever the sync raised (e.g. `WeightSyncError`), as it raised it.
        """
        if self._thread is None:
            return {}, 0.0
        start = self.clock()
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the weight sync of model version {self.version} still runs after {timeout_s} s")
        waited = self.clock() - start
        metrics, error = self._metrics, self._error
        self._thread, self.version, self._metrics, self._error = None, None, {}, None
        if error is not None:
            raise error
        return metrics, waited

    def __repr__(self) -> str:
        state: Any = "idle" if self._thread is None else ("done" if self._done.is_set() else "running")
        return f"PendingSync(version={self.version}, {state})"
