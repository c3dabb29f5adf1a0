"""Same numbers as TRL where we use TRL's names (issue #35), loss and gradient in float64.

`_trl_loss` is TRL 1.16's ``GRPOTrainer`` objective written from its formulas, in TRL's padded layout: rows of
completions ``[B, T]`` with a completion mask, the vLLM importance-sampling ratio computed from the old policy's
and the sampler's log-probs (per token, or one per row for the ``sequence_*`` modes: ``exp Σ_t``), masked to 0
outside ``[C_min, C_max]`` or clamped into it (a ``None`` bound is no bound), the trust-region ratio
``coef_1 = π_θ/π_old`` (per token, or GSPO's ``exp(mean_t log)`` per row), the clipped surrogate (``cispo``: the
stop-gradient capped ratio times the log-prob), multiplied by the IS ratio, then normalised per ``loss_type``:
``grpo`` the mean over rows of each row's masked token mean (an empty row counts, with mean 0), ``bnpo`` the masked
token mean, ``dr_grpo`` the masked sum over ``B × max_completion_length``, ``dapo`` / ``cispo`` the masked sum
over the batch's tokens. It shares no code with ``asyncgrpo_cli.train.loss``.

Ours sees only the trained tokens, flattened with their sample index, and normalises with ``S`` = every row of
the batch (a cut completion travels as an untrained stub and is counted, `micro_batch_sequences`). Two readings
of TRL's old policy are checked, because we have one ratio (trainer over sampler) where TRL has two:

- the old policy is the current one (TRL's on-policy step): TRL's trust region never clips (``coef_1 = 1``), every
  importance-sampling mode is TRL's, so ours runs with a trust region that clips nothing here;
- the old policy is the sampler: TRL's importance-sampling ratio is 1 (no mode can matter) and its trust region is
  ours, clipping included (every loss type, GSPO, asymmetric ε).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo_cli.train.loss import LossConfig, normalised_loss, token_terms

F64 = torch.float64
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")
MAX_LEN = 8


def _trl_loss(logps, old, sampling, mask, adv, *, loss_type, level="token", mode="token_mask", cmin=None,
              cmax=None, eps_low=0.2, eps_high=0.2, max_completion_length=MAX_LEN):
    """TRL's loss of one batch (module docstring). ``logps`` ``[B, T]`` differentiable; ``old``, ``sampling``
    ``[B, T]`` constants; ``mask`` ``[B, T]`` 0/1; ``adv`` ``[B]``."""
    m = mask.to(F64)
    diff = (old - sampling) * m
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)
    is_ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        is_ratio = torch.clamp(is_ratio, min=cmin, max=cmax)
    else:
        low = -math.inf if cmin is None else cmin
        high = math.inf if cmax is None else cmax
        is_ratio = torch.where((is_ratio < low) | (is_ratio > high), torch.zeros_like(is_ratio), is_ratio)
    log_w = logps - old
    if level == "sequence":
        log_w = ((log_w * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).unsqueeze(1)
    coef = torch.exp(log_w)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef, max=eps_high).detach() * a * logps
    else:
        per_token = -torch.min(coef * a, torch.clamp(coef, 1 - eps_low, 1 + eps_high) * a)
    per_token = per_token * is_ratio
    masked = per_token * m
    if loss_type == "grpo":
        return (masked.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    return masked.sum() / m.sum().clamp(min=1.0)  # dapo, cispo: one process, one micro-batch per generation


def _ours(logps, sampling, mask, adv, cfg):
    """Our loss of the same batch: trained tokens only, every row counted in S."""
    keep = mask.bool()
    rows = torch.arange(mask.shape[0]).unsqueeze(1).expand_as(mask)
    terms = token_terms(logps[keep], adv.unsqueeze(1).expand_as(mask)[keep], sampling[keep], cfg,
                        sample_index=rows[keep])
    return normalised_loss(terms.losses, rows[keep], cfg, global_num_trained_tokens=float(keep.sum()),
                           num_processes=1, global_num_samples=mask.shape[0])


def _batch(seed=0, cut_row=False):
    """Four completions of lengths 6, 3, 5, 2 in an ``[4, 6]`` batch (optionally a fifth row cut: empty mask)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 6
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate([6, 3, 5, 2, 0]):  # the fifth: mask_truncated_completions, TRL's row with an empty mask
        mask[i, :n] = 1
    logps = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.1
    sampling = logps + (torch.rand(B, T, generator=g, dtype=F64) - 0.5) * 1.2  # token ratios in ~[0.55, 1.8]
    sampling[0, 1] = logps[0, 1] - 1.6  # r ≈ 5: outside C_max = 3
    sampling[2, 4] = logps[2, 4] + 1.0  # r ≈ 0.37: below C_min = 0.5
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9], dtype=F64)
    n = B if cut_row else B - 1
    return logps[:n], sampling[:n], mask[:n], adv[:n]


