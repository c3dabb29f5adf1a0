"""A table of wrong inputs as a user types them (CLI overrides, recipes, datasets, rewards, Python API), issue #19.

Every case must fail before anything starts, in bounded time, with exit code 2 (CLI) or a TypeError/ValueError
subclass carrying the key (API), naming the key, printing a fix and no traceback. The CLI cases run in-process
(typer's CliRunner) with the launcher replaced by a tripwire, so no server or trainer can start; a few run as
real subprocesses at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pytest
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.rules import ConfigError, ConfigTypeError
from asyncgrpo_cli.testing import make_tiny_model

FAIL_WITHIN_S = 60.0  # generous: a loaded 2-core machine; an in-process case takes well under a second idle
runner = CliRunner()

REWARDS_MODULE = '''
def good_reward(completions, answer, **kwargs):
    return [float(len(str(c)) % 2) for c in completions]

def needs_gold(completions, gold, **kwargs):
    return [0.0 for _ in completions]

def no_kwargs(completions, answer):
    return [0.0 for _ in completions]

NOT_CALLABLE = 3

def raising_reward(completions, answer, **kwargs):
    return [float(a) / 0 for a in answer]

def text_reward(completions, **kwargs):
    return ["right" for _ in completions]

async def async_text_reward(completions, **kwargs):
    return [None, 0.5, 1.0]

def paid_judge(completions, **kwargs):
    raise RuntimeError("the judge would charge for this call")

paid_judge.probe_at_start = False
'''


def _free_port() -> int:
    """A port nothing listens on (train refuses a busy sampler.port before anything else)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, data files, a rewards module on sys.path and a recipes folder with a good base recipe."""
    root = tmp_path_factory.mktemp("bad_inputs")
    model = make_tiny_model(root / "model")
    bare = root / "no_template"
    bare.mkdir()
    (bare / "config.json").write_text((model / "config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (root / "empty_folder").mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "answer": str(2 * i)} for i in range(6)]
    (root / "good.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (root / "text.jsonl").write_text("\n".join(json.dumps({"question": f"{i}+1?", "answer": "x"}) for i in range(3)))
    (root / "ints.jsonl").write_text("\n".join(json.dumps({"prompt": i, "answer": "x"}) for i in range(3)))
    (root / "empty.jsonl").write_text("")
    (root / "empty_data").mkdir()
    (root / "empty_data" / "train.jsonl").write_text("")
    (root / "blank.jsonl").write_text("\n\n")
    long_rows = rows[:3] + [{"prompt": [{"role": "user", "content": " ".join(["seven"] * 150)}], "answer": "7"}]
    (root / "long.jsonl").write_text("\n".join(json.dumps(r) for r in long_rows) + "\n")
    (root / "no_answer.jsonl").write_text("\n".join(json.dumps({"prompt": r["prompt"], "gold": "x"}) for r in rows))
    (root / "rewards_mod").mkdir()
    (root / "rewards_mod" / "badrewards.py").write_text(REWARDS_MODULE)
    sys.path.insert(0, str(root / "rewards_mod"))
    recipes = root / "recipes"
    recipes.mkdir()
    base = {
        "model": {"name": str(model), "gguf_file": None},
        "data": {"name": str(root / "good.jsonl"), "generator": None},
        "rewards": [{"func": "badrewards:good_reward"}],
        "rollout": {"num_generations": 4, "max_completion_length": 32, "num_sampler_logprobs": 4},
        "sampler": {"backend": "embedded", "device": "cpu", "max_model_len": 256, "port": _free_port()},
        "trainer": {"output_dir": str(root / "out"), "max_steps": 2},
    }
    import yaml

    (recipes / "good.yaml").write_text("# @package _global_\n" + yaml.safe_dump(base))

    def variant(name, **groups):
        cfg = json.loads(json.dumps(base))
        for k, v in groups.items():
            cfg[k] = v
        (recipes / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(cfg))

    variant("typo_func", rewards=[{"func": "badrewards:good_rewrd"}])
    variant("typo_module", rewards=[{"func": "asyncgrpo_cli.reward:accuracy_reward"}])
    variant("hub_reward", rewards=[{"func": "OpenAssistant/reward-model-deberta"}])
    variant("missing_column", rewards=[{"func": "badrewards:needs_gold"}])
    variant("no_kwargs", rewards=[{"func": "badrewards:no_kwargs"}])
    variant("not_callable", rewards=[{"func": "badrewards:NOT_CALLABLE"}])
    variant("accuracy", rewards=[{"func": "asyncgrpo_cli.rewards:accuracy_reward"}])
    variant("bad_kwargs", rewards=[{"func": "badrewards:no_kwargs", "kwargs": {"tolerance": 0.1}}])
    variant("raising_reward", rewards=[{"func": "badrewards:raising_reward"}])
    variant("text_reward", rewards=[{"func": "badrewards:good_reward"}, {"func": "badrewards:text_reward"}])
    variant("async_text_reward", rewards=[{"func": "badrewards:async_text_reward"}])
    variant("raising_reward_unprobed", rewards=[{"func": "badrewards:raising_reward", "probe": False}])
    variant("paid_judge", rewards=[{"func": "badrewards:paid_judge"}])
    (recipes / "broken.yaml").write_text("# @package _global_\nrollout:\n  num_generations: 4\n   top_k: 8\n")
    yield {"root": root, "model": model, "recipes": recipes}
    sys.path.remove(str(root / "rewards_mod"))


@pytest.fixture
def tripwire(monkeypatch):
    """Replace the launcher: a config error must never reach it."""
    import asyncgrpo_cli.launch.supervisor as supervisor

    started = []

    def run_train(cfg, dry_run=False, **kw):
        started.append(cfg)
        return 0

    monkeypatch.setattr(supervisor, "run_train", run_train)
    return started


def _cli(world, args):
    argv = ["train", "--recipes-dir", str(world["recipes"]), *args]
    start = time.monotonic()
    result = runner.invoke(app, argv)
    return result, time.monotonic() - start


def test_the_good_base_passes(world, tripwire):
    result, _ = _cli(world, ["+recipe=good"])
    assert result.exit_code == 0, result.output
    assert len(tripwire) == 1


R = "+recipe=good"
UNSHIPPED = re.compile(r"SPEC|DESIGN\.md|CONFIG\.md|VLLM\.md|\bB\.\d+")  # documents that do not ship


CLI_CASES = [
    # (id, overrides, key named, extra text expected)
    ("ga_zero", [R, "trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps", ""),
    ("lr_negative", [R, "trainer.learning_rate=-1e-5"], "trainer.learning_rate", ""),
    ("completion_over_max_len", [R, "rollout.max_completion_length=300"], "rollout.max_completion_length",
     "HTTP 400"),
    ("completion_over_model_len", [R, "sampler.max_model_len=null", "rollout.max_completion_length=4096"],
     "rollout.max_completion_length", "max_position_embeddings"),
    ("one_generation", [R, "rollout.num_generations=1"], "rollout.num_generations", ""),
    ("generations_not_int", [R, "rollout.num_generations=abc"], "rollout.num_generations", ""),
    ("temperature_zero", [R, "rollout.temperature=0"], "rollout.temperature", ""),
    ("top_p_without_top_k", [R, "rollout.top_p=0.9"], "rollout.top_p", "rollout.top_k"),
    ("top_p_above_one", [R, "rollout.top_p=1.5"], "rollout.top_p", ""),
    ("top_k_negative", [R, "rollout.top_k=-1"], "rollout.top_k", ""),
    ("min_p_above_one", [R, "rollout.min_p=2", "rollout.top_k=8"], "rollout.min_p", ""),
    ("repetition_penalty_zero", [R, "rollout.repetition_penalty=0"], "rollout.repetition_penalty", ""),
    ("no_signal_limit_negative", [R, "rollout.max_groups_without_signal=-1"], "rollout.max_groups_without_signal", ""),
    ("backend_unknown", [R, "sampler.backend=foo"], "sampler.backend", "vllm, embedded, external"),
    ("max_model_len_zero", [R, "sampler.max_model_len=0"], "sampler.max_model_len", ""),
    ("max_logprobs_too_low", [R, "sampler.max_logprobs=2"], "sampler.max_logprobs", ""),
    ("external_without_url", [R, "sampler.backend=external"], "sampler.url", ""),
    ("staleness_negative", [R, "staleness.max_staleness=-1"], "staleness.max_staleness", ""),
    ("weight_sync_zero", [R, "staleness.weight_sync_steps=0"], "staleness.weight_sync_steps", ""),
    ("concurrency_zero", [R, "staleness.max_concurrent_rollouts=0"], "staleness.max_concurrent_rollouts", ""),
    ("epsilon_negative", [R, "loss.epsilon=-0.1"], "loss.epsilon", ""),
    ("clip_min_above_max", [R, "loss.vllm_importance_sampling_clip_min=6"], "loss.vllm_importance_sampling_clip_min", ""),
    # Loss variants (issue #27): refused with the field, the value and the fix.
    ("loss_type_unknown", [R, "loss.loss_type=ppo"], "loss.loss_type", "dapo, grpo, bnpo, dr_grpo, cispo"),
    ("cispo_with_centering", [R, "loss.loss_type=cispo", "loss.epsilon_high=5.0"], "loss.loss_type",
     "loss.score_centering=false"),
    ("cispo_without_eps_max", [R, "loss.loss_type=cispo", "loss.score_centering=false"], "loss.epsilon_high", "5.0"),
    ("gspo_with_centering", [R, "loss.importance_sampling_level=sequence"], "loss.importance_sampling_level",
     "loss.score_centering=false"),
    ("is_level_unknown", [R, "loss.importance_sampling_level=group"], "loss.importance_sampling_level", "token"),
    ("is_mode_unknown", [R, "loss.vllm_importance_sampling_mode=truncate"], "loss.vllm_importance_sampling_mode",
     "token_truncate"),
    ("sequence_mask_with_centering", [R, "loss.vllm_importance_sampling_mode=sequence_mask"],
     "loss.vllm_importance_sampling_mode", "loss.score_centering=false"),
    ("beta_negative", [R, "loss.beta=-0.1"], "loss.beta", "loss.beta=0.0"),
    ("mask_truncated_not_bool", [R, "loss.mask_truncated_completions=maybe"], "loss.mask_truncated_completions", ""),
    ("reward_weights_count", [R, "rollout.reward_weights=[1.0,0.5]"], "rollout.reward_weights", "1 reward function"),
    ("reward_weights_not_numbers", [R, "rollout.reward_weights=[1.0,abc]"], "rollout.reward_weights", ""),
    ("token_budget_zero", [R, "packing.token_budget=0"], "packing.token_budget", ""),
    ("max_steps_zero", [R, "trainer.max_steps=0"], "trainer.max_steps", ""),
    ("cosine_without_steps", [R, "trainer.max_steps=-1", "trainer.lr_scheduler_type=cosine"],
     "trainer.lr_scheduler_type", ""),
    ("warmup_negative", [R, "trainer.warmup_steps=-1"], "trainer.warmup_steps", ""),
    ("beta1_one", [R, "trainer.adam_beta1=1.0"], "trainer.adam_beta1", ""),
    ("save_limit_zero", [R, "trainer.save_total_limit=0"], "trainer.save_total_limit", ""),
    ("logging_steps_zero", [R, "trainer.logging_steps=0"], "trainer.logging_steps", ""),
    ("seed_negative", [R, "trainer.seed=-3"], "trainer.seed", ""),
    ("liger", [R, "trainer.use_liger_kernel=true"], "trainer.use_liger_kernel", ""),
    ("lora_rank_too_big", [R, "peft.enabled=true", "peft.r=1024"], "peft.r", ""),
    ("lora_on_lm_head", [R, "peft.enabled=true", "peft.target_modules=lm_head"], "peft.target_modules", ""),
    ("shared_gpus", [R, "sampler.backend=vllm", "launch.server_gpus=[0]", "launch.trainer_gpus=[0]"],
     "launch.server_gpus", ""),
    ("unknown_key", [R, "rollout.num_generation=4"], "rollout.num_generation", "rollout.num_generations"),
    ("unknown_group", [R, "rolout.top_k=3"], "rolout", "rollout"),
    ("unknown_recipe", ["+recipe=nonexistent"], "recipe", "good"),
    ("model_folder_missing", [R, "model.name=/nonexistent/models/tiny"], "model.name", "no such folder"),
    ("model_id_malformed", [R, "model.name=-bad-id"], "model.name", "owner/name"),
    ("override_grammar", [R, "model.name=not a model id!"], "model.name", "quote"),
    ("model_folder_empty", [R, "model.name={root}/empty_folder"], "model.name", "config.json"),
    ("model_without_chat_template", [R, "model.name={root}/no_template"], "model.name", "chat template"),
    ("data_missing", [R, "data.name=/nonexistent/prompts.jsonl"], "data.name", "no such file"),
    ("data_empty", [R, "data.name={root}/empty.jsonl"], "data.name", ""),
    ("prompt_column_missing", [R, "data.name={root}/text.jsonl"], "data.prompt_column", "question"),
    ("prompt_not_text", [R, "data.name={root}/ints.jsonl"], "data.prompt_column", "int"),
    ("generator_unknown", [R, "data.name=null", "data.generator=foo"], "data.generator", "reasoning_gym"),
    ("generator_size_zero", [R, "data.name=null", "data.generator=reasoning_gym", "data.task=basic_arithmetic",
                             "data.size=0"], "data.size", ""),
    ("reward_attr_typo", ["+recipe=typo_func"], "rewards[0].func", "good_reward"),
    ("reward_module_typo", ["+recipe=typo_module"], "rewards[0].func", "asyncgrpo_cli.rewards"),
    ("reward_hub_id", ["+recipe=hub_reward"], "rewards[0].func", "Hub id"),
    ("reward_missing_column", ["+recipe=missing_column"], "rewards[0].func", "gold"),
    ("reward_without_kwargs", ["+recipe=no_kwargs"], "rewards[0].func", "**kwargs"),
    ("reward_not_callable", ["+recipe=not_callable"], "rewards[0].func", "not callable"),
    ("reward_bad_kwargs", ["+recipe=bad_kwargs"], "rewards[0].kwargs", "tolerance"),
    ("loop_cls_not_a_loop", [R, "rollout.loop_cls=badrewards:good_reward"], "rollout.loop_cls", "AsyncRolloutLoop"),
    ("loop_cls_typo", [R, "rollout.loop_cls=asyncgrpo_cli.rollout.loop:AsyncRolloutLop"], "rollout.loop_cls",
     "AsyncRolloutLoop"),
    ("recipe_yaml_error", ["+recipe=broken"], "broken.yaml:4", "YAML"),
    ("scheduler_unknown", [R, "trainer.lr_scheduler_type=foo"], "trainer.lr_scheduler_type", "cosine"),
    ("optimizer_unknown", [R, "trainer.optim=adamw_foo"], "trainer.optim",
     "transformers accepts one of adamw_torch, "),  # the closest first, 8 of 41 (the whole list was 1,500 characters)
    ("optimizer_unknown_list_is_short", [R, "trainer.optim=foo"], "trainer.optim", "(the 8 closest of "),
    ("key_set_twice", [R, "trainer.max_steps=5", "trainer.max_steps=7"], "trainer.max_steps",
     "trainer.max_steps is set twice on the command line (trainer.max_steps=5, then trainer.max_steps=7)"),
    ("save_strategy_typo", [R, "trainer.save_strategy=step"], "trainer.save_strategy", "Fix: trainer.save_strategy=steps"),
    ("tracker_typo", [R, "trainer.report_to=tensorbord"], "trainer.report_to", "Fix: trainer.report_to=tensorboard"),
    ("tracker_typo_in_a_list", [R, "trainer.report_to=[tensorboard,wandbb]"], "trainer.report_to",
     "Fix: trainer.report_to=[tensorboard,wandb]"),
    # the fix names a port free here, not the default 8000 (which may be taken; second fresh-user trial)
    ("port_out_of_range", [R, "sampler.port=70000"], "sampler.port", "use a free port, e.g. sampler.port="),
    ("gpu_memory_above_one", [R, "sampler.gpu_memory_utilization=1.5"], "sampler.gpu_memory_utilization", ""),
    ("device_unknown", [R, "sampler.device=tpu"], "sampler.device", "cuda:N"),
    ("lora_dropout_one", [R, "peft.lora_dropout=1.0"], "peft.lora_dropout", ""),
    ("cpu_processes_zero", [R, "launch.cpu_processes=0"], "launch.cpu_processes", ""),
    ("machine_rank_too_big", [R, "launch.num_machines=2", "launch.machine_rank=2"], "launch.machine_rank", ""),
    # issue 25: accepted silently before
    ("output_dir_empty", [R, "trainer.output_dir="], "trainer.output_dir", "empty"),
    ("stop_timeout_negative", [R, "launch.stop_timeout=-1"], "launch.stop_timeout", "> 0"),
    ("prompt_plus_completion_over_max_len", [R, "data.name={root}/long.jsonl", "rollout.max_completion_length=200"],
     "rollout.max_completion_length", "row 3"),
    ("no_prompt_fits_the_token_budget", [R, "packing.token_budget=4"], "packing.token_budget", "no prompt fits"),
    ("accuracy_without_ground_truth", ["+recipe=accuracy", "data.name={root}/no_answer.jsonl"], "rewards[0].func",
     "solution, answer"),
    ("output_dir_not_writable", [R, "trainer.output_dir={root}/good.jsonl/run"], "trainer.output_dir", "is a file"),
    ("gguf_file_with_a_model_folder", [R, "model.gguf_file=model-q8.gguf"], "model.gguf_file", "not found"),
    ("group_option_unknown", [R, "loss=ppo"], "loss=ppo", "its options: default"),
    ("list_override_malformed", [R, "rewards=[{fnc:badrewards:good_reward}]"], "rewards", "'rewards=["),
    ("data_folder_of_empty_files", [R, "data.name={root}/empty_data"], "data.name", "no rows"),
    ("data_blank_lines", [R, "data.name={root}/blank.jsonl"], "data.name", "no rows"),
    ("url_not_a_url", [R, "sampler.backend=external", "sampler.url=notaurl"], "sampler.url", "http://HOST:PORT"),
    ("group_requests_not_a_bool", [R, "rollout.group_requests=maybe"], "rollout.group_requests", ""),
    ("in_flight_estimate_unknown", [R, "staleness.in_flight_estimate=queued"], "staleness.in_flight_estimate",
     "staleness.in_flight_estimate=kept"),
    ("deadline_release_zero", [R, "staleness.deadline_release_versions=0"], "staleness.deadline_release_versions",
     "staleness.deadline_release_versions=4"),
    ("deadline_order_unknown", [R, "staleness.deadline_order=fifo"], "staleness.deadline_order",
     "staleness.deadline_order=observed"),
    ("request_seeds_off_with_engines", [R, "rollout.request_seeds=false", "sampler.data_parallel_size=2"],
     "rollout.request_seeds", "identical text"),
    # issue #45: each reward function is called once before the start (it failed a minute into the run)
    ("reward_raises", ["+recipe=raising_reward"], "rewards[0].func",
     "it raised ZeroDivisionError: float division by zero (at "),
    ("reward_returns_text", ["+recipe=text_reward"], "rewards[1].func", "it returned ['right', 'right'] (str)"),
    ("reward_async_three_rewards_for_two", ["+recipe=async_text_reward"], "rewards[0].func",
     "it returned 3 rewards for 2 completions"),
    ("reward_probe_not_bool", [R, "rewards=[{func: badrewards:good_reward, probe: maybe}]"], "rewards", "'maybe'"),
]


@pytest.mark.parametrize("case_id,overrides,key,extra", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(world, tripwire, case_id, overrides, key, extra):
    overrides = [o.replace("{root}", str(world["root"])) for o in overrides]
    result, elapsed = _cli(world, overrides)
    out = result.output
    assert result.exit_code == 2, out
    assert key in out, out
    assert "Fix" in out, out
    if extra:
        assert extra in out, out
    assert "Traceback" not in out and result.exception is None or isinstance(result.exception, SystemExit), out
    assert not UNSHIPPED.search(out), out  # messages cite what ships: README sections
    assert elapsed < FAIL_WITHIN_S
    assert not tripwire, "a config error reached the launcher"


@pytest.mark.parametrize("recipe", ["raising_reward_unprobed", "paid_judge"])
def test_a_reward_left_out_of_the_start_probe_is_not_called(world, tripwire, recipe):
    """``probe: false`` in its rewards entry, or ``probe_at_start = False`` on the function (a paid judge)."""
    result, _ = _cli(world, [f"+recipe={recipe}"])
    assert result.exit_code == 0, result.output
    assert len(tripwire) == 1


@pytest.mark.parametrize("flag", [[], ["--dry-run"]])
def test_the_reward_probe_runs_in_train_and_its_dry_run_alike(world, tripwire, flag):
    result, elapsed = _cli(world, ["+recipe=raising_reward", *flag])
    assert result.exit_code == 2 and "it raised ZeroDivisionError" in result.output, result.output
    assert "Fix: correct the function (the run would fail at the first group it scores)" in result.output
    assert "add probe: false to rewards[0]" in result.output and "Traceback" not in result.output
    assert not tripwire and elapsed < FAIL_WITHIN_S


def test_a_tracker_that_is_not_installed_is_refused_and_check_says_what_passed(world, tripwire):
    import importlib.util

    if importlib.util.find_spec("trackio") is not None:
        pytest.skip("trackio is installed here")
    for command in (["train", "--dry-run"], ["config", "--check"]):
        result = runner.invoke(app, [*command, "--recipes-dir", str(world["recipes"]), R, "trainer.report_to=trackio"])
        assert result.exit_code == 2 and "trainer.report_to" in result.output, result.output
        assert "pip install trackio" in result.output and "Traceback" not in result.output
    passed = runner.invoke(app, ["config", "--check", "--recipes-dir", str(world["recipes"]), R])
    assert passed.exit_code == 0 and "every check train runs before it starts passed" in passed.output
    refused = runner.invoke(app, ["config", "--check", "--recipes-dir", str(world["recipes"]), R,
                                  "model.gguf_file=model-q8.gguf"])
    assert refused.exit_code == 2 and "model.gguf_file" in refused.output and "passed" not in refused.output
    assert not tripwire


def test_list_overrides_on_the_command_line_set_the_list(world, tripwire):
    """README's list form works as an override (Hydra alone reads rewards=[...] as an option file of the group)."""
    result, _ = _cli(world, [R, "rewards=[badrewards:good_reward,{func:badrewards:good_reward,kwargs:{}}]",
                             "tools=[asyncgrpo_cli.envs.calculator:calculate]"])
    assert result.exit_code == 0, result.output
    cfg = tripwire[0]
    assert [r.func for r in cfg.rewards] == ["badrewards:good_reward"] * 2
    assert list(cfg.tools) == ["asyncgrpo_cli.envs.calculator:calculate"]


