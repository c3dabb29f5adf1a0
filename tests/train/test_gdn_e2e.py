"""The reference recipe end to end on CPU: `asyncgrpo train +recipe=deepmath` on a tiny random Qwen3.5-shaped
vision-language checkpoint (Gated DeltaNet hybrid) with the embedded sampler and a DeepMath-like data file.

A random model never gets a DeepMath answer right, so a test-only recipe layered after ``deepmath`` adds a reward
with spread (the first token's parity); everything else is the deepmath recipe plus the CPU overrides below.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from asyncgrpo_cli.testing import make_tiny_model

DATA = Path(__file__).resolve().parents[1] / "data" / "deepmath_tiny"
CPU_OVERRIDES = (
    "sampler.backend=embedded", "sampler.device=cpu", "sampler.max_model_len=160", "model.dtype=float32",
    "trainer.bf16=false", "trainer.activation_checkpointing=false", "rollout.num_generations=4",
    "rollout.max_completion_length=12", "rollout.num_sampler_logprobs=3", "staleness.max_concurrent_rollouts=16",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def asyncgrpo(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "asyncgrpo_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **popen)


SPREAD = """# description: test layer over deepmath: a reward with spread for a random model
# @package _global_
rewards:
  - func: asyncgrpo_cli.rewards:accuracy_reward
  - func: tests.test_main_job:first_token_parity
"""


def test_deepmath_recipe_on_a_tiny_qwen35_vlm(tmp_path):
    model = make_tiny_model(tmp_path / "qwen3_5_vl", family="qwen3_5_vl", num_layers=4)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "spread.yaml").write_text(SPREAD)
    out = tmp_path / "run"
    proc = asyncgrpo("train", "--recipes-dir", str(recipes), "+recipe=[deepmath,spread]", f"model.name={model}",
                     f"data.name={DATA}", *CPU_OVERRIDES, f"sampler.port={free_port()}", "trainer.max_steps=2",
                     f"trainer.output_dir={out}", "logging.dashboard=plain", cwd=Path(__file__).resolve().parents[2])
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout
    assert "step 2/2" in stdout
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2]
    # the sampler generated through the GDN layers' recurrent cache, the trainer forwarded tree-packed rows:
    # they agree on the sampled tokens' log-probs (the first step's policy is the sampler's)
    assert lines[0]["batch/packing_ratio"] > 1.5
    assert lines[0]["sampling/sampling_logp_difference/mean"] < 1e-4
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
