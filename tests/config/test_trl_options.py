"""TRL's option names on both sides of the config (issue #35): one-sided importance-sampling bounds, TRL's
``scale_rewards`` / ``multi_objective_aggregation``, TRL's GSPO warning, and what ``config --doc`` says about the
differences from TRL that stay (advantage std, importance-sampling defaults)."""

from __future__ import annotations

import pytest

from asyncgrpo_cli.config.compose import compose, to_training_args
from asyncgrpo_cli.config.docs import field_docs
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
from asyncgrpo_cli.config.loss_rules import loss_warnings
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.config.schema import LossConfig as LossGroup, RolloutConfig
from asyncgrpo_cli.train.loss import LossConfig


def _args(tmp_path, **kw):
    return AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", **kw)


@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, None), (None, None)])
def test_one_sided_bounds_through_the_api(tmp_path, bounds):
    cmin, cmax = bounds
    args = _args(tmp_path, vllm_importance_sampling_clip_min=cmin, vllm_importance_sampling_clip_max=cmax)
    cfg = LossConfig.from_args(args)
    assert (cfg.clip_min, cfg.clip_max) == bounds


@pytest.mark.parametrize("bounds", [("null", "3.0"), ("0.5", "null")])
def test_one_sided_bounds_through_the_cli(bounds):
    cfg = compose(["+recipe=deepmath", "trainer.output_dir=/tmp/agrpo-trl-options",
                   f"loss.vllm_importance_sampling_clip_min={bounds[0]}",
                   f"loss.vllm_importance_sampling_clip_max={bounds[1]}", "loss.score_centering=false",
                   "loss.vllm_importance_sampling_mode=sequence_truncate"])
    args = to_training_args(cfg)
    loss = LossConfig.from_args(args)
    assert loss.clip_min == (None if bounds[0] == "null" else 0.5)
    assert loss.clip_max == (None if bounds[1] == "null" else 3.0)


def test_bad_bounds_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode.*both null.*clip_max=3.0"):
        _args(tmp_path, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=None,
              vllm_importance_sampling_clip_max=None)
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_max=0.0: must be > 0, or None"):
        _args(tmp_path, vllm_importance_sampling_clip_max=0.0)
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_min=4.0: needs clip_min <"):
        _args(tmp_path, vllm_importance_sampling_clip_min=4.0, vllm_importance_sampling_clip_max=3.0)
    with pytest.raises(ConfigError, match=r"loss\.vllm_importance_sampling_mode.*loss\.vllm_importance_sampling_clip_max=3\.0"):
        compose(["loss.vllm_importance_sampling_mode=token_truncate", "loss.vllm_importance_sampling_clip_min=null",
                 "loss.vllm_importance_sampling_clip_max=null"])
    with pytest.raises(ValueError, match="both bounds are None"):
        LossConfig(is_mode="sequence_truncate", score_centering=False, clip_min=None, clip_max=None)


def test_scale_rewards_values(tmp_path):
    assert _args(tmp_path).scale_rewards == "group"
    assert _args(tmp_path, scale_rewards="none").scale_rewards == "none"
    assert _args(tmp_path, scale_rewards=False).scale_rewards == "none"  # TRL's spelling
    assert _args(tmp_path, scale_rewards=True).scale_rewards == "group"
    assert to_training_args(compose(["+recipe=deepmath", "trainer.output_dir=/tmp/agrpo-trl-options",
                                     "rollout.scale_rewards=none"])).scale_rewards == "none"
    for typed, name in (("true", "group"), ("false", "none"), ("True", "group"), ("FALSE", "none")):
        # TRL's spelling through the CLI too (Hydra hands the string field 'True' / 'False')
        assert to_training_args(compose(["+recipe=deepmath", "trainer.output_dir=/tmp/agrpo-trl-options",
                                         f"rollout.scale_rewards={typed}"])).scale_rewards == name
    with pytest.raises(ConfigError, match="scale_rewards='batch': .*generation batch.*Fix: set scale_rewards=group"):
        _args(tmp_path, scale_rewards="batch")
    with pytest.raises(ConfigError, match=r"rollout\.scale_rewards='batch'"):
        compose(["rollout.scale_rewards=batch"])
    with pytest.raises(ConfigError, match="scale_rewards='grp': must be group"):
        _args(tmp_path, scale_rewards="grp")


def test_multi_objective_aggregation_values(tmp_path):
    assert _args(tmp_path).multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(ConfigError, match="multi_objective_aggregation='normalize_then_sum': .*generation batch"):
        _args(tmp_path, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ConfigError, match=r"rollout\.multi_objective_aggregation='mean'"):
        compose(["rollout.multi_objective_aggregation=mean"])


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "dr_grpo", "cispo", "grpo"])
def test_gspo_with_a_summing_loss_warns_as_trl(loss_type):
    warned = loss_warnings({"importance_sampling_level": "sequence", "loss_type": loss_type},
                           lambda n: f"loss.{n}")
    if loss_type == "grpo":
        assert warned == []
    else:
        assert len(warned) == 1 and f"loss.loss_type={loss_type}" in warned[0] and "loss.loss_type=grpo" in warned[0]
    assert loss_warnings({"importance_sampling_level": "token", "loss_type": loss_type}) == []


def test_gspo_warning_reaches_the_api(tmp_path):
    import datasets

    from asyncgrpo_cli.config.run_checks import validate_trainer_inputs
    from asyncgrpo_cli.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    args = _args(tmp_path / "out", score_centering=False, importance_sampling_level="sequence", loss_type="dr_grpo")
    prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    warned = validate_trainer_inputs(str(model), [_reward], args, prompts)
    assert any("importance_sampling_level=sequence with loss_type=dr_grpo" in w for w in warned)


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


def test_config_doc_states_the_differences_from_trl():
    loss, rollout = field_docs(LossGroup), field_docs(RolloutConfig)
    mode = " ".join(loss["vllm_importance_sampling_mode"].split())
    assert "TRL's defaults differ: ``sequence_mask`` with C_max = 3.0 and no C_min" in mode
    assert "[0.5, 5.0]" in mode
    scale = " ".join(rollout["scale_rewards"].split())
    assert "Bessel-corrected std + 1e-4" in scale and "sqrt((n-1)/n)" in scale and "population std" in scale
    assert "null = no lower bound" in " ".join(loss["vllm_importance_sampling_clip_min"].split())


def test_the_checks_build_the_training_arguments_without_a_cuda_context(tmp_path, monkeypatch):
    """The supervisor's own build of the arguments (`check_training_args_build`) must not set up a CUDA device:
    on the H100 it held a 518 MiB context for the whole run beside vLLM and the trainer (seventeenth session).
    On a CUDA machine it builds with ``use_cpu=True``; the trainer's own build (no flag) keeps the device."""
    import torch

    import asyncgrpo_cli.config.grpo_config as grpo_config
    from asyncgrpo_cli.config.run_checks import check_training_args_build

    built = []
    real = grpo_config.AsyncGRPOConfig

    def spy(**kwargs):
        built.append(kwargs.get("use_cpu"))
        return real(**{**kwargs, "use_cpu": True})  # this machine has no GPU: keep the build itself on the CPU

    monkeypatch.setattr(grpo_config, "AsyncGRPOConfig", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = compose(["+recipe=smoke", f"trainer.output_dir={tmp_path / 'run'}"])
    check_training_args_build(cfg)
    to_training_args(cfg)
    assert built == [True, cfg.trainer.get("use_cpu")]
