"""KL to the reference policy (``beta``, issue #27): the k3 penalty in float64, and the reference's log-probs
computed in the tree-packed layout equal those of each sample forwarded alone (frozen copy for full
fine-tuning, adapters disabled for LoRA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.train.loss import LossConfig, k3_kl, loss_and_metrics
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.reference import Reference, reference_weight_bytes
from asyncgrpo_cli.train.tree_attention import apply_tree_attention

F64 = torch.float64


def test_k3_hand_computed():
    ref = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    lp = torch.tensor([-1.0, -1.0, -1.5], dtype=F64, requires_grad=True)
    kl = k3_kl(ref, lp)
    d = [0.0, -1.0, 1.0]
    assert kl.tolist() == pytest.approx([np.exp(x) - x - 1 for x in d], abs=1e-15)
    kl.sum().backward()
    assert lp.grad.tolist() == pytest.approx([1 - np.exp(x) for x in d], abs=1e-15)  # d/dlp = 1 − e^d


@pytest.mark.parametrize("score_centering", [True, False])
def test_beta_adds_k3_to_the_loss_float64(score_centering):
    torch.manual_seed(0)
    n, h, v, k = 7, 5, 11, 3
    hidden = torch.randn(n, h, dtype=F64, requires_grad=True)
    weight = torch.randn(v, h, dtype=F64)
    target = torch.randint(0, v, (n,))
    adv, mu = torch.randn(n, dtype=F64), -torch.rand(n, dtype=F64) - 1.0
    ref = -torch.rand(n, dtype=F64) * 3
    top = torch.stack([torch.randperm(v)[:k] for _ in range(n)])
    top_lp = -torch.rand(n, k, dtype=F64) * 3
    kw = dict(global_num_trained_tokens=12, num_processes=2, sampler_top_ids=top, sampler_top_logprobs=top_lp)
    beta = 0.3
    cfg = LossConfig(score_centering=score_centering, beta=beta)
    loss, metrics = loss_and_metrics(hidden, weight, target, adv, mu, torch.arange(n), config=cfg,
                                     ref_logprobs=ref, **kw)
    loss.backward()
    h2 = hidden.detach().clone().requires_grad_()
    base, _ = loss_and_metrics(h2, weight, target, adv, mu, torch.arange(n),
                               config=LossConfig(score_centering=score_centering), **kw)
    lp = torch.log_softmax(h2 @ weight.T, -1).gather(1, target[:, None])[:, 0]
    expected = base + beta * sum(torch.exp(ref[t] - lp[t]) - (ref[t] - lp[t]) - 1 for t in range(n)) * 2 / 12
    expected.backward()
    assert abs(float(loss) - float(expected)) < 1e-9
    torch.testing.assert_close(hidden.grad, h2.grad, atol=1e-9, rtol=1e-9)
    kl_mean = float(sum(torch.exp(ref[t] - lp[t]) - (ref[t] - lp[t]) - 1 for t in range(n))) / n
    assert metrics["kl"][0] / metrics["kl"][1] == pytest.approx(kl_mean, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_and_metrics(hidden, weight, target, adv, mu, torch.arange(n), config=cfg, **kw)


def test_beta_validation():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beta"):
            LossConfig(beta=bad)
    assert "kl" not in loss_and_metrics(torch.zeros(0, 4, requires_grad=True), torch.zeros(6, 4),
                                        torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0),
                                        torch.zeros(0, dtype=torch.long), global_num_trained_tokens=0,
                                        config=LossConfig(score_centering=False))[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _samples():
    rng = np.random.default_rng(0)

    def one(ids, n_prompt, adv, group):
        trained = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        lp = [(-float(rng.random()) - 0.5) if t else 0.0 for t in trained]
        return TrainingSequence(input_ids=ids, trained_mask=trained, sampler_logprobs=lp, advantage=adv,
                                group_id=group, row_index=0, model_version=0)

    prompt = [5, 9, 17, 33, 2]
    return [one(prompt + [40, 41, 42], 5, 1.0, 0), one(prompt + [50, 51], 5, -0.5, 0), one([7, 8, 60, 61, 62], 2, 0.3, 1)]


def _unpacked_kl(policy, reference, samples, temperature):
    """Mean k3 over the trained tokens, each sample forwarded alone (no packing)."""
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.input_ids])
        with torch.no_grad():
            lp = torch.log_softmax(policy(input_ids=ids).logits[0].double() / temperature, -1)
            rl = torch.log_softmax(reference(input_ids=ids).logits[0].double() / temperature, -1)
        for t in range(1, len(s.input_ids)):
            if s.trained_mask[t]:
                d = float(rl[t - 1, s.input_ids[t]] - lp[t - 1, s.input_ids[t]])
                total += np.exp(d) - d - 1
                count += 1
    return total / count


def _perturb(model, scale=0.05):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


def test_full_finetune_reference_is_a_frozen_copy_exact_vs_unpacked(model_dir):
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_tree_attention(policy, "sdpa")
    install_loss_head(policy)
    reference = Reference.for_policy(policy, beta=0.1)
    assert reference.frozen is not None and not any(p.requires_grad for p in reference.frozen.parameters())
    assert reference_weight_bytes(policy) == sum(p.numel() * 4 for p in policy.parameters())
    assert Reference.for_policy(policy, beta=0.0) is None  # beta 0: nothing copied
    _perturb(policy)  # training moves the policy; the reference stays the initial weights
    samples = _samples()
    cfg = LossConfig(score_centering=False, beta=0.1, temperature=0.9)
    row = pack_row(samples)
    assert row.num_tokens < sum(len(s.input_ids) for s in samples)  # the prompt is shared
    n = sum(s.num_trained_tokens for s in samples)
    loss, metrics = row_loss(policy, row, cfg, n, reference=reference)
    base, _ = row_loss(policy, row, LossConfig(score_centering=False, temperature=0.9), n)
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    _perturb(plain)
    expected = _unpacked_kl(plain, initial, samples, 0.9)
    kl = metrics["kl"][0] / metrics["kl"][1]
    assert kl > 1e-4 and kl == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert float(loss - base) == pytest.approx(0.1 * kl, rel=1e-4)
    loss.backward()
    assert all(p.grad is None for p in reference.frozen.parameters())
    with pytest.raises(ValueError, match="reference"):
        row_loss(policy, row, cfg, n)


def test_lora_reference_is_the_base_with_adapters_disabled(model_dir):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    apply_tree_attention(policy, "sdpa")
    install_loss_head(policy)
    reference = Reference.for_policy(policy, beta=0.2)
    assert reference.frozen is None and reference_weight_bytes(policy) == 0  # no second copy
    samples = _samples()
    cfg = LossConfig(score_centering=False, beta=0.2)
    row = pack_row(samples)
    _, metrics = row_loss(policy, row, cfg, sum(s.num_trained_tokens for s in samples), reference=reference)
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        lora_logits = {id(s): policy(input_ids=torch.tensor([s.input_ids])).logits for s in samples}
    assert all(torch.isfinite(x).all() for x in lora_logits.values())

    class _Lora(torch.nn.Module):  # the LoRA policy forwarded alone (its own lm_head forward outside a request)
        def forward(self, input_ids):
            return policy(input_ids=input_ids)

    expected = _unpacked_kl(_Lora(), initial, samples, 1.0)
    kl = metrics["kl"][0] / metrics["kl"][1]
    assert kl > 1e-4 and kl == pytest.approx(expected, rel=1e-4, abs=1e-7)
    from peft.tuners.lora import LoraLayer

    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m.disable_adapters for m in layers)  # the adapters are back on after the reference
