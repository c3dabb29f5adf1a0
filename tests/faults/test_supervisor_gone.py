"""Issue #45, item 1: the supervisor is killed with -9 and the trainer then dies during the save of its last step
(in the issue, after the first step, with accelerate 1.16). Nobody of the job is left to write the final state, so
the trainer's status guard (`run.status_guard`, started when the trainer learns the supervisor is gone) writes
it: the save was cut, and the newest complete checkpoint (or none) with its resume command.

The trainer is `dying_trainer_program.py` (it follows the supervisor's pid with the real
`train.main._follow_supervisor`); the whole job with the real trainer is
`test_dead_server.py::test_supervisor_killed_while_the_trainer_waits_on_the_server_every_process_ends`."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from asyncgrpo_cli.run.folder import TRAIN_ARGV_ENV
from asyncgrpo_cli.run.state import LOCK_OWNER_ENV

from .conftest import status, wait_for

BOUND_S = 60.0


def _complete_checkpoint(out: Path, step: int) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "rollout_state.json").write_text(json.dumps({"dataset_start_index": 8 * step}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _kill_supervisor_then_trainer_mid_save(jobs, out: Path, step: int):
    supervisor = jobs([sys.executable, "-c", "import threading; threading.Event().wait()"], "supervisor")
    argv = ["asyncgrpo", "train", "+recipe=smoke", f"trainer.output_dir={out}"]
    trainer = jobs([sys.executable, "-m", "tests.faults.dying_trainer_program", "--out", str(out), "--step",
                    str(step)], "trainer", env={LOCK_OWNER_ENV: str(supervisor.pid),
                                                TRAIN_ARGV_ENV: json.dumps(argv)})
    wait_for((out / "following").is_file, BOUND_S, "the stand-in trainer to follow its supervisor", trainer)
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait(10)
    wait_for((out / "saving").is_file, BOUND_S, "the stand-in trainer's save", trainer)
    assert status(out)["state"] == "running" and "saving the last completed step" in status(out)["stopping"]
    os.kill(trainer.pid, signal.SIGKILL)  # what cut the save in the issue
    trainer.wait(10)
    final = wait_for(lambda: (s := status(out)) and s["state"] != "running" and s, BOUND_S,
                     "a final state in status.json")
    return trainer, final


def test_trainer_killed_in_its_first_save_after_the_supervisor_is_gone_status_says_the_save_was_cut(
        jobs, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    trainer, final = _kill_supervisor_then_trainer_mid_save(jobs, out, step=1)
    assert final["state"].startswith(f"failed: the trainer (pid {trainer.pid}) died after the supervisor (pid "), final
    assert "its save of the last completed step (step 1) was cut; there is no complete checkpoint" in final["state"]
    assert final["stopping"] is None and final["resume_command"] is None, final
    assert "no complete checkpoint" in final["note"], final
    trainer.assert_no_process_left(BOUND_S)  # the guard ends once it has written


def test_trainer_killed_in_a_later_save_names_the_newest_complete_checkpoint_and_how_to_resume(jobs, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    kept = _complete_checkpoint(out, 1)
    trainer, final = _kill_supervisor_then_trainer_mid_save(jobs, out, step=2)
    assert "its save of the last completed step (step 2) was cut" in final["state"], final
    assert f"the newest complete checkpoint is {kept} (step 1)" in final["state"], final
    assert final["resume_command"].endswith("asyncgrpo train +recipe=smoke "  # after ASYNCGRPO_CACHE=... if set
                                            f"trainer.output_dir={out} trainer.resume_from_checkpoint={kept}"), final
    assert final["last_checkpoint"] == str(kept)
