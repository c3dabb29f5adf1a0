"""Weight sync against vLLM 0.33's trainer-side API shape (read from vLLM 0.33.0's weight_transfer package).

0.33 changed what a trainer hands vLLM: a ``WeightSource`` whose ``metadata`` must be a
``functools.cached_property`` (the class refuses anything else when it is defined), read at ``trainer_init``,
with the stream in ``iter_full()``; and, for CUDA IPC, an ``IPCTrainerWeightTransferEngine`` object that
posts ``/init_weight_transfer_engine`` with ``packed`` itself and drives start → update → finish in
``send_weights()``. The fakes below reproduce exactly those contracts (on CPU; the real engines need a GPU),
and the HTTP side is the recording server of the 0.26 IPC tests.
"""

from __future__ import annotations

import base64
import functools
import pickle
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from asyncgrpo_cli.sampler.client import SyncSamplerClient
from asyncgrpo_cli.train.weight_sync import FullWeightSource, VllmIpcSync, WeightSyncError
from asyncgrpo_cli.train.weight_sync.vllm_nccl import VllmNccl028Sync
from asyncgrpo_cli.train.weight_sync.vllm_source import metadata_is_cached_property

from test_weight_sync_ipc import RecordingVllm, load, model_dir  # noqa: F401  (fixture)


@dataclass(frozen=True)
class ParamMeta033:
    name: str
    dtype: torch.dtype
    shape: tuple
    owners: tuple | None = field(default=None, kw_only=True)


class WeightSource033(ABC):
    """vLLM 0.33's ``WeightSource`` contract."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list:
        raise NotImplementedError

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource033.iter_full

    def iter_full(self):
        raise NotImplementedError


@dataclass
class IPCTrainerInitInfo033:
    backend: ClassVar[str] = "ipc"
    packed: bool = False
    rank: int = field(default=0, kw_only=True)


class IPCTrainerEngine033:
    """``IPCTrainerWeightTransferEngine``: checks the source at init, posts init with ``packed``, then per
    ``send_weights`` start → one update (names, dtypes, shapes, one handle per tensor) → finish."""

    instances: list = []

    def __init__(self, client, source, packed) -> None:
        self.client, self.source, self.packed, self.sent = client, source, packed, []

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None or not source.implements_iter_full():
            raise TypeError("IPC sends full tensors")
        if len(source.owned_names(init_info.rank)) != len(source.metadata):
            raise ValueError("every rank must own every parameter")
        engine = cls(client, source, init_info.packed)
        client.init_weight_transfer_engine({"packed": init_info.packed})
        cls.instances.append(engine)
        return engine

    def send_weights(self) -> None:
        self.client.start_weight_update()
        names, dtypes, shapes, handles = [], [], [], []
        for name, tensor in self.source.iter_full():
            self.sent.append((name, tensor))
            names.append(name)
            dtypes.append(str(tensor.dtype).split(".")[-1])
            shapes.append(list(tensor.shape))
            handles.append({"GPU-fake": ("rebuild_cuda_tensor", name, tuple(tensor.shape))})
        self.client.update_weights({"names": names, "dtype_names": dtypes, "shapes": shapes, "ipc_handles": handles})
        self.client.finish_weight_update()


@dataclass
class NCCLTrainerInitInfo033:
    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    rank: int = field(default=0, kw_only=True)


class NcclEngine033:
    """``NCCLTrainerWeightTransferEngine``: init reads the metadata (owners check) and rendezvous; per
    ``send_weights`` start → update ∥ the broadcast of ``iter_full()`` → finish."""

    def __init__(self, client, source) -> None:
        self.client, self.source, self.sent = client, source, []

    def send_weights(self) -> None:
        meta = self.source.metadata
        self.client.start_weight_update()
        update = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                  "shapes": [list(m.shape) for m in meta]}
        thread = threading.Thread(target=self.client.update_weights, args=(update,))
        thread.start()
        for index, (name, tensor) in enumerate(self.source.iter_full()):
            assert name == meta[index].name and tuple(tensor.shape) == meta[index].shape
            self.sent.append((name, tensor))
        thread.join()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        pass


class Factory033:
    engines: list = []

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        for m in source.metadata:  # what 0.33 reads at init
            assert m.owners is None or m.owners[0] == 0
        client.init_weight_transfer_engine({"master_address": init_info.master_address,
                                            "world_size": init_info.world_size, "packed": init_info.packed})
        engine = NcclEngine033(client, source)
        cls.engines.append(engine)
        return engine


class HTTP033:
    """vLLM 0.33's ``HTTPVLLMWeightSyncClient`` over our recording server."""

    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.client = SyncSamplerClient(base_url, timeout_s=30, max_retries=0)

    def init_weight_transfer_engine(self, init_info):
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self):
        self.client.start_weight_update()

    def update_weights(self, update_info):
        # the recording server decodes IPC handles for every update: one (empty) handle per name
        handles = base64.b64encode(pickle.dumps([{}] * len(update_info["names"]))).decode()
        self.client._post("/update_weights", {"update_info": {**update_info, "ipc_handles_pickled": handles}})

    def finish_weight_update(self, weight_version=None):
        self.client.finish_weight_update(weight_version)


def ipc_api() -> SimpleNamespace:
    return SimpleNamespace(IPCTrainerWeightTransferEngine=IPCTrainerEngine033, IPCTrainerInitInfo=IPCTrainerInitInfo033,
                           WeightSource=WeightSource033, ParamMeta=ParamMeta033)


