"""Gated DeltaNet hybrids in tree packing: packed = one-sample-at-a-time log-probs and gradients (SPEC §6.5)."""

from __future__ import annotations

import random

import pytest
import torch

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train import gated_deltanet as gdn
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention, forward_packed

transformers = pytest.importorskip("transformers")


def seq(ids, trained_from=1, group=0):
    mask = [1 if k >= trained_from else 0 for k in range(len(ids))]
    return TrainingSequence(list(ids), mask, [0.0] * len(ids), 1.0, group, 0, 0)


def _qwen35(layers=("linear_attention", "linear_attention", "full_attention", "linear_attention")):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layers), layer_types=list(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).float()


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        decoder_sparse_step=1, mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).float()


def _sharpen(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for m in gdn.gated_deltanet_layers(model):  # slower decay, so the recurrent state matters
            m.A_log.fill_(-2.0)
    return model


def _samples(vocab: int) -> list[TrainingSequence]:
    """Nested forks, identical samples, a prefix of another, a deep branch, unrelated samples, one > 64 tokens."""
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(9)]
    out = [seq(prompt + [rng.randrange(vocab) for _ in range(rng.randint(2, 7))], trained_from=9) for _ in range(4)]
    out.append(seq(out[0].input_ids))  # identical
    out.append(seq(prompt[:5], trained_from=2))  # prefix of the others
    out.append(seq(prompt + out[1].input_ids[9:11] + [3, 4], trained_from=9))  # nested fork inside branch 1
    out.append(seq(prompt + out[1].input_ids[9:12] + [5], trained_from=9))  # fork one token deeper
    out.append(seq([rng.randrange(vocab) for _ in range(6)] + [1, 2, 3], trained_from=6, group=1))  # unrelated
    long = [rng.randrange(vocab) for _ in range(70)]
    out.append(seq(long, trained_from=3, group=2))  # crosses a delta-rule chunk (64)
    out.append(seq(long[:66] + [7, 8, 9], trained_from=40, group=2))  # forks past the chunk boundary
    return out