def test_a_hub_id_without_the_hub_is_one_line_before_anything_starts(world, tripwire, monkeypatch):
    """No network: a Hub model that is not cached, or a Hub dataset, is refused at once (it failed 70-98 s in
    with a raw ConnectionError), naming the id, why the Hub cannot be used and the fix."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there: refused at once, whatever this machine's network
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for extra, key in (["model.name=someorg/not-cached-model"], "model.name"), (["data.name=someorg/prompts"],
                                                                               "data.name"):
        result, elapsed = _cli(world, [R, *extra])
        out = result.output
        assert result.exit_code == 2 and f"{key}='someorg/" in out and "unreachable" in out, out
        assert "HF_HUB_OFFLINE=1" in out and "Traceback" not in out and elapsed < FAIL_WITHIN_S
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result, _ = _cli(world, [R, "model.name=someorg/not-cached-model"])
    assert result.exit_code == 2 and "HF_HUB_OFFLINE is set" in result.output, result.output
    assert not tripwire


def test_cli_reports_several_problems_at_once(world, tripwire):
    result, _ = _cli(world, [R, "trainer.gradient_accumulation_steps=0", "trainer.learning_rate=-1",
                             "data.name=/nonexistent/p.jsonl"])
    assert result.exit_code == 2
    for key in ("trainer.gradient_accumulation_steps", "trainer.learning_rate", "data.name"):
        assert key in result.output


def test_cli_repetition_penalty_warns(world, tripwire):
    result, _ = _cli(world, [R, "rollout.repetition_penalty=1.3"])
    assert result.exit_code == 0, result.output
    assert "warning" in result.output and "repetition penalty" in result.output
    assert not UNSHIPPED.search(result.output), result.output


def test_cli_fallback_warns(world, tripwire):
    result, _ = _cli(world, [R, "rollout.top_k=8", "rollout.sampling_mask_fallback=true"])
    assert result.exit_code == 0, result.output
    assert "biased" in result.output


# ---------------------------------------------------------------------------------------------- Python API
def _args(tmp_path, **kw):
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

    return AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", **kw)


CONFIG_CASES = [
    ("num_generations_str", {"num_generations": "8"}, ConfigTypeError, "num_generations", "8"),
    ("learning_rate_str", {"learning_rate": "1e-5"}, ConfigTypeError, "learning_rate", "1e-05"),
    ("score_centering_str", {"score_centering": "yes"}, ConfigTypeError, "score_centering", "bool"),
    ("top_k_float", {"top_k": 8.5}, ConfigTypeError, "top_k", "int"),
    ("ga_zero", {"gradient_accumulation_steps": 0}, ConfigError, "gradient_accumulation_steps", ""),
    ("lr_negative", {"learning_rate": -1e-5}, ConfigError, "learning_rate", ""),
    ("top_p_without_top_k", {"top_p": 0.9}, ConfigError, "top_p", "top_k"),
    ("temperature_zero", {"temperature": 0.0}, ConfigError, "temperature", ""),
    ("cosine_without_steps", {"max_steps": -1, "lr_scheduler_type": "cosine"}, ConfigError, "lr_scheduler_type", ""),
    ("max_steps_zero", {"max_steps": 0}, ConfigError, "max_steps", ""),
    ("loss_type_unknown", {"loss_type": "ppo"}, ConfigError, "loss_type", "dr_grpo"),
    ("cispo_without_eps_max", {"loss_type": "cispo", "score_centering": False}, ConfigError, "epsilon_high", ""),
    ("reward_weights_nan", {"reward_weights": [1.0, float("nan")]}, ConfigError, "reward_weights", "finite"),
    ("in_flight_estimate_unknown", {"in_flight_estimate": "Kept"}, ConfigError, "in_flight_estimate", "'Kept'"),
    ("deadline_release_zero", {"deadline_release_versions": 0}, ConfigError, "deadline_release_versions",
     "deadline_release_versions=4"),
    ("deadline_order_unknown", {"deadline_order": "Observed"}, ConfigError, "deadline_order", "'Observed'"),
]


@pytest.mark.parametrize("case_id,kwargs,exc_type,key,extra", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_api_config_bad_input(tmp_path, case_id, kwargs, exc_type, key, extra):
    start = time.monotonic()
    with pytest.raises(exc_type) as info:
        _args(tmp_path, **kwargs)
    assert time.monotonic() - start < FAIL_WITHIN_S
    assert info.value.key == key or key in str(info.value)
    assert f"{key}=" in str(info.value) and "Fix" in str(info.value) and extra in str(info.value)
    assert isinstance(info.value, (TypeError, ValueError))


def _chat(n=4, **cols):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}?"}], "answer": str(i), **cols}
                                       for i in range(n)])


def _good_reward(completions, answer, **kwargs):
    return [0.0 for _ in completions]


def _needs_gold(completions, gold, **kwargs):
    return [0.0 for _ in completions]


def _raising_reward(completions, answer, **kwargs):
    return [int(a) for a in kwargs["solution"]]


def _text_reward(completions, **kwargs):
    return ["yes" for _ in completions]


def _judge(completions, **kwargs):
    raise RuntimeError("charged")


_judge.probe_at_start = False


TRAINER_CASES = [
    # (id, model ("tiny" = the tiny folder), rewards, dataset factory, key, text)
    ("string_prompts", "tiny", [_good_reward], lambda: datasets.Dataset.from_list([{"prompt": "2+2?", "answer": "4"}]),
     "train_dataset['prompt']", "plain string"),
    ("empty_dataset", "tiny", [_good_reward], lambda: _chat().select([]), "train_dataset", "no rows"),
    ("no_prompt_column", "tiny", [_good_reward],
     lambda: datasets.Dataset.from_list([{"question": [{"role": "user", "content": "x"}], "answer": "1"}]),
     "train_dataset['prompt']", "question"),
    ("reward_hub_string", "tiny", ["OpenAssistant/reward-model"], _chat, "reward_funcs[0]", "Hub id"),
    ("reward_missing_column", "tiny", [_needs_gold], _chat, "reward_funcs[0]", "gold"),
    ("reward_not_callable", "tiny", [42], _chat, "reward_funcs[0]", "not callable"),
    ("no_rewards", "tiny", [], _chat, "reward_funcs", ""),
    ("reward_weights_count", "tiny", [_good_reward], _chat, "reward_weights", "1 reward function"),
    ("no_dataset", "tiny", [_good_reward], lambda: None, "train_dataset", ""),
    ("model_folder_missing", "/nonexistent/models/tiny", [_good_reward], _chat, "model", "no such folder"),
    ("model_id_malformed", "not a model id!", [_good_reward], _chat, "model", "owner/name"),
    ("model_without_chat_template", "bare", [_good_reward], _chat, "model", "chat template"),
    # issue #45: called once on the first row before anything loads
    ("reward_raises", "tiny", [_good_reward, _raising_reward], _chat, "reward_funcs[1]", "it raised KeyError: 'solution'"),
    ("reward_returns_text", "tiny", _text_reward, _chat, "reward_funcs", "it returned ['yes', 'yes'] (str)"),
]


@pytest.mark.parametrize("case_id,model,rewards,make_dataset,key,text", TRAINER_CASES,
                         ids=[c[0] for c in TRAINER_CASES])
def test_api_trainer_bad_input(world, tmp_path, case_id, model, rewards, make_dataset, key, text):
    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    model = {"tiny": str(world["model"]), "bare": str(world["root"] / "no_template")}.get(model, model)
    args = _args(tmp_path, **({"reward_weights": [1.0, 2.0]} if case_id == "reward_weights_count" else {}))
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        AsyncGRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=make_dataset())
    assert time.monotonic() - start < FAIL_WITHIN_S
    message = str(info.value)
    assert key in message and "Fix" in message and text in message, message
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------------------------- real processes
def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}


def test_subprocess_cli_exit_code_and_no_traceback():
    args, key = ["train", "+recipe=smoke", f"sampler.port={_free_port()}", "trainer.gradient_accumulation_steps=0"], \
        "trainer.gradient_accumulation_steps"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo_cli", *args], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    out = proc.stdout + proc.stderr
    assert key in out and "Fix" in out and "Traceback" not in out, out
    assert time.monotonic() - start < 120


def test_subprocess_yaml_error_names_file_and_line(world):
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo_cli", "config", "+recipe=broken", "--recipes-dir",
                           str(world["recipes"])], capture_output=True, text=True, timeout=120, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "broken.yaml:4" in out and "Traceback" not in out, out
    assert len(out.splitlines()) < 10


def test_script_without_main_guard_is_refused(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from asyncgrpo_cli.rollout.worker import unguarded_main_call

        def start():
            return unguarded_main_call()

        print("TOP", start())
        if __name__ == "__main__":
            print("GUARDED", start())
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    top, guarded = proc.stdout.splitlines()
    assert top.startswith("TOP (") and "unguarded.py" in top and ", 7)" in top, top
    assert guarded == "GUARDED None"


def test_cited_readme_sections_exist():
    from asyncgrpo_cli.config.citations import README_SECTIONS, cite_shipped

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    headings = {line.lstrip("#").strip() for line in readme.splitlines() if line.startswith("#")}
    missing = [name for _, name in README_SECTIONS if name not in headings]
    assert not missing, f"citations.README_SECTIONS names README sections that do not exist: {missing}"
    text = cite_shipped("biased (SPEC B.11). Watch (SPEC §7).\n  - indented (SPEC §13.2)")
    assert text == "biased. Watch (README: Sampling filters).\n  - indented (README: Agent training: tools and environments)"


def test_readme_hub_snippet_without_the_hub_is_refused_in_a_few_lines_before_anything_loads(tmp_path):
    """Issue #45: README's Hub API snippet, run without network, printed five "Retrying in Ns" lines and a
    65-line transformers traceback ending in OSError, although README says ``AsyncGRPOTrainer(...)`` checks the
    model before anything loads. It is refused there: the id, why, the fix, and only the user's frame."""
    import socket

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'model="Qwen/Qwen3-0.6B"' in snippet, snippet
    (tmp_path / "hub_snippet.py").write_text(snippet)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens: the Hub refuses at once, whatever this machine's network
    env = {**_env(), "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "0"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "hub_snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "ConfigError: model='Qwen/Qwen3-0.6B': this Hub model is not in the local cache" in out, out
    assert "Fix: set model to a local folder" in out and "HF_HUB_OFFLINE=1" in out, out
    assert "Retrying in" not in out and "OSError" not in out and len(out.splitlines()) <= 8, out
    assert elapsed < FAIL_WITHIN_S, elapsed


def test_errors_show_booleans_and_null_as_the_command_line_writes_them():
    """A CLI key's value as the user types it (``trainer.bf16=true``), the Python API's as Python writes it."""
    from asyncgrpo_cli.config.rules import config_error

    assert str(config_error("trainer.bf16", True, "p", "f")).startswith("trainer.bf16=true: p. Fix: f")
    assert str(config_error("data.eval_name", None, "p", "f")).startswith("data.eval_name=null: p")
    assert str(config_error("bf16", True, "p", "f")).startswith("bf16=True: p")
    assert str(config_error("trainer.optim", "adamw", "p", "f")).startswith("trainer.optim='adamw': p")


def test_independent_mistakes_are_all_named_in_one_try():
    """Three mistakes in three groups: one `config --check` names each (key, value, fix), not only the first; a key
    with two problems is named once; the Python API's config does the same."""
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.config.rules import ConfigErrors

    result = runner.invoke(app, ["config", "+recipe=smoke", "rollout.num_generations=1", "rollout.temperature=0",
                                 "sampler.port=99999", "peft.enabled=true", "peft.r=1000", "--check"])
    assert result.exit_code == 2, result.output
    text = result.output[result.output.index("config error:"):]
    assert text.startswith("config error: 4 problems:"), text
    for shown in ("rollout.num_generations=1:", "rollout.temperature=0.0:", "sampler.port=99999:", "peft.r=1000:"):
        assert text.count(f"- {shown}") == 1 and "Fix:" in text.split(f"- {shown}")[1].split("\n")[0], (shown, text)
    with pytest.raises(ConfigErrors) as err:
        AsyncGRPOConfig(output_dir="/tmp/x", num_generations=1, top_p=-1.0, num_sampler_logprobs=-1)
    assert [e.key for e in err.value.errors] == ["num_generations", "top_p", "num_sampler_logprobs"], str(err.value)


def test_one_try_names_a_rule_a_deep_check_and_a_used_folder_together(tmp_path):
    """A fresh-user trial (fifteenth session) needed three tries for three mistakes: a rule broken at composition
    (`rollout.num_generations=1`), one the deep pass finds (`trainer.learning_rate=-1`) and a folder that holds an
    earlier run. `train`, its dry run and `config --check` now name all three at once."""
    from asyncgrpo_cli.launch.preflight import free_port

    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"x")  # a finished run's final model
    args = ["+recipe=smoke", "rollout.num_generations=1", "trainer.learning_rate=-1", f"sampler.port={free_port()}",
            f"trainer.output_dir={used}"]
    for command in (["train", *args], ["train", *args, "--dry-run"], ["config", *args, "--check"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        text = result.output
        assert "config error: 2 problems:" in text and "- rollout.num_generations=1:" in text, (command, text)
        assert "- trainer.learning_rate=-1.0: must be a finite number >= 0" in text, (command, text)
        assert f"\nerror: trainer.output_dir={used} already holds an earlier run" in text, (command, text)
        assert "Fix (once the problems above are fixed):" in text, (command, text)  # its commands repeat them
        assert "num_generations=1: GRPO" not in text.replace("rollout.num_generations=1: GRPO", ""), text  # once


def test_a_deep_check_alone_is_named_beside_a_used_folder_by_train(tmp_path):
    """A mistake only the deep pass's `TrainingArguments` rules find, with nothing wrong at composition: `train`
    refused the used folder alone, with commands that repeated the mistake (fresh-user trial, seventeenth session).
    Both come out now (those rules run beside the refusal; they import nothing heavy), and the folder's fix gives
    only the override to add."""
    from asyncgrpo_cli.launch.preflight import free_port

    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"x")
    result = runner.invoke(app, ["train", "+recipe=smoke", "trainer.activation_checkpointing=true",
                                 "trainer.activation_checkpointing_kwargs={every_n_layers:0}",
                                 f"sampler.port={free_port()}", f"trainer.output_dir={used}"])
    assert result.exit_code == 2, result.output
    text = result.output
    assert "activation_checkpointing_kwargs.every_n_layers=0: must be a whole number >= 1" in text, text
    assert f"error: trainer.output_dir={used} already holds an earlier run" in text, text
    assert "Fix (once the problems above are fixed):" in text and "every_n_layers:0}' " not in text, text


def test_a_plan_problem_is_named_beside_a_used_folder_and_its_fix_does_not_repeat_it(tmp_path):
    """`launch.mps=true` on a CPU (a problem of the launch plan, not of the config's rules) in a used folder:
    `train` refused the folder alone, with commands that repeated ``launch.mps=true``, and pasting one got the MPS
    refusal next (fresh-user trial, twentieth session). `train`, its dry run and `config --check` now name both,
    and the folder's fix gives only the override to add."""
    from asyncgrpo_cli.launch.preflight import free_port

    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"x")
    args = ["+recipe=smoke", "launch.mps=true", f"sampler.port={free_port()}", f"trainer.output_dir={used}"]
    for command in (["train", *args], ["train", *args, "--dry-run"], ["config", *args, "--check"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        text = result.output
        assert "launch.mps=true: CUDA MPS lets the server and the trainer share one GPU's compute" in text, text
        assert f"trainer.output_dir={used} already holds an earlier run" in text, (command, text)
        assert "launch.mps=true" not in text.split("already holds an earlier run")[1], (command, text)


def test_unknown_keys_and_wrong_types_are_all_named_in_one_try(tmp_path):
    """Hydra stops at its first unknown key or wrong type: two typos and a bad number took three tries. Each is
    named now, in command-line order, with the value rules and the deep pass run on the rest (the learning rate,
    with its value without the override) and the used folder after them."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.config.rules import ConfigErrors
    from asyncgrpo_cli.launch.preflight import free_port

    with pytest.raises(ConfigErrors) as err:
        compose(["+recipe=smoke", "rollout.tmperature=1", "rollout.top_k=abc", "trainer.max_step=3"])
    assert err.value.keys == ["rollout.tmperature", "rollout.top_k", "trainer.max_step"], str(err.value)
    assert "did you mean rollout.temperature?" in str(err.value) and "did you mean trainer.max_steps" in str(err.value)
    assert "rollout.top_k=0" in str(err.value)  # the type error's own fix
    with pytest.raises(ConfigErrors) as group:  # a group's missing option is one of them too
        compose(["+recipe=smoke", "model=nosuch", "rollout.tmperature=1"])
    assert group.value.keys == ["model", "rollout.tmperature"] and "Fix: model=default" in str(group.value)
    with pytest.raises(ConfigErrors) as loose:  # a true/false field given 2 or yes: named beside the others
        compose(["+recipe=smoke", "rollout.group_requests=2", "trainer.bf16=yes", "rollout.tmperature=1"])
    assert loose.value.keys == ["rollout.group_requests", "trainer.bf16", "rollout.tmperature"], str(loose.value)
    with pytest.raises(ConfigError) as one:  # one mistake: one error, as before
        compose(["+recipe=smoke", "rollout.tmperature=1"])
    assert not isinstance(one.value, ConfigErrors) and one.value.key == "rollout.tmperature"

    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"x")
    args = ["+recipe=smoke", "trainer.max_step=3", "trainer.learning_rate=-1", "rollout.top_p=7", "rollout.tmperature=1",
            f"sampler.port={free_port()}", f"trainer.output_dir={used}"]
    for command in (["train", *args], ["config", *args, "--check"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        text = result.output
        assert "config error: 4 problems:" in text, (command, text)
        assert text.index("- unknown key 'trainer.max_step'") < text.index("- unknown key 'rollout.tmperature'"), text
        assert "- rollout.top_p=7.0: must lie in (0, 1]" in text, (command, text)
        assert "- trainer.learning_rate=-1.0: must be a finite number >= 0" in text, (command, text)
        assert "Fix: trainer.learning_rate=3e-05 (its value without this override), or set" in text, (command, text)
        assert f"trainer.output_dir={used} already holds an earlier run" in text, (command, text)


def test_the_python_api_names_training_argument_and_grpo_problems_together():
    """`AsyncGRPOConfig` ran the `TrainingArguments` rules, then the GRPO ones, and stopped at the first pass that
    failed: a bad learning rate hid a bad group size. Both passes' problems come out in one try, each key once."""
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.config.rules import ConfigErrors

    with pytest.raises(ConfigErrors) as err:
        AsyncGRPOConfig(output_dir="/tmp/x", learning_rate=-1.0, num_generations=1, top_p=-1.0)
    assert sorted(err.value.keys) == ["learning_rate", "num_generations", "top_p"], str(err.value)
    assert len(err.value.keys) == len(set(err.value.keys))
    with pytest.raises(ConfigError) as one:
        AsyncGRPOConfig(output_dir="/tmp/x", learning_rate=-1.0)
    assert not isinstance(one.value, ConfigErrors) and one.value.key == "learning_rate"


def test_a_collector_of_first_problems_names_each_key_once():
    """`errors.Collector(first_per_key=True)`: two passes that check one field (TrainingArguments' rules, then the
    GRPO ones; the deep pass's checks) name it once, by the first problem found; a plain one keeps every problem."""
    from asyncgrpo_cli.config.errors import Collector
    from asyncgrpo_cli.config.rules import ConfigErrors

    def refuse(*errors):
        raise ConfigErrors(list(errors)) if len(errors) > 1 else errors[0]

    a1, a2, b = ConfigError("a: first", key="a"), ConfigError("a: second", key="a"), ConfigError("b", key="b")
    first = Collector(first_per_key=True)
    first.run(refuse, a1)
    first.run(refuse, a2, b)
    first.add(ConfigError("no key"))
    first.add(ConfigError("no key again"))  # problems without a key are all kept
    assert [str(e) for e in first.errors] == ["a: first", "b", "no key", "no key again"]
    every = Collector()
    every.run(refuse, a1)
    every.run(refuse, a2, b)
    assert [str(e) for e in every.errors] == ["a: first", "a: second", "b"]
    with pytest.raises(ConfigErrors) as err:
        first.raise_if_any()
    assert err.value.keys == ["a", "b", None, None]
