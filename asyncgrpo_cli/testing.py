"""Tiny offline models for tests, examples and benchmarks: nothing is downloaded.

`make_tiny_model(out_dir)` writes a randomly initialised Qwen3-style causal LM and a byte-level BPE
tokenizer trained on the spot, with a ChatML chat template, into one ``save_pretrained`` folder that
`transformers.AutoModelForCausalLM`, the embedded sampler and vLLM can all load.
"""

from __future__ import annotations

import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORDS = (
    "the a of to in is it what why how number sum plus minus times answer question user assistant "
    "system think step result equal one two three four five six seven eight nine ten zero boxed "
    "please solve compute add subtract multiply divide first then so we get final"
).split()


def _corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.7 else str(rng.randint(0, 999)) for _ in range(12)]
        out.append(" ".join(words) + rng.choice([".", "?", "!", " = 42", " \\boxed{7}"]))
    return out


def make_tiny_tokenizer(vocab_size: int = 384, seed: int = 0, tool_template: bool = False):
    """Train a byte-level BPE tokenizer offline and wrap it as a `PreTrainedTokenizerFast`.

    Returns a tokenizer with ``<|im_end|>`` as EOS, ``<|endoftext|>`` as pad (left padding) and a
    ChatML chat template; ``tool_template=True`` gives it the Qwen3-style ChatML template with tools
    (`asyncgrpo_cli.rollout.chat_templates.TOOLS_CHATML_TEMPLATE`). ``vocab_size`` is a target; the
    trained vocabulary may be smaller.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, 2000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    if tool_template:
        from .rollout.chat_templates import TOOLS_CHATML_TEMPLATE

        fast.chat_template = TOOLS_CHATML_TEMPLATE
    return fast


def make_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    tool_template: bool = False,
) -> Path:
    """Write a tiny random Qwen3 causal LM plus tokenizer to ``out_dir`` and return the path.

    The model has ``hidden_size`` (default 64) hidden units, ``num_layers`` decoder layers and a
    vocabulary equal to the tokenizer's length; weights are random (seeded) in ``dtype``;
    ``tool_template`` as in `make_tiny_tokenizer`.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(seed=seed, tool_template=tool_template)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def machine_slowdown() -> float:
    """How many times slower than idle this machine runs right now (>= 1): the larger of the 1-minute load
    average and the processes runnable at this instant (``/proc/loadavg``), per CPU core. Tests multiply
    their deadlines by it so a loaded machine (CI, other jobs) does not turn slowness into a failure."""
    import os

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1  # minus this reader
    except (OSError, ValueError, IndexError):
        running = 0
    return max(1.0, max(load, float(running)) / cores)


def deadline_s(idle_s: float, *, floor_s: float | None = None) -> float:
    """A test deadline for work taking up to ``idle_s`` seconds on an idle machine: ``idle_s`` times
    (1 + `machine_slowdown`), at least ``floor_s`` (default ``idle_s``)."""
    return max(floor_s if floor_s is not None else idle_s, idle_s * (1.0 + machine_slowdown()))
