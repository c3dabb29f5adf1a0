"""Before the trainer's first request (the Python API has no supervisor doing this): wait for the server,
saying so, then run `asyncgrpo doctor`'s checks (`server.checks.read_facts` + `evaluate`) against the
trainer's settings, and stop with doctor's fix text when one fails.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import Any

WAIT_LINE_EVERY_S = 10.0


class ServerMismatchError(RuntimeError):
    """The server does not match the trainer's settings (the message lists doctor's failed checks and fixes)."""


def _say(text: str) -> None:
    # A line of its own: the trainer's progress bar may hold the cursor mid-line on the same terminal.
    print(f"\n{text}" if sys.stderr.isatty() else text, file=sys.stderr, flush=True)


def wait_for_server(sampler, url: str, deadline_s: float, say: Callable[[str], None] = _say,
                    every_s: float = WAIT_LINE_EVERY_S) -> float:
    """Wait until ``GET {url}/health`` answers, printing ``waiting for the server at URL (N s left)`` about
    every ``every_s`` seconds while it does not.

    Args:
        sampler: a `SyncSamplerClient` of ``url``.
        deadline_s: seconds to wait at most (``vllm_server_timeout``).

    Returns:
        Seconds waited.

    Raises:
        SamplerUnavailableError: not ready within ``deadline_s`` (names the URL and the last error).
    """
    from ..sampler.client import SamplerUnavailableError

    start = time.monotonic()
    if sampler.health():
        return 0.0
    while True:
        left = deadline_s - (time.monotonic() - start)
        say(f"waiting for the server at {url} ({max(0.0, left):.0f} s left; start it with `asyncgrpo serve` "
            "and the same settings, or set vllm_server_base_url)")
        try:
            sampler.wait_until_ready(max(0.0, min(every_s, left)))
            return time.monotonic() - start
        except SamplerUnavailableError as exc:
            if time.monotonic() - start >= deadline_s:
                raise SamplerUnavailableError(
                    f"no server answered at {url} within {deadline_s:g} s (vllm_server_timeout; CLI: sampler.timeout)"
                    f": {exc}. Fix: start it with `asyncgrpo serve` and the same settings, or point "
                    "vllm_server_base_url (CLI: sampler.url) at a running one", "/health") from None


def doctor_config(args: Any, model_id: str, lora_rank: int | None = None):
    """The CLI config (`AppConfig`) doctor checks, from an `AsyncGRPOConfig`: the fields that have a Hydra
    path (`config.compose.FIELD_PATHS`), ``model.name`` = ``model_id``, LoRA from ``lora_rank``."""
    from omegaconf import OmegaConf

    from ..config.compose import FIELD_PATHS
    from ..config.schema import AppConfig

    cfg = OmegaConf.structured(AppConfig)
    cfg.model.name = model_id
    for name, path in FIELD_PATHS.items():
        group, key = path.split(".")
        value = getattr(args, name, None)
        if name == "vllm_server_base_url":
            cfg.sampler.url = value
            continue
        if value is None and OmegaConf.is_missing(cfg[group], key):
            continue
        cfg[group][key] = getattr(value, "value", value)
    cfg.sampler.backend = "external"
    # The compute dtype doctor compares with the server's (`compute_dtype`): the trainer's own precision flags.
    cfg.trainer.bf16 = bool(getattr(args, "bf16", False))
    cfg.trainer.fp16 = bool(getattr(args, "fp16", False))
    if lora_rank is not None:
        cfg.peft.enabled = True
        cfg.peft.r = int(lora_rank)
    return cfg


def api_names(text: str) -> str:
    """Doctor's text with the trainer's settings named as `AsyncGRPOConfig` fields (``max_completion_length``,
    not ``rollout.max_completion_length``); ``sampler.*`` keys stay, being `asyncgrpo serve`'s settings."""
    from ..config.compose import FIELD_PATHS

    for name, path in FIELD_PATHS.items():
        if not path.startswith("sampler."):
            text = re.sub(rf"(?<![\w.]){re.escape(path)}\b", name, text)
    return text


def check_server(sampler, args: Any, model_id: str, model=None, say: Callable[[str], None] = _say) -> None:
    """`wait_for_server`, then doctor's checks of the server against ``args`` and the model.

    Raises:
        SamplerUnavailableError: the server did not come up within ``args.vllm_server_timeout``.
        ServerMismatchError: a doctor check failed (each failed check with doctor's fix).
    """
    from ..server.checks import FAIL, WARN, evaluate, read_facts

    url = str(args.vllm_server_base_url).rstrip("/")
    waited = wait_for_server(sampler, url, float(args.vllm_server_timeout), say)
    if waited > 0:
        say(f"server ready at {url} ({waited:.0f} s)")
    peft_config = getattr(model, "peft_config", None)
    rank = next(iter(peft_config.values())).r if peft_config else None
    cfg = doctor_config(args, model_id, rank)
    checks = evaluate(read_facts(url, timeout=min(10.0, float(args.vllm_server_timeout))), model=cfg.model,
                      rollout=cfg.rollout, sampler=cfg.sampler, staleness=cfg.staleness, trainer=cfg.trainer,
                      peft=cfg.peft, launch=cfg.launch)
    for c in checks:
        if c.status == WARN:
            say(f"doctor warning: {c.name}: {api_names(c.message)}" + (f" (fix: {api_names(c.fix)})" if c.fix else ""))
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        lines = "\n".join(f"- {c.name}: {api_names(c.message)}. Fix: {api_names(c.fix)}" for c in failed)
        raise ServerMismatchError(f"the server at {url} does not match the trainer ({len(failed)} check(s) "
                                  f"failed):\n{lines}")
