"""Chunked log-probabilities and entropy from last-layer hidden states (SPEC §3.3.1, §7, Appendix B.10).

The trainer needs, at every trained token, a handful of log-probabilities of the *processed* policy
(logits divided by the sampling temperature, renormalised over the sampler's candidate set when one was
returned) plus the entropy of that distribution. Computing them naively materialises the ``[N, V]``
logits of a row (32K tokens × 150K vocabulary ≈ 20 GB in fp32). :func:`chunked_token_logprobs`
instead walks ``[token_chunk_size, vocab_chunk_size]`` tiles of the logits: the forward keeps an online
log-sum-exp (a streaming softmax) and gathers the few logits it needs; the backward recomputes each
tile and turns it straight into its contribution to the hidden-state, weight and bias gradients.

Math, per token ``t`` with logits ``z = (h_t W^T + b) / temperature`` and working set ``S_t`` (the
candidate set, or the full vocabulary):

- ``lse_t = log Σ_{v∈S_t} exp(z_v)``; ``log π̃(v) = z_v − lse_t`` for ``v ∈ S_t``. This equals SPEC §7's
  ``log π(v) − log Σ_{v∈S} π(v)``.
- entropy ``H_t = lse_t − Σ_{v∈S_t} π̃(v) z_v`` (no gradient).
- gradient of ``Σ_t g_t log π̃(o_t) + Σ_{t,k} g_{t,k} log π̃(v_{t,k})`` with respect to ``z_{t,v}`` is
  ``g_t 1[v=o_t] + Σ_k g_{t,k} 1[v=v_{t,k}] − (g_t + Σ_k g_{t,k}) π̃(v) 1[v∈S_t]``, and ``dz/d(hW^T+b) =
  1/temperature``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TokenLogProbs", "check_token_ids", "chunked_token_logprobs"]

DEFAULT_TOKEN_CHUNK_SIZE = 2048
DEFAULT_VOCAB_CHUNK_SIZE = 16384


@dataclass
class TokenLogProbs:
    """Per-token outputs of :func:`chunked_token_logprobs` (N trained tokens, K sampler top ids).

    Attributes:
        target_logprobs: ``[N]`` float32 (float64 for float64 inputs), differentiable: ``log π̃_θ(o_t)``
            of the trained token under the temperature-scaled, candidate-renormalised policy.
        top_logprobs: ``[N, K]`` same dtype, differentiable: ``log π̃_θ(v)`` at the sampler's top ids;
            ``0.0`` where ``top_valid`` is False.
        top_valid: ``[N, K]`` bool: the id is not padding (``>= 0``) and lies in the token's working set
            (its candidate set when it has one). Outside the candidate set ``π̃ = 0``.
        entropy: ``[N]`` same dtype, no gradient: entropy (nats) of the working distribution.
    """

    target_logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_valid: torch.Tensor
    entropy: torch.Tensor


def _acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32: the dtype all reductions accumulate in."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the lm_head GEMMs, the same in the forward and the backward: the operands' common dtype, or
    autocast's dtype when autocast is on for their device and they are float32 (float32 weights trained under
    bf16 autocast, the default). Autocast casts the forward's GEMM but is off in the backward, so without this
    the backward's three GEMMs ran in float32 (at the 1.7B shape, 32K tokens: ~6·10^13 FLOPs, an estimated 0.9 s
    at an H100's float32 rate, about the 1.0 s by which that job's backward exceeded 3x its forward; NOTES,
    eighteenth session), and their softmax was taken against the bf16 forward's log-sum-exp."""
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if cdt == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return cdt


