"""Evaluation end to end on CPU (issue #27 item 6, README "Evaluation"): 3 steps against the embedded sampler
with eval_strategy=steps, eval_steps=2 and a small eval set; eval/* lands in metrics.jsonl once per round (the
round of step 2 during training, the final round of step 3 at the end), the training counts are unchanged."""

from __future__ import annotations

import json

import datasets
import pytest

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model


def parity_reward(completion_ids, **kwargs):
    return [float(bool(ids) and ids[0] % 2 == ids[-1] % 2) for ids in completion_ids]


def target_reward(completion_ids, target, **kwargs):
    """Needs the eval set's ``target`` column: 1.0 when the first token id is ``target`` modulo 2."""
    return [float(bool(ids) and ids[0] % 2 == int(t)) for ids, t in zip(completion_ids, target)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_eval"))
    handle = ServerThread(ServerConfig(model=str(path), port=0, device="cpu", dtype="float32",
                                       max_model_len=96, max_logprobs=8)).start()
    yield path, handle
    handle.stop()


def test_eval_rounds_are_logged(server, tmp_path):
    path, handle = server
    out = tmp_path / "run"
    args = AsyncGRPOConfig(output_dir=str(out), max_steps=3, num_generations=4, max_completion_length=6,
                           num_sampler_logprobs=3, vllm_server_base_url=handle.url, learning_rate=1e-3,
                           save_strategy="no", logging_steps=1, report_to="none", max_staleness=2,
                           vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0,
                           eval_strategy="steps", eval_steps=2)
    rows = [{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}], "target": i % 2} for i in range(16)]
    evals = [{"prompt": [{"role": "user", "content": f"what is {i} minus 1?"}], "target": i % 2} for i in range(5)]
    trainer = AsyncGRPOTrainer(model=str(path), reward_funcs=[parity_reward, target_reward], args=args,
                               train_dataset=datasets.Dataset.from_list(rows),
                               eval_dataset=datasets.Dataset.from_list(evals))
    assert trainer.evaluation.schedule.eval_steps == 2
    assert trainer.train().global_step == 3
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [line for line in lines if "eval/reward" in line]
    assert [(r["event"], r["step"], r["eval/step"]) for r in rounds] == [("eval", 2, 2), ("eval", 3, 3)]
    for r in rounds:
        assert r["eval/num_completions"] == 5 and r["eval/num_scored"] == 5
        assert 0.0 <= r["eval/pass_rate"] <= 1.0
        parity, target = r["eval/rewards/parity_reward/mean"], r["eval/rewards/target_reward/mean"]
        assert r["eval/reward"] == pytest.approx(parity + target)
    training = [line for line in lines if "event" not in line]
    assert [line["step"] for line in training] == [1, 2, 3] and not any("eval/reward" in line for line in training)
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
