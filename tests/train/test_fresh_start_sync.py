"""A fresh (not resumed) run pushes its weights to the server before the first request (model version 0).

The server here holds perturbed weights, as an external server left by an earlier run would. Without the push,
step 1 was sampled from those weights and trained off-policy at staleness 0 (sampler/trainer log-prob gap
several times an in-step run's); with it, step 1's gap is at the level of a run against an unperturbed server.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.sampler.client import SyncSamplerClient
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.train.weight_sync import WeightSync, make_weight_sync

GAP = "sampling/sampling_logp_difference/mean"


def token_parity_reward(completion_ids, **kwargs):
    return [float(bool(ids) and ids[0] % 2 == ids[-1] % 2) for ids in completion_ids]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def start_server(model_dir):
    return ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                     max_model_len=96, max_logprobs=8)).start()


def perturb_server(url: str, model_dir, out) -> None:
    """Push weights other than the base model's into the server, as an earlier run's last sync would."""
    other = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    client = SyncSamplerClient(url, timeout_s=60.0)
    backend = make_weight_sync(client, output_dir=out)
    sync = WeightSync(other, backend)
    sync.init()
    sync.sync(7)
    sync.close()


def server_version(url: str) -> str | None:
    return httpx.get(f"{url}/weight_info", timeout=30).json().get("weight_version")


class VersionAtStart(AsyncGRPOTrainer):
    """Reads the server's weight version once the rollouts are set up (the worker has just started)."""

    def _setup_rollouts(self, start_position, resumed=False):
        super()._setup_rollouts(start_position, resumed=resumed)
        self.version_at_start = server_version(self.args.vllm_server_base_url)


def step_one_gap(model_dir, url, out) -> tuple[float, str | None]:
    args = AsyncGRPOConfig(output_dir=str(out), max_steps=1, num_generations=4, max_completion_length=8,
                           num_sampler_logprobs=3, vllm_server_base_url=url, learning_rate=1e-2, save_strategy="no",
                           logging_steps=1, report_to="none", max_staleness=2, vllm_server_timeout=120.0,
                           rollout_worker_timeout=120.0, seed=0, optim="sgd", max_grad_norm=0.0)
    import datasets

    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}]}
                                       for i in range(8)])
    trainer = VersionAtStart(model=str(model_dir), reward_funcs=[token_parity_reward], args=args, train_dataset=rows)
    trainer.train()
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["sample/staleness_mean"] == 0
    return float(line[GAP]), trainer.version_at_start


def test_fresh_run_pushes_its_weights_before_the_first_request(model_dir, tmp_path):
    server = start_server(model_dir)
    try:
        in_step, _ = step_one_gap(model_dir, server.url, tmp_path / "in-step")
    finally:
        server.stop()
    server = start_server(model_dir)
    try:
        perturb_server(server.url, model_dir, tmp_path / "earlier-run")
        assert server_version(server.url) == "7"
        gap, at_start = step_one_gap(model_dir, server.url, tmp_path / "fresh")
        assert at_start == "0"  # its own weights, as model version 0, before the first request
        assert server_version(server.url) == "1"  # then version 1 after its step
    finally:
        server.stop()
    assert gap <= 2 * in_step + 0.01, (gap, in_step)
