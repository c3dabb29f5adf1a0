"""AsyncGRPOTrainer end to end on CPU against the embedded sampler: tree-packed steps, weight sync into the
server, metrics files, checkpoints with the rollout position, and resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.run.state import load_rollout_state


def token_parity_reward(completion_ids, **kwargs):
    """Picklable reward with spread inside groups (random for a random model)."""
    return [float(bool(ids) and ids[0] % 2 == ids[-1] % 2) for ids in completion_ids]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def server(model_dir):
    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=96, max_logprobs=8)).start()
    yield handle
    handle.stop()


def prompts(n=12):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}],
                                        "answer": str(i + 3)} for i in range(n)])


def args_for(out: Path, url: str, **kw) -> AsyncGRPOConfig:
    base = dict(output_dir=str(out), max_steps=3, num_generations=4, max_completion_length=8, num_sampler_logprobs=3,
                vllm_server_base_url=url, learning_rate=1e-2, save_steps=2, logging_steps=1, report_to="none",
                max_staleness=2, vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0,
                optim="sgd", max_grad_norm=0.0)
    base.update(kw)
    return AsyncGRPOConfig(**base)


def server_sample(url: str, model: str, prompt_ids) -> tuple[list[int], list[float]]:
    """Sample 6 tokens at temperature 1: their ids and the server's (processed) log-probs."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": 6, "logprobs": 0, "temperature": 1.0, "seed": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def model_logprobs(model, prompt_ids, continuation) -> list[float]:
    ids = torch.tensor([prompt_ids + continuation])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    start = len(prompt_ids) - 1
    return [float(lp[start + i, t]) for i, t in enumerate(continuation)]


def test_train_syncs_checkpoints_and_resumes(model_dir, server, tmp_path):
    out = tmp_path / "run"
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                               args=args_for(out, server.url), train_dataset=prompts())
    result = trainer.train()
    assert result.global_step == 3 and trainer.model_version == 3

    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
    for key in ("loss", "reward", "entropy", "batch/packing_ratio", "batch/samples_per_row", "perf/weight_sync_s",
                "perf/step_s", "perf/fwd_bwd_forwarded_tokens_per_s", "sample/staleness_mean",
                "sampling/sampling_logp_difference/mean", "rollout/generated_tokens_per_s", "num_tokens"):
        assert any(key in l for l in lines), key
    assert all(l["batch/packing_ratio"] > 1.0 for l in lines)  # the prompt is shared inside each group
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 3 and status["model_version"] == 3

    # The server samples with the trained weights: its log-probs equal the trainer's model's.
    first = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt_ids = [1, 10, 20, 30, 40]
    continuation, served = server_sample(server.url, str(model_dir), prompt_ids)
    trained = model_logprobs(trainer.model, prompt_ids, continuation)
    initial = model_logprobs(first, prompt_ids, continuation)
    assert max(abs(a - b) for a, b in zip(served, trained)) < 1e-3
    assert max(abs(a - b) for a, b in zip(trained, initial)) > 1e-3

    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "rollout_state.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    position = load_rollout_state(checkpoint)
    assert position >= 1

    resumed = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                               args=args_for(out, server.url, max_steps=4), train_dataset=prompts())
    result = resumed.train(resume_from_checkpoint=str(checkpoint))
    assert result.global_step == 4
    assert resumed.position.value >= position  # fast-forwarded, never restarted at 0
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines][-2:] == [3, 4]


def test_epoch_based_stop(model_dir, server, tmp_path, capsys):
    """With max_steps unset, training ends after num_train_epochs passes over the prompts (SPEC §16.4). The
    console gets one plain line per logging step, as `asyncgrpo train` prints it, not a dict of every metric."""
    out = tmp_path / "epochs"
    args = args_for(out, server.url, max_steps=-1, num_train_epochs=1, save_strategy="no")
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward], args=args,
                               train_dataset=prompts(6))
    result = trainer.train()
    assert result.global_step >= 1
    assert trainer.position.value == 6  # exactly one pass: every prompt of epoch 0 trained or dropped
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished"
    from asyncgrpo_cli.run.state import final_model_step

    assert (out / "model.safetensors").is_file() and final_model_step(out) == result.global_step  # the step it holds
    printed = capsys.readouterr().out
    assert "step 1 | reward " in printed and "| stale " in printed, printed[-3000:]
    assert re.search(r"\| train \S+ tok/s \(\d+ groups\) \| step ", printed), printed[-3000:]  # the groups it trained
    assert "'loss'" not in printed and "{'" not in printed, printed[-3000:]  # the dict stays in metrics.jsonl


