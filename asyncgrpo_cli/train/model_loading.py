"""Loading the policy and its tokenizer as SPEC §16.1/§16.3 and §14 describe."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_policy(model_id: str, args) -> torch.nn.Module:
    """Load ``model_id`` with ``args.dtype`` (a dtype in ``model_init_kwargs`` wins) and ``trust_remote_code``.

    A vision-language checkpoint loads with ``AutoModelForImageTextToText`` and everything outside its text
    model is frozen (SPEC §14); any other with ``AutoModelForCausalLM``. ``router_aux_loss_coef`` is applied
    to MoE configs.

    Raises:
        ValueError: ``router_aux_loss_coef`` set on a model that is not mixture-of-experts (SPEC §2.16).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(args.model_init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", args.dtype))
    kwargs["dtype"] = dtype if dtype == "auto" or not isinstance(dtype, str) else _DTYPES[dtype]
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    config = AutoConfig.from_pretrained(model_id, trust_remote_code=kwargs["trust_remote_code"],
                                        revision=kwargs.get("revision"))
    if args.router_aux_loss_coef is not None:  # the trainer adds the loss itself (train/moe_aux.py)
        text = getattr(config, "text_config", None)
        if not hasattr(config, "router_aux_loss_coef") and not hasattr(text, "router_aux_loss_coef"):
            raise ValueError(f"router_aux_loss_coef={args.router_aux_loss_coef}: {model_id} is not a mixture-of-experts "
                             "model (its config has no router_aux_loss_coef). Fix: leave router_aux_loss_coef unset")
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(model_id, **kwargs)
        freeze_outside_text_model(model)
        return model
    return AutoModelForCausalLM.from_pretrained(model_id, **kwargs)


def freeze_outside_text_model(model: torch.nn.Module) -> int:
    """``requires_grad=False`` for every parameter outside the language model and the lm_head (SPEC §14).

    Returns:
        The number of parameters frozen.
    """
    text = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    keep = {id(p) for p in text.parameters()} if text is not None else set()
    head = model.get_output_embeddings()
    if head is not None:
        keep |= {id(p) for p in head.parameters()}
    frozen = 0
    for p in model.parameters():
        if id(p) not in keep and p.requires_grad:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def load_tokenizer(model_id: str, args):
    """The processing class: left padding, ``pad_token`` = ``eos_token`` when unset (SPEC §2.22)."""
    from transformers import AutoTokenizer

    init = dict(args.model_init_kwargs or {})
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code,
                                              revision=init.get("revision"))
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer):
    """Left padding and a pad token (the EOS token when the tokenizer has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(tokenizer, model) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS plus the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return sorted(ids)
