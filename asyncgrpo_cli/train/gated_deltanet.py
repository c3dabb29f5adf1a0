"""Gated DeltaNet layers in tree-packed rows (SPEC §2.8, §6.5).

A Gated DeltaNet layer (``linear_attention`` in Qwen3.5 / Qwen3.6 / Qwen3-Next ``layer_types``) mixes tokens in
two places, and both must follow the trie of a packed row rather than its memory order:

- the **short causal convolution** (kernel ``K``, 4 in every released checkpoint) reads, for each token, the
  ``K - 1`` tokens before it *in its own sample*: its trie ancestors. :func:`tree_causal_conv1d` runs the model's
  ordinary depthwise convolution over the packed row (right for every token whose ``K - 1`` packed neighbours are
  its ancestors) and recomputes the few tokens near a segment start from gathered ancestors;
- the **chunked gated delta rule** carries a recurrent state ``[H_v, D_k, D_v]`` along the sequence.
  :func:`tree_gated_delta_rule` runs it segment by segment, each segment starting from its **parent segment's
  final state** (zeros for a root segment, so plain padding-free packing resets the state at every sample).
  Segments of the same trie depth do not depend on each other and go into **one kernel call**.

How it is plugged in: the model's own ``*GatedDeltaNet`` modules are kept. Their forward calls the modeling
module's ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` and hands them the forward's keyword arguments,
which in a packed forward include ``tree_attention`` (``asyncgrpo_cli.train.tree_attention.TreeAttentionInputs``).
:func:`prepare_gated_deltanet` (called from ``apply_tree_attention`` at trainer start) replaces those two module-level
names with dispatchers that take the tree path when ``tree_attention`` is present and call the original function
otherwise (generation, evaluation). transformers 5.17 and 5.24 both call these names with these arguments.

Kernels of the delta rule (``ASYNCGRPO_GDN_KERNEL`` overrides; default ``fla`` on CUDA, ``torch`` elsewhere):

- ``torch``: the model's own plain-torch chunked function, segments of one depth right-padded into a batch
  (padding has ``k = v = q = 0``, ``beta = 0``, ``g = 0``, which leaves the state unchanged). float32-exact
  reference; slow on GPU.
- ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (package ``fla-core``), segments of one depth
  concatenated into one varlen call (``cu_seqlens``) with one initial state per segment. Probed with a tiny
  forward + backward at trainer start: fla refuses its backward on Hopper with Triton in ``[3.4.0, 3.7.1)`` unless
  ``tilelang`` is installed, and that refusal is raised then (:class:`GatedDeltaNetUnavailable`), not mid-step.
  The probe is also where its kernels compile on a machine's first run (Triton, tilelang): a progress line says
  so, with the caches that keep them for later runs (:func:`kernel_caches`), and the time it took.

Only the modeling modules in :data:`SUPPORTED_MODULES` (whose forwards were read) are accepted; any other
token-mixing layer is refused by :func:`check_token_mixers`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .model_features import model_configs as _configs

__all__ = [
    "GDN_KERNELS",
    "SUPPORTED_FAMILIES",
    "SUPPORTED_MODULES",
    "GatedDeltaNetUnavailable",
    "TreeLinearPlan",
    "UnsupportedTokenMixer",
    "check_token_mixers",
    "gated_deltanet_layers",
    "kernel_caches",
    "prepare_gated_deltanet",
    "resolve_gdn_kernel",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
]

GDN_KERNELS = ("torch", "fla")
#: transformers modeling modules whose Gated DeltaNet forward calls ``causal_conv1d_fn(x, weight, bias,
#: activation=..., **kwargs)`` and ``torch_chunk_gated_delta_rule(q, k, v, g=, beta=, initial_state=, ...,
#: **kwargs)`` (checked in transformers 5.17 and 5.24).
SUPPORTED_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
SUPPORTED_FAMILIES = (
    "decoder-only attention models (full or sliding-window attention, dense or MoE: Llama, Qwen2/3, Mistral, ...)",
    "Gated DeltaNet hybrids: Qwen3.5 and Qwen3.6 (model types qwen3_5, qwen3_5_moe), Qwen3-Next (qwen3_next)",
)
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention", "attention"}
# model types whose non-attention layers mix tokens and are not implemented for tree packing
_REFUSED_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid",
    "nemotron_h", "nemotron_h_omni", "lfm2", "lfm2_moe", "lfm2_vl", "lfm3", "lfm3_vl", "rwkv", "recurrent_gemma",
    "minimax", "kimi_linear", "olmo_hybrid", "plamo2", "hymba", "lara_mini", "qwen4_exp",
}
_MIXER_NAME_HINTS = ("mamba", "mixer", "ssm", "shortconv", "linearattention", "rwkv", "recurrent", "deltanet",
                     "lightning", "rglru")
_CONV_NAME = "causal_conv1d_fn"
_RULE_NAME = "torch_chunk_gated_delta_rule"


class GatedDeltaNetUnavailable(RuntimeError):
    """The Gated DeltaNet kernel selected for tree packing cannot run here (missing package, refused backward)."""


class UnsupportedTokenMixer(ValueError):
    """The model has a token-mixing layer that tree packing cannot reproduce exactly (SPEC §2.8)."""


# --------------------------------------------------------------------------------------------------
# Which layers, and refusal of the rest
# --------------------------------------------------------------------------------------------------


def _is_gdn(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "conv1d") and hasattr(module, "A_log")


def gated_deltanet_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet modules (any family), in module order."""
    return [m for m in model.modules() if _is_gdn(m)]


