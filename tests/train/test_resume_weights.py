"""A resume loads the checkpoint's weights without a false alarm (issue #45's fault trial): a model with tied input
and output embeddings (the smoke recipe's SmolLM2-135M) saves the shared tensor once, and transformers' load then
warned ``There were missing keys in the checkpoint model loaded: ['lm_head.weight']``, which reads as a broken
checkpoint. The tied ``lm_head`` is restored (it is the loaded ``embed_tokens`` tensor): no warning; a key that is
really missing is still reported. A two-layer model built in memory, no download."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from asyncgrpo_cli.train.checkpoint import without_tied_missing_keys
from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

LOST = "model.layers.0.mlp.down_proj.weight"


def tiny(seed: int, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def load_as_a_resume_does(model: torch.nn.Module, folder) -> list[str]:
    """`checkpoint.load_checkpoint_weights`' call (transformers' ``Trainer._load_from_checkpoint``) on a trainer
    holding ``model``; returns what transformers' trainer logger warned."""
    trainer = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)  # only the model and the FSDP flag are read
    trainer.model, trainer.is_fsdp_enabled = model, False
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers.trainer")
    logger.addHandler(handler)
    try:
        trainer._load_from_checkpoint(str(folder))
    finally:
        logger.removeHandler(handler)
    return said


@pytest.fixture
def saved(tmp_path):
    model = tiny(0)
    model.save_pretrained(tmp_path / "checkpoint-2")
    assert "lm_head.weight" not in load_file(tmp_path / "checkpoint-2" / "model.safetensors")  # saved once
    return model, tmp_path / "checkpoint-2"


def test_tied_embeddings_are_restored_without_a_missing_key_warning(saved):
    model, folder = saved
    resumed = tiny(1)
    assert not torch.equal(resumed.lm_head.weight, model.lm_head.weight)
    assert load_as_a_resume_does(resumed, folder) == []
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight  # still tied
    assert torch.equal(resumed.lm_head.weight, model.lm_head.weight)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(resumed(ids).logits, model(ids).logits)


def test_a_key_that_is_really_missing_is_still_reported(saved):
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    del state[LOST]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    said = load_as_a_resume_does(tiny(1), folder)
    assert said == [f"There were missing keys in the checkpoint model loaded: ['{LOST}']."], said
    # an untied output layer that the checkpoint lacks is not restored by anything: reported too
    untied = tiny(1, tied=False)
    result = untied.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert sorted(without_tied_missing_keys(untied, result).missing_keys) == sorted(["lm_head.weight", LOST])
