"""Activation checkpointing of the trainer's model, as `transformers.Trainer` applies it (README: Defaults).

``trainer.activation_checkpointing`` (SPEC §16.4: on by default) makes every layer transformers can checkpoint (its
``GradientCheckpointingLayer`` modules: the decoder layers, and a vision tower's blocks where the model has one)
keep only its input in the forward and recompute itself in the backward. ``trainer.activation_checkpointing_kwargs``
(``gradient_checkpointing_kwargs`` is its deprecated alias) means what it means to ``transformers.Trainer``:

- ``every_n_layers: N`` checkpoints layers 0, N, 2N, ... and leaves the others' activations in memory (about
  ``token_budget x hidden x 30`` bytes each), so their recomputation, about a fifth of a compiled step's GPU time at
  the Qwen3-1.7B shape (`scripts/bench/NOTES.md`, P3), is skipped. Where the installed transformers has no such
  argument (before 5.2x), the same layers are chosen here.
- ``offload: true`` keeps the saved layer inputs in pinned host memory (transformers' own; refused where the
  installed version lacks it).
- any other key goes to ``torch.utils.checkpoint.checkpoint``; ``use_reentrant`` defaults to false (transformers
  binds the layer's keyword inputs, the tree's attention inputs among them, before either mode recomputes it).

Results are the same whichever layers checkpoint: recomputing a layer replays the same kernels on the same inputs.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from ..config.checkpointing_rules import KEY, checkpointing_options

__all__ = ["checkpointed_layers", "enable_activation_checkpointing"]


def _checkpointable(model: Any) -> list[Any]:
    """The model's ``GradientCheckpointingLayer`` modules, in module order (a PEFT wrapper's too)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_activation_checkpointing(model: Any, kwargs: Mapping[str, Any] | str | None = None) -> tuple[int, int]:
    """Turn on activation checkpointing of ``model`` with ``trainer.activation_checkpointing_kwargs`` (module
    docstring), before FSDP wraps it.

    Args:
        model: a transformers ``PreTrainedModel`` (or a PEFT model around one).
        kwargs: ``args.activation_checkpointing_kwargs``; None = every layer, non-reentrant.

    Returns:
        (layers that checkpoint, checkpointable layers).

    Raises:
        ConfigError: as `checkpointing_options`; ``offload`` with a transformers that cannot offload.
    """
    from ..config.rules import ConfigError

    every, offload, rest = checkpointing_options(kwargs)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
    name = "activation_checkpointing_enable" if enable is not None else "gradient_checkpointing_enable"
    enable = enable or model.gradient_checkpointing_enable
    takes = inspect.signature(enable).parameters
    native = "every_n_layers" in takes
    if offload and "offload" not in takes:
        import transformers

        raise ConfigError(f"{KEY}.offload=true: transformers {transformers.__version__}'s {name} cannot offload the "
                          "saved activations. Fix: upgrade transformers (5.25 can), or leave offload out", key=KEY)
    extra = {"every_n_layers": every, **({"offload": True} if offload else {})} if native else {}
    if name == "activation_checkpointing_enable":
        enable(activation_checkpointing_kwargs=rest, **extra)
    else:
        enable(gradient_checkpointing_kwargs=rest, **extra)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    found = _checkpointable(model)
    if not native and every > 1:  # the layers transformers' every_n_layers chooses
        for index, module in enumerate(found):
            module.gradient_checkpointing = index % every == 0
    return checkpointed_layers(model)


def checkpointed_layers(model: Any) -> tuple[int, int]:
    """(layers that checkpoint, checkpointable layers) of ``model``: the start-up line and the tests."""
    found = _checkpointable(model)
    return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in found), len(found)
