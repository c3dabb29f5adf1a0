"""Full-weight sync to a vLLM server on the trainer's own GPU, over CUDA IPC (issue #17, VLLM.md).

The colocated layout (`asyncgrpo_cli.server.colocate`): vLLM runs with
``--weight-transfer-config '{"backend": "ipc"}'`` on the GPU the trainer uses. No NCCL group forms and
no byte is copied between GPUs: the trainer hands the server CUDA-IPC handles of its (bf16) tensors,
and vLLM's workers map them and load the weights in place.

The trainer side is vLLM's own ``IPCWeightTransferEngine.trainer_send_weights`` (it builds the
handles with torch's ``reduce_tensor`` and holds the tensors until the send is done); its ``send_mode``
callable hands us each update, which goes to ``/update_weights`` through our `SyncSamplerClient` as
base64-pickled handles (``ipc_handles_pickled``). The server only accepts those with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: such a server must listen on loopback only (the builder
refuses another ``sampler.host``).

Per sync: ``/pause?mode=keep`` → ``/start_weight_update`` → ``/update_weights`` (one request, or one per
1 GiB chunk with ``packed``) → ``/finish_weight_update`` → ``/reset_prefix_cache`` → ``/resume``, with
`WeightSyncBackend.paused`'s failure handling (the server is resumed whatever fails).

Versions: vLLM 0.26.x has the engine (``send_mode`` may be a callable); a vLLM without
``vllm.distributed.weight_transfer.ipc_engine`` gets an `ImportError` naming the version and the
two-GPU alternative. vLLM 0.26.0's module imports ``ray`` at load time, so ray must be installed.
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from .base import SyncTimings, WeightSyncBackend, WeightSyncError, drain_quietly, now
from .params import FullWeightSource
from .vllm_source import CurrentSource, _checked

TWO_GPU_ALTERNATIVE = ("or use two GPUs: launch.colocate=false on a machine with 2+ GPUs (vLLM on one, the trainer "
                       "on the other, NCCL weight transfer)")


def _installed_vllm() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("vllm")
    except Exception:  # noqa: BLE001 - only used in a message
        return "not installed"


def import_ipc_api() -> SimpleNamespace:
    """vLLM's trainer side of CUDA-IPC weight transfer.

    Returns:
        A namespace with ``IPCWeightTransferEngine`` and ``IPCTrainerSendWeightsArgs`` (vLLM 0.26), or with
        ``IPCTrainerWeightTransferEngine``, ``IPCTrainerInitInfo``, ``WeightSource`` and ``ParamMeta``
        (vLLM 0.33: the trainer-side engine drives start → update → finish itself).

    Raises:
        ImportError: the installed vLLM has no ``ipc_engine`` (or a dependency of it, e.g. ray on
            vLLM 0.26.0, is missing), naming the version, the fix and the two-GPU alternative.
    """
    try:
        from vllm.distributed.weight_transfer import ipc_engine
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        version = _installed_vllm()
        if missing == "ray":
            fix = "pip install ray (vLLM 0.26's ipc_engine imports it at load time, on both sides)"
        else:
            fix = "pip install 'vllm>=0.26' (the first release with the ipc weight-transfer backend)"
        raise ImportError(f"CUDA-IPC weight sync needs vllm.distributed.weight_transfer.ipc_engine, which the "
                          f"installed vLLM ({version}) cannot import: {exc}. Fix: {fix}, {TWO_GPU_ALTERNATIVE}") from exc
    if hasattr(ipc_engine, "IPCTrainerWeightTransferEngine"):  # vLLM 0.33: a trainer-side engine object
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        return SimpleNamespace(IPCTrainerWeightTransferEngine=ipc_engine.IPCTrainerWeightTransferEngine,
                               IPCTrainerInitInfo=ipc_engine.IPCTrainerInitInfo,
                               WeightSource=WeightSource, ParamMeta=ParamMeta)
    return SimpleNamespace(IPCWeightTransferEngine=ipc_engine.IPCWeightTransferEngine,
                           IPCTrainerSendWeightsArgs=ipc_engine.IPCTrainerSendWeightsArgs)


def _fields(cls: Any) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set()


def http_update_info(update_info: Any) -> dict[str, Any]:
    """The JSON body of ``/update_weights`` for one vLLM ``IPCWeightTransferUpdateInfo``: every field but
    ``ipc_handles``, which goes as ``ipc_handles_pickled`` (base64 of the pickled handles, the encoding
    vLLM's own HTTP transport uses)."""
    if dataclasses.is_dataclass(update_info):  # shallow: the handles hold classes and dtypes, not data
        fields = {f.name: getattr(update_info, f.name) for f in dataclasses.fields(update_info)}
    else:
        fields = dict(update_info)
    handles = fields.pop("ipc_handles")
    fields.pop("ipc_handles_pickled", None)
    fields = {k: v for k, v in fields.items() if v is not None}
    fields["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
    return fields


class VllmIpcSync(CurrentSource, WeightSyncBackend):
    """Full-weight sync to a vLLM server on the same GPU (CUDA IPC; vLLM 0.26+).

    Args:
        client: `SyncSamplerClient` of a vLLM started with ``--weight-transfer-config
            '{"backend": "ipc"}'``, ``VLLM_SERVER_DEV_MODE=1`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
        device: the trainer's CUDA device (tensors are moved there; the server must run on it).
        packed: send in 1 GiB packed chunks (bounded extra memory, one request per chunk) instead of
            one request holding a handle per tensor (extra memory: the model in the server's dtype).
        vllm_api: object with ``IPCWeightTransferEngine`` and ``IPCTrainerSendWeightsArgs`` (tests, which
            may then run on CPU); default: imported from vLLM (`import_ipc_api`).
        send_weight_version: send ``{"weight_version": str(version)}`` to ``/finish_weight_update``
            (vLLM 0.27+ accepts it; 0.26 gets an empty body).

    Raises:
        ImportError: at `init`, when vLLM's IPC engine cannot be imported (see `import_ipc_api`).
        ValueError: at `init`, when ``device`` is not a CUDA device.
    """

    mode = "full"

    def __init__(self, client: Any, device: str | torch.device | None = None, *, packed: bool = False,
                 vllm_api: Any = None, send_weight_version: bool = False) -> None:
        super().__init__(client)
        self.send_weight_version = send_weight_version
        self.device = torch.device(device) if device is not None else None
        self.packed = packed
        self._api = vllm_api
        self._ready = False
        self._engine: Any = None  # vLLM 0.33's IPCTrainerWeightTransferEngine, built at the first sync
        self._current: FullWeightSource | None = None
        self._live: Iterator[tuple[str, torch.Tensor]] | None = None
        self._version: int | None = None
        self.requests = 0  # /update_weights requests of the last sync
        self.update_s = 0.0  # seconds inside those requests (SyncTimings.update_s)

    def init(self) -> None:
        """Import vLLM's IPC engine, select the trainer's GPU, and check that the server is one process
        (``/get_world_size`` == 1: a tensor-parallel server spans GPUs the trainer's handles do not reach)."""
        real = self._api is None
        if real:
            self._api = import_ipc_api()
        if real and (self.device is None or self.device.type != "cuda"):
            raise ValueError(f"CUDA-IPC weight sync needs the trainer on a CUDA GPU, got device={self.device}. "
                             f"Fix: run the trainer on the server's GPU (launch.colocate=true), "
                             f"{TWO_GPU_ALTERNATIVE}")
        if self.device is not None and self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        world = int(self.call("/get_world_size", None, self.client.get_world_size))
        if world != 1:
            raise WeightSyncError(f"the ipc server has {world} workers; colocated sync supports one (the GPU the "
                                  f"trainer shares). Fix: start it without tensor parallelism, {TWO_GPU_ALTERNATIVE}",
                                  "/get_world_size")
        if not self._engine_api:
            self.call("/init_weight_transfer_engine", None, self.client.init_weight_transfer_engine, {})
        # vLLM 0.33: IPCTrainerWeightTransferEngine.trainer_init posts /init_weight_transfer_engine itself (with
        # ``packed``) and reads the source's metadata, so it runs at the first sync, which has the source.
        self._ready = True

    @property
    def _engine_api(self) -> bool:
        return self._api is not None and hasattr(self._api, "IPCTrainerWeightTransferEngine")

    def reconnect(self) -> None:
        """A restarted server has no transfer engine: the next `sync` initialises it again."""
        self._ready = False
        self._engine = None

    def _update(self, version: int | None, update_info: Any) -> None:
        """One ``/update_weights`` request, counted in ``requests`` and timed into ``update_s``."""
        body = http_update_info(update_info)
        self.requests += 1
        t0 = now()
        try:
            self.call("/update_weights", version, self.client.update_weights, body)
        finally:
            self.update_s += now() - t0

    def _measured_update_s(self) -> float | None:
        """``update_s`` of this sync, or None when vLLM posted the updates itself (0.26's ``mode="http"``
        sender: none passed through `_update`, so nothing was timed)."""
        return self.update_s if self.requests else None

    def _send_args(self, version: int) -> Any:
        cls = self._api.IPCTrainerSendWeightsArgs
        names = _fields(cls)

        def send(update_info: Any) -> None:
            self._update(version, update_info)

        kwargs: dict[str, Any] = {}
        if "packed" in names:
            kwargs["packed"] = self.packed
        if "send_mode" in names:
            return cls(send_mode=send, **kwargs)
        # Older trainer API (mode + url): vLLM posts to /update_weights itself.
        return cls(mode="http", url=self.client.base_url, **kwargs)

    def sync(self, source: FullWeightSource, version: int) -> SyncTimings:
        """``/pause`` → ``/start_weight_update`` → ``/update_weights`` (IPC handles) →
        ``/finish_weight_update`` → ``/reset_prefix_cache`` → ``/resume``.

        Raises:
            WeightSyncError: a route failed, or vLLM's sender raised (``route`` = ``"ipc send"``;
                e.g. the server runs on another GPU than the trainer).
        """
        if not self._ready:
            self.init()
        if self._engine_api:
            return self._sync_engine(source, version)
        timings = SyncTimings()
        start = now()
        meta = source.metadata()
        tensors: Iterator[tuple[str, torch.Tensor]] = source.tensors()
        self.requests, self.update_s = 0, 0.0
        try:
            with self.paused(version, timings):
                t0 = now()
                self.call("/start_weight_update", version, self.client.start_weight_update)
                try:
                    self._api.IPCWeightTransferEngine.trainer_send_weights(_checked(meta, tensors, self.device),
                                                                           self._send_args(version))
                except WeightSyncError:
                    raise
                except Exception as exc:
                    raise self._send_error(version, exc) from exc
                self.call("/finish_weight_update", version, self.client.finish_weight_update,
                          str(version) if self.send_weight_version else None)
                timings.transfer_s, timings.update_s = now() - t0, self._measured_update_s()
        except BaseException:
            drain_quietly(tensors)
            raise
        finally:
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # free the blocks the server has let go of
        timings.total_s = now() - start
        return timings

    def _send_error(self, version: int, exc: Exception) -> WeightSyncError:
        return WeightSyncError(f"weight sync to model version {version} failed in the CUDA-IPC send: "
                               f"{type(exc).__name__}: {exc} (the server must run on the trainer's GPU, "
                               f"{self.device}; {TWO_GPU_ALTERNATIVE})", "ipc send", version)

    # ------------------------------------------------------------------ vLLM 0.33: the trainer-side engine
    def _wire(self) -> Any:
        """vLLM's four-method weight-sync client protocol over our `SyncSamplerClient` (errors name the route)."""
        backend = self

        class _Wire:
            def init_weight_transfer_engine(self, init_info: dict) -> None:
                backend.call("/init_weight_transfer_engine", None, backend.client.init_weight_transfer_engine,
                             init_info)

            def start_weight_update(self) -> None:
                backend.call("/start_weight_update", backend._version, backend.client.start_weight_update)

            def update_weights(self, update_info: Any) -> None:
                backend._update(backend._version, update_info)

            def finish_weight_update(self, weight_version: str | None = None) -> None:
                version = backend._version
                backend.call("/finish_weight_update", version, backend.client.finish_weight_update,
                             str(version) if backend.send_weight_version else None)

        return _Wire()

    def _sync_engine(self, source: FullWeightSource, version: int) -> SyncTimings:
        """vLLM 0.33: ``/pause`` → ``engine.send_weights()`` (``/start_weight_update`` → ``/update_weights``
        with the CUDA-IPC handles → ``/finish_weight_update``) → ``/reset_prefix_cache`` → ``/resume``."""
        timings = SyncTimings()
        start = now()
        self._current, self._live, self._version, self.requests, self.update_s = source, None, version, 0, 0.0
        try:
            if self._engine is None:
                info = self._api.IPCTrainerInitInfo(rank=0, packed=self.packed)
                self._engine = self._api.IPCTrainerWeightTransferEngine.trainer_init(
                    info, client=self._wire(), source=self._vllm_source())
            with self.paused(version, timings):
                t0 = now()
                try:
                    self._engine.send_weights()
                except WeightSyncError:
                    raise
                except Exception as exc:
                    raise self._send_error(version, exc) from exc
                timings.transfer_s, timings.update_s = now() - t0, self._measured_update_s()
        except BaseException:
            drain_quietly(self._live if self._live is not None else source.tensors())
            raise
        finally:
            self._current, self._live = None, None
        timings.total_s = now() - start
        return timings