def _unpacked_loss(model, samples):
    lps = []
    device = next(model.parameters()).device
    for s in samples:
        logits = model(input_ids=torch.tensor([s.input_ids], device=device), use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        lps.extend(lp[k - 1, s.input_ids[k]] for k in range(1, len(s.input_ids)) if s.trained_mask[k])
    return torch.stack(lps)


def _packed_loss(model, row):
    row = row.to(next(model.parameters()).device)
    hidden = forward_packed(model, row)
    logits = hidden[row.predict_index] @ model.lm_head.weight.T
    return torch.log_softmax(logits.float(), -1).gather(1, row.target_ids[:, None])[:, 0]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_exact(make):
    ref = _sharpen(make())
    samples = _samples(ref.config.vocab_size)
    row = pack_row(samples)
    assert row.packing_ratio > 1.3 and row.num_segments > 6
    expected = _unpacked_loss(ref, samples)
    expected.sum().backward()
    want = _grads(ref)

    model = _sharpen(make())
    assert apply_tree_attention(model, "sdpa") == "sdpa"
    got = _packed_loss(model, row)
    got.sum().backward()
    have = _grads(model)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    # plain padding-free packing (nothing shared): each sample its own root, state reset at each
    plain = [seq(s.input_ids, trained_from=1, group=i) for i, s in enumerate(samples[:3] + samples[-3:-1])]
    plain[1] = seq([5] + plain[1].input_ids[1:], group=1)
    row = pack_row(plain)
    with torch.no_grad():
        torch.testing.assert_close(_packed_loss(model, row), _unpacked_loss(model, plain), atol=1e-5, rtol=0)


def test_qwen35_packed_equals_unpacked_logprobs_and_grads():
    _check_exact(_qwen35)


def test_qwen3_next_packed_equals_unpacked_logprobs_and_grads():
    _check_exact(_qwen3_next)


@pytest.mark.parametrize("family", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vlm_checkpoints_of_testing_are_exact(tmp_path, family):
    """The tiny Qwen3.5 / Qwen3.6 (MoE) vision-language checkpoints of asyncgrpo_cli.testing, loaded as the trainer
    loads them (tower frozen): packed = unpacked log-probs through the wrapper's text stack."""
    from asyncgrpo_cli.testing import make_tiny_model
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.train.model_loading import load_policy

    path = make_tiny_model(tmp_path / family, family=family, num_layers=4, hidden_size=32)
    model = load_policy(str(path), AsyncGRPOConfig(output_dir=str(tmp_path / "o"), report_to=[], dtype="float32"))
    assert len(gdn.gated_deltanet_layers(model)) == 3
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    samples = _samples(model.config.get_text_config().vocab_size)
    apply_tree_attention(model, "sdpa")
    with torch.no_grad():
        torch.testing.assert_close(_packed_loss(model, pack_row(samples)), _unpacked_loss(model, samples),
                                   atol=1e-5, rtol=0)


def test_without_tree_kwarg_the_model_is_unchanged():
    """Generation/evaluation (no tree_attention keyword) runs the model's own kernels."""
    model = _sharpen(_qwen35())
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        apply_tree_attention(model, "sdpa")
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_segments_of_one_depth_go_in_one_call(monkeypatch):
    model = _sharpen(_qwen35(("linear_attention",)))
    apply_tree_attention(model, "sdpa")
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    calls = []
    real = gdn.tree_gated_delta_rule

    def spy(*args, **kwargs):
        plan = args[5]
        calls.append([len(segs) for segs, *_ in plan.levels])
        return real(*args, **kwargs)

    monkeypatch.setattr(gdn, "tree_gated_delta_rule", spy)
    batches = []
    ref = gdn._ORIGINALS["transformers.models.qwen3_5.modeling_qwen3_5"]["torch_chunk_gated_delta_rule"]

    def counting(*args, **kwargs):
        batches.append(args[0].shape[0])
        return ref(*args, **kwargs)

    monkeypatch.setattr(gdn.inspect, "unwrap", lambda fn: counting)
    with torch.no_grad():
        forward_packed(model, row)
    depths = max(1 + _depth(row, s) for s in range(row.num_segments))
    assert len(batches) == depths  # one kernel call per trie depth
    assert sum(batches) == row.num_segments and calls[0] == batches


def _depth(row, s):
    d, parents = 0, row.segment_parent.tolist()
    while parents[s] >= 0:
        s, d = parents[s], d + 1
    return d


def _fake_fla(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              cu_seqlens=None, **kwargs):
    """fla-core's varlen contract (B = 1, ``cu_seqlens`` [N + 1], ``initial_state`` [N, HV, K, V]) on the CPU, one
    sequence at a time through transformers' torch reference."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as ref

    import inspect

    ref = inspect.unwrap(ref)
    assert q.shape[0] == 1 and cu_seqlens is not None and cu_seqlens.dtype == torch.long
    if q.shape[2] != v.shape[2]:  # grouped value attention, as fla does it (older transformers' reference does not)
        q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    outs, finals = [], []
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        h0 = None if initial_state is None else initial_state[i : i + 1]
        o, h = ref(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=h0,
                   output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(h)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def test_fla_path_varlen_plumbing_is_exact_on_cpu(monkeypatch):
    """The CUDA path's layout (one varlen call per trie depth, one initial state per segment, final states handed to
    the children) with a CPU stand-in of fla's kernel: packed = unpacked in fp32, gradients included."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(len(kwargs["cu_seqlens"]) - 1)
        return _fake_fla(*args, **kwargs)

    monkeypatch.setattr(gdn, "_fla_rule", lambda: fake)
    monkeypatch.setattr(gdn, "resolve_gdn_kernel", lambda device: "fla")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    try:
        _check_exact(_qwen35)
    finally:
        gdn._KERNEL.clear()
    assert calls and max(calls) > 1  # segments of one depth went into one call


def test_kernel_selection(monkeypatch):
    monkeypatch.delenv("ASYNCGRPO_GDN_KERNEL", raising=False)
    assert gdn.resolve_gdn_kernel("cpu") == "torch"
    assert gdn.resolve_gdn_kernel("cuda") == "fla"
    monkeypatch.setenv("ASYNCGRPO_GDN_KERNEL", "torch")
    assert gdn.resolve_gdn_kernel("cuda") == "torch"
    monkeypatch.setenv("ASYNCGRPO_GDN_KERNEL", "fla")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        gdn.resolve_gdn_kernel("cpu")
    monkeypatch.setenv("ASYNCGRPO_GDN_KERNEL", "cudnn")
    with pytest.raises(ValueError, match="unknown"):
        gdn.resolve_gdn_kernel("cpu")


def test_refused_fla_backward_fails_at_start_with_versions_and_fix(monkeypatch):
    """What the trainer does on a Hopper GPU with Triton 3.6 and no tilelang: the probe's refusal at start."""

    def refusing(q, k, v, g, beta, **kwargs):
        class Refuse(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
                                   "chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1 or install tilelang")

        return Refuse.apply(v), torch.zeros(2, v.shape[2], q.shape[3], v.shape[3])

    monkeypatch.setattr(gdn, "_fla_rule", lambda: refusing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with pytest.raises(gdn.GatedDeltaNetUnavailable) as info:
        gdn.probe_fla(torch.device("cpu"), torch.float32, (2, 4), (8, 8))
    msg = str(info.value)
    assert "3.7.1" in msg and "tilelang" in msg and "torch " in msg and "ASYNCGRPO_GDN_KERNEL=torch" in msg
    # and prepare_gated_deltanet runs that probe when the fla kernel is selected
    monkeypatch.setattr(gdn, "resolve_gdn_kernel", lambda device: "fla")
    with pytest.raises(gdn.GatedDeltaNetUnavailable):
        gdn.prepare_gated_deltanet(_qwen35())


def test_missing_fla_is_named(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name.startswith("fla"):
            raise ImportError("No module named 'fla'")
        return real_import(name, *args, **kwargs)

    gdn._fla_rule.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_fla)
    try:
        with pytest.raises(gdn.GatedDeltaNetUnavailable, match="pip install 'fla-core"):
            gdn._fla_rule()
    finally:
        gdn._fla_rule.cache_clear()


def test_unsupported_token_mixers_are_refused_at_start():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(gdn.UnsupportedTokenMixer) as info:
        apply_tree_attention(mamba, "sdpa", model_id="tiny/mamba")
    msg = str(info.value)
    assert "tiny/mamba" in msg and "'mamba'" in msg and "Qwen3.5" in msg and "Qwen3-Next" in msg

    model = _qwen35(("linear_attention", "full_attention"))
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(gdn.UnsupportedTokenMixer, match="layer type 'chunked_attention'"):
        gdn.check_token_mixers(model, "tiny/llama4-like")


def test_gdn_of_an_unchecked_module_is_refused(monkeypatch):
    model = _qwen35(("linear_attention",))
    layer = gdn.gated_deltanet_layers(model)[0]
    fake = type("OtherGatedDeltaNet", (type(layer),), {"__module__": "somewhere.modeling_other"})
    monkeypatch.setattr(layer, "__class__", fake)
    with pytest.raises(gdn.UnsupportedTokenMixer, match="OtherGatedDeltaNet from somewhere.modeling_other"):
        gdn.check_token_mixers(model, "tiny/other")


def _qwen35_2b_shape(layers=4):
    """Qwen3.5-2B's layer shapes (random weights, ``layers`` of its 24, every 4th full attention) in bf16 on CUDA."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16)


def _gpu_samples():
    rng = random.Random(0)
    prompt = [rng.randrange(8192) for _ in range(300)]
    out = [seq(prompt + [rng.randrange(8192) for _ in range(rng.randint(100, 400))], trained_from=300)
           for _ in range(6)]
    out.append(seq(out[0].input_ids[:350] + [rng.randrange(8192) for _ in range(90)], trained_from=300))  # nested
    out.append(seq([rng.randrange(8192) for _ in range(200)], trained_from=20, group=1))  # unrelated
    return out


def _bf16_close(got, want):
    err = (got.float() - want.float()).abs()
    assert err.mean() < 0.02 and err.max() < 0.25, (err.mean().item(), err.max().item())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu/run_gdn.sh test)")


@pytest.mark.gpu
@gpu
def test_fla_forward_bf16_packed_matches_unpacked_on_qwen35_2b_shape(monkeypatch):
    """fla-core's varlen kernel with one initial state per segment: packed log-probs = unpacked within bf16 noise.
    Forward only (the trainer-start probe of the backward is skipped here; the next test covers training)."""
    pytest.importorskip("fla")
    monkeypatch.delenv("ASYNCGRPO_GDN_KERNEL", raising=False)
    monkeypatch.setattr(gdn, "probe_fla", lambda *a, **k: None)
    model = _qwen35_2b_shape()
    assert apply_tree_attention(model, "flex") == "flex"
    samples = _gpu_samples()
    row = pack_row(samples)
    with torch.no_grad():
        _bf16_close(_packed_loss(model, row), _unpacked_loss(model, samples))


@pytest.mark.gpu
@gpu
def test_fla_training_bf16_packed_matches_unpacked_on_qwen35_2b_shape(monkeypatch):
    """Log-probs and gradients; skipped with fla's own reason where its backward refuses (the trainer would stop at
    start with that message)."""
    pytest.importorskip("fla")
    monkeypatch.delenv("ASYNCGRPO_GDN_KERNEL", raising=False)
    model = _qwen35_2b_shape()
    try:
        apply_tree_attention(model, "flex")
    except gdn.GatedDeltaNetUnavailable as exc:
        pytest.skip(f"the trainer refuses at start here: {exc}")
    ref = _qwen35_2b_shape()
    samples = _gpu_samples()
    row = pack_row(samples)
    got = _packed_loss(model, row)
    got.sum().backward()
    want = _unpacked_loss(ref, samples)
    want.sum().backward()
    _bf16_close(got, want)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        cos = torch.nn.functional.cosine_similarity(p.grad.float().flatten(), q.grad.float().flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


@pytest.mark.gpu
@gpu
def test_torch_kernel_on_cuda_matches_unpacked(monkeypatch):
    """ASYNCGRPO_GDN_KERNEL=torch (the fallback where fla cannot train) on a GPU, fp32 on a small shape."""
    monkeypatch.setenv("ASYNCGRPO_GDN_KERNEL", "torch")
    ref = _sharpen(_qwen35()).cuda()
    model = _sharpen(_qwen35()).cuda()
    apply_tree_attention(model, "sdpa")
    samples = _samples(ref.config.vocab_size)
    row = pack_row(samples)
    with torch.no_grad():
        torch.testing.assert_close(_packed_loss(model, row), _unpacked_loss(ref, samples), atol=1e-4, rtol=0)


def test_the_first_runs_kernel_compile_shows_as_progress_lines_with_its_caches(monkeypatch, capsys, tmp_path):
    """Issue #43 item 6: fla's kernels compile during the start-up probe on a machine's first run; the console says
    so before (with where they are cached for later runs) and after (with the time), from the first process only."""
    monkeypatch.setattr(gdn, "resolve_gdn_kernel", lambda device: "fla")
    monkeypatch.setattr(gdn, "_KERNEL", dict(gdn._KERNEL))  # the layers' kernel choice goes back to the real one after
    seen = []
    monkeypatch.setattr(gdn, "probe_fla", lambda *a, **k: seen.append(capsys.readouterr().out))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("RANK", "0")
    gdn.prepare_gated_deltanet(_qwen35())
    before, after = seen[0], capsys.readouterr().out
    assert "Gated DeltaNet" in before and "compiling fla-core's kernels" in before and str(tmp_path / "triton") in before
    assert after.startswith("asyncgrpo: Gated DeltaNet: fla-core's kernels ready in ") and after.rstrip().endswith(" s")
    monkeypatch.setenv("RANK", "1")
    gdn.prepare_gated_deltanet(_qwen35())
    assert capsys.readouterr().out == ""


def test_the_training_device_picks_the_kernel_not_where_the_model_was_loaded(monkeypatch):
    """The trainer switches its model at start, still on the CPU where it was loaded; a GPU run must get fla (and
    its start-up probe on that GPU), not the torch kernel the CPU parameters would pick."""
    probed = []
    monkeypatch.setattr(gdn, "probe_fla", lambda device, *a, **k: probed.append(device))
    monkeypatch.delenv("ASYNCGRPO_GDN_KERNEL", raising=False)
    model = _qwen35()  # on the CPU
    assert gdn.prepare_gated_deltanet(model, device=torch.device("cuda", 0)) == "fla"
    assert probed == [torch.device("cuda", 0)] and set(gdn._KERNEL.values()) == {"fla"}
    assert gdn.prepare_gated_deltanet(model) == "torch"  # no device: the parameters' (the CPU)
    assert set(gdn._KERNEL.values()) == {"torch"} and len(probed) == 1
