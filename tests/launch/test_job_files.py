"""The supervisor's stop grace and the final state it gives status.json."""

from __future__ import annotations

import json

from asyncgrpo_cli.launch.job_files import finalize_status, stop_grace


def write(out, **status):
    (out / "status.json").write_text(json.dumps(status))


def test_stop_grace_from_the_measured_save(tmp_path):
    assert stop_grace(None, tmp_path, 120.0) == 120.0  # no status yet
    write(tmp_path, state="running", last_save_s=4.0, last_step_s=10.0)
    assert stop_grace(None, tmp_path, 120.0) == 10.0 + 12.0 + 30.0
    assert stop_grace(600.0, tmp_path, 120.0) == 600.0  # launch.stop_timeout wins


def test_finalize_status(tmp_path):
    write(tmp_path, state="saving", step=3, stopping="SIGINT: saving the last completed step (step 3) and stopping")
    finalize_status(tmp_path, 130, None)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and "stopped while saving" in status["note"]
    # fresh-user trial: a double Ctrl-C left "newest complete checkpoint: None" and the stop's "saving ..." line
    assert status["note"].endswith("no complete checkpoint") and status["stopping"] is None
    write(tmp_path, state="running")
    finalize_status(tmp_path, 1, "the trainer exited with code -9")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "failed: the trainer exited with code -9"
    write(tmp_path, state="finished")
    finalize_status(tmp_path, 1, "x")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"  # a final state is kept
    write(tmp_path, state="stopped", step=1)  # stopped because its server died: the job failed, and says so
    finalize_status(tmp_path, 1, "the server (pid 7) was killed by SIGKILL during training")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed: the server (pid 7) was killed by SIGKILL during training"
    assert status["trainer_state"] == "stopped" and status["outcome"] == "failed"  # one word for programs
    write(tmp_path, state="stopped", step=1)
    finalize_status(tmp_path, 130, None)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and status["outcome"] == "stopped"
    write(tmp_path, state="finished")
    finalize_status(tmp_path, 0, None)
    assert json.loads((tmp_path / "status.json").read_text())["outcome"] == "finished"
    write(tmp_path, state="failed: the rollout worker died")  # the trainer's own final state: only outcome added
    finalize_status(tmp_path, 1, "x")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed: the rollout worker died" and status["outcome"] == "failed"


def test_the_stop_reason_the_supervisor_writes_is_what_the_trainer_reports(tmp_path):
    import signal

    from asyncgrpo_cli.train import stopping

    assert stopping.stop_reason(tmp_path, signal.SIGINT) == "SIGINT"  # no reason written: the signal alone
    stopping.write_stop_reason(tmp_path, "the server (pid 7) was killed by SIGKILL")
    assert stopping.stop_reason(tmp_path, signal.SIGINT) == "SIGINT from the supervisor: the server (pid 7) was killed by SIGKILL"
    stopping.clear_stop_reason(tmp_path)  # a new job starts without the last one's reason
    assert stopping.stop_reason(tmp_path, signal.SIGTERM) == "SIGTERM"


def test_a_failed_run_without_a_save_of_its_own_gets_the_resume_command(tmp_path, monkeypatch):
    """fresh-user trial (issue #36): a resumed run whose trainer was killed before its first save left
    status.json without resume_command, while the console printed one."""
    from asyncgrpo_cli.launch import job_files

    ckpt = str(tmp_path / "checkpoint-2")
    monkeypatch.setattr(job_files, "newest_checkpoint", lambda out: ckpt)
    write(tmp_path, state="running", step=3)
    finalize_status(tmp_path, 1, "the trainer was killed by SIGKILL")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["resume_command"].endswith(f"trainer.resume_from_checkpoint={ckpt}")
    assert status["last_checkpoint"] == ckpt
    write(tmp_path, state="running", step=3, resume_command="asyncgrpo train mine", last_checkpoint="c")
    finalize_status(tmp_path, 1, "x")  # the trainer's own is kept
    assert json.loads((tmp_path / "status.json").read_text())["resume_command"] == "asyncgrpo train mine"
    write(tmp_path, state="running", step=3)
    finalize_status(tmp_path, 0, None)  # finished: nothing to resume
    assert json.loads((tmp_path / "status.json").read_text())["resume_command"] is None


