"""``trainer.activation_checkpointing_kwargs`` as transformers' Trainer reads it (`train.checkpointing`): every
layer or every N-th checkpoints, the same gradients whichever do (tree-packed rows, the trainer's loss), the
older transformers without ``every_n_layers`` choosing the same layers, and the refusals (config and start)."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.config.checkpointing_rules import checkpointing_options
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.train.checkpointing import checkpointed_layers, enable_activation_checkpointing

from test_compile import groups, rows_of, step, tiny_policy


def _flags(model) -> list[bool]:
    return [bool(layer.gradient_checkpointing) for layer in model.model.layers]


def test_every_n_layers_checkpoints_every_nth_layer_and_keeps_the_gradients():
    rows = rows_of(groups(3, 17, [6, 2, 9]))
    reference = tiny_policy(layers=4)  # every layer checkpoints (the helper enables it)
    assert checkpointed_layers(reference) == (4, 4)
    expected = step(reference, rows)
    for kwargs, flags in ((None, [True] * 4), ({"every_n_layers": 2}, [True, False, True, False]),
                          ('{"every_n_layers": 3}', [True, False, False, True]),
                          ({"every_n_layers": 9}, [True, False, False, False]),
                          ({"every_n_layers": 2, "use_reentrant": True}, [True, False, True, False])):
        model = tiny_policy(layers=4)
        on = enable_activation_checkpointing(model, kwargs)
        assert _flags(model) == flags and on == (sum(flags), 4), kwargs
        for (loss, grads), (want_loss, want_grads) in zip(step(model, rows), expected):
            assert loss == pytest.approx(want_loss, abs=1e-6)
            for name, grad in grads.items():
                assert torch.allclose(grad, want_grads[name], atol=1e-6), (kwargs, name)


def test_an_older_transformers_without_every_n_layers_gets_the_same_layers_and_refuses_offload():
    model = tiny_policy(layers=4)
    calls = []

    def old_enable(activation_checkpointing_kwargs=None):  # transformers before every_n_layers
        calls.append(activation_checkpointing_kwargs)
        for layer in model.model.layers:
            layer.gradient_checkpointing = True

    model.activation_checkpointing_enable = old_enable
    assert enable_activation_checkpointing(model, {"every_n_layers": 2, "preserve_rng_state": False}) == (2, 4)
    assert _flags(model) == [True, False, True, False]
    assert calls == [{"preserve_rng_state": False, "use_reentrant": False}]  # the rest reaches torch's checkpoint
    with pytest.raises(ConfigError, match=r"offload=true: transformers .* cannot offload"):
        enable_activation_checkpointing(model, {"offload": True})


@pytest.mark.parametrize("kwargs,match", [
    ({"every_n_layers": 0}, r"every_n_layers=0: must be a whole number >= 1"),
    ({"every_n_layers": 1.5}, r"every_n_layers=1.5"),
    ({"offload": "yes"}, r"offload='yes': must be true or false"),
    ("[1, 2]", r"must be a mapping"),
    ({"every_n_layer": 2}, r"every_n_layer=2: not a key .* Fix: did you mean every_n_layers\?"),  # the trial's typo
])
def test_bad_options_are_refused_with_the_key_and_the_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        checkpointing_options(kwargs)


def test_the_options_split_as_transformers_splits_them():
    assert checkpointing_options(None) == (1, False, {"use_reentrant": False})
    assert checkpointing_options({"every_n_layers": 2, "offload": True, "preserve_rng_state": False}) == \
        (2, True, {"preserve_rng_state": False, "use_reentrant": False})


def test_the_config_refuses_options_that_would_do_nothing_or_break(tmp_path):
    from asyncgrpo_cli import AsyncGRPOConfig

    with pytest.raises(ConfigError, match=r"activation_checkpointing_kwargs=\{'every_n_layers': 2\}: has no effect: "
                                          r"activation_checkpointing is false in this config"):
        AsyncGRPOConfig(output_dir=str(tmp_path), activation_checkpointing=False,
                        activation_checkpointing_kwargs={"every_n_layers": 2})
    with pytest.raises(ConfigError, match=r"every_n_layers=0"):
        AsyncGRPOConfig(output_dir=str(tmp_path), gradient_checkpointing_kwargs={"every_n_layers": 0})
    with pytest.raises(ConfigError) as info:  # off and a bad value: one problem naming both (two trials asked for
        AsyncGRPOConfig(output_dir=str(tmp_path), activation_checkpointing=False,  # one line, then for the value)
                        activation_checkpointing_kwargs={"every_n_layers": 0})
    text = str(info.value)
    assert "problems" not in text and "every_n_layers=0: must be a whole number >= 1" in text, text
    assert "It would also have no effect: activation_checkpointing is false" in text, text
    args = AsyncGRPOConfig(output_dir=str(tmp_path), activation_checkpointing_kwargs={"every_n_layers": 2})
    assert args.activation_checkpointing and args.activation_checkpointing_kwargs == {"every_n_layers": 2}


def test_the_memory_plan_counts_the_layers_that_keep_their_activations():
    from asyncgrpo_cli.server.colocate import TRAINER_MARGIN, ModelShape, trainer_need_bytes

    shape = ModelShape(parameters=2_000_000_000, num_layers=28, hidden_size=2048, num_kv_heads=8, head_dim=128,
                       vocab_size=151_936)
    need = {every: trainer_need_bytes(shape, dtype="float32", token_budget=16384, activation_checkpointing=True,
                                      lora=False, checkpoint_every=every) for every in (1, 2, 28)}
    off = trainer_need_bytes(shape, dtype="float32", token_budget=16384, activation_checkpointing=False, lora=False)
    assert need[1] < need[2] < need[28] < off + 16384 * 2048 * 34 * 2  # 28: one layer checkpoints
    layer = 16384 * 2048 * 30  # a layer that keeps its activations instead of its input
    assert need[2] - need[1] == pytest.approx(TRAINER_MARGIN * 14 * layer, rel=1e-6)  # 14 of 28 keep theirs


def test_how_the_trainer_group_checkpoints_unset_is_on_as_the_trainer_resolves_it():
    """One reading for the plan's run row and the one-GPU memory split; the split read an unset
    ``activation_checkpointing`` (the deepmath recipe's) as off and sized the trainer for full activations."""
    from asyncgrpo_cli.config.checkpointing_rules import checkpoint_every

    assert checkpoint_every({}) == 1
    assert checkpoint_every({"activation_checkpointing": None, "gradient_checkpointing": False}) == 0
    assert checkpoint_every({"activation_checkpointing": False}) == 0
    assert checkpoint_every({"activation_checkpointing_kwargs": {"every_n_layers": 3}}) == 3
    assert checkpoint_every({"gradient_checkpointing_kwargs": '{"every_n_layers": 2}'}) == 2
    assert checkpoint_every({"activation_checkpointing_kwargs": {"every_n_layers": 0}}) == 1  # refused elsewhere


def test_the_memory_split_sizes_the_trainer_for_the_checkpointing_it_will_run():
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.server.colocate import decide_layout

    def trainer_need(*overrides):
        cfg = compose(["+recipe=arith_vllm_1gpu", *overrides])
        parts = {k: cfg[k] for k in ("launch", "sampler", "model", "trainer", "packing", "staleness", "peft", "loss")}
        return decide_layout(1, 80 * 2**30, **parts).memory.trainer_need_bytes

    unset, on, off = (trainer_need(f"trainer.activation_checkpointing={v}") for v in ("null", "true", "false"))
    every2 = trainer_need("trainer.activation_checkpointing=true",
                          "trainer.activation_checkpointing_kwargs={every_n_layers: 2}")
    assert unset == on < every2 < off


def test_the_old_names_reach_the_trainer_on_a_transformers_that_has_only_them():
    """transformers 5.17 (the H200 image's) has only ``gradient_checkpointing(_kwargs)``: ``AsyncGRPOConfig``
    declares both spellings and resolves them itself, so the trainer's reads of the new names never fail (the
    first GPU run of issue #42 died on ``args.activation_checkpointing_kwargs``) and ``gradient_checkpointing=True``
    is not silently dropped. `_resolve_checkpointing_aliases` is run on bare objects with 5.17's defaults."""
    from types import SimpleNamespace

    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig, _resolve_checkpointing_aliases

    def resolved(**given):
        args = SimpleNamespace(**{"gradient_checkpointing": None, "activation_checkpointing": None,
                                  "gradient_checkpointing_kwargs": None, "activation_checkpointing_kwargs": None,
                                  **given})
        _resolve_checkpointing_aliases(args)
        return (args.activation_checkpointing, args.activation_checkpointing_kwargs, args.gradient_checkpointing,
                args.gradient_checkpointing_kwargs)

    assert resolved() == (True, None, True, None)  # SPEC §16.4: on unless asked off
    assert resolved(gradient_checkpointing=False) == (False, None, False, None)
    assert resolved(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2}) == (
        True, {"every_n_layers": 2}, True, {"every_n_layers": 2})
    assert resolved(activation_checkpointing=False, gradient_checkpointing=True) == (False, None, False, None)
    own = AsyncGRPOConfig.__dict__["__annotations__"]  # declared here, whatever TrainingArguments holds
    assert {"activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing",
            "gradient_checkpointing_kwargs"} <= set(own)
    args = AsyncGRPOConfig(output_dir="unused", use_cpu=True, gradient_checkpointing_kwargs={"every_n_layers": 3})
    assert args.activation_checkpointing is True and args.activation_checkpointing_kwargs == {"every_n_layers": 3}


def test_the_fixes_are_overrides_that_compose():
    """The trial copied `Fix: trainer.activation_checkpointing_kwargs.every_n_layers=2` and got an unknown key: a
    dotted key into a mapping the user gave is no override. The fixes set the whole mapping, and it composes."""
    from asyncgrpo_cli.config.compose import compose

    key = "trainer.activation_checkpointing_kwargs"
    for bad, fix in (({"every_n_layers": 0}, f"{key}={{every_n_layers: 2}}"), ({"offload": "yes"},
                                                                               f"{key}={{offload: true}}")):
        with pytest.raises(ConfigError) as info:
            checkpointing_options(bad, key)
        assert f"Fix: {fix}" in str(info.value), str(info.value)
        cfg = compose(["+recipe=smoke", "trainer.activation_checkpointing=true", fix])
        assert checkpointing_options(cfg.trainer.activation_checkpointing_kwargs, key)[:2] in ((2, False), (1, True))
