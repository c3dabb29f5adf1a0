"""Secrets stay in the environment: a config that carries one (``trainer.hub_token``, a token in
``sampler.env``) is refused at compose time, before it could be printed, saved in
``<output_dir>/asyncgrpo_config.yaml`` (a plain file) or passed on a command line.

The run reads its secrets from the environment itself: ``HF_TOKEN`` for the Hub (huggingface_hub reads it for
``push_to_hub`` and for downloads), ``WANDB_API_KEY`` for Weights & Biases, ...; the server and the trainer
inherit the environment of ``asyncgrpo train``.
"""

from __future__ import annotations

from typing import Any

from ..run.redact import HIDDEN, is_secret_name
from .errors import ConfigError


def check_no_secrets(cfg: Any) -> None:
    """Refuse a secret in the composed config (module docstring); the message never shows its value.

    Raises:
        ConfigError: naming the key (the value hidden), why and the fix (the environment variable to export).
    """
    token = cfg.trainer.get("hub_token")
    if token:
        raise ConfigError(
            f"trainer.hub_token={HIDDEN!r} (hidden): a token given on the command line or in a recipe is visible "
            "to every user of this machine (ps, shell history) and would be saved in plain text in "
            "<output_dir>/asyncgrpo_config.yaml. Fix: remove trainer.hub_token and export HF_TOKEN=... in the "
            "shell instead (the trainer's Hub uploads read it from the environment)", key="trainer.hub_token")
    for name in (cfg.sampler.get("env") or {}):
        if is_secret_name(str(name)):
            raise ConfigError(
                f"sampler.env.{name}={HIDDEN!r} (hidden): a secret in sampler.env is printed in the server's "
                "command line (the launch plan, serve --dry-run) and saved in <output_dir>/asyncgrpo_config.yaml. "
                f"Fix: remove it from sampler.env and export {name}=... in the shell instead (the server inherits "
                "the environment)", key=f"sampler.env.{name}")