def test_a_resumed_run_stopped_before_its_first_save_keeps_its_state_and_gets_the_resume_command(tmp_path,
                                                                                               monkeypatch):
    """Fresh-user trial (issue #45): SIGINT while a resumed run was starting; the console said 'no new checkpoint
    was needed: .../checkpoint-2 holds the last completed step (2)' and 'resume with: ...', status.json had
    last_checkpoint and resume_command null (the trainer's own 'stopped' was kept as it was)."""
    from asyncgrpo_cli.launch import job_files

    ckpt = str(tmp_path / "checkpoint-2")
    monkeypatch.setattr(job_files, "newest_checkpoint", lambda out: ckpt)
    write(tmp_path, state="stopped", step=2, note="stopped by SIGINT", last_checkpoint=None, resume_command=None)
    finalize_status(tmp_path, 130, None)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and status["note"] == "stopped by SIGINT"
    assert status["resume_command"].endswith(f"trainer.resume_from_checkpoint={ckpt}")
    assert status["last_checkpoint"] == ckpt
    write(tmp_path, state="failed: ServerHungError", step=2)  # a trainer's failure too
    finalize_status(tmp_path, 1, "x")
    assert json.loads((tmp_path / "status.json").read_text())["last_checkpoint"] == ckpt
    write(tmp_path, state="finished", step=2)  # finished: nothing to resume
    finalize_status(tmp_path, 0, None)
    assert json.loads((tmp_path / "status.json").read_text())["resume_command"] is None


def test_the_trainers_status_carries_the_one_word_outcome_of_its_final_state(tmp_path):
    """status.json's `state` of a failure is a sentence; `outcome` is its one word once the state is final (second
    fresh-user trial: a program had to match `state` on a prefix), and absent (null) before."""
    from asyncgrpo_cli.run.state import LiveFiles, outcome_of

    live = LiveFiles(tmp_path)
    for state, outcome in (("running", None), ("saving", None), ("failed: the server (pid 7) died", "failed"),
                           ("stopped", "stopped"), ("finished", "finished")):
        live.update(force=True, state=state)
        assert json.loads((tmp_path / "status.json").read_text())["outcome"] == outcome == outcome_of(state)


def test_status_keeps_the_same_keys_whatever_the_outcome(tmp_path):
    """`run.state.ALWAYS_KEYS` are in status.json from the first write to the last, null where they do not apply,
    whichever writer ends the file: the trainer (`LiveFiles`), the supervisor (`finalize_status`) or the status
    guard (`close_cut_status`)."""
    from asyncgrpo_cli.run.state import ALWAYS_KEYS, LiveFiles
    from asyncgrpo_cli.run.status_guard import close_cut_status

    def keys(folder):
        return json.loads((folder / "status.json").read_text())

    live = LiveFiles(tmp_path / "live")
    live.update(force=True, state="running", step=1)
    assert all(keys(tmp_path / "live")[k] is None for k in ALWAYS_KEYS)
    live.update(force=True, state="finished", step=2)
    final = keys(tmp_path / "live")
    assert final["outcome"] == "finished" and all(k in final for k in ALWAYS_KEYS)

    for rc, failure in ((0, None), (130, None), (1, "the server died")):
        folder = tmp_path / f"sup{rc}"
        folder.mkdir()
        write(folder, state="running", step=1)  # an old trainer's file, without the keys
        finalize_status(folder, rc, failure)
        assert all(k in keys(folder) for k in ALWAYS_KEYS), (rc, keys(folder))
    folder = tmp_path / "done"
    folder.mkdir()
    write(folder, state="finished", outcome="finished", step=2)  # final already: the keys are added all the same
    finalize_status(folder, 0, None)
    assert all(k in keys(folder) for k in ALWAYS_KEYS) and keys(folder)["state"] == "finished"

    folder = tmp_path / "cut"
    folder.mkdir()
    write(folder, state="running", step=1)
    close_cut_status(folder, 4321, "the supervisor (pid 1) is gone")
    assert keys(folder)["outcome"] == "failed" and all(k in keys(folder) for k in ALWAYS_KEYS)


