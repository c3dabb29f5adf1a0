"""Composition, overrides and compose-time validation (issue: foundation; CONFIG.md, SPEC §16)."""

import pytest

from asyncgrpo_cli.config.compose import compose, list_recipes, to_training_args, to_yaml
from asyncgrpo_cli.config.rules import ConfigError, ConfigTypeError
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig


def test_defaults_follow_spec():
    cfg = compose([])
    assert cfg.rollout.num_generations == 8 and cfg.rollout.max_completion_length == 2048
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0 and cfg.rollout.top_k == 0
    assert cfg.rollout.min_p is None and cfg.rollout.repetition_penalty == 1.0
    assert cfg.rollout.num_sampler_logprobs == 8
    assert cfg.loss.score_centering is True and cfg.loss.epsilon == 0.2 and cfg.loss.epsilon_high is None
    assert (cfg.loss.vllm_importance_sampling_clip_min, cfg.loss.vllm_importance_sampling_clip_max) == (0.5, 5.0)
    assert (cfg.staleness.max_staleness, cfg.staleness.weight_sync_steps) == (4, 1)
    assert (cfg.staleness.max_concurrent_rollouts, cfg.staleness.rollout_worker_timeout) == (512, 300.0)
    assert cfg.packing.token_budget is None and cfg.packing.attention.value == "auto"
    assert cfg.sampler.backend.value == "vllm" and cfg.sampler.api_server_count == 8 and cfg.sampler.timeout == 1800.0
    assert (cfg.peft.enabled, cfg.peft.r, cfg.peft.lora_alpha, cfg.peft.target_modules) == (False, 16, 32, "all-linear")
    assert cfg.model.dtype.value == "float32"
    t = cfg.trainer
    assert t.logging_steps == 1 and t.learning_rate == 1e-6
    assert t.lr_scheduler_type == "constant" and t.ignore_data_skip is True and t.remove_unused_columns is False
    assert t.bf16 is None


def test_every_async_field_reaches_training_args():
    from asyncgrpo_cli.config.grpo_config import ASYNC_GRPO_FIELDS

    args = to_training_args(compose(["+recipe=deepmath", "trainer.output_dir=/tmp/agrpo-test"]))
    assert isinstance(args, AsyncGRPOConfig)
    defaults = AsyncGRPOConfig(output_dir="/tmp/agrpo-test")
    for name in ASYNC_GRPO_FIELDS:
        if name == "vllm_server_base_url":
            continue
        assert getattr(args, name) == getattr(defaults, name), name
    assert args.vllm_server_base_url == "http://127.0.0.1:8000"


OVERRIDES = {
    "model.name": ("some/model", lambda c: c.model.name),
    "model.dtype": ("bfloat16", lambda c: c.model.dtype.value),
    "rollout.num_generations": (16, lambda c: c.rollout.num_generations),
    "rollout.max_completion_length": (512, lambda c: c.rollout.max_completion_length),
    "rollout.temperature": (0.7, lambda c: c.rollout.temperature),
    "rollout.top_p": (0.95, lambda c: c.rollout.top_p),
    "rollout.top_k": (512, lambda c: c.rollout.top_k),
    "rollout.min_p": (0.05, lambda c: c.rollout.min_p),
    "rollout.num_sampler_logprobs": (4, lambda c: c.rollout.num_sampler_logprobs),
    "staleness.max_staleness": (2, lambda c: c.staleness.max_staleness),
    "staleness.weight_sync_steps": (3, lambda c: c.staleness.weight_sync_steps),
    "staleness.max_concurrent_rollouts": (64, lambda c: c.staleness.max_concurrent_rollouts),
    "packing.token_budget": (8192, lambda c: c.packing.token_budget),
    "sampler.backend": ("embedded", lambda c: c.sampler.backend.value),
    "sampler.url": ("http://10.0.0.1:9000", lambda c: c.sampler.url),
    "sampler.max_model_len": (2048, lambda c: c.sampler.max_model_len),
    "sampler.api_server_count": (4, lambda c: c.sampler.api_server_count),
    "peft.enabled": (True, lambda c: c.peft.enabled),
    "peft.r": (64, lambda c: c.peft.r),
    "peft.lora_alpha": (128, lambda c: c.peft.lora_alpha),
    "peft.target_modules": ("[q_proj,v_proj]", lambda c: list(c.peft.target_modules)),
    "trainer.learning_rate": (3e-6, lambda c: c.trainer.learning_rate),
    "trainer.output_dir": ("/tmp/run", lambda c: c.trainer.output_dir),
    "trainer.max_steps": (100, lambda c: c.trainer.max_steps),
    "launch.server_gpus": ("[0]", lambda c: list(c.launch.server_gpus)),
    "launch.trainer_gpus": ("[1,2]", lambda c: list(c.launch.trainer_gpus)),
}


