"""Hydra's command-line conventions through `asyncgrpo`: --cfg, -m sweeps, hydra.run.dir, --version, --info,
completion, groups in --help, config --doc; and a busy sampler.port refused before the model loads."""

from __future__ import annotations

import dataclasses
import http.server
import socket
import threading

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.docs import _group_classes, attribute_docstrings, documented_yaml, field_docs
from asyncgrpo_cli.config.hydra_conventions import expand_sweep, take_hydra_keys
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.config.schema import RolloutConfig
from asyncgrpo_cli.launch.preflight import free_port
from asyncgrpo_cli.launch.supervisor import check_server_port, run_train

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_version_info_help_and_completion():
    assert invoke("--version").output.startswith("asyncgrpo ")
    info = invoke("--info").output
    assert "config search path" in info and "sampler" in info and "embedded" in info and "smoke" in info
    help_text = " ".join(invoke("--help").output.split())
    assert "--install-completion" in help_text and "--show-completion" in help_text
    for group in ("sampler (embedded|external|vllm)", "peft (lora|none)", "recipe ("):
        assert group in help_text, group
    assert "-m" in invoke("train", "--help").output
    for command in ("train", "serve", "config"):  # Hydra's --info after the command too, before any compose
        assert invoke(command, "--info", "rollout.no_such_key=1").output == info, command


def test_info_columns_line_up_and_flags_show_no_type():
    lines = invoke("--info").output.splitlines()
    sections, current = [], None
    for line in lines:
        if not line.startswith("  "):
            current = []
            sections.append(current)
        else:
            name, _, value = line[2:].partition("  ")
            current.append(len(line) - len(line[2:].split("  ", 1)[1].lstrip()) if value else None)
    assert len(sections) == 3
    for starts in sections:  # within a section every value starts in the same column
        assert starts and None not in starts and len(set(starts)) == 1, starts
    for command in ((), ("train",), ("serve",), ("config",)):
        text = invoke(*command, "--help").output
        assert "--help" in text and "<bool>" not in text, command
    assert "<list[Path]>" in invoke("train", "--help").output  # an option that takes a value keeps its type


def test_cfg_job_hydra_all():
    job = invoke("config", "+recipe=smoke", "--cfg", "job")
    assert job.exit_code == 0 and yaml.safe_load(job.output)["rollout"]["num_generations"] == 4
    hydra = invoke("train", "+recipe=smoke", "--cfg", "hydra")
    assert hydra.exit_code == 0 and "sweeper" in hydra.output and "\nrollout:" not in hydra.output
    shown = yaml.safe_load(hydra.output)["hydra"]  # the folders this run uses, not Hydra's dated defaults
    assert shown["run"]["dir"] == "outputs/smoke" and shown["sweep"]["dir"] == "outputs/smoke"
    from asyncgrpo_cli.config.hydra_conventions import hydra_config_yaml

    assert yaml.safe_load(hydra_config_yaml(["+recipe=smoke"], sweep_dir="sw"))["hydra"]["sweep"]["dir"] == "sw"
    both = invoke("config", "+recipe=smoke", "--cfg", "all")
    assert "hydra:" in both.output and "\nrollout:" in both.output
    assert invoke("config", "--cfg", "jobs").exit_code == 2


def test_hydra_run_dir_is_the_output_folder(tmp_path):
    result = invoke("config", "+recipe=smoke", f"hydra.run.dir={tmp_path}/x")
    assert result.exit_code == 0 and yaml.safe_load(result.stdout)["trainer"]["output_dir"] == f"{tmp_path}/x"
    with pytest.raises(ConfigError, match="trainer.output_dir"):
        take_hydra_keys(["hydra.run.dir=a", "trainer.output_dir=b"])
    refused = invoke("config", "hydra.job.chdir=true")
    assert refused.exit_code == 2 and "trainer.output_dir" in refused.output
    assert invoke("config", "hydra.sweep.dir=x").exit_code == 2  # not a sweep


def test_sweep_without_m_says_how():
    result = invoke("config", "+recipe=smoke", "rollout.temperature=0.7,0.9")
    assert result.exit_code == 2 and "add -m" in result.output and "rollout.temperature=[a,b]" in result.output
    serve = invoke("serve", "+recipe=smoke", "rollout.temperature=0.7,0.9", "--dry-run")
    assert serve.exit_code == 2 and "--multirun" not in serve.output and "takes one value" in serve.output


