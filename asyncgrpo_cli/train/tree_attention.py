"""Tree attention for tree-packed rows, plugged into transformers' ``AttentionInterface`` (SPEC §6.1–6.2).

A packed row (``asyncgrpo_cli.train.packing.PackedRow``) is a prefix trie laid out depth-first. Query
``i`` may attend key ``j`` iff ``j`` is an ancestor-or-self of ``i`` in the trie, i.e.
``j <= i <= dfs_leave[j]``: exactly the keys it would see if its sample were forwarded alone. With
position ids equal to trie depths, every token's hidden state (hence log-prob) matches the unpacked one.

Backends (``packing.attention`` in the config; ``auto`` = ``flex`` on CUDA, ``sdpa`` elsewhere):

- ``sdpa``: an explicit boolean ancestor mask ``[L, L]`` through ``torch.nn.functional.
  scaled_dot_product_attention``. The reference, and the CPU default. Memory ``O(L²)`` bits.
- ``flex``: FlexAttention with a block mask built from the DFS intervals (block-sparse, ``O(L²/128²)``
  metadata). Compiled on CUDA; on CPU torch 2.13 runs its forward eagerly but has no backward.
- ``flash``: a flash-attention varlen call where each segment is one "sequence" whose keys/values are
  gathered along its trie path (ancestors' segments, then its own); causal alignment is bottom-right,
  so the gathered key index equals the position id. The kernel comes from ``flash-attn-4`` (PyPI, Hopper and
  newer), ``flash_attn`` or a Hub kernel (``asyncgrpo_cli.train.flash_varlen``); without one,
  :class:`TreeAttentionUnavailable`.

How the row reaches the attention function: :func:`forward_packed` passes a
:class:`TreeAttentionInputs` as the ``tree_attention`` keyword of the model's forward; transformers
forwards extra keywords down to every attention call (also through activation checkpointing's
recomputation, which a context variable would not survive). The metadata (masks, gather indices) is built
once per forward, on first use, and shared by all layers. To keep transformers from building its own
``[L, L]`` mask from the non-monotonic position ids, :func:`forward_packed` passes a zero-storage 4-D
placeholder ``attention_mask``, which transformers' mask creation returns as is. Without a
``tree_attention`` keyword (generation, evaluation) the registered functions behave like plain ``sdpa``
with transformers' standard masks, which are registered for the tree names in ``AttentionMaskInterface``.

Models whose non-attention layers mix tokens: Gated DeltaNet layers (Qwen3.5 / Qwen3.6 / Qwen3-Next) are switched
to trie-aware kernels by ``asyncgrpo_cli.train.gated_deltanet`` from :func:`apply_tree_attention`; any other such
layer (Mamba, short convolutions, other linear attention) is refused there. Attention sinks and logit soft-capping
are refused.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncgrpo_cli.train.flash_varlen import TreeAttentionUnavailable, call_varlen, load_flash_varlen
from asyncgrpo_cli.train.packing import PackedRow

__all__ = [
    "BACKENDS",
    "FLEX_MIN_TOKENS",
    "IMPLEMENTATION_NAMES",
    "TreeAttentionInputs",
    "TreeAttentionUnavailable",
    "VarlenPlan",
    "apply_tree_attention",
    "forward_packed",
    "load_flash_varlen",
    "packed_forward_kwargs",
    "register_tree_attention",
    "resolve_backend",
    "tree_attention_backend",
    "varlen_attention_reference",
]

BACKENDS = ("sdpa", "flex", "flash")
IMPLEMENTATION_NAMES = {
    "sdpa": "asyncgrpo_tree_sdpa",
    "flex": "asyncgrpo_tree_flex",
    # no "flash" in the name: transformers switches model code paths on that substring
    "flash": "asyncgrpo_tree_varlen",
}
_BACKEND_OF = {v: k for k, v in IMPLEMENTATION_NAMES.items()}
# The ``flex`` backend pads a row shorter than this to this many tokens: two of FlexAttention's 128-token blocks.
# Its compiled functions are traced with dynamic shapes, which specialise a size of 1: a row of 128 tokens or
# fewer (one block) failed a guard (`2 <= kv_indices.size(2)`) and recompiled create_block_mask, the forward and
# the backward mid-run, a 14.8 s step in the one-GPU job of 2026-12-05 (`rollouts_job_sync_s7.json`, step 24).
FLEX_MIN_TOKENS = 256
# Extra ``kernel_options`` of every FlexAttention call: empty, torch's default (its Triton kernel). A screening knob,
# not a product option: `scripts/bench/bench_attention.py`'s ``flex_flash`` sets ``{"BACKEND": "FLASH"}`` (torch's
# CuTe flash-attention kernel for FlexAttention, flash-attn-4 installed) to measure it on P1's rows first (#43).
FLEX_KERNEL_OPTIONS: dict[str, Any] = {}


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """Map a ``packing.attention`` value to a concrete backend.

    Args:
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"flash"``.
        device: the model's device; ``auto`` gives ``flex`` on CUDA and ``sdpa`` elsewhere (``None``: CUDA
            if available).

    Raises:
        ValueError: unknown ``backend``.
    """
    if backend == "auto":
        if device is None:
            on_cuda = torch.cuda.is_available()
        else:
            on_cuda = torch.device(device).type == "cuda"
        return "flex" if on_cuda else "sdpa"
    if backend not in BACKENDS:
        raise ValueError(
            f"tree attention backend={backend!r} is unknown; use one of 'auto', {', '.join(map(repr, BACKENDS))}"
        )
    return backend


# --------------------------------------------------------------------------------------------------
# Per-forward metadata
# --------------------------------------------------------------------------------------------------


@dataclass
class VarlenPlan:
    """Gather plan of the ``flash`` backend: one varlen "sequence" per segment.

    Attributes:
        cu_seqlens_q: ``[S + 1]`` int32 offsets of each segment's queries in the row.
        cu_seqlens_k: ``[S + 1]`` int32 offsets of each segment's gathered keys.
        kv_index: ``[Σ path lengths]`` int64 row index of every gathered key/value; ``None`` when no segment has a
            parent (plain packing: every path is its own segment, so the row's keys are used as they are).
        max_seqlen_q, max_seqlen_k: longest segment and longest path, in tokens.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    kv_index: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int


class TreeAttentionInputs:
    """What every attention layer needs to know about the packed row, built lazily once per forward.

    Args:
        position_ids: ``[L]`` int64 depth of each token.
        dfs_leave: ``[L]`` int64 last row index of each token's subtree.
        segment_start, segment_length, segment_parent: ``[S]`` int64 segment table (``PackedRow``).
        device: where masks and indices are built (the model's device).
        varlen_fn: replacement for ``flash_attn_varlen_func`` in the ``flash`` backend (e.g.
            :func:`varlen_attention_reference` in tests); ``None`` loads the real kernel.
    """

    def __init__(
        self,
        position_ids: torch.Tensor,
        dfs_leave: torch.Tensor,
        segment_start: torch.Tensor,
        segment_length: torch.Tensor,
        segment_parent: torch.Tensor,
        device: torch.device | str,
        varlen_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.varlen_fn = varlen_fn
        self.device = torch.device(device)
        self.position_ids = position_ids.to(self.device, dtype=torch.int64, non_blocking=True)
        self.dfs_leave = dfs_leave.to(self.device, dtype=torch.int64, non_blocking=True)
        self.num_tokens = int(self.position_ids.numel())
        self._segment_tensors = (segment_start, segment_length, segment_parent)
        self._segment_lists: tuple[list[int], list[int], list[int]] | None = None
        self._cache: dict[Any, Any] = {}

    @property
    def _segments(self) -> tuple[list[int], list[int], list[int]]:
        """The segment table as Python lists (``flash`` plan, Gated DeltaNet), read on first use only: sdpa and
        flex never need it, and a device copy read here would be a host sync per micro-batch."""
        if self._segment_lists is None:
            self._segment_lists = tuple(t.tolist() for t in self._segment_tensors)
        return self._segment_lists

    @classmethod
    def from_row(
        cls, row: PackedRow, device: torch.device | str, varlen_fn: Callable[..., torch.Tensor] | None = None,
        host_row: PackedRow | None = None,
    ) -> TreeAttentionInputs:
        """Metadata of a packed row, on ``device``. ``host_row``: the same row on the CPU (the packer's), whose
        segment table is read instead of ``row``'s, so a device row costs no host sync."""
        table = host_row if host_row is not None else row
        return cls(
            row.position_ids, row.dfs_leave, table.segment_start, table.segment_length, table.segment_parent, device,
            varlen_fn=varlen_fn,
        )

    def sdpa_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """``[1, 1, L, L]`` bool, True where query ``i`` (dim 2) may attend key ``j`` (dim 3)."""
        key = ("sdpa", sliding_window)
        if key not in self._cache:
            idx = torch.arange(self.num_tokens, device=self.device)
            allowed = _tree_mask_mod(self.dfs_leave, self.position_ids, sliding_window)
            self._cache[key] = allowed(None, None, idx[:, None], idx[None, :])[None, None]
        return self._cache[key]

    @property
    def flex_tokens(self) -> int:
        """Length of the ``flex`` backend's attention (tokens): the row's ``L``, or `FLEX_MIN_TOKENS` for a
        shorter row, whose extra tokens see only themselves (:meth:`block_mask`)."""
        return max(self.num_tokens, FLEX_MIN_TOKENS)

    def block_mask(self, sliding_window: int | None = None):
        """FlexAttention ``BlockMask`` of the same relation as :meth:`sdpa_mask`, over :attr:`flex_tokens`
        (compiled on CUDA, so the ``[L, L]`` mask is never materialised there). A padding token ``p >= L``
        has ``dfs_leave[p] = p``: it attends to itself only, and no row token attends to it, so the row's
        outputs are those of the unpadded mask (`FLEX_MIN_TOKENS` says why it exists)."""
        key = ("flex", sliding_window)
        if key not in self._cache:
            leave, pos, n = self.dfs_leave, self.position_ids, self.flex_tokens
            if n > self.num_tokens:
                extra = torch.arange(self.num_tokens, n, device=self.device, dtype=torch.int64)
                leave = torch.cat([leave, extra])
                pos = torch.cat([pos, torch.zeros_like(extra)])
            mask_mod = _tree_mask_mod(leave, pos, sliding_window)
            build = _block_mask_fn(self.device)
            self._cache[key] = build(mask_mod, None, None, n, n, device=self.device)
        return self._cache[key]

    def varlen_plan(self) -> VarlenPlan:
        """Segment-wise gather plan for the ``flash`` backend (see :class:`VarlenPlan`)."""
        if "varlen" not in self._cache:
            starts, lengths, parents = self._segments
            path_ranges: list[list[tuple[int, int]]] = []
            kv: list[int] = []
            cu_q, cu_k = [0], [0]
            max_k = 0
            for s, (start, length, parent) in enumerate(zip(starts, lengths, parents)):
                if start != cu_q[-1]:
                    raise ValueError(
                        f"segment {s} starts at {start}, expected {cu_q[-1]}: segments must tile the row in order"
                    )
                ranges = (path_ranges[parent] if parent >= 0 else []) + [(start, start + length)]
                path_ranges.append(ranges)
                for a, b in ranges:
                    kv.extend(range(a, b))
                n_k = sum(b - a for a, b in ranges)
                cu_q.append(start + length)
                cu_k.append(cu_k[-1] + n_k)
                max_k = max(max_k, n_k)
            if cu_q[-1] != self.num_tokens:
                raise ValueError(f"segments cover {cu_q[-1]} tokens but the row has {self.num_tokens}")
            # Built on the host, copied without a stream sync (a blocking copy would wait for the GPU).
            self._cache["varlen"] = VarlenPlan(
                cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32).to(self.device, non_blocking=True),
                cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32).to(self.device, non_blocking=True),
                kv_index=(None if all(parent < 0 for parent in parents)
                          else torch.tensor(kv, dtype=torch.int64).to(self.device, non_blocking=True)),
                max_seqlen_q=max(lengths, default=0),
                max_seqlen_k=max_k,
            )
        return self._cache["varlen"]


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Pure-PyTorch stand-in for ``flash_attn_varlen_func`` (same arguments), one SDPA call per sequence.

    ``q`` ``[Tq, Hq, D]``, ``k``/``v`` ``[Tk, Hkv, D]``; returns ``[Tq, Hq, D]``. Causal masking is
    bottom-right aligned and ``window_size=(left, right)`` limits key distance as in flash-attention.
    Slow; for tests and debugging of the ``flash`` gather plan.
    """
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs, ks = q[cq[s] : cq[s + 1]], k[ck[s] : ck[s + 1]]
        vs = v[ck[s] : ck[s + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        qi = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        ki = torch.arange(nk, device=q.device)[None, :]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        if causal:
            mask &= ki <= qi
        left, right = window_size
        if left >= 0:
            mask &= ki >= qi - left
        if right >= 0:
            mask &= ki <= qi + right
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], attn_mask=mask,
            dropout_p=dropout_p, scale=softmax_scale, enable_gqa=qs.shape[1] != ks.shape[1],
        )
        out[cq[s] : cq[s + 1]] = o[0].transpose(0, 1)
    return out


def _tree_mask_mod(leave: torch.Tensor, pos: torch.Tensor, sliding_window: int | None) -> Callable:
    """FlexAttention ``mask_mod``: key ``j`` visible to query ``i`` iff ``j <= i <= leave[j]`` (ancestor-
    or-self in DFS order), and within ``sliding_window`` positions when one is given. It closes over
    tensors only, so compiled callers see new rows as new inputs rather than new code."""
    if sliding_window is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx <= leave[kv_idx])

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx <= leave[kv_idx]) & (pos[q_idx] - pos[kv_idx] < sliding_window)

    return mask_mod


_compiled: dict[str, Callable] = {}


def _block_mask_fn(device: torch.device) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    if device.type != "cuda":
        return create_block_mask
    if "block_mask" not in _compiled:
        _compiled["block_mask"] = torch.compile(create_block_mask, dynamic=True)
    return _compiled["block_mask"]


def _flex_fn(device: torch.device) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention  # eager (materialises scores); fine for CPU checks
    if "flex" not in _compiled:
        _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
    return _compiled["flex"]


def _tree_attention(
    backend: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ctx: TreeAttentionInputs | None = kwargs.get("tree_attention")
    if ctx is None:  # not a packed forward: behave like plain sdpa with transformers' masks
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"tree attention forwards one packed row at a time; got batch size {query.shape[0]}")
    if query.shape[2] != ctx.num_tokens or key.shape[2] != ctx.num_tokens:
        raise ValueError(
            f"tree attention got {query.shape[2]} queries / {key.shape[2]} keys for a row of {ctx.num_tokens} "
            "tokens; packed forwards cannot use a KV cache (pass use_cache=False)"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"tree attention does not support {name} (this model uses it)")
    sliding_window = kwargs.get("sliding_window")
    gqa = query.shape[1] != key.shape[1]
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=ctx.sdpa_mask(sliding_window), dropout_p=dropout, scale=scaling,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).contiguous(), None
    if backend == "flex":
        if dropout:
            raise NotImplementedError(
                f"the flex tree attention backend has no attention dropout (got {dropout}); use sdpa"
            )
        flex = _flex_fn(query.device)
        pad = ctx.flex_tokens - ctx.num_tokens
        if pad:  # a short row: see FLEX_MIN_TOKENS
            query, key, value = (_pad_tokens(t, pad) for t in (query, key, value))
        extra = {"kernel_options": dict(FLEX_KERNEL_OPTIONS)} if FLEX_KERNEL_OPTIONS else {}
        out = flex(query, key, value, block_mask=ctx.block_mask(sliding_window), scale=scaling, enable_gqa=gqa,
                   **extra)
        if pad:
            out = out[:, :, : ctx.num_tokens]
        return out.transpose(1, 2).contiguous(), None
    if backend == "flash":
        if ctx.varlen_fn is None:  # resolved once per row, not per layer
            ctx.varlen_fn = load_flash_varlen(_capability(query.device)).fn
        varlen = ctx.varlen_fn
        plan = ctx.varlen_plan()
        q = query[0].transpose(0, 1).contiguous()  # [L, Hq, D]
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [L, Hkv, D]
        if plan.kv_index is not None:  # gathered along each segment's path: [Σ path, Hkv, D]
            k, v = k.index_select(0, plan.kv_index), v.index_select(0, plan.kv_index)
        k, v = k.contiguous(), v.contiguous()
        out = call_varlen(
            varlen, q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
            softmax_scale=scaling, window_left=sliding_window - 1 if sliding_window is not None else None,
            dropout_p=dropout,
        )
        return out.unsqueeze(0), None
    raise ValueError(f"unknown tree attention backend {backend!r}")


def _grown(shape: torch.Size, strides: tuple[int, ...], token_dim: int, total: int) -> tuple[list[int], list[int]]:
    """``shape`` and ``strides`` of a dense layout whose token dim grows from ``shape[token_dim]`` to ``total``: a
    stride spanning all its tokens (a batch dim) grows with it, every other stride (a size-1 head dim's included)
    is kept."""
    n = shape[token_dim]
    span = strides[token_dim] * n
    sizes = [total if d == token_dim else size for d, size in enumerate(shape)]
    return sizes, [st // n * total if st >= span and d != token_dim else st for d, st in enumerate(strides)]


def _pad_tokens(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` ``[B, H, L, D]`` zero-padded to ``[B, H, L + pad, D]`` in the layout the model gave it, so the compiled
    FlexAttention sees a short row as it saw a long one: its guards check each input's strides and, for a view,
    its base. A model's key after RoPE is a fresh ``[1, L, H, D]``-ordered tensor seen as ``[1, H, L, D]``
    (``stride(1) = D``: a contiguous copy, ``F.pad``'s, recompiled flex mid-run on the GPU), and its value a view
    of the ``[1, L, H * D]`` projection (a padded copy that is no view recompiles too). So the padding is built
    the same way: a tensor with the grown strides, or a grown base and the same view of it. Same dtype and
    device; differentiable (the padding's gradient is dropped). A layout it cannot grow (not dense) gets a
    contiguous copy: the same values, at worst a recompile."""
    n, step = t.shape[2], t.stride(2)
    total = n + pad
    base = t._base
    layouts = [t] if base is None else [t, base]
    dense = all(st < step * n or st % n == 0 for x in layouts for st in x.stride())
    token_dims = [] if base is None else [d for d in range(base.dim()) if base.stride(d) == step and base.shape[d] == n]
    sizes, strides = _grown(t.shape, t.stride(), 2, total)
    if dense and base is None:
        out = torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device).zero_()
    elif dense and len(token_dims) == 1 and 0 <= t.storage_offset() - base.storage_offset() < step:
        base_sizes, base_strides = _grown(base.shape, base.stride(), token_dims[0], total)
        grown = torch.empty_strided(base_sizes, base_strides, dtype=t.dtype, device=t.device).zero_()
        out = grown.as_strided(sizes, strides, t.storage_offset() - base.storage_offset())
    else:
        out = t.new_zeros(t.shape[0], t.shape[1], total, t.shape[3])
    out[:, :, :n] = t
    return out


