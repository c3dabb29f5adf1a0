"""Models whose attention or output logits the tree-packed trainer cannot reproduce are refused at construction,
by our own check, naming the feature: GPT-OSS (attention sinks), Gemma2 (logit soft-capping)."""

from __future__ import annotations

import datasets
import pytest
import transformers as tf

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.testing import make_tiny_tokenizer
from asyncgrpo_cli.train.model_features import UnsupportedModelFeature, check_model_features

SHAPE = dict(vocab_size=400, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def build(tmp_path, model):
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, report_to="none")
    return AsyncGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                            args=args, train_dataset=rows, processing_class=make_tiny_tokenizer())


def test_gpt_oss_is_refused_for_its_attention_sinks(tmp_path):
    model = tf.GptOssForCausalLM(tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **SHAPE))
    with pytest.raises(UnsupportedModelFeature) as info:
        build(tmp_path, model)
    msg = str(info.value)
    assert "attention sinks" in msg and "'gpt_oss'" in msg and "self_attn.sinks" in msg
    assert "token-mixing" not in msg


def test_gemma2_is_refused_for_its_logit_soft_capping(tmp_path):
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**SHAPE))
    with pytest.raises(UnsupportedModelFeature) as info:
        build(tmp_path, model)
    msg = str(info.value)
    assert "soft-capping" in msg or "softcapping" in msg
    assert "config.attn_logit_softcapping=50.0" in msg and "'gemma2'" in msg
    # Without attention soft-capping, the final-logit cap is named in turn.
    model.config.attn_logit_softcapping = None
    with pytest.raises(UnsupportedModelFeature, match="final_logit_softcapping=30.0"):
        check_model_features(model)


def test_models_without_those_features_pass():
    check_model_features(tf.Qwen3ForCausalLM(tf.Qwen3Config(**SHAPE)))
    check_model_features(tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SHAPE)))
