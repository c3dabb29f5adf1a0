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
        from ..rollout.chat_templates import TOOLS_CHATML_TEMPLATE

        fast.chat_template = TOOLS_CHATML_TEMPLATE
    return fast


FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next", "qwen3_vl")


def _family_config(family: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                   max_pos: int, special: dict):
    """The transformers config of a tiny ``family`` model (see :func:`make_tiny_model`)."""
    import transformers as tf

    head_dim = hidden // heads
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=max_pos, **special)
    # Gated DeltaNet hybrids: three linear_attention layers per full_attention one, as the released checkpoints
    hybrid = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    gdn = dict(layer_types=hybrid, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dim,
               linear_value_head_dim=head_dim, linear_conv_kernel_dim=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=hidden, num_position_embeddings=64)
    media = dict(image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3,
                 vision_end_token_id=vocab - 4)
    if family == "qwen3":
        return tf.Qwen3Config(tie_word_embeddings=True, **common), tf.Qwen3ForCausalLM
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(tie_word_embeddings=True, router_aux_loss_coef=0.01, **moe, **common), \
            tf.Qwen3MoeForCausalLM
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(tie_word_embeddings=True, **gdn, **common), tf.Qwen3_5ForCausalLM
    if family == "qwen3_next":
        config = tf.Qwen3NextConfig(tie_word_embeddings=True, shared_expert_intermediate_size=hidden,
                                    router_aux_loss_coef=0.01, **gdn, **moe, **common)
        return config, tf.Qwen3NextForCausalLM
    if family == "qwen3_5_vl":
        text = tf.Qwen3_5TextConfig(tie_word_embeddings=True, **gdn, **common)
        return tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True,
                                **media), tf.Qwen3_5ForConditionalGeneration
    if family == "qwen3_5_moe_vl":
        text = tf.Qwen3_5MoeTextConfig(tie_word_embeddings=True, shared_expert_intermediate_size=hidden,
                                       router_aux_loss_coef=0.01, **gdn, **moe, **common)
        return tf.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True,
                                   **media), tf.Qwen3_5MoeForConditionalGeneration
    if family == "qwen3_vl":
        text = tf.Qwen3VLTextConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [2, 1, 1]}, tie_word_embeddings=True,
                                    **common)
        vision_vl = dict(vision, deepstack_visual_indexes=[0])
        return tf.Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision_vl, tie_word_embeddings=True,
                                **media), tf.Qwen3VLForConditionalGeneration
    raise ValueError(f"family={family!r} is unknown; use one of {', '.join(FAMILIES)}")


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
    family: str = "qwen3",
) -> Path:
    """Write a tiny random causal LM (or vision-language model) plus tokenizer to ``out_dir`` and return the path.

    The model has ``hidden_size`` (default 64) hidden units, ``num_layers`` decoder layers and a
    vocabulary equal to the tokenizer's length; weights are random (seeded) in ``dtype``;
    ``tool_template`` as in `make_tiny_tokenizer`.

    ``family`` picks the architecture (:data:`FAMILIES`): ``qwen3`` (dense, default), ``qwen3_moe`` (4 experts,
    top-2), ``qwen3_5`` (Gated DeltaNet hybrid: every 4th layer full attention, the others ``linear_attention``),
    ``qwen3_5_vl`` / ``qwen3_5_moe_vl`` (the same text stack inside the vision-language wrapper, as the released
    Qwen3.5 / Qwen3.6 checkpoints are, with a 2-block vision tower), ``qwen3_next`` (GDN hybrid with MoE) and
    ``qwen3_vl`` (attention-only VLM).

    Raises:
        ValueError: unknown ``family``.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(seed=seed, tool_template=tool_template)
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config, model_cls = _family_config(family, len(tokenizer), hidden_size, num_layers, num_heads, num_kv_heads,
                                       max_position_embeddings, special)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
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


def config_groups(fn, cfg) -> dict:
    """The config groups ``fn`` takes, from a composed config: ``{name: cfg[name]}`` for each keyword-only
    parameter of ``fn`` named after a group of `config.schema.AppConfig` (``sampler``, ``rollout``, ...),
    so that a test calls ``fn(..., **config_groups(fn, cfg))`` with exactly what its signature names.

    Raises:
        TypeError: ``fn`` takes no config group (nothing to fill in).
    """
    import dataclasses
    import inspect

    from ..config.schema import AppConfig

    names = {f.name for f in dataclasses.fields(AppConfig)}
    wanted = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in names]
    if not wanted:
        raise TypeError(f"{getattr(fn, '__name__', fn)} takes no config group")
    return {name: cfg[name] for name in wanted}


def poll_until(predicate, what: str, deadline_s: float, poll_s: float = 0.05):
    """Call ``predicate`` every ``poll_s`` seconds until it returns something true, and return that; after
    ``deadline_s`` seconds raise AssertionError naming ``what`` (tests and drills: a wait, never a sleep as
    synchronisation)."""
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(poll_s)
    raise AssertionError(f"not within {deadline_s:.0f} s: {what}")


def still_running(seen: dict[int, float]) -> list[int]:
    """The pids of ``seen`` (pid -> start time, psutil's ``create_time``) still running: same pid and start time
    (a reused pid is another process); zombies count as gone. Tests and drills end only the processes they
    started, so they remember them this way."""
    import psutil

    out = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out