def test_status_names_the_job_and_server_pids(tmp_path, monkeypatch):
    """A fresh-user trial (fifteenth session) signalled status.json's `pid`, the training process, for the job:
    the file names the supervisor (`job_pid`) and the server it started (`server_pid`) too."""
    from asyncgrpo_cli.run.state import LOCK_OWNER_ENV, SERVER_PID_ENV, LiveFiles

    monkeypatch.setenv(LOCK_OWNER_ENV, "4242")
    monkeypatch.setenv(SERVER_PID_ENV, "4343")
    LiveFiles(tmp_path / "a").update(force=True, state="running")
    status = json.loads((tmp_path / "a" / "status.json").read_text())
    assert (status["job_pid"], status["server_pid"]) == (4242, 4343) and status["pid"] != 4242
    monkeypatch.delenv(LOCK_OWNER_ENV)
    monkeypatch.setenv(SERVER_PID_ENV, "")  # an external server; the Python API: no supervisor
    LiveFiles(tmp_path / "b").update(force=True, state="running")
    status = json.loads((tmp_path / "b" / "status.json").read_text())
    assert status["job_pid"] is None and status["server_pid"] is None


def test_a_resume_keeps_the_earlier_summaries_below_its_own(tmp_path):
    """`logs/summary.txt` was rewritten by a resume, losing the attempt that failed (its error and resume command).
    Each attempt's summary now comes first, its appended lines (a failure's error) right below it, and the earlier
    attempts after `EARLIER_HEADER`, newest first."""
    from asyncgrpo_cli.launch.job_files import EARLIER_HEADER, write_summary_file

    path = tmp_path / "logs" / "summary.txt"
    write_summary_file(tmp_path, ["one"], append=True)  # nothing to append to: nothing written
    assert not path.exists()
    write_summary_file(tmp_path, ["asyncgrpo train: summary (1)"])
    write_summary_file(tmp_path, ["  error: the server died"], append=True)
    write_summary_file(tmp_path, ["asyncgrpo train: summary (2)"])
    write_summary_file(tmp_path, ["  error: stopped again"], append=True)
    write_summary_file(tmp_path, ["asyncgrpo train: summary (3)"])
    text = path.read_text()
    assert text.startswith("asyncgrpo train: summary (3)\n  written ") and text.count(EARLIER_HEADER) == 2, text
    third, second, first = text.split(f"\n\n{EARLIER_HEADER}\n")
    assert second.startswith("asyncgrpo train: summary (2)") and second.endswith("  error: stopped again"), second
    assert first.startswith("asyncgrpo train: summary (1)") and first.endswith("  error: the server died\n"), first
    assert "error" not in third


def test_an_earlier_attempts_checkpoint_since_removed_is_marked(tmp_path, monkeypatch):
    """Checkpoint rotation deletes the checkpoint an earlier attempt's `resume with:` names (a trial ran it and was
    refused): the kept summary says so; a checkpoint still there is left as it is."""
    from asyncgrpo_cli.launch.job_files import write_summary_file

    (tmp_path / "checkpoint-8").mkdir()
    write_summary_file(tmp_path, ["asyncgrpo train: summary (1)"])
    gone = f"trainer.resume_from_checkpoint={tmp_path}/checkpoint-2"
    write_summary_file(tmp_path, ["  error: the server died", "  cause: the server got SIGKILL from outside this job",
                                  f"  resume with: asyncgrpo train {gone}"], append=True)
    write_summary_file(tmp_path, ["asyncgrpo train: summary (2)", f"  checkpoint   {tmp_path}/checkpoint-8"])
    text = (tmp_path / "logs" / "summary.txt").read_text()
    assert f"resume_from_checkpoint={tmp_path}/checkpoint-2  (checkpoint-2 since removed)\n" in text, text  # no
    import asyncgrpo_cli.launch.job_files as job_files  # complete checkpoint is left: nothing to point to

    monkeypatch.setattr(job_files, "newest_checkpoint", lambda out: str(tmp_path / "checkpoint-8"))
    write_summary_file(tmp_path, ["  error: stopped", f"  resume with: asyncgrpo train {gone[:-1]}3"], append=True)
    write_summary_file(tmp_path, ["asyncgrpo train: summary (3)"])
    text = (tmp_path / "logs" / "summary.txt").read_text()
    assert "checkpoint-3  (checkpoint-3 since removed; the newest is checkpoint-8: trainer.resume_from_checkpoint=" \
           "true)\n" in text, text
    assert text.count("since removed") == 2  # a line marked before is not marked again
    assert f"checkpoint   {tmp_path}/checkpoint-8\n" in text and "cause: the server got SIGKILL" in text, text


