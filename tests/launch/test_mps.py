"""`launch.mps`: the plan's refusals and environment, and the daemon's life in a job (stand-in `fake_mps.py`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.launch import mps as mps_mod
from asyncgrpo_cli.launch import plan as plan_mod
from asyncgrpo_cli.launch.mps import gpu_uuid
from asyncgrpo_cli.launch.plan import build_launch_plan
from asyncgrpo_cli.launch.supervisor import Timeouts, run_train

from .conftest import HERE, alive, hook
from .test_colocate import H200, cfg_of

FAKE_MPS = str(HERE / "fake_mps.py")
FAST = Timeouts(trainer_grace_s=30.0, trainer_term_s=5.0, server_term_s=5.0, group_term_s=1.0, poll_s=0.1)


@pytest.fixture(autouse=True)
def uuids(monkeypatch):
    """nvidia-smi's answer for GPU N: GPU-uuid-N."""
    monkeypatch.setattr(mps_mod, "gpu_uuid",
                        lambda device: device if device.startswith("GPU-") else f"GPU-uuid-{device}")


def test_the_plan_puts_both_processes_under_this_runs_daemon(tmp_path, monkeypatch):
    monkeypatch.setattr(mps_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    plan = build_launch_plan(cfg_of(tmp_path, "launch.mps=true"), gpu_count=1, gpu_memory=H200)
    assert not plan.problems, plan.problems
    pipe = str(plan.mps.pipe_dir)
    assert plan.server.env["CUDA_MPS_PIPE_DIRECTORY"] == pipe == plan.trainer_env["CUDA_MPS_PIPE_DIRECTORY"]
    assert len(pipe) + len("/control") < 100 and plan.mps.pipe_dir == mps_mod.pipe_dir_of(tmp_path / "run")
    assert plan.mps.log_dir == tmp_path / "run" / "logs" / "mps"
    assert any(n.startswith("CUDA MPS (launch.mps=true)") for n in plan.gpus.notes)
    assert "CUDA_MPS_PIPE_DIRECTORY=" in plan.trainer_shell_line()
    assert build_launch_plan(cfg_of(tmp_path), gpu_count=1, gpu_memory=H200).mps is None  # off by default
    # the MPS server renumbers what its daemon sees: all three name the GPU by its UUID
    assert plan.mps.daemon_env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid-0" == plan.trainer_env["CUDA_VISIBLE_DEVICES"]
    assert plan.server.env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid-0"


def test_the_gpu_ids_a_child_gets_are_the_users_visible_ones(tmp_path, monkeypatch):
    """With CUDA_VISIBLE_DEVICES exported, index 0 of the plan is the first GPU the user made visible: a child's
    variable replaces the parent's, so "0" there would be the machine's GPU 0."""
    monkeypatch.setattr(mps_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5c1e")
    plan = build_launch_plan(cfg_of(tmp_path), gpu_count=1, gpu_memory=H200)
    assert plan.server.env["CUDA_VISIBLE_DEVICES"] == "3" == plan.trainer_env["CUDA_VISIBLE_DEVICES"]
    mps_plan = build_launch_plan(cfg_of(tmp_path, "launch.mps=true"), gpu_count=1, gpu_memory=H200).mps
    assert mps_plan.daemon_env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid-3"  # the user's GPU 3, not the machine's 0
    two = build_launch_plan(cfg_of(tmp_path), gpu_count=2, gpu_memory=H200)
    assert (two.server.env["CUDA_VISIBLE_DEVICES"], two.trainer_env["CUDA_VISIBLE_DEVICES"]) == ("3", "GPU-5c1e")


@pytest.mark.parametrize("overrides, gpus, which, says", [
    (["launch.colocate=false"], 2, "/usr/bin/x", "puts the server and the trainer on separate GPUs"),
    ([], 0, "/usr/bin/x", "runs the trainer on the CPU (no GPU is visible here). Fix: launch.mps=false"),
    (["sampler.backend=external", "sampler.url=http://127.0.0.1:9"], 1, "/usr/bin/x", "starts no server"),
    ([], 1, None, "is not on PATH"),
    (["launch.server_gpus=[7]"], 1, "/usr/bin/x", "could not read the UUID of GPU 7"),
])
def test_the_plan_refuses_mps_where_it_cannot_apply(tmp_path, monkeypatch, overrides, gpus, which, says):
    monkeypatch.setattr(mps_mod.shutil, "which", lambda name: which)
    monkeypatch.setattr(mps_mod, "gpu_uuid", lambda device: None if device == "7" else f"GPU-uuid-{device}")
    plan = build_launch_plan(cfg_of(tmp_path, "launch.mps=true", *overrides), gpu_count=gpus, gpu_memory=H200)
    problems = [p for p in plan.problems if p.startswith("launch.mps=true")]
    assert len(problems) == 1 and says in problems[0] and "Fix: launch.mps=false" in problems[0], plan.problems
    assert plan.mps is None and "CUDA_MPS_PIPE_DIRECTORY" not in plan.trainer_env


def _stand_in(monkeypatch, tmp_path, mode: str = "ok"):
    """The plan gets an MPS daemon on the CPU (the stand-in), and the hook starts `fake_mps.py` for it."""
    real = plan_mod.plan_mps

    def planned(output_dir, *, colocated, starts_server, device="0", on_cpu=False, which=None):
        return real(output_dir, colocated=True, starts_server=starts_server, device=device,
                    which=lambda name: sys.executable)

    monkeypatch.setattr(plan_mod, "plan_mps", planned)
    base = hook("ok", "ok", tmp_path / "pids")
    (tmp_path / "pids").mkdir()

    def _hook(name, argv):
        if name == "mps":
            return [sys.executable, FAKE_MPS, "daemon", *([mode] if mode != "ok" else [])]
        if name == "mps-quit":
            return [sys.executable, FAKE_MPS, "quit"]
        return base(name, argv)
    return _hook


def mps_job(make_cfg, tmp_path, monkeypatch, mode: str = "ok") -> tuple[int, str, Path]:
    """A smoke-sized job with ``launch.mps=true`` and the stand-in daemon in ``mode``: (exit status, console text,
    run folder)."""
    cfg, out = make_cfg("launch.mps=true")
    console = Console(record=True, width=200)
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=_stand_in(monkeypatch, tmp_path, mode))
    return rc, console.export_text(), out


def test_a_job_starts_the_daemon_first_and_quits_it_at_the_end(make_cfg, tmp_path, monkeypatch):
    rc, text, out = mps_job(make_cfg, tmp_path, monkeypatch)
    assert rc == 0, text
    assert text.index("started CUDA MPS (pid") < text.index("started the server")
    log = (out / "logs" / "mps.log").read_text()
    assert "fake mps: quit received" in log and f"log dir {out / 'logs' / 'mps'}" in log
    pid = int(log.split("fake mps: pid ")[1].split()[0])
    assert not alive(pid)
    assert not mps_mod.pipe_dir_of(out).exists()  # the pipe folder is removed
    assert "CUDA MPS: 2 CUDA process(es) joined the daemon (expected: vLLM's engine and the trainer)" in text


def test_a_process_that_did_not_join_mps_is_said(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_CLIENTS", "1")
    rc, text, _ = mps_job(make_cfg, tmp_path, monkeypatch)
    assert rc == 0 and "warning: CUDA MPS: 1 process(es) joined the daemon, 2 expected" in text, text


def test_a_daemon_that_does_not_start_fails_the_job_before_the_server(make_cfg, tmp_path, monkeypatch):
    rc, text, out = mps_job(make_cfg, tmp_path, monkeypatch, "die")
    assert rc == 1, text
    assert "launch.mps=true: the CUDA MPS control daemon exited (4) before it was ready" in text
    assert "launch.mps=false" in text and "cannot start (pretend)" in text
    assert "started the server" not in text and not (tmp_path / "pids" / "server.pid").exists()
    assert not mps_mod.pipe_dir_of(out).exists()


def test_mps_composes_and_the_cpu_smoke_plan_refuses_it():
    cfg = compose(["+recipe=smoke", "launch.mps=true"])
    assert cfg.launch.mps is True
    plan = build_launch_plan(cfg, gpu_count=0)
    assert any(p.startswith("launch.mps=true: CUDA MPS lets the server and the trainer share") and
               p.endswith("no GPU is visible here). Fix: launch.mps=false") for p in plan.problems), plan.problems


def test_gpu_uuid_reads_nvidia_smi_and_keeps_a_uuid(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n[ \"$2\" = 3 ] && echo GPU-3f2a-77 && exit 0\necho 'No devices were found'; exit 6\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_uuid("3") == "GPU-3f2a-77" and gpu_uuid("4") is None
    assert gpu_uuid("MIG-1d2e") == "MIG-1d2e"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert gpu_uuid("3") is None


def test_a_daemon_gone_during_the_run_is_said_once(make_cfg, tmp_path, monkeypatch):
    rc, text, out = mps_job(make_cfg, tmp_path, monkeypatch, "leave")
    assert rc == 0, text  # the run goes on: the stand-in's clients need no daemon
    assert text.count("the CUDA MPS control daemon (pid") == 1 and "exited with code 0 during the run" in text, text
    assert not mps_mod.pipe_dir_of(out).exists()
