"""Which weight-sync backend `make_weight_sync` picks for a server (/version, /server_info LoRA limits)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from asyncgrpo_cli.sampler.protocol import vllm_config_of
from asyncgrpo_cli.train.weight_sync import (
    EmbeddedPathSync,
    LoraAdapterSync,
    VllmNccl026Sync,
    VllmNccl028Sync,
    check_lora_limits,
    make_weight_sync,
    parse_vllm_version,
)
from asyncgrpo_cli.train.weight_sync.vllm_nccl import address_facing


class VersionClient:
    def __init__(self, version: dict, server_info: dict | None = None,
                 base_url: str = "http://127.0.0.1:8000") -> None:
        self._version, self._info, self.base_url = version, server_info, base_url

    def version(self) -> dict:
        return self._version

    def server_info(self) -> dict | None:  # what SyncSamplerClient.server_info returns for such an answer
        return vllm_config_of(self._info)


@pytest.mark.parametrize(("version", "expected"), [
    ({"version": "0.1.0", "server": "asyncgrpo-embedded"}, EmbeddedPathSync),
    ({"version": "0.26.0"}, VllmNccl026Sync),
    ({"version": "0.27.1+cu130"}, VllmNccl026Sync),
    ({"version": "0.28.0rc1"}, VllmNccl028Sync),
    ({"version": "0.33.0"}, VllmNccl028Sync),
])
def test_make_weight_sync_picks_backend(tmp_path, version, expected):
    backend = make_weight_sync(VersionClient(version), output_dir=tmp_path, master_port=29560)
    assert type(backend) is expected
    if expected is VllmNccl026Sync:  # /finish_weight_update takes a weight_version from 0.27 on
        assert backend.send_weight_version is (version["version"] >= "0.27")
    if expected is EmbeddedPathSync:
        assert backend.weights_dir == tmp_path / ".weights"


def test_make_weight_sync_lora_choices(tmp_path):
    lora_info = {"vllm_config": json.dumps({"lora_config": {"max_loras": 6, "max_lora_rank": 32}})}
    client = VersionClient({"version": "0.26.0"}, lora_info)
    backend = make_weight_sync(client, output_dir=tmp_path, lora_rank=32, max_staleness=4)
    assert isinstance(backend, LoraAdapterSync) and backend.lora_dir == tmp_path / ".vllm_lora"
    assert backend.window.keep == 5
    merged = make_weight_sync(client, output_dir=tmp_path, lora_rank=32, adapter_sync=False, master_port=29561)
    assert isinstance(merged, VllmNccl026Sync)
    no_lora = make_weight_sync(VersionClient({"version": "0.26.0"}, {}), output_dir=tmp_path, lora_rank=8,
                               master_port=29562)
    assert isinstance(no_lora, VllmNccl026Sync)
    with pytest.raises(ValueError, match="--max-loras 7"):
        make_weight_sync(client, output_dir=tmp_path, lora_rank=32, max_staleness=5)
    with pytest.raises(ValueError, match="--max-lora-rank 64"):
        check_lora_limits({"max_loras": 6, "max_lora_rank": 32}, 48, 4)
    with pytest.raises(ValueError, match="vLLM >= 0.26"):
        make_weight_sync(VersionClient({"version": "0.25.1"}), output_dir=tmp_path)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        parse_vllm_version("dev")
    assert parse_vllm_version("0.28.0rc1") == (0, 28)


def _local_addresses() -> list[str]:
    """Loopback, plus this machine's address on its default route when it has one."""
    found = ["127.0.0.1"]
    try:
        found.append(address_facing("http://192.0.2.1:80"))  # TEST-NET-1: routed, never contacted (UDP connect)
    except ValueError:
        pass
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("host", _local_addresses())
def test_master_address_defaults_to_this_host_as_the_server_sees_it(tmp_path, host):
    """With no ``weight_transfer_address`` the NCCL rendezvous address is the one a server at the client's URL
    sees a connection from (checked against a real TCP server's view of its peer), not a fixed 127.0.0.1."""
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        port = server.getsockname()[1]
        url = f"http://{host}:{port}"
        seen: list[str] = []
        accepted = threading.Thread(target=lambda: seen.append(server.accept()[0].getpeername()[0]), daemon=True)
        accepted.start()
        with socket.create_connection((host, port), timeout=30):
            accepted.join(30)
    backend = make_weight_sync(VersionClient({"version": "0.28.0"}, base_url=url), output_dir=tmp_path)
    assert isinstance(backend, VllmNccl028Sync)
    assert seen and backend.master_address == seen[0] == address_facing(url)
    explicit = make_weight_sync(VersionClient({"version": "0.26.0"}, base_url=url), output_dir=tmp_path,
                                master_address="10.1.2.3", master_port=29562)
    assert (explicit.master_address, explicit.master_port) == ("10.1.2.3", 29562)


def test_localhost_url_gives_loopback_and_a_hostless_url_names_the_field():
    assert address_facing("http://localhost:8000/v1") in ("127.0.0.1", "::1")
    with pytest.raises(ValueError, match="sampler.weight_transfer_address"):
        address_facing("http://:8000")


def test_trainer_passes_the_weight_transfer_fields_to_the_backend(tmp_path, monkeypatch):
    """`AsyncGRPOTrainer` hands ``weight_transfer_address`` / ``weight_transfer_port`` and ``weight_sync_packed``
    to `make_weight_sync`."""
    from types import SimpleNamespace

    from asyncgrpo_cli.train import weight_sync
    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    seen: dict = {}

    def fake_make(client, **kwargs):
        seen.update(kwargs)
        return SimpleNamespace(mode="full")

    class FakeSync:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def init(self) -> None:
            pass

    monkeypatch.setattr(weight_sync, "make_weight_sync", fake_make)
    monkeypatch.setattr(weight_sync, "read_server_dtype", lambda client: "bfloat16")
    monkeypatch.setattr(weight_sync, "WeightSync", FakeSync)
    monkeypatch.setattr(weight_sync, "dist_barrier", lambda: None)
    args = SimpleNamespace(output_dir=str(tmp_path), max_staleness=4, weight_transfer_address="10.0.1.1",
                           weight_transfer_port=29600, weight_sync_packed=True)
    trainer = SimpleNamespace(args=args, model=object(), sampler=object(), accelerator=SimpleNamespace(device="cpu"),
                              is_world_process_zero=lambda: True, _broadcast=lambda value: value)
    assert isinstance(AsyncGRPOTrainer._make_weight_sync(trainer), FakeSync)
    assert seen["master_address"] == "10.0.1.1" and seen["master_port"] == 29600 and seen["packed"] is True
