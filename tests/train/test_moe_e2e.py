"""MoE end to end on CPU: `asyncgrpo train` on a tiny random Qwen3-MoE (4 experts, top-2, router_aux_loss_coef
0.01) with the embedded sampler, 3 steps, a weight sync after every step. The sampler's transformers model holds
fused experts and the trainer sends per-expert checkpoint names; each sync used to fail at the first step with
HTTP 400 "'model.layers.0.mlp.experts.0.down_proj.weight' is not a parameter"."""

from __future__ import annotations

import json
from pathlib import Path

from test_gdn_e2e import CPU_OVERRIDES, DATA, SPREAD, asyncgrpo, free_port

from asyncgrpo_cli.testing import make_tiny_model


def test_tiny_qwen3_moe_trains_with_a_sync_every_step(tmp_path):
    model = make_tiny_model(tmp_path / "qwen3_moe", family="qwen3_moe")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "spread.yaml").write_text(SPREAD)
    out = tmp_path / "run"
    proc = asyncgrpo("train", "--recipes-dir", str(recipes), "+recipe=[deepmath,spread]", f"model.name={model}",
                     f"data.name={DATA}", *CPU_OVERRIDES, f"sampler.port={free_port()}", "trainer.max_steps=3",
                     "staleness.weight_sync_steps=1", "trainer.save_strategy=no", f"trainer.output_dir={out}",
                     "logging.dashboard=plain", cwd=Path(__file__).resolve().parents[2])
    stdout, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
    for line in lines:
        assert line["aux_loss"] > 0  # the load-balancing loss of the router, before router_aux_loss_coef
        assert line["perf/weight_sync_s"] > 0  # one sync per step
    # Step 1 was sampled from the trainer's own weights (pushed as model version 0 before the first request).
    assert lines[0]["sampling/sampling_logp_difference/mean"] < 1e-4
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished" and status["model_version"] == 3
