"""The GPU plan and the generated accelerate config / command (launch/plan.py)."""

from __future__ import annotations

import os
import pytest

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.launch.plan import (
    TRAINER_MODULE,
    accelerate_config,
    accelerate_config_yaml,
    build_launch_plan,
    decide_layout,
    mixed_precision,
    plan_gpus,
)
from asyncgrpo_cli.testing import config_groups


def cfg_of(*overrides):
    return compose(["model.name=org/model", "trainer.output_dir=/tmp/asyncgrpo-plan-test", *overrides])


def test_one_gpu_embedded_shares_it_single_process():
    cfg = cfg_of("sampler.backend=embedded", "sampler.device=auto")
    plan = build_launch_plan(cfg, gpu_count=1)
    assert plan.gpus.server_gpus == [0] and plan.gpus.trainer_gpus == [0]
    assert not plan.problems and any("shares" in n for n in plan.gpus.notes)
    acc = plan.accelerate
    assert acc["distributed_type"] == "NO" and acc["num_processes"] == 1 and "fsdp_config" not in acc
    assert acc["use_cpu"] is False and acc["mixed_precision"] == "bf16"  # trainer.bf16 defaults on
    assert plan.trainer_env["CUDA_VISIBLE_DEVICES"] == "0" and "ACCELERATE_USE_CPU" not in plan.trainer_env


def test_the_overlapped_sync_is_announced_with_the_plan_where_it_overlaps():
    """A fresh-user trial found it only in trainer.log; on-policy it overlaps nothing (the config check warns)."""
    def notes(*o):
        return [n for n in build_launch_plan(cfg_of(*o), gpu_count=1).gpus.notes if "weight_sync_overlap" in n]

    assert notes() == [] and notes("sampler.weight_sync_overlap=true", "staleness.max_staleness=0") == []
    assert notes("sampler.weight_sync_overlap=true") == [
        "sampler.weight_sync_overlap=true: each step's weight sync runs on a background thread while the next step "
        "trains (perf/weight_sync_wait_s: what a step still waits for it)"]


def test_torch_compile_is_announced_with_the_plan():
    assert not any("torch_compile" in n for n in build_launch_plan(cfg_of(), gpu_count=2).gpus.notes)
    gpu = build_launch_plan(cfg_of("trainer.torch_compile=true"), gpu_count=2).gpus.notes
    assert any("first step" in n and "CPU" not in n for n in gpu)
    cpu = build_launch_plan(cfg_of("trainer.torch_compile=true", "sampler.backend=embedded"), gpu_count=0).gpus.notes
    assert any("first step" in n and "CPU trainer" in n for n in cpu)


def test_one_gpu_vllm_without_colocation_is_a_problem():
    plan = build_launch_plan(cfg_of("launch.colocate=false"), gpu_count=1)
    assert plan.problems and "different GPUs" in plan.problems[0] and "sampler.backend=embedded" in plan.problems[0]
    assert "launch.colocate=true" in plan.problems[0]


def test_vllm_needs_a_gpu():
    plan = build_launch_plan(cfg_of(), gpu_count=0)
    assert any("needs a CUDA GPU" in p for p in plan.problems)
    # A server that already runs (or an external one) needs no local GPU.
    assert not build_launch_plan(cfg_of(), gpu_count=0, server_running=True).problems
    assert not build_launch_plan(cfg_of("sampler.backend=external", "sampler.url=http://h:1"), gpu_count=0).problems


def test_flash_attention_on_a_cpu_trainer_is_a_problem():
    cpu = build_launch_plan(cfg_of("sampler.backend=embedded", "packing.attention=flash"), gpu_count=0).problems
    assert any(p.startswith("packing.attention=flash:") and "trainer runs on the CPU" in p
               and "packing.attention=auto" in p for p in cpu)
    assert not build_launch_plan(cfg_of("sampler.backend=embedded", "packing.attention=flex"), gpu_count=0).problems
    assert not build_launch_plan(cfg_of("packing.attention=flash"), gpu_count=2).problems


