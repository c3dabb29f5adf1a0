"""CUDA-IPC weight sync (`VllmIpcSync`) against a recording HTTP fake of vLLM 0.26's dev routes.

The fake server speaks real HTTP to our `SyncSamplerClient` and decodes ``ipc_handles_pickled`` the way
vLLM does (base64 + pickle, one handle per name). The fake IPC engine stands in for vLLM's
``IPCWeightTransferEngine.trainer_send_weights`` (which needs a GPU): it iterates the tensors and hands
an update with vLLM's field names to ``send_mode``, with picklable stand-in handles.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
import torch

from asyncgrpo_cli.sampler.client import SyncSamplerClient
from asyncgrpo_cli.train.weight_sync import FullWeightSource, VllmIpcSync, WeightSyncError, make_weight_sync
from asyncgrpo_cli.train.weight_sync.vllm_ipc import http_update_info, import_ipc_api


class RecordingVllm:
    """vLLM 0.26's weight-transfer routes on a loopback port; records ``(route, body)`` in order.
    ``fail`` = a route answering HTTP 500; ``backend`` = what ``/server_info`` reports."""

    def __init__(self, fail: str | None = None, backend: str = "ipc", world_size: int = 1) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.updates: list[dict] = []
        self.fail, self.backend, self.world_size = fail, backend, world_size
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                route = urlparse(self.path).path
                owner.calls.append((route, {}))
                if route == "/version":
                    return self._answer(200, {"version": "0.26.0"})
                if route == "/server_info":
                    config = {"weight_transfer_config": {"backend": owner.backend},
                              "model_config": {"dtype": "torch.bfloat16"}}
                    return self._answer(200, {"vllm_config": json.dumps(config)})
                if route == "/get_world_size":
                    return self._answer(200, {"world_size": owner.world_size})
                return self._answer(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                route = url.path
                owner.calls.append((route + (f"?{url.query}" if url.query else ""), body))
                if route == owner.fail:
                    return self._answer(500, {"detail": "boom"})
                if route == "/update_weights":
                    info = dict(body["update_info"])
                    handles = pickle.loads(base64.b64decode(info.pop("ipc_handles_pickled")))
                    if not info.get("packed") and len(handles) != len(info["names"]):
                        return self._answer(400, {"detail": "`ipc_handles` should be of the same size as `names`"})
                    owner.updates.append({**info, "ipc_handles": handles})
                if route == "/reset_prefix_cache":
                    return self._answer(200, {"success": True})
                return self._answer(200, {"message": "ok"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def routes(self) -> list[str]:
        return [route for route, _ in self.calls]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class UpdateInfo026:
    """vLLM 0.26's ``IPCWeightTransferUpdateInfo`` fields."""

    names: list
    dtype_names: list
    shapes: list
    ipc_handles: object = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list | None = None
    packed: bool = False


@dataclass
class SendArgs026:
    """vLLM 0.26's ``IPCTrainerSendWeightsArgs`` (``send_mode`` may be a callable)."""

    send_mode: object
    llm_handle: object = None
    url: str | None = None
    packed: bool = False


