"""scripts/bench/bench_gdn.py: its CPU self-check on the tiny shape writes a complete JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import bench_gdn as bg


def test_cpu_self_check_writes_versions_and_figures(tmp_path, capsys):
    assert bg.main(["--device", "cpu", "--shape", "tiny", "--steps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "GDN_tiny.json").read_text())
    for key in ("torch", "triton", "fla-core", "tilelang", "transformers", "date", "device", "gdn_kernel"):
        assert key in result
    assert result["gdn_kernel"] == "torch"
    assert result["workload"]["activation_checkpointing"] is True  # as the trainer (an H100 OOM'd without it)
    assert 3.0 < result["packing_ratio"] < 3.5  # 8 rollouts, prompt 4 × completion
    assert result["forwarded_tokens"]["plain"] > 3 * result["forwarded_tokens"]["tree"]
    assert result["loss"]["tree"] == pytest.approx(result["loss"]["plain"], rel=1e-4, abs=1e-4)
    assert result["trained_tokens_per_s"]["tree"] > 0 and "speedup" in result
    assert "wrote" in capsys.readouterr().out


def test_the_kernel_refusal_is_recorded(tmp_path, monkeypatch):
    from asyncgrpo_cli.train.gated_deltanet import GatedDeltaNetUnavailable

    def refuse(*args, **kwargs):
        raise GatedDeltaNetUnavailable("fla-core's chunk_gated_delta_rule cannot train on this machine (...)")

    monkeypatch.setattr(bg, "apply_tree_attention", refuse)
    assert bg.main(["--device", "cpu", "--shape", "tiny", "--out", str(tmp_path)]) == 3
    assert "cannot train" in json.loads((tmp_path / "GDN_tiny.json").read_text())["error"]


def test_cuda_default_without_a_gpu_says_how_to_check_on_cpu(monkeypatch):
    monkeypatch.setattr(bg.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cpu --shape tiny"):
        bg.main(["--out", "/nonexistent"])
