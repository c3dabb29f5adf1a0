"""Issue #42's GPU scripts, their CPU-checkable parts: the nvidia-smi poll's arithmetic, the figures and the
comparison from synthetic rows, TRL's plan, and the staging of TRL's wheel (scripts/gpu/vllm033/)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "scripts" / "gpu" / "vllm033"
for _p in (HERE, ROOT / "scripts" / "bench"):
    sys.path.insert(0, str(_p))

import gpu_memory  # noqa: E402
import realistic  # noqa: E402
import realistic_trl  # noqa: E402


def test_nvidia_smi_lines_parse_and_roles_come_from_the_command_line():
    apps = gpu_memory.parse_apps("123, python3, 40960\n456, VLLM::EngineCore, 81920\nbad line\n789, x, [N/A]\n")
    assert apps == {123: ("python3", 40960.0), 456: ("VLLM::EngineCore", 81920.0)}
    assert gpu_memory.parse_gpu("130000, 143771\n") == (130000.0, 143771.0) and gpu_memory.parse_gpu("") is None
    assert gpu_memory.role_of("VLLM::EngineCore") == "vllm"
    assert gpu_memory.role_of("/usr/bin/python3 -m asyncgrpo_cli.train.worker") == "trainer"
    assert gpu_memory.role_of("python3 scripts/gpu/vllm033/trl_run.py --mode colocate") == "trainer"
    assert gpu_memory.role_of("/tmp/vsite/bin/vllm serve /tmp/m --port 8000") == "vllm"
    assert gpu_memory.role_of("python3 -m vllm.entrypoints.cli.main serve /tmp/m") == "vllm"
    assert gpu_memory.role_of("Xorg") == "other" and gpu_memory.role_of("nvidia-cuda-mps-server") == "mps"
    assert gpu_memory.role_of_pid(__import__("os").getpid())[0] in ("trainer", "other")  # pytest: no vLLM
    with pytest.raises(ValueError, match="interval_s"):
        gpu_memory.Poller(0)


def _samples() -> tuple[list[dict], dict]:
    processes = {1: {"role": "vllm"}, 2: {"role": "trainer"}, 3: {"role": "trainer"}}
    samples = [{"t": 10.0, "apps": {1: 50000.0}, "gpu_used_mib": 50500.0, "gpu_total_mib": 143771.0},
               {"t": 13.0, "apps": {1: 60000.0, 2: 20000.0, 3: 1000.0}, "gpu_used_mib": 81500.0,
                "gpu_total_mib": 143771.0},
               {"t": 16.0, "apps": {1: 60000.0, 2: 30000.0}, "gpu_used_mib": 90600.0, "gpu_total_mib": 143771.0}]
    return samples, processes


def test_memory_peaks_per_step_window_and_the_check_against_the_plan():
    samples, processes = _samples()
    assert gpu_memory.peaks(samples, processes, None, 13.0) == {"vllm": 60000.0, "trainer": 21000.0}
    assert gpu_memory.peaks(samples, processes, 13.0, 16.0) == {"vllm": 60000.0, "trainer": 30000.0}
    s = gpu_memory.summary(samples, processes, planned_vllm_frac=0.4)
    assert s["peak_mib_by_role"] == {"vllm": 60000.0, "trainer": 30000.0}
    assert s["at_widest_read"] == {"processes_sum_mib": 90000.0, "gpu_used_mib": 90600.0}
    assert s["planned"]["vllm_within_share"] is False  # 60,000 MiB > 0.4 x 143,771
    assert s["planned"]["trainer_within_rest"] is True
    assert gpu_memory.summary([], {}) == {"samples": 0}


def _metrics(n: int = 6) -> list[dict]:
    return [{"step": s, "time": 100.0 + 10 * s, "perf/step_s": 10.0, "perf/rollout_wait_s": 2.0,
             "batch/trained_tokens_per_step": 24576.0, "perf/wall_clock_trained_tokens_per_s": 2457.6,
             "rollout/generated_tokens_per_s": 5000.0, "perf/weight_sync_s": 0.6, "batch/samples_per_step": 48.0}
            for s in range(1, n + 1)]


def test_our_step_rows_and_completion_figures():
    samples, processes = _samples()
    rows = realistic.step_rows([{**r, "time": r["time"] - 100.0} for r in _metrics(2)], samples, processes)
    assert rows[0]["busy_frac"] == 0.8 and rows[0]["trained_tok_s"] == 2457.6 and rows[0]["weight_sync_s"] == 0.6
    assert rows[0]["gpu_peak_mib"] == {"vllm": 50000.0}  # the reads up to t = 10 s: only vLLM was up
    assert rows[1]["gpu_peak_mib"] == {"vllm": 60000.0, "trainer": 30000.0}
    figures = realistic.completion_figures(realistic.step_rows(_metrics()))
    assert figures == {"completions_total": 288.0, "completions_after_step1": 240.0, "s_per_1000_completions": 208.33}
    assert realistic.planned_vllm_frac("... vllm serve m --gpu-memory-utilization 0.62 --port 1") == 0.62


def _trl_records(n: int = 4) -> list[dict]:
    return [{"versions": {"trl": "1.16.0"}}] + [
        {"step": s, "time": 1000.0 + 20 * s, "completions": 48, "completion_tokens": 48 * 512, "generate_s": 12.0,
         "train_s": 8.0} for s in range(1, n + 1)]


def test_trl_figures_plan_and_exact_error():
    f = realistic_trl.trl_figures(_trl_records())
    assert f["trained_tokens_per_s"] == round(3 * 48 * 512 / 60, 1) and f["s_per_1000_completions"] == 416.67
    assert f["train_frac"] == 0.4 and f["completions_total"] == 192
    assert realistic_trl.trl_figures(_trl_records(2))["note"].startswith("fewer than 3")
    plan = realistic_trl.trl_plan({"rows": [{"completions": 50}, {"completions": 45}, {"completions": 58}]})
    assert plan == {"completions": 153, "per_step": 48, "steps": 4, "source": "async run"}
    assert realistic_trl.trl_plan(None)["per_step"] % 8 == 0
    assert realistic_trl.exact_error([{"error": "AttributeError: no model_executor"}], "") == \
        "AttributeError: no model_executor"
    assert realistic_trl.exact_error([], "x\nRuntimeError: NCCL error: duplicate GPU\nwarn") == \
        "RuntimeError: NCCL error: duplicate GPU"


def test_trl_plans_from_this_machines_newest_asynchronous_run_a_variant_included(tmp_path):
    """The s26 TRL run found no plain realistic_job_async.json in the work folder (the asynchronous run was
    ``_clip_release4``), planned from s18's committed run and ran 29 steps against our 20. The newest
    asynchronous result of the work folder wins now; on-policy ones do not count."""
    import os

    assert realistic_trl.async_result_path(tmp_path) == next(p for p in realistic_trl.ASYNC_RESULTS[1:] if p.exists())
    older, newer = tmp_path / "realistic_job_async.json", tmp_path / "realistic_job_async_clip_release4.json"
    for path, t in ((older, 1000), (newer, 2000), (tmp_path / "realistic_job_sync_clip.json", 3000)):
        path.write_text("{}")
        os.utime(path, (t, t))
    assert realistic_trl.async_result_path(tmp_path) == newer


def test_combine_computes_ours_over_trl_and_the_targets(tmp_path):
    ours = {"summary": {"steps_measured": 5, "trained_tokens_per_s": 6000.0, "trainer_busy_frac": 0.75,
                        "generated_tokens_per_s": 7000.0, "weight_sync_s": 0.6},
            "rows": [{"busy_frac": 0.1}, {"busy_frac": 0.8}, {"busy_frac": 0.72}]}
    sync = {"summary": {**ours["summary"], "trained_tokens_per_s": 3000.0, "trainer_busy_frac": 0.5}, "rows": []}
    trl = {"figures": {"trained_tokens_per_s": 2000.0, "rows": [{"step": 1}]}, "mode_measured": "colocate"}
    for name, data in {"realistic_job_async.json": ours, "realistic_job_sync.json": sync, "realistic_trl.json": trl,
                       "realistic_engine.json": {"engine_generated_tok_s": 10000.0}}.items():
        (tmp_path / name).write_text(json.dumps(data))
    rows = [{"step": k, "t_since_step1_s": 2.0 * (k - 1), "trained_tokens": 6000.0} for k in range(1, 5)]
    variant = {**ours, "rows": rows, "command": "asyncgrpo train ..."}
    (tmp_path / "realistic_job_async_mps.json").write_text(json.dumps(variant))
    (tmp_path / "realistic_job_async_nosuchtag.json").write_text(json.dumps(variant))  # not a variant: left out
    sync["rows"] = [{**r, "trained_tokens": 3000.0} for r in rows]
    trl["figures"]["rows"] = [{"step": k, "time": 3.0 * (k - 1), "completion_tokens": 3000.0} for k in range(1, 5)]
    for name, data in {"realistic_job_sync.json": sync, "realistic_trl.json": trl}.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = realistic_trl.combine(tmp_path, tmp_path / "out")
    assert list(out["figures"]["variants"]) == ["async_mps"]
    window = out["figures"]["variants"]["async_mps"]["same_steps"]
    assert window["variant_over_sync_trained_tok_s"] == 2.0 and window["variant_over_trl_trained_tok_s"] == 3.0
    assert out["sources"]["async"]["file"] == "realistic_job_async.json"
    assert out["ours_over_trl"] == 3.0 and out["figures"]["async_over_sync_trained_tok_s"] == 2.0
    assert out["figures"]["steady_steps"] is None  # the async run's rows have no steps here
    assert out["figures"]["async"]["generation_frac_of_engine"] == 0.7  # rows without rates: the summary's

    assert out["figures"]["async"]["busy_frac_min_step"] == 0.72  # step 1 (start-up) left out
    assert {k: v["met"] for k, v in out["targets"].items()} == {
        "async_over_sync_trained_tok_s": True, "ours_over_trl_trained_tok_s": True, "async_busy_frac_min_step": True,
        "generation_frac_of_engine": True}
    written = json.loads((tmp_path / "out" / "realistic_trl.json").read_text())
    assert written["ours_over_trl"] == 3.0 and "async" in (tmp_path / "out" / "realistic_async_sync.json").name
    (tmp_path / "realistic_trl.json").unlink()
    with pytest.raises(FileNotFoundError, match="realistic_trl"):
        realistic_trl.combine(tmp_path, tmp_path / "out")


def test_a_job_compares_with_the_engine_row_asking_as_many_log_probs():
    engine = {"engine_generated_tok_s": 6000.0,
              "runs": [{"variant": "job", "logprobs": 8, "generated_tok_s": 6000.0},
                       {"variant": "no_logprobs", "logprobs": None, "generated_tok_s": 27000.0}]}
    default = {"command": "asyncgrpo train model.name=m"}
    clip = {"command": "asyncgrpo train loss.score_centering=false rollout.num_sampler_logprobs=0"}
    assert realistic_trl.engine_for(engine, default) == (6000.0, "job (logprobs=8)")
    rate, row = realistic_trl.engine_for(engine, clip)  # no logprobs=0 row: the no-log-probs one, an upper bound
    assert rate == 27000.0 and "upper bound" in row
    engine["runs"].insert(1, {"variant": "sampled_only", "logprobs": 0, "generated_tok_s": 20000.0})
    assert realistic_trl.engine_for(engine, clip) == (20000.0, "sampled_only (logprobs=0)")
    assert realistic_trl.engine_for({"engine_generated_tok_s": 5.0},
                                    {"command": "x rollout.num_sampler_logprobs=4"}) == (5.0, "headline (logprobs=8)")
    assert realistic_trl.engine_for(None, clip) == (None, None)
    figures = realistic_trl.ours_figures({**clip, "summary": {"generated_tokens_per_s": 10000.0}},
                                         *realistic_trl.engine_for(engine, clip))
    assert figures["generation_frac_of_engine"] == 0.5 and figures["engine_row"] == "sampled_only (logprobs=0)"


def test_unmet_requirements_of_a_wheel():
    import install

    meta = ("Name: x\nRequires-Dist: pytest>=1\nRequires-Dist: pytest>=999\nRequires-Dist: no-such-dist-zz>=1\n"
            "Requires-Dist: other-missing-zz; extra == \"vllm\"\nRequires-Dist: deepspeed; extra == \"deepspeed\"\n")
    paths = [p for p in sys.path if p]
    assert install.unmet_requirements(meta, paths) == [f"pytest>=999: {__import__('pytest').__version__} found",
                                                      "no-such-dist-zz>=1: missing"]
    assert install.unmet_requirements(meta, paths, ("vllm",))[-1].startswith("other-missing-zz")


def test_the_stage_plan_is_the_packing_of_its_items_and_carries_the_optional_groups_last():
    """build_parts.pack, run on PARTS.txt's own items, puts every piece in the part the plan names (the
    refactor for --add-group changed nothing); TRL's wheel (p54) and flash-attn-4's (p55) are the last parts,
    each in a part of its own, and install.py installs both groups as optional."""
    import build_parts

    records = [line.split() for line in (HERE / "PARTS.txt").read_text().splitlines() if line and line[0] != "#"]
    pieces = []
    for f in (r for r in records if r[0] == "ITEM"):
        size, count = int(f[4]), int(f[6])
        for i in range(count):
            piece = f[3] if count == 1 else f"{f[3]}.part{i:02d}"
            pieces.append((f[1], piece, f[3], i, min(build_parts.PIECE, size - i * build_parts.PIECE), None, 0))
    parts = build_parts.pack(pieces, build_parts.GROUP_ORDER)
    packed = {m[1]: f"p{n:02d}" for n, (_g, members, _b) in enumerate(parts, start=1) for m in members}
    assert packed == {f[3]: f[1] for f in records if f[0] == "PIECE"}
    trl = [r for r in build_parts.read_manifest() if r[0] == "trl"]
    assert [r[1] for r in trl] == ["trl-1.16.0-py3-none-any.whl"]
    assert parts[-2][0] == "trl" and f"p{len(parts) - 1:02d}" == packed[trl[0][1]] == "p54"
    fa4 = sorted(r[1] for r in build_parts.read_manifest() if r[0] == "fa4")
    assert fa4 == ["einops-0.8.2-py3-none-any.whl", "flash_attn_4-4.0.0b40-py3-none-any.whl"]
    assert parts[-1][0] == "fa4" and {packed[name] for name in fa4} == {f"p{len(parts):02d}"} == {"p55"}
    import install

    assert set(install.OPTIONAL) == {"trl", "fa4"}


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_trl_accepts_the_arguments(mode, tmp_path):
    """Every argument `trl_run.grpo_kwargs` gives is a field of TRL's GRPOConfig (where trl is installed; CI has
    none: the GPU session's install.py stages trl 1.16.0, and `pip install --no-deps trl==1.16.0` runs it here)."""
    trl = pytest.importorskip("trl")
    import trl_run

    kw = trl_run.grpo_kwargs(mode, str(tmp_path), 20, 48, learning_rate=1e-6, completion=512, max_model_len=1024,
                             server_url="http://127.0.0.1:8011", bf16=False)  # TRL refuses bf16 without a GPU
    config = trl.GRPOConfig(**kw)
    assert config.generation_batch_size == 48 and config.steps_per_generation == 6
    assert config.vllm_mode == mode and config.gradient_checkpointing and config.lr_scheduler_type == "constant"


