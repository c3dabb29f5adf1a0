"""The loss computed inside the packed forward equals the loss of each sample forwarded alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.train.loss import LossConfig, loss_and_metrics
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _sample(ids, n_prompt, adv, group, rng, k=3):
    n = len(ids)
    trained = [0] * n_prompt + [1] * (n - n_prompt)
    lp = [(-float(rng.random()) - 0.5) if t else 0.0 for t in trained]
    top_ids = [[int(x) for x in rng.choice(300, size=k, replace=False)] if t else [] for t in trained]
    top_lp = [sorted((-float(rng.random()) * 3 for _ in range(k)), reverse=True) if t else [] for t in trained]
    return TrainingSequence(input_ids=ids, trained_mask=trained, sampler_logprobs=lp, advantage=adv, group_id=group,
                            row_index=0, model_version=0, sampler_top_ids=top_ids, sampler_top_logprobs=top_lp)


@pytest.mark.parametrize("score_centering", [True, False])
def test_row_loss_matches_unpacked(model_dir, score_centering):
    import numpy as np

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    prompt = [5, 9, 17, 33, 2]
    samples = [_sample(prompt + [40, 41, 42], 5, 1.0, 0, rng), _sample(prompt + [50, 51], 5, -0.5, 0, rng),
               _sample([7, 8, 60, 61, 62, 63], 2, 0.3, 1, rng)]
    cfg = LossConfig(score_centering=score_centering, temperature=0.9)
    packed = AutoModelForCausalLM.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_tree_attention(packed, "sdpa")
    install_loss_head(packed)
    row = pack_row(samples)
    assert row.num_tokens < sum(len(s.input_ids) for s in samples)  # the prompt is shared
    n_trained = sum(s.num_trained_tokens for s in samples)
    loss, metrics = row_loss(packed, row, cfg, global_trained_tokens=n_trained, num_processes=1)
    loss.backward()

    total = 0.0
    for i, s in enumerate(samples):
        out = ref.model(input_ids=torch.tensor([s.input_ids]))
        hidden = out.last_hidden_state[0]
        idx = [t - 1 for t in range(len(s.input_ids)) if s.trained_mask[t]]
        tgt = torch.tensor([s.input_ids[t] for t in range(len(s.input_ids)) if s.trained_mask[t]])
        top = torch.tensor([s.sampler_top_ids[t] for t in range(len(s.input_ids)) if s.trained_mask[t]])
        top_lp = torch.tensor([s.sampler_top_logprobs[t] for t in range(len(s.input_ids)) if s.trained_mask[t]])
        lp = torch.tensor([s.sampler_logprobs[t] for t in range(len(s.input_ids)) if s.trained_mask[t]])
        part, _ = loss_and_metrics(hidden[idx], ref.lm_head.weight, tgt, torch.full((len(idx),), s.advantage),
                                   lp, torch.full((len(idx),), i), global_num_trained_tokens=n_trained, config=cfg,
                                   sampler_top_ids=top if score_centering else None,
                                   sampler_top_logprobs=top_lp if score_centering else None)
        total = total + part
    total.backward()
    assert torch.allclose(loss, total, atol=1e-5), (loss, total)
    for (name, p), (_, q) in zip(packed.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert "entropy" in metrics


def test_empty_row_reaches_every_parameter(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_tree_attention(model, "sdpa")
    install_loss_head(model)
    loss, _ = row_loss(model, pack_row([]), LossConfig(), global_trained_tokens=4, num_processes=2)
    loss.backward()
    assert float(loss) == 0.0
    assert all(p.grad is not None for p in model.parameters())


def test_head_outside_a_request_is_a_plain_linear(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    install_loss_head(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits)
