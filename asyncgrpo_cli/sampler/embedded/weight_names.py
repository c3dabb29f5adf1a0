"""Checkpoint names of fused MoE expert weights, mapped to slices of the embedded model's parameters.

A weight sync sends tensors under their Hugging Face **checkpoint** names (what vLLM's ``load_weights`` reads):
one tensor per expert, e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``. transformers fuses a layer's
experts into one parameter when it loads such a checkpoint (``experts.gate_up_proj`` of shape
``[E, 2·I, H]``, ``experts.down_proj`` of ``[E, H, I]``), so the embedded model has no parameter of that
name. As vLLM does with its expert-parameter mapping (each checkpoint expert weight goes to its expert's
slot, and to the gate or up half of a fused gate-up weight), every such name is mapped here to the view of
the fused parameter it fills: expert ``e`` along the stacking dimension, shard ``k`` of ``n`` along the
concatenation dimension. The layout comes from transformers' own conversion mapping of the served model
(``get_model_conversion_mapping``: a ``MergeModulelist`` over the expert index, optionally followed by a
``Concatenate`` of the source patterns), so it is the one transformers loaded the weights with.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["expert_weight_slots"]

Slot = Callable[[], torch.Tensor]


def _conversions(model: Any) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # a transformers without load-time conversions: names are checkpoint names
        return []
    try:
        mapping = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - not a transformers model: nothing to map
        return []
    return [c for c in mapping if isinstance(c, WeightConverter)]


def _layout(converter: Any) -> tuple[list[str], str, int | None] | None:
    """``(source patterns, target pattern, concatenation dim of one expert's slice or None)`` of an expert
    fusion converter, or None for any other conversion (left unmapped)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    sources, targets, ops = list(converter.source_patterns), list(converter.target_patterns), converter.operations
    if len(targets) != 1 or not sources or any(s.count("*") != 1 for s in sources) or "*" in targets[0]:
        return None
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return (sources, targets[0], None) if len(sources) == 1 else None
    if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].num_shards_attribute is None and ops[1].dim >= 1:
        return sources, targets[0], ops[1].dim - 1  # the stacked dim 0 is gone once one expert is taken
    return None


def expert_weight_slots(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, Slot]:
    """``{checkpoint name: a function returning the writable view of its slot}`` for every per-expert
    checkpoint weight of ``model``'s fused expert parameters (module docstring); ``{}`` for a model without.

    Args:
        model: the served transformers model.
        params: its parameters by name (``named_parameters(remove_duplicate=False)``).
    """
    slots: dict[str, Slot] = {}
    for converter in _conversions(model):
        layout = _layout(converter)
        if layout is None:
            continue
        sources, target, cat_dim = layout
        target_re = re.compile(rf"(?:^|(?<=\.)){re.escape(target)}$")
        for name, param in params.items():
            match = target_re.search(name)
            if match is None or param.dim() < 2:
                continue
            prefix = name[: match.start()]
            num_experts = int(param.shape[0])
            if cat_dim is not None and int(param.shape[cat_dim + 1]) % len(sources):
                continue  # the fused size does not split evenly: not this layout
            width = int(param.shape[cat_dim + 1]) // len(sources) if cat_dim is not None else 0
            for shard, pattern in enumerate(sources):
                for expert in range(num_experts):
                    key = prefix + pattern.replace("*", str(expert))
                    slots[key] = _view(param, expert, cat_dim, shard * width, width)
    return slots


def _view(param: torch.Tensor, expert: int, cat_dim: int | None, start: int, width: int) -> Slot:
    def slot() -> torch.Tensor:
        view = param.detach()[expert]
        return view if cat_dim is None else view.narrow(cat_dim, start, width)

    return slot
