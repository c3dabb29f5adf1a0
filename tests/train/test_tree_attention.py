"""Tree attention: packed log-probs equal one-sample-at-a-time log-probs (SPEC §6.1–6.2, DESIGN §6)."""

from __future__ import annotations

import random

import pytest
import torch

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train.packing import PackedRow, pack_row
from asyncgrpo_cli.train.tree_attention import (
    FLEX_MIN_TOKENS,
    IMPLEMENTATION_NAMES,
    TreeAttentionInputs,
    TreeAttentionUnavailable,
    apply_tree_attention,
    forward_packed,
    register_tree_attention,
    resolve_backend,
    tree_attention_backend,
    varlen_attention_reference,
)

transformers = pytest.importorskip("transformers")


def seq(ids, trained_from=1, group=0):
    mask = [1 if k >= trained_from else 0 for k in range(len(ids))]
    return TrainingSequence(list(ids), mask, [0.0] * len(ids), 1.0, group, 0, 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), num_layers=2)


def _load(model_dir, impl="sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl)
    # random init has tiny logits; sharpen them so differences in attention would show in log-probs
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def _samples(vocab: int) -> list[TrainingSequence]:
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(9)]
    other = [rng.randrange(vocab) for _ in range(6)]
    out = [seq(prompt + [rng.randrange(vocab) for _ in range(rng.randint(2, 7))], trained_from=9) for _ in range(4)]
    out.append(seq(out[0].input_ids))  # identical
    out.append(seq(prompt[:5], trained_from=2))  # prefix of the others
    out.append(seq(prompt[:9] + out[1].input_ids[9:11] + [3, 4], trained_from=9))  # deeper branch
    out.append(seq(other + [1, 2, 3], trained_from=6, group=1))  # another group, nothing shared
    return out


def _unpacked_logprobs(ref_model, samples):
    """Per sample, log-prob of every trained token, forwarding the sample alone."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            logits = ref_model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            ks = [k for k in range(1, len(s.input_ids)) if s.trained_mask[k]]
            out.extend(lp[k - 1, s.input_ids[k]].item() for k in ks)
    return torch.tensor(out)


def _packed_logprobs(model, row: PackedRow, **kw):
    hidden = forward_packed(model, row, **kw)
    assert hidden.shape == (row.num_tokens, model.config.hidden_size)
    logits = hidden[row.predict_index] @ model.lm_head.weight.T
    return torch.log_softmax(logits.float(), -1).gather(1, row.target_ids[:, None])[:, 0]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash-reference"])
def test_packed_logprobs_match_unpacked(model_dir, backend):
    ref = _load(model_dir)
    model = _load(model_dir)
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    assert row.packing_ratio > 1.5
    expected = _unpacked_logprobs(ref, samples)
    kw = {}
    if backend == "flash-reference":  # the flash gather plan, with a pure-torch varlen kernel
        register_tree_attention()
        model.config._attn_implementation = IMPLEMENTATION_NAMES["flash"]
        kw["varlen_fn"] = varlen_attention_reference
    else:
        assert apply_tree_attention(model, backend) == backend
    with torch.no_grad():
        got = _packed_logprobs(model, row, **kw)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5
    assert expected.std() > 0.1  # the check is not vacuous


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_logprobs_match_unpacked_under_bf16_autocast(model_dir, backend, monkeypatch):
    """The recipes' precision, ``model.dtype=float32`` with ``trainer.bf16``: float32 weights, the forward under bf16
    autocast. Qwen3's q_norm/k_norm then hand attention a float32 query and key beside a bf16 value; stock SDPA is
    autocast, while FlexAttention (no autocast op; it accepts a query of higher precision than its key and value)
    computes its scores from the float32 query and key. Casting them to bf16 first bought nothing on the GPU
    (1,790 against 1,796 ms for the 1.7B shape's P3 step, one H100, 2026-12-07: NOTES), so the kernel keeps the
    model's dtypes; packed log-probs still match the unpacked ones under the same autocast, to bf16 precision."""
    from torch.nn.attention.flex_attention import flex_attention

    from asyncgrpo_cli.train import tree_attention as ta

    seen = []

    def spy_flex(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(ta, "_flex_fn", lambda device: spy_flex)
    ref, model = _load(model_dir), _load(model_dir)
    assert apply_tree_attention(model, backend) == backend
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _unpacked_logprobs(ref, samples)
        with torch.no_grad():
            got = _packed_logprobs(model, row)
    if backend == "flex":
        assert seen == [(torch.float32, torch.float32, torch.bfloat16)] * model.config.num_hidden_layers, seen
    assert expected.std() > 0.1
    assert (got - expected).abs().max().item() <= 0.1  # bf16 precision (float32 throughout: <= 1e-5 above)


def test_packed_hidden_states_match_per_token(model_dir):
    """Stronger than log-probs: every sample's every token has its unpacked hidden state."""
    ref = _load(model_dir)
    model = _load(model_dir)
    apply_tree_attention(model, "sdpa")
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    with torch.no_grad():
        hidden = forward_packed(model, row)
        leave = row.dfs_leave.tolist()
        for s, end in zip(samples, row.sample_end_index.tolist()):
            path = [j for j in range(end + 1) if end <= leave[j]]
            alone = ref.model(input_ids=torch.tensor([s.input_ids])).last_hidden_state[0]
            assert torch.allclose(hidden[path], alone, atol=1e-5, rtol=0)


def test_gradients_match_unpacked(model_dir):
    ref = _load(model_dir)
    model = _load(model_dir)
    apply_tree_attention(model, "sdpa")
    model.train()
    ref.train()
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    _packed_logprobs(model, row).sum().backward()
    total = 0
    for s in samples:
        ids = torch.tensor([s.input_ids])
        lp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
        ks = [k for k in range(1, len(s.input_ids)) if s.trained_mask[k]]
        total = total + sum(lp[k - 1, s.input_ids[k]] for k in ks)
    total.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-4, rtol=1e-4), name


def test_activation_checkpointing_recomputes_with_the_tree(model_dir):
    model = _load(model_dir)
    apply_tree_attention(model, "sdpa")
    samples = _samples(model.config.vocab_size)
    row = pack_row(samples)
    model.train()
    _packed_logprobs(model, row).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    _packed_logprobs(model, row).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, plain[n], atol=1e-6), n


