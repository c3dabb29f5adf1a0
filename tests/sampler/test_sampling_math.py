"""Sampling math of the embedded sampler against hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo_cli.sampler.embedded.sampling import (
    LOGPROB_FLOOR,
    apply_repetition_penalty,
    candidate_set,
    finite_logprob,
    process_logits,
    sample_tokens,
    top_logprobs,
)

LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def run(logits=LOGITS, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    b = logits.shape[0]
    return process_logits(
        logits,
        torch.full((b,), temperature),
        torch.full((b,), top_k),
        torch.full((b,), top_p),
        torch.full((b,), min_p),
    )


def probs_of(lp):
    return torch.exp(lp)[0].tolist()


def test_no_filter_is_softmax():
    assert probs_of(run()) == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05], abs=1e-6)


def test_temperature_divides_logits():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert probs_of(run(temperature=0.5)) == pytest.approx((p / p.sum()).tolist(), abs=1e-6)


def test_greedy_rows_use_temperature_one():
    assert probs_of(run(temperature=0.0)) == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05], abs=1e-6)


def test_top_k_renormalises_over_kept_set():
    lp = run(top_k=2)
    assert probs_of(lp)[:2] == pytest.approx([0.5 / 0.7, 0.2 / 0.7], abs=1e-6)
    assert torch.isinf(lp[0, 2:]).all()
    assert candidate_set(lp[0]) == [0, 1]


def test_top_p_keeps_smallest_prefix_reaching_p():
    # cumulative 0.5, 0.7, 0.85: top_p=0.8 needs the first three tokens
    lp = run(top_p=0.8)
    assert candidate_set(lp[0]) == [0, 1, 2]
    assert probs_of(lp)[:3] == pytest.approx([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85], abs=1e-6)
    assert candidate_set(run(top_p=0.4)[0]) == [0]


def test_top_p_applies_after_top_k():
    # after top_k=3 the mass is 0.5/0.85, 0.2/0.85 ...; top_p=0.8 then needs {0, 1}: 0.588 + 0.235 >= 0.8
    assert candidate_set(run(top_k=3, top_p=0.8)[0]) == [0, 1]


def test_min_p_relative_to_max():
    # threshold 0.3 * 0.5 = 0.15 keeps tokens with p >= 0.15
    assert candidate_set(run(min_p=0.3)[0]) == [0, 1, 2]


def test_rows_are_independent():
    logits = LOGITS.repeat(2, 1)
    lp = process_logits(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 2]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert candidate_set(lp[0]) == [0, 1, 2, 3, 4]
    assert candidate_set(lp[1]) == [0, 1]


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    out = apply_repetition_penalty(logits, [torch.tensor([0, 1, 1])], [2.0])
    assert out[0].tolist() == [1.0, -2.0, 3.0, 0.5]
    assert logits[0, 0] == 2.0  # input untouched


def test_sampling_follows_the_distribution_and_the_seed():
    lp = run(top_k=3).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    draws = sample_tokens(lp, [False] * 4000, [gen] * 4000)
    freq = torch.bincount(draws, minlength=5).float() / 4000
    assert freq[:3].tolist() == pytest.approx([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85], abs=0.03)
    assert freq[3:].sum() == 0
    a = sample_tokens(lp[:50], [False] * 50, [torch.Generator().manual_seed(9)] * 50)
    b = sample_tokens(lp[:50], [False] * 50, [torch.Generator().manual_seed(9)] * 50)
    assert torch.equal(a, b)
    assert sample_tokens(lp[:1], [True], [None]).item() == 0


def test_top_logprobs_and_floor():
    lp = run(top_k=2)
    values, ids = top_logprobs(lp, 3)
    assert ids[0, :2].tolist() == [0, 1]
    assert math.isinf(values[0, 2].item())
    assert finite_logprob(values[0, 2].item()) == LOGPROB_FLOOR
    assert finite_logprob(float("nan")) == LOGPROB_FLOOR
    assert finite_logprob(-1.5) == -1.5
