"""Full-weight sync to vLLM over NCCL, through vLLM's own trainer-side classes (DESIGN §5 item 1).

vLLM changed its trainer-side API at 0.28, so there is one thin adapter per API generation
(VLLM.md "Weight transfer"); neither re-implements NCCL rendezvous. The trainer joins vLLM's
weight-transfer group as rank 0 of ``world_size = server world + 1`` (workers at rank offset 1).
Server and trainer must use different GPUs.

- `VllmNccl026Sync` (vLLM 0.26–0.27): ``NCCLWeightTransferEngine.trainer_init({...})`` →
  ``PyNcclCommunicator``; per sync ``trainer_send_weights(iterator, NCCLTrainerSendWeightsArgs)``
  broadcasts while ``/update_weights`` (names, dtype_names, shapes, packed) waits on a thread.
- `VllmNccl028Sync` (vLLM 0.28+): ``WeightTransferTrainerFactory.trainer_init(init_info=
  NCCLTrainerInitInfo(...), client=HTTPVLLMWeightSyncClient(url), source=WeightSource)`` →
  engine; per sync ``engine.send_weights()`` runs start → update ∥ broadcast → finish itself.

In both, pause/resume and the prefix-cache reset are ours (`WeightSyncBackend.paused`). vLLM is
imported lazily; tests inject recording fakes through ``vllm_api``.
"""

from __future__ import annotations

import inspect
import logging
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from .base import Background, SyncTimings, WeightSyncBackend, WeightSyncError, drain_quietly, now
from .params import FullWeightSource
from .vllm_source import CurrentSource, _checked, metadata_is_cached_property  # noqa: F401 (_checked: re-exported)

log = logging.getLogger(__name__)

_INSTALL_HINT = (
    "install the vLLM release the server runs in the trainer's environment, e.g. "
    "pip install 'asyncgrpo[vllm]' 'vllm=={version}'"
)


