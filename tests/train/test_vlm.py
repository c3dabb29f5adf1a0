"""Vision-language checkpoints train text-only (SPEC §14): tower frozen, skipped by the weight sync, images refused."""

from __future__ import annotations

import pytest

from asyncgrpo_cli.config.multimodal import ImagesUnsupported, check_text_only, image_part
from asyncgrpo_cli.train.model_loading import freeze_outside_text_model
from asyncgrpo_cli.train.weight_sync import WeightSync
from asyncgrpo_cli.train.weight_sync.params import FullWeightSource

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5_vl"])
def vlm_dir(request, tmp_path_factory):
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param, num_layers=4)


def _sent_names(model):
    return [m.name for m in WeightSync(model, mode="full").source.metadata()]


def test_weight_sync_skips_the_frozen_tower(vlm_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    everything = [m.name for m in FullWeightSource(model).metadata()]
    assert any(".visual." in n for n in everything)  # the tower is there to skip
    frozen = freeze_outside_text_model(model)
    assert frozen > 0
    sent = _sent_names(model)
    assert sent and not any(".visual." in n for n in sent)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".visual." not in n for n in trainable)
    assert len(sent) == len(everything) - sum(".visual." in n for n in everything)


def test_a_model_passed_directly_is_frozen_like_a_loaded_one(vlm_dir, tmp_path):
    """AsyncGRPOTrainer(model=<PreTrainedModel>) freezes outside the text model, as load_policy does."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText

    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.train.model_loading import load_policy
    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, dtype="float32")
    loaded = load_policy(str(vlm_dir), args)
    direct = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}]}])
    trainer = AsyncGRPOTrainer(direct, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=args, train_dataset=data)
    want = {n for n, p in loaded.named_parameters() if p.requires_grad}
    have = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert have == want and not any(".visual." in n for n in have)


def test_image_prompts_are_refused(tmp_path):
    text = [{"role": "user", "content": "what is 2+2?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image", "url": "x"}]}]
    assert image_part(text) is None
    assert image_part([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) is None
    assert image_part(parts) == "message 0 content part 1 is of type 'image'"
    assert image_part([{"role": "user", "content": "hi", "images": ["a.png"]}]) == "message 0 has an 'images' field"
    check_text_only([text, text])
    with pytest.raises(ImagesUnsupported, match=r"train_dataset row 1: .*Images are not supported \(SPEC §14\)"):
        check_text_only([text, parts])

    from datasets import Dataset

    from asyncgrpo_cli.testing import make_tiny_model
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    text_parts = [{"role": "user", "content": [{"type": "text", "text": "what is 2+2?"}]}]
    data = Dataset.from_list([{"prompt": text_parts}, {"prompt": parts}])  # arrow adds None-valued keys
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    with pytest.raises(ImagesUnsupported, match="row 1"):
        AsyncGRPOTrainer(str(make_tiny_model(tmp_path / "m")), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                         args=args, train_dataset=data)


def test_cli_data_refuses_image_prompts():
    from asyncgrpo_cli.config.rules import ConfigError
    from asyncgrpo_cli.data import _as_messages

    with pytest.raises(ConfigError, match="images are not supported"):
        _as_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], None)