def test_empty_row_still_reaches_every_parameter(model_dir):
    model = _load(model_dir)
    apply_tree_attention(model, "sdpa")
    hidden = forward_packed(model, PackedRow.empty())
    assert hidden.shape == (0, model.config.hidden_size)
    hidden.sum().backward()
    grads = [p.grad for p in model.model.layers.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)


def test_peft_wrapped_model(model_dir):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _load(model_dir), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    assert apply_tree_attention(model, "sdpa") == "sdpa"
    samples = [seq([1, 2, 3, 4]), seq([1, 2, 5])]
    row = pack_row(samples)
    hidden = forward_packed(model, row)
    end = row.sample_end_index[1].item()
    path = [j for j in range(end + 1) if end <= row.dfs_leave[j]]
    alone = model(input_ids=torch.tensor([samples[1].input_ids]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(hidden[path], alone, atol=1e-5)
    hidden.sum().backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is not None for p in lora)


def test_model_outside_packed_forwards_behaves_like_sdpa(model_dir):
    """Generation/evaluation with padding still works after switching to tree attention."""
    ref = _load(model_dir)
    model = _load(model_dir)
    apply_tree_attention(model, "sdpa")
    assert tree_attention_backend(model) == "sdpa"
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1, 2:], b[1, 2:], atol=1e-6)


def test_masks_follow_the_spec_example():
    row = pack_row([seq([1, 2, 3, 10, 11], 3), seq([1, 2, 3, 20, 21], 3)])
    ctx = TreeAttentionInputs.from_row(row, "cpu")
    mask = ctx.sdpa_mask()[0, 0]
    for s in range(row.num_segments):
        start, length = row.segment_start[s].item(), row.segment_length[s].item()
        keys = row.segment_key_indices(s)
        last = start + length - 1
        assert mask[last].nonzero().flatten().tolist() == keys
        for q in range(start, last + 1):  # causal inside the path
            assert mask[q].nonzero().flatten().tolist() == [k for k in keys if k <= q]
    block = ctx.block_mask()  # a short row is padded to FLEX_MIN_TOKENS for flex (see the compiled test below)
    assert ctx.flex_tokens == FLEX_MIN_TOKENS and tuple(block.shape[-2:]) == (FLEX_MIN_TOKENS, FLEX_MIN_TOKENS)
    dense = block.to_dense()[0, 0]  # [blocks, blocks]: the padding's block sees only itself
    assert dense.tolist() == [[1, 0], [0, 1]]
    plan = ctx.varlen_plan()
    assert plan.cu_seqlens_q.tolist() == [0, 2, 5, 8]
    assert plan.cu_seqlens_k.tolist() == [0, 2, 7, 12]
    assert plan.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (3, 5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 2, 3])
