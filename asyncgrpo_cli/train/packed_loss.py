"""The loss of one packed row, computed inside the model's own forward (SPEC §3.3, §6).

The policy's output-embedding module (``lm_head``) gets a forward that, while a `LossRequest` is active,
takes the row's final hidden states ``[1, L, H]``, gathers the trained tokens' prediction positions, and
runs the chunked loss (`asyncgrpo_cli.train.loss.loss_and_metrics`) with its own weight. Doing this inside
the root forward means the weight is the gathered one under FSDP2 and no ``[L, V]`` logits ever exist.
Outside a request the head behaves as before (generation, evaluation).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .logprobs import check_token_ids, chunked_token_logprobs
from .loss import LossConfig, PendingMetrics, check_sampler_logprobs, loss_and_metrics
from .moe_aux import MoeAuxLoss
from .packing import PackedRow
from .reference import Reference
from .tree_attention import packed_forward_kwargs

_ACTIVE: contextvars.ContextVar[LossRequest | None] = contextvars.ContextVar("asyncgrpo_loss_request", default=None)


@dataclass
class LossRequest:
    """One row's loss inputs and, after the forward, its outputs.

    Attributes:
        row: the packed row on the model's device.
        config: loss hyper-parameters.
        global_trained_tokens: trained tokens of this micro-batch summed over all ranks (B.9 normaliser).
        num_processes: data-parallel processes.
        global_samples: samples of this micro-batch over all ranks (``grpo``/``dr_grpo`` normalisers).
        reference: True for the reference forward (``beta`` > 0): the head only stores ``ref_logprobs``.
        ref_logprobs: ``[N]`` the reference's log-probs of the trained tokens, given to the policy's loss.
        values_checked: the row's ids and sampler log-probs were checked on the host (`check_row_values`): the
            loss skips its own value checks (device syncs).
        defer_metrics: the loss returns `loss.PendingMetrics` (read once per step), not a dict.
        loss: scalar loss (set by the head), already scaled per B.9.
        metrics: metric contributions (``loss.py`` format).
    """

    row: PackedRow
    config: LossConfig
    global_trained_tokens: int
    num_processes: int
    global_samples: int | None = None
    reference: bool = False
    ref_logprobs: torch.Tensor | None = None
    values_checked: bool = False
    defer_metrics: bool = False
    loss: torch.Tensor | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def _head_forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    request = _ACTIVE.get()
    if request is None:
        return F.linear(hidden, self.weight, getattr(self, "bias", None))
    row = request.row
    flat = hidden.reshape(-1, hidden.shape[-1])
    h = flat.index_select(0, row.predict_index)
    if request.reference:  # the reference policy's processed log-probs of the trained tokens (beta > 0)
        cfg = request.config
        request.ref_logprobs = chunked_token_logprobs(
            h, self.weight, row.target_ids, lm_head_bias=getattr(self, "bias", None), temperature=cfg.temperature,
            candidate_ids=row.candidate_ids, token_chunk_size=cfg.token_chunk_size,
            vocab_chunk_size=cfg.vocab_chunk_size, compile_backend=cfg.compile_backend,
            check_values=not request.values_checked).target_logprobs.detach()
        return hidden.new_zeros(hidden.shape[0], 1, 1)
    centering = request.config.score_centering
    top_ids = row.sampler_top_ids if centering else None
    top_lp = row.sampler_top_logprobs if centering else None
    loss, metrics = loss_and_metrics(
        h, self.weight, row.target_ids, row.advantages, row.sampler_logprobs, row.sample_index,
        global_num_trained_tokens=max(request.global_trained_tokens, 1), num_processes=request.num_processes,
        config=request.config, lm_head_bias=getattr(self, "bias", None), sampler_top_ids=top_ids,
        sampler_top_logprobs=top_lp, candidate_ids=row.candidate_ids, global_num_samples=request.global_samples,
        ref_logprobs=request.ref_logprobs, check_values=not request.values_checked, num_samples=row.num_samples,
        defer_metrics=request.defer_metrics)
    # Every parameter joins the graph even for an empty row, so data-parallel reductions stay in step.
    loss = loss + 0.0 * flat.sum() + 0.0 * self.weight.sum()
    request.loss = loss
    request.metrics = metrics
    # The loss stands in for the logits, so wrappers that trace the forward's outputs (DDP's unused-parameter
    # search) see the parameters the loss depends on.
    return loss.reshape(1, 1, 1).expand(hidden.shape[0], 1, 1)


def install_loss_head(model: torch.nn.Module) -> torch.nn.Module:
    """Give the model's output-embedding module the request-aware forward; returns that module.

    Raises:
        ValueError: the model has no output embeddings (``get_output_embeddings()`` is None).
    """
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); a causal LM is required")
    head.forward = types.MethodType(_head_forward, head)
    return head


def check_row_values(row: PackedRow, config: LossConfig, vocab: int) -> None:
    """The loss's value checks (ids in range, candidate sets, finite sampler log-probs) on the packer's CPU row,
    before it moves to the GPU: the same errors, no host-device sync per micro-batch.

    Raises:
        ValueError: as `logprobs.check_token_ids` and `loss.check_sampler_logprobs`.
    """
    check_token_ids(row.target_ids, row.sampler_top_ids if config.score_centering else None, row.candidate_ids,
                    vocab)
    check_sampler_logprobs(row.sampler_logprobs)


def micro_batch_sequences(rows: list[list[Any]]) -> int:
    """``S`` of the ``grpo`` / ``dr_grpo`` normalisers: the samples of one micro-batch over all ranks (``rows[r]``
    holds rank ``r``'s), every one counted, the untrained stubs of completions cut with
    ``mask_truncated_completions`` included (`rollout.sequences.untrained_stub`), as TRL counts rows with an
    empty mask (README "Loss variants")."""
    return sum(len(row) for row in rows)


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the output embeddings (through DDP-style ``.module`` wrappers), or None if not found."""
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def _routes(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return any(getattr(c, "output_router_logits", False) for c in (config, getattr(config, "text_config", None)))


def row_loss(model: torch.nn.Module, row: PackedRow, config: LossConfig, global_trained_tokens: int,
             num_processes: int = 1, moe_aux: MoeAuxLoss | None = None,
             global_samples: int | None = None, reference: Reference | None = None,
             defer_metrics: bool = False) -> tuple[torch.Tensor, dict[str, Any] | PendingMetrics]:
    """Forward one packed row through ``model`` (tree attention + loss head) and return ``(loss, metrics)``.

    The model must have been switched with ``apply_tree_attention`` and ``install_loss_head``. For an
    empty row (an idle rank in this micro-batch) one dummy token is forwarded and the loss is a zero that
    still reaches every parameter.

    With ``moe_aux`` (a MoE policy with a non-zero ``router_aux_loss_coef``, SPEC §3.3.5) the router logits of the
    row's forwarded tokens are recorded, ``coef × aux`` is added to the loss and ``aux_loss`` (unscaled) to the
    metrics (``moe_aux`` module). ``global_samples``: the micro-batch's samples over all ranks (needed by the
    ``grpo`` and ``dr_grpo`` loss types). With ``config.beta`` > 0, ``reference`` (`reference.Reference`) first
    runs the reference forward of the same row (no gradient) for the KL penalty.

    Host syncs (``scripts/bench/NOTES_host_syncs.md``): a CPU ``row`` is checked on the host
    (`check_row_values`), copied without a stream sync, and its segment table read from the CPU copy; with
    ``defer_metrics`` the metrics come back as `loss.PendingMetrics` for `loss.read_pending` to read with the
    step's other micro-batches in one sync, so the forward itself reads nothing back from the GPU.

    Returns:
        ``loss``: 0-dim float32 tensor (per B.9: this rank's token-loss sum / global trained tokens ×
        num_processes; the caller divides by ``gradient_accumulation_steps``); ``metrics``: contributions.
    """
    device = next(model.parameters()).device
    vocab = _vocab_size(model)
    host = row if row.input_ids.device.type == "cpu" and vocab is not None else None
    if host is not None:
        check_row_values(host, config, vocab)
    # H2D copies without a stream sync each (a blocking copy waits for the GPU, e.g. the last backward)
    row = row.to(device, non_blocking=True)
    kwargs = packed_forward_kwargs(row, device, host_row=host)
    checked = host is not None
    request = LossRequest(row=row, config=config, global_trained_tokens=global_trained_tokens,
                          num_processes=num_processes, global_samples=global_samples, values_checked=checked,
                          defer_metrics=defer_metrics)
    if config.beta > 0:
        if reference is None:
            raise ValueError(f"beta={config.beta} needs a reference policy: build it with Reference.for_policy")
        ref_request = LossRequest(row=row, config=config, global_trained_tokens=1, num_processes=1, reference=True,
                                  values_checked=checked)
        token = _ACTIVE.set(ref_request)
        try:
            no_aux = {"output_router_logits": False} if moe_aux is not None or _routes(model) else {}
            reference.forward(model, {**kwargs, **no_aux, "logits_to_keep": 0})
        finally:
            _ACTIVE.reset(token)
        request.ref_logprobs = ref_request.ref_logprobs
    token = _ACTIVE.set(request)
    recording = moe_aux.recorder.recording() if moe_aux is not None else contextlib.nullcontext([])
    try:
        if moe_aux is not None or _routes(model):  # the model's own aux-loss code would read the placeholder mask
            kwargs["output_router_logits"] = False
        with recording as router_logits:
            model(**kwargs, logits_to_keep=0)
    finally:
        _ACTIVE.reset(token)
    if request.loss is None:
        raise RuntimeError(f"{type(model).__name__}'s forward did not call its output embeddings; "
                           "install_loss_head(model) must run before row_loss")
    if moe_aux is not None:
        aux = moe_aux.of_row(row, router_logits)
        request.loss = request.loss + moe_aux.coef * aux
        if isinstance(request.metrics, PendingMetrics):  # read with the rest, no sync of its own
            m = request.metrics
            request.metrics = PendingMetrics(m.names + ["aux_loss"],
                                             torch.cat([m.values, aux.detach().double().reshape(1)]),
                                             {**m.counts, "aux_loss": 1.0}, m.ready)
        else:
            request.metrics = {**request.metrics, "aux_loss": (float(aux.detach()), 1.0)}
    return request.loss, request.metrics
