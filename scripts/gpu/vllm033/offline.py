"""Offline stand-ins for issue #37's three vLLM 0.33 runs on one H200 (the lent machine reaches no network).

    python3 scripts/gpu/vllm033/offline.py DEST [--shape full|tiny] [--device cuda|cpu]

writes under ``DEST``:

``deepmath_model/``
    A random-weight ``Qwen3_5ForConditionalGeneration`` (the released Qwen3.5-2B's class: a Gated DeltaNet hybrid
    inside the vision-language wrapper) with Qwen3.5-2B's text stack as its ``config.json`` gives it (24 layers,
    every 4th full attention, hidden 2048, vocabulary 248,320: `QWEN35_2B_TEXT`, the figures
    ``scripts/bench/bench_gdn.py`` uses) and transformers' default Qwen3.5 vision tower projected to 2,048 (the tower
    is frozen and skipped by the weight sync; its exact width is not the checkpoint's). bf16, about 2.3 B parameters.
``moe_model/``
    A small random ``Qwen3MoeForCausalLM`` (`MOE_SHAPE`: 16 experts, top-4, ``router_aux_loss_coef`` 0.01) for the
    MoE sync run: served by vLLM 0.33 (``Qwen3MoeForCausalLM`` is in its registry), trained a few steps.
``deepmath.jsonl``
    Generated math problems in the deepmath recipe's schema (``trl-lib/DeepMath-103K``: a conversational
    ``prompt`` column and a ``solution`` column that `accuracy_reward` reads): `make_deepmath_data`.

Both models get a word-level tokenizer that covers every id of their vocabulary (vLLM detokenizes whatever a
random model samples) and whose first ids are the words and numbers of the generated problems, so prompts
tokenize to real ids; a chat template (prompts are chat messages). The overrides of the runs are
`deepmath_overrides`, `lora_overrides` and `moe_overrides`; ``tests/test_gpu_script_configs.py`` composes each of
them with the ``tiny`` shape on CPU and passes it through the checks ``train`` runs.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Qwen3.5-2B's text stack (config.json): 24 layers, every 4th full attention, the others linear_attention.
QWEN35_2B_TEXT = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                      linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, max_position_embeddings=40960)
TINY_TEXT = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                 max_position_embeddings=4096)
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=64)
MOE_SHAPE = dict(vocab_size=151936, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16,
                 num_experts_per_tok=4, router_aux_loss_coef=0.01, max_position_embeddings=40960)
TINY_MOE = dict(MOE_SHAPE, vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2, max_position_embeddings=4096)
SHAPES = {"full": (QWEN35_2B_TEXT, None, MOE_SHAPE), "tiny": (TINY_TEXT, TINY_VISION, TINY_MOE)}
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# The words of `make_deepmath_data`'s problems (and of an answer), then the numbers up to `NUMBERS`.
WORDS = ("What is the value of Compute Find Let x be such that Solve for The answer is . , ? : + - * / = ( ) "
         "sum product difference remainder when divided by of and Put your final in boxed { } \\boxed").split()
NUMBERS = 1600  # the largest number of a problem: 39 * 39 + 38


def word_vocab(vocab_size: int) -> dict[str, int]:
    """Token -> id for all ``vocab_size`` ids: the special tokens, `WORDS`, the numbers 0 .. `NUMBERS` - 1, then
    ``<tN>`` fillers. Raises ValueError when ``vocab_size`` cannot hold the words."""
    words = [*SPECIALS, *dict.fromkeys(WORDS), *(str(i) for i in range(NUMBERS))]
    if vocab_size < len(words):
        raise ValueError(f"vocab_size={vocab_size} is below the {len(words)} words of the offline tokenizer")
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"<t{i}>": i for i in range(len(words), vocab_size)})
    return vocab


def make_tokenizer(vocab_size: int):
    """A word-level `PreTrainedTokenizerFast` over `word_vocab` (whitespace and punctuation split), eos
    ``<|im_end|>``, pad ``<|endoftext|>``, with `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(word_vocab(vocab_size), unk_token="<|endoftext|>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[2:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _save(model, tokenizer, out: Path) -> Path:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_deepmath_model(out: Path, shape: str = "full", device: str = "cuda") -> Path:
    """The Qwen3.5-2B-shaped vision-language checkpoint (module docstring) in ``out``; kept when it exists."""
    import torch
    import transformers as tf

    if (out / "config.json").exists():
        return out
    text_shape, vision, _ = SHAPES[shape]
    tokenizer = make_tokenizer(text_shape["vocab_size"])
    layers = text_shape["num_hidden_layers"]
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    text = tf.Qwen3_5TextConfig(layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                             for i in range(layers)], tie_word_embeddings=True, **special,
                                **text_shape)
    vision_config = dict(vision or {}, out_hidden_size=text_shape["hidden_size"])
    vocab = text_shape["vocab_size"]  # the media tokens: the last ids, as fillers the problems never use
    config = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision_config, tie_word_embeddings=True,
                              image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3,
                              vision_end_token_id=vocab - 4)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    return _save(model, tokenizer, out)


def make_moe_model(out: Path, shape: str = "full", device: str = "cuda") -> Path:
    """The small random Qwen3-MoE (module docstring) in ``out``; kept when it exists."""
    import torch
    import transformers as tf

    if (out / "config.json").exists():
        return out
    moe = SHAPES[shape][2]
    tokenizer = make_tokenizer(moe["vocab_size"])
    config = tf.Qwen3MoeConfig(tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **moe)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.Qwen3MoeForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    return _save(model, tokenizer, out)


def make_deepmath_data(path: Path, n: int = 2000, seed: int = 0) -> Path:
    """``n`` generated problems as jsonl in the deepmath recipe's schema: ``prompt`` (one user message) and
    ``solution`` (the integer answer as text). Every word is in `WORDS` and every number below `NUMBERS`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(2, 40), rng.randrange(2, 40)
        kind = rng.randrange(4)
        if kind == 0:
            question, answer = f"What is the value of {a} * {b} ?", a * b
        elif kind == 1:
            question, answer = f"Compute the sum of {a} and {b} .", a + b
        elif kind == 2:
            question, answer = f"Find the remainder when {a * b + a % b} is divided by {b} .", (a * b + a % b) % b
        else:
            question, answer = f"Let x be such that x - {a} = {b} . Solve for x .", a + b
        rows.append({"prompt": [{"role": "user", "content": f"{question} Put your final answer in \\boxed {{ }} ."}],
                     "solution": str(answer)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def number_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's words that are numbers (0.0 .. 1.0). A stand-in next to `accuracy_reward`: a
    random-weight model never answers right, so every group would score alike and be dropped (no learning
    signal, the run stops); this one varies within a group. Needs ``scripts/gpu/vllm033`` on ``PYTHONPATH``.

    Args:
        completions: G completions, each a list of chat messages (the recipe's conversational prompts).

    Returns:
        G floats in [0, 1].
    """
    out = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        words = text.split()
        out.append(sum(w.isdigit() for w in words) / len(words) if words else 0.0)
    return out


def deepmath_overrides(model_dir: Path | str, data_file: Path | str, run_dir: Path | str, steps: int = 12,
                       learning_rate: float = 0.0) -> list[str]:
    """``+recipe=deepmath`` on one GPU with what points at the offline model and data, what one GPU and the run's
    length need (colocated vLLM, 12 steps, learning rate 0: the importance ratio must stay about 1),
    `number_reward` next to the recipe's `accuracy_reward` (a random model scores 0 on every problem), and the
    weight-sync check (``sampler.check_weight_sync``: a perturbed sync at start, a probe after every sync)."""
    return ["+recipe=deepmath", f"model.name={model_dir}", f"data.name={data_file}", "launch.colocate=true",
            "rewards=[{func:asyncgrpo_cli.rewards:accuracy_reward},{func:offline:number_reward}]",
            f"trainer.output_dir={run_dir}", f"trainer.max_steps={steps}", f"trainer.learning_rate={learning_rate}",
            "logging.dashboard=plain", "trainer.save_steps=1000", "sampler.check_weight_sync=true"]


def lora_overrides(run_dir: Path | str, steps: int = 16, learning_rate: float | None = None) -> list[str]:
    """The one-GPU arith recipe with ``peft.enabled=true`` (adapter-only sync through vLLM); ``learning_rate``
    None keeps the recipe's."""
    lr = [] if learning_rate is None else [f"trainer.learning_rate={learning_rate}"]
    return ["+recipe=arith_vllm_1gpu", "peft.enabled=true", f"trainer.output_dir={run_dir}",
            f"trainer.max_steps={steps}", "logging.dashboard=plain", *lr]


def moe_overrides(model_dir: Path | str, run_dir: Path | str, steps: int = 6) -> list[str]:
    """The small Qwen3-MoE on the one-GPU arith recipe: a sync every step (max_staleness 0 syncs before each
    generation round), the router's aux loss in the loss, the weight-sync check (its probe after every sync), and
    `number_reward` next to the recipe's `accuracy_reward`: a random model scores 0 on every problem, and a run of
    groups with no signal stops the job (found on CPU, seventeenth session) before its first step."""
    return ["+recipe=arith_vllm_1gpu", f"model.name={model_dir}", "model.gguf_file=null", "model.dtype=bfloat16",
            "rewards=[{func:asyncgrpo_cli.rewards:accuracy_reward},{func:offline:number_reward}]",
            f"trainer.output_dir={run_dir}", f"trainer.max_steps={steps}", "staleness.max_staleness=0",
            "model.router_aux_loss_coef=0.01",
            "logging.dashboard=plain", "sampler.check_weight_sync=true"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="full")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    make_deepmath_data(args.dest / "deepmath.jsonl")
    print(make_deepmath_model(args.dest / "deepmath_model", args.shape, args.device))
    print(make_moe_model(args.dest / "moe_model", args.shape, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