def _tile_forward(z_mm, bias, temperature: float, acc: torch.dtype, run_max, run_sum, run_wsum, col):
    """One ``[nc, vc]`` logits tile of the forward's online log-sum-exp (a streaming softmax).

    Args:
        z_mm: ``[nc, vc]`` ``h W[v0:v1]^T`` in the compute dtype (the model's, as its own lm_head and the sampler
            run it; GPU GEMMs accumulate in fp32 internally). Everything after it runs in ``acc``.
        bias: ``[vc]`` bias slice or None; temperature: logits are divided by it (B.10).
        run_max, run_sum, run_wsum: ``[nc]`` ``acc`` running max, ``Σ exp(z − max)`` and
            ``Σ exp(z − max)(z − max)`` over the tiles so far (``−inf``, 0, 0 before the first).
        col: ``[nc, C]`` int64 local columns to gather (clamped into the tile; the caller masks outside ones).

    Returns:
        ``(run_max, run_sum, run_wsum, picked)``: updated ``[nc]`` statistics and ``[nc, C]`` the processed
        logits ``z`` at ``col``.

    Pure and free of Python branching on tensor values, so :func:`_tile_functions` can compile it into one or
    two fused kernels per tile (the eager version makes about seven fp32 passes over the tile).
    """
    z = z_mm.to(acc)
    if bias is not None:
        z = z + bias.to(acc)
    if temperature != 1.0:
        z = z / temperature
    picked = z.gather(1, col)
    new_max = torch.maximum(run_max, z.amax(dim=1))
    shift = torch.where(torch.isfinite(run_max), run_max - new_max, torch.zeros_like(run_max))
    scale = shift.exp()
    z = z - new_max[:, None]
    e = z.exp()
    run_wsum = scale * (run_wsum + shift * run_sum) + (e * z).sum(dim=1)
    run_sum = scale * run_sum + e.sum(dim=1)
    return new_max, run_sum, run_wsum, picked


def _tile_backward(z_mm, bias, temperature: float, acc: torch.dtype, lse, g_total, col, g_col, member,
                   need_bias: bool):
    """Gradient ``dL/d(h W^T + b)`` of one ``[nc, vc]`` tile (module docstring), recomputed from ``z_mm``.

    Args:
        z_mm, bias, temperature, acc: as :func:`_tile_forward`.
        lse: ``[nc]`` log-sum-exp of each token's working set; g_total: ``[nc]`` coefficient of ``−π̃(v)``.
        col: ``[nc, C]`` local columns of the trained token and the top ids; g_col: ``[nc, C]`` their
            gradients (0 where the id lies outside this tile).
        member: ``[nc, vc]`` bool, the token's candidate set (all True without one), or None = full vocabulary.
        need_bias: also return the tile's bias gradient.

    Returns:
        ``(dz, gb)``: ``[nc, vc]`` gradient in ``z_mm``'s dtype (the two gradient GEMMs run in it), and
        ``[vc]`` ``acc`` bias gradient (None unless ``need_bias``).
    """
    z = z_mm.to(acc)
    if bias is not None:
        z = z + bias.to(acc)
    if temperature != 1.0:
        z = z / temperature
    dz = (z - lse[:, None]).exp()  # π̃(v) on the working set (full-vocabulary rows)
    if member is not None:
        dz = dz.masked_fill(~member, 0.0)
    dz = (dz * -g_total[:, None]).scatter_add(1, col, g_col)
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(z_mm.dtype), (dz.sum(dim=0) if need_bias else None)


