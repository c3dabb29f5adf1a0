"""The ``flash`` tree-attention kernel's providers (``asyncgrpo_cli.train.flash_varlen``; issue #43 item 4).

On the CPU: the provider order, the refusal of flash-attn-4 below SM90, its on-disk compile cache, SPEC §2.10's Hub
kernels, and the calling convention, with stand-ins that keep each provider's real signature (flash-attn-4 takes
``qv`` as its fourth positional argument and has no dropout). On a CUDA GPU with a provider installed: packed =
unpacked in bf16 through the real kernel, and its gradients against the sdpa tree path
(``bash scripts/gpu/run_flash.sh test``)."""

from __future__ import annotations

import importlib
import importlib.machinery
import random
import sys
import types

import pytest
import torch

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train import flash_varlen as fv
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import (
    TreeAttentionInputs,
    TreeAttentionUnavailable,
    _tree_attention,
    varlen_attention_reference,
)


def seq(ids, trained_from=1, group=0):
    mask = [1 if k >= trained_from else 0 for k in range(len(ids))]
    return TrainingSequence(list(ids), mask, [0.0] * len(ids), 1.0, group, 0, 0)


def fa4_like(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
             softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
             return_lse=False):
    """flash-attn-4's ``flash_attn_varlen_func`` signature (4.0.0b40), computed by the reference; returns
    ``(out, lse)`` as it does."""
    assert qv is None, "cu_seqlens_q reached qv: the call was positional"
    assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int)
    left, right = (-1 if w is None else w for w in window_size)
    out = varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale=softmax_scale, causal=causal, window_size=(left, right))
    return out, torch.zeros(q.shape[1], q.shape[0])


def fa2_like(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
             causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
             return_attn_probs=False, block_table=None):
    return varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size)


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


@pytest.fixture
def providers(monkeypatch):
    """Install stand-in provider modules; yields a function ``install(fa4=..., fa2=...)``."""
    fv.load_flash_varlen.cache_clear()
    for name in ("flash_attn", "flash_attn.cute", "kernels"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    def install(fa4: bool = False, fa2: bool = False):
        top = _module("flash_attn", **({"flash_attn_varlen_func": fa2_like} if fa2 else {}))
        monkeypatch.setitem(sys.modules, "flash_attn", top)
        if fa4:
            monkeypatch.setitem(sys.modules, "flash_attn.cute", _module("flash_attn.cute", flash_attn_varlen_func=fa4_like))
        elif not fa2:
            monkeypatch.delitem(sys.modules, "flash_attn")
            monkeypatch.setattr(fv.importlib.util, "find_spec", lambda name, *a: None)
        else:  # flash-attn-2 alone: no cute submodule
            real = fv.importlib.util.find_spec
            monkeypatch.setattr(fv.importlib.util, "find_spec",
                                lambda name, *a: None if name in ("flash_attn.cute", "kernels") else real(name, *a))

    yield install
    fv.load_flash_varlen.cache_clear()


def test_flash_attn_4_comes_first_and_turns_on_its_compile_cache(providers, monkeypatch):
    monkeypatch.delenv(fv.CUTE_CACHE_ENV, raising=False)
    providers(fa4=True, fa2=True)
    got = fv.load_flash_varlen((9, 0))
    assert got.provider == "flash-attn-4" and got.fn is fa4_like
    assert got.name.startswith("flash-attn-4")
    assert fv.os.environ[fv.CUTE_CACHE_ENV] == "1"


def test_a_users_cache_setting_is_kept(providers, monkeypatch):
    monkeypatch.setenv(fv.CUTE_CACHE_ENV, "0")
    providers(fa4=True)
    fv.load_flash_varlen((9, 0))
    assert fv.os.environ[fv.CUTE_CACHE_ENV] == "0"


def test_flash_attn_4_is_passed_over_below_sm90_with_the_reason(providers):
    providers(fa4=True, fa2=True)
    assert fv.load_flash_varlen((8, 0)).provider == "flash-attn"
    fv.load_flash_varlen.cache_clear()
    providers(fa4=True)
    with pytest.raises(TreeAttentionUnavailable, match=r"flash-attn-4: its backward needs compute capability 9\.0 "
                                                        r"or newer, this GPU has 8\.0"):
        fv.load_flash_varlen((8, 0))


def test_nothing_installed_names_every_provider_and_the_fix(providers):
    providers()
    with pytest.raises(TreeAttentionUnavailable) as err:
        fv.load_flash_varlen((9, 0))
    msg = str(err.value)
    for part in ("flash-attn-4: not installed", "flash_attn: not installed", "kernels: not installed",
                 "pip install flash-attn-4", "packing.attention to 'flex'"):
        assert part in msg


def test_hub_kernels_follow_the_spec():
    assert fv.hub_kernel_repo((10, 0)) == "kernels-community/flash-attn4"
    assert fv.hub_kernel_repo((12, 0)) == "kernels-community/flash-attn4"
    assert fv.hub_kernel_repo((9, 0)) == "kernels-community/flash-attn3"
    assert fv.hub_kernel_repo((8, 0)) == "kernels-community/flash-attn2"
    assert fv.hub_kernel_repo(None) == "kernels-community/flash-attn2"


def _random_row(seed=1):
    rng = random.Random(seed)
    samples = []
    for _ in range(6):
        base = rng.choice(samples).input_ids[: rng.randint(1, 6)] if samples else []
        samples.append(seq(base + [rng.randrange(4) for _ in range(rng.randint(1, 6))]))
    return pack_row(samples)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kernel", [fa4_like, fa2_like])
def test_every_signature_gives_the_sdpa_tree_attention(kernel, window):
    row = _random_row()
    n = row.num_tokens
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    kw = dict(sliding_window=window)
    want, _ = _tree_attention("sdpa", None, q, k, v, None, 0.5, 0.0,
                              tree_attention=TreeAttentionInputs.from_row(row, "cpu"), **kw)
    got, _ = _tree_attention("flash", None, q, k, v, None, 0.5, 0.0,
                             tree_attention=TreeAttentionInputs.from_row(row, "cpu", varlen_fn=kernel), **kw)
    assert torch.allclose(got, want, atol=1e-5)


def test_dropout_is_refused_by_a_kernel_without_it_and_passed_to_one_with_it():
    row = _random_row()
    n = row.num_tokens
    q, k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    with pytest.raises(NotImplementedError, match="no attention dropout.*packing.attention=sdpa"):
        _tree_attention("flash", None, q, k, v, None, 0.5, 0.1,
                        tree_attention=TreeAttentionInputs.from_row(row, "cpu", varlen_fn=fa4_like))
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return fa2_like(*args, **{**kwargs, "dropout_p": 0.0})

    _tree_attention("flash", None, q, k, v, None, 0.5, 0.1,
                    tree_attention=TreeAttentionInputs.from_row(row, "cpu", varlen_fn=spy))
    assert seen["dropout_p"] == 0.1
    seen.clear()
    _tree_attention("flash", None, q, k, v, None, 0.5, 0.0,
                    tree_attention=TreeAttentionInputs.from_row(row, "cpu", varlen_fn=spy))
    assert "dropout_p" not in seen  # flash-attn-3 has no such argument


# ------------------------------------------------------------------------------------------------------------------
# On a CUDA GPU with a real provider (the lent H200: bash scripts/gpu/run_flash.sh test)
# ------------------------------------------------------------------------------------------------------------------


def _real_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fv.load_flash_varlen.cache_clear()
    try:
        return fv.load_flash_varlen()
    except TreeAttentionUnavailable as exc:
        pytest.skip(str(exc))


def _cuda_model(impl):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False, attn_implementation=impl)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharp log-probs, so attention errors would show
    return model


