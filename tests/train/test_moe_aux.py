"""MoE load-balancing aux loss on tree-packed rows (SPEC §3.3.5): packed = unpacked, logged as aux_loss."""

from __future__ import annotations

import random

import pytest
import torch

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train.loss import LossConfig
from asyncgrpo_cli.train.moe_aux import MoeAuxLoss, moe_aux_settings, token_multiplicity
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention, forward_packed

transformers = pytest.importorskip("transformers")
COEF = 0.5


def seq(ids, trained_from=1, group=0):
    mask = [1 if k >= trained_from else 0 for k in range(len(ids))]
    return TrainingSequence(list(ids), mask, [0.1 * (k % 3) for k in range(len(ids))], 1.0, group, 0, 0)


def _moe(kind="qwen3_moe"):
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(vocab_size=89, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                num_experts=6, num_experts_per_tok=2, router_aux_loss_coef=0.01)
        model = Qwen3MoeForCausalLM(config)
    elif kind == "qwen3_5_moe":  # the Qwen3.5-MoE / Qwen3.6 text stack: Gated DeltaNet hybrid with MoE
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        config = Qwen3_5MoeTextConfig(vocab_size=89, hidden_size=32, num_hidden_layers=2,
                                      layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16)
        model = Qwen3_5MoeForCausalLM(config)
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=8, linear_value_head_dim=8, num_experts=6,
                                 num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.float()


def _samples(vocab):
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(8)]
    out = [seq(prompt + [rng.randrange(vocab) for _ in range(rng.randint(2, 6))], trained_from=8) for _ in range(3)]
    out.append(seq(out[0].input_ids))  # identical
    out.append(seq(prompt[:4], trained_from=2))  # prefix of another
    out.append(seq(prompt + out[1].input_ids[8:10] + [1, 2], trained_from=8))  # nested fork
    out.append(seq([rng.randrange(vocab) for _ in range(7)], trained_from=3, group=1))  # unrelated
    return out


def _unpacked(model, samples):
    """Sum of per-sample trained log-probs, plus the library aux loss of the right-padded batch (real tokens)."""
    lps = []
    for s in samples:
        lp = torch.log_softmax(model(input_ids=torch.tensor([s.input_ids])).logits[0].float(), -1)
        lps.extend(lp[k - 1, s.input_ids[k]] for k in range(1, len(s.input_ids)) if s.trained_mask[k])
    width = max(len(s.input_ids) for s in samples)
    ids = torch.tensor([s.input_ids + [0] * (width - len(s.input_ids)) for s in samples])
    mask = torch.tensor([[1] * len(s.input_ids) + [0] * (width - len(s.input_ids)) for s in samples])
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    return torch.stack(lps), out.aux_loss


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_packed_aux_loss_and_gradients_equal_unpacked(kind):
    ref = _moe(kind)
    samples = _samples(ref.config.vocab_size)
    lps, aux = _unpacked(ref, samples)
    (lps.sum() + COEF * aux).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    model = _moe(kind)
    apply_tree_attention(model, "sdpa")
    aux_loss = MoeAuxLoss.for_model(model, COEF)
    row = pack_row(samples)
    assert row.packing_ratio > 1.2
    with aux_loss.recorder.recording() as logits:
        hidden = forward_packed(model, row, output_router_logits=False)
    packed_aux = aux_loss.of_row(row, logits)
    got = torch.log_softmax((hidden[row.predict_index] @ model.lm_head.weight.T).float(), -1)
    got = got.gather(1, row.target_ids[:, None])[:, 0]
    (got.sum() + COEF * packed_aux).backward()
    torch.testing.assert_close(got, lps, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_aux, aux.float(), atol=1e-6, rtol=1e-5)
    have = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert have.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-5, rtol=1e-3, msg=lambda m: name + m)


def test_row_loss_adds_the_aux_loss_and_logs_it():
    """The trainer's path: no crash on the placeholder mask, loss += coef × aux, aux_loss metric unscaled."""
    model = _moe()
    model.config.output_router_logits = True  # as a user's config may say: must not reach the library's aux code
    apply_tree_attention(model, "sdpa")
    install_loss_head(model)
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    config = LossConfig()
    base, m0 = row_loss(model, row, config, row.num_trained_tokens)
    assert "aux_loss" not in m0
    aux = MoeAuxLoss.for_model(model, None)  # default: the config's coefficient
    assert aux.coef == pytest.approx(0.01)
    with_aux, metrics = row_loss(model, row, config, row.num_trained_tokens, moe_aux=aux)
    value, count = metrics["aux_loss"]
    assert count == 1.0 and value > 0.5  # ~1 for a balanced router
    torch.testing.assert_close(with_aux, base + 0.01 * value, atol=1e-6, rtol=0)
    _, ref_aux = _unpacked(model, samples)
    assert value == pytest.approx(float(ref_aux.detach()), rel=1e-5)
    # an empty row (an idle rank) contributes a zero aux loss that still reaches the graph
    loss, metrics = row_loss(model, pack_row([]), config, 0, moe_aux=aux)
    assert metrics["aux_loss"] == (0.0, 1.0) and loss.requires_grad


def test_aux_settings():
    model = _moe()
    assert moe_aux_settings(model, None) == (0.01, 6, 2)
    assert moe_aux_settings(model, 0.0) is None
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=20, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert moe_aux_settings(dense, None) is None
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1: the model is not mixture-of-experts"):
        moe_aux_settings(dense, 0.1)


def test_token_multiplicity():
    row = pack_row([seq([1, 2, 3, 4]), seq([1, 2, 3, 4]), seq([1, 2, 5]), seq([1, 2]), seq([9, 8])])
    mult = dict()
    for i, (tok, m) in enumerate(zip(row.input_ids.tolist(), token_multiplicity(row).tolist())):
        mult.setdefault((tok, row.position_ids[i].item()), []).append(m)
    assert sum(token_multiplicity(row).tolist()) == row.sample_tokens
    assert mult[(9, 0)] == [1.0] and mult[(4, 3)] == [2.0]
