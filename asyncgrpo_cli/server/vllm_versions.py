"""The vLLM releases this project supports, and what the installed one is and accepts (VLLM.md).

Shared by the server command builder (`server.command`), the colocated layout (`server.colocate`) and the
doctor's checks (`server.checks`). Reads package metadata and, for flags, the installed vLLM's sources;
imports nothing of vLLM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

__all__ = ["MIN_VLLM", "NEWEST_SUPPORTED_VLLM", "SAMPLING_MASK_MIN_VLLM", "SCALE_OUT_MIN_VLLM",
           "installed_vllm_version", "parse_version", "vllm_has_flag"]

# vLLM releases this project is written against (VLLM.md); the newest is assumed when none is installed.
MIN_VLLM = (0, 26)
NEWEST_SUPPORTED_VLLM = "0.33.0"
SAMPLING_MASK_MIN_VLLM = (0, 28)  # --return-sampling-mask (VLLM.md)
SCALE_OUT_MIN_VLLM = (0, 30)      # --enable-scale-out, when the installed sources cannot be read (VLLM.md: ~0.29/0.30+)


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.26.0rc1+cu130"`` → ``(0, 26, 0)``: the release numbers (PEP 440, via `packaging`)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text).release
    except InvalidVersion:
        return ()


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution, or None when vLLM is not installed."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_has_flag(flag: str, version: str | None) -> bool:
    """Whether the vLLM in use accepts ``flag`` (e.g. ``--enable-scale-out``).

    Reads the installed vLLM's argument definitions when ``version`` is the installed one; otherwise
    decides by the release that introduced the flag (VLLM.md).
    """
    snake = flag.lstrip("-").replace("-", "_")
    if version is not None and version == installed_vllm_version():
        spec = importlib.util.find_spec("vllm")
        if spec is not None and spec.origin:
            root = Path(spec.origin).parent
            for rel in ("engine/arg_utils.py", "entrypoints/openai/cli_args.py", "config/model.py",
                        "entrypoints/openai/api_server.py", "entrypoints/common/cli_args.py"):  # 0.33: common
                path = root / rel
                if path.is_file() and snake in path.read_text(errors="ignore"):
                    return True
            return False
    v = parse_version(version or NEWEST_SUPPORTED_VLLM)
    minimum = {"enable_scale_out": SCALE_OUT_MIN_VLLM, "return_sampling_mask": SAMPLING_MASK_MIN_VLLM}.get(snake, MIN_VLLM)
    return v >= minimum