def _make_attention_fn(backend: str) -> Callable:
    def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """Tree attention (asyncgrpo) for one packed row: ``query`` ``[1, Hq, L, D]``, ``key``/``value``
        ``[1, Hkv, L, D]``; returns ``([1, L, Hq, D], None)``."""
        return _tree_attention(backend, module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    tree_attention_forward.__name__ = f"tree_attention_{backend}"
    # Regionally compiled layers (train/compile.py) break their graph here: the per-row mask objects never reach
    # dynamo, and FlexAttention runs through its own compiled function (which a disabled frame still calls).
    return torch.compiler.disable(tree_attention_forward)


_registered = False


def register_tree_attention() -> None:
    """Register the three tree-attention functions with transformers' ``AttentionInterface`` under
    :data:`IMPLEMENTATION_NAMES`, and the standard ``sdpa`` mask builder under the same names in
    ``AttentionMaskInterface`` (used only outside packed forwards). Idempotent."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for backend, name in IMPLEMENTATION_NAMES.items():
        AttentionInterface.register(name, _make_attention_fn(backend))
        AttentionMaskInterface.register(name, sdpa_mask)
    _registered = True


def _config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config; tree attention needs a transformers PreTrainedModel")
    return config


def tree_attention_backend(model: torch.nn.Module) -> str | None:
    """The tree backend ``model`` is switched to, or ``None`` if :func:`apply_tree_attention` was not applied."""
    return _BACKEND_OF.get(getattr(_config(model), "_attn_implementation", None))


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device`` (which picks the flash kernel), ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def apply_tree_attention(model: torch.nn.Module, backend: str = "auto", model_id: str | None = None, *,
                         device: torch.device | str | None = None, announce: bool = False) -> str:
    """Switch a ``PreTrainedModel`` (or a PEFT wrapper of one) to tree attention; returns the backend.

    Args:
        model: the policy model.
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"flash"`` (module docstring).
        model_id: the model's name, for refusal messages.
        device: the device the model will train on, which decides ``auto``, ``flash``'s kernel and the Gated
            DeltaNet kernel; default: its parameters' device. The trainer passes its training device: it switches
            the model before transformers' ``Trainer`` moves it there, so a GPU run's model is still on the CPU
            here (before 2026-12-05 every GPU job resolved ``auto`` to ``sdpa`` that way, a dense ``[L, L]`` mask
            per row, and Gated DeltaNet to its torch kernel).
        announce: print ``asyncgrpo: tree attention: BACKEND`` (with the flash kernel, or what ``auto`` chose) from
            the first process (``RANK`` 0).

    Also checks the model's non-attention token mixers and switches Gated DeltaNet layers to their trie-aware
    kernels (``gated_deltanet.prepare_gated_deltanet``).

    Raises:
        ValueError: unknown backend, a model without ``config``, or one that refuses the implementation;
            ``flex`` for a model with ``attention_dropout`` > 0 (the trainer runs in train mode, where it applies).
        TreeAttentionUnavailable: ``flash`` on a non-CUDA model or without a loadable kernel.
        UnsupportedModelFeature: attention sinks or logit soft-capping (``model_features``, SPEC §2.8).
        UnsupportedTokenMixer: a token-mixing layer tree packing does not support (SPEC §2.8).
        GatedDeltaNetUnavailable: the Gated DeltaNet kernel cannot run here (e.g. fla's refused backward).

    ``flex`` is accepted on CPU (its forward runs eagerly) but torch 2.13 has no CPU backward for it.
    """
    from asyncgrpo_cli.train.gated_deltanet import prepare_gated_deltanet
    from asyncgrpo_cli.train.model_features import check_model_features

    device = torch.device(device) if device is not None else _model_device(model)
    asked = backend
    backend = resolve_backend(backend, device)
    check_model_features(model, model_id)  # before the token mixers: named by the feature itself
    if backend == "flex":  # the trainer trains in train mode: a model's attention dropout applies, as in TRL
        from asyncgrpo_cli.train.model_features import model_configs

        dropout = max((float(getattr(c, "attention_dropout", 0.0) or 0.0) for c in model_configs(model)), default=0.0)
        if dropout > 0:
            raise ValueError(f"{model_id or type(model).__name__} has attention_dropout={dropout:g} in its config, "
                             "which the flex tree attention backend cannot apply (its first step would stop on it). "
                             "Fix: packing.attention=sdpa, or set the model's attention_dropout to 0")
    prepare_gated_deltanet(model, model_id, device=device)
    line = f"tree attention: {backend}" + (f" (packing.attention=auto on {device.type})" if asked == "auto" else "")
    if backend == "flash":
        if device.type != "cuda":
            raise TreeAttentionUnavailable(
                f"the 'flash' tree attention backend needs a CUDA model, got device {device}"
            )
        line = f"tree attention: flash, through {load_flash_varlen(_capability(device)).name}"
    if announce and os.environ.get("RANK", "0") == "0":  # every rank switches its model; one line is enough
        print(f"asyncgrpo: {line}", flush=True)
    register_tree_attention()
    name = IMPLEMENTATION_NAMES[backend]
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        _config(model)._attn_implementation = name
    if tree_attention_backend(model) != backend:
        raise ValueError(
            f"{type(model).__name__} did not accept attn_implementation={name!r}; tree packing needs a model "
            "that dispatches attention through transformers' AttentionInterface"
        )
    return backend


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def packed_forward_kwargs(
    row: PackedRow, device: torch.device | str, *, varlen_fn: Callable[..., torch.Tensor] | None = None,
    host_row: PackedRow | None = None,
) -> dict[str, Any]:
    """Keyword arguments for a model's forward over one packed row (the model switched to tree attention).

    Returns ``input_ids`` and ``position_ids`` ``[1, L]`` int64, a zero-storage ``[1, 1, L, L]`` bool
    placeholder ``attention_mask`` (any 4-D mask makes transformers skip building its own), ``use_cache=False``
    and ``tree_attention`` (a :class:`TreeAttentionInputs`), all on ``device``. An empty row (``L = 0``)
    becomes one dummy token (id 0, position 0), so that the forward still reaches every parameter; the
    caller discards its output. ``host_row``: ``row``'s CPU original when ``row`` is a device copy (its segment
    table is read from it: no host sync, `TreeAttentionInputs.from_row`).
    """
    device = torch.device(device)
    if row.num_tokens == 0:
        one = torch.zeros(1, dtype=torch.int64)
        ctx = TreeAttentionInputs(
            one, one, one, torch.ones(1, dtype=torch.int64), -torch.ones(1, dtype=torch.int64), device,
            varlen_fn=varlen_fn,
        )
        input_ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
    else:
        ctx = TreeAttentionInputs.from_row(row, device, varlen_fn=varlen_fn, host_row=host_row)
        input_ids = row.input_ids.to(device)[None]
    length = input_ids.shape[1]
    placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device).expand(1, 1, length, length)
    return dict(
        input_ids=input_ids, position_ids=ctx.position_ids[None], attention_mask=placeholder, use_cache=False,
        tree_attention=ctx,
    )


def forward_packed(
    model: torch.nn.Module,
    row: PackedRow,
    *,
    varlen_fn: Callable[..., torch.Tensor] | None = None,
    **extra: Any,
) -> torch.Tensor:
    """Forward one packed row and return the last layer's hidden states (after the final norm).

    The model must have been switched with :func:`apply_tree_attention`. The root model is called (so
    FSDP2 / PEFT wrappers run their hooks) with ``logits_to_keep=1`` where supported, and the decoder's
    output is captured by a forward hook; logits are left to the loss, which computes log-probs in
    vocabulary chunks from these hidden states and the lm_head weight.

    Args:
        model: a causal LM (or its decoder) switched to tree attention.
        row: the packed row (CPU or device tensors).
        varlen_fn: override of ``flash_attn_varlen_func`` for the ``flash`` backend (tests).
        extra: further keyword arguments for the model's forward.

    Returns:
        ``[L, H]`` hidden states in the model's dtype, on the model's device. For an empty row
        (``L = 0``) one dummy token is forwarded and a ``[0, H]`` slice of its output is returned, so every
        parameter still joins the backward pass (data-parallel collectives stay in step).

    Raises:
        ValueError: the model was not switched to tree attention.
    """
    backend = tree_attention_backend(model)
    if backend is None:
        raise ValueError(
            f"the model's attn_implementation is {getattr(_config(model), '_attn_implementation', None)!r}; "
            "call apply_tree_attention(model, backend) before forward_packed"
        )
    kwargs = packed_forward_kwargs(row, _model_device(model), varlen_fn=varlen_fn)
    kwargs.update(extra)
    keep = row.num_tokens

    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    if decoder is model:
        out = model(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    else:
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        if _accepts(base.forward, "logits_to_keep"):
            kwargs.setdefault("logits_to_keep", 1)
        captured: list[torch.Tensor] = []

        def hook(_module, _args, output):
            captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

        handle = decoder.register_forward_hook(hook)
        try:
            model(**kwargs)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(f"{type(decoder).__name__} (the model's decoder) was not called by the forward")
        hidden = captured[-1]
    return hidden[0, :keep]
