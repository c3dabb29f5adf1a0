"""Loss variants (issue #27, README "Loss variants"): loss_type, importance_sampling_level (GSPO),
vllm_importance_sampling_mode (TIS / MIS, token and sequence), checked in float64 against a reference that
loops over samples and tokens, and on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo_cli.train.loss import LossConfig, loss_and_metrics, normalised_loss, token_terms

F64 = torch.float64


def _reference_loss(lp, adv, mu, sample, cfg, *, P, T, S, top_lp=None, mu_top=None):
    """Loop-by-loop float64 reference of README "Loss variants" (independent of loss.py's vector code)."""
    n = lp.shape[0]
    ids = sorted(set(sample.tolist()))
    members = {i: [t for t in range(n) if int(sample[t]) == i] for i in ids}
    cmin, cmax, eps, eh = cfg.clip_min, cfg.clip_max, cfg.epsilon, cfg.eps_high

    def trunc(x):
        return min(max(x, cmin), cmax) / x

    def factor(t):  # the off-policy correction of token t (a constant): c_t, or W_i for the sequence modes
        r = math.exp(float(lp[t] - mu[t]))
        if cfg.is_mode.startswith("sequence"):
            rho = math.exp(sum(float(lp[u] - mu[u]) for u in members[int(sample[t])]))
            return rho * (cmin <= rho <= cmax) if cfg.is_mode.endswith("mask") else min(max(rho, cmin), cmax)
        if cfg.is_mode.endswith("mask"):
            return 1.0 if cmin <= r <= cmax else 0.0
        return trunc(r)

    terms = []
    for t in range(n):
        r_t = torch.exp(lp[t] - mu[t])
        c = factor(t)
        if cfg.score_centering:
            cent = lp.new_zeros(())
            for k in range(top_lp.shape[1]):
                if math.isfinite(float(mu_top[t, k])):
                    r_v = math.exp(float(top_lp[t, k] - mu_top[t, k]))
                    c_v = (1.0 if cmin <= r_v <= cmax else 0.0) if cfg.is_mode == "token_mask" else trunc(r_v)
                    cent = cent + c_v * torch.exp(top_lp[t, k])
            terms.append(-adv[t] * (c * r_t - cent))
            continue
        if cfg.importance_sampling_level == "sequence":
            m = members[int(sample[t])]
            q = torch.exp(sum(lp[u] - mu[u] for u in m) / len(m))
        else:
            q = r_t
        per_value = 1.0 / float(q) if cfg.is_mode.startswith("sequence") else 1.0  # W_i / sg[q] (README)
        if cfg.loss_type == "cispo":
            w = min(float(q), eh)
            terms.append(-c * per_value * w * adv[t] * lp[t])
        else:
            clipped = torch.clamp(q, 1 - eps, 1 + eh)
            terms.append(-c * per_value * torch.minimum(q * adv[t], clipped * adv[t]))
    if cfg.loss_type in ("dapo", "cispo"):
        return sum(terms) * P / T
    if cfg.loss_type == "bnpo":
        return sum(terms) / n
    if cfg.loss_type == "dr_grpo":
        return sum(terms) * P / (S * cfg.max_completion_length)
    return sum(sum(terms[t] for t in m) / len(m) for m in members.values()) * P / S


def _data(seed=0, n=11, k=3):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=F64) * 2 - 0.05
    mu = lp.detach() + (torch.rand(n, generator=g, dtype=F64) - 0.5) * 1.6  # ratios roughly in [0.45, 2.2]
    mu[2] = lp[2].detach() - 2.5  # r ≈ 12: beyond C_max
    mu[5] = lp[5].detach() + 1.2  # r ≈ 0.3: below C_min
    adv = torch.randn(n, generator=g, dtype=F64)
    sample = torch.tensor([0, 0, 0, 4, 4, 7, 7, 7, 7, 9, 9])[:n]
    top_lp = -torch.rand(n, k, generator=g, dtype=F64) * 3 - 0.1
    mu_top = top_lp + (torch.rand(n, k, generator=g, dtype=F64) - 0.5) * 2.0
    mu_top[1, 2] = -math.inf  # outside the candidate set: skipped
    return lp, adv, mu, sample, top_lp, mu_top


