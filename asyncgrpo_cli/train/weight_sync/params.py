"""The trainer's parameters as the server's checkpoint sees them, gathered one bucket at a time.

A weight sync (SPEC §3.1, §9 merged sync, DESIGN §6) sends full, unsharded tensors under their
Hugging Face checkpoint names, the names the server's ``load_weights`` expects. This module turns
a training model into that stream:

- FSDP2 shards (``DTensor`` parameters) are gathered with ``full_tensor()``, one bucket at a time,
  so the extra memory is one bucket, not the model. The gather is a collective: **every trainer
  rank must iterate the same buckets in the same order** (rank 0 sends them; the others call
  `FullWeightSource.drain`).
- PEFT models are *merged* for sending: each LoRA layer's weight goes out as
  ``W + scaling · B @ A`` (transposed for embeddings and ``fan_in_fan_out`` layers), computed in
  float32 out of place, so the trained parameters are never touched. Names lose PEFT's
  ``base_model.model.`` prefix and ``.base_layer`` infix; ``lora_*`` tensors are not sent;
  ``modules_to_save`` copies go out under the original module's name.
- Tied weights go out once, under the name the checkpoint uses (the tie's source).
- transformers' load-time weight conversions (e.g. MoE experts fused into one tensor) are
  reverted, so the server receives the checkpoint layout.
- ``skip(hf_name) -> bool`` drops parameters, e.g. a frozen vision tower (`vision_tower_skip`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .names import (
    ADAPTER_PART,
    MODULES_TO_SAVE,
    ORIGINAL_MODULE,
    ParamMeta,
    SkipFn,
    hf_parameter_name,
    is_peft_model,
    itemsize,
    strip_wrappers,
    tied_sources,
)

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Default bucket size: 512 MiB of output tensors."""

Bucket = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------- plan
def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: ``DTensor.full_tensor()`` (a collective) or the tensor."""
    tensor = tensor.detach()
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


@dataclass
class _Entry:
    """One tensor to send: its HF name, full shape, source dtype and how to materialise it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]


def _active(adapters: Any) -> list[str]:
    if adapters is None:
        return []
    return [adapters] if isinstance(adapters, str) else list(adapters)