def _cuda_samples(vocab):
    rng = random.Random(5)
    samples = []
    for g in range(4):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(40, 300))]
        samples += [seq(prompt + [rng.randrange(vocab) for _ in range(rng.randint(3, 200))], len(prompt), g)
                    for _ in range(8)]
    samples.append(seq(samples[0].input_ids))  # an identical completion
    return samples


@pytest.mark.gpu
def test_flash_packed_logprobs_equal_unpacked_in_bf16_on_cuda():
    from asyncgrpo_cli.train.tree_attention import apply_tree_attention, forward_packed

    kernel = _real_kernel()
    ref, model = _cuda_model("sdpa").eval(), _cuda_model("sdpa").eval()
    assert apply_tree_attention(model, "flash") == "flash"
    samples = _cuda_samples(model.config.vocab_size)
    row = pack_row(samples).to("cuda")
    assert row.packing_ratio > 2
    with torch.no_grad():
        hidden = forward_packed(model, row)
        packed = torch.log_softmax((hidden[row.predict_index] @ model.lm_head.weight.T).float(), -1)
        packed = packed.gather(1, row.target_ids[:, None])[:, 0]
        unpacked = []
        for s in samples:
            logits = ref(input_ids=torch.tensor([s.input_ids], device="cuda")).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            unpacked += [lp[t - 1, s.input_ids[t]] for t in range(1, len(s.input_ids)) if s.trained_mask[t]]
    unpacked = torch.stack(unpacked)
    err = (packed - unpacked).abs()
    assert unpacked.std() > 0.5, "the check would be vacuous"
    # bf16: both paths round activations to 8 bits of mantissa; a wrong mask moves log-probs by whole nats
    assert err.max().item() < 0.15 and err.mean().item() < 0.02, (kernel.name, err.max().item(), err.mean().item())


