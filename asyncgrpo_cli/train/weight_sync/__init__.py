"""Trainer → sampler weight sync (SPEC §3.1, §9, §15.8, Appendix B.23; DESIGN §5–§6).

- `names` / `params`: the model's full weights under HF checkpoint names, FSDP2-gathered one
  bucket at a time, PEFT adapters merged (`iter_full_parameter_buckets`, `FullWeightSource`);
  `lora.AdapterSource`: the adapter alone.
- backends (trainer rank 0): `EmbeddedPathSync` (safetensors files to the embedded sampler),
  `VllmNccl026Sync` / `VllmNccl028Sync` (vLLM's NCCL trainer classes), `VllmIpcSync` (CUDA IPC to a
  vLLM on the trainer's own GPU), `LoraAdapterSync`
  (new adapter ``policy-v{N}`` per version); `make_weight_sync` picks one from ``/version``.
- `WeightSync`: runs a sync on every rank and returns the ``perf/weight_sync_*`` metrics.
"""

from .base import SyncTimings, WeightSyncBackend, WeightSyncError
from .embedded import EmbeddedPathSync
from .lora import AdapterSource, AdapterWindow, LoraAdapterSync, adapter_name
from .names import ParamMeta, hf_parameter_name, vision_tower_skip
from .params import DEFAULT_BUCKET_BYTES, FullWeightSource, iter_full_parameter_buckets, parameter_metadata
from .select import check_lora_limits, make_weight_sync, parse_vllm_version, read_server_dtype
from .sync import WeightSync, dist_barrier
from .vllm_ipc import VllmIpcSync
from .vllm_nccl import VllmNccl026Sync, VllmNccl028Sync

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AdapterSource",
    "AdapterWindow",
    "EmbeddedPathSync",
    "FullWeightSource",
    "LoraAdapterSync",
    "ParamMeta",
    "SyncTimings",
    "VllmIpcSync",
    "VllmNccl026Sync",
    "VllmNccl028Sync",
    "WeightSync",
    "WeightSyncBackend",
    "WeightSyncError",
    "adapter_name",
    "check_lora_limits",
    "dist_barrier",
    "hf_parameter_name",
    "iter_full_parameter_buckets",
    "make_weight_sync",
    "parameter_metadata",
    "parse_vllm_version",
    "read_server_dtype",
    "vision_tower_skip",
]