def address_facing(base_url: str) -> str:
    """This host's address as the server at ``base_url`` sees it: the local address the routing table picks
    for a (UDP, so no packet is sent) socket connected to the server's host. ``http://localhost:8000`` gives
    ``127.0.0.1``; a server on another machine gives this machine's address on the network that reaches it.

    Raises:
        ValueError: the URL has no host, or the host cannot be resolved or reached from here; the message
            names ``sampler.weight_transfer_address`` as the fix.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    host = parts.hostname
    fix = ("Fix: set sampler.weight_transfer_address (weight_transfer_address) to this trainer's address "
           "that the vLLM server's workers can connect to")
    if not host:
        raise ValueError(f"vllm_server_base_url={base_url!r} names no host to find this machine's address towards. {fix}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot find this machine's address towards the vLLM server host {host!r} "
                         f"(from vllm_server_base_url={base_url!r}): {exc}. {fix}") from exc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the NCCL rendezvous; an IPv4 or IPv6 address)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(sockaddr)
        return int(s.getsockname()[1])


def _import_026() -> SimpleNamespace:
    try:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )
    except ImportError as exc:
        raise ImportError(
            "VllmNccl026Sync needs vLLM 0.26-0.27 (vllm.distributed.weight_transfer.nccl_engine."
            f"NCCLWeightTransferEngine); {_INSTALL_HINT.format(version='0.26.0')}. Import error: {exc}"
        ) from exc
    return SimpleNamespace(NCCLWeightTransferEngine=NCCLWeightTransferEngine,
                           NCCLTrainerSendWeightsArgs=NCCLTrainerSendWeightsArgs)


def _import_028() -> SimpleNamespace:
    try:
        from vllm.distributed.weight_transfer.base import ParamMeta as VllmParamMeta
        from vllm.distributed.weight_transfer.base import WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        try:
            from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
        except ImportError:
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    except ImportError as exc:
        raise ImportError(
            "VllmNccl028Sync needs vLLM >= 0.28 (WeightTransferTrainerFactory, NCCLTrainerInitInfo, "
            f"HTTPVLLMWeightSyncClient); {_INSTALL_HINT.format(version='<server version>')}. "
            f"Import error: {exc}"
        ) from exc
    return SimpleNamespace(WeightTransferTrainerFactory=WeightTransferTrainerFactory,
                           NCCLTrainerInitInfo=NCCLTrainerInitInfo,
                           HTTPVLLMWeightSyncClient=HTTPVLLMWeightSyncClient,
                           WeightSource=WeightSource, ParamMeta=VllmParamMeta)


class _NcclBase(WeightSyncBackend):
    mode = "full"

    def __init__(self, client: Any, master_address: str = "127.0.0.1", master_port: int | None = None,
                 device: str | torch.device | None = None, *, packed: bool = True,
                 vllm_api: Any = None) -> None:
        super().__init__(client)
        if master_port is not None and not 0 < int(master_port) < 65536:
            raise ValueError(f"master_port={master_port} must be in 1..65535 (or None for a free port)")
        self.master_address = master_address
        self.master_port = int(master_port) if master_port is not None else free_port(master_address)
        self.device = torch.device(device) if device is not None else None
        self.packed = packed
        self._api = vllm_api
        self.world_size: int | None = None

    def reconnect(self) -> None:
        """Drop the NCCL group: a restarted server has none; the next `sync` rendezvouses again."""
        self._group = None
        engine = getattr(self, "_engine", None)
        if engine is not None and hasattr(engine, "shutdown"):
            try:
                engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - the old group's server side is gone
                log.warning("shutting the old weight-transfer engine down failed: %r", exc)
        self._engine = None

    def _select_device(self) -> None:
        """Make ``device`` current for vLLM's communicator (a bare ``cuda`` means the current one)."""
        if self.device is not None and self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)

    def _synchronize(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class VllmNccl026Sync(_NcclBase):
    """NCCL weight sync for vLLM 0.26–0.27 (the sequence seen working on the lent H200s).

    Args:
        client: `SyncSamplerClient` of the vLLM server (``VLLM_SERVER_DEV_MODE=1``,
            ``--weight-transfer-config '{"backend": "nccl"}'``).
        master_address: address of this trainer process that the server's workers can reach.
        master_port: rendezvous port; ``None`` picks a free one.
        device: the trainer's CUDA device for the transfer (tensors are moved there).
        packed: packed broadcasting (vLLM's default buffer sizes on both sides).
        vllm_api: object with ``NCCLWeightTransferEngine`` and ``NCCLTrainerSendWeightsArgs``
            (tests); default: imported from vLLM.
        send_weight_version: send ``{"weight_version": str(version)}`` to
            ``/finish_weight_update`` (vLLM 0.27 accepts it; 0.26 gets an empty body).

    Raises:
        ImportError: vLLM 0.26–0.27 is not installed (at `init`), naming what to install.
    """

    _group: Any = None  # vLLM's PyNcclCommunicator, set by init()

    def __init__(self, *args: Any, send_weight_version: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_weight_version = send_weight_version

    def init(self) -> None:
        """``GET /get_world_size``, then ``/init_weight_transfer_engine`` on a thread while
        ``trainer_init`` joins the group as rank 0."""
        if self._api is None:
            self._api = _import_026()
        server_world = self.call("/get_world_size", None, self.client.get_world_size)
        self.world_size = int(server_world) + 1
        self._select_device()
        init_info = {"master_address": self.master_address, "master_port": self.master_port,
                     "rank_offset": 1, "world_size": self.world_size}
        server = Background(lambda: self.call("/init_weight_transfer_engine", None,
                                              self.client.init_weight_transfer_engine, init_info),
                            "init_weight_transfer_engine")
        engine = self._api.NCCLWeightTransferEngine
        self._group = engine.trainer_init({"master_address": self.master_address,
                                           "master_port": self.master_port, "world_size": self.world_size})
        server.result()

    def sync(self, source: FullWeightSource, version: int) -> SyncTimings:
        """``/pause`` → ``/start_weight_update`` → ``/update_weights`` ∥ broadcast →
        ``/finish_weight_update`` → ``/reset_prefix_cache`` → ``/resume``."""
        if self._group is None:
            self.init()
        timings = SyncTimings()
        start = now()
        meta = source.metadata()
        update_info = {"names": [m.name for m in meta], "dtype_names": [m.dtype_name for m in meta],
                       "shapes": [list(m.shape) for m in meta], "packed": self.packed}
        tensors = source.tensors()
        try:
            with self.paused(version, timings):
                t0 = now()
                self.call("/start_weight_update", version, self.client.start_weight_update)
                receiver = Background(lambda: self.call("/update_weights", version,
                                                        self.client.update_weights, update_info),
                                      "update_weights")
                if receiver.done():  # rejected before any NCCL call: don't broadcast into the void
                    receiver.result()
                args = self._api.NCCLTrainerSendWeightsArgs(group=self._group, packed=self.packed)
                try:
                    self._api.NCCLWeightTransferEngine.trainer_send_weights(
                        _checked(meta, tensors, self.device), args)
                    self._synchronize()
                except Exception as exc:
                    raise WeightSyncError(f"weight sync to model version {version} failed in the NCCL "
                                          f"broadcast: {type(exc).__name__}: {exc}", "nccl broadcast",
                                          version) from exc
                receiver.result()
                self.call("/finish_weight_update", version, self.client.finish_weight_update,
                          str(version) if self.send_weight_version else None)
                timings.transfer_s = now() - t0
        except BaseException:
            drain_quietly(tensors)  # finish this pass's gathers so the other ranks are not left waiting
            raise
        timings.total_s = now() - start
        return timings


class _RouteRecorder:
    """Wraps vLLM's HTTP weight-sync client and remembers the last route it called."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failed_route: str | None = None

    def _run(self, route: str, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.inner, fn)(*args)
        except BaseException:
            self.failed_route = route
            raise

    def init_weight_transfer_engine(self, init_info: dict) -> Any:
        return self._run("/init_weight_transfer_engine", "init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> Any:
        return self._run("/start_weight_update", "start_weight_update")

    def update_weights(self, update_info: dict) -> Any:
        return self._run("/update_weights", "update_weights", update_info)

    def finish_weight_update(self) -> Any:
        return self._run("/finish_weight_update", "finish_weight_update")


def _accepts(cls: Any, name: str) -> bool:
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


class VllmNccl028Sync(CurrentSource, _NcclBase):
    """NCCL weight sync for vLLM 0.28+ (trainer-side engine API).

    Same arguments as `VllmNccl026Sync`; ``vllm_api`` provides ``WeightTransferTrainerFactory``,
    ``NCCLTrainerInitInfo``, ``HTTPVLLMWeightSyncClient``, ``WeightSource`` and ``ParamMeta``.
    ``packed`` is sent in the init info (0.28 moved it there). Only rank 0 builds the engine;
    the other trainer ranks drain the same `FullWeightSource` so the FSDP gathers match.

    Raises:
        ImportError: vLLM >= 0.28 is not installed (at `init`).
    """

    _engine: Any = None
    _current: FullWeightSource | None = None
    _live: Iterator[tuple[str, torch.Tensor]] | None = None

    def init(self) -> None:
        """``GET /get_world_size``, then vLLM's ``trainer_init`` (it POSTs
        ``/init_weight_transfer_engine`` itself while joining the group as rank 0).

        vLLM 0.33's ``trainer_init`` reads the source's metadata, which exists only once a sync hands
        over its `FullWeightSource`: there the rendezvous waits for the first `sync` (which a fresh
        run makes before its first request)."""
        if self._api is None:
            self._api = _import_028()
        server_world = self.call("/get_world_size", None, self.client.get_world_size)
        self.world_size = int(server_world) + 1
        if self._current is None and metadata_is_cached_property(self._api):
            return
        self._rendezvous()

    def _rendezvous(self) -> None:
        self._select_device()
        info_cls = self._api.NCCLTrainerInitInfo
        kwargs: dict[str, Any] = {"master_address": self.master_address, "master_port": self.master_port,
                                  "world_size": self.world_size, "packed": self.packed}
        if _accepts(info_cls, "rank"):
            kwargs["rank"] = 0
        timeout = getattr(self.client, "timeout_s", 300.0)
        http = self._api.HTTPVLLMWeightSyncClient(self.client.base_url, timeout=timeout)
        self._http = _RouteRecorder(http)
        self._engine = self.call("/init_weight_transfer_engine", None,
                                 self._api.WeightTransferTrainerFactory.trainer_init,
                                 init_info=info_cls(**kwargs), client=self._http, source=self._vllm_source())

    def sync(self, source: FullWeightSource, version: int) -> SyncTimings:
        """``/pause`` → ``engine.send_weights()`` (start → update ∥ broadcast → finish) →
        ``/reset_prefix_cache`` → ``/resume``."""
        self._current, self._live = source, None
        if self._engine is None:
            try:
                if self.world_size is None or self._api is None:
                    self.init()
                if self._engine is None:
                    self._rendezvous()
            except BaseException:
                self._current = None
                raise
        timings = SyncTimings()
        start = now()
        try:
            with self.paused(version, timings):
                t0 = now()
                self._http.failed_route = None
                try:
                    self._engine.send_weights()
                    self._synchronize()
                except Exception as exc:
                    route = self._http.failed_route or "nccl broadcast"
                    raise WeightSyncError(f"weight sync to model version {version} failed at {route} "
                                          f"(vLLM send_weights): {type(exc).__name__}: {exc}",
                                          route, version) from exc
                timings.transfer_s = now() - t0
        except BaseException:
            # finish this pass's gathers so the other ranks are not left waiting
            drain_quietly(self._live if self._live is not None else source.tensors())
            raise
        finally:
            self._current, self._live = None, None
        timings.total_s = now() - start
        return timings

    def close(self) -> None:
        """Shut the vLLM trainer engine down."""
        if self._engine is not None and hasattr(self._engine, "shutdown"):
            self._engine.shutdown()
        self._engine = None