def _mm_accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in a wider dtype than ``a``/``b`` (fp32 accumulator, bf16/fp16 operands).

    On CUDA the GEMM adds into ``out`` itself (``addmm`` with ``out_dtype``: cuBLAS's ``C = C + A B``), so no
    half-precision product is rounded, cast and added in extra passes; elsewhere (CPU, float64) it is the plain
    ``out += (a @ b).to(out.dtype)``.
    """
    if out.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and out.dtype == torch.float32:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out += torch.matmul(a, b).to(out.dtype)


_TILE_FUNCTIONS: dict[str | None, tuple] = {None: (_tile_forward, _tile_backward)}


def _tile_functions(compile_backend: str | None) -> tuple:
    """``(tile_forward, tile_backward)``: eager when ``compile_backend`` is None, else compiled once per backend
    with ``torch.compile(backend=compile_backend, dynamic=True)``: traced for any tile shape at the first call, so
    that a later row's new shapes do not recompile (with shapes static until a first recompile, a model whose
    vocabulary is a multiple of the vocabulary chunk, SmolLM2's 49,152, recompiled at step 2). Dynamic shapes still
    specialise a size of 1: `_token_chunks` keeps token chunks of one token out, and `chunked_token_logprobs` gives
    a single trained token a detached twin."""
    if compile_backend not in _TILE_FUNCTIONS:
        _TILE_FUNCTIONS[compile_backend] = tuple(
            torch.compile(fn, backend=compile_backend, dynamic=True) for fn in (_tile_forward, _tile_backward))
    return _TILE_FUNCTIONS[compile_backend]


def _token_chunks(n: int, token_chunk: int, compiled: bool) -> list[tuple[int, int]]:
    """``[a, b)`` bounds of the token chunks of ``n`` trained tokens, ``token_chunk`` at most each. ``compiled``:
    when the last chunk would hold a single token (``n % token_chunk == 1``, ``n > token_chunk``), the last two
    hold ``token_chunk - 1`` and 2 instead, so the compiled tile functions never meet a size of 1 mid-run (a
    recompile of seconds). The chunks only group rows: each token's values are the same either way."""
    bounds = [(a, min(n, a + token_chunk)) for a in range(0, n, token_chunk)]
    if compiled and len(bounds) > 1 and token_chunk > 2 and n - bounds[-1][0] == 1:
        a = bounds[-2][0]
        bounds[-2:] = [(a, n - 2), (n - 2, n)]
    return bounds


def _in_tile(ids: torch.Tensor, v0: int, vc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each id in the tile ``[v0, v0+vc)`` (clamped into range) and whether it is inside."""
    local = ids - v0
    inside = (local >= 0) & (local < vc)
    return local.clamp(0, max(vc - 1, 0)), inside


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function behind :func:`chunked_token_logprobs`; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, top_ids, cand_ids, has_cand, temperature,
                token_chunk, vocab_chunk, compile_backend):
        n, _ = hidden.shape
        v = weight.shape[0]
        acc = _acc_dtype(hidden, weight, bias)
        cdt = _compute_dtype(hidden, weight)
        dev = hidden.device
        k = top_ids.shape[1]
        m_cols = cand_ids.shape[1] if cand_ids is not None else 0

        lse = torch.empty(n, dtype=acc, device=dev)
        entropy = torch.empty(n, dtype=acc, device=dev)

        # One gather per tile for the target, the top ids and the candidates (columns 0, 1..k, k+1..).
        ids = torch.cat([target_ids[:, None], top_ids] + ([cand_ids] if m_cols else []), dim=1)
        gathered = torch.empty(n, ids.shape[1], dtype=acc, device=dev)
        gathered[:, 0] = 0.0
        gathered[:, 1:1 + k] = 0.0
        gathered[:, 1 + k:] = -math.inf
        tile_fwd = _tile_functions(compile_backend)[0]
        for a, b in _token_chunks(n, token_chunk, compile_backend is not None):
            h = hidden[a:b].to(cdt)
            run_max = torch.full((b - a,), -math.inf, dtype=acc, device=dev)
            run_sum = torch.zeros(b - a, dtype=acc, device=dev)
            # Σ exp(z - run_max) · (z - run_max): entropy of the full-vocabulary softmax, streamed.
            run_wsum = torch.zeros(b - a, dtype=acc, device=dev)
            for v0 in range(0, v, vocab_chunk):
                v1 = min(v, v0 + vocab_chunk)
                z_mm = torch.matmul(h, weight[v0:v1].to(cdt).T)
                col, inside = _in_tile(ids[a:b], v0, v1 - v0)
                b_tile = bias[v0:v1] if bias is not None else None
                run_max, run_sum, run_wsum, picked = tile_fwd(
                    z_mm, b_tile, temperature, acc, run_max, run_sum, run_wsum, col)
                gathered[a:b] = torch.where(inside, picked, gathered[a:b])
                del z_mm
            log_sum = run_sum.log()
            lse[a:b] = run_max + log_sum
            entropy[a:b] = log_sum - run_wsum / run_sum
        tgt_z, top_z, cand_z = gathered[:, 0], gathered[:, 1:1 + k], gathered[:, 1 + k:]

        if m_cols:
            cand_valid = cand_ids >= 0
            cz = torch.where(cand_valid, cand_z, torch.full_like(cand_z, -math.inf))
            cand_lse = torch.logsumexp(cz, dim=1)
            logq = cz - cand_lse[:, None]
            cand_ent = -torch.where(cand_valid, logq.exp() * logq, torch.zeros_like(logq)).sum(dim=1)
            lse = torch.where(has_cand, cand_lse, lse)
            entropy = torch.where(has_cand, cand_ent, entropy)

        target_lp = tgt_z - lse
        top_valid = top_ids >= 0
        if m_cols and k:
            sorted_cand = cand_ids.sort(dim=1).values
            pos = torch.searchsorted(sorted_cand, top_ids).clamp(max=m_cols - 1)
            in_set = sorted_cand.gather(1, pos) == top_ids
            top_valid = top_valid & (in_set | ~has_cand[:, None])
        top_lp = torch.where(top_valid, top_z - lse[:, None], torch.zeros_like(top_z))

        ctx.save_for_backward(hidden, weight, bias, target_ids, top_ids, top_valid, cand_ids, has_cand, lse)
        ctx.temperature = temperature
        ctx.compute_dtype = cdt  # the backward runs without autocast: it recomputes in the forward's dtype
        ctx.token_chunk = token_chunk
        ctx.vocab_chunk = vocab_chunk
        ctx.compile_backend = compile_backend
        ctx.mark_non_differentiable(top_valid, entropy)
        return target_lp, top_lp, top_valid, entropy

    @staticmethod
    def backward(ctx, g_target, g_top, _g_valid, _g_entropy):
        hidden, weight, bias, target_ids, top_ids, top_valid, cand_ids, has_cand, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        temperature, token_chunk, vocab_chunk = ctx.temperature, ctx.token_chunk, ctx.vocab_chunk
        n, hdim = hidden.shape
        v = weight.shape[0]
        acc = lse.dtype
        cdt = ctx.compute_dtype
        dev = hidden.device
        k = top_ids.shape[1]
        m_cols = cand_ids.shape[1] if cand_ids is not None else 0

        g_target = g_target.to(acc)
        g_top = torch.where(top_valid, g_top.to(acc), torch.zeros((), dtype=acc, device=dev))
        g_total = g_target + g_top.sum(dim=1)  # coefficient of -π̃(v) in dL/dz_v

        grad_h = torch.zeros(n, hdim, dtype=acc, device=dev) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None

        # Scatter targets of each token's gradient: column 0 the trained token, columns 1..k the top ids.
        ids = torch.cat([target_ids[:, None], top_ids], dim=1)
        g_ids = torch.cat([g_target[:, None], g_top], dim=1)
        tile_bwd = _tile_functions(ctx.compile_backend)[1]
        for v0 in range(0, v, vocab_chunk):
            v1 = min(v, v0 + vocab_chunk)
            vc = v1 - v0
            w_tile = weight[v0:v1].to(cdt)
            b_tile = bias[v0:v1] if bias is not None else None
            gw_tile = torch.zeros(vc, hdim, dtype=acc, device=dev) if need_w else None
            gb_tile = torch.zeros(vc, dtype=acc, device=dev) if need_b else None
            for a, b in _token_chunks(n, token_chunk, ctx.compile_backend is not None):
                h = hidden[a:b].to(cdt)
                z_mm = torch.matmul(h, w_tile.T)
                member = None
                if m_cols:
                    col, inside = _in_tile(cand_ids[a:b], v0, vc)
                    member = torch.zeros(b - a, vc + 1, dtype=torch.bool, device=dev)
                    member.scatter_(1, torch.where(inside, col, torch.full_like(col, vc)), True)
                    member.masked_fill_(~has_cand[a:b, None], True)  # a mask, not a data-dependent index
                    member = member[:, :vc]
                col, inside = _in_tile(ids[a:b], v0, vc)
                g_col = torch.where(inside, g_ids[a:b], 0.0)
                dz_c, gb = tile_bwd(z_mm, b_tile, temperature, acc, lse[a:b], g_total[a:b], col, g_col, member,
                                    need_b)
                del z_mm, member
                if need_b:
                    gb_tile += gb
                if need_h:
                    _mm_accumulate(grad_h[a:b], dz_c, w_tile)
                if need_w:
                    _mm_accumulate(gw_tile, dz_c.T, h)
                del dz_c
            if need_w:
                grad_w[v0:v1] = gw_tile.to(grad_w.dtype)
            if need_b:
                grad_b[v0:v1] = gb_tile.to(grad_b.dtype)
        if need_h:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _check_ids(name: str, ids: torch.Tensor, n: int, vocab: int, allow_pad: bool, values: bool = True) -> None:
    """Dtype and length of an id tensor, and (``values``) its range: two host reads, a device sync each when
    ``ids`` lives on a GPU."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64 tensor of token ids, got dtype {ids.dtype}; use .long()")
    if ids.shape[0] != n:
        raise ValueError(f"{name} has {ids.shape[0]} rows but hidden has {n} tokens; give one row per trained token")
    if ids.numel() == 0 or not values:
        return
    lo, hi = int(ids.min()), int(ids.max())
    low_ok = -1 if allow_pad else 0
    if lo < low_ok or hi >= vocab:
        pad = " (-1 = padding)" if allow_pad else ""
        raise ValueError(
            f"{name} holds ids in [{lo}, {hi}] but the lm_head vocabulary has {vocab} rows; "
            f"ids must lie in [{low_ok}, {vocab - 1}]{pad}"
        )


def check_token_ids(target_ids: torch.Tensor, top_ids: torch.Tensor | None, candidate_ids: torch.Tensor | None,
                    vocab: int) -> None:
    """The id checks of :func:`chunked_token_logprobs` (shapes, range, unique candidates, each trained token in its
    own candidate set). They read values back, so the trainer runs them on the packer's CPU tensors before the row
    moves to the GPU (``check_values=False`` there), not as a host sync per micro-batch.

    Raises:
        ValueError: as :func:`chunked_token_logprobs`.
    """
    if target_ids.dim() != 1:
        raise ValueError(f"target_ids must be [N], got shape {tuple(target_ids.shape)}")
    n = target_ids.shape[0]
    _check_ids("target_ids", target_ids, n, vocab, allow_pad=False)
    if top_ids is not None:
        if top_ids.dim() != 2:
            raise ValueError(f"top_ids must be [N, K], got shape {tuple(top_ids.shape)}")
        _check_ids("top_ids", top_ids, n, vocab, allow_pad=True)
    if candidate_ids is None:
        return
    if candidate_ids.dim() != 2:
        raise ValueError(f"candidate_ids must be [N, M], got shape {tuple(candidate_ids.shape)}")
    _check_ids("candidate_ids", candidate_ids, n, vocab, allow_pad=True)
    if candidate_ids.shape[1] == 0:
        return
    candidate_ids, target_ids = candidate_ids.long(), target_ids.long()
    has_cand = (candidate_ids >= 0).any(dim=1)
    sorted_cand = candidate_ids.sort(dim=1).values
    dup = (sorted_cand[:, 1:] == sorted_cand[:, :-1]) & (sorted_cand[:, 1:] >= 0)
    if bool(dup.any()):
        row = int(dup.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"candidate_ids row {row} repeats a token id; each candidate set must list unique ids")
    pos = torch.searchsorted(sorted_cand, target_ids[:, None]).clamp(max=sorted_cand.shape[1] - 1)
    missing = has_cand & (sorted_cand.gather(1, pos)[:, 0] != target_ids)
    if bool(missing.any()):
        row = int(missing.nonzero()[0, 0])
        raise ValueError(
            f"target_ids[{row}]={int(target_ids[row])} is not in its own candidate set (candidate_ids row "
            f"{row}); the sampler can only draw from that set, so the rollout data is inconsistent"
        )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_ids: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    compile_backend: str | None = None,
    check_values: bool = True,
) -> TokenLogProbs:
    """Log-probs of the trained tokens and of the sampler's top ids, plus entropy, without full logits.

    Args:
        hidden: ``[N, H]`` float (bf16/fp16/fp32/fp64), last-layer hidden states at each trained token's
            prediction index (the position whose logits predict it). May require grad.
        lm_head_weight: ``[V, H]`` output projection (unsharded); may require grad (tied or not).
        target_ids: ``[N]`` int64, the trained tokens, in ``[0, V)``.
        lm_head_bias: optional ``[V]`` bias.
        temperature: sampling temperature (> 0); logits are divided by it before the softmax (B.10).
        top_ids: optional ``[N, K]`` int64 sampler top ids, ``-1`` = padding.
        candidate_ids: optional ``[N, M]`` int64 candidate set of each token (SPEC §7), ``-1`` = padding,
            ids unique per row; a row with no id >= 0 means the full vocabulary for that token; ``None``
            means the full vocabulary everywhere.
        token_chunk_size, vocab_chunk_size: tile shape ``[Nc, Vc]`` (tokens, vocabulary rows).
        compile_backend: a ``torch.compile`` backend (``"inductor"``) for the per-tile work after each GEMM
            (casts, online log-sum-exp, gathers; in the backward softmax, scatter and cast), or None to run it
            eagerly. The GEMMs stay cuBLAS calls either way; results agree to reduction order.
        check_values: run :func:`check_token_ids` here (host reads: device syncs on a GPU); False when the caller
            checked the same ids on the host already (the trainer's row, `packed_loss.check_row_values`).

    Returns:
        :class:`TokenLogProbs`; float dtype is float64 when any float input is float64, else float32.

    Precision: the lm_head GEMMs run in the common dtype of ``hidden`` and ``lm_head_weight``, or in autocast's
    dtype (bf16) when autocast is on for their device and both are float32; the backward recomputes in that same
    dtype (`_compute_dtype`: autocast does not reach the backward). Reductions accumulate in float32.

    Memory: nothing of size ``N × V`` is ever allocated. Forward transient peak ≈ 3 tiles of
    ``Nc × Vc`` in fp32 (plus the matmul output in the model dtype) and ``O(N (K + M))`` per-token state.
    Backward recomputes each tile (no logits are saved) with a peak ≈ 2 fp32 tiles + one model-dtype tile
    + a bool ``Nc × (Vc + 1)`` membership mask, plus an fp32 ``[N, H]`` accumulator for the hidden grad
    and an fp32 ``[Vc, H]`` accumulator for the current weight slice; the weight grad itself is written
    slice by slice into a ``[V, H]`` tensor of the weight's dtype. Defaults (2048 × 16384): a tile is
    128 MiB, so ≈ 0.5 GiB transient. Cost: the backward recomputes the lm_head GEMM and runs the two
    gradient GEMMs (four GEMMs in all), as in any recomputing fused cross-entropy.
    Measured on one H200 (torch 2.11, bf16, N=16384, H=2048, V=151936, K=8, temperature 0.7): forward +
    backward 0.16 s with 1.08 GiB peak above the inputs (the bf16 weight grad alone is 0.58 GiB), versus
    0.08 s and 27.8 GiB for the naive full-logits log-softmax; target log-probs agree to 2e-6.

    Raises:
        ValueError: on wrong shapes/dtypes, ids out of range, non-positive temperature or chunk sizes,
            duplicate candidate ids, or a trained token missing from its own candidate set.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and lm_head_weight [V, H] with the same H; got {tuple(hidden.shape)} and "
            f"{tuple(lm_head_weight.shape)}"
        )
    if not hidden.is_floating_point() or not lm_head_weight.is_floating_point():
        raise ValueError(f"hidden and lm_head_weight must be floating point, got {hidden.dtype}, {lm_head_weight.dtype}")
    n, vocab = hidden.shape[0], lm_head_weight.shape[0]
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (vocab,):
        raise ValueError(f"lm_head_bias must be [V]=[{vocab}], got {tuple(lm_head_bias.shape)}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    for name, size in (("token_chunk_size", token_chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if target_ids.dim() != 1:
        raise ValueError(f"target_ids must be [N], got shape {tuple(target_ids.shape)}")
    if top_ids is None:
        top_ids = torch.empty(n, 0, dtype=torch.long, device=hidden.device)
    # Shapes and dtypes cost nothing to check; the values (host reads) only with check_values.
    _check_ids("target_ids", target_ids, n, vocab, allow_pad=False, values=False)
    if top_ids.dim() != 2:
        raise ValueError(f"top_ids must be [N, K], got shape {tuple(top_ids.shape)}")
    _check_ids("top_ids", top_ids, n, vocab, allow_pad=True, values=False)
    if candidate_ids is not None:
        if candidate_ids.dim() != 2:
            raise ValueError(f"candidate_ids must be [N, M], got shape {tuple(candidate_ids.shape)}")
        _check_ids("candidate_ids", candidate_ids, n, vocab, allow_pad=True, values=False)
    if check_values:
        check_token_ids(target_ids, top_ids, candidate_ids, vocab)
    target_ids = target_ids.long()
    top_ids = top_ids.long()
    has_cand = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    if candidate_ids is not None:
        candidate_ids = candidate_ids.long()
        if candidate_ids.shape[1] == 0:
            candidate_ids = None
    if candidate_ids is not None:
        has_cand = (candidate_ids >= 0).any(dim=1)
    one = compile_backend is not None and n == 1
    if one:  # compiled tiles never see a size of 1 (`_token_chunks`): a detached copy makes two rows, sliced off below
        hidden = torch.cat([hidden, hidden.detach()])
        target_ids, top_ids, has_cand = (torch.cat([t, t]) for t in (target_ids, top_ids, has_cand))
        candidate_ids = torch.cat([candidate_ids, candidate_ids]) if candidate_ids is not None else None
    out = _ChunkedLogProbs.apply(
        hidden, lm_head_weight, lm_head_bias, target_ids, top_ids, candidate_ids, has_cand, float(temperature),
        token_chunk_size, vocab_chunk_size, compile_backend,
    )
    if one:
        out = tuple(t[:1] for t in out)
    return TokenLogProbs(target_logprobs=out[0], top_logprobs=out[1], top_valid=out[2], entropy=out[3])