def test_a_trainer_stopped_before_it_wrote_a_status_leaves_one(tmp_path):
    # fresh-user trial (2026-12-06): a Ctrl-C 2 s after the start, while the model loaded, left no status.json
    finalize_status(tmp_path, 130, None)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and status["outcome"] == "stopped"
    assert status["note"] == "the trainer was stopped while starting; no complete checkpoint"
    assert status["job_pid"] > 0 and "resume_command" in status
    (tmp_path / "status.json").unlink()
    finalize_status(tmp_path, 1, "the trainer exited with status 1")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "failed: the trainer exited with status 1"


def test_a_trainer_stopped_for_a_failure_says_failed_at_once_and_the_supervisor_completes_it(tmp_path):
    """Twenty-third session's leftover: after `kill -9` of the server, status.json read ``stopped`` for ~3 s (the
    trainer's final write) before the supervisor's ``failed``. The supervisor now says the job fails in its stop
    line, the trainer's final write reads ``failed: <that line>``, and the supervisor's fuller text replaces it."""
    import types

    from asyncgrpo_cli.run import stop_reason
    from asyncgrpo_cli.train.stopping import StopHandling

    trainer = types.SimpleNamespace(args=types.SimpleNamespace(output_dir=str(tmp_path)),
                                    _stop_reason="SIGINT from the supervisor: the server (pid 7) was killed by SIGKILL")
    stop_reason.write_stop_reason(tmp_path, "asyncgrpo train got SIGINT")  # the user's Ctrl-C: the trainer's stop
    assert not stop_reason.stop_fails(tmp_path)
    assert StopHandling._stopped_status(trainer)["state"] == "stopped"
    stop_reason.write_stop_reason(tmp_path, "the server (pid 7) was killed by SIGKILL", fails=True)
    assert stop_reason.stop_fails(tmp_path)
    assert stop_reason.read_stop_reason(tmp_path) == "the server (pid 7) was killed by SIGKILL"  # the first line only
    said = StopHandling._stopped_status(trainer)
    assert said["state"] == "failed: the server (pid 7) was killed by SIGKILL" and said["trainer_state"] == "stopped"
    assert said["note"] == "stopped by SIGINT from the supervisor: the server (pid 7) was killed by SIGKILL"
    stop_reason.own_reason.append("the supervisor (pid 9) is gone")  # its own watchdog: no supervisor completes it
    try:
        assert StopHandling._stopped_status(trainer)["state"] == "stopped"
    finally:
        stop_reason.own_reason.pop()

    write(tmp_path, step=2, **said)
    finalize_status(tmp_path, 1, "the server (pid 7) was killed by SIGKILL during training; checkpoint saved: x")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == ("failed: the server (pid 7) was killed by SIGKILL during training; checkpoint saved: "
                               "x") and status["trainer_state"] == "stopped" and status["outcome"] == "failed"
    write(tmp_path, step=2, **said)  # no failure text from the supervisor (none given): the trainer's is kept
    finalize_status(tmp_path, 1, None)
    assert json.loads((tmp_path / "status.json").read_text())["state"] == said["state"]


def test_files_written_atomically_follow_the_umask_as_the_runs_other_files_do(tmp_path):
    """A fresh-user trial (2026-12-07) found status.json, summary.txt and final_model.json at mode 0600 beside the
    run's other files at 0644: `tempfile.mkstemp` made the atomic write's temporary file owner-only. It follows the
    umask now; the write is still atomic (no temporary file left, the old content replaced whole)."""
    import os
    import stat

    from asyncgrpo_cli.run.state import write_json_atomic, write_text_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "status.json", {"state": "running"})
        write_text_atomic(tmp_path / "summary.txt", "one\n")
        write_text_atomic(tmp_path / "summary.txt", "two\n")
        os.umask(0o077)
        write_text_atomic(tmp_path / "private.txt", "x")
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode == {"status.json": 0o644, "summary.txt": 0o644, "private.txt": 0o600}, mode
    assert (tmp_path / "summary.txt").read_text() == "two\n"
    assert json.loads((tmp_path / "status.json").read_text()) == {"state": "running"}
