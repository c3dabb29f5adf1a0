"""No host-device sync per micro-batch in the trainer's hot path (scripts/bench/NOTES_host_syncs.md).

On a GPU every host read of a device tensor (``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()`` of a tensor,
``torch.unique``, ``nonzero``, ``bincount``) waits for the GPU. The CPU test counts those calls during one
micro-batch's ``row_loss`` (forward + loss) and its backward, outside the host-side checks of the CPU row
(`packed_loss.check_row_values`, which never touch the GPU): none may come back. The step's losses and metrics are
then read by one ``tolist`` (`loss.read_pending`). The GPU test runs the same with CUDA's sync debug mode on error.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.testing import make_tiny_model
from asyncgrpo_cli.train import packed_loss
from asyncgrpo_cli.train.loss import LossConfig, PendingMetrics, read_pending
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention

READS = [(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                                           "nonzero", "unique", "cpu", "numpy")]
READS += [(torch, name) for name in ("unique", "nonzero", "bincount")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _samples():
    rng = np.random.default_rng(0)

    def sample(ids, n_prompt, adv, group, k=3):
        trained = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        lp = [(-float(rng.random()) - 0.5) if t else 0.0 for t in trained]
        top = [[int(x) for x in rng.choice(300, size=k, replace=False)] if t else [] for t in trained]
        top_lp = [sorted((-float(rng.random()) * 3 for _ in range(k)), reverse=True) if t else [] for t in trained]
        return TrainingSequence(input_ids=ids, trained_mask=trained, sampler_logprobs=lp, advantage=adv,
                                group_id=group, row_index=0, model_version=0, sampler_top_ids=top,
                                sampler_top_logprobs=top_lp)

    prompt = [5, 9, 17, 33, 2]
    return [sample(prompt + [40, 41, 42], 5, 1.0, 0), sample(prompt + [50, 51], 5, -0.5, 0),
            sample(prompt + [50, 51], 5, -0.5, 0), sample([7, 8, 60, 61, 62, 63], 2, 0.3, 1)]


@contextlib.contextmanager
def counting_reads(monkeypatch):
    """Count host reads of tensor values (``READS``), except inside `packed_loss.check_row_values`."""
    calls: list[str] = []
    in_check = [0]

    def counted(owner, name, fn):
        def wrapper(*args, **kwargs):
            if not in_check[0]:
                calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return fn(*args, **kwargs)
        return wrapper

    for owner, name in READS:
        monkeypatch.setattr(owner, name, counted(owner, name, getattr(owner, name)))
    check = packed_loss.check_row_values

    def unchecked(*args, **kwargs):
        in_check[0] += 1
        try:
            return check(*args, **kwargs)
        finally:
            in_check[0] -= 1

    monkeypatch.setattr(packed_loss, "check_row_values", unchecked)
    yield calls
    monkeypatch.undo()


def _model(model_dir, device="cpu"):
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    apply_tree_attention(model, "sdpa")
    install_loss_head(model)
    return model


@pytest.mark.parametrize("config", [LossConfig(), LossConfig(score_centering=False, temperature=0.9)],
                         ids=["centering", "clipped"])
def test_micro_batch_reads_nothing_back(model_dir, monkeypatch, config):
    model = _model(model_dir)
    samples = _samples()
    trained = sum(s.num_trained_tokens for s in samples)
    reads = []
    for _ in range(2):  # two micro-batches, as the trainer's loop runs them
        row = pack_row(samples)  # on the host: pack_row's own CPU reads do not count (no GPU there)
        with counting_reads(monkeypatch) as calls:
            loss, metrics = row_loss(model, row, config, trained, 1, defer_metrics=True)
            (loss / 2).backward()
        assert calls == [], f"host reads of tensor values during one micro-batch: {calls}"
        assert isinstance(metrics, PendingMetrics)
        reads.append((loss.detach(), metrics))
    with counting_reads(monkeypatch) as calls:
        values, dicts = read_pending([r[0] for r in reads], [r[1] for r in reads])
    assert calls == ["Tensor.tolist"]  # the step's one sync
    # the deferred read gives what the per-micro-batch read gave
    loss, eager = row_loss(model, pack_row(samples), config, trained, 1)
    assert values[0] == float(loss.detach())
    assert dicts[0] == eager and dicts[1] == eager
    model.zero_grad(set_to_none=True)


def test_bad_ids_are_still_refused_on_the_host(model_dir):
    model = _model(model_dir)
    samples = _samples()
    samples[0].input_ids[-1] = 10**6  # outside the vocabulary
    with pytest.raises(ValueError, match="lm_head vocabulary"):
        row_loss(model, pack_row(samples), LossConfig(), 100, 1)
    samples = _samples()
    samples[1].sampler_logprobs[-1] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        row_loss(model, pack_row(samples), LossConfig(), 100, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_micro_batch_has_no_cuda_sync(model_dir):
    """On a GPU: CUDA's sync debug mode raises on any synchronising call in one micro-batch's forward + backward."""
    model = _model(model_dir, "cuda")
    samples = _samples()
    trained = sum(s.num_trained_tokens for s in samples)
    row_loss(model, pack_row(samples), LossConfig(), trained, 1, defer_metrics=True)[0].backward()  # warm-up
    torch.cuda.synchronize()
    row = pack_row(samples)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = row_loss(model, row, LossConfig(), trained, 1, defer_metrics=True)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    values, _ = read_pending([loss.detach()], [metrics])
    assert np.isfinite(values[0])