def check_token_mixers(model: torch.nn.Module, model_id: str | None = None) -> list[torch.nn.Module]:
    """Refuse a model whose non-attention layers mix tokens in a way tree packing does not reproduce.

    Accepted: attention layers (handled by tree attention), and the Gated DeltaNet layers of
    :data:`SUPPORTED_MODULES`. Refused: Mamba/SSM, short-convolution, other linear-attention or recurrent layers,
    ``layer_types`` entries other than full/sliding/linear attention, and any Gated DeltaNet from another
    modeling module (its forward was not checked).

    Returns:
        The supported Gated DeltaNet modules (possibly empty).

    Raises:
        UnsupportedTokenMixer: naming the layer type, the model id and the supported families.
    """
    configs = _configs(model)
    model_id = model_id or (getattr(configs[0], "_name_or_path", None) if configs else None) or type(model).__name__

    def refuse(what: str) -> UnsupportedTokenMixer:
        return UnsupportedTokenMixer(
            f"{model_id}: {what}. Tree packing would give this layer's tokens the wrong context (packed neighbours "
            "instead of their own sample's history), so training would use wrong log-probs; it is refused (SPEC "
            "§2.8). Supported families: " + "; ".join(SUPPORTED_FAMILIES) + ". Fix: use a model of a supported family"
        )

    for config in configs:
        model_type = getattr(config, "model_type", None)
        if model_type in _REFUSED_MODEL_TYPES:
            raise refuse(f"model type {model_type!r} has token-mixing non-attention layers that tree packing does "
                         "not support")
        for layer_type in sorted(set(getattr(config, "layer_types", None) or ())):
            if layer_type not in _SUPPORTED_LAYER_TYPES:
                raise refuse(f"layer type {layer_type!r} (config.layer_types) is not supported by tree packing")
    gdn = []
    for name, module in model.named_modules():
        cls = type(module)
        if _is_gdn(module):
            if cls.__module__ not in SUPPORTED_MODULES:
                raise refuse(f"layer {name} is a {cls.__name__} from {cls.__module__}, a Gated DeltaNet whose "
                             "forward tree packing was not checked against")
            gdn.append(module)
            continue
        lowered = cls.__name__.lower()
        if any(h in lowered for h in _MIXER_NAME_HINTS) and not lowered.endswith(("norm", "rmsnormgated")):
            raise refuse(f"layer {name} is a {cls.__name__}, a token-mixing layer that tree packing does not support")
    return gdn


# --------------------------------------------------------------------------------------------------
# Per-row plan (built once per forward, shared by all layers)
# --------------------------------------------------------------------------------------------------


