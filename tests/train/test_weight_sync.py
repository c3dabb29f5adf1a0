"""Weight sync (SPEC §3.1, §9, §15.8, B.23): buckets, names, backends against the embedded server
and against recording fakes of vLLM's trainer-side classes, FSDP2 gathers under torchrun."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import torch
from safetensors import safe_open

from asyncgrpo_cli.sampler.client import SamplerError, SamplerRequestError, SyncSamplerClient
from asyncgrpo_cli.train.weight_sync import (
    AdapterWindow,
    EmbeddedPathSync,
    FullWeightSource,
    LoraAdapterSync,
    SyncTimings,
    VllmNccl026Sync,
    VllmNccl028Sync,
    WeightSync,
    WeightSyncError,
    hf_parameter_name,
    iter_full_parameter_buckets,
    make_weight_sync,
    parameter_metadata,
    vision_tower_skip,
)

HERE = Path(__file__).parent
METRICS = {"perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s",
           "perf/weight_sync_transfer_s"}
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
DEADLINE_S = 30.0


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ws_model"))


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def lora(model: torch.nn.Module, seed: int = 1, **config) -> torch.nn.Module:
    """A PEFT LoRA model whose B factors are random (so the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model

    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    settings.update(config)
    peft = get_peft_model(model, LoraConfig(**settings))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return peft.eval()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


class Server:
    """The embedded sampler in a subprocess (``--device cpu``, float32, free port)."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "asyncgrpo_cli.sampler.embedded", "--model", str(model_dir), "--port", "0",
               "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny", "--max-model-len", "256",
               *extra]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"embedded server did not start; log: {log_path.read_text()[-2000:]}")
        match = re.search(r"(http://\S+)", line)
        if not match:
            self.stop()
            raise RuntimeError(f"unexpected first line {line!r}; log: {log_path.read_text()[-2000:]}")
        self.url = match[1]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def lora_server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("lora_srv") / "server.log",
                 "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8")
    yield srv
    srv.stop()


def complete(url: str, prompt: list[int], *, temperature: float, seed: int = 1, model: str = "tiny",
             max_tokens: int = 8) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lp = logits.log_softmax(-1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def trainer_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ---------------------------------------------------------------------------------------------- buckets
def test_buckets_bounded_and_complete(model_dir):
    model = load(model_dir)
    params = dict(model.named_parameters())
    limit = 20_000
    buckets = list(iter_full_parameter_buckets(model, bucket_bytes=limit, dtype=torch.bfloat16))
    assert len(buckets) > 3
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1, [(n, t.shape) for n, t in bucket]
    assert any(sum(t.numel() * 2 for _, t in b) > limit for b in buckets)  # the embedding: alone and oversized
    flat = [(n, t) for b in buckets for n, t in b]
    assert [n for n, _ in flat] == list(params)  # every parameter once, in order
    assert all(t.dtype == torch.bfloat16 for _, t in flat)
    for name, tensor in flat:
        assert torch.equal(tensor, params[name].detach().to(torch.bfloat16))
    meta = parameter_metadata(model, bucket_bytes=limit, dtype=torch.bfloat16)
    assert [(m.name, m.shape, m.dtype) for m in meta] == [(n, tuple(t.shape), t.dtype) for n, t in flat]


def test_names_match_checkpoint_and_tied_weight_sent_once(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        checkpoint = set(f.keys())
    names = [m.name for m in parameter_metadata(load(model_dir))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied to the embedding
    assert sorted(names) == sorted(checkpoint)


def test_bad_arguments_named(model_dir):
    model = load(model_dir)
    with pytest.raises(ValueError, match="bucket_bytes"):
        FullWeightSource(model, bucket_bytes=0)
    with pytest.raises(ValueError, match="dtype"):
        FullWeightSource(model, dtype="bfloat16")


def test_moe_weights_reverted_to_checkpoint_layout(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        checkpoint = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in checkpoint  # per-expert on disk, fused in memory
    source = FullWeightSource(model, bucket_bytes=4096)
    sent = dict(source.tensors())
    assert sorted(sent) == sorted(checkpoint)
    for name, tensor in sent.items():
        assert torch.equal(tensor, checkpoint[name]), name
    assert [m.name for m in source.metadata()] == list(dict(source.tensors()))


# ---------------------------------------------------------------------------------------------- PEFT
def test_peft_merged_names_and_values(model_dir):
    base_names = [n for n, _ in load(model_dir).named_parameters()]
    peft = lora(load(model_dir), target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["norm"])
    with torch.no_grad():
        peft.get_submodule("base_model.model.model.norm").modules_to_save["default"].weight.add_(1.0)
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}

    sent = dict(t for b in iter_full_parameter_buckets(peft, bucket_bytes=10_000) for t in b)
    assert list(sent) == base_names

    q = peft.get_submodule("base_model.model.model.layers.1.self_attn.q_proj")
    a, b = q.lora_A["default"].weight, q.lora_B["default"].weight
    expected_q = q.base_layer.weight + q.scaling["default"] * (b @ a)
    assert q.scaling["default"] == 2.0
    assert torch.allclose(sent["model.layers.1.self_attn.q_proj.weight"], expected_q, atol=1e-5)
    assert not torch.allclose(expected_q, q.base_layer.weight, atol=1e-3)  # the adapter matters
    emb = peft.get_submodule("base_model.model.model.embed_tokens")
    expected_emb = emb.base_layer.weight + emb.scaling["default"] * (emb.lora_embedding_B["default"]
                                                                      @ emb.lora_embedding_A["default"]).T
    assert torch.allclose(sent["model.embed_tokens.weight"], expected_emb, atol=1e-5)
    norm = peft.get_submodule("base_model.model.model.norm").modules_to_save["default"].weight
    assert torch.equal(sent["model.norm.weight"], norm)  # the trained copy, not the original
    k = peft.get_submodule("base_model.model.model.layers.0.self_attn.k_proj")
    assert torch.equal(sent["model.layers.0.self_attn.k_proj.weight"], k.weight)

    for name, p in peft.named_parameters():  # sending never changes the trained parameters
        assert torch.equal(p, before[name]), name
    merged = dict(peft.merge_and_unload().named_parameters())
    for name, tensor in sent.items():
        assert torch.allclose(tensor, merged[name], atol=1e-5), name


def test_peft_name_mapping():
    raw = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert hf_parameter_name(raw, peft=True) == "model.layers.0.self_attn.q_proj.weight"
    assert hf_parameter_name("base_model.model.model.norm.modules_to_save.default.weight", peft=True) == "model.norm.weight"
    assert hf_parameter_name("model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight") \
        == "model.layers.0.mlp.weight"


def test_vision_tower_skip():
    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.visual = torch.nn.ModuleDict({"frozen": torch.nn.Linear(2, 2), "trained": torch.nn.Linear(2, 2)})
            self.model = torch.nn.Linear(2, 2)

    toy = Toy()
    toy.visual["frozen"].requires_grad_(False)
    toy.model.requires_grad_(False)  # frozen but not a vision module: still sent
    names = [m.name for m in parameter_metadata(toy, skip=vision_tower_skip(toy))]
    assert names == ["visual.trained.weight", "visual.trained.bias", "model.weight", "model.bias"]

    from peft import LoraConfig, get_peft_model

    toy = Toy()
    toy.requires_grad_(False)
    peft = get_peft_model(toy, LoraConfig(r=2, target_modules=["visual.trained"]))  # LoRA on a vision layer
    names = [m.name for m in parameter_metadata(peft, skip=vision_tower_skip(peft))]
    assert names == ["visual.trained.weight", "visual.trained.bias", "model.weight", "model.bias"]


# ---------------------------------------------------------------------------------------------- embedded
def test_embedded_sync_matches_trainer(model_dir, server, tmp_path):
    client = SyncSamplerClient(server.url, timeout_s=60)
    model = load(model_dir)
    ids_before, lp_before = complete(server.url, PROMPT, temperature=1.0, seed=3)
    perturb(model, seed=7)
    backend = make_weight_sync(client, output_dir=tmp_path)
    assert isinstance(backend, EmbeddedPathSync)
    sync = WeightSync(model, backend, bucket_bytes=16_384)
    assert sync.source.num_buckets > 3
    sync.init()
    metrics = sync.sync(1)

    assert set(metrics) == METRICS
    assert metrics["perf/weight_sync_s"] >= metrics["perf/weight_sync_transfer_s"] > 0
    assert metrics["perf/weight_sync_pause_s"] >= 0 and metrics["perf/weight_sync_barrier_s"] == 0
    assert not (tmp_path / ".weights").exists()  # files deleted after the update, the empty folder too
    assert client.is_paused() is False
    assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == "1"

    ids_after, lp_after = complete(server.url, PROMPT, temperature=1.0, seed=3)
    theirs = trainer_logprobs(model, PROMPT, ids_after)
    assert max(abs(x - y) for x, y in zip(lp_after, theirs)) < 1e-4
    if ids_after == ids_before:
        assert max(abs(x - y) for x, y in zip(lp_after, lp_before)) > 1e-2
    greedy, _ = complete(server.url, PROMPT, temperature=0.0)
    assert greedy == trainer_greedy(model, PROMPT, 8)


def test_embedded_merged_peft_sync_matches_trainer(model_dir, server, tmp_path):
    client = SyncSamplerClient(server.url, timeout_s=60)
    peft = lora(load(model_dir), seed=5)
    sync = WeightSync(peft, make_weight_sync(client, output_dir=tmp_path, lora_rank=4))  # no LoRA server: merged
    assert sync.mode == "full"
    sync.sync(2)
    ids, lps = complete(server.url, PROMPT, temperature=1.0, seed=9)
    theirs = trainer_logprobs(peft, PROMPT, ids)
    assert max(abs(x - y) for x, y in zip(lps, theirs)) < 1e-4


def test_lora_adapter_sync_window(model_dir, lora_server, tmp_path):
    client = SyncSamplerClient(lora_server.url, timeout_s=60)
    peft = lora(load(model_dir), seed=11)
    backend = make_weight_sync(client, output_dir=tmp_path, lora_rank=4, max_staleness=1)
    assert isinstance(backend, LoraAdapterSync)
    sync = WeightSync(peft, backend)
    sync.init()
    assert sync.adapter_name is None
    for version in range(4):
        perturb(peft, seed=100 + version, scale=0.05)  # only the adapter trains
        metrics = sync.sync(version)
        assert set(metrics) == METRICS and metrics["perf/weight_sync_pause_s"] == 0
        assert sync.adapter_name == f"policy-v{version}"
    served = {c["id"] for c in client.models() if c.get("parent") is not None}
    assert served == {"policy-v2", "policy-v3"}
    assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == ["policy-v2", "policy-v3"]
    ids, lps = complete(lora_server.url, PROMPT, temperature=1.0, seed=5, model="policy-v3")
    theirs = trainer_logprobs(peft, PROMPT, ids)
    assert max(abs(x - y) for x, y in zip(lps, theirs)) < 1e-4
    _, older = complete(lora_server.url, PROMPT, temperature=1.0, seed=5, model="policy-v2")
    assert older != lps  # v2 is still served, with its own weights
    with pytest.raises(ValueError, match="already published"):
        sync.sync(3)


# ---------------------------------------------------------------------------------------------- fakes
class FakeClient:
    """Records weight-transfer calls; ``fail`` names the route that raises."""

    def __init__(self, events: list[str] | None = None, fail: str | None = None, world_size: int = 1) -> None:
        self.events = events if events is not None else []
        self.fail = fail
        self.world_size = world_size
        self.base_url = "http://fake:8000"
        self.timeout_s = 42.0
        self.update_infos: list[dict] = []
        self.init_infos: list[dict] = []
        self.update_started = threading.Event()
        self.update_saw_broadcast = False
        self.broadcast_started = threading.Event()

    def _hit(self, route: str) -> None:
        self.events.append(route)
        if self.fail == route:
            raise SamplerError(f"{self.base_url}{route}: HTTP 500: boom", route)

    def pause(self, mode: str = "keep") -> None:
        self._hit(f"/pause?mode={mode}")

    def resume(self) -> None:
        self._hit("/resume")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self._hit(f"/reset_prefix_cache?reset_running_requests={reset_running_requests}")
        return True

    def start_weight_update(self) -> None:
        self._hit("/start_weight_update")

    def _blocking(self, route: str) -> None:
        """Like vLLM: recorded on arrival, returns (or fails) only once the broadcast has begun."""
        self.events.append(route)
        self.update_started.set()
        self.update_saw_broadcast = self.broadcast_started.wait(DEADLINE_S)
        if self.fail == route:
            raise SamplerError(f"{self.base_url}{route}: HTTP 500: boom", route)

    def update_weights(self, info: dict) -> None:
        self.update_infos.append(info)
        self._blocking("/update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._hit(f"/finish_weight_update:{weight_version}")

    def get_world_size(self) -> int:
        self._hit("/get_world_size")
        return self.world_size

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.init_infos.append(info)
        self._blocking("/init_weight_transfer_engine")


def route_of(event: str) -> str:
    """``/pause?mode=keep`` -> ``/pause``; ``/finish_weight_update:3`` -> ``/finish_weight_update``."""
    return re.split(r"[?:]", event)[0]


class SpySource:
    """A `FullWeightSource` that counts the buckets it produced."""

    def __init__(self, inner: FullWeightSource) -> None:
        self.inner = inner
        self.produced = 0

    def metadata(self):
        return self.inner.metadata()

    def buckets(self):
        for bucket in self.inner.buckets():
            self.produced += 1
            yield bucket

    def tensors(self):
        for bucket in self.buckets():
            yield from bucket


@pytest.mark.parametrize("fail", ["/pause?mode=keep", "/update_weights", "/finish_weight_update:3"])
def test_embedded_failure_resumes_names_route_and_drains(model_dir, tmp_path, fail):
    client = FakeClient(fail=fail)
    client.broadcast_started.set()  # no broadcast with files
    source = SpySource(FullWeightSource(load(model_dir), bucket_bytes=16_384))
    backend = EmbeddedPathSync(client, tmp_path / ".weights")
    with pytest.raises(WeightSyncError, match=re.escape(fail.split(":")[0])) as info:
        backend.sync(source, 3)
    assert info.value.route == route_of(fail) and info.value.version == 3
    assert client.events[-1] == "/resume"
    assert source.produced == source.inner.num_buckets  # the other ranks' gathers were completed
    assert not (tmp_path / ".weights").exists()


def test_two_trainers_syncing_to_one_server_keep_their_own_files(model_dir, tmp_path):
    """Two runs on one embedded server write into its one weights folder at the same model version: the
    second's whole sync runs while the server reads the first's bucket, and neither overwrites nor deletes
    the other's file (CI once failed on a shared ``v0-00000.safetensors``)."""
    folder = tmp_path / ".weights"
    seen: list[tuple[str, bool, list[str]]] = []

    class Reader(FakeClient):
        def __init__(self, name: str, inner=None) -> None:
            super().__init__()
            self.broadcast_started.set()
            self.name, self.inner = name, inner

        def update_weights(self, info: dict) -> None:
            if self.inner is not None and not seen:
                self.inner()  # the other trainer's sync, start to end, between our write and the server's read
            path, keys = Path(info["path"]), []
            if path.is_file():
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    keys = sorted(f.keys())
            seen.append((self.name, path.is_file(), keys))
            assert path.resolve().is_relative_to(folder.resolve())

    first = FullWeightSource(load(model_dir), bucket_bytes=16_384)
    second = EmbeddedPathSync(Reader("second"), folder)
    backend = EmbeddedPathSync(Reader("first", inner=lambda: second.sync(FullWeightSource(load(model_dir), bucket_bytes=10**9), 0)),
                               folder)
    backend.sync(first, 0)
    assert seen[0][0] == "second" and seen[1][0] == "first"
    assert all(is_file for _, is_file, _ in seen), seen
    assert seen[1][2] == sorted(name for name, _ in next(iter(FullWeightSource(load(model_dir), bucket_bytes=16_384).buckets())))
    assert not folder.exists()  # both private folders and the shared one are gone


def test_embedded_resume_failure_does_not_hide_first_error(model_dir, tmp_path):
    class TwoFailures(FakeClient):
        def resume(self) -> None:
            self.events.append("/resume")
            raise SamplerError("resume down", "/resume")

    client = TwoFailures(fail="/start_weight_update")
    with pytest.raises(WeightSyncError, match="/start_weight_update") as info:
        EmbeddedPathSync(client, tmp_path).sync(FullWeightSource(load(model_dir)), 1)
    assert any("resum" in note for note in info.value.__notes__)


@dataclass
class FakeSendArgs:
    group: object
    packed: bool = False


class FakeEngine026:
    """Stands in for vLLM 0.26's ``NCCLWeightTransferEngine`` (static trainer methods)."""

    def __init__(self, client: FakeClient, fail_broadcast: bool = False) -> None:
        self.client = client
        self.fail_broadcast = fail_broadcast
        self.init_args: list[dict] = []
        self.sent: list[tuple[str, torch.Tensor]] = []
        self.saw_update = False

    def trainer_init(self, info: dict) -> str:
        self.init_args.append(info)
        self.client.broadcast_started.set()
        self.saw_update = self.client.update_started.wait(DEADLINE_S)
        return "group"

    def trainer_send_weights(self, iterator, args: FakeSendArgs) -> None:
        assert args.group == "group" and args.packed is True
        self.client.events.append("broadcast")
        self.client.broadcast_started.set()
        self.saw_update = self.client.update_started.wait(DEADLINE_S)
        if self.fail_broadcast:
            raise RuntimeError("NCCL error")
        self.sent.extend(iterator)


def _api026(client: FakeClient, **kw) -> tuple[SimpleNamespace, FakeEngine026]:
    engine = FakeEngine026(client, **kw)
    return SimpleNamespace(NCCLWeightTransferEngine=engine, NCCLTrainerSendWeightsArgs=FakeSendArgs), engine


def test_vllm_026_call_sequence(model_dir):
    client = FakeClient(world_size=2)
    api, engine = _api026(client)
    backend = VllmNccl026Sync(client, "10.0.0.1", 29555, vllm_api=api)
    backend.init()
    assert engine.saw_update and client.update_saw_broadcast  # init POST and trainer_init ran together
    assert client.init_infos == [{"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 3}]
    assert engine.init_args == [{"master_address": "10.0.0.1", "master_port": 29555, "world_size": 3}]

    client.events.clear()
    client.update_started.clear()
    client.broadcast_started.clear()
    model = load(model_dir)
    source = FullWeightSource(model, bucket_bytes=16_384, dtype=torch.bfloat16)
    timings = backend.sync(source, 7)
    assert isinstance(timings, SyncTimings) and timings.total_s >= timings.transfer_s
    assert engine.saw_update and client.update_saw_broadcast  # update_weights concurrent with the broadcast
    ev = client.events
    assert ev[:2] == ["/pause?mode=keep", "/start_weight_update"]
    assert sorted(ev[2:4]) == ["/update_weights", "broadcast"]
    assert ev[4:] == ["/finish_weight_update:None", "/reset_prefix_cache?reset_running_requests=True", "/resume"]
    (info,) = client.update_infos
    assert info["packed"] is True and info["names"] == [n for n, _ in engine.sent]
    assert info["dtype_names"] == ["bfloat16"] * len(info["names"])
    assert info["shapes"] == [list(t.shape) for _, t in engine.sent]
    params = dict(model.named_parameters())
    assert all(torch.equal(t, params[n].detach().bfloat16()) for n, t in engine.sent)


def test_nccl_bare_cuda_device_becomes_the_current_one(monkeypatch):
    # A single-process trainer's accelerator.device is a bare "cuda": torch.cuda.set_device refuses that
    # (seen on the H200s), so the current device is used instead.
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device))
    backend = VllmNccl026Sync(FakeClient(), master_port=29563, device="cuda")
    backend._select_device()
    assert chosen == [torch.device("cuda", 0)] and backend.device == torch.device("cuda", 0)


@pytest.mark.parametrize("fail", ["/update_weights", "broadcast", "/reset_prefix_cache?reset_running_requests=True"])
def test_vllm_026_failure_resumes(model_dir, fail):
    client = FakeClient(fail=fail if fail != "broadcast" else None)
    api, _ = _api026(client, fail_broadcast=fail == "broadcast")
    backend = VllmNccl026Sync(client, master_port=29556, vllm_api=api)
    backend._group = "group"  # init done
    with pytest.raises(WeightSyncError) as info:
        backend.sync(FullWeightSource(load(model_dir)), 1)
    assert info.value.route == ("nccl broadcast" if fail == "broadcast" else route_of(fail))
    assert client.events[-1] == "/resume"
    assert "/finish_weight_update:None" not in client.events or fail.startswith("/reset")


# -- vLLM 0.28 fakes
class FakeWeightSource:
    """vLLM's abstract ``WeightSource`` (our source must subclass and fill it)."""

    def metadata(self):
        raise NotImplementedError

    def __iter__(self):
        raise NotImplementedError


@dataclass(frozen=True)
class FakeParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple


@dataclass
class FakeInitInfo:
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    rank: int = field(default=-1, kw_only=True)


class FakeHTTP:
    def __init__(self, url: str, timeout: float, events: list[str], fail: str | None) -> None:
        self.url, self.timeout, self.events, self.fail = url, timeout, events, fail

    def _hit(self, route: str) -> None:
        self.events.append(f"vllm{route}")
        if self.fail == route:
            raise httpx.HTTPStatusError(f"500 for {self.url}{route}", request=None, response=None)

    def init_weight_transfer_engine(self, info: dict) -> None:
        self._hit("/init_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._hit("/start_weight_update")

    def update_weights(self, info: dict) -> None:
        self.updates.append(info)
        self._hit("/update_weights")

    def finish_weight_update(self) -> None:
        self._hit("/finish_weight_update")


class FakeEngine028:
    def __init__(self, init_info, client, source) -> None:
        self.init_info, self.client, self.source = init_info, client, source
        self.sent: list[tuple[str, torch.Tensor]] = []
        client.inner.updates = []

    def send_weights(self) -> None:
        meta = self.source.metadata()
        self.client.start_weight_update()
        info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                "shapes": [list(m.shape) for m in meta]}
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                self.client.update_weights(info)
            except BaseException as exc:  # surfaced below, as vLLM's future.result() does
                errors.append(exc)

        worker = threading.Thread(target=receive)
        worker.start()
        self.client.inner.events.append("vllm-broadcast")
        self.sent.extend(iter(self.source))
        worker.join(DEADLINE_S)
        if errors:
            raise errors[0]
        self.client.finish_weight_update()


def _api028(events: list[str], fail: str | None = None) -> tuple[SimpleNamespace, list]:
    engines: list[FakeEngine028] = []

    class Factory:
        @staticmethod
        def trainer_init(*, init_info, client, source):
            assert isinstance(source, FakeWeightSource)
            client.init_weight_transfer_engine({"world_size": init_info.world_size})
            engines.append(FakeEngine028(init_info, client, source))
            return engines[-1]

    api = SimpleNamespace(
        WeightTransferTrainerFactory=Factory, NCCLTrainerInitInfo=FakeInitInfo, WeightSource=FakeWeightSource,
        ParamMeta=FakeParamMeta,
        HTTPVLLMWeightSyncClient=lambda url, timeout: FakeHTTP(url, timeout, events, fail),
    )
    return api, engines


def test_vllm_028_call_sequence(model_dir):
    client = FakeClient()
    api, engines = _api028(client.events)
    backend = VllmNccl028Sync(client, "10.0.0.2", 29557, vllm_api=api)
    backend.init()
    (engine,) = engines
    assert engine.init_info == FakeInitInfo("10.0.0.2", 29557, 2, True, rank=0)
    assert engine.client.inner.url == client.base_url and engine.client.inner.timeout == 42.0
    assert client.events == ["/get_world_size", "vllm/init_weight_transfer_engine"]

    client.events.clear()
    model = load(model_dir)
    backend.sync(FullWeightSource(model, bucket_bytes=16_384), 4)
    ev = client.events
    assert ev[:2] == ["/pause?mode=keep", "vllm/start_weight_update"]
    assert sorted(ev[2:4]) == ["vllm-broadcast", "vllm/update_weights"]
    assert ev[4:] == ["vllm/finish_weight_update", "/reset_prefix_cache?reset_running_requests=True", "/resume"]
    params = dict(model.named_parameters())
    assert [n for n, _ in engine.sent] == list(params)
    assert all(torch.equal(t, params[n]) for n, t in engine.sent)


def test_vllm_028_failure_names_route_and_resumes(model_dir):
    client = FakeClient()
    api, _ = _api028(client.events, fail="/update_weights")
    backend = VllmNccl028Sync(client, master_port=29558, vllm_api=api)
    backend.init()
    with pytest.raises(WeightSyncError, match="/update_weights") as info:
        backend.sync(FullWeightSource(load(model_dir)), 5)
    assert info.value.route == "/update_weights"
    assert client.events[-1] == "/resume" and "vllm/finish_weight_update" not in client.events


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("cls", [VllmNccl026Sync, VllmNccl028Sync])
def test_vllm_missing_names_the_extra(cls):
    with pytest.raises(ImportError, match=r"asyncgrpo\[vllm\]"):
        cls(FakeClient(), master_port=29559).init()


# ---------------------------------------------------------------------------------------------- pure parts
def test_adapter_window():
    window = AdapterWindow(keep=2)
    assert window.newest is None
    assert window.push("policy-v0") == [] and window.push("policy-v1") == []
    assert window.push("policy-v2") == ["policy-v0"]
    assert window.names == ["policy-v1", "policy-v2"] and window.newest == "policy-v2"
    with pytest.raises(ValueError, match="already registered"):
        window.push("policy-v2")
    with pytest.raises(ValueError, match="keep"):
        AdapterWindow(0)


def test_sync_timings_and_weight_sync_modes(model_dir):
    timings = SyncTimings(pause_s=0.5, transfer_s=2.0, total_s=3.0)
    timings.add_barrier(1.0)
    assert timings.as_metrics() == {"perf/weight_sync_s": 4.0, "perf/weight_sync_pause_s": 0.5,
                                    "perf/weight_sync_barrier_s": 1.0, "perf/weight_sync_transfer_s": 2.0}
    # the server's share of the transfer is logged only by a backend that measured it (CUDA IPC)
    assert SyncTimings(transfer_s=2.0, update_s=1.5).as_metrics()["perf/weight_sync_update_s"] == 1.5
    model = load(model_dir)
    with pytest.raises(ValueError, match="mode"):
        WeightSync(model, None)
    with pytest.raises(ValueError, match="PEFT"):
        WeightSync(model, None, mode="adapter")
    calls = []
    follower = WeightSync(model, None, mode="full", barrier=lambda: calls.append("barrier"))
    metrics = follower.sync(1)
    assert calls == ["barrier"] and set(metrics) == METRICS and follower.adapter_name is None


def test_lora_sync_tolerates_unloaded_and_replaces_stale(model_dir, tmp_path):
    class LoraClient:
        def __init__(self) -> None:
            self.loaded: dict[str, str] = {"policy-v0": "old"}
            self.events: list[str] = []

        def models(self):
            return [{"id": "tiny", "parent": None}] + [{"id": n, "parent": "tiny"} for n in self.loaded]

        def load_lora_adapter(self, name: str, path: str) -> None:
            self.events.append(f"load {name}")
            if name in self.loaded:
                raise SamplerRequestError("400", "/v1/load_lora_adapter", 400,
                                          f"The lora adapter '{name}' has already been loaded.")
            self.loaded[name] = path

        def unload_lora_adapter(self, name: str) -> None:
            self.events.append(f"unload {name}")
            if name not in self.loaded:
                raise SamplerRequestError("404", "/v1/unload_lora_adapter", 404, "not found")
            del self.loaded[name]

    client = LoraClient()
    (tmp_path / ".vllm_lora" / "policy-v9").mkdir(parents=True)
    backend = LoraAdapterSync(client, tmp_path / ".vllm_lora", max_staleness=0)
    backend.init()  # a previous run's adapters and folders go away
    assert client.loaded == {} and not (tmp_path / ".vllm_lora" / "policy-v9").exists()
    source = SimpleNamespace(state_dict=lambda: {}, save=lambda d, s: Path(d).mkdir(parents=True))
    backend.sync(source, 0)
    client.loaded["policy-v1"] = "stale"  # appeared behind our back
    backend.sync(source, 1)
    assert client.events[-4:] == ["load policy-v1", "unload policy-v1", "load policy-v1", "unload policy-v0"]
    assert set(client.loaded) == {"policy-v1"} and backend.current_adapter == "policy-v1"


# ---------------------------------------------------------------------------------------------- FSDP2
def test_fsdp2_two_ranks_gather_identical_full_tensors(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "weight_sync_fsdp_worker.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    assert "model.embed_tokens.weight" in result["names"] and "lm_head.weight" not in result["names"]
