"""Tests of the trainer loss (SPEC §3.3, §7, §15.2, Appendix B.8–B.10, B.14).

The reference below is a deliberately plain float64 re-implementation written from the formulas: full
logits, full softmax, Python loops over the sampler's top ids. The chunked kernel and the objectives
must match it in value and in gradient (hidden states, lm_head weight and bias).
"""

from __future__ import annotations

import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncgrpo_cli.train.logprobs import chunked_token_logprobs
from asyncgrpo_cli.train.loss import (
    LossConfig,
    finalize_metrics,
    loss_and_metrics,
    loss_scale,
    merge_metric_contributions,
    token_losses,
)

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# Reference (float64, full logits, straight from SPEC §3.3 / §7)
# --------------------------------------------------------------------------------------------------


def ref_logq(h, w, b, temperature, cand):
    """[N, V] log π̃ with -inf outside each token's candidate set (full vocabulary where none)."""
    z = h @ w.T
    if b is not None:
        z = z + b
    z = z / temperature
    if cand is not None:
        in_set = torch.zeros_like(z, dtype=torch.bool)
        for i in range(z.shape[0]):
            ids = [c for c in cand[i].tolist() if c >= 0]
            if ids:
                in_set[i, ids] = True
            else:
                in_set[i, :] = True
        z = torch.where(in_set, z, torch.tensor(-math.inf, dtype=z.dtype))
    return z - torch.logsumexp(z, dim=1, keepdim=True)


def ref_entropy(logq):
    p = logq.exp()
    return -torch.where(p > 0, p * logq, torch.zeros_like(p)).sum(dim=1)