def test_override_paths():
    args = [f"{k}={v}" for k, (v, _) in OVERRIDES.items()]
    cfg = compose(["+recipe=deepmath", *args])
    expected = {"peft.target_modules": ["q_proj", "v_proj"], "launch.server_gpus": [0], "launch.trainer_gpus": [1, 2]}
    for key, (value, read) in OVERRIDES.items():
        assert read(cfg) == expected.get(key, value), key
    args_obj = to_training_args(cfg)
    assert args_obj.top_k == 512 and args_obj.max_staleness == 2 and args_obj.vllm_server_base_url == "http://10.0.0.1:9000"


def test_recipes_compose_and_override_order():
    deepmath = compose(["+recipe=deepmath"])
    assert deepmath.model.name == "Qwen/Qwen3.5-2B"
    assert deepmath.data.name == "trl-lib/DeepMath-103K" and deepmath.data.split == "train"
    assert [r.func for r in deepmath.rewards] == ["asyncgrpo_cli.rewards:accuracy_reward"]
    assert deepmath.sampler.max_model_len == 4096
    smoke = compose(["+recipe=smoke"])
    assert smoke.sampler.backend.value == "embedded"
    # A command-line override wins over the recipe.
    assert compose(["+recipe=deepmath", "sampler.max_model_len=1024"]).sampler.max_model_len == 1024
    assert {r.name for r in list_recipes()} >= {"deepmath", "smoke"}
    assert all(r.description for r in list_recipes())


def test_user_recipe_dir(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "# description: my own recipe\n# @package _global_\nmodel:\n  name: me/my-model\nrollout:\n  num_generations: 4\n")
    cfg = compose(["+recipe=mine"], extra_recipe_dirs=[tmp_path])
    assert cfg.model.name == "me/my-model" and cfg.rollout.num_generations == 4
    assert "mine" in {r.name for r in list_recipes([tmp_path])}


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.top_p=0.9"], "rollout.top_k"),
    (["rollout.min_p=0.1"], "rollout.top_k"),
    (["rollout.top_p=1.5", "rollout.top_k=5"], "rollout.top_p"),
    (["rollout.num_generations=1"], "rollout.num_generations=1"),
    (["staleness.max_staleness=-1"], "staleness.max_staleness=-1"),
    (["peft.enabled=true", "peft.r=600"], "peft.r=600"),
    (["rollout.num_sampler_logprobs=0"], "rollout.num_sampler_logprobs=0"),
    (["launch.server_gpus=[0]", "launch.trainer_gpus=[0,1]"], "launch.trainer_gpus"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["sampler.backend=external"], "sampler.url"),
    (["loss.vllm_importance_sampling_clip_min=6"], "loss.vllm_importance_sampling_clip_min"),
])
def test_validation_names_key_value_and_fix(overrides, needle):
    with pytest.raises(ConfigError) as info:
        compose(["+recipe=deepmath", *overrides])
    msg = str(info.value)
    assert needle in msg and "Fix:" in msg


