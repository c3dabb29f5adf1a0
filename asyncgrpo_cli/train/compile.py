"""Regional ``torch.compile`` of the policy's decoder layers (``torch_compile``, SPEC §16.3 field list).

Eager PyTorch runs a decoder layer's RMSNorms, rotary embedding, SwiGLU, casts and residual adds as dozens of
separate kernels; on one H200 they took about half of a tree-packed step's kernel time
(``scripts/bench/NOTES.md``). Compiling the whole model does not work here: the loss runs inside the
output-embedding module from a context variable, each packed row has a new length, and tree attention takes
per-row Python objects. So this compiles *regions* instead: every direct child of every decoder layer (the
attention block, the MLP, the norms) gets a compiled ``forward``. Layers are instances of one class, so the
28 layers of a Qwen3 model share four compiled graphs, and shapes are dynamic, so new row lengths do not
recompile. Tree attention itself stays outside the graphs (``torch.compiler.disable`` in
``tree_attention``): FlexAttention is compiled on its own, and the per-row mask objects never reach dynamo.

The layers themselves keep their eager ``__call__``, so activation checkpointing (transformers wraps the
layer's forward), FSDP2 hooks (on the layer) and PEFT adapters (inside the children, traced with them) are
untouched. Parameter names do not change, so checkpoints and weight sync see the same state dict.
"""

from __future__ import annotations

import torch

__all__ = ["compile_decoder_layers", "decoder_layers"]

_MARK = "_asyncgrpo_compiled"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers of a transformers causal LM (or a PEFT wrapper of one).

    Looks for ``get_decoder().layers``, then for the longest ``nn.ModuleList`` whose entries share one class.

    Raises:
        ValueError: the model has no such list (nothing to compile regionally).
    """
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return list(layers)
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    if not best:
        raise ValueError(
            f"{type(model).__name__} has no list of repeated decoder layers to compile; set "
            "trainer.torch_compile=false"
        )
    return best


def compile_decoder_layers(model: torch.nn.Module, backend: str | None = "inductor", mode: str | None = None) -> int:
    """Compile the ``forward`` of every direct child of every decoder layer, in place; returns how many.

    Args:
        model: the policy (a transformers causal LM, possibly PEFT-wrapped), before FSDP2 sharding or after.
        backend: ``torch.compile`` backend [``torch_compile_backend``]; None means ``"inductor"``.
        mode: ``torch.compile`` mode [``torch_compile_mode``]; None is the default mode. Avoid
            ``"reduce-overhead"``: CUDA graphs need static shapes and packed rows change length every step.

    Idempotent: a child compiled before is skipped. Compilation itself happens on the first forward (tens of
    seconds for the first row, once per process; a second shape compiles no more graphs).

    Raises:
        ValueError: no decoder layers found (see :func:`decoder_layers`).
    """
    compiled = 0
    for layer in decoder_layers(model):
        for child in layer.children():
            if getattr(child, _MARK, False) or not any(True for _ in child.parameters()):
                continue
            child.forward = torch.compile(child.forward, backend=backend or "inductor", mode=mode, dynamic=True)
            setattr(child, _MARK, True)
            compiled += 1
    return compiled