def test_backends_agree_on_random_rows_with_gqa_and_sliding_window(window):
    from asyncgrpo_cli.train.tree_attention import _tree_attention

    rng = random.Random(1)
    samples = []
    for _ in range(6):
        base = rng.choice(samples).input_ids[: rng.randint(1, 6)] if samples else []
        samples.append(seq(base + [rng.randrange(4) for _ in range(rng.randint(1, 6))]))
    row = pack_row(samples)
    n = row.num_tokens
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    ctx = TreeAttentionInputs.from_row(row, "cpu", varlen_fn=varlen_attention_reference)
    kw = dict(tree_attention=ctx, sliding_window=window)
    ref = _explicit_attention(q, k, v, row, window)
    for backend in ("sdpa", "flex", "flash"):
        out, weights = _tree_attention(backend, None, q, k, v, None, 0.5, 0.0, **kw)
        assert weights is None and out.shape == (1, n, 4, 8)
        assert torch.allclose(out, ref, atol=1e-5), backend


def _explicit_attention(q, k, v, row, window):
    """Naive loops: each query over its ancestors-or-self (within the window), GQA by head groups."""
    leave, pos = row.dfs_leave.tolist(), row.position_ids.tolist()
    n, hq, hk = q.shape[2], q.shape[1], k.shape[1]
    out = torch.zeros(1, n, hq, q.shape[3])
    for i in range(n):
        keys = [j for j in range(i + 1) if i <= leave[j] and (window is None or pos[i] - pos[j] < window)]
        for h in range(hq):
            kh = h // (hq // hk)
            scores = (k[0, kh, keys] @ q[0, h, i]) * 0.5
            out[0, i, h] = torch.softmax(scores, 0) @ v[0, kh, keys]
    return out