class TreeLinearPlan:
    """Trie structure of one packed row as the Gated DeltaNet kernels need it.

    Args:
        segment_start, segment_length, segment_parent: the row's segment table (``PackedRow``), Python ints.
        num_tokens: ``L``.
        kernel_size: the convolution's ``K``.
        device: where index tensors live.

    Attributes:
        fix_index: ``[F]`` int64 row indices of tokens whose ``K - 1`` packed predecessors are not all their
            ancestors (the first ``K - 1`` tokens of every segment).
        fix_taps: ``[F, K]`` int64 row index of each such token's ancestor at distance ``K - 1 - t`` (tap ``t``;
            the last tap is the token itself), ``L`` (a zero column) where the sample has no such token.
        levels: per trie depth, ``(segments, token_index, cu_seqlens, parents)``: the segment ids at that depth,
            ``[T]`` int64 row indices of their tokens concatenated, ``[n + 1]`` int32 offsets, and the parent
            segment of each (``-1`` for roots).
    """

    def __init__(self, segment_start: list[int], segment_length: list[int], segment_parent: list[int],
                 num_tokens: int, kernel_size: int, device: torch.device) -> None:
        self.num_tokens = num_tokens
        self.kernel_size = kernel_size
        depth: list[int] = []
        prev_token: list[int] = [-1] * num_tokens  # the token before each one in its own sample
        for s, (start, length, parent) in enumerate(zip(segment_start, segment_length, segment_parent)):
            if parent >= s:
                raise ValueError(f"segment {s} has parent {parent}: parents must come before their children")
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
            if length:
                prev_token[start] = segment_start[parent] + segment_length[parent] - 1 if parent >= 0 else -1
                for i in range(start + 1, start + length):
                    prev_token[i] = i - 1
        fix, taps = [], []
        for start, length in zip(segment_start, segment_length):
            for i in range(start, min(start + length, start + kernel_size - 1)):
                chain = [i]
                for _ in range(kernel_size - 1):
                    chain.append(prev_token[chain[-1]] if chain[-1] >= 0 else -1)
                packed = [i - d if i - d >= 0 else -1 for d in range(kernel_size)]
                if chain != packed:
                    fix.append(i)
                    taps.append([c if c >= 0 else num_tokens for c in reversed(chain)])
        self.fix_index = torch.tensor(fix, dtype=torch.int64, device=device)
        self.fix_taps = torch.tensor(taps, dtype=torch.int64, device=device).reshape(len(fix), kernel_size)
        self.levels: list[tuple[list[int], torch.Tensor, torch.Tensor, list[int]]] = []
        for d in range(max(depth, default=-1) + 1):
            segs = [s for s in range(len(depth)) if depth[s] == d]
            index, cu = [], [0]
            for s in segs:
                index.extend(range(segment_start[s], segment_start[s] + segment_length[s]))
                cu.append(len(index))
            self.levels.append((
                segs, torch.tensor(index, dtype=torch.int64, device=device),
                torch.tensor(cu, dtype=torch.int32, device=device), [segment_parent[s] for s in segs],
            ))
        self.has_children = {p for p in segment_parent if p >= 0}

    @classmethod
    def of(cls, ctx: Any, kernel_size: int) -> TreeLinearPlan:
        """The plan of the row behind ``ctx`` (a ``TreeAttentionInputs``), cached on it per kernel size."""
        key = ("gdn", kernel_size)
        if key not in ctx._cache:
            starts, lengths, parents = ctx._segments
            ctx._cache[key] = cls(starts, lengths, parents, ctx.num_tokens, kernel_size, ctx.device)
        return ctx._cache[key]


# --------------------------------------------------------------------------------------------------
# The two token-mixing operations along the trie
# --------------------------------------------------------------------------------------------------


