"""Loss variants end to end on CPU (issue #27): the trainer runs 2 steps against the embedded sampler with several
options on at once, and the weights move. A tiny model whose EOS is likely, so that some completions end and
some are cut at max_completion_length (mask_truncated_completions has both kinds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model


def parity_reward(completion_ids, **kwargs):
    return [float(bool(ids) and ids[0] % 2 == ids[-1] % 2) for ids in completion_ids]


def length_reward(completion_ids, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


def brevity_reward(completion_ids, **kwargs):
    """For mask_truncated_completions: only completions ending with EOS are trained, and length_reward would give
    every one of them a negative advantage, so that one step at lr 1e-2 could leave every completion cut (then
    nothing is trained and the run stops for want of signal). Rewarding brevity keeps EOS likely, and the case's
    lower learning rate keeps the first step from making every completion a bare EOS (all scored the same)."""
    return [1.0 - len(ids) / 8.0 for ids in completion_ids]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_eos"))
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():  # point the EOS row along the mean final hidden state: P(EOS) ≈ 0.15 per token
        hidden = model.model(input_ids=torch.randint(0, len(tok), (8, 20))).last_hidden_state.flatten(0, 1)
        mean = hidden.mean(0)
        model.lm_head.weight[tok.eos_token_id] = mean / mean.norm() ** 2 * 3.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=96, max_logprobs=8)).start()
    yield handle
    handle.stop()


CASES = {
    "gspo_seq_tis_grpo_masked_weighted": dict(
        score_centering=False, loss_type="grpo", importance_sampling_level="sequence",
        vllm_importance_sampling_mode="sequence_truncate", mask_truncated_completions=True,
        reward_weights=[1.0, 0.5], epsilon=3e-4, epsilon_high=4e-4, learning_rate=1e-4),
    "cispo_token_tis_every2": dict(score_centering=False, loss_type="cispo", epsilon_high=5.0,
                                   vllm_importance_sampling_mode="token_truncate",
                                   activation_checkpointing_kwargs={"every_n_layers": 2}),
    "centering_dr_grpo_token_tis_kl": dict(loss_type="dr_grpo", vllm_importance_sampling_mode="token_truncate",
                                           beta=0.05),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_variant_trains(model_dir, server, tmp_path, case, monkeypatch, capfd):
    import transformers.modeling_utils

    recomputed = []  # layer calls that went through torch's checkpoint: the model trains in train mode

    def counting_checkpoint(function, *args, **kwargs):
        recomputed.append(1)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counting_checkpoint)
    out = tmp_path / case
    options = dict(output_dir=str(out), max_steps=2, num_generations=4, max_completion_length=8,
                   num_sampler_logprobs=3, vllm_server_base_url=server.url, learning_rate=1e-2,
                   save_strategy="no", logging_steps=1, report_to="none", max_staleness=2,
                   vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0, optim="sgd", max_grad_norm=0.0)
    args = AsyncGRPOConfig(**{**options, **CASES[case]})
    second = brevity_reward if args.mask_truncated_completions else length_reward
    prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}]}
                                          for i in range(16)])
    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[parity_reward, second], args=args,
                               train_dataset=prompts)
    assert trainer.loss_config.loss_type == args.loss_type
    result = trainer.train()
    assert result.global_step == 2
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    after = trainer.model.state_dict()
    assert max(float((after[k].float() - before[k]).abs().max()) for k in before if k in after) > 0
    keys = set().union(*lines)
    if args.mask_truncated_completions:
        assert "completions/masked_truncated_frac" in keys
        assert {"rewards/parity_reward/weight", "rewards/brevity_reward/weight"} <= keys
    else:
        assert not any(k.endswith("/weight") for k in keys) and "completions/masked_truncated_frac" not in keys
    assert ("kl" in keys) == (args.beta > 0)
    from asyncgrpo_cli.train.checkpointing import checkpointed_layers

    on, of = checkpointed_layers(trainer.model)  # trainer.activation_checkpointing_kwargs reached the model
    assert of >= 2 and on == (-(-of // 2) if args.activation_checkpointing_kwargs else of), (on, of)
    assert trainer.model.training and len(recomputed) >= 2 * on, (len(recomputed), on)  # each step, each layer on
    assert f"asyncgrpo trainer: activation checkpointing on {on} of {of} layers" in capfd.readouterr().err
    if args.beta > 0:  # step 1 trains the initial policy itself: KL 0; after one update it is > 0
        assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6) and lines[1]["kl"] > 0
        assert trainer.reference.frozen is not None


def test_lora_with_kl_to_the_base_model(model_dir, tmp_path):
    from peft import LoraConfig

    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32", max_model_len=96,
                                       max_logprobs=8, enable_lora=True, max_lora_rank=8, max_loras=4)).start()
    try:
        out = tmp_path / "lora_kl"
        args = AsyncGRPOConfig(output_dir=str(out), max_steps=2, num_generations=4, max_completion_length=8,
                               num_sampler_logprobs=3, vllm_server_base_url=handle.url, learning_rate=5e-2,
                               save_strategy="no", logging_steps=1, report_to="none", max_staleness=2,
                               vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0, optim="sgd",
                               max_grad_norm=0.0, beta=0.1, loss_type="bnpo")
        prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}]}
                                              for i in range(16)])
        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[parity_reward, length_reward], args=args,
                                   train_dataset=prompts, peft_config=LoraConfig(
                                       r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        assert trainer.reference.frozen is None  # the base model with adapters disabled: no copy
        assert trainer.train().global_step == 2
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts at the base model (B = 0)
        assert lines[1]["kl"] > 0
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def no_eos_model_dir(tmp_path_factory):
    """A tiny model that never ends a completion: every token embedding gets a large constant first component, so
    the final hidden state's first component is large and positive everywhere, and each stop id's (untied) output
    row reads only that component with a negative weight: P(EOS) below 1e-20 at every position."""
    from asyncgrpo_cli.train.model_loading import eos_token_ids

    path = make_tiny_model(tmp_path_factory.mktemp("tiny_no_eos"))
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = emb.abs().max() * 20
        first = model.model(input_ids=torch.randint(0, len(tok), (16, 30))).last_hidden_state[..., 0]
        assert float(first.min()) > 1.0
        for eos in eos_token_ids(tok, model):
            model.lm_head.weight[eos] = 0.0
            model.lm_head.weight[eos, 0] = -60.0 / float(first.min())
    model.save_pretrained(path)
    return path


def test_every_completion_cut_trains_zero_loss_and_keeps_the_weights(no_eos_model_dir, tmp_path):
    """TRL's all-masked case (test_training_with_mask_truncated_completions_all_masked: lr 0.1, the default AdamW,
    every completion cut): the steps train with loss 0 and every weight stays equal. The steps are trained here:
    each cut completion travels as an untrained stub. The weights stay because the gradient is exactly 0 from the
    first step, so AdamW's moments stay 0, and weight_decay is 0 (after real steps, momentum would move them)."""
    handle = ServerThread(ServerConfig(model=str(no_eos_model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=96, max_logprobs=8)).start()
    try:
        out = tmp_path / "all_cut"
        args = AsyncGRPOConfig(output_dir=str(out), max_steps=2, num_generations=4, max_completion_length=8,
                               num_sampler_logprobs=3, vllm_server_base_url=handle.url, learning_rate=0.1,
                               save_strategy="no", logging_steps=1, report_to="none", max_staleness=2,
                               vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0,
                               mask_truncated_completions=True, loss_type="grpo")
        assert args.optim.startswith("adamw") and args.weight_decay == 0.0
        prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}]}
                                              for i in range(16)])
        before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(no_eos_model_dir).state_dict().items()}
        trainer = AsyncGRPOTrainer(model=str(no_eos_model_dir), reward_funcs=[parity_reward], args=args,
                                   train_dataset=prompts)
        assert trainer.train().global_step == 2
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2]
        assert all(line["completions/masked_truncated_frac"] == 1.0 for line in lines)
        assert all(line["loss"] == 0.0 and line["batch/trained_tokens_per_step"] == 0.0 for line in lines)
        assert all(line["batch/samples_per_step"] > 0 for line in lines)  # the stubs were trained
        after = trainer.model.state_dict()
        changed = [k for k in before if k in after and not torch.equal(after[k].float(), before[k])]
        assert changed == []
    finally:
        handle.stop()