class FakeIpcEngine:
    """Stands in for ``IPCWeightTransferEngine.trainer_send_weights`` (one update; a chunk per 2 tensors
    when packed). Handles are ``("rebuild_cuda_tensor", name, shape)`` tuples keyed by a fake GPU UUID."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, torch.Tensor]] = []
        self.fail = fail

    def trainer_send_weights(self, iterator, args: SendArgs026) -> None:
        assert callable(args.send_mode)
        items = []
        for name, tensor in iterator:
            items.append((name, tensor))
            if self.fail:
                raise RuntimeError("cudaIpcGetMemHandle failed")
        self.sent.extend(items)
        chunks = [items[i:i + 2] for i in range(0, len(items), 2)] if args.packed else [items]
        for chunk in chunks:
            handles = [{"GPU-fake": ("rebuild_cuda_tensor", n, tuple(t.shape))} for n, t in chunk]
            args.send_mode(UpdateInfo026(
                names=[n for n, _ in chunk], dtype_names=[str(t.dtype).split(".")[-1] for _, t in chunk],
                shapes=[list(t.shape) for _, t in chunk],
                ipc_handles={"GPU-fake": ("packed", len(chunk))} if args.packed else handles,
                tensor_sizes=[t.numel() * t.element_size() for _, t in chunk] if args.packed else None,
                packed=args.packed))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ipc_model"))


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def backend_for(server: RecordingVllm, engine: FakeIpcEngine, **kw) -> tuple[VllmIpcSync, SyncSamplerClient]:
    client = SyncSamplerClient(server.url, timeout_s=30, max_retries=0)
    api = SimpleNamespace(IPCWeightTransferEngine=engine, IPCTrainerSendWeightsArgs=SendArgs026)
    return VllmIpcSync(client, device="cpu", vllm_api=api, **kw), client


def test_ipc_sync_call_sequence_and_payload(model_dir):
    server, engine = RecordingVllm(), FakeIpcEngine()
    try:
        backend, client = backend_for(server, engine)
        model = load(model_dir)
        source = FullWeightSource(model, bucket_bytes=16_384, dtype=torch.bfloat16)
        timings = backend.sync(source, 5)
        assert server.routes() == ["/get_world_size", "/init_weight_transfer_engine", "/pause?mode=keep",
                                   "/start_weight_update", "/update_weights", "/finish_weight_update",
                                   "/reset_prefix_cache?reset_running_requests=true", "/resume"]
        assert timings.total_s >= timings.transfer_s + timings.pause_s > 0
        # the server's share of the transfer (inside /update_weights) is timed apart from the trainer's
        assert 0 < timings.update_s <= timings.transfer_s
        assert timings.as_metrics()["perf/weight_sync_update_s"] == timings.update_s
        (update,) = server.updates
        names = [m.name for m in source.metadata()]
        assert update["names"] == names and update["packed"] is False
        assert update["dtype_names"] == ["bfloat16"] * len(names)
        assert [h["GPU-fake"][1] for h in update["ipc_handles"]] == names
        params = dict(model.named_parameters())
        assert all(torch.equal(t, params[n].detach().bfloat16()) for n, t in engine.sent)
        # A second sync repeats the frame without a second init.
        server.calls.clear()
        backend.sync(source, 6)
        assert server.routes()[0] == "/pause?mode=keep" and "/init_weight_transfer_engine" not in server.routes()
        client.close()
    finally:
        server.close()


def test_ipc_packed_sends_one_request_per_chunk(model_dir):
    server, engine = RecordingVllm(), FakeIpcEngine()
    try:
        backend, client = backend_for(server, engine, packed=True)
        source = FullWeightSource(load(model_dir), dtype=torch.bfloat16)
        backend.sync(source, 1)
        n = len(source.metadata())
        assert len(server.updates) == backend.requests == (n + 1) // 2
        assert all(u["packed"] is True and len(u["tensor_sizes"]) == len(u["names"]) for u in server.updates)
        assert [name for u in server.updates for name in u["names"]] == [m.name for m in source.metadata()]
        client.close()
    finally:
        server.close()


class SpySource:
    """A `FullWeightSource` that counts the tensors it produced (drained after a failure?)."""

    def __init__(self, inner: FullWeightSource) -> None:
        self.inner, self.produced = inner, 0

    def metadata(self):
        return self.inner.metadata()

    def tensors(self):
        for item in self.inner.tensors():
            self.produced += 1
            yield item


@pytest.mark.parametrize(("fail", "route"), [("/pause", "/pause"), ("/start_weight_update", "/start_weight_update"),
                                             ("/update_weights", "/update_weights"),
                                             ("/finish_weight_update", "/finish_weight_update"),
                                             ("engine", "ipc send")])
def test_ipc_failure_resumes_names_route_and_drains(model_dir, fail, route):
    server = RecordingVllm(fail=fail if fail != "engine" else None)
    engine = FakeIpcEngine(fail=fail == "engine")
    try:
        backend, client = backend_for(server, engine)
        source = SpySource(FullWeightSource(load(model_dir), dtype=torch.bfloat16))
        with pytest.raises(WeightSyncError) as info:
            backend.sync(source, 9)
        assert info.value.route == route and info.value.version == 9
        assert server.routes()[-1] == "/resume"
        assert source.produced == len(source.metadata())
        if fail == "engine":
            assert "server must run on the trainer's GPU" in str(info.value)
        client.close()
    finally:
        server.close()


def test_ipc_refuses_a_tensor_parallel_server():
    server = RecordingVllm(world_size=2)
    try:
        backend, client = backend_for(server, FakeIpcEngine())
        with pytest.raises(WeightSyncError, match="2 workers.*launch.colocate=false"):
            backend.init()
        client.close()
    finally:
        server.close()


def test_make_weight_sync_picks_ipc_from_server_info(tmp_path):
    server = RecordingVllm(backend="ipc")
    nccl = RecordingVllm(backend="nccl")
    try:
        with SyncSamplerClient(server.url, timeout_s=30, max_retries=0) as client:
            backend = make_weight_sync(client, output_dir=tmp_path, device="cpu")
            assert isinstance(backend, VllmIpcSync) and backend.send_weight_version is False
            assert backend.packed is False
            packed = make_weight_sync(client, output_dir=tmp_path, device="cpu", packed=True)  # sampler.weight_sync_packed
            assert isinstance(packed, VllmIpcSync) and packed.packed is True
        with SyncSamplerClient(nccl.url, timeout_s=30, max_retries=0) as client:
            assert not isinstance(make_weight_sync(client, output_dir=tmp_path, master_port=29570), VllmIpcSync)
    finally:
        server.close()
        nccl.close()


def test_http_body_is_vllms_pickled_encoding():
    info = UpdateInfo026(names=["w"], dtype_names=["bfloat16"], shapes=[[2]], ipc_handles=[{"GPU-x": ("f", 1)}])
    body = http_update_info(info)
    assert "ipc_handles" not in body and "tensor_sizes" not in body and body["packed"] is False
    assert pickle.loads(base64.b64decode(body["ipc_handles_pickled"])) == [{"GPU-x": ("f", 1)}]


def test_missing_ipc_engine_names_version_and_two_gpu_alternative(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.ipc_engine", None)  # import fails
    with pytest.raises(ImportError, match=r"installed vLLM \(.*\).*launch.colocate=false.*2\+ GPUs"):
        import_ipc_api()


@dataclass
class SendArgsHttp:
    """An older ``IPCTrainerSendWeightsArgs`` with no ``send_mode``: vLLM posts ``/update_weights`` itself."""

    mode: str
    url: str
    packed: bool = False


def test_ipc_sync_by_a_sender_that_posts_itself_logs_no_update_time(model_dir):
    """``perf/weight_sync_update_s`` is our own timing of ``/update_weights``; when vLLM's sender posts the update
    itself nothing is timed, so the metric is left out rather than logged as 0."""

    class PostsItself:
        @staticmethod
        def trainer_send_weights(iterator, args):
            assert args.mode == "http" and args.url
            for _ in iterator:
                pass

    server = RecordingVllm()
    try:
        client = SyncSamplerClient(server.url, timeout_s=30, max_retries=0)
        api = SimpleNamespace(IPCWeightTransferEngine=PostsItself, IPCTrainerSendWeightsArgs=SendArgsHttp)
        backend = VllmIpcSync(client, device="cpu", vllm_api=api)
        timings = backend.sync(FullWeightSource(load(model_dir), dtype=torch.bfloat16), 1)
        assert backend.requests == 0 and timings.update_s is None and timings.transfer_s > 0
        assert "perf/weight_sync_update_s" not in timings.as_metrics()
        client.close()
    finally:
        server.close()