def tree_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str | None, plan: TreeLinearPlan) -> torch.Tensor:
    """Depthwise causal convolution where each token reads its trie ancestors (SPEC §6.5).

    Args:
        hidden_states: ``[1, C, L]`` the packed row's channels (any float dtype).
        weight: ``[C, K]`` depthwise kernel; ``bias``: ``[C]`` or ``None``.
        activation: ``"silu"``/``"swish"`` or ``None``, applied after the convolution.
        plan: the row's :class:`TreeLinearPlan`.

    Returns:
        ``[1, C, L]`` in ``hidden_states``' dtype: what the model's ``causal_conv1d_fn`` gives each token when its
        sample is forwarded alone.
    """
    if hidden_states.shape[0] != 1:
        raise ValueError(f"tree packing forwards one row at a time; got batch size {hidden_states.shape[0]}")
    dtype = hidden_states.dtype
    x = hidden_states.to(weight.dtype)
    k = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[1])[:, :, : x.shape[2]]
    if plan.fix_index.numel():
        padded = torch.cat([x[0], x.new_zeros(x.shape[1], 1)], dim=1)  # [C, L + 1], column L = no token
        gathered = padded[:, plan.fix_taps]  # [C, F, K]
        fixed = (gathered * weight[:, None, :]).sum(-1)
        if bias is not None:
            fixed = fixed + bias[:, None]
        out = out[0].index_copy(1, plan.fix_index, fixed)[None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal conv activation {activation!r} is not supported in tree packing (silu only)")
    return out.to(dtype)


def _gather_padded(x: torch.Tensor, index: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """``x`` ``[L, ...]`` → ``[n, T_max, ...]``, sequence ``i`` = ``x[index[cu[i]:cu[i+1]]]``, zero-padded."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    t_max = max(lengths)
    pos = torch.arange(t_max, device=x.device)
    starts = torch.tensor(cu[:-1], device=x.device)
    lens = torch.tensor(lengths, device=x.device)
    flat = (starts[:, None] + pos[None, :]).clamp(max=max(cu[-1] - 1, 0))
    valid = pos[None, :] < lens[:, None]
    rows = x.index_select(0, index)[flat]  # [n, T_max, ...]
    shape = valid.shape + (1,) * (rows.dim() - 2)
    return torch.where(valid.reshape(shape), rows, rows.new_zeros(()))


def tree_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    plan: TreeLinearPlan, kernel: str, reference: Callable[..., Any] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """Chunked gated delta rule along the trie: each segment starts from its parent's final state (SPEC §6.5).

    Args:
        query, key: ``[1, L, H_k, D_k]``; value: ``[1, L, H_v, D_v]``; g (log decay, ``<= 0``) and beta:
            ``[1, L, H_v]``; as the model's forward passes them to ``torch_chunk_gated_delta_rule``.
        plan: the row's :class:`TreeLinearPlan`.
        kernel: ``"torch"`` (``reference``, the model's own function, on right-padded batches) or ``"fla"``
            (fla-core's varlen kernel).
        reference: the model's original ``torch_chunk_gated_delta_rule`` (required for ``"torch"``).
        use_qk_l2norm_in_kernel: as in the model's call.

    Returns:
        ``[1, L, H_v, D_v]`` outputs, in the dtype the kernel returns.
    """
    if query.shape[0] != 1:
        raise ValueError(f"tree packing forwards one row at a time; got batch size {query.shape[0]}")
    q0, k0, v0, g0, b0 = query[0], key[0], value[0], g[0], beta[0]
    out = None
    states: dict[int, torch.Tensor] = {}
    for segs, index, cu_t, parents in plan.levels:
        if index.numel() == 0:
            continue
        cu = cu_t.tolist()
        init = None
        if any(p >= 0 for p in parents):
            ref = next(states[p] for p in parents if p >= 0)
            init = torch.stack([states[p] if p >= 0 else ref.new_zeros(ref.shape) for p in parents])
        if kernel == "fla":
            fn = _fla_rule()
            o, final = fn(
                q0.index_select(0, index)[None], k0.index_select(0, index)[None], v0.index_select(0, index)[None],
                g0.index_select(0, index)[None], b0.index_select(0, index)[None], initial_state=init,
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_t.long(),
            )
            o = o[0]
        elif kernel == "torch":
            if reference is None:
                raise ValueError("the 'torch' Gated DeltaNet kernel needs the model's torch_chunk_gated_delta_rule")
            o_pad, final = reference(
                _gather_padded(q0, index, cu), _gather_padded(k0, index, cu), _gather_padded(v0, index, cu),
                g=_gather_padded(g0, index, cu), beta=_gather_padded(b0, index, cu), initial_state=init,
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )
            o = torch.cat([o_pad[i, : cu[i + 1] - cu[i]] for i in range(len(segs))])
        else:
            raise ValueError(f"Gated DeltaNet kernel {kernel!r} is unknown; use one of {GDN_KERNELS}")
        for i, s in enumerate(segs):
            if s in plan.has_children:
                states[s] = final[i]
        if out is None:
            out = o.new_zeros((plan.num_tokens,) + tuple(o.shape[1:]))
        out = out.index_copy(0, index, o)
    if out is None:  # an empty row cannot reach here (forward_packed sends one dummy token), but stay total
        out = value[0].new_zeros(value.shape[1:])
    return out[None]


# --------------------------------------------------------------------------------------------------
# Kernel selection and the trainer-start probe
# --------------------------------------------------------------------------------------------------


def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for name in ("triton", "fla-core", "tilelang", "transformers"):
        try:
            from importlib.metadata import version

            parts.append(f"{name} {version(name)}")
        except Exception:  # noqa: BLE001 - not installed
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def kernel_caches() -> str:
    """Where fla-core's compiled kernels are kept between runs: Triton's cache (``TRITON_CACHE_DIR``, default
    ``~/.triton/cache``) and, when tilelang is installed (fla's backward on Hopper), tilelang's
    (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``)."""
    caches = [os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")]
    if importlib.util.find_spec("tilelang") is not None:
        caches.append(os.environ.get("TILELANG_CACHE_DIR")
                      or os.path.join(os.path.expanduser("~"), ".tilelang", "cache"))
    return " and ".join(caches)


def _say(message: str) -> None:
    """A start-up progress line on the console, from the first process only (every rank prepares its model)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"asyncgrpo: {message}", flush=True)


@functools.cache
def _fla_rule() -> Callable[..., Any]:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure means the kernel is unavailable
        raise GatedDeltaNetUnavailable(
            f"tree packing of Gated DeltaNet layers on CUDA uses fla-core's chunk_gated_delta_rule, which could not "
            f"be imported ({type(exc).__name__}: {exc}; {_versions()}). Fix: pip install 'fla-core>=0.6' einops, or "
            "set ASYNCGRPO_GDN_KERNEL=torch to use the exact but slow plain-torch kernel"
        ) from None
    return chunk_gated_delta_rule


def resolve_gdn_kernel(device: torch.device | str) -> str:
    """``ASYNCGRPO_GDN_KERNEL`` if set (``torch``/``fla``), else ``fla`` on CUDA and ``torch`` elsewhere.

    Raises:
        ValueError: an unknown value, or ``fla`` on a non-CUDA device.
    """
    device = torch.device(device)
    chosen = os.environ.get("ASYNCGRPO_GDN_KERNEL", "").strip().lower()
    if not chosen:
        return "fla" if device.type == "cuda" else "torch"
    if chosen not in GDN_KERNELS:
        raise ValueError(f"ASYNCGRPO_GDN_KERNEL={chosen!r} is unknown; use one of {', '.join(GDN_KERNELS)}")
    if chosen == "fla" and device.type != "cuda":
        raise ValueError(f"ASYNCGRPO_GDN_KERNEL=fla needs a CUDA model, got device {device}. Fix: unset it")
    return chosen


def probe_fla(device: torch.device, dtype: torch.dtype, heads: tuple[int, int], dims: tuple[int, int]) -> None:
    """Run fla's kernel forward and backward once on a tiny two-segment varlen batch with initial states.

    Raises:
        GatedDeltaNetUnavailable: fla is missing or refuses (e.g. its backward on Hopper with Triton < 3.7.1 and no
            tilelang), with the versions and the fix.
    """
    fn = _fla_rule()
    (h_k, h_v), (d_k, d_v) = heads, dims
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    t = 80
    q, k, v = rand(1, t, h_k, d_k), rand(1, t, h_k, d_k), rand(1, t, h_v, d_v)
    g = (-torch.rand(1, t, h_v, generator=gen)).to(device=device, dtype=torch.float32).requires_grad_(True)
    beta = torch.rand(1, t, h_v, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    h0 = rand(2, h_v, d_k, d_v)
    cu = torch.tensor([0, 17, t], dtype=torch.long, device=device)
    try:
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=cu)
        (o.float().sum() + ht.float().sum()).backward()
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - the kernel's own refusal is the message we pass on
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise GatedDeltaNetUnavailable(
            f"fla-core's chunk_gated_delta_rule cannot train on this machine ({name}; {_versions()}): "
            f"{type(exc).__name__}: {exc}. Tree packing of Gated DeltaNet layers needs its forward and backward. "
            "Fix: upgrade Triton to >= 3.7.1 (with a matching torch), or pip install tilelang (0.1.15 works with "
            "fla-core 0.6), or set ASYNCGRPO_GDN_KERNEL=torch (exact, much slower)"
        ) from None


# --------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------

_ORIGINALS: dict[str, dict[str, Callable[..., Any]]] = {}
_KERNEL: dict[str, str] = {}


# Regionally compiled layers (train/compile.py) break their graph here, as at tree attention: the per-row plans
# (Python lists, cached on the row's TreeAttentionInputs) never reach dynamo.
@torch.compiler.disable
def _tree_conv(hidden_states, weight, bias, activation, ctx):
    return tree_causal_conv1d(hidden_states, weight, bias, activation, TreeLinearPlan.of(ctx, weight.shape[-1]))


@torch.compiler.disable
def _tree_rule(query, key, value, g, beta, ctx, kernel, reference, use_qk_l2norm_in_kernel):
    plan = TreeLinearPlan.of(ctx, 0)  # the kernel size does not matter for the delta rule's levels
    out = tree_gated_delta_rule(query, key, value, g, beta, plan, kernel, reference=reference,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out.to(query.dtype), None


def _make_conv(module_name: str) -> Callable[..., Any]:
    original = _ORIGINALS[module_name][_CONV_NAME]

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """asyncgrpo: trie-aware in packed forwards (``tree_attention`` keyword), the model's own otherwise."""
        ctx = kwargs.get("tree_attention")
        if ctx is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return _tree_conv(hidden_states, weight, bias, activation, ctx)

    return causal_conv1d_fn


def _make_rule(module_name: str) -> Callable[..., Any]:
    original = _ORIGINALS[module_name][_RULE_NAME]

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """asyncgrpo: along the trie in packed forwards (``tree_attention`` keyword), the model's own otherwise."""
        ctx = kwargs.get("tree_attention")
        if ctx is None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        if initial_state is not None or output_final_state:
            raise ValueError("packed forwards cannot use a cache (pass use_cache=False)")
        kernel = _KERNEL.get(module_name) or resolve_gdn_kernel(query.device)
        return _tree_rule(query, key, value, g, beta, ctx, kernel, inspect.unwrap(original), use_qk_l2norm_in_kernel)

    return torch_chunk_gated_delta_rule


def prepare_gated_deltanet(model: torch.nn.Module, model_id: str | None = None, *, probe: bool = True,
                           device: torch.device | str | None = None) -> str | None:
    """Check the model's token mixers and switch its Gated DeltaNet layers to trie-aware kernels (trainer start).

    Args:
        model: the policy (a ``PreTrainedModel`` or a wrapper).
        model_id: for messages.
        probe: run :func:`probe_fla` when the ``fla`` kernel is selected.
        device: the device the model will train on, which picks the kernel (default: its parameters' device; the
            trainer's model is still on the CPU at its start, `tree_attention.apply_tree_attention`).

    Returns:
        The Gated DeltaNet kernel in use (``"torch"``/``"fla"``), or ``None`` when the model has no such layers.

    Raises:
        UnsupportedTokenMixer: see :func:`check_token_mixers`.
        GatedDeltaNetUnavailable: the selected kernel cannot run (message names versions and the fix).
    """
    layers = check_token_mixers(model, model_id)
    if not layers:
        return None
    device = torch.device(device) if device is not None else next((p.device for p in model.parameters()),
                                                                     torch.device("cpu"))
    kernel = resolve_gdn_kernel(device)
    if kernel == "fla" and probe:
        first = layers[0]
        dtype = next((p.dtype for p in first.parameters()), torch.bfloat16)
        _say(f"Gated DeltaNet ({len(layers)} layers): compiling fla-core's kernels for this GPU and head shape (first "
             f"run only: cached for later runs in {kernel_caches()}) ...")
        start = time.perf_counter()
        probe_fla(device, dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32,
                  (first.num_k_heads, first.num_v_heads), (first.head_k_dim, first.head_v_dim))
        _say(f"Gated DeltaNet: fla-core's kernels ready in {time.perf_counter() - start:.1f} s")
    for layer in layers:
        module_name = type(layer).__module__
        mod = sys.modules[module_name]
        if module_name not in _ORIGINALS:
            conv, rule = getattr(mod, _CONV_NAME, None), getattr(mod, _RULE_NAME, None)
            if conv is None or rule is None:
                raise UnsupportedTokenMixer(
                    f"{module_name} has no {_CONV_NAME}/{_RULE_NAME} (this transformers version changed the Gated "
                    f"DeltaNet code); tree packing cannot follow the trie there. Fix: use transformers 5.17-5.24"
                )
            _ORIGINALS[module_name] = {_CONV_NAME: conv, _RULE_NAME: rule}
            setattr(mod, _CONV_NAME, _make_conv(module_name))
            setattr(mod, _RULE_NAME, _make_rule(module_name))
        _KERNEL[module_name] = kernel
    return kernel