def test_clipped_objective_allows_zero_logprobs():
    cfg = compose(["rollout.num_sampler_logprobs=0", "loss.score_centering=false"])
    assert cfg.rollout.num_sampler_logprobs == 0


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.foo=1"], "foo"),
    (["rollout.top_k=abc"], "rollout.top_k"),
    (["sampler.backend=bogus"], "bogus"),
    (["+recipe=does_not_exist"], "deepmath"),
    (["+recipe=smok"], "+recipe=smok: there is no such recipe. Fix: did you mean +recipe=smoke?"),
    (["trainer.not_a_training_arg=1"], "not_a_training_arg"),
])
def test_hydra_errors_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert needle in str(info.value)


def test_config_yaml_round_trips():
    text = to_yaml(compose(["+recipe=deepmath"]))
    assert "max_model_len: 4096" in text and "backend: vllm" in text and "name: Qwen/Qwen3.5-2B" in text


def test_python_api_validates_too():
    with pytest.raises(ConfigError, match="top_k"):
        AsyncGRPOConfig(output_dir="/tmp/x", top_p=0.9)
    args = AsyncGRPOConfig(output_dir="/tmp/x", remove_unused_columns=False, ignore_data_skip=False)
    assert args.ignore_data_skip is True  # forced (SPEC §12)
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True  # SPEC §16.4
    assert AsyncGRPOConfig(output_dir="/tmp/x", activation_checkpointing=False).gradient_checkpointing is False
    assert args.learning_rate == 1e-6 and args.logging_steps == 1 and args.lr_scheduler_type == "constant"


def test_list_override_of_a_group_sets_the_list():
    """README documents the list form: rewards=[...] / tools=[...] set the list (issue 25: it was refused)."""
    assert [r.func for r in compose(["rewards=[{func: 'x:y'}]"]).rewards] == ["x:y"]
    assert list(compose(["tools=[a.b:c,d.e:f]"]).tools) == ["a.b:c", "d.e:f"]
    with pytest.raises(ConfigError, match="quote the whole override"):
        compose(["rewards=[{fnc: 'x:y'}]"])


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean rollout.num_generations"):
        compose(["rollout.num_generation=4"])
    with pytest.raises(ConfigError, match=r"^unknown key 'model.nme' \(given 'foo'\): .* did you mean model.name"):
        compose(["model.nme=foo"])  # the key, the value and the fix (the tenth session's trial)
    for override in ("trainer.hub_tokn=hf_secret1", "+trainer.hub_tokn=hf_secret1", "+trainer.api_key=hf_secret1"):
        with pytest.raises(ConfigError) as info:  # a mistyped token key: named, its value never shown
            compose([override])
        assert "(given '***')" in str(info.value) and "hf_secret1" not in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.num_generation' \(given '3'\)"):
        compose(["+rollout.num_generation=3"])
    with pytest.raises(ConfigError, match="did you mean rollout"):
        compose(["rollot.top_k=4"])


@pytest.mark.parametrize("override, suggestion, not_suggested", [
    ("rollouts.x=1", "did you mean rollout?", "loss"),                      # the nearest group, by full path
    ("rollouts.top_k=3", "did you mean rollout.top_k", "loss"),             # the same key under that group
    ("+rollout.num_generation=3", "did you mean rollout.num_generations", "loss"),  # `+` adds nothing unread
    ("+rollouts.x=1", "did you mean rollout?", "loss"),
    ("rollout.xx=1", "every key of the rollout group", "did you mean"),     # nothing near: no guess
])
def test_unknown_key_suggests_the_nearest_real_key_by_path(override, suggestion, not_suggested):
    with pytest.raises(ConfigError) as info:
        compose([override])
    assert suggestion in str(info.value) and not_suggested not in str(info.value), str(info.value)


