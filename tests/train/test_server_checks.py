"""The Python API's server checks: a waiting line with the seconds left, then doctor's checks (fix text on a
mismatch), against the embedded sampler on a tiny model."""

from __future__ import annotations

import socket

import pytest

from asyncgrpo_cli.sampler.client import SamplerUnavailableError, SyncSamplerClient
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
from asyncgrpo_cli.train.server_checks import ServerMismatchError, check_server, wait_for_server


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_waiting_line_names_the_url_and_the_seconds_left():
    url = closed_port_url()
    said: list[str] = []
    with pytest.raises(SamplerUnavailableError, match="not ready"):
        wait_for_server(SyncSamplerClient(url, timeout_s=1.0), url, deadline_s=1.0, say=said.append, every_s=0.4)
    assert said and all(line.startswith(f"waiting for the server at {url} (") and " s left" in line
                        for line in said)
    assert "(1 s left" in said[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    handle = ServerThread(ServerConfig(model=str(model), port=0, device="cpu", dtype="float32", max_model_len=128,
                                       kv_cache_tokens=1024, max_num_seqs=4, served_model_name="tiny")).start()
    yield handle
    handle.stop()


def args_for(url: str, tmp_path, max_completion_length: int = 16) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=url, vllm_server_timeout=30.0,
                           num_generations=2, max_completion_length=max_completion_length, num_sampler_logprobs=3,
                           report_to="none")


def test_matching_server_passes(server, tmp_path):
    said: list[str] = []
    check_server(SyncSamplerClient(server.url, timeout_s=30.0), args_for(server.url, tmp_path), "tiny",
                 say=said.append)
    assert not any(line.startswith("waiting") for line in said)


def test_server_of_another_model_is_refused_with_doctors_fix(server, tmp_path):
    with pytest.raises(ServerMismatchError) as info:
        check_server(SyncSamplerClient(server.url, timeout_s=30.0), args_for(server.url, tmp_path),
                     "Qwen/Qwen3-0.6B", say=lambda _: None)
    text = str(info.value)
    assert "model:" in text and "Qwen/Qwen3-0.6B" in text and "Fix: restart the server" in text
    with pytest.raises(ServerMismatchError, match="max_model_len") as info:  # no room for a prompt: 128 >= 128
        check_server(SyncSamplerClient(server.url, timeout_s=30.0), args_for(server.url, tmp_path, 128), "tiny",
                     say=lambda _: None)
    text = str(info.value)  # the Python API's names for its own settings; sampler.* stays (asyncgrpo serve's)
    assert "max_completion_length=128" in text and "rollout.max_completion_length" not in text, text
    assert "asyncgrpo doctor" not in text


def test_dtype_mismatch_is_one_warning_line_naming_both_dtypes_and_the_fix(server, tmp_path):
    """SPEC §8.1/§16.3: the trainer itself (not only doctor) warns at start when the server's dtype is not its
    compute dtype; the run goes on."""
    said: list[str] = []
    args = args_for(server.url, tmp_path)
    args.bf16, args.fp16 = True, False  # computes in bfloat16; the server runs float32
    check_server(SyncSamplerClient(server.url, timeout_s=30.0), args, "tiny", say=said.append)
    lines = [line for line in said if "dtype" in line]
    assert len(lines) == 1, said
    assert "server runs float32" in lines[0] and "computes in bfloat16" in lines[0]
    assert "--dtype bfloat16" in lines[0] and "trainer.bf16=false" in lines[0] and "\n" not in lines[0]
    said.clear()
    args.bf16 = False  # float32 on both sides: nothing to say
    check_server(SyncSamplerClient(server.url, timeout_s=30.0), args, "tiny", say=said.append)
    assert not [line for line in said if "dtype" in line], said