def _lora_layer_entry(name: str, param: torch.Tensor, layer: Any) -> _Entry | None:
    """The merged-weight entry of a LoRA layer's base weight, or None when nothing to merge."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return None  # the weight already holds the delta, or the adapter is off
    embedding = bool(getattr(layer, "lora_embedding_A", None))
    factors_a = layer.lora_embedding_A if embedding else layer.lora_A
    adapters = [a for a in _active(getattr(layer, "active_adapters", None)) if a in factors_a]
    if not adapters:
        return None
    for adapter in adapters:
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(
                f"{name}: merged weight sync of DoRA adapters is not supported; use adapter sync "
                "(serve with --enable-lora) or a plain LoRA config (use_dora=False)"
            )
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            raise NotImplementedError(f"{name}: merged weight sync does not support lora_bias=True adapters")
    if not embedding and type(layer).__name__ != "Linear":
        raise NotImplementedError(
            f"{name}: merged weight sync supports LoRA on Linear and Embedding layers, not "
            f"{type(layer).__name__}; use adapter sync or target Linear layers only"
        )
    fan_in_fan_out = bool(getattr(layer, "fan_in_fan_out", False))

    def fetch() -> torch.Tensor:
        weight = full_tensor(param)
        merged = weight.to(torch.float32)
        for adapter in adapters:
            if embedding:
                a = full_tensor(layer.lora_embedding_A[adapter]).to(torch.float32)
                b = full_tensor(layer.lora_embedding_B[adapter]).to(torch.float32)
                delta = (b @ a).T
            else:
                a = full_tensor(layer.lora_A[adapter].weight).to(torch.float32)
                b = full_tensor(layer.lora_B[adapter].weight).to(torch.float32)
                delta = b @ a
                if fan_in_fan_out:
                    delta = delta.T
            merged = torch.add(merged, delta, alpha=float(layer.scaling[adapter]))  # out of place
        return merged.to(weight.dtype)

    return _Entry(name, tuple(param.shape), param.dtype, fetch)


def _plain_entry(name: str, param: torch.Tensor) -> _Entry:
    return _Entry(name, tuple(param.shape), param.dtype, lambda: full_tensor(param))


def _plan(model: torch.nn.Module, skip: SkipFn | None, merge_adapters: bool) -> list[_Entry]:
    """Entries for every parameter to send, in ``named_parameters()`` order (same on all ranks)."""
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    entries: list[_Entry] = []
    for raw, param in model.named_parameters():
        stripped = strip_wrappers(raw, peft)
        if peft and ADAPTER_PART.search(stripped):
            continue  # lora_A / lora_B & co: merged into their base weight below
        name = hf_parameter_name(raw, peft)
        entry = None
        if peft and (".modules_to_save." in stripped or ".original_module." in stripped):
            if not _keeps_copy(model, raw):
                continue
        elif peft and ".base_layer." in stripped:
            layer = model.get_submodule(raw.rsplit(".base_layer.", 1)[0])
            if merge_adapters and (hasattr(layer, "lora_A") or hasattr(layer, "lora_embedding_A")):
                entry = _lora_layer_entry(name, param, layer)
        entries.append(entry or _plain_entry(name, param))
    names = {e.name for e in entries}
    for target, source in tied_sources(base).items():
        if target in names and source not in names:  # deduplicated under the tie's other name
            for e in entries:
                if e.name == target:
                    e.name = source
    if skip is not None:
        entries = [e for e in entries if not skip(e.name)]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ValueError(f"two parameters map to the HF name {e.name!r}; pass skip= to drop one")
        seen.add(e.name)
    return entries


def _keeps_copy(model: torch.nn.Module, raw: str) -> bool:
    """For PEFT ``modules_to_save``: send the active adapter's copy, else the original module."""
    match = MODULES_TO_SAVE.match(raw) or ORIGINAL_MODULE.match(raw)
    if match is None:
        return True
    wrapper = model.get_submodule(match["module"])
    copies = getattr(wrapper, "modules_to_save", {})
    active = [a for a in _active(getattr(wrapper, "active_adapters", None)) if a in copies]
    use_copy = bool(active) and not getattr(wrapper, "disable_adapters", False)
    if "adapter" in match.groupdict():
        return use_copy and match["adapter"] == active[0]
    return not use_copy