def test_a_detached_job_outlives_its_start_and_each_follow_returns_what_it_wrote(tmp_path, monkeypatch):
    """`realistic.py start` runs the job in a session of its own and returns after one slice with the rows written
    so far (exit 3: still runs); `follow` returns the next slice, and the end (exit 0) with the job's files in $OUT.
    A stand-in job writes a result, waits for a go file (no timing), then ends."""
    out, go = tmp_path / "out", tmp_path / "go"
    monkeypatch.setattr(realistic, "WORK", tmp_path / "work")
    monkeypatch.setattr(realistic, "OUT", out)
    monkeypatch.setattr(realistic, "SLICE_S", 0.5)
    job = ("import json, os, pathlib, time\n"
           "o = pathlib.Path(os.environ['OUT']); o.mkdir(parents=True, exist_ok=True)\n"
           "(o / 'realistic_job_async.json').write_text(json.dumps({'rows': [{'step': 1}]}))\n"
           f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
           "(o / 'realistic_job_async.json').write_text(json.dumps({'rows': [{'step': 1}, {'step': 2}]}))\n")
    assert realistic.phase_follow("async") == 1  # nothing started
    folder = realistic.detached_dir("async", tmp_path / "work")
    try:
        assert realistic.phase_start("async", [sys.executable, "-c", job]) == 3
        pid = int((folder / "pid").read_text())
        assert os.getsid(pid) == pid != os.getsid(0)  # a session of its own: the call's end does not take it
        assert realistic.phase_start("async", [sys.executable, "-c", job]) == 1  # one job at a time
        assert realistic.phase_start("sync", [sys.executable, "-c", job]) == 1  # on the GPU
        progress = json.loads((out / "realistic_follow_async.json").read_text())
        assert progress["state"] == "running" and progress["steps_logged"] in (0, 1) and progress["host"]
        go.write_text("")
        monkeypatch.setattr(realistic, "SLICE_S", 120.0)
        assert realistic.phase_follow("async") == 0
        assert [r["step"] for r in json.loads((out / "realistic_job_async.json").read_text())["rows"]] == [1, 2]
        assert json.loads((out / "realistic_follow_async.json").read_text())["state"] == "exit 0"
    finally:  # a failed assertion leaves no job behind
        go.write_text("")
        if (folder / "pid").exists() and realistic.finished(folder) is None:
            try:
                os.killpg(int((folder / "pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_detached_runs_progress_rows_come_from_its_own_files(tmp_path, monkeypatch):
    """`follow` reports our job's result rows, TRL's step records (its rows file) and the engine's runs; every
    name `start` takes has a phase of realistic.py."""
    monkeypatch.setattr(realistic, "WORK", tmp_path)
    folder = realistic.detached_dir("sync")
    (folder / "out").mkdir(parents=True)
    assert realistic.progress_rows("sync", folder) == []  # nothing written yet
    (folder / "out" / "realistic_job_sync.json").write_text('{"rows": [{"step": 1}, {"step": 2}]}')
    assert [r["step"] for r in realistic.progress_rows("sync", folder)] == [1, 2]
    (folder / "out" / "realistic_job_sync.json").write_text('{"rows": [{"st')  # caught mid-write
    assert realistic.progress_rows("sync", folder) == []
    (tmp_path / "trl_colocate_rows.jsonl").write_text('{"versions": {}}\n{"step": 1, "completions": 48}\n'
                                                      '{"log": {"step": 1}}\n{"step": 2, "compl')
    assert realistic.progress_rows("trl", realistic.detached_dir("trl")) == [{"step": 1, "completions": 48}]
    for args, *_ in realistic.DETACHED.values():
        assert args[0] in ("job", "engine", "trl")


def test_a_follow_of_a_killed_detached_run_says_so_at_once(tmp_path, monkeypatch):
    """A driver killed without writing its exit status ends the follow at once (exit 1, state `exit -9`), not after
    a slice of waiting, and a new start is then allowed."""
    monkeypatch.setattr(realistic, "WORK", tmp_path / "work")
    monkeypatch.setattr(realistic, "OUT", tmp_path / "out")
    monkeypatch.setattr(realistic, "SLICE_S", 0.2)
    folder = realistic.detached_dir("sync")
    assert realistic.phase_start("sync", [sys.executable, "-c", "import time; time.sleep(600)"]) == 3
    pid = int((folder / "pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    while realistic.alive(pid):
        try:  # reap it: the test process is its parent
            os.waitpid(pid, 0)
        except ChildProcessError:
            break
    monkeypatch.setattr(realistic, "SLICE_S", 600.0)
    assert realistic.phase_follow("sync") == 1
    assert json.loads((tmp_path / "out" / "realistic_follow_sync.json").read_text())["state"] == "exit -9"
    assert realistic.phase_start("sync", [sys.executable, "-c", "pass"]) in (0, 3)
    realistic.phase_follow("sync")


def test_a_model_built_on_a_device_is_built_in_a_child_process(tmp_path, monkeypatch):
    """`realistic.build` on a device other than the CPU builds the stand-in in a child, so the driver holds no
    device memory beside the job (``cpu:0`` takes that path on a machine without a GPU); a kept model is not
    built again."""
    import subprocess

    calls = []
    real_run = subprocess.run

    def recording_run(argv, *args, **kwargs):
        calls.append(argv)
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(realistic.subprocess, "run", recording_run)
    out = realistic.build(tmp_path, shape="tiny", device="cpu:0", rows=8)
    assert len(calls) == 1 and calls[0][1] == "-c" and "make_model" in calls[0][2]
    assert (Path(out["model"]) / "config.json").exists() and Path(out["data"]).exists()
    realistic.build(tmp_path, shape="tiny", device="cpu:0", rows=8)
    assert len(calls) == 1


def test_combine_compares_the_runs_over_their_common_steps(tmp_path):
    """Runs of 6, 4 and 5 steps compare over steps 2-4, from their rows' times (the whole-run figures stay beside)."""
    def ours_rows(n, step_s, tokens):
        return [{"step": k, "t_since_step1_s": step_s * (k - 1), "trained_tokens": tokens, "busy_frac": 0.9}
                for k in range(1, n + 1)]

    ours = {"summary": {"trained_tokens_per_s": 9999.0, "trainer_busy_frac": 0.9}, "rows": ours_rows(6, 2.0, 4000)}
    sync = {"summary": {"trained_tokens_per_s": 1.0}, "rows": ours_rows(4, 4.0, 4000)}
    trl = {"figures": {"trained_tokens_per_s": 1.0, "rows": [
        {"step": k, "time": 50.0 + 8.0 * k, "completion_tokens": 4000} for k in range(1, 6)]}}
    for name, data in {"realistic_job_async.json": ours, "realistic_job_sync.json": sync,
                       "realistic_trl.json": trl}.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = realistic_trl.combine(tmp_path, tmp_path / "out")
    window = out["figures"]["same_steps"]
    assert window["steps"] == "2-4"
    assert (window["async_trained_tokens_per_s"], window["sync_trained_tokens_per_s"],
            window["trl_trained_tokens_per_s"]) == (2000.0, 1000.0, 500.0)
    assert out["ours_over_trl"] == 4.0 and out["figures"]["async_over_sync_trained_tok_s"] == 2.0
    assert out["targets"]["ours_over_trl_trained_tok_s"]["measured"] == 4.0
    assert realistic_trl.same_steps(ours_rows(2, 1.0, 1), ours_rows(6, 1.0, 1), ours_rows(6, 1.0, 1)) is None


def test_the_kill9_drill_kills_the_supervisor_once_its_step_is_logged_and_reports_what_is_left(tmp_path):
    """`kill9.Kill9` (the ``_kill9`` job tag): nothing before step ``after``; then SIGKILL of this process's
    ``asyncgrpo_cli`` child, and a grandchild that outlives it is reported as left, then ended (ours only)."""
    import subprocess
    import time

    import kill9

    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
              "print('ready', flush=True); time.sleep(300)")
    sup = subprocess.Popen([sys.executable, "-c", script, "asyncgrpo_cli"], stdout=subprocess.PIPE, text=True)
    try:
        assert sup.stdout.readline().strip() == "ready"
        (tmp_path / "checkpoint-21").mkdir()
        (tmp_path / "status.json").write_text(json.dumps({"state": "running", "step": 21, "secret": "x"}))
        drill = kill9.Kill9(21, tmp_path)
        assert drill.observe(0)["fired"] is False and kill9.supervisor_pid() == sup.pid
        assert not drill.fire(20) and sup.poll() is None
        assert drill.fire(21) and not drill.fire(22)
        assert sup.wait(timeout=30) == -signal.SIGKILL
        grandchild = [r["pid"] for r in drill.record["tree"] if r["pid"] != sup.pid]
        assert drill.record["supervisor"] == sup.pid and len(grandchild) == 1
        rec = drill.observe(timeout_s=1.0)
        assert rec["fired"] and rec["all_gone_after_s"] is None
        assert [r["pid"] for r in rec["left_after_wait"]] == grandchild
        assert rec["checkpoints"] == ["checkpoint-21"] and rec["status"] == {"state": "running", "step": 21}
        deadline = time.monotonic() + 30
        while drill.left() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert drill.left() == []  # observe ended what it had remembered
    finally:
        if sup.poll() is None:
            sup.kill()
        sup.wait()


def test_an_mps_check_counts_the_clients_of_the_runs_daemon(tmp_path):
    """`kill9.mps_check`: the control log's ``NEW CLIENT`` lines and the console's MPS lines of a run."""
    import kill9

    assert kill9.mps_check(tmp_path, "")["joined_clients"] is None
    log = tmp_path / "logs" / "mps.log"  # the foreground daemon's stdout
    (tmp_path / "logs" / "mps").mkdir(parents=True)
    log.write_text("[x] Control daemon started\n[y] NEW CLIENT 2348 from user 0: Server is not ready\n"
                   "[z] NEW CLIENT 2348 from user 0: Server already exists\n[z] NEW CLIENT 3377 from user 0: x\n")
    out = kill9.mps_check(tmp_path, "step 1\nCUDA MPS: 2 CUDA process(es) joined the daemon\n")
    assert out["joined_clients"] == 2 and len(out["client_lines"]) == 3
    assert out["console"] == ["CUDA MPS: 2 CUDA process(es) joined the daemon"]
    assert isinstance(out["mps_processes_after"], list) and isinstance(out["pipe_dirs_after"], list)


def test_generated_tokens_per_s_is_weighted_by_the_steps_time():
    # waves: a step of 2 s with none finished, then 6 s holding the burst (issue #42); a plain mean says 6,000
    rows = [{"step": 1, "generated_tok_s": 1.0, "step_s": 30.0},
            {"step": 2, "generated_tok_s": 0.0, "step_s": 2.0}, {"step": 3, "generated_tok_s": 12000.0, "step_s": 6.0}]
    f = realistic_trl.ours_figures({"summary": {"generated_tokens_per_s": 6000.0}, "rows": rows}, 10000.0)
    assert f["generated_tokens_per_s"] == 9000.0 and f["generation_frac_of_engine"] == 0.9
    import bench_e2e
    metrics = [{"step": k, "time": 10.0 * k, "perf/step_s": s, "rollout/generated_tokens_per_s": v,
                "batch/trained_tokens_per_step": 100.0} for k, (v, s) in enumerate([(1.0, 30.0), (0.0, 2.0),
                                                                                   (12000.0, 6.0)], start=1)]
    assert bench_e2e.summarize(metrics)["generated_tokens_per_s"] == 9000.0


def test_steady_steps_leave_out_the_first_half():
    # a queue drained in steps 2-5: fast early steps, then the steady rate
    times = [0.0, 1.0, 2.0, 3.0, 4.0] + [4.0 + 3.0 * k for k in range(1, 16)]
    rows = [{"step": k + 1, "t_since_step1_s": t, "trained_tokens": 3000.0} for k, t in enumerate(times)]
    flat = [{"step": k, "t_since_step1_s": 4.0 * (k - 1), "trained_tokens": 3000.0} for k in range(1, 21)]
    trl = [{"step": k, "time": 5.0 * (k - 1), "completion_tokens": 3000.0} for k in range(1, 21)]
    whole = realistic_trl.same_steps(rows, flat, trl)
    steady = realistic_trl.same_steps(rows, flat, trl, steady=True)
    assert whole["steps"] == "2-20" and steady["steps"] == "10-20"
    assert steady["async_trained_tokens_per_s"] == 1000.0 and steady["async_over_sync_trained_tok_s"] == 1.333
    assert whole["async_trained_tokens_per_s"] > steady["async_trained_tokens_per_s"]


def test_combine_without_an_on_policy_run_compares_the_asynchronous_run_with_trl(tmp_path):
    """The twenty-seventh session's device time held the compiled asynchronous run, TRL and the engine but no
    on-policy run: combine still gives ours_over_trl over the common steps, and every on-policy figure is None."""
    rows = [{"step": k, "t_since_step1_s": 2.0 * (k - 1), "trained_tokens": 6000.0, "busy_frac": 0.8}
            for k in range(1, 6)]
    ours = {"summary": {"trained_tokens_per_s": 3000.0, "trainer_busy_frac": 0.8}, "rows": rows}
    trl = {"figures": {"trained_tokens_per_s": 1.0, "rows": [
        {"step": k, "time": 10.0 + 4.0 * k, "completion_tokens": 6000.0} for k in range(1, 6)]}}
    for name, data in {"realistic_job_async.json": ours, "realistic_trl.json": trl}.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = realistic_trl.combine(tmp_path, tmp_path / "out")
    window = out["figures"]["same_steps"]
    assert window["steps"] == "2-5" and window["sync_trained_tokens_per_s"] is None
    assert out["ours_over_trl"] == 2.0 and out["figures"]["async_over_sync_trained_tok_s"] is None
    assert out["figures"]["sync"] is None and out["sources"]["sync"]["file"] is None
    assert out["targets"]["async_over_sync_trained_tok_s"]["met"] is None
    assert out["targets"]["ours_over_trl_trained_tok_s"]["met"] is True


def test_compare_puts_our_runs_side_by_side_over_their_common_steps(tmp_path):
    """Three runs of 6, 5 and 6 steps compare over steps 2-5; the first is the baseline, the ``sync`` one the
    on-policy run each asynchronous run is held against; the busy steps' median leaves out the waiting ones."""
    def rows(n, step_s, tokens, busy):
        return [{"step": k, "t_since_step1_s": step_s * (k - 1), "trained_tokens": tokens, "step_s": step_s,
                 "busy_frac": busy[k % len(busy)]} for k in range(1, n + 1)]

    runs = {"async_x": rows(6, 2.0, 4000, [1.0]), "async_x_overlap": rows(5, 1.6, 4000, [1.0, 0.5]),
            "sync_x": rows(6, 4.0, 4000, [0.5])}
    files = []
    for name, rs in runs.items():
        files.append(tmp_path / f"realistic_job_{name}.json")
        files[-1].write_text(json.dumps({"rows": rs, "summary": {"dropped_stale_token_frac": 0.01},
                                         "versions": {"date": "d", "gpu": "g"}}))
    out = realistic_trl.compare_jobs(files, tmp_path / "cmp.json", "what")
    assert json.loads((tmp_path / "cmp.json").read_text()) == out
    assert (out["same_steps"], out["steady_steps"], out["baseline"]) == ("2-5", "2-5", "async_x")
    assert out["runs"]["async_x"]["same_steps_trained_tokens_per_s"] == 2000.0
    assert out["runs"]["async_x_overlap"]["over_async_x_same_steps"] == 1.25
    assert out["runs"]["async_x_overlap"]["busy_steps"] == 2  # steps 2 and 4 of 2-5
    assert out["runs"]["async_x"]["busy_steps"] == 4  # steps 2-5: its step 6 is outside the common steps
    assert out["runs"]["sync_x"]["busy_step_s_median"] is None
    assert out["async_over_sync_trained_tok_s"] == {"async_x": 2.0, "async_x_overlap": 2.5}
    assert out["targets"]["async_x"]["async_over_sync_trained_tok_s"]["met"] is True
    assert set(out["targets"]["async_x"]) == {"async_over_sync_trained_tok_s", "async_busy_frac_min_step"}
    with pytest.raises(ValueError, match="two job results"):
        realistic_trl.compare_jobs(files[:1], tmp_path / "one.json")
    with pytest.raises(ValueError, match="named like a job result"):
        realistic_trl.compare_jobs(files[1:], files[0])  # OUT forgotten: the first run would be overwritten
    engine = tmp_path / "realistic_engine.json"
    engine.write_text(json.dumps({"runs": [{"generated_tok_s": 1.0}]}))
    with pytest.raises(ValueError, match="not one of our job results"):
        realistic_trl.compare_jobs([files[0], engine], tmp_path / "three.json")
    short = tmp_path / "realistic_job_async_short.json"
    short.write_text(json.dumps({"rows": rows(2, 1.0, 1, [1.0])}))
    with pytest.raises(ValueError, match="share 2 step"):
        realistic_trl.compare_jobs([files[0], short], tmp_path / "two.json")