def checkpoint_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / name))


class ProbingTrainer(AsyncGRPOTrainer):
    """Samples from the server right after the rollouts were set up (before any training step)."""

    def _setup_rollouts(self, start_position, resumed=False):
        super()._setup_rollouts(start_position, resumed=resumed)
        url, name, expected, base = self.probe
        prompt_ids = [1, 10, 20, 30, 40]
        continuation, served = server_sample(url, name, prompt_ids)
        self.served_at_start = (served, model_logprobs(expected, prompt_ids, continuation),
                                model_logprobs(base, prompt_ids, continuation))


def test_resume_restores_weights_tokens_and_position(model_dir, server, tmp_path):
    """Resume loads the checkpoint's weights (not the base model's), continues num_tokens, trains nothing when
    max_steps is already reached, and the server samples with the restored weights before the first step."""
    out = tmp_path / "run"
    first = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                             args=args_for(out, server.url, max_steps=2), train_dataset=prompts())
    first.train()
    checkpoint = out / "checkpoint-2"
    saved = checkpoint_tensors(checkpoint, "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (saved[name] - base.state_dict()[name]).abs().max() > 1e-4  # training moved it
    tokens = json.loads((checkpoint / "rollout_state.json").read_text())["num_tokens"]
    assert tokens > 0
    # Another server state: the base weights. Resuming with max_steps=2 from checkpoint-2 trains nothing.
    again = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                             args=args_for(out, server.url, max_steps=2), train_dataset=prompts())
    result = again.train(resume_from_checkpoint=True)
    assert result.global_step == 2 and not (out / "checkpoint-3").exists()
    for key, value in saved.items():
        assert torch.equal(again.model.state_dict()[key], value), key  # restored exactly, not the base model
    # max_steps=3 against a fresh server (base weights): the resumed run pushes the checkpoint's weights before
    # generating, trains step 3, and num_tokens continues.
    fresh = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                      max_model_len=96, max_logprobs=8)).start()
    try:
        resumed = ProbingTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                                 args=args_for(out, fresh.url, max_steps=3), train_dataset=prompts())
        resumed.probe = (fresh.url, str(model_dir), AutoModelForCausalLM.from_pretrained(checkpoint), base)
        resumed.train(resume_from_checkpoint=str(checkpoint))
    finally:
        fresh.stop()
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 3 and lines[-1]["num_tokens"] > tokens
    # A running total that continues the checkpoint's: the saved count plus step 3's forwarded tokens.
    assert lines[-1]["num_tokens"] == tokens + lines[-1]["batch/forwarded_tokens_per_step"]
    # The first resumed step was sampled from the restored weights: the sampler/trainer log-prob gap stays small.
    gap = "sampling/sampling_logp_difference/mean"
    assert abs(lines[-1][gap]) < 0.05, lines[-1][gap]
    # Before its first generation the server sampled with the checkpoint's weights, not the base model's.
    served, expected, initial = resumed.served_at_start
    assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-3
    assert max(abs(a - b) for a, b in zip(served, initial)) > 1e-3


def test_resume_refuses_an_incomplete_checkpoint(model_dir, server, tmp_path):
    from asyncgrpo_cli.train.checkpoint import CheckpointError

    out = tmp_path / "run"
    AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                     args=args_for(out, server.url, max_steps=2, save_steps=1), train_dataset=prompts()).train()
    (out / "checkpoint-2" / "rollout_state.json").write_text("{not json")
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                               args=args_for(out, server.url, max_steps=3), train_dataset=prompts())
    with pytest.raises(CheckpointError, match=r"rollout_state.json is corrupt.*checkpoint-1 \(the newest complete"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert not (out / ".asyncgrpo.lock").exists()  # released on the error path


def test_lora_resume_republishes_the_adapter(model_dir, tmp_path):
    from peft import LoraConfig

    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=96, max_logprobs=8, enable_lora=True, max_lora_rank=8,
                                       max_loras=4)).start()
    try:
        out = tmp_path / "lora"
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                         args=args_for(out, handle.url, max_steps=2), train_dataset=prompts(),
                         peft_config=lora).train()
        saved = checkpoint_tensors(out / "checkpoint-2", "adapter_model.safetensors")
        resumed = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                                   args=args_for(out, handle.url, max_steps=3), train_dataset=prompts(),
                                   peft_config=lora)
        result = resumed.train(resume_from_checkpoint=True)  # was: HTTP 404 "policy-v2 does not exist"
        assert result.global_step == 3
        served = [m["id"] for m in httpx.get(f"{handle.url}/v1/models", timeout=30).json()["data"]]
        assert any(m.startswith("policy-r") and m.endswith("-v3") for m in served), served
        assert (out / "checkpoint-3").is_dir() and saved
    finally:
        handle.stop()


