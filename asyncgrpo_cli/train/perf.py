"""Model FLOPs and the device peak behind ``perf/fwd_bwd_mfu`` and ``perf/wall_clock_mfu`` (SPEC §15.8).

Model FLOPs of one row's forward + backward: ``6 × N_params × forwarded tokens`` (dense matmuls) plus the
attention of the tree mask, ``12 × layers × heads × head_dim × attended pairs`` (QKᵀ and AV, 2 FLOPs per
multiply-add each, ×3 for forward + backward); recomputation by activation checkpointing is not counted.
MFU is logged only where the peak is known: a CUDA device named in `PEAK_BF16_FLOPS` training in bf16/fp16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .packing import PackedRow, RowStats

# Dense bf16/fp16 tensor-core peaks per GPU (vendor data sheets, FLOP/s), matched on the device name.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "H800": 989.4e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}
# Architectures the estimator knows (dense decoder-only transformers; MoE counts all experts' params).
SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "gemma2", "gemma3_text",
                         "phi3", "olmo2", "qwen3_vl", "smollm3"}


@dataclass
class PeakFlops:
    """Peak FLOP/s of one training device at the training precision."""

    per_device: float

    @classmethod
    def detect(cls, device: torch.device, args) -> PeakFlops | None:
        """The peak of ``device`` when known (CUDA, bf16 or fp16 training, a listed GPU), else None."""
        if device.type != "cuda" or not (args.bf16 or args.fp16):
            return None
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_BF16_FLOPS.items():
            if key in name:
                return cls(flops)
        return None

    def total(self, num_processes: int) -> float:
        """Peak of all training processes together (FLOP/s)."""
        return self.per_device * num_processes


def _attention_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    if text is None or getattr(text, "model_type", None) not in SUPPORTED_MODEL_TYPES and \
            getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads, head_dim


def trainable_parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the model (all of them: a frozen base still costs forward and backward FLOPs)."""
    cached = getattr(model, "_asyncgrpo_num_params", None)
    if cached is None:
        cached = sum(p.numel() for p in model.parameters())
        try:
            model._asyncgrpo_num_params = cached
        except AttributeError:
            pass
    return cached


def step_flops(model: torch.nn.Module, row: PackedRow | RowStats) -> float:
    """Model FLOPs of one row's forward + backward (module docstring); 0 for an unsupported architecture."""
    shape = _attention_shape(model)
    if shape is None:
        return 0.0
    layers, heads, head_dim = shape
    stats = row.stats() if isinstance(row, PackedRow) else row
    dense = 6.0 * trainable_parameter_count(model) * stats.num_tokens
    attention = 12.0 * layers * heads * head_dim * stats.attention_cost
    return dense + attention


class SpanClock:
    """Summed duration of code spans (``perf/fwd_s``: the micro-batches' forwards) without a host sync per span.

    On a CUDA device each span is a pair of CUDA events on the current stream, read by :meth:`seconds` after the
    step's one sync (`loss.read_pending`): the GPU time from the span's first queued kernel to its last. Elsewhere
    the device runs in step with the host, and a span is its wall-clock time.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple] = []
        self._wall = 0.0
        self._start: object = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.monotonic()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._wall += time.monotonic() - self._start

    def seconds(self) -> float:
        """The spans' total; on CUDA call it after a sync that follows the last span (else it waits for it)."""
        if not self.cuda:
            return self._wall
        return sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
