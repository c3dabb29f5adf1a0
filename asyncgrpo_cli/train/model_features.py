"""Attention features tree packing cannot reproduce, refused at start by name (SPEC §2.8).

Tree attention computes plain softmax attention over each token's own history (`tree_attention`); the loss
head reads the ``lm_head`` logits as they are (`packed_loss`). A model whose attention or output logits
need more than that would train on log-probs other than its own, so it is refused before anything loads
or starts, with the feature named:

* **attention sinks** (GPT-OSS: a learned per-head ``sinks`` logit added to every softmax's denominator);
* **attention logit soft-capping** (Gemma2: ``config.attn_logit_softcapping``, ``tanh`` on the scores);
* **final logit soft-capping** (Gemma2: ``config.final_logit_softcapping``, ``tanh`` on the output logits).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["UnsupportedModelFeature", "check_model_features"]


class UnsupportedModelFeature(ValueError):
    """The model uses an attention or logit feature the tree-packed trainer cannot reproduce (SPEC §2.8)."""


def model_configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and its text sub-config(s) (``text_config``, ``language_config``, ``llm_config``)."""
    config = getattr(model, "config", None)
    out = [config] if config is not None else []
    for name in ("text_config", "language_config", "llm_config"):
        sub = getattr(config, name, None) if config is not None else None
        if sub is not None and not isinstance(sub, dict):
            out.append(sub)
    return out


def check_model_features(model: torch.nn.Module, model_id: str | None = None) -> None:
    """Refuse a model with attention sinks or logit soft-capping (module docstring).

    Attention sinks are found as a ``sinks`` parameter of any module; soft-capping as a non-null
    ``attn_logit_softcapping`` / ``final_logit_softcapping`` in the model's (or its text model's) config.

    Raises:
        UnsupportedModelFeature: naming the model, the feature, where it was found, and the fix.
    """
    configs = model_configs(model)
    model_id = model_id or (getattr(configs[0], "_name_or_path", None) if configs else None) or type(model).__name__
    model_type = next((getattr(c, "model_type", None) for c in configs if getattr(c, "model_type", None)), None)
    kind = f" (model type {model_type!r})" if model_type else ""

    def refuse(feature: str, where: str, effect: str) -> UnsupportedModelFeature:
        return UnsupportedModelFeature(
            f"{model_id}{kind} uses {feature} ({where}), which {effect}; the tree-packed trainer does not "
            "reproduce it, so training would use log-probs other than the model's own, and it is refused "
            "(SPEC §2.8). Fix: use a model without it (e.g. Llama, Qwen2/3, Mistral, Gemma3)")

    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] == "sinks":
            raise refuse("attention sinks", f"parameter {name}, shape {list(param.shape)}",
                         "adds a learned logit to every attention softmax")
    for config in configs:
        for field, effect in (("attn_logit_softcapping", "caps every attention score with tanh"),
                              ("final_logit_softcapping", "caps the output logits with tanh")):
            value = getattr(config, field, None)
            if value is not None:
                raise refuse(f"{field.replace('_', ' ').replace('attn', 'attention')}", f"config.{field}={value}",
                             effect)
