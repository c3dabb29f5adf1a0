"""Fixtures of the sampler tests.

``conformance`` is the server the conformance suite talks to: by default the embedded sampler over a
tiny random Qwen3 (started once per session in a background thread); with
``ASYNCGRPO_CONFORMANCE_URL`` (and optionally ``ASYNCGRPO_CONFORMANCE_MODEL``) set, a server already
running there, e.g. real vLLM on a GPU started with ``--logprobs-mode processed_logprobs``,
``--max-logprobs >= 8`` and ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread

MAX_MODEL_LEN = 256


@dataclass
class ConformanceTarget:
    """The server under test: its URL, served model name, and whether it is our embedded one."""

    url: str
    model: str
    embedded: bool
    max_model_len: int
    handle: ServerThread | None = None


def run(coro):
    """Run one coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def start_embedded(model_dir: Path, **overrides) -> ServerThread:
    """An embedded sampler on a free port over ``model_dir`` (float32, CPU); call ``.stop()`` after."""
    settings = dict(
        model=str(model_dir),
        port=0,
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_tokens=16 * MAX_MODEL_LEN,
        max_num_seqs=32,
        served_model_name="tiny",
    )
    settings.update(overrides)
    return ServerThread(ServerConfig(**settings)).start()


@pytest.fixture(scope="session")
def conformance(tiny_model_dir) -> ConformanceTarget:
    url = os.environ.get("ASYNCGRPO_CONFORMANCE_URL")
    if url:
        import httpx

        url = url.rstrip("/")
        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        base = next(c for c in cards if c.get("parent") is None)
        model = os.environ.get("ASYNCGRPO_CONFORMANCE_MODEL") or base["id"]
        yield ConformanceTarget(url=url, model=model, embedded=False, max_model_len=int(base["max_model_len"]))
        return
    handle = start_embedded(tiny_model_dir, enable_lora=True, max_lora_rank=8, max_loras=2)
    try:
        yield ConformanceTarget(
            url=handle.url, model="tiny", embedded=True, max_model_len=MAX_MODEL_LEN, handle=handle
        )
    finally:
        handle.stop()


@pytest.fixture
def embedded_only(conformance) -> ConformanceTarget:
    if not conformance.embedded:
        pytest.skip("embedded-only behaviour (ASYNCGRPO_CONFORMANCE_URL points at another server)")
    return conformance