@pytest.mark.gpu
def test_flash_gradients_match_the_sdpa_tree_path_in_bf16_on_cuda():
    from asyncgrpo_cli.train.tree_attention import apply_tree_attention, forward_packed

    kernel = _real_kernel()
    grads = {}
    for backend in ("sdpa", "flash"):
        model = _cuda_model("sdpa").train()
        apply_tree_attention(model, backend)
        samples = _cuda_samples(model.config.vocab_size)
        row = pack_row(samples).to("cuda")
        hidden = forward_packed(model, row)
        lp = torch.log_softmax((hidden[row.predict_index] @ model.lm_head.weight.T).float(), -1)
        lp.gather(1, row.target_ids[:, None]).sum().backward()
        grads[backend] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads["flash"].keys()
    for name, want in grads["sdpa"].items():
        got = grads["flash"][name]
        rel = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert rel < 5e-2, (kernel.name, name, rel)


# ------------------------------------------------------------------------------------------------------------------
# Before anything starts: `train`, `--dry-run` and `config --check` (asyncgrpo_cli.config.start_checks)
# ------------------------------------------------------------------------------------------------------------------


def test_installed_providers_are_found_without_importing_them(tmp_path, monkeypatch):
    from asyncgrpo_cli.config.start_checks import installed_flash_providers

    fa4 = tmp_path / "fa4"
    (fa4 / "flash_attn" / "cute").mkdir(parents=True)
    (fa4 / "flash_attn" / "cute" / "__init__.py").write_text("raise ImportError('imported')\n")
    fa2 = tmp_path / "fa2"
    (fa2 / "flash_attn").mkdir(parents=True)
    (fa2 / "flash_attn" / "__init__.py").write_text("raise ImportError('imported')\n")
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(fa4))
    importlib.invalidate_caches()
    assert "flash-attn-4" in installed_flash_providers() and "flash-attn" not in installed_flash_providers()
    monkeypatch.syspath_prepend(str(fa2))  # a regular package shadows the namespace one, as pip would have it
    importlib.invalidate_caches()
    assert "flash-attn" in installed_flash_providers() and "flash-attn-4" not in installed_flash_providers()


def test_flash_without_any_provider_is_refused_naming_the_key_and_the_fix(monkeypatch):
    from asyncgrpo_cli.config import start_checks
    from asyncgrpo_cli.config.rules import ConfigError

    monkeypatch.setattr(start_checks, "installed_flash_providers", lambda: [])
    with pytest.raises(ConfigError) as err:
        start_checks.check_flash_kernel("flash")
    text = str(err.value)
    assert "packing.attention" in text and "pip install flash-attn-4" in text and "packing.attention=flex" in text
    start_checks.check_flash_kernel("flex")  # other backends need nothing
    monkeypatch.setattr(start_checks, "installed_flash_providers", lambda: ["kernels"])
    start_checks.check_flash_kernel("flash")


def test_the_trainer_start_names_the_flash_kernel_once(monkeypatch, capsys, tmp_path):
    from asyncgrpo_cli.testing import make_tiny_model
    from asyncgrpo_cli.train import tree_attention as ta
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"), attn_implementation="sdpa")
    monkeypatch.setattr(ta, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(ta, "load_flash_varlen", lambda capability=None: fv.FlashVarlen(fa4_like, "flash-attn-4", "4.0.0b40"))
    monkeypatch.setenv("RANK", "0")
    gpu = torch.device("cuda", 0)  # the trainer's device; the model is still on the CPU at its start
    assert ta.apply_tree_attention(model, "flash", device=gpu, announce=True) == "flash"
    assert capsys.readouterr().out == "asyncgrpo: tree attention: flash, through flash-attn-4 4.0.0b40\n"
    monkeypatch.setenv("RANK", "3")
    ta.apply_tree_attention(model, "flash", device=gpu, announce=True)
    assert capsys.readouterr().out == ""
    with pytest.raises(ta.TreeAttentionUnavailable, match="needs a CUDA model"):
        ta.apply_tree_attention(model, "flash")  # no device given: the parameters' (the CPU)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_row_without_shared_prefixes_uses_its_keys_without_a_gather():
    row = pack_row([seq([first] + [3, 1, 4, 1, 5][: 2 + first]) for first in (0, 1, 2)])  # no common first token
    ctx = TreeAttentionInputs.from_row(row, "cpu", varlen_fn=fa4_like)
    plan = ctx.varlen_plan()
    assert plan.kv_index is None and plan.cu_seqlens_k.tolist() == plan.cu_seqlens_q.tolist()
    n = row.num_tokens
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    want, _ = _tree_attention("sdpa", None, q, k, v, None, 0.5, 0.0, tree_attention=TreeAttentionInputs.from_row(row, "cpu"))
    got, _ = _tree_attention("flash", None, q, k, v, None, 0.5, 0.0, tree_attention=ctx)
    assert torch.allclose(got, want, atol=1e-5)
    shared = _random_row()  # segments with parents keep the gather
    assert TreeAttentionInputs.from_row(shared, "cpu").varlen_plan().kv_index is not None
