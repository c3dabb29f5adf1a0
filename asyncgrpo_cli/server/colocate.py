"""One GPU for vLLM and the trainer: when to colocate, and how the GPU's memory is split (issue #17).

In the colocated layout vLLM starts first on the shared GPU and takes ``--gpu-memory-utilization``
of it (weights, activations and its whole KV cache, allocated at start); the trainer then starts on the
same GPU and uses what is left. Weights travel through vLLM's CUDA-IPC weight-transfer backend (the
server maps the trainer's tensors; no NCCL group, no second GPU).

Everything here is pure: sizes come in as arguments (`model_shape` reads a local ``config.json``).

Memory model (bytes; estimates, printed in the plan so that a user can correct them):

- trainer: ``4 · P · itemsize(model.dtype)`` for weights, gradients and AdamW's two moments (LoRA:
  the frozen weights plus 1% of them for the adapter), ``2 · P`` for the bf16 copy handed to vLLM
  during a sync, activations ``T · L · H · 34`` bytes for a micro-batch of ``T`` tokens (``T · L · H · 4``
  with activation checkpointing, plus one layer's ``T · H · 34`` recomputed; with ``every_n_layers: N`` the
  ``ceil(L / N)`` checkpointed layers count 4 and the others 34), the log-prob tiles (``2048 × 16384`` fp32, three live), and
  `TRAINER_OVERHEAD_BYTES` for the CUDA context and the caching allocator's slack; times
  `TRAINER_MARGIN`.
- vLLM: weights in its dtype, a KV cache for ``staleness.max_concurrent_rollouts`` sequences of
  ``sampler.max_model_len`` tokens (``2 · L · kv_heads · head_dim · 2`` bytes a token), and
  `VLLM_OVERHEAD_BYTES` (profiling peak, sampler buffers, CUDA context).

When both fit, vLLM gets its need (at least `MIN_SHARE` of the GPU) and the trainer the rest; when they
do not, the trainer gets its estimate with up to 2x headroom and vLLM the rest, down to a KV cache of
`MIN_KV_SEQUENCES` full-length sequences, below which the plan refuses (with fixes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config.schema import (LaunchConfig, LossConfig, ModelConfig, PackingConfig, PeftConfig, SamplerConfig,
                                 StalenessConfig, TrainerConfig)

GiB = 2**30
TRAINER_OVERHEAD_BYTES = 3 * GiB
TRAINER_MARGIN = 1.25
VLLM_OVERHEAD_BYTES = 4 * GiB
GPU_RESERVE_FRACTION = 0.05  # never planned: other contexts, fragmentation, the driver
MIN_KV_SEQUENCES = 32  # vLLM's KV must hold at least this many full-length sequences, or the plan refuses
DEFAULT_SHARE_UNKNOWN_MODEL = 0.4
MIN_SHARE = 0.1  # vLLM's share when its estimate is smaller and the trainer's leaves room: its profiling
# peak and non-torch memory vary by release, and a larger KV cache only helps
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def visible_gpu_count() -> int:
    """Number of CUDA GPUs this process sees (``torch.cuda.device_count()``; 0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # a broken driver reads as "no GPU" rather than crashing the plan
        return 0


@dataclass
class ModelShape:
    """What the memory split needs of a model (from its ``config.json``).

    Attributes:
        parameters: parameter count (embeddings included; tied embeddings counted once).
        hidden_size, num_layers, num_kv_heads, head_dim: decoder dimensions.
        vocab_size: vocabulary size.
    """

    parameters: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V a token takes in a bf16 KV cache, over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """`ModelShape` of a dense decoder from its ``config.json`` dict (Llama / Qwen / SmolLM / Mistral keys).

    Parameters are counted from the dimensions: embeddings ``V · H`` (twice when not tied), per layer
    the attention projections ``H · hd · (2 · heads + 2 · kv_heads)`` and a gated MLP ``3 · H · I``
    (``num_experts`` of them for MoE configs), norms ignored.

    Raises:
        KeyError: the config lacks ``hidden_size``, ``num_hidden_layers`` or ``vocab_size``.
    """
    c = _text_config(config)
    hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    heads = int(c.get("num_attention_heads") or max(1, hidden // 64))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 4 * hidden)
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 1)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inter * experts
    tied = bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False)))
    params = vocab * hidden * (1 if tied else 2) + layers * (attention + mlp)
    return ModelShape(params, hidden, layers, kv_heads, head_dim, vocab)