def ref_token_losses(logq, targets, adv, slp, top_ids, top_lp, cfg: LossConfig):
    """Per-token ℓ_t exactly as written in SPEC §3.3.2 (derived surrogate) and §3.3.3."""
    out = []
    for i in range(logq.shape[0]):
        lq = logq[i, targets[i]]
        r = torch.exp(lq - slp[i].double())
        inside = cfg.clip_min <= r.item() <= cfg.clip_max
        a = float(adv[i])
        if cfg.score_centering:
            centering = torch.zeros((), dtype=F64)
            for k in range(top_ids.shape[1]):
                v = int(top_ids[i, k])
                mu = float(top_lp[i, k])
                if v < 0 or not math.isfinite(mu) or not math.isfinite(logq[i, v].item()):
                    continue
                pi_v = logq[i, v].exp()
                r_v = pi_v.item() / math.exp(mu)
                if cfg.clip_min <= r_v <= cfg.clip_max:
                    centering = centering + pi_v
            first = r if inside else torch.zeros((), dtype=F64)
            out.append(-a * (first - centering))
        else:
            if not inside:
                out.append(torch.zeros((), dtype=F64))
                continue
            clipped = torch.clamp(r, 1 - cfg.epsilon, 1 + cfg.eps_high)
            out.append(-torch.minimum(r * a, clipped * a))
    return torch.stack(out)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def make_batch(seed=0, n=24, h=8, v=53, k=4, m=7, with_bias=True, with_cand=True, temperature=0.7):
    """Random micro-batch whose sampler log-probs put ratios both inside and outside [C_min, C_max]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=F64)
    weight = torch.randn(v, h, generator=g, dtype=F64) * 0.8
    bias = torch.randn(v, generator=g, dtype=F64) * 0.3 if with_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    cand = None
    if with_cand:
        rows = []
        for i in range(n):
            others = [x for x in torch.randperm(v, generator=g).tolist() if x != int(targets[i])]
            size = int(torch.randint(2, m + 1, (1,), generator=g))
            row = [int(targets[i])] + others[: size - 1]
            rows.append(row + [-1] * (m - len(row)))
        cand = torch.tensor(rows)
        cand[1] = -1  # full vocabulary for this token
        cand[5] = -1
    logq = ref_logq(hidden, weight, bias, temperature, cand)
    # Sampler top ids: mostly from the candidate set; some padding; one -inf log-prob.
    top_ids = torch.full((n, k), -1, dtype=torch.long)
    for i in range(n):
        order = torch.argsort(logq[i], descending=True)
        top_ids[i] = order[:k]
    top_ids[0, -1] = -1
    top_ids[3, 2:] = -1
    shift = torch.empty(n, k, dtype=F64).uniform_(-1.2, 1.2, generator=g)
    top_lp = torch.where(top_ids >= 0, logq.gather(1, top_ids.clamp(min=0)) + shift, torch.zeros((), dtype=F64))
    top_lp = torch.where(torch.isfinite(top_lp), top_lp, torch.full_like(top_lp, -math.inf))
    top_lp[2, -1] = -math.inf
    # Ratios spread over [e^-2.3, e^2.3] ≈ [0.10, 10]: some below 0.5, some above 5.
    delta = torch.empty(n, dtype=F64).uniform_(-2.3, 2.3, generator=g)
    delta[0], delta[1], delta[2], delta[3] = -2.0, 2.0, 0.1, -0.1
    slp = logq.gather(1, targets[:, None])[:, 0] - delta
    adv = torch.randn(n, generator=g, dtype=F64)
    sample_index = torch.arange(n) // 5
    return SimpleNamespace(
        hidden=hidden, weight=weight, bias=bias, targets=targets, cand=cand, top_ids=top_ids,
        top_lp=top_lp.float(), slp=slp.float(), adv=adv.float(), sample_index=sample_index,
        temperature=temperature,
    )


def run_impl(batch, cfg: LossConfig, dtype=F64, global_tokens=None, num_processes=1):
    h = batch.hidden.to(dtype).clone().requires_grad_(True)
    w = batch.weight.to(dtype).clone().requires_grad_(True)
    b = batch.bias.to(dtype).clone().requires_grad_(True) if batch.bias is not None else None
    loss, metrics = loss_and_metrics(
        h, w, batch.targets, batch.adv, batch.slp, batch.sample_index,
        global_num_trained_tokens=global_tokens if global_tokens is not None else len(batch.targets),
        num_processes=num_processes, config=cfg, lm_head_bias=b,
        sampler_top_ids=batch.top_ids, sampler_top_logprobs=batch.top_lp, candidate_ids=batch.cand,
    )
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad, (b.grad if b is not None else None)


def run_ref(batch, cfg: LossConfig, global_tokens=None, num_processes=1):
    h = batch.hidden.clone().requires_grad_(True)
    w = batch.weight.clone().requires_grad_(True)
    b = batch.bias.clone().requires_grad_(True) if batch.bias is not None else None
    logq = ref_logq(h, w, b, cfg.temperature, batch.cand)
    losses = ref_token_losses(logq, batch.targets, batch.adv, batch.slp, batch.top_ids, batch.top_lp, cfg)
    total = global_tokens if global_tokens is not None else len(batch.targets)
    loss = losses.sum() / total * num_processes
    loss.backward()
    return loss.detach(), logq.detach(), h.grad, w.grad, (b.grad if b is not None else None)


# --------------------------------------------------------------------------------------------------
# Loss and gradients vs the float64 reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_centering", [True, False])
@pytest.mark.parametrize("with_cand", [True, False])
def test_loss_and_grads_match_reference(score_centering, with_cand):
    batch = make_batch(seed=1, with_cand=with_cand, temperature=0.7)
    cfg = LossConfig(score_centering=score_centering, epsilon=0.2, epsilon_high=0.28, temperature=0.7,
                     token_chunk_size=7, vocab_chunk_size=16)
    loss, metrics, gh, gw, gb = run_impl(batch, cfg)
    rloss, logq, rgh, rgw, rgb = run_ref(batch, cfg)
    # The batch really exercises masked IS on both sides and the clip region.
    ratio = (logq.gather(1, batch.targets[:, None])[:, 0] - batch.slp.double()).exp()
    assert (ratio < cfg.clip_min).any() and (ratio > cfg.clip_max).any()
    assert ((ratio >= cfg.clip_min) & (ratio <= cfg.clip_max)).sum() >= 5
    assert abs(rloss.item()) > 1e-3
    torch.testing.assert_close(loss, rloss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rgh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rgw, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gb, rgb, rtol=1e-9, atol=1e-12)
    assert gw.abs().sum() > 0 and gh.abs().sum() > 0


def test_float32_inputs_match_reference_within_fp32_precision():
    batch = make_batch(seed=2, temperature=1.3)
    cfg = LossConfig(temperature=1.3, token_chunk_size=5, vocab_chunk_size=10)
    loss, _, gh, gw, gb = run_impl(batch, cfg, dtype=torch.float32)
    rloss, _, rgh, rgw, rgb = run_ref(batch, cfg)
    assert loss.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss.double(), rloss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gh.double(), rgh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw.double(), rgw, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gb.double(), rgb, rtol=1e-4, atol=1e-5)


def test_kernel_logprobs_entropy_and_top_validity_match_reference():
    batch = make_batch(seed=3, temperature=0.5)
    out = chunked_token_logprobs(
        batch.hidden, batch.weight, batch.targets, lm_head_bias=batch.bias, temperature=0.5,
        top_ids=batch.top_ids, candidate_ids=batch.cand, token_chunk_size=4, vocab_chunk_size=9,
    )
    logq = ref_logq(batch.hidden, batch.weight, batch.bias, 0.5, batch.cand)
    torch.testing.assert_close(out.target_logprobs, logq.gather(1, batch.targets[:, None])[:, 0])
    torch.testing.assert_close(out.entropy, ref_entropy(logq))
    ref_top = logq.gather(1, batch.top_ids.clamp(min=0))
    ref_valid = (batch.top_ids >= 0) & torch.isfinite(ref_top)
    assert torch.equal(out.top_valid, ref_valid)
    torch.testing.assert_close(out.top_logprobs[ref_valid], ref_top[ref_valid])
    assert torch.all(out.top_logprobs[~ref_valid] == 0)
    # Candidate-set renormalisation really changes the numbers (§7): log π̃ > log π on restricted rows.
    full = ref_logq(batch.hidden, batch.weight, batch.bias, 0.5, None)
    restricted = (batch.cand >= 0).any(dim=1)
    t = batch.targets[:, None]
    assert torch.all(logq.gather(1, t)[restricted] > full.gather(1, t)[restricted])


def test_candidate_renormalisation_formula_of_spec_section_7():
    """log π̃(o) = log π(o) − log Σ_{v∈S} π(v), with π the temperature-scaled full softmax."""
    batch = make_batch(seed=4, temperature=0.9)
    out = chunked_token_logprobs(batch.hidden, batch.weight, batch.targets, lm_head_bias=batch.bias,
                                 temperature=0.9, candidate_ids=batch.cand, vocab_chunk_size=11)
    logp = ref_logq(batch.hidden, batch.weight, batch.bias, 0.9, None)
    for i in range(len(batch.targets)):
        ids = [c for c in batch.cand[i].tolist() if c >= 0] or list(range(batch.weight.shape[0]))
        expected = logp[i, batch.targets[i]] - torch.logsumexp(logp[i, ids], dim=0)
        assert out.target_logprobs[i].item() == pytest.approx(expected.item(), abs=1e-12)


def test_kernel_gradcheck_float64():
    batch = make_batch(seed=5, n=6, h=4, v=13, k=3, m=4, temperature=0.8)
    h = batch.hidden.clone().requires_grad_(True)
    w = batch.weight.clone().requires_grad_(True)
    b = batch.bias.clone().requires_grad_(True)

    def fn(h, w, b):
        out = chunked_token_logprobs(h, w, batch.targets, lm_head_bias=b, temperature=0.8, top_ids=batch.top_ids,
                                     candidate_ids=batch.cand, token_chunk_size=4, vocab_chunk_size=5)
        return out.target_logprobs, out.top_logprobs

    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_frozen_lm_head_and_no_bias():
    """LoRA case: only the hidden states need a gradient; no weight gradient is produced."""
    batch = make_batch(seed=6, with_bias=False)
    cfg = LossConfig(token_chunk_size=8, vocab_chunk_size=20, temperature=0.7)
    h = batch.hidden.clone().requires_grad_(True)
    loss, _ = loss_and_metrics(h, batch.weight, batch.targets, batch.adv, batch.slp, batch.sample_index,
                               global_num_trained_tokens=len(batch.targets), config=cfg,
                               sampler_top_ids=batch.top_ids, sampler_top_logprobs=batch.top_lp,
                               candidate_ids=batch.cand)
    loss.backward()
    _, _, rgh, _, _ = run_ref(batch, cfg)
    torch.testing.assert_close(h.grad, rgh)
    assert batch.weight.grad is None


# --------------------------------------------------------------------------------------------------
# Chunking: equality across chunk sizes, stability, memory bound
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_centering", [True, False])
def test_chunk_sizes_do_not_change_results(score_centering):
    batch = make_batch(seed=7, n=23, v=61, temperature=1.1)
    results = []
    # (tokens, vocab): unchunked, V not divisible by the chunk (61 = 4·15 + 1, 7 and 10 do not divide it), 1-wide.
    for tc, vc in [(10_000, 10_000), (5, 15), (7, 10), (23, 1), (1, 61), (3, 7)]:
        cfg = LossConfig(score_centering=score_centering, temperature=1.1, token_chunk_size=tc, vocab_chunk_size=vc)
        loss, metrics, gh, gw, gb = run_impl(batch, cfg)
        results.append((loss, finalize_metrics(metrics), gh, gw, gb))
    base = results[0]
    for loss, metrics, gh, gw, gb in results[1:]:
        torch.testing.assert_close(loss, base[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(gh, base[2], rtol=1e-11, atol=1e-13)
        torch.testing.assert_close(gw, base[3], rtol=1e-11, atol=1e-13)
        torch.testing.assert_close(gb, base[4], rtol=1e-11, atol=1e-13)
        assert metrics.keys() == base[1].keys()
        for name, value in metrics.items():
            assert value == pytest.approx(base[1][name], rel=1e-9, abs=1e-12), name


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor on the CPU needs a C++ compiler")),
])
def test_compiled_tiles_match_eager(backend):
    """``compile_backend`` runs the same per-tile math through torch.compile: loss, gradients and metrics agree
    with the eager kernel (candidates, bias, temperature, padded top ids, ragged last tiles)."""
    batch = make_batch(seed=13, n=23, v=61, temperature=0.7)
    eager_cfg = LossConfig(temperature=0.7, token_chunk_size=10, vocab_chunk_size=16)
    compiled_cfg = LossConfig(temperature=0.7, token_chunk_size=10, vocab_chunk_size=16, compile_backend=backend)
    for dtype, tol in ((F64, 1e-10), (torch.float32, 1e-5)):
        want = run_impl(batch, eager_cfg, dtype=dtype)
        got = run_impl(batch, compiled_cfg, dtype=dtype)
        assert abs(float(want[0])) > 1e-3
        for a, b in zip((got[0], *got[2:]), (want[0], *want[2:])):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        got_m, want_m = finalize_metrics(got[1]), finalize_metrics(want[1])
        assert got_m.keys() == want_m.keys()
        for name, value in got_m.items():
            assert value == pytest.approx(want_m[name], rel=1e-4, abs=1e-6), name


def test_token_chunks_keep_a_single_token_out_of_compiled_tiles():
    from asyncgrpo_cli.train.logprobs import _token_chunks

    assert _token_chunks(23, 10, True) == [(0, 10), (10, 20), (20, 23)]
    assert _token_chunks(21, 10, True) == [(0, 10), (10, 19), (19, 21)]  # not (20, 21): one token
    assert _token_chunks(21, 10, False) == [(0, 10), (10, 20), (20, 21)]  # eager: unchanged
    assert _token_chunks(11, 10, True) == [(0, 9), (9, 11)] and _token_chunks(1, 10, True) == [(0, 1)]
    assert _token_chunks(0, 10, True) == [] and _token_chunks(3, 1, True) == [(0, 1), (1, 2), (2, 3)]


def test_compiled_tiles_trace_once_for_every_row_length():
    """The trainer's compiled log-prob tiles (`trainer.torch_compile`): traced with dynamic shapes at the first row,
    they serve later rows of other lengths, a last chunk of one token included (the smoke job recompiled at
    step 2 before: SmolLM2's vocabulary is a multiple of the vocabulary chunk), with the eager kernel's values."""
    import torch._dynamo

    eager_cfg = LossConfig(temperature=0.7, token_chunk_size=10, vocab_chunk_size=16)
    compiled_cfg = LossConfig(temperature=0.7, token_chunk_size=10, vocab_chunk_size=16, compile_backend="aot_eager")
    torch._dynamo.reset()
    try:
        run_impl(make_batch(seed=3, n=20, v=64), compiled_cfg)  # whole tiles only: 2 x 10 tokens, 4 x 16 ids
        with torch._dynamo.config.patch(error_on_recompile=True):
            for n in (23, 21, 11, 37, 1):  # 1: a row of one trained token (a detached twin makes two)
                batch = make_batch(seed=n, n=max(n, 6), v=64)
                batch = SimpleNamespace(**{k: (v[:n] if isinstance(v, torch.Tensor) and v.shape[0] == max(n, 6)
                                               and k not in ("weight", "bias") else v)
                                           for k, v in vars(batch).items()})
                got, want = run_impl(batch, compiled_cfg), run_impl(batch, eager_cfg)
                for a, b in zip((got[0], *got[2:]), (want[0], *want[2:])):
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    finally:
        torch._dynamo.reset()


def test_online_logsumexp_is_stable_for_huge_logits():
    """Logits in the thousands (fp32) must not overflow; the result equals the float64 reference."""
    batch = make_batch(seed=8, n=9, v=40, with_cand=False)
    hidden = (batch.hidden * 400).float()
    weight = batch.weight.float()
    out = chunked_token_logprobs(hidden, weight, batch.targets, top_ids=batch.top_ids, vocab_chunk_size=6)
    logq = ref_logq(hidden.double(), weight.double(), None, 1.0, None)
    assert torch.isfinite(out.target_logprobs).all() and torch.isfinite(out.entropy).all()
    assert (hidden.double() @ weight.double().T).abs().max() > 1000
    torch.testing.assert_close(out.target_logprobs.double(), logq.gather(1, batch.targets[:, None])[:, 0],
                               rtol=1e-4, atol=2e-2)
    torch.testing.assert_close(out.entropy.double(), ref_entropy(logq), rtol=1e-3, atol=1e-3)


def test_bfloat16_hidden_states_accumulate_in_float32():
    batch = make_batch(seed=9, n=16, v=50, temperature=0.7)
    cfg = LossConfig(temperature=0.7, token_chunk_size=6, vocab_chunk_size=8)
    h = batch.hidden.to(torch.bfloat16).requires_grad_(True)
    w = batch.weight.to(torch.bfloat16).requires_grad_(True)
    out = chunked_token_logprobs(h, w, batch.targets, temperature=0.7, top_ids=batch.top_ids,
                                 candidate_ids=batch.cand, token_chunk_size=6, vocab_chunk_size=8)
    assert out.target_logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    # Reference on the same bf16-rounded inputs, in float64.
    logq = ref_logq(h.detach().double(), w.detach().double(), None, 0.7, batch.cand)
    torch.testing.assert_close(out.target_logprobs.double(), logq.gather(1, batch.targets[:, None])[:, 0],
                               rtol=0, atol=0.05)
    torch.testing.assert_close(out.entropy.double(), ref_entropy(logq), rtol=0, atol=0.05)
    loss, _ = loss_and_metrics(h, w, batch.targets, batch.adv, batch.slp, batch.sample_index,
                               global_num_trained_tokens=16, config=cfg, sampler_top_ids=batch.top_ids,
                               sampler_top_logprobs=batch.top_lp, candidate_ids=batch.cand)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()
    _, _, rgh, rgw, _ = run_ref(SimpleNamespace(**{**vars(batch), "bias": None}), cfg)
    # bf16 has ~3 significant digits: compare directions, not bits.
    cos = torch.nn.functional.cosine_similarity(w.grad.double().flatten(), rgw.flatten(), dim=0)
    assert cos > 0.99


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.where = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.where = t.numel(), f"{func} -> {tuple(t.shape)}"
        return out


@pytest.mark.parametrize("score_centering", [True, False])
def test_chunk_size_caps_the_largest_intermediate(score_centering):
    """No op in forward or backward produces anything near the [N, V] logits (here 256 × 1000)."""
    n, hdim, v, tc, vc = 256, 3, 1000, 32, 128
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(n, hdim, generator=g, requires_grad=True)
    weight = torch.randn(v, hdim, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    top_ids = torch.randint(0, v, (n, 4), generator=g)
    cand = torch.stack([torch.cat([targets[i:i + 1], torch.full((5,), -1)]) for i in range(n)])
    cand[:, 1] = (targets + 1) % v
    cfg = LossConfig(score_centering=score_centering, token_chunk_size=tc, vocab_chunk_size=vc)
    recorder = _LargestTensor()
    with recorder:
        loss, _ = loss_and_metrics(hidden, weight, targets, torch.randn(n), torch.full((n,), -7.0),
                                   torch.arange(n) // 8, global_num_trained_tokens=n, config=cfg,
                                   sampler_top_ids=top_ids, sampler_top_logprobs=torch.full((n, 4), -7.0),
                                   candidate_ids=cand)
        loss.backward()
    tile = tc * (vc + 1)
    # The weight gradient (V × H = 3000) and a tile (+1 dump column) are the biggest things allowed.
    assert recorder.largest <= max(tile, v * hdim), recorder.where
    assert recorder.largest < n * v // 20
    assert weight.grad is not None and hidden.grad is not None


class _GemmDtypes(TorchDispatchMode):
    """Records the operand dtypes of every GEMM (``mm``, ``addmm``, ``bmm``) that reaches dispatch."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor))[-2:])
        return func(*args, **(kwargs or {}))


def test_float32_weights_under_bf16_autocast_compute_in_bf16_in_both_passes():
    """float32 hidden states and lm_head under bf16 autocast (the default ``model.dtype=float32`` with
    ``trainer.bf16``): autocast reaches the forward's GEMM but not the backward, which recomputed each tile and ran
    its three GEMMs in float32 (an estimated 0.9 s of a 3.1 s fwd+bwd of 32K tokens at the 1.7B shape on an H100;
    NOTES, eighteenth session). Every GEMM of both passes now runs in bf16, and the gradients still agree with
    float64 within bf16 precision."""
    n, hdim, v = 64, 16, 300
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, hdim, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(v, hdim, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    top_ids = torch.randint(0, v, (n, 4), generator=g)
    forward, backward = _GemmDtypes(), _GemmDtypes()
    with torch.autocast("cpu", dtype=torch.bfloat16), forward:
        out = chunked_token_logprobs(hidden, weight, targets, top_ids=top_ids, temperature=0.7,
                                     token_chunk_size=32, vocab_chunk_size=128)
    assert out.target_logprobs.dtype == torch.float32
    with backward:
        (out.target_logprobs.sum() + 0.5 * out.top_logprobs.sum()).backward()
    assert forward.seen and backward.seen
    assert all(d == (torch.bfloat16, torch.bfloat16) for d in forward.seen + backward.seen), (forward.seen,
                                                                                              backward.seen)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = chunked_token_logprobs(h64, w64, targets, top_ids=top_ids, temperature=0.7)
    (ref.target_logprobs.sum() + 0.5 * ref.top_logprobs.sum()).backward()
    torch.testing.assert_close(out.target_logprobs.double(), ref.target_logprobs.detach(), atol=0.05, rtol=0.02)
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert got.dtype == torch.float32
        rel = float((got.double() - want).norm() / want.norm())
        assert rel < 0.02, rel


# --------------------------------------------------------------------------------------------------
# Normalisation (Appendix B.9)
# --------------------------------------------------------------------------------------------------


def test_loss_scale_arithmetic():
    assert loss_scale(10, 2) == pytest.approx(0.2)
    assert loss_scale(7, 1) == pytest.approx(1 / 7)
    assert loss_scale(0, 4) == 0.0
    with pytest.raises(ValueError, match="num_processes"):
        loss_scale(10, 0)


def test_b9_two_ranks_with_gradient_accumulation():
    """Rank loss = Σ token losses / global tokens × P; DDP mean over ranks, then mean over micro-batches.

    The step gradient must be mean_m (Σ_{all ranks' tokens in m} ∇ℓ_t / T_m), with T_m the global trained
    tokens of micro-batch m. Token counts differ across ranks and micro-batches on purpose.
    """
    cfg = LossConfig(temperature=0.8, token_chunk_size=6, vocab_chunk_size=12)
    base = make_batch(seed=11, n=30, temperature=0.8)
    weight = base.weight

    def part(lo, hi):
        fields = {key: (val[lo:hi] if isinstance(val, torch.Tensor) and val.shape[0] == 30 else val)
                  for key, val in vars(base).items()}
        return SimpleNamespace(**fields)

    # micro-batch 0: rank 0 has 9 tokens, rank 1 has 4; micro-batch 1: rank 0 has 5, rank 1 has 12.
    layout = [[part(0, 9), part(9, 13)], [part(13, 18), part(18, 30)]]
    num_processes, ga = 2, len(layout)

    step_grad = torch.zeros_like(weight)
    for mb in layout:
        global_tokens = sum(len(r.targets) for r in mb)
        rank_grads = []
        for rank_batch in mb:
            w = weight.clone().requires_grad_(True)
            loss, _ = loss_and_metrics(
                rank_batch.hidden, w, rank_batch.targets, rank_batch.adv, rank_batch.slp, rank_batch.sample_index,
                global_num_trained_tokens=global_tokens, num_processes=num_processes, config=cfg,
                lm_head_bias=rank_batch.bias, sampler_top_ids=rank_batch.top_ids,
                sampler_top_logprobs=rank_batch.top_lp, candidate_ids=rank_batch.cand,
            )
            # The scalar itself: Σ ℓ_t × P / T_global.
            logq = ref_logq(rank_batch.hidden, weight, rank_batch.bias, cfg.temperature, rank_batch.cand)
            tok = ref_token_losses(logq, rank_batch.targets, rank_batch.adv, rank_batch.slp, rank_batch.top_ids,
                                   rank_batch.top_lp, cfg)
            assert loss.item() == pytest.approx(tok.sum().item() * num_processes / global_tokens, rel=1e-10)
            (loss / ga).backward()  # the trainer's gradient-accumulation division
            rank_grads.append(w.grad)
        step_grad += torch.stack(rank_grads).mean(dim=0)  # DDP/FSDP all-reduce mean

    expected = torch.zeros_like(weight)
    for mb in layout:
        w = weight.clone().requires_grad_(True)
        global_tokens = sum(len(r.targets) for r in mb)
        total = sum(
            ref_token_losses(ref_logq(r.hidden, w, r.bias, cfg.temperature, r.cand), r.targets, r.adv, r.slp,
                             r.top_ids, r.top_lp, cfg).sum()
            for r in mb
        )
        (g,) = torch.autograd.grad(total / global_tokens, w)
        expected += g / ga
    torch.testing.assert_close(step_grad, expected, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# Metrics on a hand-made example (§15.2, B.14)
# --------------------------------------------------------------------------------------------------


def _hand_batch():
    """W = I and hidden = log-probs, so π = [0.5, 0.25, 0.125, 0.125] at every token."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=F64)
    hidden = probs.log().repeat(4, 1)
    weight = torch.eye(4, dtype=F64)
    targets = torch.tensor([0, 1, 2, 3])
    # r = [0.5/0.5, 0.25/0.625, 0.125/0.1, 0.125/0.02] = [1, 0.4, 1.25, 6.25]
    slp = torch.tensor([0.5, 0.625, 0.1, 0.02]).log()
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5])
    top_ids = torch.tensor([[0, 1, -1], [0, 1, -1], [0, 1, -1], [0, 1, 2]])
    top_lp = torch.tensor([[0.5, 0.3, 1.0]] * 3 + [[0.4, 0.3, 0.0]]).log()
    top_lp[:3, 2] = 0.0  # padding entries: value ignored
    top_lp[3, 2] = -math.inf  # outside the sampler's candidate set: skipped
    sample_index = torch.tensor([0, 0, 1, 1])
    return hidden, weight, targets, slp, adv, top_ids, top_lp, sample_index


@pytest.mark.parametrize("score_centering, expected_loss", [(True, -1.625 / 4), (False, -3.4 / 4)])
def test_hand_made_loss_and_metrics(score_centering, expected_loss):
    hidden, weight, targets, slp, adv, top_ids, top_lp, sample_index = _hand_batch()
    cfg = LossConfig(score_centering=score_centering, epsilon=0.2, vocab_chunk_size=3, token_chunk_size=3)
    loss, m = loss_and_metrics(hidden, weight, targets, adv, slp, sample_index, global_num_trained_tokens=4,
                               config=cfg, sampler_top_ids=top_ids, sampler_top_logprobs=top_lp)
    # Score centering: ℓ = −Â(1[in]·r − Σ in(r_v) π(v)); centering = 0.5 + 0.25 at every token
    #   [−1·(1 − .75), +1·(0 − .75), −2·(1.25 − .75), −.5·(0 − .75)] = [−.25, −.75, −1, .375] → −1.625
    # Clipped: [−min(1, 1), 0 (masked), −min(2.5, 2.4), 0 (masked)] → −3.4
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert m["entropy"] == pytest.approx((4 * 1.75 * math.log(2), 4.0))
    diffs = [0.0, math.log(2.5), math.log(1.25), math.log(6.25)]
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((sum(diffs), 4.0), rel=1e-6)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(6.25), rel=1e-6)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx((8.9, 4.0), rel=1e-6)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.4, rel=1e-6)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(6.25, rel=1e-6)
    assert m["sampling/masked_mean"] == (2.0, 4.0)
    assert m["clip_ratio/low_mean"] == (1.0, 4.0)
    assert m["clip_ratio/high_mean"] == (2.0, 4.0)
    assert m["clip_ratio/region_mean"] == (3.0, 4.0)
    assert m["clip_ratio/low_min"] == 0.0  # sample 1 has no low-clipped token (sample 0: 1/2)
    assert m["clip_ratio/high_max"] == 1.0  # both tokens of sample 1 are above 1 + ε_high
    if score_centering:
        assert m["sampling/sampler_mass"] == pytest.approx((0.8 * 3 + 0.7, 4.0), rel=1e-6)
    else:
        assert "sampling/sampler_mass" not in m
    final = finalize_metrics(m)
    assert final["clip_ratio/region_mean"] == 0.75
    assert final["sampling/importance_sampling_ratio/mean"] == pytest.approx(2.225, rel=1e-6)


def test_metric_merging_across_micro_batches_and_ranks():
    a = {"entropy": (3.0, 2.0), "clip_ratio/low_min": 0.25, "clip_ratio/high_max": 0.5}
    b = {"entropy": (1.0, 2.0), "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.75}
    c = {"entropy": (0.0, 0.0)}  # an empty micro-batch
    merged = merge_metric_contributions([a, b, c])
    assert merged == {"entropy": (4.0, 4.0), "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.75}
    assert finalize_metrics(merged) == {"entropy": 1.0, "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.75}
    assert finalize_metrics(c) == {}
    with pytest.raises(ValueError, match="entropy"):
        merge_metric_contributions([{"entropy": 1.0}])


def test_masked_token_keeps_only_its_centering_term():
    """Score centering: a token outside [C_min, C_max] loses f(r_t) but keeps −Σ in(r_v) π(v) (SPEC formula)."""
    cfg = LossConfig()
    tlp = torch.tensor([math.log(0.1)], dtype=F64, requires_grad=True)
    top = torch.tensor([[math.log(0.6), math.log(0.1)]], dtype=F64, requires_grad=True)
    losses, ratio = token_losses(tlp, torch.tensor([2.0]), torch.tensor([math.log(0.5)]), cfg,
                                 top_logprobs=top, top_valid=torch.tensor([[True, True]]),
                                 sampler_top_logprobs=torch.tensor([[math.log(0.5), math.log(0.5)]]))
    # r_t = 0.2 < 0.5 → masked; r_v = [1.2, 0.2] → only v0 counts: ℓ = −2·(0 − 0.6) = 1.2
    assert ratio.item() == pytest.approx(0.2)
    assert losses.item() == pytest.approx(1.2)
    losses.sum().backward()
    assert tlp.grad.item() == 0.0
    assert top.grad[0].tolist() == pytest.approx([2 * 0.6, 0.0])


def test_huge_ratio_gives_finite_gradients():
    cfg = LossConfig(score_centering=False)
    tlp = torch.tensor([0.0, -0.1], requires_grad=True)
    losses, ratio = token_losses(tlp, torch.tensor([1.0, 1.0]), torch.tensor([-200.0, -0.1]), cfg)
    losses.sum().backward()
    assert math.isinf(ratio[0].item()) or ratio[0].item() > 1e80
    assert torch.isfinite(tlp.grad).all() and tlp.grad[0] == 0.0 and tlp.grad[1] != 0.0


# --------------------------------------------------------------------------------------------------
# Edge cases and errors
# --------------------------------------------------------------------------------------------------


def test_empty_micro_batch():
    weight = torch.randn(11, 4, requires_grad=True)
    hidden = torch.zeros(0, 4, requires_grad=True)
    e = torch.zeros(0, dtype=torch.long)
    loss, m = loss_and_metrics(hidden, weight, e, torch.zeros(0), torch.zeros(0), e, global_num_trained_tokens=10,
                               num_processes=2, sampler_top_ids=torch.zeros(0, 8, dtype=torch.long),
                               sampler_top_logprobs=torch.zeros(0, 8))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(weight.grad == 0)
    assert m["entropy"] == (0.0, 0.0)
    assert "clip_ratio/low_min" not in m and "sampling/importance_sampling_ratio/max" not in m


def test_config_from_args_and_validation():
    args = SimpleNamespace(score_centering=False, epsilon=0.1, epsilon_high=None,
                           vllm_importance_sampling_clip_min=0.3, vllm_importance_sampling_clip_max=3.0,
                           temperature=0.6)
    cfg = LossConfig.from_args(args, vocab_chunk_size=4096)
    assert (cfg.score_centering, cfg.eps_high, cfg.clip_min, cfg.clip_max, cfg.temperature, cfg.vocab_chunk_size) == (
        False, 0.1, 0.3, 3.0, 0.6, 4096)
    assert cfg.compile_backend is None
    args.torch_compile, args.torch_compile_backend = True, None
    assert LossConfig.from_args(args).compile_backend == "inductor"
    args.torch_compile_backend = "aot_eager"
    assert LossConfig.from_args(args).compile_backend == "aot_eager"
    with pytest.raises(ValueError, match="clip_min"):
        LossConfig(clip_min=2.0, clip_max=1.0)
    with pytest.raises(ValueError, match="temperature"):
        LossConfig(temperature=0.0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        LossConfig(vocab_chunk_size=0)


def _bad_call(**changes):
    batch = make_batch(seed=12, n=6, v=20, m=4)
    kwargs = dict(hidden=batch.hidden, lm_head_weight=batch.weight, target_ids=batch.targets, advantages=batch.adv,
                  sampler_logprobs=batch.slp, sample_index=batch.sample_index, global_num_trained_tokens=6,
                  sampler_top_ids=batch.top_ids, sampler_top_logprobs=batch.top_lp, candidate_ids=batch.cand)
    kwargs.update(changes)
    return loss_and_metrics(**kwargs)


@pytest.mark.parametrize("changes, match", [
    (dict(target_ids=torch.tensor([0, 1, 2, 3, 4, 20])), "target_ids"),
    (dict(advantages=torch.zeros(5)), "advantages"),
    (dict(sampler_logprobs=torch.tensor([0.0, -1.0, float("-inf"), -1.0, -1.0, -1.0])), r"sampler_logprobs\[2\]"),
    (dict(sampler_top_ids=None, sampler_top_logprobs=None), "score_centering"),
    (dict(global_num_trained_tokens=3), "global_num_trained_tokens"),
    (dict(sampler_top_ids=torch.full((6, 4), 25)), "top_ids"),
    (dict(candidate_ids=torch.tensor([[0, 0, -1, -1]] * 6)), "repeats"),
    (dict(candidate_ids=torch.tensor([[19, -1]] * 6), target_ids=torch.tensor([0, 19, 19, 19, 19, 19])),
     r"target_ids\[0\]=0 is not in its own candidate set"),
    (dict(sample_index=torch.zeros(6)), "sample_index"),
])
def test_bad_input_raises_clear_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**changes)
