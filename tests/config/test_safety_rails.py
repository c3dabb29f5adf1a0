"""Safety rails that no override gets around (issue #36): the server's flags stay the builder's (no second
``--host`` through ``sampler.extra_args``), and secrets stay in the environment (never in a file the run
writes, the run lock or a printed line)."""

from __future__ import annotations

import json
import pickle
import sys

import pytest
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.rules import ConfigError

runner = CliRunner()
SECRET = "hf_NotARealTokenButSecret123"


# ------------------------------------------------------------------------------------ sampler.extra_args
@pytest.mark.parametrize("extra", [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--ho", "0.0.0.0"], ["--host", "::"]])
def test_a_public_host_in_extra_args_gets_the_sampler_host_refusal(extra):
    """The last --host wins: ``--host 127.0.0.1 ... --host 0.0.0.0`` bound the dev routes to every address."""
    with pytest.raises(ConfigError) as public:
        compose(["model.name=x", "sampler.host=0.0.0.0"])
    with pytest.raises(ConfigError) as info:
        compose(["+recipe=smoke", f"sampler.extra_args={json.dumps(extra)}"])
    text = str(info.value)
    assert info.value.key == "sampler.extra_args" and text.startswith("sampler.extra_args=[")
    reason = str(public.value).split("is not a loopback address: ", 1)[1].split(". Fix:", 1)[0]
    assert f"is not a loopback address: {reason}. Fix: remove {extra[0]} from sampler.extra_args" in text
    assert "sampler.host=127.0.0.1 (reach it through an SSH tunnel)" in text and "sampler.allow_public=true" in text


def test_allow_public_does_not_let_extra_args_set_the_host():
    with pytest.raises(ConfigError, match=r"--host 0\.0\.0\.0 would replace sampler.host=0\.0\.0\.0"):
        compose(["+recipe=smoke", "sampler.host=0.0.0.0", "sampler.allow_public=true",
                 "sampler.extra_args=[--host,0.0.0.0]"])


@pytest.mark.parametrize("extra,key", [
    (["--host", "127.0.0.1"], "sampler.host"), (["--port", "9"], "sampler.port"),
    (["--max_model_len", "4"], "sampler.max_model_len"), (["--max-lora-r", "8"], "peft.r"),
    (["--config", "more.yaml"], "the keys above"), (["-dp", "2"], "sampler.data_parallel_size"),
    (["--weights-dir", "/"], "trainer.output_dir"),
])
def test_every_flag_the_builder_owns_is_refused_in_extra_args(extra, key):
    with pytest.raises(ConfigError) as info:
        compose(["+recipe=smoke", f"sampler.extra_args={json.dumps(extra)}"])
    assert info.value.key == "sampler.extra_args" and key in str(info.value) and "Fix: remove" in str(info.value)


def test_flags_the_builder_does_not_own_pass():
    for extra in (["--enforce-eager"], ["--seed", "1", "--max-num-seqs", "64"], ["--no-return-sampling-mask"],
                  ["--enable-lora-bias"], ["--config-format", "hf"], ["--kv-cache-dtype=fp8"]):
        compose(["+recipe=smoke", f"sampler.extra_args={json.dumps(extra)}"])


def test_the_owned_list_covers_every_flag_the_builder_writes():
    """A flag the builder starts writing must join OWNED_FLAGS, or extra_args could override it."""
    from asyncgrpo_cli.config.server_flags import OWNED_FLAGS
    from asyncgrpo_cli.server.colocate import Layout
    from asyncgrpo_cli.server.command import build_server_command

    everything = ["model.name=x", "model.trust_remote_code=true", "peft.enabled=true", "sampler.data_parallel_size=2",
                  "sampler.gpu_memory_utilization=0.5", "sampler.max_model_len=256", "sampler.kv_cache_tokens=4096",
                  "rollout.top_k=8", "launch.server_gpus=[0,1]", "launch.trainer_gpus=[2]"]
    written = set()
    for backend in ("vllm", "embedded"):
        cfg = compose([*everything, f"sampler.backend={backend}", "sampler.device=cpu", "model.gguf_file=m.gguf"])
        for layout in (Layout(colocated=False, reason=""), Layout(colocated=True, reason="", gpu=0)):
            cmd = build_server_command("0.33.0", layout=layout, model=cfg.model, sampler=cfg.sampler,
                                       launch=cfg.launch, rollout=cfg.rollout, trainer=cfg.trainer, peft=cfg.peft,
                                       staleness=cfg.staleness, use_installed=False)
            written |= {a for a in cmd.argv if a.startswith("--")}
    conditional = {"--return-sampling-mask", "--enable-scale-out"}  # added only when filtering; repeating is harmless
    assert written - conditional <= set(OWNED_FLAGS), written - conditional - set(OWNED_FLAGS)


def test_the_embedded_sampler_takes_no_abbreviated_flag():
    from asyncgrpo_cli.sampler.embedded.__main__ import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--ho", "0.0.0.0"])


def test_the_embedded_command_names_the_runs_weights_folder(tmp_path):
    from asyncgrpo_cli.server.command import server_command_here

    cmd = server_command_here(compose(["+recipe=smoke", f"trainer.output_dir={tmp_path}/run"]))
    assert cmd.flag("--weights-dir") == str(tmp_path / "run" / ".weights")


# ------------------------------------------------------------------------------------ secrets
def test_a_hub_token_in_the_config_is_refused_without_showing_it(tmp_path):
    out = tmp_path / "run"
    for command in (["config"], ["config", "--check"], ["train", "--dry-run"], ["train"], ["serve", "--dry-run"]):
        result = runner.invoke(app, [*command, "+recipe=smoke", f"trainer.hub_token={SECRET}",
                                     f"trainer.output_dir={out}"])
        assert result.exit_code == 2, result.output
        assert "trainer.hub_token='***' (hidden)" in result.output and "export HF_TOKEN=" in result.output
        assert SECRET not in result.output and "Traceback" not in result.output
    assert not out.exists()  # no config file, no lock


def test_a_secret_in_sampler_env_is_refused_without_showing_it():
    with pytest.raises(ConfigError) as info:
        compose(["+recipe=smoke", f"+sampler.env.HF_TOKEN={SECRET}"])
    assert "sampler.env.HF_TOKEN='***'" in str(info.value) and SECRET not in str(info.value)
    assert "export HF_TOKEN=" in str(info.value)
    compose(["+recipe=smoke", "+sampler.env.OMP_NUM_THREADS=1", "+sampler.env.MAX_TOKENS=4"])  # not secrets


def test_the_run_lock_hides_a_secret_of_its_command_line(tmp_path, monkeypatch):
    from asyncgrpo_cli.run.state import RunLock

    monkeypatch.setattr(sys, "argv", ["asyncgrpo", "train", "+recipe=smoke", f"trainer.hub_token={SECRET}",
                                      "--token", SECRET, f"WANDB_API_KEY={SECRET}"])
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        text = lock.path.read_text()
    finally:
        lock.release()
    assert SECRET not in text
    assert json.loads(text)["command"] == \
        "asyncgrpo train +recipe=smoke trainer.hub_token=*** --token *** WANDB_API_KEY=***"


def test_the_api_never_pickles_the_hub_token(tmp_path):
    """training_args.bin (torch.save of the args, in every checkpoint) held the token in plain text."""
    import io

    import torch

    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", hub_token=SECRET)
    saved = io.BytesIO()
    torch.save(args, saved)
    assert SECRET.encode() not in saved.getvalue() and SECRET.encode() not in pickle.dumps(args)
    assert args.hub_token == SECRET  # the live object keeps it for push_to_hub
    assert SECRET not in str(args) and SECRET not in args.to_json_string()
