"""The launch plan shows the KL reference's memory (``loss.beta`` > 0, issue #27): a frozen copy of the weights
with full fine-tuning (in the one-GPU split too), nothing with LoRA."""

from __future__ import annotations

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.server.colocate import GiB, ModelShape, plan_memory, reference_copy_bytes
from asyncgrpo_cli.launch.plan import build_launch_plan
from asyncgrpo_cli.testing import make_tiny_model


def _cfg(tmp_path, *overrides):
    return compose([f"model.name={tmp_path / 'tiny'}", f"trainer.output_dir={tmp_path}/run", *overrides])


def test_plan_notes_the_reference_copy(tmp_path):
    make_tiny_model(tmp_path / "tiny")
    assert not any("reference" in n for n in build_launch_plan(_cfg(tmp_path), gpu_count=2).gpus.notes)
    notes = build_launch_plan(_cfg(tmp_path, "loss.beta=0.01"), gpu_count=2).gpus.notes
    assert any("frozen reference copy" in n and "GiB" in n for n in notes), notes
    lora = build_launch_plan(_cfg(tmp_path, "loss.beta=0.01", "peft.enabled=true"), gpu_count=2).gpus.notes
    assert any("adapters disabled" in n for n in lora) and not any("frozen" in n for n in lora)


def test_one_gpu_split_counts_the_reference():
    shape = ModelShape(parameters=600_000_000, hidden_size=1024, num_layers=28, num_kv_heads=8, head_dim=128,
                       vocab_size=151936)
    common = dict(configured=None, dtype="bfloat16", token_budget=8192, max_model_len=4096, max_concurrent=64,
                  activation_checkpointing=True)
    plain = plan_memory(140 * GiB, shape, lora=False, **common)
    with_ref = plan_memory(140 * GiB, shape, lora=False, reference=True, **common)
    extra = with_ref.trainer_need_bytes - plain.trainer_need_bytes
    assert reference_copy_bytes(shape, "bfloat16") == 1_200_000_000
    assert 1_200_000_000 <= extra <= 1.3 * 1_200_000_000  # the copy, times the estimate's margin
    assert any("frozen reference copy" in n for n in with_ref.notes) and not plain.notes
    lora = plan_memory(140 * GiB, shape, lora=True, **common)
    assert plan_memory(140 * GiB, shape, lora=True, reference=True, **common).trainer_need_bytes == lora.trainer_need_bytes