def model_shape(path: str | Path) -> ModelShape | None:
    """`shape_from_config` of ``path/config.json``; None when there is no readable local config (a Hub
    id not downloaded yet, a GGUF not exported yet, an architecture without the usual keys)."""
    file = Path(str(path)).expanduser() / "config.json"
    try:
        return shape_from_config(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class MemorySplit:
    """How one GPU is shared (all sizes in bytes).

    Attributes:
        total_bytes: the GPU's memory.
        gpu_memory_utilization: vLLM's ``--gpu-memory-utilization`` (fraction of ``total_bytes``).
        vllm_bytes / trainer_bytes: what each side gets (the trainer: the rest, less the reserve).
        trainer_need_bytes / vllm_need_bytes: the estimates (None = model size unknown).
        kv_tokens: tokens vLLM's KV cache can hold with its share (None = unknown).
        source: ``"config"`` (``sampler.gpu_memory_utilization`` set), ``"estimate"`` or ``"default"``.
        reason: one sentence on why this split.
        problems: why it cannot work (empty = fine), each with a fix.
        notes: remarks for the plan.
    """

    total_bytes: int
    gpu_memory_utilization: float
    vllm_bytes: int
    trainer_bytes: int
    trainer_need_bytes: int | None
    vllm_need_bytes: int | None
    kv_tokens: int | None
    source: str
    reason: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the plan: ``vLLM 0.12 of 139.8 GiB = 16.8 GiB | trainer 116.0 GiB (needs ~5.1 GiB)``."""
        def gib(b: int | None) -> str:
            return "?" if b is None else f"{b / GiB:.1f} GiB"

        kv = f", KV for ~{self.kv_tokens:,} tokens" if self.kv_tokens is not None else ""
        need_v = f" (needs ~{gib(self.vllm_need_bytes)}{kv})" if self.vllm_need_bytes is not None else ""
        need_t = f" (needs ~{gib(self.trainer_need_bytes)})" if self.trainer_need_bytes is not None else ""
        return (f"vLLM --gpu-memory-utilization {self.gpu_memory_utilization:.2f} of {gib(self.total_bytes)} = "
                f"{gib(self.vllm_bytes)}{need_v} | trainer the rest, {gib(self.trainer_bytes)}{need_t}")


def trainer_need_bytes(shape: ModelShape, *, dtype: str, token_budget: int, activation_checkpointing: bool,
                       lora: bool, reference: bool = False, checkpoint_every: int = 1) -> int:
    """Estimated peak GPU memory of a single-process trainer (module docstring), bytes, margin included.

    ``reference``: ``loss.beta`` > 0 with full fine-tuning keeps a frozen copy of the weights (``P · itemsize``
    more); with LoRA the reference is the base model with adapters disabled (nothing more).
    ``checkpoint_every``: ``activation_checkpointing_kwargs.every_n_layers`` (layers 0, N, 2N, ... checkpoint;
    the others keep their activations, as without checkpointing)."""
    item = _ITEMSIZE.get(dtype, 4)
    p = shape.parameters
    states = p * item * (1.01 if lora else 4) + (reference_copy_bytes(shape, dtype) if reference and not lora else 0)
    sync_copy = 2 * p
    checkpointed = -(-shape.num_layers // max(1, checkpoint_every)) if activation_checkpointing else 0
    per_token = 4 * checkpointed + 34 * (shape.num_layers - checkpointed)
    acts = token_budget * shape.hidden_size * per_token
    if activation_checkpointing:
        acts += token_budget * shape.hidden_size * 34  # the layer being recomputed
    tiles = 3 * 2048 * 16384 * 4
    return int(TRAINER_MARGIN * (states + sync_copy + acts + tiles) + TRAINER_OVERHEAD_BYTES)


def reference_copy_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of the frozen KL reference (``loss.beta`` > 0, full fine-tuning): one copy of the weights."""
    return shape.parameters * _ITEMSIZE.get(dtype, 4)


def vllm_need_bytes(shape: ModelShape, *, kv_tokens: int) -> int:
    """vLLM's memory for bf16 weights, ``kv_tokens`` of KV cache and its overhead, bytes."""
    return int(2 * shape.parameters + kv_tokens * shape.kv_bytes_per_token + VLLM_OVERHEAD_BYTES)


def _round_up(x: float, step: float = 0.01) -> float:
    return round(math.ceil(x / step - 1e-9) * step, 2)


def _round_down(x: float, step: float = 0.01) -> float:
    return round(math.floor(x / step + 1e-9) * step, 2)


def plan_memory(total_bytes: int, shape: ModelShape | None, *, configured: float | None, dtype: str,
                token_budget: int, max_model_len: int, max_concurrent: int, activation_checkpointing: bool,
                lora: bool, reference: bool = False, checkpoint_every: int = 1) -> MemorySplit:
    """Split ``total_bytes`` of one GPU between vLLM and the trainer.

    Args:
        total_bytes: the shared GPU's memory.
        shape: the model (`model_shape`), None when unknown (a default share is used, said in notes).
        configured: ``sampler.gpu_memory_utilization`` when the user set it (it wins), else None.
        dtype: the trainer's ``model.dtype`` (``float32`` / ``bfloat16`` / ...).
        token_budget: tokens of one micro-batch (``packing.token_budget`` or ``max_model_len``).
        max_model_len: ``sampler.max_model_len`` (KV tokens per sequence).
        max_concurrent: ``staleness.max_concurrent_rollouts`` (sequences in flight at most).
        activation_checkpointing, lora, checkpoint_every: trainer settings that change its need
            (``checkpoint_every``: ``activation_checkpointing_kwargs.every_n_layers``).
        reference: ``loss.beta`` > 0 (full fine-tuning adds a frozen copy of the weights to the trainer's need).

    Returns:
        The `MemorySplit`; ``problems`` says when the estimate does not fit (with fixes).
    """
    usable = int(total_bytes * (1 - GPU_RESERVE_FRACTION))
    problems: list[str] = []
    notes: list[str] = []
    t_need = v_need = kv_tokens = None
    if shape is not None:
        t_need = trainer_need_bytes(shape, dtype=dtype, token_budget=token_budget,
                                    activation_checkpointing=activation_checkpointing, lora=lora, reference=reference,
                                    checkpoint_every=checkpoint_every)
        if reference and not lora:
            notes.append(f"loss.beta > 0: the trainer holds a frozen reference copy of the weights, "
                         f"~{reference_copy_bytes(shape, dtype) / GiB:.1f} GiB (included above)")
        v_need = vllm_need_bytes(shape, kv_tokens=max_concurrent * max_model_len)
    if configured is not None:
        share, source = float(configured), "config"
        reason = f"sampler.gpu_memory_utilization={configured:g} (set in the config)"
    elif shape is None:
        share, source = DEFAULT_SHARE_UNKNOWN_MODEL, "default"
        reason = (f"the model's size is not known before it is downloaded or exported: vLLM gets "
                  f"{DEFAULT_SHARE_UNKNOWN_MODEL:g}; set sampler.gpu_memory_utilization to choose")
    else:
        assert t_need is not None and v_need is not None
        source = "estimate"
        room = usable - t_need
        if v_need <= room:
            share = _round_up(max(v_need, min(MIN_SHARE * total_bytes, room)) / total_bytes)
            reason = (f"vLLM gets what its weights and a KV cache for staleness.max_concurrent_rollouts="
                      f"{max_concurrent} x sampler.max_model_len={max_model_len} tokens need (at least "
                      f"{MIN_SHARE:g} of the GPU); the trainer keeps the rest")
        else:
            floor = vllm_need_bytes(shape, kv_tokens=min(max_concurrent, MIN_KV_SEQUENCES) * max_model_len)
            # The trainer keeps up to twice its estimate as headroom (at most 40% of the GPU); vLLM the rest.
            reserve = max(t_need, min(2 * t_need, int(0.4 * usable)))
            # vLLM's part of what is left is rounded down (rounded up it cut into the trainer's estimate: a
            # 1.7B fp32 run on an 80 GB GPU got 44.6 GiB against its 45.2), its floor up
            share = max(_round_up(floor / total_bytes), _round_down((usable - reserve) / total_bytes))
            reason = ("the trainer's estimate comes first (with up to 2x headroom); vLLM gets the rest, a KV cache "
                      "smaller than max_concurrent_rollouts x max_model_len (the adaptive concurrency cap adjusts "
                      "to it)")
            if floor > room:
                problems.append(
                    f"one GPU of {total_bytes / GiB:.0f} GiB is too small for this run: the trainer needs "
                    f"~{t_need / GiB:.1f} GiB and vLLM at least ~{floor / GiB:.1f} GiB. Fix: two GPUs "
                    f"(launch.colocate=false, vLLM on one GPU, the trainer on the other), LoRA "
                    f"(peft.enabled=true), trainer.activation_checkpointing=true, a smaller packing.token_budget, "
                    f"or set sampler.gpu_memory_utilization yourself")
    if not 0 < share < 1 and (configured is not None or not problems):
        problems.append(f"sampler.gpu_memory_utilization={share:g}: must be between 0 and 1 in the colocated "
                        f"layout (the trainer needs the rest). Fix: e.g. sampler.gpu_memory_utilization=0.3")
        share = min(max(share, 0.01), 0.99)
    vllm_bytes = int(share * total_bytes)
    trainer_bytes = max(0, usable - vllm_bytes)
    if shape is not None:
        kv_tokens = max(0, int((vllm_bytes - 2 * shape.parameters - VLLM_OVERHEAD_BYTES) // shape.kv_bytes_per_token))
        if configured is not None and t_need is not None and t_need > trainer_bytes:
            problems.append(f"sampler.gpu_memory_utilization={configured:g} leaves the trainer "
                            f"{trainer_bytes / GiB:.1f} GiB but it needs ~{t_need / GiB:.1f} GiB. Fix: "
                            f"sampler.gpu_memory_utilization={max(0.01, _round_up((usable - t_need) / total_bytes) - 0.01):.2f}"
                            f" or less, or leave it unset for the estimate")
        if kv_tokens < max_model_len:
            problems.append(f"vLLM's share ({vllm_bytes / GiB:.1f} GiB) leaves KV for {kv_tokens} tokens, less than "
                            f"one sequence of sampler.max_model_len={max_model_len}. Fix: raise "
                            f"sampler.gpu_memory_utilization, or use two GPUs (launch.colocate=false)")
    return MemorySplit(total_bytes=int(total_bytes), gpu_memory_utilization=share, vllm_bytes=vllm_bytes,
                       trainer_bytes=trainer_bytes, trainer_need_bytes=t_need, vllm_need_bytes=v_need,
                       kv_tokens=kv_tokens, source=source, reason=reason, problems=problems, notes=notes)


def visible_ids(ids: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that is to use this process's visible devices ``ids`` (indices as torch
    counts them here, as ``launch.server_gpus`` / ``launch.trainer_gpus`` are): the entries of this process's own
    ``CUDA_VISIBLE_DEVICES`` at those indices when it is set (numbers, UUIDs or MIG names), else the indices. A
    child's variable replaces the parent's, so an index alone would name a GPU the user did not make visible
    (``CUDA_VISIBLE_DEVICES=3``: index 0 is GPU 3, not GPU 0). An index past the list stays as it is (the plan
    refuses it)."""
    import os

    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return ",".join(visible[i] if 0 <= i < len(visible) else str(i) for i in ids)


def gpu_memory_bytes(index: int = 0) -> int | None:
    """Total memory of visible CUDA device ``index`` in bytes, read with ``nvidia-smi`` so that the
    supervisor opens no CUDA context on the GPU it shares; None without a GPU or without nvidia-smi.
    ``CUDA_VISIBLE_DEVICES`` applies (its ``index``-th entry is asked for)."""
    import subprocess

    device = visible_ids([index])
    try:
        out = subprocess.run(["nvidia-smi", "-i", device, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return int(float(out.stdout.strip().splitlines()[0]) * 2**20) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------ the layout
@dataclass
class Layout:
    """Whether vLLM and the trainer share a GPU, why, and how its memory is split.

    Attributes:
        colocated: vLLM and the trainer share ``gpu``.
        reason: why (printed in the plan).
        gpu: the shared GPU's index (None when not colocated).
        memory: the memory split (None when not colocated).
        problems: why the colocated layout cannot run here (each with a fix); empty = fine.
    """

    colocated: bool
    reason: str
    gpu: int | None = None
    memory: MemorySplit | None = None
    problems: list[str] = field(default_factory=list)


def _backend(sampler: SamplerConfig) -> str:
    b = sampler.backend
    return b.value if hasattr(b, "value") else str(b)


def _model_shape_of(name: str | None, gguf_file: str | None = None) -> ModelShape | None:
    """`model_shape` of a local folder (a GGUF's export folder once exported), or of a Hub id's
    ``config.json`` already in the Hugging Face cache."""
    if not name:
        return None
    try:
        from ..config.models import plan_model_path

        name = plan_model_path(name, gguf_file)[0]
    except Exception:  # noqa: BLE001 - a bad model.name is reported elsewhere; the size stays unknown
        pass
    shape = model_shape(name)
    if shape is not None or Path(name).expanduser().exists():
        return shape
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a Hub id, no hub library: the size stays unknown
        return None
    return model_shape(Path(cached).parent) if isinstance(cached, str) else None


def wants_colocation(gpu_count: int, *, launch: LaunchConfig, sampler: SamplerConfig) -> tuple[bool, str]:
    """Whether vLLM and the trainer share a GPU: ``launch.colocate`` when set, else automatically with
    ``sampler.backend=vllm`` and exactly one visible GPU (unless ``launch.trainer_gpus`` names others).

    Args:
        gpu_count: visible GPUs.
        launch: the ``launch`` group (``colocate``, ``server_gpus``, ``trainer_gpus``).
        sampler: the ``sampler`` group (``backend``).

    Returns:
        (colocated, the reason to print; "" when there is nothing to say).
    """
    if _backend(sampler) != "vllm":
        if launch.get("colocate") is True:  # said as a note: nothing to share with a sampler of our own
            return False, (f"launch.colocate=true applies to sampler.backend=vllm; with sampler.backend="
                           f"{_backend(sampler)} nothing is colocated (it runs where sampler.device says)")
        return False, ""
    setting = launch.get("colocate")
    if setting is True:
        return True, "launch.colocate=true"
    if setting is False:
        return False, "launch.colocate=false"
    trainer = launch.trainer_gpus
    server = launch.server_gpus
    if gpu_count == 1 and (trainer is None or server is None or set(trainer) <= set(server)):
        return True, ("one GPU is visible and sampler.backend=vllm: vLLM and the trainer share it "
                      "(launch.colocate=false turns this off)")
    return False, ""


def expected_colocation(gpu_count: int, *, launch: LaunchConfig, sampler: SamplerConfig) -> bool | None:
    """What `asyncgrpo doctor` expects of a running server: True = the trainer shares its GPU (``ipc``),
    False = separate GPUs (``nccl``), None = cannot tell (an external server and ``launch.colocate``
    unset: either backend is accepted, the trainer follows the server).

    Args:
        gpu_count: visible GPUs.
        launch: the ``launch`` group (``colocate``, ``server_gpus``, ``trainer_gpus``).
        sampler: the ``sampler`` group (``backend``).
    """
    setting = launch.get("colocate")
    if setting is not None:
        return bool(setting)
    if _backend(sampler) == "vllm":
        return wants_colocation(gpu_count, launch=launch, sampler=sampler)[0]
    return None


def decide_layout(gpu_count: int, gpu_memory: int | None = None, *, launch: LaunchConfig, sampler: SamplerConfig,
                  model: ModelConfig, trainer: TrainerConfig, packing: PackingConfig, staleness: StalenessConfig,
                  peft: PeftConfig, loss: LossConfig) -> Layout:
    """The layout for a config's groups on a machine with ``gpu_count`` visible GPUs.

    Args:
        gpu_count: visible GPUs.
        gpu_memory: the shared GPU's memory in bytes; None = read it (`gpu_memory_bytes`).
        launch: ``colocate``, ``server_gpus``, ``trainer_gpus``, ``num_machines``.
        sampler: ``backend``, ``host``, ``max_model_len``, ``gpu_memory_utilization``.
        model: ``name``, ``gguf_file``, ``dtype`` (the model's size, for the memory split).
        trainer: ``activation_checkpointing``.
        packing: ``token_budget`` (None = ``sampler.max_model_len``).
        staleness: ``max_concurrent_rollouts`` (the KV cache's sequences).
        peft: ``enabled`` (LoRA: the trainer's memory).
        loss: ``beta`` (> 0: a reference model on the GPU).

    Returns:
        A `Layout`; its ``problems`` name every setting that stops the colocated layout (with a fix).
        Nothing is raised: the problems are collected so that ``--dry-run`` prints them with the plan.
    """
    on, reason = wants_colocation(gpu_count, launch=launch, sampler=sampler)
    if not on:
        return Layout(False, reason)
    gpus = list(launch.server_gpus or launch.trainer_gpus or [0])
    gpu = gpus[0]
    problems: list[str] = []
    if launch.server_gpus is not None and len(launch.server_gpus) > 1:
        problems.append(f"launch.server_gpus={list(launch.server_gpus)} with the colocated layout: vLLM runs on one "
                        f"GPU shared with the trainer. Fix: launch.server_gpus=[{gpu}], or launch.colocate=false")
    trainer_gpus = launch.trainer_gpus
    if trainer_gpus is not None and list(trainer_gpus) not in ([], [gpu]):
        problems.append(f"launch.trainer_gpus={list(trainer_gpus)} with the colocated layout: the trainer runs as one "
                        f"process on vLLM's GPU {gpu}. Fix: launch.trainer_gpus=[{gpu}] (or unset), or "
                        "launch.colocate=false for separate GPUs")
    if int(launch.num_machines) > 1:
        problems.append(f"launch.num_machines={launch.num_machines} with the colocated layout (one GPU). Fix: "
                        "launch.colocate=false")
    if gpu_count == 0:
        problems.append("the colocated layout needs a CUDA GPU but none is visible. Fix: run on a GPU machine, or "
                        "sampler.backend=embedded sampler.device=cpu")
    host = str(sampler.host)
    if host not in ("127.0.0.1", "localhost", "::1"):
        problems.append(f"sampler.host={host} with the colocated layout: the server accepts pickled CUDA-IPC handles "
                        "(VLLM_ALLOW_INSECURE_SERIALIZATION=1), so anyone reaching its port could run code in it. "
                        "Fix: sampler.host=127.0.0.1 (the trainer is on this machine)")
    total = gpu_memory if gpu_memory is not None else (gpu_memory_bytes(gpu) if gpu_count else None)
    memory = None
    if total:
        mml = sampler.max_model_len
        shape = _model_shape_of(str(model.name) if model.name else None, model.get("gguf_file"))
        dtype = model.dtype.value if hasattr(model.dtype, "value") else str(model.dtype)
        max_len = int(mml) if mml is not None else 4096
        budget = packing.token_budget
        from ..config.checkpointing_rules import checkpoint_every

        every = checkpoint_every(trainer)  # 0: off; unset is on, as the trainer resolves it
        memory = plan_memory(int(total), shape, configured=sampler.gpu_memory_utilization, dtype=dtype,
                             token_budget=int(budget) if budget is not None else max_len, max_model_len=max_len,
                             max_concurrent=int(staleness.max_concurrent_rollouts),
                             activation_checkpointing=every > 0, lora=bool(peft.enabled),
                             reference=float(loss.get("beta", 0.0) or 0.0) > 0, checkpoint_every=max(1, every))
        if mml is None:
            memory.notes.append("sampler.max_model_len is unset: the KV estimate assumes 4096 tokens a sequence")
        problems.extend(memory.problems)
    elif sampler.gpu_memory_utilization is None and gpu_count:
        problems.append("the shared GPU's memory could not be read (nvidia-smi). Fix: set "
                        "sampler.gpu_memory_utilization (vLLM's share, e.g. 0.3)")
    return Layout(True, reason, gpu, memory, problems)


def vllm_ipc_problem(version: str | None, installed: str | None) -> str | None:
    """Why the vLLM in use cannot do CUDA-IPC weight transfer (None = it can).

    Reads the installed vLLM's ``ipc_engine.py`` when ``version`` is the installed one: absent → no IPC;
    a module-level ``import ray`` (vLLM 0.26.0) with ray not importable → the server would die at start.
    Without an installed vLLM, decides by the release (0.26 introduced the backend, VLLM.md).
    """
    import importlib.util
    import re

    from .vllm_versions import MIN_VLLM, parse_version

    two_gpus = ("or use two GPUs: launch.colocate=false on a machine with 2+ GPUs (vLLM on one GPU, the "
                "trainer on the others, NCCL weight transfer)")
    if version is not None and version == installed:
        spec = importlib.util.find_spec("vllm")
        root = Path(spec.origin).parent if spec is not None and spec.origin else None
        engine = root / "distributed" / "weight_transfer" / "ipc_engine.py" if root else None
        if engine is None or not engine.is_file():
            return (f"the installed vLLM {version} has no CUDA-IPC weight transfer "
                    f"(vllm/distributed/weight_transfer/ipc_engine.py). Fix: pip install 'vllm>=0.26', {two_gpus}")
        if re.search(r"^import ray\b", engine.read_text(errors="ignore"), re.M) and importlib.util.find_spec("ray") is None:
            return (f"vLLM {version}'s CUDA-IPC engine imports ray when it loads, and ray is not installed (the "
                    f"server would exit at start). Fix: pip install ray, {two_gpus}")
        return None
    if version is not None and parse_version(version) < MIN_VLLM:
        return f"vLLM {version} has no CUDA-IPC weight transfer (from 0.26). Fix: pip install 'vllm>=0.26', {two_gpus}"
    return None
