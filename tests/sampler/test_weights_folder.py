"""The embedded sampler reads weight files from the run's weights folder only (issue #36, safety rails):
``/update_weights`` with any other path (``/etc/passwd``, a symlink leading out, ``..``) answers 400 naming
the path, the folder and the fix, and never opens the file; the trainer writes where the server says."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from .conftest import start_embedded


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    handle = start_embedded(tiny_model_dir, weights_dir=str(run / ".weights"))
    try:
        yield handle, run
    finally:
        handle.stop()


def _update(url: str, path: str, names=("model.embed_tokens.weight",)) -> httpx.Response:
    return httpx.post(f"{url}/update_weights", json={"update_info": {"names": list(names), "path": path}}, timeout=60)


def test_a_path_outside_the_weights_folder_is_a_400_with_the_reason(served, tmp_path):
    handle, run = served
    weights = (run / ".weights").resolve()
    outside = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(2)}, str(outside))
    (run / ".weights").mkdir(exist_ok=True)
    link = run / ".weights" / "link.safetensors"
    link.symlink_to(outside)  # inside by name, outside once followed
    for path in ("/etc/passwd", str(outside), str(link), str(run / ".weights" / ".." / "x.safetensors"), str(run)):
        answer = _update(handle.url, path)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "path" and f"update_info.path={path!r}" in error["message"], error
        assert f"outside this server's weights folder {weights}" in error["message"] and "Fix:" in error["message"]
    assert handle.server.weight_updates == 0
    info = httpx.get(f"{handle.url}/server_info?config_format=json", timeout=30).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "file", "weights_dir": str(weights)}


def test_a_file_inside_that_is_no_safetensors_is_a_400_not_a_500(served):
    handle, run = served
    (run / ".weights").mkdir(exist_ok=True)
    junk = run / ".weights" / "junk.safetensors"
    junk.write_text("not a safetensors file")
    answer = _update(handle.url, str(junk))
    assert answer.status_code == 400 and "is not a safetensors file" in answer.json()["error"]["message"], answer.text


def test_without_a_weights_folder_the_server_uses_a_private_one_and_removes_it(tiny_model_dir):
    handle = start_embedded(tiny_model_dir)
    folder = handle.server.weights_dir
    try:
        assert folder.is_dir() and oct(folder.stat().st_mode & 0o777) == "0o700"
        assert _update(handle.url, "/etc/passwd").status_code == 400
    finally:
        handle.stop()
    assert not folder.exists()


def test_the_trainer_writes_into_the_folder_the_server_names(served, tiny_model_dir):
    """`make_weight_sync` against the real server: its files land where the server reads them."""
    from asyncgrpo_cli.sampler.client import SyncSamplerClient
    from asyncgrpo_cli.train.weight_sync import EmbeddedPathSync, make_weight_sync

    handle, run = served
    backend = make_weight_sync(SyncSamplerClient(handle.url, timeout_s=60.0), output_dir=run / "elsewhere")
    assert isinstance(backend, EmbeddedPathSync) and backend.weights_dir == (run / ".weights").resolve()
    assert os.path.basename(str(backend.weights_dir)) == ".weights"


def test_a_restarted_server_with_another_folder_gets_the_next_sync_there(tiny_model_dir):
    """A server started without --weights-dir reads from a temporary folder of its own, a new one after a
    restart: each sync asks the server where to write (the restart drill failed with a 400 before)."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.sampler.client import SyncSamplerClient
    from asyncgrpo_cli.train.weight_sync import make_weight_sync
    from asyncgrpo_cli.train.weight_sync.params import FullWeightSource

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    first = start_embedded(tiny_model_dir)
    try:
        backend = make_weight_sync(SyncSamplerClient(first.url, timeout_s=60.0), output_dir="unused")
        assert backend.weights_dir == first.server.weights_dir
    finally:
        first.stop()
    second = start_embedded(tiny_model_dir)  # "restarted": another temporary folder
    try:
        backend.client = SyncSamplerClient(second.url, timeout_s=60.0)
        backend.sync(FullWeightSource(model), 1)
        assert backend.weights_dir == second.server.weights_dir and second.server.weight_updates >= 1
    finally:
        second.stop()
