"""Checkpoint layout, completeness, resume resolution, rollout_state.json checks and the run lock (no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo_cli.train.checkpoint import (CheckpointError, check_writable, checkpoint_problem,
                                            newest_complete_checkpoint, partial_dir, publish, remove_partials,
                                            resolve_resume, save_error)
from asyncgrpo_cli.run.state import RolloutStateError, RunLock, RunLockedError, read_rollout_state, \
    save_rollout_state


def make_checkpoint(run: Path, step: int, *, rollout: bool = True, weights: bool = True) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"x")
    if rollout:
        save_rollout_state(folder, position=3 * step, num_prompts=10, num_tokens=100 * step)
    return folder


def test_completeness_and_newest_complete(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, rollout=False)  # killed before the position was written
    make_checkpoint(tmp_path, 6, weights=False)
    assert checkpoint_problem(tmp_path / "checkpoint-2") is None
    assert "rollout_state.json is missing" in checkpoint_problem(tmp_path / "checkpoint-4")
    assert "no model weights" in checkpoint_problem(tmp_path / "checkpoint-6")
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert resolve_resume(True, tmp_path) == tmp_path / "checkpoint-2"
    with pytest.raises(CheckpointError, match=r"checkpoint-4: not a complete checkpoint: rollout_state.json is "
                                              r"missing.*Fix: resume_from_checkpoint=.*checkpoint-2"):
        resolve_resume(str(tmp_path / "checkpoint-4"), tmp_path)
    assert resolve_resume(None, tmp_path) is None


def test_resume_true_without_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 3, rollout=False)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint-N folder \(incomplete: checkpoint-3\)"):
        resolve_resume(True, tmp_path)


@pytest.mark.parametrize("content, field", [("{oops", "corrupt"), ('{"dataset_start_index": -1}', "dataset_start_index"),
                                            ('{"dataset_start_index": 2, "num_tokens": "x"}', "num_tokens"),
                                            ("[]", "not an object")])
def test_corrupt_rollout_state_names_the_field(tmp_path, content, field):
    folder = make_checkpoint(tmp_path, 1)
    (folder / "rollout_state.json").write_text(content)
    with pytest.raises(RolloutStateError, match=field):
        read_rollout_state(folder)
    assert field in checkpoint_problem(folder)


def test_publish_replaces_and_partials_are_cleaned(tmp_path):
    old = make_checkpoint(tmp_path, 5)
    (old / "stale.txt").write_text("from an earlier run")
    partial = partial_dir(tmp_path, 5)
    partial.mkdir()
    (partial / "trainer_state.json").write_text("{}")
    publish(partial, tmp_path / "checkpoint-5")
    assert not (tmp_path / "checkpoint-5" / "stale.txt").exists() and not partial.exists()
    partial_dir(tmp_path, 7).mkdir()
    assert remove_partials(tmp_path) == [partial_dir(tmp_path, 7)]


def test_save_error_messages(tmp_path):
    import errno

    make_checkpoint(tmp_path, 2)
    text = str(save_error(3, tmp_path, OSError(errno.ENOSPC, "No space left on device")))
    assert "checkpoint-3" in text and "checkpoint-2 is untouched" in text and "free disk space" in text


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_dir(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match=r"output_dir=.*ro is not writable.*Fix: choose a writable folder"):
            check_writable(locked / "run")
    finally:
        locked.chmod(0o700)


def test_run_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    # A live owner: another process holds the lock.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from asyncgrpo_cli.run.state import RunLock\n"
                               f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"pid {holder.pid} on .* is already running in"):
            RunLock(tmp_path).acquire()
        shared = RunLock(tmp_path, shared_with=holder.pid)
        shared.acquire()  # the trainer of the supervisor that holds it
        assert not shared.owned
    finally:
        holder.kill()
        holder.wait()
    # Its owner died (kill -9 leaves the file): the next job takes it over.
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.owned and lock.read()["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ".asyncgrpo.lock").exists()


def test_run_lock_waits_for_the_trainer_of_a_killed_supervisor(tmp_path):
    # The supervisor (owner) is killed with SIGKILL while its trainer (a member) still writes its checkpoint:
    # a resume must not start beside it. Once the trainer is gone too, the lock is taken over and tidied.
    def child(code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                                 "from asyncgrpo_cli.run.state import RunLock\n" + code +
                                 "; print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        return proc

    supervisor = child(f"RunLock({str(tmp_path)!r}).acquire()")
    trainer = None
    try:
        trainer = child(f"RunLock({str(tmp_path)!r}, shared_with={supervisor.pid}).acquire()")
        assert (tmp_path / f".asyncgrpo.lock-member.{trainer.pid}").exists()
        supervisor.kill()
        supervisor.wait()
        with pytest.raises(RunLockedError, match=rf"\(pid {supervisor.pid}\) is gone, but its trainer "
                                                 rf"\(pid {trainer.pid}\) still runs.*Fix: wait for pid {trainer.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        for proc in (supervisor, trainer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.owned and not list(tmp_path.glob(".asyncgrpo.lock-member.*"))
    lock.release()
    assert not (tmp_path / ".asyncgrpo.lock").exists()


def test_a_member_releases_its_own_file_and_the_owner_tidies_a_dead_one(tmp_path):
    owner = RunLock(tmp_path)
    owner.acquire()
    member = RunLock(tmp_path, shared_with=os.getpid())
    member.acquire()
    assert not member.owned and (tmp_path / f".asyncgrpo.lock-member.{os.getpid()}").exists()
    member.release()
    assert not list(tmp_path.glob(".asyncgrpo.lock-member.*")) and (tmp_path / ".asyncgrpo.lock").exists()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f".asyncgrpo.lock-member.{gone.stdout.strip()}").write_text(
        json.dumps({"pid": int(gone.stdout), "host": "here", "started": 0.0}))  # killed -9: its file stayed
    owner.release()
    assert not list(tmp_path.glob(".asyncgrpo.lock*"))


@pytest.mark.parametrize("processes, in_step, expected", [
    (2, False, "with 2 trainer processes, the others may be inside a collective"),
    (1, True, "inside the optimizer step"),
])
def test_a_failure_that_cannot_save_says_why_and_where_the_last_step_is(processes, in_step, expected):
    from types import SimpleNamespace

    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=processes), _in_optimizer_step=in_step,
                              _last_saved_step=4)
    why = AsyncGRPOTrainer._why_not_saved(trainer, RuntimeError("boom"))
    assert expected in why and why.endswith("checkpoint-4 holds the last saved step")
    trainer._last_saved_step = 0
    assert AsyncGRPOTrainer._why_not_saved(trainer, RuntimeError("boom")).endswith("no earlier checkpoint")
