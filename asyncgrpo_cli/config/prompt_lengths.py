"""Prompt lengths against the length limits, before anything starts (issue 25).

The rollout worker renders each prompt through the chat template with a generation prompt
(`AsyncRolloutLoop.render_prompt`) and asks the server for ``max_completion_length`` more tokens; the
trainer packs each sample into rows of ``token_budget`` tokens. `check_prompt_lengths` renders the
prompts of the dataset the same way (up to `ROWS_SCANNED` rows) and refuses:

- a prompt whose length plus ``rollout.max_completion_length`` exceeds ``sampler.max_model_len``: the
  server answers HTTP 400 to that request and the run fails a minute in;
- a ``packing.token_budget`` that no prompt fits (with one completion token): every sample would be
  dropped as oversize and training would wait for ever.

Tool schemas shown to the model (``tools``) make real prompts longer than rendered here: the check can
only miss, never refuse a prompt that fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .rules import ConfigError, config_error as _err

ROWS_SCANNED = 20000
"""Rows rendered at most (a larger dataset is checked on its first rows; the message says so)."""


def prompt_token_lengths(prompts: Iterable[Any], tokenizer: Any, chat_template_kwargs: dict | None = None,
                         limit: int = ROWS_SCANNED) -> list[int]:
    """Token counts of ``prompts`` (chat messages, or a plain string as one user message) through the chat
    template with a generation prompt, as the rollout worker renders them; at most ``limit`` of them."""
    lengths = []
    for i, prompt in enumerate(prompts):
        if i >= limit:
            break
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                **(chat_template_kwargs or {}))
        lengths.append(len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return lengths


def check_prompt_lengths(lengths: list[int], max_completion_length: int, max_model_len: int | None,
                         token_budget: int | None, *, scanned_all: bool = True,
                         completion_key: str = "rollout.max_completion_length",
                         len_key: str = "sampler.max_model_len", budget_key: str = "packing.token_budget") -> None:
    """Refuse lengths the run cannot serve or train (module docstring).

    Args:
        lengths: prompt lengths in tokens (`prompt_token_lengths`), in dataset order.
        max_completion_length: generated tokens asked per request.
        max_model_len: the server's limit (None: unknown, not checked).
        token_budget: tokens per packed row (None: ``max_model_len``).
        scanned_all: False when ``lengths`` covers only the first rows.

    Raises:
        ConfigError: naming the key, the longest (or shortest) prompt's row and length, and the fix.
    """
    if not lengths:
        return
    where = "" if scanned_all else f" (of the first {len(lengths)} rows)"
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if max_model_len is not None and lengths[longest] + max_completion_length > max_model_len:
        n = lengths[longest]
        too_long = sum(1 for x in lengths if x + max_completion_length > max_model_len)
        raise _err(completion_key, max_completion_length,
                   f"the longest prompt{where} (row {longest}) has {n} tokens after the chat template, and "
                   f"{n} + {max_completion_length} > {len_key}={max_model_len}: the server answers HTTP 400 to "
                   f"{too_long} prompt(s)",
                   f"set {completion_key}={max(1, max_model_len - n)} or less, or raise {len_key} to at least "
                   f"{n + max_completion_length}, or drop the longest prompts")
    budget = token_budget if token_budget is not None else max_model_len
    shortest = min(lengths)
    if budget is not None and shortest + 1 > budget:
        raise _err(budget_key if token_budget is not None else len_key, budget,
                   f"no prompt fits: the shortest prompt{where} has {shortest} tokens after the chat template, so "
                   "every sample (prompt + completion) is dropped as oversize and training never gets a step",
                   f"set {budget_key} to at least {shortest + max_completion_length} (the prompt plus "
                   f"{completion_key}), or null for {len_key}")


def check_dataset_lengths(ds: Any, folder: Any, cfg: Any) -> None:
    """`check_prompt_lengths` for the CLI: the composed config ``cfg``, its loaded prompts ``ds`` (the
    ``prompt`` column) and the local model ``folder``'s tokenizer. ``max_model_len`` is the config's, else the
    model's ``max_position_embeddings``.

    Raises:
        ConfigError: see `check_prompt_lengths`.
    """
    from transformers import AutoTokenizer

    from .sources import model_max_len

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - the model check reports an unreadable folder itself
        return
    limit = ROWS_SCANNED
    total = len(ds) if hasattr(ds, "__len__") else None
    if total is not None and hasattr(ds, "select"):
        column = ds.select(range(min(total, limit)))["prompt"]
    else:
        column = (row["prompt"] for row in ds)
    kwargs = dict(cfg.rollout.chat_template_kwargs or {})
    try:
        lengths = prompt_token_lengths(column, tokenizer, kwargs)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a template problem is the chat-template check's to report
        return
    max_len = cfg.sampler.max_model_len
    if max_len is None:
        max_len = model_max_len(folder)
    check_prompt_lengths(lengths, int(cfg.rollout.max_completion_length), max_len, cfg.packing.token_budget,
                         scanned_all=total is not None and total <= len(lengths))
