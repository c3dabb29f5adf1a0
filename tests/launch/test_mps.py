"""`launch.mps`: the plan's refusals and environment, and the daemon's life in a job (stand-in `fake_mps.py`)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.launch import mps as mps_mod
from asyncgrpo_cli.launch import plan as plan_mod
from asyncgrpo_cli.launch.mps import gpu_uuid
from asyncgrpo_cli.launch.plan import build_launch_plan
from asyncgrpo_cli.launch.supervisor import Timeouts, run_train
from asyncgrpo_cli.testing import poll_until

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
    assert build_launch_plan(cfg_of(tmp_path, "launch.mps=false"), gpu_count=1, gpu_memory=H200).mps is None
    # the MPS server renumbers what its daemon sees: all three name the GPU by its UUID
    assert plan.mps.daemon_env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid-0" == plan.trainer_env["CUDA_VISIBLE_DEVICES"]
    assert plan.server.env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid-0"


def test_a_trainer_of_priority_below_normal_leaves_vllms_kernels_first(tmp_path, monkeypatch):
    """``launch.mps_trainer_priority=below_normal``: ``CUDA_MPS_CLIENT_PRIORITY=1`` for the trainer alone (one the user
    exported is taken from vLLM's environment); unused without MPS, and said so; refused with launch.mps=false."""
    monkeypatch.setattr(mps_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
    plan = build_launch_plan(cfg_of(tmp_path, "launch.mps_trainer_priority=below_normal"), gpu_count=1,
                             gpu_memory=H200)
    assert not plan.problems, plan.problems
    assert plan.trainer_env["CUDA_MPS_CLIENT_PRIORITY"] == "1" and "CUDA_MPS_CLIENT_PRIORITY" not in plan.server.env
    assert any("MPS client of priority below normal" in n for n in plan.gpus.notes), plan.gpus.notes
    assert "CUDA_MPS_CLIENT_PRIORITY=1" in plan.trainer_shell_line()
    default = build_launch_plan(cfg_of(tmp_path), gpu_count=1, gpu_memory=H200)
    assert "CUDA_MPS_CLIENT_PRIORITY" not in default.trainer_env and not any("priority below" in n for n in default.gpus.notes)
    on_policy = build_launch_plan(cfg_of(tmp_path, "launch.mps_trainer_priority=below_normal",
                                         "staleness.max_staleness=0"), gpu_count=1, gpu_memory=H200)
    assert on_policy.mps is None and "CUDA_MPS_CLIENT_PRIORITY" not in on_policy.trainer_env
    assert on_policy.gpus.unused == ["launch.mps_trainer_priority=below_normal is unused: this job runs without MPS "
                                     "(on-policy training (staleness.max_staleness=0) takes turns on the GPU anyway, "
                                     "and trained 3.7% fewer tok/s under MPS)"], on_policy.gpus.unused
    with pytest.raises(ValueError, match=r"launch.mps_trainer_priority='below_normal'.*launch.mps=false starts none"):
        cfg_of(tmp_path, "launch.mps_trainer_priority=below_normal", "launch.mps=false")
    # a bad value is one problem, with launch.mps=false too; its case-fixed spelling is the fix
    with pytest.raises(ValueError) as bad:
        cfg_of(tmp_path, "launch.mps_trainer_priority=BELOW_NORMAL", "launch.mps=false")
    assert str(bad.value).count("launch.mps_trainer_priority='") == 1
    assert "Fix: set launch.mps_trainer_priority=below_normal" in str(bad.value)
    for typed, meant in (("low", "below_normal"), ("lower", "below_normal"), ("high", "normal")):  # a trial typed low
        with pytest.raises(ValueError, match=f"Fix: set launch.mps_trainer_priority={meant}"):
            cfg_of(tmp_path, f"launch.mps_trainer_priority={typed}")
    # launch.mps=true where it cannot apply (no GPU): the refusal names the priority's fix too, and no "unused" note
    cpu = build_launch_plan(cfg_of(tmp_path, "launch.mps=true", "launch.mps_trainer_priority=below_normal"),
                            gpu_count=0, gpu_memory=H200)
    assert [p for p in cpu.problems if p.startswith("launch.mps=true") and
            p.endswith("(and launch.mps_trainer_priority=normal: its below_normal needs MPS too)")], cpu.problems
    assert not any("is unused" in n for n in cpu.gpus.notes), cpu.gpus.notes


def test_the_gpu_ids_a_child_gets_are_the_users_visible_ones(tmp_path, monkeypatch):
    """With CUDA_VISIBLE_DEVICES exported, index 0 of the plan is the first GPU the user made visible: a child's
    variable replaces the parent's, so "0" there would be the machine's GPU 0."""
    monkeypatch.setattr(mps_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5c1e")
    plan = build_launch_plan(cfg_of(tmp_path, "launch.mps=false"), gpu_count=1, gpu_memory=H200)
    assert plan.server.env["CUDA_VISIBLE_DEVICES"] == "3" == plan.trainer_env["CUDA_VISIBLE_DEVICES"]
    mps_plan = build_launch_plan(cfg_of(tmp_path, "launch.mps=true"), gpu_count=1, gpu_memory=H200).mps
    assert mps_plan.daemon_env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid-3"  # the user's GPU 3, not the machine's 0
    two = build_launch_plan(cfg_of(tmp_path), gpu_count=2, gpu_memory=H200)
    assert (two.server.env["CUDA_VISIBLE_DEVICES"], two.trainer_env["CUDA_VISIBLE_DEVICES"]) == ("3", "GPU-5c1e")
    asked = []  # the plan's memory read asks nvidia-smi for the same GPU (`colocate.gpu_memory_bytes`)
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: asked.append(argv[2]) or subprocess.CompletedProcess(
        argv, 0, stdout="143771\n"))
    from asyncgrpo_cli.server.colocate import gpu_memory_bytes

    assert gpu_memory_bytes(1) == 143771 * 2**20 == gpu_memory_bytes(0) and asked == ["GPU-5c1e", "3"]


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


@pytest.mark.parametrize("overrides, gpus, which, on, says", [
    ([], 1, "/usr/bin/x", True, None),  # asynchronous, one GPU, vLLM started here: on
    (["staleness.max_staleness=0"], 1, "/usr/bin/x", False, "on-policy training (staleness.max_staleness=0) takes turns"),
    ([], 1, None, False, "`nvidia-cuda-mps-control` is not on PATH"),
    (["launch.server_gpus=[7]"], 1, "/usr/bin/x", False, "could not read the UUID of GPU 7"),
    (["launch.colocate=false"], 2, "/usr/bin/x", False, None),  # nothing shares a GPU: not a word
    ([], 0, "/usr/bin/x", False, None),
    (["sampler.backend=external", "sampler.url=http://127.0.0.1:9"], 1, "/usr/bin/x", False, None),
])
def test_automatic_mps_is_on_for_an_asynchronous_colocated_job_and_says_why_not_elsewhere(
        tmp_path, monkeypatch, overrides, gpus, which, on, says):
    """``launch.mps=null`` (the default): a reason not to is a plan note, never a problem."""
    monkeypatch.setattr(mps_mod.shutil, "which", lambda name: which)
    monkeypatch.setattr(mps_mod, "gpu_uuid", lambda device: None if device == "7" else f"GPU-uuid-{device}")
    plan = build_launch_plan(cfg_of(tmp_path, *overrides), gpu_count=gpus, gpu_memory=H200)
    assert not [p for p in plan.problems if "mps" in p.lower()], plan.problems
    notes = [n for n in plan.gpus.notes if n.startswith("CUDA MPS")]
    assert (plan.mps is not None) is on and (plan.mps is None or plan.mps.automatic)
    if on:
        assert notes[0].startswith("CUDA MPS (launch.mps=null (automatic), as this job is asynchronous")
        assert plan.trainer_env["CUDA_MPS_PIPE_DIRECTORY"] == str(plan.mps.pipe_dir)
    elif says:
        assert len(notes) == 1 and notes[0].startswith("CUDA MPS off (launch.mps=null (automatic)): ")
        assert says in notes[0] and "Fix:" not in notes[0], notes
        # the priority's unused note quotes the reason alone, not the note's own advice on launch.mps
        low = build_launch_plan(cfg_of(tmp_path, *overrides, "launch.mps_trainer_priority=below_normal"),
                                gpu_count=gpus, gpu_memory=H200).gpus.unused
        assert len(low) == 1 and low[0].startswith("launch.mps_trainer_priority=below_normal is unused: this job runs "
                                                   "without MPS (") and says in low[0], low
        assert "launch.mps=" not in low[0].split("without MPS", 1)[1], low
    else:
        assert not notes, notes
    if not on:
        assert "CUDA_MPS_PIPE_DIRECTORY" not in plan.trainer_env


def mps_control(folder: Path, mode: str = "ok") -> str:
    """A program ``folder/nvidia-cuda-mps-control`` that runs the stand-in (`fake_mps.py`) with ``mode``."""
    folder.mkdir(parents=True, exist_ok=True)
    program = folder / "nvidia-cuda-mps-control"
    program.write_text(f"#!/bin/sh\nFAKE_MPS_MODE={mode} exec {shlex.quote(sys.executable)} "
                       f"{shlex.quote(FAKE_MPS)} \"$@\"\n")
    program.chmod(0o755)
    return str(program)


FAILING_PROBE = [sys.executable, "-c", "print('mps probe: cuCtxCreate failed: CUDA_ERROR_MPS_SERVER_NOT_READY (805): "
                 "pretend'); raise SystemExit(1)"]


def _stand_in(monkeypatch, tmp_path, mode: str = "ok", probe: list[str] | None = None):
    """The plan gets an MPS daemon on the CPU: the stand-in's program (`mps_control`) is its control program, run
    under the keeper as a job runs it. The probe is the real one (no CUDA driver here: not probed), or ``probe``."""
    real = plan_mod.plan_mps
    control = mps_control(tmp_path / "bin", mode)

    def planned(output_dir, *, colocated, starts_server, device="0", on_cpu=False, which=None):
        return real(output_dir, colocated=True, starts_server=starts_server, device=device,
                    which=lambda name: control)

    monkeypatch.setattr(plan_mod, "plan_mps", planned)
    base = hook("ok", "ok", tmp_path / "pids")
    (tmp_path / "pids").mkdir()

    def _hook(name, argv):
        if name == "mps-probe":
            return probe or argv
        if name in ("mps", "mps-quit"):
            return argv
        return base(name, argv)
    return _hook


def mps_job(make_cfg, tmp_path, monkeypatch, mode: str = "ok", probe: list[str] | None = None) -> tuple[int, str, Path]:
    """A smoke-sized job with ``launch.mps=true`` and the stand-in daemon in ``mode``: (exit status, console text,
    run folder)."""
    cfg, out = make_cfg("launch.mps=true")
    console = Console(record=True, width=200)
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST,
                   _commands=_stand_in(monkeypatch, tmp_path, mode, probe))
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
    assert "CUDA MPS: 2 CUDA process(es) joined the daemon (vLLM's engine and the trainer at least;" in text


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


@pytest.mark.parametrize("mode, probe, why", [
    ("die", None, "the CUDA MPS control daemon exited (4) before it was ready"),
    ("ok", FAILING_PROBE, "a CUDA context through the daemon failed (cuCtxCreate failed: "
                          "CUDA_ERROR_MPS_SERVER_NOT_READY (805): pretend)"),
])
def test_an_automatic_daemon_that_does_not_start_is_skipped_and_the_job_runs_without_it(make_cfg, tmp_path,
                                                                                        monkeypatch, mode, probe, why):
    """``launch.mps=null`` chose MPS (`plan_mps_auto`, on the CPU here as if colocated on a GPU) and the daemon dies
    before it is ready, or a client cannot get a context through it: one line says so, the job runs as with
    ``launch.mps=false``."""
    control = mps_control(tmp_path / "bin", mode)
    real = plan_mod.plan_mps_auto

    def chosen(output_dir, *, colocated, starts_server, asynchronous, device="0", on_cpu=False, which=None):
        return real(output_dir, colocated=True, starts_server=starts_server, asynchronous=asynchronous,
                    device=device, which=lambda name: control)

    monkeypatch.setattr(plan_mod, "plan_mps_auto", chosen)
    hooks = _stand_in(monkeypatch, tmp_path, mode, probe)
    cfg, out = make_cfg()
    assert cfg.launch.mps is None
    console = Console(record=True, width=300)
    rc = run_train(cfg, console=console, gpu_count=0, timeouts=FAST, _commands=hooks)
    text = console.export_text()
    assert rc == 0, text
    assert f"CUDA MPS could not start ({why}; its log: {out / 'logs' / 'mps.log'}); this job runs without it" in text
    assert text.index("this job runs without it") < text.index("started the server")
    assert "joined the daemon" not in text and not mps_mod.pipe_dir_of(out).exists()


def test_without_mps_takes_the_pipe_folder_out_of_both_environments(tmp_path):
    plan_ = mps_mod.MpsPlan("/bin/true", tmp_path / "pipe", tmp_path / "logs" / "mps", device="GPU-uuid-0")
    from types import SimpleNamespace

    launch = SimpleNamespace(mps=plan_, server=SimpleNamespace(env={"A": "1", **plan_.client_env}),
                             trainer_env={"B": "2", **plan_.client_env})
    line = mps_mod.without_mps(launch, None, "no socket")
    assert launch.mps is None and line.startswith("CUDA MPS could not start (no socket; its log: ")
    assert launch.server.env == {"A": "1", "CUDA_VISIBLE_DEVICES": "GPU-uuid-0"}
    assert launch.trainer_env == {"B": "2", "CUDA_VISIBLE_DEVICES": "GPU-uuid-0"}


def test_with_launch_mps_true_a_failing_probe_fails_the_job_before_the_server(make_cfg, tmp_path, monkeypatch):
    rc, text, out = mps_job(make_cfg, tmp_path, monkeypatch, "ok", FAILING_PROBE)
    assert rc == 1, text
    assert "launch.mps=true: a CUDA context through the daemon failed (cuCtxCreate failed: " in text
    assert "started the server" not in text and not mps_mod.pipe_dir_of(out).exists()


def test_the_probe_passes_a_context_and_says_nothing_where_it_cannot_probe(tmp_path):
    """`mps.probe_daemon`: exit 0 (a context) and exit 3 (no CUDA driver library: not probed) are no problem; the
    probe runs with the daemon's pipe folder and GPU."""
    plan = mps_mod.MpsPlan("/bin/true", tmp_path / "pipe", tmp_path / "logs", device="GPU-uuid-0")
    seen = tmp_path / "env.txt"
    code = ("import os, sys; open(sys.argv[1], 'w').write(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + ' ' + "
            "os.environ['CUDA_VISIBLE_DEVICES']); raise SystemExit(int(sys.argv[2]))")
    assert mps_mod.probe_daemon(plan, [sys.executable, "-c", code, str(seen), "0"]) is None
    assert len(plan.probe_pids) == 1  # left out of the closing count
    assert seen.read_text() == f"{tmp_path / 'pipe'} GPU-uuid-0"
    assert mps_mod.probe_daemon(plan, [sys.executable, "-c", code, str(seen), "3"]) is None
    assert mps_mod.probe_daemon(plan, [sys.executable, "-c", code, str(seen), "1"]) == (
        "a CUDA context through the daemon failed (exit status 1)")
    assert mps_mod.probe_daemon(plan) is None  # the real probe on this machine: no CUDA driver, not probed
    import threading

    stop = threading.Event()  # a stop signal while the probe hangs: it is killed, not waited for
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    hung = [sys.executable, "-c", "import time; time.sleep(120)"]
    assert mps_mod.probe_daemon(plan, hung, stop=stop) == mps_mod.STOPPED_BEFORE_READY
    assert time.monotonic() - started < mps_mod.PROBE_S / 2


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


# ------------------------------------------------------------------------------------ the daemon's keeper
PACKAGE_ROOT = str(Path(mps_mod.__file__).resolve().parents[2])  # the keeper run here is the one imported here
DEADLINE_S = 15.0


def until(predicate, what: str, deadline_s: float = DEADLINE_S):
    """`asyncgrpo_cli.testing.poll_until` with this module's deadline."""
    return poll_until(predicate, what, deadline_s, poll_s=0.02)


class KeeperRun:
    """``python -m asyncgrpo_cli.launch.mps_keeper`` over the stand-in (mode ``mode``), started by the test in a
    session of its own (the daemon joins its group, which the test kills at the end), its output in ``log``;
    the stand-in's clients are the live pids listed in ``clients``."""

    def __init__(self, tmp_path: Path, *args: str, mode: str = "ok", env: dict[str, str] | None = None) -> None:
        self.pipe, self.clients, self.log = tmp_path / "pipe", tmp_path / "clients", tmp_path / "keeper.log"
        self.pipe.mkdir(parents=True)
        (tmp_path / "mps-logs").mkdir()
        full_env = {**os.environ, mps_mod.PIPE_ENV: str(self.pipe), mps_mod.LOG_ENV: str(tmp_path / "mps-logs"),
                    "FAKE_MPS_CLIENT_PIDS": str(self.clients), **(env or {}),
                    "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        argv = mps_mod.keeper_argv(mps_mod.MpsPlan(mps_control(tmp_path / "bin", mode), self.pipe, tmp_path))
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([*argv, "--poll", "0.05", *args], stdout=out, stderr=subprocess.STDOUT,
                                         env=full_env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def daemon(self) -> int:
        """The daemon's pid, once it is ready (its control socket made)."""
        until(lambda: (self.pipe / "control").exists(), f"the stand-in's control socket; log:\n{self.text()}")
        return int((self.pipe / "fake-daemon.pid").read_text())

    def says(self, line: str) -> None:
        until(lambda: line in self.text(), f"{line!r} in the keeper's log:\n{self.text()}")

    def wait(self) -> int:
        return self.proc.wait(timeout=DEADLINE_S)

    def end(self) -> None:
        """SIGKILL what is left of the keeper's group (the keeper, the daemon)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def keeper(tmp_path):
    """``keeper(*args, mode=..., env=...)`` starts a `KeeperRun`; what it started is killed at the end."""
    runs: list[KeeperRun] = []

    def start(*args: str, mode: str = "ok", env: dict[str, str] | None = None) -> KeeperRun:
        runs.append(KeeperRun(tmp_path / f"k{len(runs)}", *args, mode=mode, env=env))
        return runs[-1]

    yield start
    for run in runs:
        run.end()


@pytest.fixture
def client():
    """A process standing for a CUDA client of the daemon (the test's own; killed at the end if still there)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(timeout=DEADLINE_S)


def test_the_job_runs_the_daemon_under_its_keeper_draining_at_least_the_stop_grace(tmp_path):
    plan = mps_mod.MpsPlan("/usr/bin/nvidia-cuda-mps-control", tmp_path / "pipe", tmp_path / "logs")
    argv = mps_mod.keeper_argv(plan)
    assert argv == [sys.executable, "-m", "asyncgrpo_cli.launch.mps_keeper", plan.control, "--drain-timeout", "600"]
    assert mps_mod.keeper_argv(plan, 900.5)[-1] == "900.5" and mps_mod.keeper_argv(plan, 30.0)[-1] == "600"
    from asyncgrpo_cli.launch import mps_keeper

    for bad in (["--drain-timeout", "-5"], ["--poll", "nan"]):
        with pytest.raises(SystemExit) as exited:
            mps_keeper.main([plan.control, *bad])
        assert exited.value.code == 2
    assert f"its log: {tmp_path / 'mps.log'}" in plan.note()  # the foreground daemon's output


def test_the_keeper_keeps_the_daemon_until_its_clients_are_gone(keeper, client):
    k = keeper()
    daemon = k.daemon()
    k.clients.write_text(f"{client.pid}\n")
    os.kill(k.proc.pid, signal.SIGTERM)  # what the supervisor's death sends it
    k.says(f"waiting for 1 client(s) of the MPS server: pids {client.pid}")
    os.kill(k.proc.pid, signal.SIGTERM)  # a second signal does not cut the drain short
    k.says("SIGTERM received: still waiting for the clients")
    assert k.proc.poll() is None and alive(daemon) and not (k.pipe / "quit").exists(), k.text()
    assert mps_mod.draining_keeper(k.pipe) == k.proc.pid  # a job started again here waits for it
    client.kill()  # the trainer's save is done: it exits, and the daemon may go
    assert k.wait() == 0, k.text()
    assert "no client left: the daemon is quit now" in k.text() and "fake mps: quit received" in k.text()
    assert not alive(daemon) and not k.pipe.exists()  # the pipe folder goes with it, as stop_daemon removes it


def test_the_keeper_quits_a_daemon_without_clients_at_once(keeper):
    k = keeper()
    daemon = k.daemon()
    start = time.monotonic()
    os.kill(k.proc.pid, signal.SIGINT)
    assert k.wait() == 0, k.text()
    assert time.monotonic() - start < 5.0  # not the drain timeout (600 s)
    assert "SIGINT received" in k.text() and "no client left: the daemon is quit now" in k.text()
    assert "fake mps: quit received" in k.text() and not alive(daemon)


def test_the_drain_timeout_bounds_the_wait_for_clients(keeper, client):
    k = keeper("--drain-timeout", "1")
    daemon = k.daemon()
    k.clients.write_text(f"{client.pid}\n")
    start = time.monotonic()
    os.kill(k.proc.pid, signal.SIGTERM)
    assert k.wait() == 0, k.text()
    assert 1.0 <= time.monotonic() - start < 10.0
    assert f"the drain timeout (1 s) passed with client(s) {client.pid} still there" in k.text()
    assert "fake mps: quit received" in k.text() and not alive(daemon) and client.poll() is None


def test_a_daemon_that_does_not_answer_is_not_waited_for_and_is_killed_if_it_stays(keeper, client):
    k = keeper("--quit-timeout", "0.5", env={"FAKE_MPS_CONTROL_FAILS": "1"})
    daemon = k.daemon()
    k.clients.write_text(f"{client.pid}\n")
    start = time.monotonic()
    os.kill(k.proc.pid, signal.SIGTERM)
    assert k.wait() == 137, k.text()  # the daemon's status: SIGKILL
    assert time.monotonic() - start < 10.0
    assert "the daemon does not answer: it is quit now" in k.text()
    assert "did not exit within 0.5 s of `quit`: SIGKILL" in k.text() and not alive(daemon)


def test_a_daemon_that_ignores_quit_is_killed(keeper):
    k = keeper("--quit-timeout", "0.5", mode="stubborn")
    daemon = k.daemon()
    os.kill(k.proc.pid, signal.SIGTERM)
    assert k.wait() == 137, k.text()
    assert "no client left" in k.text() and "did not exit within 0.5 s of `quit`: SIGKILL" in k.text()
    assert not alive(daemon) and not k.pipe.exists()


def test_a_killed_keeper_leaves_no_daemon(keeper):
    k = keeper()
    daemon = k.daemon()
    os.kill(k.proc.pid, signal.SIGKILL)
    k.proc.wait(timeout=DEADLINE_S)
    until(lambda: not alive(daemon), f"the daemon {daemon} gone after its keeper was killed")


def test_the_keeper_exits_with_the_daemon(keeper):
    k = keeper()  # the normal end: `quit` on the control pipe (stop_daemon)
    daemon = k.daemon()
    subprocess.run([str(k.pipe.parent / "bin" / "nvidia-cuda-mps-control")], input="quit\n", text=True, check=True,
                   env={**os.environ, mps_mod.PIPE_ENV: str(k.pipe)}, timeout=DEADLINE_S)
    assert k.wait() == 0 and not alive(daemon), k.text()
    assert "fake mps: quit received" in k.text() and "the daemon is quit now" not in k.text()
    assert (k.pipe / "keeper.pid").read_text().strip() == str(k.proc.pid)  # stop_daemon removes the folder
    failing = keeper(mode="die")
    assert failing.wait() == 4 and "cannot start (pretend)" in failing.text()


def test_joined_clients_counts_distinct_pids_in_either_log(tmp_path):
    """`mps.joined_clients`: the foreground daemon's stdout (``logs/mps.log``) and a background daemon's
    ``control.log``; a process that connects twice counts once; no log: None."""
    plan = mps_mod.MpsPlan("/bin/true", tmp_path / "pipe", tmp_path / "logs" / "mps")
    assert mps_mod.joined_clients(plan) is None
    plan.log_dir.mkdir(parents=True)
    plan.stdout_log.write_text("[x Control 7] NEW CLIENT 2348 from user 0: Server is not ready\n"
                               "[x Control 7] NEW CLIENT 2348 from user 0: Server already exists\n"
                               "mps keeper: 12:00:00 waiting for 1 client(s) of the MPS server: pids 3377\n")
    assert plan.stdout_log == tmp_path / "logs" / "mps.log" and mps_mod.joined_clients(plan) == 1
    (plan.log_dir / "control.log").write_text("[y] NEW CLIENT 3377 from user 0: Server already exists\n")
    assert mps_mod.joined_clients(plan) == 2
    plan.probe_pids.add(3377)  # the probe's context is no client of the job's
    assert mps_mod.joined_clients(plan) == 1


def test_a_job_in_a_folder_whose_killed_jobs_keeper_still_drains_is_refused_until_it_is_gone(tmp_path):
    """`mps.start_daemon` with a live keeper's pid in the pipe folder (`mps.draining_keeper`): refused, naming the
    pid and the fix, and the folder is left as it is; once that keeper is gone the start goes on."""
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "control").write_text("")  # the draining daemon's socket
    plan = mps_mod.MpsPlan(mps_control(tmp_path / "bin", "ok"), pipe, tmp_path / "logs" / "mps")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                 "asyncgrpo_cli.launch.mps_keeper"], start_new_session=True)
    try:
        (pipe / "keeper.pid").write_text(f"{stand_in.pid}\n")
        until(lambda: mps_mod.draining_keeper(pipe) == stand_in.pid, "the stand-in keeper seen as draining")
        child, problem = mps_mod.start_daemon(plan, tmp_path / "mps.log")
        assert child is None and f"kill {stand_in.pid}" in problem and "still waits for its clients" in problem
        assert (pipe / "control").exists() and (pipe / "keeper.pid").exists()  # nothing removed
    finally:
        stand_in.kill()
        stand_in.wait(timeout=DEADLINE_S)
    assert mps_mod.draining_keeper(pipe) is None
    (pipe / "keeper.pid").write_text(f"{os.getpid()}\n")  # a pid that runs but is no keeper
    assert mps_mod.draining_keeper(pipe) is None


def test_a_stop_signal_ends_the_wait_for_the_daemons_socket(tmp_path):
    """`mps.start_daemon` with the job's stop event: a daemon that makes no socket is not waited for its
    `READY_S` once the stop comes; the caller then stops it (the supervisor exits 130 at once)."""
    import threading

    plan = mps_mod.MpsPlan("/bin/true", tmp_path / "pipe", tmp_path / "logs" / "mps")
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    child, problem = mps_mod.start_daemon(plan, tmp_path / "mps.log",
                                          [sys.executable, "-c", "import time; time.sleep(120)"], stop)
    try:
        assert problem == mps_mod.STOPPED_BEFORE_READY and child.poll() is None
        assert time.monotonic() - started < mps_mod.READY_S / 2
    finally:
        child.signal_group(signal.SIGKILL)
        until(lambda: child.poll() is not None, "the stand-in daemon gone")


def test_the_keeper_says_repeated_signals_once_with_a_count(capsys):
    """A dead supervisor's other children may pass their SIGTERM on: one line per signal name, not per signal."""
    from asyncgrpo_cli.launch.mps_keeper import Keeper

    k = Keeper("/bin/true", drain_s=1.0)
    k.signals += [signal.SIGTERM] * 4 + [signal.SIGINT]
    k._say_signals("draining")
    k._say_signals("draining")  # nothing new: nothing said
    k.signals.append(signal.SIGTERM)
    k._say_signals("still waiting")
    lines = [x.split(" ", 3)[3] for x in capsys.readouterr().out.splitlines()]  # "mps keeper: HH:MM:SS ..."
    assert lines == ["SIGTERM received (4 times): draining", "SIGINT received: draining",
                     "SIGTERM received: still waiting"], lines