def _compare(trl_fn, ours_fn, seed=0, cut_row=False):
    logps, sampling, mask, adv = _batch(seed, cut_row)
    a, b = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    theirs, ours = trl_fn(a, sampling, mask, adv), ours_fn(b, sampling, mask, adv)
    theirs.backward()
    ours.backward()
    assert ours.dtype == F64
    theirs, ours = theirs.detach(), ours.detach()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(b.grad * mask, a.grad * mask, rtol=1e-12, atol=1e-14)
    return float(theirs)


BOUNDS = {"trl_default": (None, 3.0), "two_sided": (0.5, 3.0), "lower_only": (0.5, None)}
MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")


@pytest.mark.parametrize("bounds", list(BOUNDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_importance_sampling_modes_match_trl_on_policy(loss_type, mode, bounds):
    """Old policy = the current one: TRL weighs token t by its IS ratio (the sequence modes: ρ_i 1[ρ_i in bounds]
    or clamp(ρ_i) on every token of row i); our trust region is opened wide so that it clips nothing either."""
    cmin, cmax = BOUNDS[bounds]
    cfg = LossConfig(score_centering=False, loss_type=loss_type, is_mode=mode, clip_min=cmin, clip_max=cmax,
                     epsilon=0.999, epsilon_high=1e6, max_completion_length=MAX_LEN)

    def trl(logps, sampling, mask, adv):
        return _trl_loss(logps, logps.detach(), sampling, mask, adv, loss_type=loss_type, mode=mode, cmin=cmin,
                         cmax=cmax, eps_low=0.2, eps_high=1e6 if loss_type == "cispo" else 0.28)

    value = _compare(trl, lambda lp, mu, m, a: _ours(lp, mu, m, a, cfg))
    assert value != 0.0


@pytest.mark.parametrize("mode", ("sequence_mask", "sequence_truncate"))
@pytest.mark.parametrize("loss_type", ("grpo", "dapo"))
def test_gspo_with_sequence_modes_matches_trl_on_policy(loss_type, mode):
    cfg = LossConfig(score_centering=False, loss_type=loss_type, is_mode=mode, importance_sampling_level="sequence",
                     clip_min=None, clip_max=3.0, epsilon=0.999, epsilon_high=1e6, max_completion_length=MAX_LEN)

    def trl(logps, sampling, mask, adv):
        return _trl_loss(logps, logps.detach(), sampling, mask, adv, loss_type=loss_type, level="sequence",
                         mode=mode, cmin=None, cmax=3.0)

    _compare(trl, lambda lp, mu, m, a: _ours(lp, mu, m, a, cfg), seed=3)


@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types_and_trust_region_match_trl_with_the_sampler_as_old_policy(loss_type, level):
    """Old policy = the sampler: TRL's IS ratio is 1 and its trust region (asymmetric ε, GSPO's sequence ratio)
    is ours; no bound is set so that our token_mask leaves every token in."""
    eps_high = 2.0 if loss_type == "cispo" else 0.28
    cfg = LossConfig(score_centering=False, loss_type=loss_type, importance_sampling_level=level, clip_min=None,
                     clip_max=None, epsilon=0.2, epsilon_high=eps_high, max_completion_length=MAX_LEN)

    def trl(logps, sampling, mask, adv):
        return _trl_loss(logps, sampling, sampling, mask, adv, loss_type=loss_type, level=level, eps_low=0.2,
                         eps_high=eps_high)

    _compare(trl, lambda lp, mu, m, a: _ours(lp, mu, m, a, cfg), seed=1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ("grpo", "dr_grpo"))
def test_cut_completions_count_as_rows(loss_type, mode):
    """mask_truncated_completions: TRL keeps a cut completion as a row with an empty mask, so it counts in grpo's
    number of sequences and in dr_grpo's B × max_completion_length; so does ours (S counts the stub)."""
    cfg = LossConfig(score_centering=False, loss_type=loss_type, is_mode=mode, clip_min=0.5, clip_max=3.0,
                     epsilon=0.999, epsilon_high=1e6, max_completion_length=MAX_LEN)

    def trl(logps, sampling, mask, adv):
        return _trl_loss(logps, logps.detach(), sampling, mask, adv, loss_type=loss_type, mode=mode, cmin=0.5,
                         cmax=3.0)

    with_cut = _compare(trl, lambda lp, mu, m, a: _ours(lp, mu, m, a, cfg), cut_row=True)
    without = _compare(trl, lambda lp, mu, m, a: _ours(lp, mu, m, a, cfg), cut_row=False)
    assert with_cut == pytest.approx(without * 4 / 5, rel=1e-12)  # one more row in the denominator, nothing else


def test_every_row_cut_gives_zero_loss_and_gradient():
    logps, sampling, mask, adv = _batch(cut_row=True)
    mask.zero_()
    for loss_type in LOSS_TYPES:
        cfg = LossConfig(score_centering=False, loss_type=loss_type, epsilon_high=5.0, max_completion_length=MAX_LEN)
        lp = logps.clone().requires_grad_()
        trl = _trl_loss(lp, lp.detach(), sampling, mask, adv, loss_type=loss_type, cmin=0.5, cmax=5.0, eps_high=5.0)
        assert float(trl) == 0.0
        lp = logps.clone().requires_grad_()
        ours = _ours(lp, sampling, mask, adv, cfg)
        ours.backward()
        assert float(ours) == 0.0 and (lp.grad is None or not lp.grad.any())


# ------------------------------------------------------------------------------------------- through the model
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_parity"))


@pytest.mark.parametrize("loss_type", ("grpo", "dr_grpo"))
def test_packed_row_with_cut_stubs_matches_trl(model_dir, loss_type):
    """The path a step takes: the worker turns cut completions into untrained stubs (`untrained_stub`), the
    trainer packs them with the others and counts them (`micro_batch_sequences`); the loss and every gradient
    equal TRL's on the same model, where the cut completions are rows with an empty mask."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.rollout.sequences import untrained_stub
    from asyncgrpo_cli.rollout.types import TrainingSequence
    from asyncgrpo_cli.train.packed_loss import install_loss_head, micro_batch_sequences, row_loss
    from asyncgrpo_cli.train.packing import pack_row
    from asyncgrpo_cli.train.tree_attention import apply_tree_attention

    torch.manual_seed(0)
    prompt = [5, 9, 17, 33, 2]
    completions = [[40, 41, 42, 43], [50, 51], [60, 61, 62, 63], [70, 71, 72]]
    cut = [False, True, False, True]
    adv = [1.0, -0.5, 0.7, -1.2]
    g = torch.Generator().manual_seed(1)
    mu = [(-torch.rand(len(c), generator=g) * 2 - 0.5).tolist() for c in completions]
    samples = []
    for c, a, m, is_cut in zip(completions, adv, mu, cut):
        s = TrainingSequence(input_ids=prompt + c, trained_mask=[0] * len(prompt) + [1] * len(c),
                             sampler_logprobs=[0.0] * len(prompt) + m, advantage=a, group_id=0, row_index=0,
                             model_version=0)
        samples.append(untrained_stub(s) if is_cut else s)
    assert [s.num_trained_tokens for s in samples] == [4, 0, 4, 0]
    cfg = LossConfig(score_centering=False, loss_type=loss_type, clip_min=None, clip_max=3.0, temperature=0.9,
                     max_completion_length=MAX_LEN)
    packed = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_tree_attention(packed, "sdpa")
    install_loss_head(packed)
    row = pack_row(samples)
    assert row.num_tokens == pack_row([s for s in samples if s.num_trained_tokens]).num_tokens  # stubs: shared
    S = micro_batch_sequences([samples])
    assert S == 4
    ours, _ = row_loss(packed, row, cfg, global_trained_tokens=8, num_processes=1, global_samples=S)
    ours.backward()

    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    T = max(len(c) for c in completions)
    logps = torch.zeros(len(completions), T)
    sampling = torch.zeros(len(completions), T)
    mask = torch.zeros(len(completions), T, dtype=torch.long)
    for i, c in enumerate(completions):
        logits = ref(input_ids=torch.tensor([prompt + c])).logits[0, len(prompt) - 1:-1] / 0.9
        logps[i, :len(c)] = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(c).unsqueeze(1)).squeeze(1)
        sampling[i, :len(c)] = torch.tensor(mu[i])
        mask[i, :len(c)] = 0 if cut[i] else 1
    theirs = _trl_loss(logps, logps.detach(), sampling, mask, torch.tensor(adv), loss_type=loss_type,
                       cmin=None, cmax=3.0)
    theirs.backward()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)
    for (name, p), (_, q) in zip(packed.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_row_of_stubs_only_trains_nothing(model_dir):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.rollout.sequences import untrained_stub
    from asyncgrpo_cli.rollout.types import TrainingSequence
    from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
    from asyncgrpo_cli.train.packing import pack_row
    from asyncgrpo_cli.train.tree_attention import apply_tree_attention

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_tree_attention(model, "sdpa")
    install_loss_head(model)
    stubs = [untrained_stub(TrainingSequence(input_ids=[5, 9, 40 + i, 41], trained_mask=[0, 0, 1, 1],
                                             sampler_logprobs=[0.0, 0.0, -1.0, -1.0], advantage=1.0, group_id=0,
                                             row_index=0, model_version=0)) for i in range(3)]
    for loss_type in LOSS_TYPES:
        cfg = LossConfig(score_centering=False, loss_type=loss_type, epsilon_high=5.0)
        loss, _ = row_loss(model, pack_row(stubs), cfg, global_trained_tokens=0, num_processes=1, global_samples=3)
        loss.backward()
        assert float(loss) == 0.0
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        model.zero_grad(set_to_none=True)