@pytest.mark.parametrize("override, expected", [
    ("rollout.num_generations=abc", "field rollout.num_generations: value 'abc' is not an integer (Rollouts per "
                                    "prompt (G)). Fix: rollout.num_generations=8 (its default)"),
    ("rollout.temperature=hot", "field rollout.temperature: value 'hot' is not a number (Sampling temperature). Fix: "
                                "rollout.temperature="),
    ("rollout.top_k=abc", "field rollout.top_k: value 'abc' is not an integer (Top-k filter; 0 disables it). Fix: "
                          "rollout.top_k=0 (its default)"),  # what 0 means (a trial)
    ("trainer.bf16=maybe", "field trainer.bf16: value 'maybe' is not true or false"),
    ("sampler.backend=foo", "field sampler.backend: value 'foo' is not one of vllm, embedded, external. Fix: "
                            "sampler.backend=vllm or"),
    ("launch.server_gpus=abc", "field launch.server_gpus: value 'abc' is not a list"),
    # null for a key that takes a value (a trial: OmegaConf's "is not Optional" text, no fix)
    ("sampler.hang_timeout=null", "field sampler.hang_timeout: value null is not a number. Fix: "
                                  "sampler.hang_timeout=120.0 (its default)"),
    ("rollout.num_generations=null", "field rollout.num_generations: value null is not an integer"),
])
def test_a_value_of_the_wrong_type_names_field_value_type_and_fix(override, expected):
    with pytest.raises(ConfigError) as info:
        compose([override])
    text = str(info.value)
    assert text.startswith(expected), text
    assert "full_key" not in text and "object_type" not in text and "reference_type" not in text


def test_the_fix_for_a_wrong_type_shows_the_recipes_value():
    with pytest.raises(ConfigError) as info:
        compose(["+recipe=smoke", "trainer.learning_rate=abc"])
    assert "Fix: trainer.learning_rate=3e-05 (its value without this override)" in str(info.value)


def test_public_sampler_host_needs_allow_public():
    from asyncgrpo_cli.config.compose import public_host_warning

    with pytest.raises(ConfigError, match=r"sampler.host=0.0.0.0 is not a loopback.*sampler.allow_public=true"):
        compose(["model.name=x", "sampler.host=0.0.0.0"])
    assert "anyone who can reach" in public_host_warning(
        compose(["model.name=x", "sampler.host=0.0.0.0", "sampler.allow_public=true"]))
    assert public_host_warning(compose(["model.name=x", "sampler.host=localhost"])) is None


def test_a_mapping_field_set_whole_on_the_command_line_replaces_the_mapping():
    """``sampler.env={MY_VAR:1}`` was refused as "unknown key 'sampler.env.MY_VAR'" (Hydra merged it into the
    struct node); ``data.task_kwargs={...}`` likewise. The value replaces the mapping; entries set after it
    apply in order."""
    cfg = compose(["+recipe=smoke", "sampler.env={MY_VAR:1}", "data.task_kwargs={min_terms:3,max_terms:3}"])
    assert dict(cfg.sampler.env) == {"MY_VAR": "1"}
    assert dict(cfg.data.task_kwargs) == {"min_terms": 3, "max_terms": 3}  # the recipe's other entries are gone
    cfg = compose(["+recipe=smoke", "sampler.env={A:1,B:2}", "+sampler.env.C=3", "~sampler.env.A",
                   "sampler.env.B=5"])
    assert dict(cfg.sampler.env) == {"B": "5", "C": "3"}
    assert dict(compose(["+recipe=smoke", "+sampler.env.X=1", "sampler.env={Y:2}"]).sampler.env) == {"Y": "2"}


def test_a_mapping_value_that_does_not_fit_names_the_key_and_both_forms():
    with pytest.raises(ConfigError) as err:
        compose(["+recipe=smoke", "sampler.env={A:{b:1}}"])
    assert "sampler.env" in str(err.value) and "+sampler.env.NAME=value" in str(err.value)
    with pytest.raises(ConfigError) as err:  # the secret rail sees the mapping form too, and hides the value
        compose(["+recipe=smoke", "sampler.env={HF_TOKEN:hf_abcdefghijklmnopqrstuvwxyz012345}"])
    assert "HF_TOKEN" in str(err.value) and "hf_abcdefghijklmnopqrstuvwxyz012345" not in str(err.value)