def test_three_gpus_vllm_fsdp2_on_two():
    cfg = cfg_of()
    plan = build_launch_plan(cfg, gpu_count=3, main_process_port=29555)
    assert plan.gpus.server_gpus == [0] and plan.gpus.trainer_gpus == [1, 2]
    assert plan.server is not None and plan.server.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert plan.trainer_env["CUDA_VISIBLE_DEVICES"] == "1,2"
    acc = plan.accelerate
    assert acc["distributed_type"] == "FSDP" and acc["num_processes"] == 2 and acc["gpu_ids"] == "all"
    assert acc["main_process_port"] == 29555 and acc["num_machines"] == 1 and acc["use_cpu"] is False
    fsdp = acc["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT" and fsdp["fsdp_reshard_after_forward"] is True
    assert "fsdp_version: 2" in accelerate_config_yaml(acc)


def test_two_gpus_external_server_fsdp2():
    plan = build_launch_plan(cfg_of("sampler.backend=external", "sampler.url=http://10.0.0.5:8000",
                                    "trainer.fp16=true", "trainer.bf16=false"), gpu_count=2)
    assert plan.server is None and "external" in plan.server_reason and plan.url == "http://10.0.0.5:8000"
    assert plan.gpus.trainer_gpus == [0, 1] and plan.accelerate["distributed_type"] == "FSDP"
    assert plan.accelerate["mixed_precision"] == "fp16"


def test_running_server_keeps_its_gpu():
    """A vLLM started by `asyncgrpo serve` holds GPU 0: the trainer avoids it even though we start nothing."""
    plan = build_launch_plan(cfg_of(), gpu_count=2, server_running=True)
    assert plan.server is None and "already answers" in plan.server_reason
    assert plan.gpus.server_gpus == [] and plan.gpus.trainer_gpus == [1]


def test_explicit_gpu_lists_are_checked():
    plan = build_launch_plan(cfg_of("launch.server_gpus=[0]", "launch.trainer_gpus=[1,5]"), gpu_count=4)
    assert any("GPU(s) [5] do not exist" in p for p in plan.problems)
    plan = build_launch_plan(cfg_of("launch.trainer_gpus=[0,1]"), gpu_count=4)
    assert any("overlaps the vLLM server" in p and "launch.trainer_gpus=[1]" in p for p in plan.problems)
    plan = build_launch_plan(cfg_of("launch.server_gpus=[0,1]", "launch.trainer_gpus=[2,3]"), gpu_count=4)
    assert not plan.problems and plan.server.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.accelerate["num_processes"] == 2


@pytest.mark.parametrize("processes", [1, 2])
def test_cpu_trainer(processes):
    cfg = cfg_of("sampler.backend=embedded", "sampler.device=cpu", f"launch.cpu_processes={processes}",
                 "trainer.bf16=false")
    plan = build_launch_plan(cfg, gpu_count=0, main_process_port=29601)
    assert not plan.problems and plan.gpus.use_cpu and plan.gpus.server_gpus == []
    acc = plan.accelerate
    assert acc["use_cpu"] is True and acc["num_processes"] == processes and acc["mixed_precision"] == "no"
    assert acc["distributed_type"] == ("FSDP" if processes > 1 else "NO")
    assert ("fsdp_config" in acc) == (processes > 1)
    assert plan.trainer_env["ACCELERATE_USE_CPU"] == "true" and plan.trainer_env["CUDA_VISIBLE_DEVICES"] == ""
    argv = plan.trainer_argv
    assert argv[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert argv[4] == str(plan.accelerate_config_path) and argv[5:7] == ["-m", TRAINER_MODULE]
    assert argv[7:] == ["--config", str(plan.config_path)]
    assert plan.config_path.name == "asyncgrpo_config.yaml"
    assert plan.accelerate_config_path.name == "accelerate_config.yaml"
    assert "ACCELERATE_USE_CPU=true" in plan.trainer_shell_line()


def test_cpu_sampler_and_trainer_split_the_cores(monkeypatch):
    from asyncgrpo_cli.launch.plan import cpu_thread_split

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = cfg_of("sampler.backend=embedded", "sampler.device=cpu", "trainer.bf16=false")
    plan = build_launch_plan(cfg, gpu_count=0, main_process_port=29601)
    sampler, trainer, cores = cpu_thread_split(plan.gpus, plan.server, sampler=cfg.sampler)
    assert plan.server.env["OMP_NUM_THREADS"] == str(sampler) and plan.trainer_env["OMP_NUM_THREADS"] == str(trainer)
    assert "OMP_NUM_THREADS=" in plan.server.shell_line() and any("CPU threads" in n for n in plan.gpus.notes)
    assert cpu_thread_split(plan.gpus, plan.server, sampler=cfg.sampler, cores=2)[:2] == (1, 1)
    assert cpu_thread_split(plan.gpus, plan.server, sampler=cfg.sampler, cores=16)[:2] == (8, 8)
    assert cpu_thread_split(plan.gpus, plan.server, sampler=cfg.sampler, cores=1)[:2] == (1, 1)
    two = cfg_of("sampler.backend=embedded", "sampler.device=cpu", "launch.cpu_processes=2", "trainer.bf16=false")
    two_plan = build_launch_plan(two, gpu_count=0, main_process_port=29601)
    assert cpu_thread_split(two_plan.gpus, two_plan.server, 16, sampler=two.sampler)[:2] == (8, 4)
    # the user's choice wins: in the environment, or in sampler.env
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    chosen = build_launch_plan(cfg, gpu_count=0, main_process_port=29601)
    assert "OMP_NUM_THREADS" not in chosen.trainer_env and "OMP_NUM_THREADS" not in chosen.server.env
    monkeypatch.delenv("OMP_NUM_THREADS")
    env_cfg = cfg_of("sampler.backend=embedded", "sampler.device=cpu", "trainer.bf16=false", "+sampler.env.OMP_NUM_THREADS=2")
    assert cpu_thread_split(plan.gpus, plan.server, sampler=env_cfg.sampler) is None
    # a sampler on a GPU, or an external one, leaves the trainer its threads
    gpu = build_launch_plan(cfg_of("sampler.backend=embedded"), gpu_count=1, main_process_port=29601)
    assert "OMP_NUM_THREADS" not in gpu.trainer_env


def test_multi_node():
    cfg = cfg_of("launch.num_machines=2", "launch.machine_rank=1", "launch.main_process_ip=10.0.0.1",
                 "launch.main_process_port=29500")
    plan = build_launch_plan(cfg, gpu_count=4)
    assert plan.server is None and "machine 0" in plan.server_reason
    assert plan.gpus.trainer_gpus == [1, 2, 3]  # same split as machine 0, whose GPU 0 runs vLLM
    acc = plan.accelerate
    assert acc["num_machines"] == 2 and acc["machine_rank"] == 1 and acc["num_processes"] == 6
    assert acc["main_process_ip"] == "10.0.0.1" and acc["main_process_port"] == 29500
    assert acc["distributed_type"] == "FSDP" and acc["same_network"] is True and acc["rdzv_backend"] == "static"
    rank0 = build_launch_plan(cfg_of("launch.num_machines=2", "launch.main_process_ip=10.0.0.1"), gpu_count=4)
    assert rank0.server is not None and rank0.accelerate["num_processes"] == 6
    # One GPU per machine and two machines: still FSDP2 across nodes.
    external = cfg_of("sampler.backend=external", "sampler.url=http://h:1", "launch.num_machines=2",
                      "launch.main_process_ip=h")
    layout = decide_layout(1, **config_groups(decide_layout, external))
    one = plan_gpus(1, layout=layout, start_server=False, **config_groups(plan_gpus, external))
    assert accelerate_config(one, **config_groups(accelerate_config, cfg_of()))["distributed_type"] == "FSDP"


def test_multi_node_needs_main_ip_and_valid_rank():
    from asyncgrpo_cli.config.rules import ConfigError

    plan = build_launch_plan(cfg_of("launch.num_machines=2"), gpu_count=2)
    assert any("main_process_ip" in p for p in plan.problems)
    with pytest.raises(ConfigError, match="launch.machine_rank=2"):  # refused when composed, before any plan
        cfg_of("launch.num_machines=2", "launch.machine_rank=2")


def _precision(*overrides):
    return mixed_precision(**config_groups(mixed_precision, cfg_of(*overrides)))


def test_mixed_precision_follows_compute_dtype():
    assert _precision() == "bf16"
    assert _precision("trainer.bf16=false", "trainer.fp16=true") == "fp16"
    assert _precision("trainer.bf16=false", "model.dtype=float32") == "no"


def test_earlier_checkpoints_are_announced_unless_resuming(tmp_path):
    from asyncgrpo_cli.run.folder import earlier_checkpoints_note

    cfg = compose(["+recipe=smoke", f"trainer.output_dir={tmp_path}"])
    assert earlier_checkpoints_note(cfg.trainer) is None
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-8").mkdir()
    note = earlier_checkpoints_note(cfg.trainer)
    assert "2 checkpoint(s)" in note and f"trainer.resume_from_checkpoint={tmp_path / 'checkpoint-8'}" in note
    resumed = compose(["+recipe=smoke", f"trainer.output_dir={tmp_path}",
                       f"trainer.resume_from_checkpoint={tmp_path / 'checkpoint-8'}"])
    assert earlier_checkpoints_note(resumed.trainer) is None


def test_several_embedded_servers_split_the_sampler_threads_and_the_note_says_so(monkeypatch):
    from asyncgrpo_cli.launch.plan import cpu_thread_split

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = cfg_of("sampler.backend=embedded", "sampler.device=cpu", "trainer.bf16=false", "sampler.engines=2")
    plan = build_launch_plan(cfg, gpu_count=0, main_process_port=29601)
    assert cpu_thread_split(plan.gpus, plan.server, sampler=cfg.sampler, cores=16)[:2] == (4, 8)
    assert cpu_thread_split(plan.gpus, plan.server, sampler=cfg.sampler, cores=2)[:2] == (1, 1)
    note = next(n for n in plan.gpus.notes if "CPU threads" in n)
    assert "per server (2 servers)" in note
    used = 2 * int(plan.server.env["OMP_NUM_THREADS"]) + int(plan.trainer_env["OMP_NUM_THREADS"])
    over = used > len(os.sched_getaffinity(0))
    assert ("servers and the trainer need more threads than" in note) == over
    # the twelfth session's trial read "they split the cores" and "they contend" in one line on 2 cores
    assert ("split the cores" in note) == (not over), note


def test_the_plan_says_how_long_and_large_the_run_is():
    """The thirteenth session's trial: the dry run showed the commands but not the run's size; its ``run`` row
    names the steps (or epochs), completions, length, rewards, learning rate and staleness, from the config."""
    from asyncgrpo_cli.launch.plan import run_size

    assert run_size(compose(["+recipe=smoke"])) == ("8 steps | 4 completions a prompt, up to 48 tokens | reward "
                                                   "accuracy_reward | learning rate 3e-05 | max_staleness 4 | "
                                                   "activation checkpointing off")
    epochs = run_size(compose(["+recipe=smoke", "trainer.max_steps=-1", "trainer.num_train_epochs=2"]))
    assert epochs.startswith("2 epochs over the prompts | ")
    assert run_size(compose(["+recipe=smoke", "trainer.max_steps=0"])).startswith("0 steps | ")  # refused, not epochs
    assert "learning rate 1e-06 | max_staleness 0 | activation checkpointing on" in run_size(
        cfg_of("staleness.max_staleness=0"))
    assert run_size(cfg_of("trainer.activation_checkpointing_kwargs={every_n_layers: 2}")).endswith(
        "activation checkpointing on every 2nd layer")


def test_the_run_row_of_a_resumed_run_names_its_checkpoint(tmp_path):
    """Second trial of 2026-12-05: a dry run of the resume command said only ``16 steps``."""
    from asyncgrpo_cli.launch.plan import run_size

    from .fake_trainer import write_checkpoint

    write_checkpoint(str(tmp_path), 2)
    resumed = run_size(compose(["+recipe=smoke", f"trainer.output_dir={tmp_path}", "trainer.max_steps=16",
                                "trainer.resume_from_checkpoint=true"]))
    assert resumed.startswith("16 steps, resumed from checkpoint-2 (step 2) | "), resumed
    named = run_size(compose(["+recipe=smoke", f"trainer.resume_from_checkpoint={tmp_path}/checkpoint-9"]))
    assert named.startswith(f"8 steps, resumed from {tmp_path}/checkpoint-9 | ")  # unresolved: as given