def test_the_033_source_shape_is_detected():
    assert metadata_is_cached_property(ipc_api())
    assert not metadata_is_cached_property(SimpleNamespace(WeightSource=type("Old", (), {"metadata": lambda self: []})))


def test_ipc_033_engine_sequence_payload_and_values(model_dir):  # noqa: F811
    server = RecordingVllm()
    IPCTrainerEngine033.instances.clear()
    try:
        client = SyncSamplerClient(server.url, timeout_s=30, max_retries=0)
        backend = VllmIpcSync(client, device="cpu", vllm_api=ipc_api(), send_weight_version=True)
        model = load(model_dir)
        source = FullWeightSource(model, bucket_bytes=16_384, dtype=torch.bfloat16)
        backend.init()
        assert server.routes() == ["/get_world_size"]  # the engine's init waits for the first sync's source
        timings = backend.sync(source, 3)
        assert server.routes() == ["/get_world_size", "/init_weight_transfer_engine", "/pause?mode=keep",
                                   "/start_weight_update", "/update_weights", "/finish_weight_update",
                                   "/reset_prefix_cache?reset_running_requests=true", "/resume"]
        assert dict(server.calls)["/init_weight_transfer_engine"] == {"init_info": {"packed": False}}
        assert dict(server.calls)["/finish_weight_update"] == {"weight_version": "3"}
        (update,) = server.updates
        names = [m.name for m in source.metadata()]
        assert update["names"] == names and [h["GPU-fake"][1] for h in update["ipc_handles"]] == names
        (engine,) = IPCTrainerEngine033.instances
        params = dict(model.named_parameters())
        assert all(torch.equal(t, params[n].detach().bfloat16()) for n, t in engine.sent)
        assert timings.total_s >= timings.transfer_s > 0 and backend.requests == 1
        assert 0 < timings.update_s <= timings.transfer_s  # reset for each sync, not summed over syncs
        server.calls.clear()
        second = backend.sync(source, 4)  # one engine for the run: no second init
        assert 0 < second.update_s <= second.transfer_s and backend.requests == 1
        assert "/init_weight_transfer_engine" not in server.routes() and len(IPCTrainerEngine033.instances) == 1
        backend.reconnect()  # a restarted server: the engine is built again
        server.calls.clear()
        backend.sync(source, 4)
        assert server.routes()[:2] == ["/get_world_size", "/init_weight_transfer_engine"]
        client.close()
    finally:
        server.close()


def test_ipc_033_packed_sync_tells_the_server_at_init(model_dir):  # noqa: F811
    """``sampler.weight_sync_packed``: vLLM 0.33's engine is built packed and posts ``packed: true`` at its init, so
    the server decodes one handle per chunk."""
    server = RecordingVllm()
    IPCTrainerEngine033.instances.clear()
    try:
        client = SyncSamplerClient(server.url, timeout_s=30, max_retries=0)
        backend = VllmIpcSync(client, device="cpu", vllm_api=ipc_api(), packed=True)
        backend.sync(FullWeightSource(load(model_dir), dtype=torch.bfloat16), 1)
        assert dict(server.calls)["/init_weight_transfer_engine"] == {"init_info": {"packed": True}}
        (engine,) = IPCTrainerEngine033.instances
        assert engine.packed is True
        client.close()
    finally:
        server.close()


def test_ipc_033_failure_names_route_resumes_and_drains(model_dir):  # noqa: F811
    server = RecordingVllm(fail="/update_weights")
    try:
        client = SyncSamplerClient(server.url, timeout_s=30, max_retries=0)
        backend = VllmIpcSync(client, device="cpu", vllm_api=ipc_api())
        with pytest.raises(WeightSyncError) as info:
            backend.sync(FullWeightSource(load(model_dir), dtype=torch.bfloat16), 1)
        assert info.value.route == "/update_weights"
        assert server.routes()[-1] == "/resume"
        client.close()
    finally:
        server.close()


def test_nccl_033_defers_the_rendezvous_to_the_first_sync(model_dir):  # noqa: F811
    server = RecordingVllm(backend="nccl")
    Factory033.engines.clear()
    try:
        client = SyncSamplerClient(server.url, timeout_s=30, max_retries=0)
        api = SimpleNamespace(WeightTransferTrainerFactory=Factory033, NCCLTrainerInitInfo=NCCLTrainerInitInfo033,
                              HTTPVLLMWeightSyncClient=HTTP033, WeightSource=WeightSource033, ParamMeta=ParamMeta033)
        backend = VllmNccl028Sync(client, master_port=29511, device="cpu", vllm_api=api)
        backend.init()
        assert server.routes() == ["/get_world_size"] and not Factory033.engines
        model = load(model_dir)
        source = FullWeightSource(model, bucket_bytes=16_384, dtype=torch.bfloat16)
        backend.sync(source, 1)
        assert server.routes() == ["/get_world_size", "/init_weight_transfer_engine", "/pause?mode=keep",
                                   "/start_weight_update", "/update_weights", "/finish_weight_update",
                                   "/reset_prefix_cache?reset_running_requests=true", "/resume"]
        (engine,) = Factory033.engines
        assert [u["names"] for u in server.updates] == [[m.name for m in source.metadata()]]  # the receiver got it
        params = dict(model.named_parameters())
        assert [n for n, _ in engine.sent] == [m.name for m in source.metadata()]
        assert all(torch.equal(t, params[n].detach().bfloat16()) for n, t in engine.sent)
        backend.sync(source, 2)
        assert len(Factory033.engines) == 1 and len(engine.sent) == 2 * len(source.metadata())
        client.close()
    finally:
        server.close()