def test_multirun_one_folder_per_job(tmp_path):
    jobs = expand_sweep(["+recipe=smoke", "rollout.temperature=0.7,0.9", "peft=none,lora"])
    assert [j.swept for j in jobs][:2] == [["rollout.temperature=0.7", "peft=none"],
                                          ["rollout.temperature=0.7", "peft=lora"]] and len(jobs) == 4
    result = invoke("config", "-m", "+recipe=smoke", "rollout.temperature=0.7,0.9", f"hydra.sweep.dir={tmp_path}")
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert [d["rollout"]["temperature"] for d in docs] == [0.7, 0.9]
    assert [d["trainer"]["output_dir"] for d in docs] == [f"{tmp_path}/0", f"{tmp_path}/1"]
    dry = invoke("train", "-m", "--dry-run", "+recipe=smoke", "rollout.temperature=0.7,0.9",
                 f"trainer.output_dir={tmp_path}/s", f"sampler.port={free_port()}")  # 8000 may be busy here
    assert dry.exit_code == 0 and dry.output.count("dry run: nothing started") == 2
    assert f"{tmp_path}/s/0" in dry.output and f"{tmp_path}/s/1" in dry.output
    assert "holds an earlier run" not in dry.output  # a fresh folder: no note


def test_a_sweep_inside_a_finished_run_says_so(tmp_path):
    run = tmp_path / "smoke"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"x")  # a finished run's final model
    result = invoke("config", "-m", "+recipe=smoke", "rollout.temperature=0.7,0.9", f"trainer.output_dir={run}")
    assert result.exit_code == 0
    assert (f"the sweep's job folders go inside {run} ({run}/0, {run}/1, ...), which holds an earlier run (the "
            f"final model)") in result.output and f"hydra.sweep.dir={run}-sweep" in result.output


def test_config_doc_has_every_fields_docstring():
    docs = attribute_docstrings(RolloutConfig)
    assert docs["num_generations"].startswith("Rollouts per prompt")
    text = documented_yaml(compose(["+recipe=smoke"]))
    assert yaml.safe_load(text)["rollout"]["max_completion_length"] == compose(["+recipe=smoke"]).rollout.max_completion_length
    lines = text.splitlines()
    i = lines.index("  num_generations: 4")
    assert lines[i - 1] == f"  # {docs['num_generations']}"
    i = next(n for n, line in enumerate(lines) if line.startswith("  learning_rate: "))  # trainer.*: TrainingArguments' help (AsyncGRPOConfig redefines it)
    assert lines[i - 1].startswith("  # ") and "learning rate" in lines[i - 1].lower()
    for group, (cls, doc) in _group_classes().items():  # every field of every group has a description
        if cls is None:  # a group that is one plain value (tools) is described as a whole
            assert doc, group
            continue
        missing = [f.name for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
        assert not missing, (group, missing)
    assert invoke("config", "--doc", "+recipe=smoke").exit_code == 0


@pytest.fixture
def listening_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_port_refused_before_the_model_loads(listening_port):
    cfg = compose(["+recipe=smoke", f"sampler.port={listening_port}"])
    with pytest.raises(ConfigError, match=rf"sampler.port={listening_port}: another process.*sampler.port=\d+"):
        check_server_port(cfg.sampler)
    console = Console(record=True, width=100, force_terminal=False)
    assert run_train(cfg, console=console, gpu_count=0) == 2  # the GGUF would be exported after this point
    assert "sampler.port" in console.export_text()
    served = invoke("serve", "+recipe=smoke", f"sampler.port={listening_port}")
    assert served.exit_code == 2 and "sampler.port=" in served.output


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_server_this_job_did_not_start_is_refused_unless_external():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        port = httpd.server_address[1]
        cfg = compose(["+recipe=smoke", f"sampler.port={port}"])
        with pytest.raises(ConfigError, match=rf"already answers.*sampler.backend=external sampler.url=http://127.0.0.1:{port}"):
            check_server_port(cfg.sampler)
        check_server_port(compose(["+recipe=smoke", "sampler.backend=external", f"sampler.url=http://127.0.0.1:{port}"]).sampler)
        served = invoke("serve", "+recipe=smoke", f"sampler.port={port}")  # serve's fix is doctor, not training
        assert served.exit_code == 2 and "asyncgrpo doctor" in served.output and "train against" not in served.output
    finally:
        httpd.shutdown()
        httpd.server_close()
