"""A dict of environments routes every example by its ``environment`` field (SPEC §16.1): without a dataset, or
with one that lacks that column, it is refused at construction (API) and when the config is checked (CLI),
instead of failing inside ``train()``."""

from __future__ import annotations

import datasets
import pytest

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.config.validate import check_environment_column as cli_check
from asyncgrpo_cli.envs.increment import IncrementEnv, IncrementEnvWithExample
from asyncgrpo_cli.train.startup import check_environment_column

ENVS = {"counter": IncrementEnv, "shown": IncrementEnvWithExample}


def args(tmp_path):
    return AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1)


def test_dict_without_a_dataset_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError) as info:
        AsyncGRPOTrainer(model="unused", args=args(tmp_path), environment_factory=ENVS)
    msg = str(info.value)
    assert "train_dataset=None" in msg and "'environment'" in msg and "['counter', 'shown']" in msg


def test_dict_with_a_dataset_without_the_column_is_refused(tmp_path):
    rows = datasets.Dataset.from_dict({"target": [1, 2]})
    with pytest.raises(ValueError, match=r"columns \['target'\] and no 'environment' column"):
        AsyncGRPOTrainer(model="unused", args=args(tmp_path), train_dataset=rows, environment_factory=ENVS)


def test_routed_dataset_and_single_environment_pass():
    check_environment_column(ENVS, datasets.Dataset.from_dict({"environment": ["counter", "shown"]}))
    check_environment_column(IncrementEnv, None)  # one environment owns its data
    cli_check(ENVS, ["environment", "prompt"])
    with pytest.raises(ConfigError, match="environment.factory"):
        cli_check(ENVS, ["prompt"])


def test_cli_refuses_a_dict_without_data():
    with pytest.raises(ConfigError) as info:
        compose(["+recipe=increment_env", "environment.factory={a: asyncgrpo_cli.envs.increment:IncrementEnv}"])
    assert "environment.factory" in str(info.value) and "data.name" in str(info.value)
    compose(["+recipe=increment_env"])  # one environment without data stays accepted
