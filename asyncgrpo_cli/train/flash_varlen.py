"""The varlen flash-attention kernel behind the ``flash`` tree-attention backend (SPEC §2.10, §6.2; issue #43).

The ``flash`` backend (``tree_attention``) turns a packed row into one varlen "sequence" per trie segment and calls
a ``flash_attn_varlen_func``. Providers, tried in this order on a CUDA device:

1. ``flash-attn-4`` from PyPI (``flash_attn.cute``: CuTe DSL, Python over ``nvidia-cutlass-dsl``), on compute
   capability 9.x or newer. Its backward needs SM90+, so on older GPUs it is passed over with that reason. Its
   kernels are compiled on first use; :func:`load_flash_varlen` turns on its on-disk cache
   (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` unless the environment says otherwise) so that a resumed or
   repeated run does not compile again.
2. ``flash_attn`` (flash-attention 2) from PyPI.
3. A Hub kernel through the ``kernels`` library, as SPEC §2.10 names them: ``kernels-community/flash-attn4`` on
   Blackwell (capability 10.x+), ``kernels-community/flash-attn3`` on Hopper (9.x), else
   ``kernels-community/flash-attn2``.

The providers disagree on their signatures (flash-attn-4 takes ``qv`` as its fourth positional argument and has
no dropout; flash-attn-3 has no ``dropout_p``), so :func:`call_varlen` passes everything after ``q, k, v`` by
keyword and ``dropout_p`` only when it is non-zero (refused by a provider without it).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["FlashVarlen", "TreeAttentionUnavailable", "call_varlen", "hub_kernel_repo", "load_flash_varlen"]

FA4_MIN_CAPABILITY = 9  # flash-attn-4's backward: SM90 and newer (interface.py of 4.0.0b40)
CUTE_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


class TreeAttentionUnavailable(RuntimeError):
    """The requested tree-attention backend cannot run here: no loadable kernel, or not a CUDA device (defined
    here, where the ``flash`` kernel is loaded; ``tree_attention`` exports it)."""


@dataclass(frozen=True)
class FlashVarlen:
    """A loaded varlen kernel.

    Attributes:
        fn: the provider's ``flash_attn_varlen_func``.
        provider: ``"flash-attn-4"``, ``"flash-attn"`` or the Hub repository (``"kernels-community/..."``).
        version: the installed distribution's version, or ``None`` (Hub kernels).
    """

    fn: Callable[..., object]
    provider: str
    version: str | None

    @property
    def name(self) -> str:
        """``provider version`` for logs and benchmark JSON."""
        return f"{self.provider} {self.version}" if self.version else self.provider


def hub_kernel_repo(capability: tuple[int, int] | None) -> str:
    """SPEC §2.10's Hub kernel for a CUDA compute capability: flash-attn4 on Blackwell (10.x and newer),
    flash-attn3 on Hopper (9.x), flash-attn2 otherwise (and when the capability is unknown)."""
    major = capability[0] if capability else 0
    if major >= 10:
        return "kernels-community/flash-attn4"
    if major == 9:
        return "kernels-community/flash-attn3"
    return "kernels-community/flash-attn2"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load_fa4(capability: tuple[int, int] | None) -> FlashVarlen:
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        raise ImportError("not installed (pip install flash-attn-4)")
    if capability is not None and capability[0] < FA4_MIN_CAPABILITY:
        raise ImportError(
            f"its backward needs compute capability {FA4_MIN_CAPABILITY}.0 or newer, this GPU has "
            f"{capability[0]}.{capability[1]}"
        )
    os.environ.setdefault(CUTE_CACHE_ENV, "1")  # read when flash_attn.cute is first imported
    from flash_attn.cute import flash_attn_varlen_func

    return FlashVarlen(flash_attn_varlen_func, "flash-attn-4", _version("flash-attn-4"))


def _load_fa2(_capability: tuple[int, int] | None) -> FlashVarlen:
    if importlib.util.find_spec("flash_attn") is None:
        raise ImportError("not installed")
    from flash_attn import flash_attn_varlen_func

    return FlashVarlen(flash_attn_varlen_func, "flash-attn", _version("flash-attn"))


def _load_hub(capability: tuple[int, int] | None) -> FlashVarlen:
    if importlib.util.find_spec("kernels") is None:
        raise ImportError("not installed")
    from kernels import get_kernel

    repo = hub_kernel_repo(capability)
    version = None
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_VERSIONS

        version = FLASH_ATTN_KERNEL_VERSIONS.get(repo)
    except ImportError:
        pass
    try:
        kernel = get_kernel(repo) if version is None else get_kernel(repo, version=version)
    except TypeError:  # an older `kernels` without version=
        kernel = get_kernel(repo)
    fn = getattr(kernel, "flash_attn_varlen_func", None)
    if fn is None:
        raise AttributeError(f"{repo} has no flash_attn_varlen_func")
    return FlashVarlen(fn, repo, None)


_PROVIDERS: tuple[tuple[str, Callable[[tuple[int, int] | None], FlashVarlen]], ...] = (
    ("flash-attn-4", _load_fa4),
    ("flash_attn", _load_fa2),
    ("kernels", _load_hub),
)


def _current_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


@functools.cache
def load_flash_varlen(capability: tuple[int, int] | None = None) -> FlashVarlen:
    """The first provider that loads (module docstring), cached per capability.

    Args:
        capability: the CUDA compute capability ``(major, minor)`` of the model's GPU; ``None`` reads the
            current device's (``None`` again without CUDA: no provider is refused for its architecture).

    Raises:
        TreeAttentionUnavailable: none loaded; the message gives every provider's reason and the fix.
    """
    if capability is None:
        capability = _current_capability()
    errors = []
    for label, load in _PROVIDERS:
        try:
            return load(capability)
        except Exception as exc:  # noqa: BLE001 - report every reason together below
            errors.append(f"{label}: {exc}")
    raise TreeAttentionUnavailable(
        "the 'flash' tree attention backend needs flash_attn_varlen_func, and none could be loaded ("
        + "; ".join(errors)
        + "). Install flash-attn-4 (pip install flash-attn-4, Hopper or newer) or asyncgrpo[kernels] with Hugging "
        "Face hub access on a CUDA machine, or set packing.attention to 'flex' (GPU) or 'sdpa'."
    )


@functools.cache
def _accepts_dropout(fn: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True  # a builtin: assume flash-attn-2's signature
    return "dropout_p" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def call_varlen(
    fn: Callable[..., object],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    window_left: int | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """One causal (bottom-right aligned) varlen attention call through any provider's ``flash_attn_varlen_func``.

    Args:
        fn: the provider's function (or ``tree_attention.varlen_attention_reference``).
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (bf16/fp16 for the real kernels; ``Hq % Hkv == 0``).
        cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 offsets; max_seqlen_q, max_seqlen_k: Python ints.
        softmax_scale: the scores' scale (``None``: ``D**-0.5``).
        window_left: a sliding window's reach to the left in tokens (``window - 1``), or ``None`` for none.
        dropout_p: attention dropout; only passed when non-zero.

    Returns:
        ``[Tq, Hq, D]`` (a provider's extra outputs such as the log-sum-exp are dropped).

    Raises:
        NotImplementedError: ``dropout_p > 0`` with a provider that has no dropout (flash-attn-3/4).
    """
    kwargs: dict[str, object] = dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale, causal=True,
        window_size=(window_left, 0) if window_left is not None else (-1, -1),
    )
    if dropout_p:
        if not _accepts_dropout(fn):
            raise NotImplementedError(
                f"this flash kernel has no attention dropout (got {dropout_p}); use packing.attention=sdpa"
            )
        kwargs["dropout_p"] = dropout_p
    out = fn(q, k, v, **kwargs)
    return out[0] if isinstance(out, tuple) else out