class FullDiskTrainer(AsyncGRPOTrainer):
    """The second save hits ENOSPC half-way (after the weights, before the optimizer)."""

    def _save_optimizer_and_scheduler(self, output_dir):
        import errno

        if self.state.global_step >= 2:
            raise OSError(errno.ENOSPC, "No space left on device", output_dir)
        return super()._save_optimizer_and_scheduler(output_dir)


def test_disk_full_while_saving_keeps_the_last_checkpoint(model_dir, server, tmp_path):
    from asyncgrpo_cli.train.checkpoint import CheckpointError, checkpoint_problem

    out = tmp_path / "run"
    trainer = FullDiskTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                              args=args_for(out, server.url, max_steps=3, save_steps=1), train_dataset=prompts())
    with pytest.raises(CheckpointError, match=r"checkpoint-2 .*No space left.*checkpoint-1 is untouched.*Fix: free"):
        trainer.train()
    assert checkpoint_problem(out / "checkpoint-1") is None
    assert not (out / "checkpoint-2").exists() and not list(out.glob(".checkpoint-*"))
    status = json.loads((out / "status.json").read_text())
    assert status["state"].startswith("failed: CheckpointError") and status["step"] == 2
    assert status["last_error"].endswith("no checkpoint written: the checkpoint write itself failed; "
                                         "checkpoint-1 holds the last saved step")


def stream_rows():
    for i in range(40):
        yield {"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}], "answer": str(i + 3)}


def test_iterable_dataset_trains_and_resumes_from_its_first_prompt(model_dir, server, tmp_path, capsys):
    """An IterableDataset trains (no len()), and on resume restarts from its first prompt (SPEC §12)."""
    out = tmp_path / "stream"
    stream = datasets.IterableDataset.from_generator(stream_rows)
    AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward], args=args_for(out, server.url, max_steps=2),
                     train_dataset=stream).train()
    assert json.loads((out / "checkpoint-2" / "rollout_state.json").read_text())["num_prompts"] is None
    resumed = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                               args=args_for(out, server.url, max_steps=3), train_dataset=stream)
    result = resumed.train(resume_from_checkpoint=True)
    assert result.global_step == 3
    assert "prompt position 0 (IterableDataset: restarts from its first prompt" in capsys.readouterr().out
    with pytest.raises(ValueError, match="IterableDataset .* max_steps=-1.*Fix: set max_steps"):
        AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                         args=args_for(out, server.url, max_steps=-1), train_dataset=stream)


def test_on_policy_trains_every_sample_at_its_own_version(model_dir, server, tmp_path):
    # issue #33: at max_staleness=0 each step is one round of generation at the current weights, trained whole
    # (as many micro-batches as it needs), then synced; nothing is dropped stale, every sample has staleness 0.
    out = tmp_path / "on_policy"
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[token_parity_reward],
                               args=args_for(out, server.url, max_staleness=0, max_steps=4, token_budget=96),
                               train_dataset=prompts(40))
    result = trainer.train()
    assert result.global_step == 4 and trainer.model_version == 4
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 4]
    assert all(l["sample/staleness_max"] == 0 for l in lines)
    assert sum(l.get("sample/dropped_stale_count", 0) for l in lines) == 0
    assert all(l["batch/samples_per_step"] >= 1 for l in lines)
    assert sum(l.get("rollout/on_policy_round_count", 0) for l in lines) >= 3  # one round per version
