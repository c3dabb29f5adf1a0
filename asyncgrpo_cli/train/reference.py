"""The reference policy of the KL penalty (``beta`` > 0; README "Loss variants").

The penalty is TRL's k3 estimator against the initial policy, per trained token,
``kl_t = exp(log π_ref(o_t) − log π_θ(o_t)) − (log π_ref(o_t) − log π_θ(o_t)) − 1``, added to the token loss
as ``beta × kl_t`` (then normalised with it by ``loss_type``) and logged as ``kl``.

``log π_ref`` is computed on the same tree-packed row as the policy's (same positions, temperature and
candidate sets: the processed distribution of SPEC §3.3.1), with no gradient:

- with LoRA the reference is the base model: the same forward with the adapters disabled (no second copy);
- with full fine-tuning it is a frozen copy of the initial weights, made when the trainer is built (its memory,
  one more copy of the weights per training process, is shown in the launch plan).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

__all__ = ["Reference", "reference_weight_bytes"]


def _is_peft(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def reference_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the frozen reference copy of ``model`` holds (0 for a PEFT model: its base is the reference)."""
    if _is_peft(model):
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Reference:
    """Computes ``log π_ref`` for a row; build it with :meth:`for_policy`.

    Attributes:
        frozen: the frozen copy (full fine-tuning), or None (LoRA: adapters disabled).
        peft_model: the PEFT policy whose adapters are disabled for the reference forward (LoRA), or None.
    """

    def __init__(self, frozen: torch.nn.Module | None = None, peft_model: torch.nn.Module | None = None) -> None:
        if (frozen is None) == (peft_model is None):
            raise ValueError("Reference needs exactly one of frozen (a copy) or peft_model (adapters disabled)")
        self.frozen = frozen
        self.peft_model = peft_model

    @classmethod
    def for_policy(cls, policy: torch.nn.Module, beta: float) -> Reference | None:
        """The reference of ``policy`` when ``beta`` > 0, else None (nothing is copied).

        Call it after ``apply_tree_attention`` and ``install_loss_head`` and before the policy is trained or
        wrapped: a full fine-tuning policy is deep-copied (patched forwards included) and frozen.
        """
        if not beta:
            return None
        if _is_peft(policy):
            return cls(peft_model=policy)
        frozen = copy.deepcopy(policy)
        frozen.requires_grad_(False)
        frozen.eval()
        return cls(frozen=frozen)

    def forward(self, policy: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """Run the reference forward of one packed row (``kwargs`` of the policy's forward), no gradient.

        The loss head stores the log-probs in the active request (``packed_loss``)."""
        with torch.no_grad():
            if self.frozen is not None:
                device = next(policy.parameters()).device
                if next(self.frozen.parameters()).device != device:
                    self.frozen.to(device)
                self.frozen(**kwargs)
                return
            with self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext():
                policy(**kwargs)
