"""Choose the weight-sync backend from what the running server is (DESIGN §5, SPEC §9).

``GET /version``: ``"server": "asyncgrpo-embedded"`` → `EmbeddedPathSync` (writing into the weights folder
the server names, `embedded_weights_dir`); a vLLM whose
``/server_info`` says ``weight_transfer_config.backend == "ipc"`` (the colocated layout, one GPU) →
`VllmIpcSync`; vLLM 0.26–0.27 → `VllmNccl026Sync`; vLLM >= 0.28 → `VllmNccl028Sync`. A PEFT model on a server with LoRA enabled
(``lora_config`` in ``/server_info``) gets `LoraAdapterSync` instead (unless adapter sync is
turned off), after checking ``--max-loras`` and ``--max-lora-rank`` against the run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .base import WeightSyncBackend
from .embedded import EmbeddedPathSync, embedded_weights_dir
from .lora import LoraAdapterSync
from .vllm_ipc import VllmIpcSync
from .vllm_nccl import VllmNccl026Sync, VllmNccl028Sync, address_facing

EMBEDDED_SERVER = "asyncgrpo-embedded"
ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def parse_vllm_version(text: str) -> tuple[int, int]:
    """``"0.26.0"``, ``"0.28.0rc1"``, ``"0.27.1+cu130"`` → ``(major, minor)``.

    Raises:
        ValueError: no ``MAJOR.MINOR`` at the start of ``text``.
    """
    match = re.match(r"^\s*v?(\d+)\.(\d+)", str(text))
    if not match:
        raise ValueError(f"server version {text!r} is not MAJOR.MINOR[...]; cannot pick a weight-sync backend")
    return int(match[1]), int(match[2])


def _server_config(client: Any) -> dict:
    """The server's engine config (``client.server_info()``, vLLM's ``vllm_config``), ``{}`` if absent."""
    config = client.server_info()
    return config if isinstance(config, dict) else {}


def read_transfer_backend(client: Any) -> str | None:
    """The server's weight-transfer backend from ``/server_info`` (``weight_transfer_config.backend``:
    ``nccl``, ``ipc``, ...), None when it does not say."""
    backend = (_server_config(client).get("weight_transfer_config") or {}).get("backend")
    return str(backend) if backend else None


def read_server_dtype(client: Any) -> torch.dtype | None:
    """The server's model dtype from ``/server_info`` (``model_config.dtype``), None if unknown."""
    name = str((_server_config(client).get("model_config") or {}).get("dtype") or "")
    dtype = getattr(torch, name.removeprefix("torch."), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else None


def check_lora_limits(lora_config: dict, lora_rank: int, max_staleness: int) -> None:
    """SPEC §9 startup validation of a LoRA server against the run.

    Raises:
        ValueError: ``max_loras < max_staleness + 2`` or ``max_lora_rank < lora_rank``, naming
            the values to restart the server with.
    """
    max_loras = int(lora_config.get("max_loras") or 1)
    max_rank = int(lora_config.get("max_lora_rank") or 16)
    problems = []
    if max_loras < max_staleness + 2:
        problems.append(f"--max-loras {max_staleness + 2} (it has {max_loras}; adapter sync keeps "
                        f"max_staleness + 1 = {max_staleness + 1} versions and loads one more before unloading)")
    if max_rank < lora_rank:
        wanted = next((r for r in ALLOWED_LORA_RANKS if r >= lora_rank), lora_rank)
        problems.append(f"--max-lora-rank {wanted} (it has {max_rank}; the adapter has r={lora_rank})")
    if problems:
        raise ValueError("the LoRA server cannot take this run's adapters; restart it with " + " and ".join(problems))


def make_weight_sync(
    client: Any,
    *,
    output_dir: str | Path,
    lora_rank: int | None = None,
    max_staleness: int = 4,
    adapter_sync: bool = True,
    master_address: str | None = None,
    master_port: int | None = None,
    device: str | torch.device | None = None,
    vllm_api: Any = None,
    packed: bool = False,
) -> WeightSyncBackend:
    """The backend for the server behind ``client`` (rank 0 only; call its ``init()`` next).

    Args:
        client: `SyncSamplerClient`.
        output_dir: the run's output folder (``.weights/`` and ``.vllm_lora/`` go inside).
        lora_rank: the PEFT adapter's rank ``r`` when training LoRA, None for full training.
        max_staleness: SPEC §4 staleness limit (adapter window size - 1).
        adapter_sync: False forces merged sync even on a LoRA server.
        master_address / master_port / device / vllm_api: for the NCCL backends (``device`` and
            ``vllm_api`` for the IPC backend too). ``master_address`` is where the server's workers reach
            this process (``weight_transfer_address``); None = `address_facing` the client's ``base_url``
            (this host's address as the server sees it). ``master_port`` None = a free port.
        packed: the CUDA-IPC backend sends packed chunks (``sampler.weight_sync_packed``); ignored by the others.

    Raises:
        ValueError: an unsupported server (vLLM < 0.26, unreadable version) or LoRA limits the
            run does not fit (with the restart values); no address towards the server's host can be
            found for the NCCL backends (names ``sampler.weight_transfer_address``).
    """
    output_dir = Path(output_dir)
    info = client.version()
    if not isinstance(info, dict) or "version" not in info:
        raise ValueError(f"GET /version answered {info!r}; expected {{'version': ...}}")
    if lora_rank is not None and adapter_sync:
        lora_config = _server_config(client).get("lora_config")
        if isinstance(lora_config, dict):
            check_lora_limits(lora_config, lora_rank, max_staleness)
            return LoraAdapterSync(client, output_dir / ".vllm_lora", max_staleness)
    if info.get("server") == EMBEDDED_SERVER:
        return EmbeddedPathSync(client, embedded_weights_dir(client) or output_dir / ".weights")
    version = parse_vllm_version(info["version"])
    if version < (0, 26):
        raise ValueError(f"vLLM {info['version']} is too old for weight transfer; use vLLM >= 0.26")
    if read_transfer_backend(client) == "ipc":
        return VllmIpcSync(client, device=device, vllm_api=vllm_api, send_weight_version=version >= (0, 27),
                           packed=packed)
    if master_address is None:
        master_address = address_facing(str(client.base_url))
    nccl = dict(master_address=master_address, master_port=master_port, device=device, vllm_api=vllm_api)
    if version < (0, 28):
        return VllmNccl026Sync(client, send_weight_version=version >= (0, 27), **nccl)
    return VllmNccl028Sync(client, **nccl)