def test_the_smoke_recipe_does_not_tighten_the_staleness_limit():
    """Issue #45, the first hour: the first recipe a newcomer runs set staleness.max_staleness=2; its allowance held
    generation back (trainer idle 63-88% of a step) and a step's plain line read "dropped stale 4 (69% of generated
    tokens)". With the default 4 the same CPU job dropped nothing and took 2m56s instead of 4m16s."""
    default = compose([]).staleness.max_staleness
    assert default == 4
    assert compose(["+recipe=smoke"]).staleness.max_staleness >= default


@pytest.mark.parametrize("override", ["rollout.group_requests=2", "trainer.bf16=yes", "peft.enabled=on",
                                      "logging.log_completions=1"])
def test_a_true_false_field_takes_only_true_or_false(override):
    """Issue #45's trial: OmegaConf read 2, yes, on and 1 as true, so a typo in a switch passed unnoticed."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"field {key}: value '.*' is not true or false.* Fix: {key}="):
        compose([override], validate=False)
    assert compose(["rollout.group_requests=False", "launch.colocate=null"], validate=False).rollout.group_requests is False


def test_an_entry_set_after_the_whole_reward_list_is_applied_after_it():
    """Issue #45's trial: rewards.0.probe=false after rewards=[...] was silently overwritten by the list."""
    cfg = compose(["rewards=[asyncgrpo_cli.rewards:accuracy_reward]", "rewards.0.probe=false"], validate=False)
    assert cfg.rewards[0].probe is False and cfg.rewards[0].func == "asyncgrpo_cli.rewards:accuracy_reward"
    with pytest.raises(ConfigError, match="rewards has 1 entries"):
        compose(["rewards=[asyncgrpo_cli.rewards:accuracy_reward]", "rewards.2.probe=false"], validate=False)


@pytest.mark.parametrize("item, message", [("probe: maybe", r"rewards\[0\]\.probe: 'maybe' is not true or false"),
                                           ("kwargs: 3", r"rewards\[0\]\.kwargs: 3 is not a mapping")])
def test_a_wrong_field_inside_the_reward_list_is_named(item, message):
    """Issue #45's trial: probe: maybe was reported as list syntax ('quote the whole override')."""
    with pytest.raises(ConfigError, match=message) as info:
        compose([f"rewards=[{{func: 'x:y', {item}}}]"], validate=False)
    assert "quote" not in str(info.value)


def test_max_groups_per_step_is_a_multiple_of_the_micro_batches_of_a_step():
    """Fresh-user trial: with gradient_accumulation_steps=2 a bound of 1 put 1 group in each micro-batch, 2 a step."""
    with pytest.raises(ConfigError, match=r"packing.max_groups_per_step=3: must be a multiple of "
                                          r"trainer.gradient_accumulation_steps \(= 2\).*Fix: set packing.max_groups_per_step=2"):
        compose(["+recipe=smoke", "packing.max_groups_per_step=3", "trainer.gradient_accumulation_steps=2"])
    assert compose(["+recipe=smoke", "packing.max_groups_per_step=4",
                    "trainer.gradient_accumulation_steps=2"]).packing.max_groups_per_step == 4


def test_the_python_api_names_none_and_a_concrete_value_in_its_fixes(tmp_path):
    """Fresh-user trial: AsyncGRPOConfig's errors said null (the CLI's YAML) and 'pass max_groups_per_step=a int'."""
    with pytest.raises(ConfigError, match=r"or None for no bound.*Fix: set max_groups_per_step=None, or a count"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_groups_per_step=0)
    with pytest.raises(ConfigTypeError, match=r"Fix: pass max_groups_per_step=2$"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_groups_per_step=2.0)
    with pytest.raises(ConfigTypeError, match=r"Fix: pass max_groups_per_step as an int$"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_groups_per_step=1.5)
    with pytest.raises(ConfigTypeError, match=r"Fix: pass num_generations=8$"):
        AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=1.5)


@pytest.mark.parametrize("value", ["2", "on", "no"])
def test_a_true_false_field_inside_the_reward_list_takes_only_true_or_false(value):
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.probe: .* is not true or false"):
        compose([f"rewards=[{{func: 'x:y', probe: {value}}}]"], validate=False)
