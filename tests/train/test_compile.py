"""Regional compilation of decoder layers (`torch_compile`): same losses and gradients as eager on tree-packed
rows with activation checkpointing, graphs shared by all layers, no recompile for new row lengths, names kept,
and the trainer wiring (the whole-model compile of Trainer/accelerate is switched off)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.train.compile import compile_decoder_layers, decoder_layers
from asyncgrpo_cli.train.loss import LossConfig
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention

VOCAB = 97


def tiny_policy(layers: int) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_tree_attention(model, "sdpa")
    install_loss_head(model)
    return model


def groups(seed: int, prompt: int, completions: list[int]) -> list[TrainingSequence]:
    """One group sharing a prompt, one sample per completion length."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (prompt,), generator=g).tolist()
    out = []
    for c in completions:
        ids = base + torch.randint(0, VOCAB, (c,), generator=g).tolist()
        trained = [0] * prompt + [1] * c
        out.append(TrainingSequence(
            input_ids=ids, trained_mask=trained, sampler_logprobs=[-4.5 if t else 0.0 for t in trained],
            advantage=1.0 if c % 2 else -1.0, group_id=seed, row_index=seed, model_version=0,
            sampler_top_ids=[torch.randint(0, VOCAB, (3,), generator=g).tolist() if t else [] for t in trained],
            sampler_top_logprobs=[[-3.0] * 3 if t else [] for t in trained]))
    return out


def rows_of(samples) -> list:
    return [pack_row(p.rows[0]) for p in TokenBudgetBatcher(10_000, 1).plan(samples)]


def step(model, rows) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """fwd+bwd per row (the trainer's path); returns each row's loss and parameter gradients."""
    out = []
    for row in rows:
        loss, _ = row_loss(model, row, LossConfig(), 1000, 1)
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor on the CPU needs a C++ compiler")),
])
def test_compiled_layers_match_eager_and_share_graphs(backend):
    model = tiny_policy(layers=4)
    names = [n for n, _ in model.named_parameters()]
    first = rows_of(groups(1, 20, [5, 9, 3]))
    second = rows_of(groups(2, 31, [7, 2, 11, 4]))  # another row length: must not recompile
    assert first[0].num_tokens != second[0].num_tokens
    want = step(model, first + second)

    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(model, backend=backend) == 4 * 4  # attention, MLP, two norms per layer
    assert compile_decoder_layers(model, backend=backend) == 0  # idempotent
    got = step(model, first)
    graphs_after_first = counters["stats"]["unique_graphs"]
    got += step(model, second)

    # One graph per child class (the attention block breaks at tree attention: two graphs), for all four layers.
    assert 4 <= graphs_after_first <= 6
    assert counters["stats"]["unique_graphs"] == graphs_after_first
    assert [n for n, _ in model.named_parameters()] == names
    for (loss_w, grads_w), (loss_g, grads_g) in zip(want, got):
        assert loss_g == pytest.approx(loss_w, rel=1e-5, abs=1e-7)
        assert abs(loss_w) > 1e-6
        for name, grad in grads_w.items():
            torch.testing.assert_close(grads_g[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_decoder_layers_needs_repeated_blocks():
    model = tiny_policy(layers=2)
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError, match="torch_compile=false"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))


def test_trainer_compiles_regions_and_not_the_whole_model(tmp_path):
    import datasets  # here, so that the CUDA tests can import this module's helpers without datasets

    model_dir = make_tiny_model(tmp_path / "tiny")
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_steps=1,
                           torch_compile=True, torch_compile_backend="aot_eager")
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                               args=args, train_dataset=data)
    layers = decoder_layers(trainer.model)
    assert all(getattr(child, "_asyncgrpo_compiled", False) for layer in layers for child in layer.children()
               if any(True for _ in child.parameters()))
    assert trainer.loss_config.compile_backend == "aot_eager"
    from accelerate.utils import DynamoBackend

    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    prepared = trainer.accelerator.prepare_model(trainer.model)
    assert not isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)


def test_the_trainer_switches_tree_attention_for_its_training_device(tmp_path, monkeypatch, capsys):
    """The model is loaded on the CPU and moved by transformers' Trainer afterwards: tree attention (``auto``, flash's
    kernel, Gated DeltaNet's) must be chosen for ``args.device``, not for where the parameters are at start. On
    every GPU job before 2026-12-05 ``auto`` became sdpa that way (a dense [L, L] mask per row)."""
    import datasets

    from asyncgrpo_cli.train import trainer as trainer_module
    from asyncgrpo_cli.train.tree_attention import apply_tree_attention

    seen = []

    def spy(model, backend="auto", model_id=None, **kwargs):
        seen.append(kwargs)
        return apply_tree_attention(model, backend, model_id, **kwargs)

    monkeypatch.setattr(trainer_module, "apply_tree_attention", spy)
    monkeypatch.setenv("RANK", "0")
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_steps=1)
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    AsyncGRPOTrainer(model=str(make_tiny_model(tmp_path / "tiny")),
                     reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args, train_dataset=data)
    assert seen == [{"device": args.device, "announce": True}]
    assert "asyncgrpo: tree attention: sdpa (packing.attention=auto on cpu)" in capsys.readouterr().out


def test_auto_is_flex_for_a_cuda_training_device_whatever_the_parameters_device(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.train.tree_attention import apply_tree_attention, tree_attention_backend

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"), attn_implementation="sdpa")
    monkeypatch.setenv("RANK", "0")
    assert apply_tree_attention(model, "auto", device=torch.device("cuda", 0), announce=True) == "flex"
    assert tree_attention_backend(model) == "flex"
    assert capsys.readouterr().out == "asyncgrpo: tree attention: flex (packing.attention=auto on cuda)\n"
    assert apply_tree_attention(model, "auto") == "sdpa" and capsys.readouterr().out == ""  # parameters: the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_trainer_trains_with_flex(tmp_path):
    """On a GPU the trainer's tree attention is FlexAttention (``auto``), chosen before its model moves there."""
    import datasets

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_steps=1)
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    trainer = AsyncGRPOTrainer(model=str(make_tiny_model(tmp_path / "tiny")),
                               reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                               train_dataset=data)
    assert args.device.type == "cuda" and trainer.tree_backend == "flex"
    assert next(trainer.model.parameters()).device.type == "cuda"