# ---------------------------------------------------------------------------------------------- buckets
def _checkpoint_converter(model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """transformers' reverse of its load-time weight conversions, or None when the model has none."""
    base = model.get_base_model() if is_peft_model(model) else model
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:  # older transformers: parameter names are checkpoint names
        return None
    conversions = getattr(base, "_weight_conversions", None)
    if conversions is None:
        try:
            conversions = get_model_conversion_mapping(base, add_legacy=False)
        except Exception:  # noqa: BLE001 - not a transformers model
            return None
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    return lambda state: revert_weight_conversion(base, state)


def _unit_key(name: str) -> str:
    """Entries a conversion may combine stay in one bucket: the name up to its first layer index."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _group(entries: list[_Entry], bucket_bytes: int, dtype: torch.dtype | None, atomic_layers: bool) -> list[list[_Entry]]:
    units: list[list[_Entry]] = []
    for e in entries:
        if atomic_layers and units and _unit_key(units[-1][-1].name) == _unit_key(e.name):
            units[-1].append(e)
        else:
            units.append([e])
    buckets: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for unit in units:
        unit_bytes = sum(math.prod(e.shape) * itemsize(dtype or e.dtype) for e in unit)
        if current and size + unit_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.extend(unit)
        size += unit_bytes
    if current:
        buckets.append(current)
    return buckets


class FullWeightSource:
    """The model's full weights, as the server's checkpoint names them, in buckets.

    Args:
        model: the training model (plain, FSDP2-sharded and/or PEFT).
        bucket_bytes: most bytes (in the output dtype) per bucket; a single larger tensor (or,
            for models with weight conversions, a single larger layer) forms a bucket alone.
        dtype: cast every tensor to this dtype (the server's); ``None`` keeps each one's dtype.
        skip: ``skip(hf_name) -> True`` drops a parameter (e.g. `vision_tower_skip`).
        merge_adapters: merge active LoRA adapters into their base weights (merged sync).

    Raises:
        ValueError: ``bucket_bytes`` < 1, or two parameters map to one HF name.
        NotImplementedError: a PEFT adapter that cannot be merged here (DoRA, lora_bias, conv).

    Every rank must call `buckets` (or `drain`) the same number of times, in step: each bucket
    gathers FSDP2 shards with collectives. The plan (names, buckets) is rebuilt when the
    model's parameter objects change (e.g. ``fully_shard`` after construction).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        skip: SkipFn | None = None,
        merge_adapters: bool = True,
    ) -> None:
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive integer (bytes, e.g. 512 * 2**20)")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={dtype!r} must be a torch.dtype (e.g. torch.bfloat16) or None")
        self.model = model
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.skip = skip
        self.merge_adapters = merge_adapters
        self._param_ids: tuple[int, ...] = ()
        self._refresh()

    def _refresh(self) -> None:
        """(Re)build the plan if the model's parameter objects are not the ones planned for."""
        ids = tuple(id(p) for p in self.model.parameters())
        if ids == self._param_ids:
            return
        entries = _plan(self.model, self.skip, self.merge_adapters)
        self._convert = _checkpoint_converter(self.model)
        self._buckets = _group(entries, self.bucket_bytes, self.dtype, atomic_layers=self._convert is not None)
        self._metadata: list[ParamMeta] | None = None
        self._param_ids = ids

    @property
    def num_buckets(self) -> int:
        """Buckets per pass."""
        self._refresh()
        return len(self._buckets)

    def metadata(self) -> list[ParamMeta]:
        """Name, wire dtype and full shape of every tensor `tensors` will yield, in that order.

        Computed without gathering (from global shapes), so it is cheap and local.
        """
        self._refresh()
        if self._metadata is None:
            out: list[ParamMeta] = []
            for bucket in self._buckets:
                state = {e.name: torch.empty(e.shape, dtype=self.dtype or e.dtype, device="meta") for e in bucket}
                if self._convert is not None:
                    state = self._convert(state)
                out.extend(ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items())
            self._metadata = out
        return list(self._metadata)

    def buckets(self) -> Iterator[Bucket]:
        """Yield ``[(hf_name, full_tensor), ...]`` per bucket (collective on every rank).

        Tensors are detached, full (unsharded), on the parameters' device, in ``dtype`` when
        given; they may be the parameters themselves (never write to them).
        """
        self._refresh()
        with torch.no_grad():
            for bucket in self._buckets:
                state: dict[str, torch.Tensor] = {}
                for e in bucket:
                    tensor = e.fetch()
                    state[e.name] = tensor if self.dtype is None else tensor.to(self.dtype)
                if self._convert is not None:
                    state = {n: t.contiguous() for n, t in self._convert(state).items()}
                yield list(state.items())
                del state

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`buckets` flattened: ``(hf_name, full_tensor)`` in `metadata` order."""
        for bucket in self.buckets():
            yield from bucket

    def drain(self) -> None:
        """Run every bucket's gathers and drop the tensors (ranks other than the sender)."""
        for _ in self.buckets():
            pass


def iter_full_parameter_buckets(
    model: torch.nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    *,
    skip: SkipFn | None = None,
    merge_adapters: bool = True,
) -> Iterator[Bucket]:
    """Yield the model's full parameters in buckets ``[(hf_name, tensor), ...]`` (SPEC §9, DESIGN §6).

    See `FullWeightSource` for the arguments and rules; every rank must iterate in lockstep.
    Each bucket holds at most ``bucket_bytes`` bytes (in ``dtype``) unless one tensor alone is
    larger. Peak extra memory is one bucket.
    """
    yield from FullWeightSource(model, bucket_bytes=bucket_bytes, dtype=dtype, skip=skip,
                                merge_adapters=merge_adapters).buckets()


def parameter_metadata(
    model: torch.nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    *,
    skip: SkipFn | None = None,
    merge_adapters: bool = True,
) -> list[ParamMeta]:
    """`ParamMeta` of every tensor `iter_full_parameter_buckets` yields, in order, without gathering."""
    return FullWeightSource(model, bucket_bytes=bucket_bytes, dtype=dtype, skip=skip,
                            merge_adapters=merge_adapters).metadata()
