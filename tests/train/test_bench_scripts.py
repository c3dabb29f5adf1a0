"""The trainer benchmark scripts (scripts/bench/bench_packing.py, bench_mfu.py): FLOP formula, tree-mask pair
count, profiler bucketing, and a CPU run of P3 on the tiny shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import bench_mfu as bm
import bench_packing as bp

from asyncgrpo_cli.train.loss import LossConfig
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import TreeAttentionInputs


@pytest.fixture
def tiny_cpu(tmp_path):
    """bench_packing configured for the tiny shape on the CPU; transformers' attention registry restored after
    (install_markers wraps its entries)."""
    from transformers import AttentionInterface

    from asyncgrpo_cli.train.tree_attention import register_tree_attention

    register_tree_attention()
    saved = dict(AttentionInterface._global_mapping)
    bp.configure("cpu", "tiny")
    yield tmp_path
    AttentionInterface._global_mapping.update(saved)


def test_tree_mask_pairs_counts_the_allowed_pairs_of_the_mask(tiny_cpu):
    samples = bp.make_samples(3, 8, 5, 7, True, seed=4)
    tree = pack_row(TokenBudgetBatcher(10_000, 1).plan(samples)[0].rows[0])
    plain = bp.concat_rows([pack_row([s]) for s in samples[:6]])
    for row in (tree, plain):
        mask = TreeAttentionInputs.from_row(row, "cpu").sdpa_mask()
        assert bm.tree_mask_pairs(row) == int(mask.sum())
    # plain packing: each 12-token sample is causal on its own, 12 * 13 / 2 pairs each
    assert bm.tree_mask_pairs(plain) == 6 * 12 * 13 // 2
    assert tree.num_tokens < 3 * 8 * 12  # the groups' prompts are shared


def test_step_flops_formula():
    params = {"non_embedding": 1000, "layers": 900}
    f = bm.step_flops(params, hidden=8, vocab=50, head_dim=4, heads=2, layers=3, forwarded_tokens=10,
                      trained_tokens=6, mask_pairs=40, checkpointing=True)
    assert f["dense"] == 6 * 1000 * 10
    assert f["lm_head"] == 6 * 8 * 50 * 6
    assert f["attention"] == 3 * 4 * 4 * 2 * 3 * 40
    assert f["model"] == f["dense"] + f["lm_head"] + f["attention"]
    recompute = 2 * 8 * 50 * 6 + 2 * 900 * 10 + 4 * 4 * 2 * 3 * 40
    assert f["hardware"] == f["model"] + recompute
    no_ckpt = bm.step_flops(params, 8, 50, 4, 2, 3, 10, 6, 40, checkpointing=False)
    assert no_ckpt["hardware"] == no_ckpt["model"] + 2 * 8 * 50 * 6


@pytest.mark.parametrize("op,kernel,scope,bucket", [
    ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "model", "matmul_gemm"),
    ("aten::mm", "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "model", "matmul_gemm"),
    ("aten::mm", "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "loss", "logprob_loss"),
    ("aten::exp", "void at::native::vectorized_elementwise_kernel<4, exp>", "loss", "logprob_loss"),
    ("triton_tem_fused_0", "triton_tem_fused_0", "attention", "attention"),
    ("aten::_flash_attention_forward", "void pytorch_flash::flash_fwd_kernel<...>", "model", "attention"),
    ("aten::mul", "void at::native::vectorized_elementwise_kernel<4, mul>", "model", "elementwise_other"),
    ("aten::mm", None, "model", "matmul_gemm"),  # CPU run: no kernel, the op name decides
    ("aten::add", None, "model", "elementwise_other"),
])
def test_bucket_of_kernels(op, kernel, scope, bucket):
    assert bp._bucket(scope, bp._kind(op, kernel)) == bucket


def test_profile_splits_a_packed_step_into_buckets_and_phases(tiny_cpu):
    model, backend = bp.setup_model("tiny")
    assert backend == "sdpa"
    bp.install_markers(model)
    rows = bm.build_rows(16, 57, 384, 1)
    summary = bp.profile_variant(bp.packed_step(model, rows, LossConfig()), "t", tiny_cpu, steps=1)
    b = summary["buckets"]
    assert set(b) == set(bp.BUCKETS)
    assert abs(sum(v["fraction"] for v in b.values()) - 1.0) < 1e-6
    # the loss kernel's backward is found through its autograd node; the loss head is never recomputed
    assert b["logprob_loss"]["forward_ms"] > 0 and b["logprob_loss"]["backward_ms"] > 0
    assert b["logprob_loss"]["recompute_ms"] == 0
    # checkpointing re-runs attention inside the backward
    assert b["attention"]["forward_ms"] > 0 and b["attention"]["recompute_ms"] > 0 and b["attention"]["backward_ms"] > 0
    assert b["matmul_gemm"]["ms_per_step"] > 0
    saved = json.loads((tiny_cpu / "t.json").read_text())
    assert len(saved["key_averages_top40"]) == 40
    assert "logprob_loss" in (tiny_cpu / "t.txt").read_text()
    assert not (tiny_cpu / "t.trace.json").exists()
    assert not bp._MARKERS_ON


def test_p3_runs_on_cpu_and_writes_its_json(tiny_cpu, monkeypatch, capsys):
    out = tiny_cpu / "out"
    monkeypatch.setattr(sys, "argv", ["bench_mfu.py", "--device", "cpu", "--shape", "tiny", "--steps", "1",
                                      "--out", str(out)])
    assert bm.main() == 0
    r = json.loads((out / "P3_tiny.json").read_text())
    assert r["target_id"] == "P3" and r["activation_checkpointing"] is True and r["rows"] == 2
    assert r["row_tokens"] == [384, 384]
    expected = bm.step_flops(r["parameters"], r["hidden"], r["vocab"], r["head_dim"], r["query_heads"], r["layers"],
                             r["forwarded_tokens"], r["trained_tokens"], r["tree_mask_pairs"], True)
    assert r["flops_per_step"] == expected
    assert r["mfu"] == pytest.approx(expected["model"] / r["step_s"] / r["matmul_peak_flops"])
    assert r["trained_tokens"] == 2 * 2 * 8 * 16
    assert "P3" in capsys.readouterr().out


def test_completion_spread_and_padded_token_count():
    import random

    lengths = bp.completion_lengths(random.Random(0), 1000, 100, 0.5)
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 50
    assert bp.completion_lengths(random.Random(0), 3, 100, 0.0) == [100, 100, 100]
    samples = bp.make_samples(2, 4, 10, 5, True, seed=0, spread=0.5)
    assert {s.num_trained_tokens for s in samples} != {10}
    longest = [max(len(s.input_ids) for s in samples[i:i + 4]) for i in (0, 4)]
    assert bp.padded_tokens(samples, 4) == 4 * sum(longest)


def test_results_table_names_ours_anchor_and_unmeasured_memory():
    results = {
        "P1": {"tree_trained_tokens_per_s": 2000.0, "plain_trained_tokens_per_s": 800.0, "ratio": 2.5, "target": ">= 3.2"},
        "P4": {"tree_trained_tokens_per_s": 2000.0, "padded_trained_tokens_per_s": 500.0, "ratio": 4.0, "target": ">= 4"},
        "M1": {"tree_peak_bytes": None, "plain_peak_bytes": None, "ratio": None, "target": "<= 1.2"},
    }
    lines = bp.results_table(results).splitlines()
    assert lines[1].split() == ["P1", "2000", "tok/s", "800", "tok/s", "2.50", ">=", "3.2"]
    assert "500 tok/s" in lines[2] and "4.00" in lines[2]
    assert "n/a (CPU)" in lines[3] and lines[3].split()[-3] == "n/a"  # not measured is not a pass
    results["M1"].update(tree_peak_bytes=3 * 2**30, plain_peak_bytes=2 * 2**30, ratio=1.5)
    assert "3.00 GiB" in bp.results_table(results).splitlines()[3]


def test_cuda_default_without_a_gpu_says_how_to_check_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cpu --shape tiny"):
        bp.configure("cuda", "qwen3-0.6b")
    bp.configure("cpu", "tiny")
