"""`asyncgrpo doctor` against a live embedded sampler, and its checks on scripted server facts."""

import json

import pytest
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.server.checks import FAIL, PASS, SKIP, WARN, ServerFacts, evaluate
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import config_groups, make_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir):
    handle = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=128, max_logprobs=8)).start()
    yield handle
    handle.stop()


def overrides(model_dir, url, *extra):
    return [f"model.name={model_dir}", "sampler.backend=embedded", f"sampler.url={url}", "sampler.max_model_len=128",
            "rollout.max_completion_length=32", "trainer.bf16=false", *extra]


def doctor_json(*args):
    result = runner.invoke(app, ["doctor", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_doctor_passes_against_the_embedded_server(model_dir, server):
    code, report = doctor_json(*overrides(model_dir, server.url))
    failed = [c for c in report["checks"] if c["status"] == FAIL]
    assert code == 0 and report["ok"] and not failed, failed
    names = {c["name"] for c in report["checks"]}
    assert {"server reachable", "model", "max_model_len", "logprobs mode", "max logprobs", "dtype"} <= names


def test_doctor_fails_lora_against_a_server_without_lora(model_dir, server):
    code, report = doctor_json(*overrides(model_dir, server.url, "peft.enabled=true", "peft.r=32"))
    assert code == 1 and not report["ok"]
    lora = next(c for c in report["checks"] if c["name"] == "lora")
    assert lora["status"] == FAIL and "--enable-lora --max-lora-rank 32 --max-loras 6" in lora["fix"]
    assert "--enable-lora" in report["restart_command"] and "--max-loras 6" in report["restart_command"]


def test_doctor_table_prints_restart_command(model_dir, server):
    result = runner.invoke(app, ["doctor", *overrides(model_dir, server.url, "rollout.num_sampler_logprobs=16")])
    assert result.exit_code == 1
    assert "max logprobs" in result.stdout and "--max-logprobs 16" in result.stdout


def test_doctor_unreachable_server(model_dir):
    code, report = doctor_json(*overrides(model_dir, "http://127.0.0.1:9"))
    assert code == 1 and report["checks"][0]["name"] == "server reachable"
    assert report["checks"][0]["status"] == FAIL and "asyncgrpo serve" in report["checks"][0]["fix"]
    table = runner.invoke(app, ["doctor", *overrides(model_dir, "http://127.0.0.1:9")])
    assert "Start the server with:" in table.stdout and "Restart" not in table.stdout


def test_doctor_without_a_server_shows_the_serve_command_with_the_same_overrides(tmp_path, monkeypatch):
    """A fresh-user trial: the fix said "start it with `asyncgrpo serve` (same overrides)", then "Start the server
    with:" printed a raw ``python3 -m asyncgrpo_cli.sampler.embedded ...`` line. The first command shown is now
    ``asyncgrpo serve`` with the overrides as typed; the raw command follows as "(it runs: ...)"."""
    import socket

    from asyncgrpo_cli.run.folder import USER_ENV

    for name in USER_ENV:  # set here, they would lead the line (the next test)
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["+recipe=smoke", f"sampler.port={port}", f"trainer.output_dir={tmp_path}"]
    table = runner.invoke(app, ["doctor", *args])
    assert table.exit_code == 1, table.output
    after = table.stdout.split("Start the server with:", 1)[1].strip().splitlines()
    assert after[0] == f"asyncgrpo serve +recipe=smoke sampler.port={port} trainer.output_dir={tmp_path}", after
    assert after[1].startswith("(it runs: ") and "asyncgrpo_cli.sampler.embedded" in after[1]
    assert f"--port {port}" in after[1]
    code, report = doctor_json(*args)
    assert code == 1 and report["serve_command"] == after[0] and "--port" in report["restart_command"]


def test_the_serve_command_hides_secrets_and_starts_the_server_at_sampler_url(monkeypatch):
    from asyncgrpo_cli.doctor.report import hidden_shell_line, serve_line
    from asyncgrpo_cli.run.folder import USER_ENV
    from asyncgrpo_cli.server.command import ServerCommand

    for name in USER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ASYNCGRPO_CACHE", "/tmp/a cache")  # a second trial: a fresh shell would miss the model
    sampler0 = compose(["+recipe=smoke"]).sampler
    assert serve_line(["+recipe=smoke"], sampler=sampler0) == "ASYNCGRPO_CACHE='/tmp/a cache' asyncgrpo serve +recipe=smoke"
    monkeypatch.delenv("ASYNCGRPO_CACHE")

    sampler = compose(["+recipe=smoke", "sampler.port=8000", "sampler.url=http://localhost:8139"]).sampler
    line = serve_line(["+recipe=smoke", "sampler.port=8000", "sampler.url=http://localhost:8139", "x.hub_token=sekrit",
                       "sampler.extra_args=[--api-key,sekrit]", "a b=c"], sampler=sampler)
    assert "sekrit" not in line and "'x.hub_token=***'" in line and "'sampler.extra_args=[--api-key,***]'" in line
    assert line.startswith("asyncgrpo serve +recipe=smoke sampler.port=8139 sampler.url=http://localhost:8139 ")
    assert line.count("sampler.port=") == 1  # `serve` refuses a key given twice
    assert line.endswith("'a b=c' sampler.host=localhost")
    raw = ServerCommand(argv=["python3", "-m", "x", "--api-key", "sekrit", "--port", "8"],
                        env={"HF_TOKEN": "sekrit", "A": "1"})
    assert hidden_shell_line(raw) == "HF_TOKEN=*** A=1 python3 -m x --api-key '***' --port 8"


def test_bare_doctor_without_a_server_suggests_a_recipe_not_the_same_overrides():
    """Issue #45: bare ``asyncgrpo doctor`` (no model, no server) said "start it with `asyncgrpo serve` (same
    overrides)", and bare ``asyncgrpo serve`` refuses for want of a model. It names +recipe=NAME instead."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, report = doctor_json(f"sampler.port={port}")
    fix = report["checks"][0]["fix"]
    assert code == 1 and report["checks"][0]["status"] == FAIL, report
    assert "`asyncgrpo serve +recipe=NAME`" in fix and "asyncgrpo recipes" in fix and "same overrides" not in fix, fix
    assert "`asyncgrpo doctor +recipe=NAME`" in fix
    serve = runner.invoke(app, ["serve", "--dry-run"])
    assert serve.exit_code == 2 and "+recipe=NAME" in serve.output  # what the bare form would have led to


def vllm_facts(models_len=4096, **info):
    server_info = {"model_config": {"max_model_len": 4096, "max_logprobs": 8, "logprobs_mode": "processed_logprobs",
                                    "dtype": "torch.bfloat16"},
                   "lora_config": None, "weight_transfer_config": {"backend": "nccl"},
                   "parallel_config": {"_api_process_count": 8}, "vllm_env": {}}
    for key, value in info.items():
        section, _, field = key.partition("__")
        if field:
            server_info[section][field] = value
        else:
            server_info[section] = value
    return ServerFacts(url="http://x", reachable=True, version={"version": "0.33.0"},
                       models={"data": [{"id": "Qwen/Qwen3.5-2B", "max_model_len": models_len}]},
                       server_info=server_info, server_env=server_info.pop("vllm_env"), metrics_ok=True)


def _evaluate(cfg, facts, **kw):
    return evaluate(facts, **kw, **config_groups(evaluate, cfg))


def statuses(checks):
    return {c.name: c.status for c in checks}


def test_vllm_checks_pass_for_the_builders_own_flags():
    st = statuses(_evaluate(compose(["+recipe=deepmath"]), vllm_facts(), gpu_count=2))
    assert all(v == PASS for v in st.values()), st


def test_gpu_split_is_skipped_with_the_reason_on_a_machine_without_gpus():
    cpu = {c.name: c for c in _evaluate(compose(["+recipe=smoke"]), vllm_facts(), gpu_count=0)}
    assert cpu["GPU split"].status == SKIP and "no CUDA GPU" in cpu["GPU split"].message
    gpu = statuses(_evaluate(compose(["+recipe=deepmath"]), vllm_facts(), gpu_count=2))
    assert gpu["GPU split"] == PASS


@pytest.mark.parametrize("facts, ov, name, status", [
    (dict(model_config__logprobs_mode="raw_logprobs"), [], "logprobs mode", FAIL),
    (dict(model_config__max_logprobs=4), [], "max logprobs", FAIL),
    (dict(model_config__dtype="torch.float16"), [], "dtype", WARN),
    (dict(weight_transfer_config={"backend": None}), [], "weight transfer", FAIL),
    (dict(models_len=1024), [], "max_model_len", FAIL),
    (dict(models_len=2048), ["rollout.max_completion_length=2048"], "max_model_len", FAIL),
    (dict(), ["rollout.top_k=50"], "sampling mask", FAIL),
    (dict(model_config__return_sampling_mask=True), ["rollout.top_k=50"], "sampling mask", PASS),
    (dict(lora_config={"max_loras": 4, "max_lora_rank": 32}, vllm_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
          parallel_config={"_api_process_count": 1}), ["peft.enabled=true", "peft.r=32"], "lora slots", FAIL),
    (dict(lora_config={"max_loras": 6, "max_lora_rank": 16}, vllm_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
          parallel_config={"_api_process_count": 1}), ["peft.enabled=true", "peft.r=32"], "lora rank", FAIL),
    (dict(lora_config={"max_loras": 6, "max_lora_rank": 32}, vllm_env={},
          parallel_config={"_api_process_count": 1}), ["peft.enabled=true", "peft.r=32"], "lora runtime updating",
     FAIL),
    (dict(lora_config={"max_loras": 6, "max_lora_rank": 32}, vllm_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}),
     ["peft.enabled=true", "peft.r=32"], "lora api servers", FAIL),
])
def test_each_vllm_misconfiguration_is_caught(facts, ov, name, status):
    st = statuses(_evaluate(compose(["+recipe=deepmath", *ov]), vllm_facts(**facts)))
    assert st[name] == status, st


def test_old_vllm_warns_about_top_logprob_cost_and_version():
    facts = vllm_facts()
    facts.version = {"version": "0.26.0"}
    st = statuses(_evaluate(compose(["+recipe=deepmath"]), facts))
    assert st["api servers"] == WARN and st["vLLM version"] == PASS
    facts.version = {"version": "0.20.1"}
    assert statuses(_evaluate(compose(["+recipe=deepmath"]), facts))["vLLM version"] == FAIL


@pytest.mark.parametrize("version,status", [("0.26.0", PASS), ("0.33.0", PASS), ("0.33.1", PASS), ("0.28.2", WARN),
                                            ("0.31.0", WARN), ("0.34.0", WARN)])
def test_only_the_releases_that_ran_on_a_gpu_pass(version, status):
    """What pip installs is what ran: 0.26 and 0.33 ran on an H200; 0.27-0.32 are named untested."""
    facts = vllm_facts()
    facts.version = {"version": version}
    check = next(c for c in _evaluate(compose(["+recipe=deepmath"]), facts) if c.name == "vLLM version")
    assert check.status == status, check
    if version == "0.28.2":
        assert "untested" in check.message and "0.26 and 0.33" in check.message


def test_api_server_count_unknown_still_warns_on_old_vllm():
    # vLLM's JSON config leaves out the private _api_process_count: the version alone decides then.
    facts = vllm_facts(parallel_config={})
    facts.version = {"version": "0.26.0"}
    assert statuses(_evaluate(compose(["+recipe=deepmath"]), facts))["api servers"] == WARN
    facts.version = {"version": "0.33.0"}
    assert "api servers" not in statuses(_evaluate(compose(["+recipe=deepmath"]), facts))


def test_serve_starts_the_embedded_server_and_doctor_passes(model_dir):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [f"model.name={model_dir}", "sampler.backend=embedded", "sampler.device=cpu", f"sampler.port={port}",
            "sampler.max_model_len=128", "rollout.max_completion_length=32", "trainer.bf16=false"]
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo_cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the embedded server did not become ready"
            time.sleep(0.2)
        result = runner.invoke(app, ["doctor", *args, "--json"])
        assert result.exit_code == 0, result.stdout
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_doctor_resolves_a_packaged_model_like_serve(tmp_path, monkeypatch, model_dir, server):
    """`doctor` compares against the folder `serve` gives the server, not the raw model.name."""
    import asyncgrpo_cli.cli as cli

    seen = {}

    def fake_resolve(name, gguf_file=None):
        seen["args"] = (name, gguf_file)
        return str(model_dir)

    monkeypatch.setattr("asyncgrpo_cli.config.models.resolve_model_path", fake_resolve)
    args = overrides("some_package", server.url, "model.gguf_file=model.gguf")
    result = runner.invoke(cli.app, ["doctor", *args, "--json"])
    assert seen["args"] == ("some_package", "model.gguf")
    assert result.exit_code == 0, result.stdout
