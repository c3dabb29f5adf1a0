"""Several machines: ``sampler.data_parallel_size`` in the serve line and the GPU plan, the weight-transfer
address fields, and the worked example of scripts/multinode/README.md (its commands plan cleanly here and
its accelerate config is the one asyncgrpo generates)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from asyncgrpo_cli.config.compose import compose, training_args_kwargs
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.server.colocate import decide_layout
from asyncgrpo_cli.launch.plan import accelerate_config, build_launch_plan
from asyncgrpo_cli.server.command import build_server_command
from asyncgrpo_cli.testing import config_groups

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "scripts" / "multinode"
GPUS = 8  # per machine in the example


def _server(cfg, gpu_count=GPUS):
    layout = decide_layout(gpu_count, **config_groups(decide_layout, cfg))
    return build_server_command(layout=layout, **config_groups(build_server_command, cfg))


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_data_parallel_size_reaches_the_serve_line_and_the_server_gpus():
    one = _server(compose(["+recipe=deepmath"]))
    assert "--data-parallel-size" not in one.argv and one.env["CUDA_VISIBLE_DEVICES"] == "0"
    two = _server(compose(["+recipe=deepmath", "sampler.data_parallel_size=2"]))
    assert _flag(two.argv, "--data-parallel-size") == "2" and not two.problems
    assert two.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    plan = build_launch_plan(compose(["+recipe=deepmath", "sampler.data_parallel_size=2"]), gpu_count=4)
    assert plan.gpus.server_gpus == [0, 1] and plan.gpus.trainer_gpus == [2, 3] and not plan.problems
    explicit = _server(compose(["+recipe=deepmath", "sampler.data_parallel_size=2", "launch.server_gpus=[4,5]",
                                "launch.trainer_gpus=[0,1]"]))
    assert explicit.env["CUDA_VISIBLE_DEVICES"] == "4,5" and not explicit.problems


def test_data_parallel_size_problems_name_the_field_and_the_fix():
    short = _server(compose(["+recipe=deepmath", "sampler.data_parallel_size=2", "launch.server_gpus=[3]"]))
    assert any("sampler.data_parallel_size=2" in p and "launch.server_gpus=[0,1]" in p for p in short.problems)
    colocated = _server(compose(["+recipe=deepmath", "sampler.data_parallel_size=2", "launch.colocate=true"]), 1)
    assert any("colocated" in p and "sampler.data_parallel_size=1" in p for p in colocated.problems)
    zero = _server(compose(["+recipe=deepmath", "sampler.data_parallel_size=0"]))
    assert any("must be >= 1" in p for p in zero.problems)


def test_weight_transfer_fields_reach_the_trainer_arguments():
    default = training_args_kwargs(compose(["+recipe=smoke"]))
    assert default["weight_transfer_address"] is None and default["weight_transfer_port"] is None
    kwargs = training_args_kwargs(compose(["+recipe=smoke", "sampler.weight_transfer_address=10.0.1.1",
                                           "sampler.weight_transfer_port=29600"]))
    assert kwargs["weight_transfer_address"] == "10.0.1.1" and kwargs["weight_transfer_port"] == 29600
    with pytest.raises(ConfigError, match=r"sampler\.weight_transfer_port.*70000|70000.*sampler\.weight_transfer_port"):
        compose(["+recipe=smoke", "sampler.weight_transfer_port=70000"])


def _example_commands() -> list[list[str]]:
    """Every ``asyncgrpo ...`` command in the example's fenced bash blocks, as argv (continuations joined)."""
    text = (EXAMPLE / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip().startswith("asyncgrpo "):
                commands.append(shlex.split(command))
    return commands


def test_the_example_commands_plan_without_problems():
    commands = _example_commands()
    assert [c[1] for c in commands] == ["train", "train", "serve", "train"]
    for argv in commands:
        cfg = compose(argv[2:])
        if argv[1] == "serve":
            server = _server(cfg)
            assert not server.problems and _flag(server.argv, "--data-parallel-size") == "8"
            assert server.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(8)))
            continue
        plan = build_launch_plan(cfg, gpu_count=GPUS, server_running=False)
        assert not plan.problems, (argv, plan.problems)
        assert plan.accelerate["num_machines"] == 2 and plan.accelerate["main_process_ip"] == "10.0.0.1"
        procs = plan.accelerate["num_processes"]
        if cfg.sampler.backend.value == "external":
            assert plan.server is None and plan.gpus.trainer_gpus == list(range(8)) and procs == 16
        elif cfg.launch.machine_rank == 0:
            assert _flag(plan.server.argv, "--data-parallel-size") == "2" and procs == 12
        else:
            assert plan.server is None and plan.gpus.trainer_gpus == [2, 3, 4, 5, 6, 7] and procs == 12


def test_the_example_accelerate_config_is_the_generated_one():
    machine0 = _example_commands()[0]
    cfg = compose(machine0[2:])
    plan = build_launch_plan(cfg, gpu_count=GPUS, server_running=False)
    shipped = yaml.safe_load((EXAMPLE / "accelerate_two_nodes.yaml").read_text())
    assert shipped == accelerate_config(plan.gpus, **config_groups(accelerate_config, cfg))


def test_readme_links_the_example():
    assert "scripts/multinode/README.md" in (ROOT / "README.md").read_text()
