"""Mixture-of-experts load-balancing auxiliary loss on tree-packed rows (SPEC §3.3.5).

transformers computes this loss inside a MoE model's forward from ``router_logits`` and a 2-D padding mask; a
packed forward has no such mask (it passes a 4-D placeholder, on which ``load_balancing_loss_func`` fails), and a
packed row forwards a shared token once although several samples contain it. Here:

- the router logits are recorded with forward hooks on the modules the model itself declares as their source
  (``_can_record_outputs["router_logits"]``, an ``OutputRecorder``), while the model's forward runs with
  ``output_router_logits=False`` (so its own aux-loss code never sees the placeholder);
- every forwarded token is weighted by its **multiplicity**, the number of the row's samples that contain it
  (:func:`token_multiplicity`). The weighted loss then equals the one transformers computes on the same samples
  forwarded unpacked in one padded batch (real tokens only); the empty row's dummy token has weight 0.

Formula (Switch Transformer load balancing, as transformers defines it; ``E`` experts, top-``k``, layers
concatenated): with ``p = softmax(router_logits)`` per token and layer, ``f_e = Σ_t w_t · #{e ∈ topk(p_t)} /
Σ_t w_t`` and ``P_e = Σ_t w_t p_{t,e} / Σ_t w_t`` (sums over tokens of all layers), ``aux = E · Σ_e f_e P_e``.
The trainer adds ``router_aux_loss_coef × aux`` to each row's loss (before the division by
``gradient_accumulation_steps``, so the step's aux term is the mean over micro-batches, SPEC §3.3.4) and logs the
unscaled ``aux`` as ``aux_loss``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .packing import PackedRow

__all__ = ["RouterLogitsRecorder", "load_balancing_aux_loss", "moe_aux_settings", "token_multiplicity"]


def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) if config is not None else None
    return text if text is not None and hasattr(text, "router_aux_loss_coef") else config


def moe_aux_settings(model: torch.nn.Module, coef: float | None) -> tuple[float, int, int] | None:
    """``(coefficient, num_experts, top_k)`` of the aux loss, or ``None`` when it is off.

    Args:
        model: the policy (a wrapper is fine: its ``config`` is read).
        coef: ``router_aux_loss_coef`` of the trainer config; ``None`` = the model config's value (SPEC §3.3.5).

    Raises:
        ValueError: ``coef`` set on a model that is not mixture-of-experts (SPEC §2.16).
    """
    config = _text_config(model)
    is_moe = config is not None and hasattr(config, "router_aux_loss_coef")
    if not is_moe:
        if coef is not None:
            raise ValueError(f"router_aux_loss_coef={coef}: the model is not mixture-of-experts (its config has no "
                             "router_aux_loss_coef). Fix: leave router_aux_loss_coef unset")
        return None
    value = float(config.router_aux_loss_coef if coef is None else coef)
    if value == 0.0:
        return None
    experts = next((getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, n, None)), None)
    top_k = next((getattr(config, n) for n in ("num_experts_per_tok", "top_k", "moe_top_k")
                  if getattr(config, n, None)), None)
    if experts is None or top_k is None:
        raise ValueError(f"{type(config).__name__} has router_aux_loss_coef but no expert count/top-k the aux loss "
                         "can use. Fix: set router_aux_loss_coef=0.0 to train without it")
    return value, int(experts), int(top_k)


def token_multiplicity(row: PackedRow) -> torch.Tensor:
    """``[L]`` float32: how many of the row's samples contain each forwarded token.

    A token ``j`` is in a sample iff the sample's last token ``e`` lies in ``j``'s subtree, ``j <= e <=
    dfs_leave[j]`` (DFS order), so the count is a range count over the sorted end indices.
    """
    ends = torch.sort(row.sample_end_index).values
    idx = torch.arange(row.num_tokens, device=ends.device)
    lo = torch.searchsorted(ends, idx)
    hi = torch.searchsorted(ends, row.dfs_leave.to(ends.device), right=True)
    return (hi - lo).to(torch.float32)


def load_balancing_aux_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int,
                            weights: torch.Tensor) -> torch.Tensor:
    """Weighted load-balancing loss (module docstring formula).

    Args:
        router_logits: per MoE layer ``[L, E]`` logits of the row's forwarded tokens.
        num_experts, top_k: ``E`` and ``k``.
        weights: ``[L]`` token weights (multiplicities); all zero gives a zero that keeps the graph.

    Returns:
        0-dim float32 tensor.
    """
    if not router_logits:
        raise ValueError("no router logits were recorded; the model's MoE layers did not run")
    w = weights.to(device=router_logits[0].device, dtype=torch.float32)
    total = w.sum() * len(router_logits)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    for logits in router_logits:
        logits = logits.reshape(-1, logits.shape[-1])[: w.shape[0]]
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p * w[:, None]).sum(0)
    if float(total) == 0.0:
        return 0.0 * sum(lg.float().sum() for lg in router_logits)
    return num_experts * ((counts / total) * (probs / total)).sum()


class RouterLogitsRecorder:
    """Forward hooks that record each MoE router's logits during one forward.

    The router modules are those the model declares in ``_can_record_outputs["router_logits"]`` (transformers'
    ``OutputRecorder``: target class, output index, optional layer name).

    Raises:
        ValueError: the model declares no router-logit source.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        specs = []
        for module in model.modules():
            recordable = getattr(module, "_can_record_outputs", None) or {}
            spec = recordable.get("router_logits") if isinstance(recordable, dict) else None
            if spec is not None:
                specs.append(spec)
        if not specs:
            raise ValueError(f"{type(model).__name__} declares no router_logits outputs; the MoE aux loss cannot be "
                             "computed. Fix: set router_aux_loss_coef=0.0")
        self.targets: list[tuple[torch.nn.Module, int]] = []
        for name, module in model.named_modules():
            for spec in specs:
                target = getattr(spec, "target_class", spec)
                index = getattr(spec, "index", 0) or 0
                layer_name = getattr(spec, "layer_name", None)
                class_name = getattr(spec, "class_name", None)
                hit = isinstance(target, type) and isinstance(module, target)
                if class_name is not None:
                    hit = hit or type(module).__name__.endswith(class_name)
                if hit and (layer_name is None or layer_name in name):
                    self.targets.append((module, index))
                    break
        self.logits: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record during the ``with`` block; yields the list that fills with ``[L, E]`` tensors."""
        self.logits = []
        handles = []
        for module, index in self.targets:
            def hook(_m, _args, output, index=index):
                out = output[index] if isinstance(output, (tuple, list)) else output
                self.logits.append(out)

            handles.append(module.register_forward_hook(hook))
        try:
            yield self.logits
        finally:
            for h in handles:
                h.remove()


class MoeAuxLoss:
    """The aux-loss setup of one policy: coefficient, expert count, top-k and the router-logit recorder.

    Build with :meth:`for_model` (``None`` when the loss is off); :func:`~asyncgrpo_cli.train.packed_loss.row_loss`
    records during the forward and calls :meth:`of_row`.
    """

    def __init__(self, model: torch.nn.Module, coef: float, num_experts: int, top_k: int) -> None:
        self.coef, self.num_experts, self.top_k = coef, num_experts, top_k
        self.recorder = RouterLogitsRecorder(model)

    @classmethod
    def for_model(cls, model: torch.nn.Module, coef: float | None) -> MoeAuxLoss | None:
        """See :func:`moe_aux_settings` (same arguments and errors)."""
        settings = moe_aux_settings(model, coef)
        return None if settings is None else cls(model, *settings)

    def of_row(self, row: PackedRow, router_logits: list[torch.Tensor]) -> torch.Tensor:
        """Unscaled aux loss of a packed row from the router logits recorded during its forward."""
        return load_balancing_aux_loss(router_logits, self.num_experts, self.top_k, token_multiplicity(row))
