"""HF checkpoint names of training parameters, and what a sent tensor will be (`ParamMeta`).

Training names differ from checkpoint names by wrapper segments (FSDP, activation
checkpointing, ``torch.compile``) and, for PEFT models, by ``base_model.model.``,
``.base_layer`` and ``modules_to_save`` infixes; tied weights keep the checkpoint's name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

SkipFn = Callable[[str], bool]

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_PEFT_PREFIX = "base_model.model."
ADAPTER_PART = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)")
MODULES_TO_SAVE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
ORIGINAL_MODULE = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")
_VISION_MODULES = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder",
                   "multi_modal_projector", "mm_projector", "vision_projector")


@dataclass(frozen=True)
class ParamMeta:
    """What one sent tensor will be, known without gathering it.

    Attributes:
        name: HF checkpoint name.
        dtype: dtype on the wire (the ``dtype`` asked for, else the parameter's).
        shape: full (unsharded) shape.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size on the wire, bytes."""
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def dtype_name(self) -> str:
        """vLLM's dtype name, e.g. ``"bfloat16"``."""
        return dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the ``dtype_names`` of ``/update_weights``)."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def strip_wrappers(raw: str, peft: bool) -> str:
    """``raw`` without FSDP/checkpointing/compile wrapper segments and, if ``peft``, the
    ``base_model.model.`` prefix (PEFT infixes stay; see `hf_parameter_name`)."""
    name = raw
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    if peft and name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name


def hf_parameter_name(raw: str, peft: bool = False) -> str:
    """The HF checkpoint name of a training parameter name.

    Removes FSDP/activation-checkpointing/compile wrapper segments and, when ``peft``, PEFT's
    ``base_model.model.`` prefix, the ``.base_layer`` infix of LoRA layers and the
    ``.modules_to_save.<adapter>`` / ``.original_module`` infixes.

    Example: ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``.
    """
    name = strip_wrappers(raw, peft)
    if peft:
        name = name.replace(".base_layer.", ".")
        match = MODULES_TO_SAVE.match(name) or ORIGINAL_MODULE.match(name)
        if match:
            name = f"{match['module']}.{match['rest']}"
    return name


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a PEFT ``PeftModel`` (it has ``peft_config`` and ``get_base_model``)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def vision_tower_skip(model: torch.nn.Module, modules: tuple[str, ...] = _VISION_MODULES) -> SkipFn:
    """A ``skip`` predicate dropping frozen vision-tower parameters (SPEC §14).

    A parameter is skipped when one component of its HF name is one of ``modules`` (``visual``,
    ``vision_tower``, ``vision_model``, ...) and it is frozen (``requires_grad`` False), so the
    server keeps the tower it loaded. Trained vision parameters, and frozen weights of layers
    that carry a trained LoRA adapter (their merged value changes), are still sent. The answer
    depends only on names and ``requires_grad``, so it is the same on every rank.
    """
    peft = is_peft_model(model)
    frozen: set[str] = set()
    adapted: set[str] = set()  # HF module paths with a trainable LoRA factor
    for raw, param in model.named_parameters():
        stripped = strip_wrappers(raw, peft)
        adapter = ADAPTER_PART.search(stripped)
        if adapter is not None:
            if param.requires_grad:
                adapted.add(stripped[: adapter.start()])
        elif not param.requires_grad:
            frozen.add(hf_parameter_name(raw, peft))
    wanted = set(modules)

    def skip(name: str) -> bool:
        return (name in frozen and name.rsplit(".", 1)[0] not in adapted
                and any(part in wanted for part in name.split(".")))

    return skip


def tied_sources(model: torch.nn.Module) -> dict[str, str]:
    """``{tied name: checkpoint name}`` of the model's tied weights (transformers' tie map)."""
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        tied = getattr(model, attr, None)
        if isinstance(tied, dict):
            return {str(k): str(v) for k, v in tied.items()}
    return {}
