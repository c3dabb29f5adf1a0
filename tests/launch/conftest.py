"""Helpers of the supervisor tests: a composed config that needs no model download, stand-in
server/trainer programs (fake_server.py, fake_trainer.py) and process checks."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from asyncgrpo_cli.config.compose import compose

HERE = Path(__file__).resolve().parent
FAKE_SERVER = str(HERE / "fake_server.py")
FAKE_TRAINER = str(HERE / "fake_trainer.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_overrides(out: Path, port: int, *extra: str) -> list[str]:
    """A config the fake server satisfies: a hub-style model name (resolve_model_path returns it as is,
    nothing is downloaded), the embedded backend on CPU, plain dashboard."""
    return ["model.name=fake-org/tiny-model", "sampler.backend=embedded", "sampler.device=cpu",
            f"sampler.port={port}", "sampler.max_model_len=256", "sampler.timeout=60",
            "rollout.max_completion_length=32", "rollout.num_sampler_logprobs=4", "trainer.bf16=false",
            f"trainer.output_dir={out}", "logging.dashboard=plain", *extra]


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(*overrides)`` → (composed config, output dir)."""
    def _make(*extra: str):
        out = tmp_path / "run"
        return compose(base_overrides(out, free_port(), *extra)), out
    return _make


def hook(server_mode: str = "ok", trainer_mode: str = "ok", pid_dir: Path | None = None,
         use_accelerate: bool = False):
    """A ``_commands`` hook: the fake server gets the builder's argv; the fake trainer replaces the whole
    accelerate command, or (``use_accelerate``) only the ``-m asyncgrpo_cli.train.main`` part."""
    pid_args = ["--fake-pid-dir", str(pid_dir)] if pid_dir else []

    def _hook(name: str, argv: list[str]) -> list[str]:
        if name == "server":
            pid = ["--fake-pid-file", str(pid_dir / "server.pid")] if pid_dir else []
            return [sys.executable, FAKE_SERVER, "--fake-mode", server_mode, *pid, *argv[1:]]
        fake = [FAKE_TRAINER, "--fake-mode", trainer_mode, *pid_args]
        if use_accelerate:
            i = argv.index("asyncgrpo_cli.train.main")
            return [*argv[: i - 1], *fake, *argv[i + 1:]]
        return [sys.executable, *fake, *argv[1:]]
    return _hook


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False