SURROGATE_CASES = [
    dict(loss_type=lt, importance_sampling_level=lvl, is_mode=mode)
    for lt in ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")
    for lvl in ("token", "sequence")
    for mode in ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
]
CENTERING_CASES = [dict(loss_type=lt, is_mode=mode) for lt in ("dapo", "grpo", "bnpo", "dr_grpo")
                   for mode in ("token_mask", "token_truncate")]


@pytest.mark.parametrize("case", SURROGATE_CASES + [dict(score_centering=True, **c) for c in CENTERING_CASES],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_loss_and_gradient_match_reference_float64(case):
    case = dict(case)
    sc = case.pop("score_centering", False)
    cfg = LossConfig(score_centering=sc, epsilon=0.2, epsilon_high=1.5 if case["loss_type"] == "cispo" else 0.28,
                     clip_min=0.5, clip_max=5.0, max_completion_length=16, **case)
    lp0, adv, mu, sample, top0, mu_top = _data()
    P, T, S = 3, 40, 9
    got_lp, ref_lp = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    got_top, ref_top = top0.clone().requires_grad_(), top0.clone().requires_grad_()
    valid = torch.ones_like(top0, dtype=torch.bool)
    terms = token_terms(got_lp, adv, mu, cfg, top_logprobs=got_top if sc else None, top_valid=valid if sc else None,
                        sampler_top_logprobs=mu_top if sc else None, sample_index=sample)
    got = normalised_loss(terms.losses, sample, cfg, global_num_trained_tokens=T, num_processes=P,
                          global_num_samples=S)
    ref = _reference_loss(ref_lp, adv, mu, sample, cfg, P=P, T=T, S=S, top_lp=ref_top, mu_top=mu_top)
    assert got.dtype == F64
    assert abs(float(got) - float(ref)) <= 1e-6 * max(1.0, abs(float(ref)))
    got.backward()
    ref.backward()
    torch.testing.assert_close(got_lp.grad, ref_lp.grad, atol=1e-6, rtol=1e-6)
    if sc:
        torch.testing.assert_close(got_top.grad, ref_top.grad, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(got_lp.grad).all()


def test_defaults_are_spec_loss():
    cfg = LossConfig()
    assert (cfg.loss_type, cfg.importance_sampling_level, cfg.is_mode) == ("dapo", "token", "token_mask")


def _one(lp, mu, adv, sample, cfg, **kw):
    lp = torch.tensor(lp, dtype=F64, requires_grad=True)
    terms = token_terms(lp, torch.tensor(adv, dtype=F64), torch.tensor(mu, dtype=F64), cfg,
                        sample_index=torch.tensor(sample))
    loss = normalised_loss(terms.losses, torch.tensor(sample), cfg, **kw)
    loss.backward()
    return float(loss), lp.grad.tolist(), terms


def test_gspo_hand_computed():
    # One sample of two tokens, log-ratios ln 2 and 0: s = exp(ln 2 / 2) = √2 > 1 + ε = 1.2.
    cfg = LossConfig(score_centering=False, importance_sampling_level="sequence", loss_type="grpo")
    lp, mu = [math.log(0.5), math.log(0.25)], [math.log(0.25), math.log(0.25)]
    # Â = +1: min(√2, 1.2) = 1.2 is the clipped branch, constant: loss -1.2, no gradient.
    loss, grad, terms = _one(lp, mu, [1.0, 1.0], [0, 0], cfg, global_num_trained_tokens=2, global_num_samples=1)
    assert loss == pytest.approx(-1.2, abs=1e-12) and grad == [0.0, 0.0]
    assert terms.high.tolist() == [True, True]  # the sequence ratio is what the trust region clips
    # Â = −1: min(−√2, −1.2) = −√2: loss √2, d loss / d log π_t = s / 2 = √2/2 for each token.
    loss, grad, _ = _one(lp, mu, [-1.0, -1.0], [0, 0], cfg, global_num_trained_tokens=2, global_num_samples=1)
    assert loss == pytest.approx(math.sqrt(2), abs=1e-12)
    assert grad == pytest.approx([math.sqrt(2) / 2] * 2, abs=1e-12)
    # Token level, same data: token 0 (r = 2) is clipped, token 1 (r = 1) is not: mean(−(−2), −(−1)) = 1.5.
    tok = LossConfig(score_centering=False, loss_type="grpo")
    loss, grad, _ = _one(lp, mu, [-1.0, -1.0], [0, 0], tok, global_num_trained_tokens=2, global_num_samples=1)
    assert loss == pytest.approx(1.5, abs=1e-12) and grad == pytest.approx([1.0, 0.5], abs=1e-12)


def test_cispo_hand_computed():
    cfg = LossConfig(score_centering=False, loss_type="cispo", epsilon_high=2.0)
    # r = 3 capped at ε_max = 2; r = 0.5 kept (no lower cap); r = 6 > C_max = 5 masked (token_mask).
    lp = [math.log(0.6), math.log(0.2), math.log(0.3)]
    mu = [math.log(0.2), math.log(0.4), math.log(0.05)]
    loss, grad, terms = _one(lp, mu, [1.0, -1.0, 1.0], [0, 1, 2], cfg, global_num_trained_tokens=3)
    expected = (-2.0 * 1.0 * lp[0] - 0.5 * (-1.0) * lp[1] + 0.0) / 3
    assert loss == pytest.approx(expected, abs=1e-12)
    assert grad == pytest.approx([-2.0 / 3, 0.5 / 3, 0.0], abs=1e-12)
    assert terms.high.tolist() == [True, False, True] and not terms.low.any()


def test_truncation_and_sequence_modes_hand_computed():
    # r = 8 > C_max = 5, Â = −1: the unclipped branch −8 wins; masked IS drops it, TIS keeps weight 5.
    base = dict(score_centering=False, clip_min=0.5, clip_max=5.0)
    one = dict(global_num_trained_tokens=1)
    lp, mu = [math.log(0.8)], [math.log(0.1)]
    assert _one(lp, mu, [-1.0], [0], LossConfig(**base), **one)[:2] == (0.0, [0.0])
    loss, grad, terms = _one(lp, mu, [-1.0], [0], LossConfig(is_mode="token_truncate", **base), **one)
    assert loss == pytest.approx(5.0, abs=1e-12) and grad == pytest.approx([5.0], abs=1e-12)
    assert terms.corrected.tolist() == [True]
    # Sequence ratio ρ = 3 × 2 = 6 > 5 although each token is inside [0.5, 5].
    lp, mu = [math.log(0.9), math.log(0.8)], [math.log(0.3), math.log(0.4)]
    two = dict(global_num_trained_tokens=2)
    wide = dict(base, epsilon=0.99, epsilon_high=100.0)  # a trust region that clips nothing here
    loss, grad, terms = _one(lp, mu, [-1.0, -1.0], [0, 0], LossConfig(is_mode="sequence_mask", **wide), **two)
    assert (loss, grad) == (0.0, [0.0, 0.0]) and terms.corrected.all()
    # sequence_truncate (TRL's): every token weighs clamp(ρ) = 5, value −Â W per token, gradient −Â W ∇log π
    loss, grad, _ = _one(lp, mu, [-1.0, -1.0], [0, 0], LossConfig(is_mode="sequence_truncate", **wide), **two)
    assert loss == pytest.approx(5.0 * (1.0 + 1.0) / 2, abs=1e-12)
    assert grad == pytest.approx([5.0 / 2, 5.0 / 2], abs=1e-12)
    # ρ = 3 × 0.5 = 1.5 inside: sequence_mask weighs both tokens by ρ, not by their own ratios 3 and 0.5
    lp2, mu2 = [math.log(0.9), math.log(0.2)], [math.log(0.3), math.log(0.4)]
    loss, grad, _ = _one(lp2, mu2, [-1.0, -1.0], [0, 0], LossConfig(is_mode="sequence_mask", **wide), **two)
    assert loss == pytest.approx(1.5, abs=1e-12) and grad == pytest.approx([0.75, 0.75], abs=1e-12)
    # with the default trust region (Â < 0): token 0 (r = 3) takes the unclipped branch min(−3, −1.2) = −3, token 1
    # (r = 0.5 < 0.8) the clipped one min(−0.5, −0.8) = −0.8: no gradient, value W × 0.8/0.5
    loss, grad, _ = _one(lp2, mu2, [-1.0, -1.0], [0, 0], LossConfig(is_mode="sequence_mask", **base), **two)
    assert grad == pytest.approx([0.75, 0.0], abs=1e-12)
    assert loss == pytest.approx(1.5 * (1.0 + 0.8 / 0.5) / 2, abs=1e-12)
    loss, _, _ = _one(lp, mu, [-1.0, -1.0], [0, 0], LossConfig(is_mode="token_mask", **base), **two)
    assert loss == pytest.approx(2.5, abs=1e-12)  # token_mask keeps both tokens (r = 3, 2 are inside)


def test_normalisers_hand_computed():
    losses = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    sample = torch.tensor([0, 0, 5])
    kw = dict(global_num_trained_tokens=6, num_processes=2, global_num_samples=4)
    norm = {lt: float(normalised_loss(losses, sample, LossConfig(loss_type=lt, max_completion_length=10,
                                                                 score_centering=lt != "cispo",
                                                                 epsilon_high=5.0), **kw))
            for lt in ("dapo", "cispo", "bnpo", "grpo", "dr_grpo")}
    assert norm == pytest.approx({"dapo": 2.0, "cispo": 2.0, "bnpo": 2.0 * 3 / 3, "grpo": (1.5 + 3.0) * 2 / 4,
                                  "dr_grpo": 6.0 * 2 / 40})
    with pytest.raises(ValueError, match="global_num_samples"):
        normalised_loss(losses, sample, LossConfig(loss_type="grpo"), global_num_trained_tokens=6)
    with pytest.raises(ValueError, match="global_num_samples"):
        normalised_loss(losses, sample, LossConfig(loss_type="grpo"), global_num_trained_tokens=6,
                        global_num_samples=1)  # fewer than this rank's 2 samples


def test_loss_and_metrics_through_the_kernel_matches_reference():
    """The variants reach `loss_and_metrics`: gradient w.r.t. the hidden states equals the reference's."""
    torch.manual_seed(3)
    n, h, v = 9, 6, 12
    hidden = torch.randn(n, h, dtype=F64, requires_grad=True)
    weight = torch.randn(v, h, dtype=F64) * 0.7
    target = torch.randint(0, v, (n,))
    adv = torch.randn(n, dtype=F64)
    sample = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    with torch.no_grad():
        true_lp = torch.log_softmax(hidden @ weight.T, -1).gather(1, target[:, None])[:, 0]
    mu = true_lp + torch.linspace(-0.8, 0.8, n, dtype=F64)
    cfg = LossConfig(score_centering=False, loss_type="grpo", importance_sampling_level="sequence",
                     is_mode="sequence_truncate", clip_max=1.5)
    loss, metrics = loss_and_metrics(hidden, weight, target, adv, mu, sample, global_num_trained_tokens=n,
                                     config=cfg, global_num_samples=3)
    loss.backward()
    h2 = hidden.detach().clone().requires_grad_()
    lp2 = torch.log_softmax(h2 @ weight.T, -1).gather(1, target[:, None])[:, 0]
    ref = _reference_loss(lp2, adv, mu, sample, cfg, P=1, T=n, S=3)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), abs=1e-9)
    torch.testing.assert_close(hidden.grad, h2.grad, atol=1e-9, rtol=1e-9)
    assert 0.0 < metrics["sampling/masked_mean"][0] <= n  # some sample's weight was truncated


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_type="ppo"), "loss_type must be one of"),
    (dict(importance_sampling_level="group"), "importance_sampling_level must be one of"),
    (dict(is_mode="mask"), "is_mode must be one of"),
    (dict(loss_type="cispo", score_centering=False), "epsilon_high"),
    (dict(loss_type="cispo", epsilon_high=5.0), "score_centering=True"),
    (dict(importance_sampling_level="sequence"), "score_centering=True"),
    (dict(is_mode="sequence_mask"), "score_centering=True"),
    (dict(max_completion_length=0), "max_completion_length"),
])
def test_loss_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)
