"""The server flags the command builder owns, and the refusal of ``sampler.extra_args`` that repeats one.

`server.command.build_server_command` writes ``--host``, ``--port``, ``--max-model-len`` ... from the config;
``sampler.extra_args`` is appended after them, and both ``vllm serve`` and the embedded sampler keep the LAST
value of a repeated flag. ``sampler.extra_args=[--host,0.0.0.0]`` would therefore bind the server beyond
loopback past the ``sampler.host`` refusal, and ``--port`` would move it away from the URL the trainer
uses. `check_extra_args` refuses every owned flag (also abbreviated, ``--ho``, or spelt with underscores,
``--max_model_len``, which argparse and vLLM accept), naming the key that sets it instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError

#: Flag -> the config key that sets it (what the builder writes from). Every flag the builder emits is here
#: (tests/config/test_safety_rails.py checks it against the builder's real command lines).
OWNED_FLAGS: dict[str, str] = {
    "--host": "sampler.host",
    "--port": "sampler.port",
    "--model": "model.name",
    "--weight-transfer-config": "launch.colocate (the builder picks the NCCL or the CUDA-IPC transfer)",
    "--logprobs-mode": "nothing: the trainer needs processed_logprobs",
    "--api-server-count": "sampler.api_server_count",
    "--data-parallel-size": "sampler.data_parallel_size",
    "-dp": "sampler.data_parallel_size",
    "--max-model-len": "sampler.max_model_len",
    "--max-logprobs": "sampler.max_logprobs",
    "--dtype": "trainer.bf16 / trainer.fp16 / model.dtype (the trainer's compute dtype)",
    "--gpu-memory-utilization": "sampler.gpu_memory_utilization",
    "--trust-remote-code": "model.trust_remote_code",
    "--enable-lora": "peft.enabled",
    "--max-lora-rank": "peft.r",
    "--max-loras": "staleness.max_staleness (max_staleness + 2 adapters)",
    "--gguf-file": "model.gguf_file",
    "--device": "sampler.device",
    "--kv-cache-tokens": "sampler.kv_cache_tokens",
    "--weights-dir": "trainer.output_dir (the server reads weight files from its .weights folder only)",
    "--config": "the keys above: a vLLM config file can set every flag the builder owns",
}


def _owned(token: str) -> str | None:
    """The owned flag ``token`` names (exactly, with underscores for dashes, or as an argparse abbreviation of
    a long flag); None when it names none."""
    name = token.split("=", 1)[0]
    if not name.startswith("-") or name in ("-", "--"):
        return None
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    if name in OWNED_FLAGS:
        return name
    if name.startswith("--") and len(name) > 3:
        matches = [f for f in OWNED_FLAGS if f.startswith("--") and f.startswith(name)]
        return matches[0] if matches else None
    return None


def owned_flags_in(extra_args: Sequence[Any]) -> list[tuple[str, str, str | None]]:
    """``(the token as written, the owned flag it names, its value or None)`` for every owned flag in
    ``extra_args`` (the value is the ``=`` part or the next token that is not a flag)."""
    args = [str(a) for a in extra_args]
    found = []
    for i, token in enumerate(args):
        flag = _owned(token)
        if flag is None:
            continue
        if "=" in token:
            value: str | None = token.split("=", 1)[1]
        else:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else None
        found.append((token, flag, value))
    return found


def check_extra_args(extra_args: Sequence[Any], *, host: str, public_risk: str, is_loopback: Any) -> None:
    """Refuse a flag of ``sampler.extra_args`` that the builder owns (module docstring).

    Args:
        extra_args: ``sampler.extra_args``.
        host: ``sampler.host``.
        public_risk: why a public bind is refused (the ``sampler.host`` message's reason).
        is_loopback: ``host -> bool``.

    Raises:
        ConfigError: naming ``sampler.extra_args``, the flag, the key that sets it and the fix; a non-loopback
            ``--host`` gets the ``sampler.host`` refusal's reason and fix.
    """
    found = owned_flags_in(extra_args)
    if not found:
        return
    shown = "[" + ",".join(str(a) for a in extra_args) + "]"
    token, flag, value = found[0]
    written = f"{token} {value}" if value is not None and "=" not in token else token
    if flag == "--host" and value is not None and not is_loopback(value):
        raise ConfigError(
            f"sampler.extra_args={shown}: {written} would replace sampler.host={host} (the last --host wins), and "
            f"{value} is not a loopback address: {public_risk}. Fix: remove {token} from sampler.extra_args; keep "
            "sampler.host=127.0.0.1 (reach it through an SSH tunnel), or set sampler.host="
            f"{value} sampler.allow_public=true on a trusted network", key="sampler.extra_args")
    raise ConfigError(
        f"sampler.extra_args={shown}: {written} repeats {flag}, which the server command already gets from "
        f"{OWNED_FLAGS[flag]}; the server keeps the last value, so it would not run as configured. Fix: remove "
        f"{token} from sampler.extra_args" + ("" if OWNED_FLAGS[flag].startswith("nothing") else
                                               f" and set {OWNED_FLAGS[flag].split(' ')[0]} instead"),
        key="sampler.extra_args")