def test_padding_keeps_the_values_and_the_layout_it_can_grow():
    """`_pad_tokens`: the row's values then zeros, whatever the layout; the model's layouts keep their strides
    (grown along the tokens) and a view stays a view of a grown base; a view at a token offset gets a copy."""
    from asyncgrpo_cli.train.tree_attention import _pad_tokens

    n, pad = 40, 88
    projection = torch.randn(1, n, 24)
    cases = {"after RoPE": (torch.randn(1, n, 3, 8).transpose(1, 2) * 1.0, (3 * 8 * 128, 8, 24, 1), False),
             "value view": (projection.view(1, n, 3, 8).transpose(1, 2), (3 * 8 * 128, 8, 24, 1), True),
             "contiguous": (torch.randn(1, 3, n, 8), (3 * 128 * 8, 128 * 8, 8, 1), False),
             "token offset": (projection[:, 2:].reshape(1, n - 2, 3, 8).transpose(1, 2), None, False)}
    for name, (t, strides, view) in cases.items():
        out = _pad_tokens(t, pad)
        length = t.shape[2]
        assert out.shape == (1, 3, length + pad, 8), name
        assert torch.equal(out[:, :, :length], t) and not out[:, :, length:].any(), name
        assert strides is None or out.stride() == strides, (name, out.stride())
        assert (out._base is not None) == view, name


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("heads, fused", [((4, 2), False), ((2, 1), False), ((4, 2), True)])
def test_a_short_row_does_not_recompile_flex(monkeypatch, heads, fused):
    """The trainer compiles create_block_mask and flex_attention with dynamic shapes (on CUDA; compiled on the CPU
    here). A row of one 128-token block used to fail a guard of the first trace and recompile mid-run (14.8 s
    in the one-GPU job); padded to FLEX_MIN_TOKENS it reuses the trace, with the same outputs. The padded
    tensors keep the model's layouts: a contiguous copy changed key's stride(1) and recompiled flex on the GPU
    (`cuda_tests_s10.txt`), and a padded value that is no view of a base fails the guard on the value's base.
    One KV head: a size-1 dim whose stride is kept; a fused QKV projection: the value at an offset in its base."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from asyncgrpo_cli.train import tree_attention as ta

    torch._dynamo.reset()
    build, flex = torch.compile(create_block_mask, dynamic=True), torch.compile(flex_attention, dynamic=True)
    monkeypatch.setattr(ta, "_block_mask_fn", lambda device: build)
    monkeypatch.setattr(ta, "_flex_fn", lambda device: flex)
    rng = random.Random(5)

    def run(n_samples, length):
        samples = [seq([rng.randrange(50) for _ in range(length)]) for _ in range(n_samples)]
        row = pack_row(samples)
        n = row.num_tokens
        # the layouts a transformers model passes: query and key fresh from RoPE in [1, L, H, D] order seen as
        # [1, H, L, D] (stride(1) = D), the value a view of its [1, L, H * D] projection (or of a fused one)
        hq, hk = heads
        q, k = (torch.randn(1, n, h, 8).transpose(1, 2) * 1.0 for h in heads)
        width = (hq + 2 * hk) * 8 if fused else hk * 8
        start = (hq + hk) * 8 if fused else 0
        v = torch.randn(1, n, width)[..., start: start + hk * 8].view(1, n, hk, 8).transpose(1, 2)
        ctx = TreeAttentionInputs.from_row(row, "cpu")
        out, _ = ta._tree_attention("flex", None, q, k, v, None, 0.5, 0.0, tree_attention=ctx)
        assert torch.allclose(out, _explicit_attention(q, k, v, row, None), atol=1e-5)
        return n

    try:
        assert run(10, 40) > 2 * 128  # the first trace: three blocks
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert run(2, 30) <= 128  # one block's worth of tokens
            assert run(1, 5) == 5
    finally:
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_kernel_options_reach_every_flex_call(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    from asyncgrpo_cli.train import tree_attention as ta

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return flex_attention(*args, **{k: v for k, v in kwargs.items() if k != "kernel_options"})

    monkeypatch.setattr(ta, "_flex_fn", lambda device: spy)
    row = pack_row([seq([1, 2, 3, 4]), seq([1, 2, 5])])
    q, k, v = torch.randn(1, 2, row.num_tokens, 8), torch.randn(1, 2, row.num_tokens, 8), torch.randn(1, 2, row.num_tokens, 8)
    ctx = TreeAttentionInputs.from_row(row, "cpu")
    ta._tree_attention("flex", None, q, k, v, None, 0.5, 0.0, tree_attention=ctx)
    monkeypatch.setitem(ta.FLEX_KERNEL_OPTIONS, "BACKEND", "FLASH")
    ta._tree_attention("flex", None, q, k, v, None, 0.5, 0.0, tree_attention=ctx)
    assert seen == [None, {"BACKEND": "FLASH"}]


def test_errors_are_clear(model_dir):
    model = _load(model_dir)
    with pytest.raises(ValueError, match="apply_tree_attention"):
        forward_packed(model, pack_row([seq([1, 2, 3])]))
    with pytest.raises(ValueError, match="backend='nope'"):
        resolve_backend("nope")
    assert resolve_backend("auto", "cpu") == "sdpa" and resolve_backend("auto", "cuda") == "flex"
    with pytest.raises(TreeAttentionUnavailable, match="flash"):
        apply_tree_attention(model, "flash")  # CPU model
    assert tree_attention_backend(model) is None
    model.config.attention_dropout = 0.1  # the trainer runs in train mode, where it applies: flex cannot
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 .*Fix: packing.attention=sdpa"):
        apply_tree_attention(model, "flex")
    assert tree_attention_backend(model) is None
    assert apply_tree_attention(model, "sdpa") == "sdpa"  # sdpa applies it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_matches_sdpa_on_cuda_forward_and_backward(model_dir):
    """Compiled FlexAttention (the GPU default) against the sdpa reference, two row lengths."""
    rng = random.Random(3)
    ref, model = _load(model_dir).cuda(), _load(model_dir).cuda()
    apply_tree_attention(ref, "sdpa")
    assert apply_tree_attention(model, "auto") == "flex"
    vocab = model.config.vocab_size
    for n_groups in (3, 7):
        samples = []
        for g in range(n_groups):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(20, 150))]
            samples += [seq(prompt + [rng.randrange(vocab) for _ in range(rng.randint(5, 120))], len(prompt), g)
                        for _ in range(4)]
        row = pack_row(samples).to("cuda")
        ref.zero_grad()
        model.zero_grad()
        a = _packed_logprobs(ref, row)
        b = _packed_logprobs(model, row)
        assert (a - b).abs().max().item() <= 1e-4
        a.sum().backward()
        b.sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-3, rtol=1e-3), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_short_row_does_not_recompile_flex(model_dir):
    """The trainer's compiled flex path: a long row, then rows of one block's worth of tokens, forward and backward,
    with no recompile (the job's 14.8 s step) and log-probs equal to sdpa's."""
    import torch._dynamo

    rng = random.Random(4)
    ref, model = _load(model_dir).cuda(), _load(model_dir).cuda()
    apply_tree_attention(ref, "sdpa")
    assert apply_tree_attention(model, "flex") == "flex"
    vocab = model.config.vocab_size

    def step(n_samples, length):
        row = pack_row([seq([rng.randrange(vocab) for _ in range(length)], 2) for _ in range(n_samples)]).to("cuda")
        a, b = _packed_logprobs(ref, row), _packed_logprobs(model, row)
        assert (a - b).abs().max().item() <= 1e-4
        b.sum().backward()
        return row.num_tokens

    assert step(12, 200) > 2048
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert step(2, 40) <= 128
        assert step(1, 7) == 7
