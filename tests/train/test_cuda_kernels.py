"""CUDA-only checks of the trainer's GPU paths (skipped without CUDA; run on the lent H200 with
``python -m pytest tests/train/test_cuda_kernels.py``): the bf16 log-prob kernel (fp32-accumulating gradient
GEMMs, eager and compiled tiles) against the float64 reference, and regionally compiled layers with flex tree
attention against eager ones."""

from __future__ import annotations

import pytest
import torch

from test_compile import groups, rows_of, step
from test_loss import make_batch, ref_logq, run_impl, run_ref

from asyncgrpo_cli.train.compile import compile_decoder_layers
from asyncgrpo_cli.train.loss import LossConfig
from asyncgrpo_cli.train.packed_loss import install_loss_head
from asyncgrpo_cli.train.tree_attention import apply_tree_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_bf16_kernel_on_cuda_matches_float64_reference(backend):
    """bf16 operands, fp32 accumulation: within bf16 rounding of the float64 reference on the same (bf16-rounded)
    inputs. Sampler log-probs equal the reference policy's, so no ratio sits near a clip bound and bf16 noise
    cannot flip a token's mask."""
    batch = make_batch(seed=21, n=300, h=64, v=1000, k=8, m=6, temperature=0.7)
    for name in ("hidden", "weight", "bias"):
        setattr(batch, name, getattr(batch, name).to(torch.bfloat16).double())
    logq = ref_logq(batch.hidden, batch.weight, batch.bias, 0.7, batch.cand)
    batch.slp = logq.gather(1, batch.targets[:, None])[:, 0].float()
    for name in ("hidden", "weight", "bias", "targets", "cand", "top_ids", "top_lp", "slp", "adv", "sample_index"):
        setattr(batch, name, getattr(batch, name).cuda())
    cfg = LossConfig(temperature=0.7, token_chunk_size=128, vocab_chunk_size=256, compile_backend=backend)
    loss, _, gh, gw, gb = run_impl(batch, cfg, dtype=torch.bfloat16)
    rloss, _, rgh, rgw, rgb = run_ref(batch, cfg)
    assert abs(float(rloss)) > 1e-3
    assert float(loss) == pytest.approx(float(rloss), abs=4e-3)  # a sum of signed terms near 0: absolute
    for got, want in ((gh, rgh), (gw, rgw), (gb, rgb)):
        err = float((got.double() - want).norm() / want.norm())
        assert err < 3e-2, err


def test_compiled_layers_with_flex_match_eager_on_cuda():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.float32).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert apply_tree_attention(model, "flex") == "flex"
    install_loss_head(model)
    rows = rows_of(groups(1, 150, [40, 90, 7])) + rows_of(groups(2, 201, [33, 5, 120, 64]))
    want = step(model, rows)
    compile_decoder_layers(model)
    got = step(model, rows)
    for (loss_w, grads_w), (loss_g, grads_g) in zip(want, got):
        assert loss_g == pytest.approx(loss_w, rel=1e-4, abs=1e-6)
        for name, grad in grads_w.items():
            torch.testing.assert_close(grads_g[name], grad, rtol=1e-3, atol=1e-5, msg=name)
