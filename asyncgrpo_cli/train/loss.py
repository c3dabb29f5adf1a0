"""The trainer's policy loss: score centering or clipped surrogate, masked IS, B.9 normalisation (SPEC §3.3).

The defaults are SPEC §3.3 exactly (``loss_type="dapo"``, ``importance_sampling_level="token"``,
``vllm_importance_sampling_mode="token_mask"``). The other values of these TRL ``GRPOConfig`` names pick
another normaliser (``grpo``, ``bnpo``, ``dr_grpo``), objective (``cispo``), ratio (GSPO's sequence ratio)
or off-policy correction (truncated / per-sequence IS); README "Loss variants" has the formulas.

Entry point: :func:`loss_and_metrics`, called once per micro-batch row with the trained tokens' hidden
states (tree packing gathers them). It returns the scalar loss to back-propagate and this micro-batch's
contributions to the training metrics of SPEC §15.2. The log-prob kernel lives in :mod:`.logprobs`.

Metric contributions (``dict[str, tuple[float, float] | float]``):

- names ending in ``mean`` (``entropy``, ``sampling/*/mean``, ``sampling/masked_mean``,
  ``sampling/sampler_mass``, ``clip_ratio/*_mean``) map to a ``(sum, count)`` pair over trained tokens:
  sum the pairs across micro-batches and ranks, then divide;
- names ending in ``min`` / ``max`` map to a plain float: reduce with ``min`` / ``max``. They are absent
  when the micro-batch has no trained token.

:func:`merge_metric_contributions` and :func:`finalize_metrics` do exactly that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.loss_rules import IS_LEVELS, IS_MODES, LOSS_TYPES  # noqa: F401  (re-exported)
from .logprobs import DEFAULT_TOKEN_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE, chunked_token_logprobs

__all__ = [
    "IS_MODES",
    "LOSS_TYPES",
    "LossConfig",
    "loss_and_metrics",
    "TokenTerms",
    "token_terms",
    "token_losses",
    "normalised_loss",
    "k3_kl",
    "loss_scale",
    "merge_metric_contributions",
    "finalize_metrics",
    "PendingMetrics",
    "read_pending",
    "check_sampler_logprobs",
]

MetricValue = tuple[float, float] | float



@dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (SPEC §3.3, §16.2 names in brackets).

    Attributes:
        score_centering: default objective (§3.3.2) when True, clipped surrogate (§3.3.3) when False.
        epsilon: ε_low [``epsilon``], fraction (default 0.2).
        epsilon_high: ε_high [``epsilon_high``]; ``None`` = ``epsilon``.
        clip_min, clip_max: IS-correction bounds C_min, C_max [``vllm_importance_sampling_clip_min/max``];
            ``None`` = no bound on that side (a ``*_truncate`` mode needs at least one).
        temperature: sampling temperature; the trainer divides logits by it (B.10).
        token_chunk_size, vocab_chunk_size: tile of the chunked log-prob kernel (tokens, vocabulary rows).
        compile_backend: ``torch.compile`` backend of the kernel's per-tile work, or None (eager); set from
            [``torch_compile``] / [``torch_compile_backend``].
        loss_type: normaliser / objective [``loss_type``], one of :data:`LOSS_TYPES` (default ``dapo``).
        importance_sampling_level: [``importance_sampling_level``] ``token`` or ``sequence`` (GSPO).
        is_mode: off-policy correction [``vllm_importance_sampling_mode``], one of :data:`IS_MODES`.
        max_completion_length: tokens, the ``dr_grpo`` constant [``max_completion_length``].
        beta: KL coefficient [``beta``] of the k3 penalty to the reference policy (0 = none, the default).

    Raises:
        ValueError: ``epsilon``/``epsilon_high`` < 0, ``epsilon`` ≥ 1, ``clip_min`` < 0, ``clip_max`` ≤ 0,
            ``clip_min`` > ``clip_max``, a truncate mode without either bound, ``temperature`` ≤ 0, chunk sizes < 1, an unknown ``loss_type``,
            level or mode, ``cispo`` without ``epsilon_high`` > 0, score centering with ``cispo``, the
            sequence level or a sequence IS mode, ``max_completion_length`` < 1.
    """

    score_centering: bool = True
    epsilon: float = 0.2
    epsilon_high: float | None = None
    clip_min: float | None = 0.5
    clip_max: float | None = 5.0
    temperature: float = 1.0
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK_SIZE
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE
    compile_backend: str | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    is_mode: str = "token_mask"
    max_completion_length: int = 2048
    beta: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon!r}; default 0.2")
        if self.epsilon_high is not None and not self.epsilon_high >= 0.0:
            raise ValueError(f"epsilon_high must be >= 0 or None (= epsilon), got {self.epsilon_high!r}")
        lo = 0.0 if self.clip_min is None else self.clip_min
        hi = math.inf if self.clip_max is None else self.clip_max
        if not (0.0 <= lo <= hi and hi > 0):
            raise ValueError(
                f"vllm_importance_sampling_clip_min/max must satisfy 0 <= min <= max, max > 0 (None = no bound), "
                f"got min={self.clip_min!r}, max={self.clip_max!r}; defaults 0.5 and 5.0"
            )
        if self.is_mode.endswith("truncate") and self.clip_min is None and self.clip_max is None:
            raise ValueError(f"vllm_importance_sampling_mode={self.is_mode!r} truncates to [C_min, C_max] but both "
                             "bounds are None; set vllm_importance_sampling_clip_max (e.g. 3.0) or clip_min")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        for name in ("token_chunk_size", "vocab_chunk_size", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, allowed in (("loss_type", LOSS_TYPES), ("importance_sampling_level", IS_LEVELS),
                              ("is_mode", IS_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0 (0 = no KL penalty), got {self.beta!r}")
        if self.loss_type == "cispo" and not (self.epsilon_high is not None and self.epsilon_high > 0):
            raise ValueError(f"loss_type='cispo' caps the importance weight at epsilon_high (its ε_max); got "
                             f"epsilon_high={self.epsilon_high!r}; set epsilon_high, e.g. 5.0")
        if self.score_centering and (self.loss_type == "cispo" or self.importance_sampling_level == "sequence"
                                     or self.is_mode.startswith("sequence")):
            raise ValueError(
                f"score_centering=True is a per-token objective: it does not combine with loss_type="
                f"{self.loss_type!r}, importance_sampling_level={self.importance_sampling_level!r}, "
                f"vllm_importance_sampling_mode={self.is_mode!r}; set score_centering=False")

    @property
    def eps_high(self) -> float:
        """ε_high with the ``None`` default resolved to ε_low."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> LossConfig:
        """Build from an ``AsyncGRPOConfig`` (SPEC field names), with keyword ``overrides`` winning."""
        values = dict(
            score_centering=args.score_centering,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
            temperature=args.temperature,
            loss_type=getattr(args, "loss_type", "dapo"),
            importance_sampling_level=getattr(args, "importance_sampling_level", "token"),
            is_mode=getattr(args, "vllm_importance_sampling_mode", "token_mask"),
            max_completion_length=getattr(args, "max_completion_length", 2048),
            beta=getattr(args, "beta", 0.0),
            compile_backend=((getattr(args, "torch_compile_backend", None) or "inductor")
                             if getattr(args, "torch_compile", False) else None),
        )
        values.update(overrides)
        return cls(**values)


def loss_scale(global_num_trained_tokens: float, num_processes: int) -> float:
    """Factor turning a rank's summed token losses into its micro-batch loss (SPEC Appendix B.9).

    ``rank loss = Σ token losses × num_processes / global_num_trained_tokens``, where the global count is
    the micro-batch's trained tokens summed over all ranks. With the data-parallel gradient *mean* over
    ranks, the effective gradient is Σ over all ranks' tokens / global count. Averaging over the
    ``gradient_accumulation_steps`` micro-batches of a step is the caller's (HF ``Trainer`` divides each
    micro-batch loss by it).

    Returns 0.0 when ``global_num_trained_tokens`` is 0 (every row empty: nothing to learn).

    Raises:
        ValueError: ``num_processes`` < 1 or ``global_num_trained_tokens`` < 0.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not global_num_trained_tokens >= 0:
        raise ValueError(f"global_num_trained_tokens must be >= 0, got {global_num_trained_tokens!r}")
    if global_num_trained_tokens == 0:
        return 0.0
    return num_processes / float(global_num_trained_tokens)


@dataclass
class TokenTerms:
    """Per-token results of :func:`token_terms`.

    Attributes:
        losses: ``[N]`` in the log-probs' dtype, differentiable: ``ℓ_t`` before normalisation.
        ratio: ``[N]`` float64, detached token ratio ``r_t = π̃_θ(o_t)/μ(o_t)`` (unclamped, may be ``inf``).
        low, high: ``[N]`` bool, ratio below ``1 − ε_low`` / above ``1 + ε_high`` (the trust region; the
            sequence ratio at the sequence level; for ``cispo`` ``low`` is empty and ``high`` is ratio > ε_max).
        corrected: ``[N]`` bool, tokens the off-policy correction changed (masked out or truncated).
    """

    losses: torch.Tensor
    ratio: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    corrected: torch.Tensor


_SAFE_LOG = 50.0  # exp(50) ≈ 5e21 stays finite in float32; bounds exponents a correction leaves unbounded


def _log_truncation(log_is: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """``log(clamp(x, C_min, C_max) / x)`` from ``log x`` (float64, 0 where x lies inside the bounds; a ``None``
    bound is no bound)."""
    lo = math.log(clip_min) if clip_min else -math.inf
    hi = math.log(clip_max) if clip_max is not None else math.inf
    return log_is.clamp(min=lo, max=hi) - log_is


def _within(x: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """``1[C_min ≤ x ≤ C_max]`` (bool, same shape), a ``None`` bound being no bound."""
    inside = torch.ones_like(x, dtype=torch.bool)
    if clip_min is not None:
        inside = inside & (x >= clip_min)
    if clip_max is not None:
        inside = inside & (x <= clip_max)
    return inside


def _mask_cap(config: LossConfig) -> float:
    """Largest log-ratio worth exponentiating where tokens above C_max are masked anyway (no inf·0 = NaN)."""
    return math.log(config.clip_max) + 1.0 if config.clip_max is not None else _SAFE_LOG


def _sample_inverse(sample_index: torch.Tensor | None, n: int) -> tuple[torch.Tensor, int]:
    if sample_index is None:
        raise ValueError("the sequence importance-sampling level, a sequence_* correction mode and the grpo / "
                         "dr_grpo normalisers need sample_index ([N], which sample each token belongs to)")
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=sample_index.device), 0
    _, inverse = torch.unique(sample_index, return_inverse=True)
    return inverse, int(inverse.max()) + 1


def _per_sample_sum(values: torch.Tensor, inverse: torch.Tensor, num: int) -> torch.Tensor:
    return torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, inverse, values)


def token_terms(
    target_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    config: LossConfig,
    *,
    top_logprobs: torch.Tensor | None = None,
    top_valid: torch.Tensor | None = None,
    sampler_top_logprobs: torch.Tensor | None = None,
    sample_index: torch.Tensor | None = None,
) -> TokenTerms:
    """Per-token losses of the configured objective and what the metrics need (SPEC §3.3; README "Loss variants").

    With ``r_t = exp(log π̃_θ(o_t) − log μ(o_t))``, ``[C_min, C_max]`` the bounds (``None`` = none on that side)
    and ``ρ_i = Π_{t∈i} r_t`` over the trained tokens of the token's sample ``i``:

    - the token modes give each token a constant factor ``c_t``: ``token_mask`` (SPEC §3.3.1)
      ``c_t = 1[C_min ≤ r_t ≤ C_max]``, ``token_truncate`` ``c_t = clamp(r_t, C_min, C_max)/r_t``;
    - the sequence modes (TRL's) weigh every token of sample ``i`` by ``W_i``: ``sequence_mask``
      ``W_i = ρ_i 1[C_min ≤ ρ_i ≤ C_max]``, ``sequence_truncate`` ``W_i = clamp(ρ_i, C_min, C_max)``.

    Then, with ``q_t`` the trust-region ratio (``q_t = r_t`` at the token level; at the sequence level, GSPO,
    ``q_t = s_i = exp(mean_{u∈i} log r_u)``, differentiable through every token of the sample):

    - score centering (§3.3.2, B.8): ``ℓ_t = −Â_t (c_t r_t − Σ_{v∈top-K_t} c_v π̃_θ(v))`` with ``c_v`` the
      token mode's factor of ``r_v = π̃_θ(v)/μ(v)``; the sum is over the valid top ids as returned, NOT
      renormalised. A masked token (``c_t = 0``) keeps its centering term. Token modes only;
    - clipped surrogate (§3.3.3), ``loss_type`` ``dapo``/``grpo``/``bnpo``/``dr_grpo``: token modes
      ``ℓ_t = −c_t min(q_t Â_t, clip(q_t, 1−ε_low, 1+ε_high) Â_t)``; sequence modes
      ``ℓ_t = −W_i min(q_t Â_t, clip(q_t, 1−ε_low, 1+ε_high) Â_t) / sg[q_t]``: value ``−W_i Â_t`` and gradient
      ``−W_i Â_t ∇log q_t`` where the trust region does not clip (TRL's ``_compute_loss`` with its old policy
      equal to the current one), no gradient where it clips;
    - ``cispo``: token modes ``ℓ_t = −c_t sg[min(q_t, ε_max)] Â_t log π̃_θ(o_t)``, ``ε_max`` = ``epsilon_high``;
      sequence modes ``ℓ_t = −W_i sg[min(q_t, ε_max)/q_t] Â_t log π̃_θ(o_t)``.

    Args:
        target_logprobs: ``[N]`` float, differentiable, ``log π̃_θ(o_t)``.
        advantages: ``[N]`` float, ``Â`` of each token's sample.
        sampler_logprobs: ``[N]`` float, the sampler's processed ``log μ(o_t)``.
        config: :class:`LossConfig`.
        top_logprobs: ``[N, K]`` float, differentiable, ``log π̃_θ(v)`` at the sampler's top ids
            (score centering only).
        top_valid: ``[N, K]`` bool, which entries of ``top_logprobs`` are real.
        sampler_top_logprobs: ``[N, K]`` float, ``log μ(v)``; non-finite entries (``-inf`` for ids outside
            the sampler's candidate set) are skipped.
        sample_index: ``[N]`` int, which sample each token belongs to (needed by the sequence level and the
            sequence modes; only equality matters).

    Raises:
        ValueError: score centering without ``top_logprobs``/``top_valid``/``sampler_top_logprobs``; a
            sequence level or mode without ``sample_index``.
    """
    dt = target_logprobs.dtype
    adv = advantages.to(dt)
    log_ratio = target_logprobs - sampler_logprobs.to(dt)
    ratio_detached = log_ratio.detach().double().exp()
    n = target_logprobs.shape[0]
    mode, sequence_level = config.is_mode, config.importance_sampling_level == "sequence"
    inverse, num = (None, 0)
    if sequence_level or mode.startswith("sequence"):
        inverse, num = _sample_inverse(sample_index, n)
    log_is = log_ratio.detach().double()
    if mode.startswith("sequence"):
        log_is = _per_sample_sum(log_is, inverse, num)[inverse]  # log ρ_i on each token of sample i
    in_range = log_factor = None
    if mode.endswith("mask"):
        is_ratio = log_is.exp() if mode.startswith("sequence") else ratio_detached
        in_range = _within(is_ratio, config.clip_min, config.clip_max)
        corrected = ~in_range
    else:
        log_factor = _log_truncation(log_is, config.clip_min, config.clip_max)
        corrected = log_factor != 0
    zero = torch.zeros((), dtype=dt, device=target_logprobs.device)
    low = ratio_detached < 1.0 - config.epsilon
    high = ratio_detached > 1.0 + config.eps_high
    if config.score_centering:
        if top_logprobs is None or top_valid is None or sampler_top_logprobs is None:
            raise ValueError(
                "score_centering=True needs top_logprobs, top_valid and sampler_top_logprobs (the sampler's "
                "top-num_sampler_logprobs per token); request them from the sampler or set score_centering=False"
            )
        mu_top = sampler_top_logprobs.to(dt)
        valid = top_valid & torch.isfinite(mu_top)
        if mode == "token_mask":  # SPEC §3.3.2 as written
            # Clamp only where the token is masked anyway, so exp never overflows into inf·0 = NaN gradients.
            ratio = log_ratio.clamp(max=_mask_cap(config)).exp()
            ratio_top = torch.where(valid, top_logprobs.detach() - mu_top, zero).exp()
            in_top = valid & _within(ratio_top, config.clip_min, config.clip_max)
            centering = torch.where(in_top, top_logprobs.exp(), zero).sum(dim=1)
            losses = -adv * (torch.where(in_range, ratio, zero) - centering)
        else:  # token_truncate: f(r) = clamp(r, C_min, C_max), value and gradient weight
            log_r_top = torch.where(valid, top_logprobs.detach() - mu_top, zero).double()
            log_f_top = _log_truncation(log_r_top, config.clip_min, config.clip_max).to(dt)
            centering = torch.where(valid, (top_logprobs + log_f_top).exp(), zero).sum(dim=1)
            losses = -adv * ((log_ratio + log_factor.to(dt)).exp() - centering)
        return TokenTerms(losses, ratio_detached, low, high, corrected)
    log_q = log_ratio
    if sequence_level:
        counts = _per_sample_sum(torch.ones_like(log_ratio), inverse, num)
        log_q = (_per_sample_sum(log_ratio, inverse, num) / counts)[inverse]
        q_detached = log_q.detach().double().exp()
        low, high = q_detached < 1.0 - config.epsilon, q_detached > 1.0 + config.eps_high
    if mode.startswith("sequence"):
        return TokenTerms(_sequence_is_losses(target_logprobs, adv, log_q, log_is, in_range, log_factor, config),
                          ratio_detached, low, high, corrected)
    if config.loss_type == "cispo":
        weight = log_q.detach().clamp(max=_SAFE_LOG).exp().clamp(max=config.eps_high)
        high = log_q.detach().double().exp() > config.eps_high
        low = torch.zeros_like(high)
        if in_range is not None:
            losses = torch.where(in_range, -weight * adv * target_logprobs, zero)
        else:
            losses = -(log_factor.to(dt).exp() * weight) * adv * target_logprobs
        return TokenTerms(losses, ratio_detached, low, high, corrected)
    if in_range is not None and not sequence_level:  # SPEC §3.3.3 as written
        ratio = log_ratio.clamp(max=_mask_cap(config)).exp()
        clipped = ratio.clamp(1.0 - config.epsilon, 1.0 + config.eps_high)
        surrogate = torch.minimum(ratio * adv, clipped * adv)
        losses = torch.where(in_range, -surrogate, zero)
    elif in_range is not None:  # masked tokens get q = 1 (finite), then zero
        q = torch.where(in_range, log_q, zero).clamp(max=_SAFE_LOG).exp()
        clipped = q.clamp(1.0 - config.epsilon, 1.0 + config.eps_high)
        losses = torch.where(in_range, -torch.minimum(q * adv, clipped * adv), zero)
    else:  # truncation: c_t q_t as one exponent (value c·q, gradient c·q·∇ log q)
        factor = log_factor.to(dt)
        cap = math.log(1.0 + config.eps_high) + 1.0
        unclipped = (log_q + factor).clamp(max=_SAFE_LOG).exp() * adv
        clipped = factor.exp() * log_q.clamp(max=cap).exp().clamp(1.0 - config.epsilon, 1.0 + config.eps_high) * adv
        losses = -torch.minimum(unclipped, clipped)
    return TokenTerms(losses, ratio_detached, low, high, corrected)


def _sequence_is_losses(target_logprobs, adv, log_q, log_is, in_range, log_factor, config) -> torch.Tensor:
    """Token losses of the sequence IS modes (:func:`token_terms`): the weight ``W_i`` of the token's sample times
    the trust-region surrogate divided by its own ratio's value, ``min(q Â, clip(q) Â) / sg[q]`` (``cispo``:
    ``sg[min(q, ε_max)/q] Â log π``). ``log_is`` is ``log ρ_i`` per token (float64, detached)."""
    dt = target_logprobs.dtype
    if in_range is not None:  # sequence_mask: W = ρ 1[ρ within the bounds]
        log_w = torch.where(in_range, log_is, torch.full_like(log_is, -math.inf))
    else:  # sequence_truncate: W = clamp(ρ, C_min, C_max)
        log_w = log_is + log_factor
    log_w = log_w.clamp(max=_SAFE_LOG)
    lq = log_q.detach().double().clamp(-_SAFE_LOG, _SAFE_LOG)  # log of the trust-region ratio's value
    if config.loss_type == "cispo":
        factor = (log_w + (math.log(config.eps_high) - lq).clamp(max=0.0)).exp().to(dt)  # W min(q, ε_max)/q
        return -factor * adv * target_logprobs
    unit = (log_q - log_q.detach()).exp()  # value 1, gradient ∇log q
    inverse = (-lq).exp()
    clipped = torch.clamp(unit, min=((1.0 - config.epsilon) * inverse).to(dt),
                          max=((1.0 + config.eps_high) * inverse).to(dt))
    return -log_w.exp().to(dt) * torch.minimum(unit * adv, clipped * adv)


def token_losses(
    target_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    config: LossConfig,
    *,
    top_logprobs: torch.Tensor | None = None,
    top_valid: torch.Tensor | None = None,
    sampler_top_logprobs: torch.Tensor | None = None,
    sample_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_terms`' ``(losses, ratio)``: ``losses`` ``[N]`` in ``target_logprobs``' dtype
    (differentiable), ``ratio`` ``[N]`` float64 detached ``r_t`` (unclamped, may be ``inf``). Same arguments
    and errors as :func:`token_terms`."""
    terms = token_terms(target_logprobs, advantages, sampler_logprobs, config, top_logprobs=top_logprobs,
                        top_valid=top_valid, sampler_top_logprobs=sampler_top_logprobs, sample_index=sample_index)
    return terms.losses, terms.ratio


def k3_kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π_θ ‖ π_ref) per token: ``exp(d) − d − 1`` with ``d = log π_ref − log π_θ``.

    Args:
        ref_logprobs: ``[N]`` float, the reference's log-probs of the trained tokens (constants).
        logprobs: ``[N]`` float, the policy's, differentiable.

    Returns:
        ``[N]`` in ``logprobs``' dtype, ≥ 0, zero where the two agree.
    """
    d = ref_logprobs.to(logprobs.dtype) - logprobs
    return torch.expm1(d) - d


def normalised_loss(losses: torch.Tensor, sample_index: torch.Tensor, config: LossConfig, *,
                    global_num_trained_tokens: float, num_processes: int = 1,
                    global_num_samples: float | None = None) -> torch.Tensor:
    """This rank's micro-batch loss from its per-token losses, by ``config.loss_type`` (README "Loss variants").

    With ``P`` = ``num_processes``, ``T`` = the micro-batch's trained tokens over all ranks, ``S`` = its
    samples over all ranks (every sample: with ``mask_truncated_completions`` the untrained stubs of cut
    completions too, as TRL counts its rows with an empty mask), ``n`` = this rank's tokens:

    - ``dapo``, ``cispo`` (SPEC §3.3.4, B.9): ``Σ_t ℓ_t × P / T``;
    - ``bnpo``: ``Σ_t ℓ_t / n`` (this rank's tokens only; 0 for an empty row);
    - ``grpo``: ``Σ_i mean_{t∈i} ℓ_t × P / S`` (the mean over the micro-batch's samples of their token means);
    - ``dr_grpo``: ``Σ_t ℓ_t × P / (S × max_completion_length)``.

    The data-parallel gradient mean over ranks then gives the stated mean; averaging over the
    ``gradient_accumulation_steps`` micro-batches is the caller's.

    Args:
        losses: ``[N]`` float token losses (differentiable). sample_index: ``[N]`` int, sample of each token.

    Raises:
        ValueError: ``grpo``/``dr_grpo`` without ``global_num_samples`` or with fewer than this rank's samples.
    """
    n = losses.shape[0]
    if config.loss_type in ("dapo", "cispo"):
        return losses.sum() * loss_scale(global_num_trained_tokens, num_processes)
    if config.loss_type == "bnpo":
        return losses.sum() / n if n else losses.sum()
    inverse, num = _sample_inverse(sample_index, n)
    if global_num_samples is None or global_num_samples < num:
        raise ValueError(f"loss_type={config.loss_type!r} needs global_num_samples (this micro-batch's samples summed "
                         f"over all ranks, >= this rank's {num}); got {global_num_samples!r}")
    if num == 0:
        return losses.sum()
    scale = num_processes / float(global_num_samples)
    if config.loss_type == "dr_grpo":
        return losses.sum() * (scale / config.max_completion_length)
    counts = _per_sample_sum(torch.ones_like(losses), inverse, num)
    return (_per_sample_sum(losses, inverse, num) / counts).sum() * scale


def _check_vector(name: str, t: torch.Tensor, n: int, floating: bool) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape [N]=[{n}] (one entry per trained token), got {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got dtype {t.dtype}")
    if not floating and t.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")


def loss_and_metrics(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    sample_index: torch.Tensor,
    *,
    global_num_trained_tokens: float,
    num_processes: int = 1,
    config: LossConfig | None = None,
    lm_head_bias: torch.Tensor | None = None,
    sampler_top_ids: torch.Tensor | None = None,
    sampler_top_logprobs: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    global_num_samples: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    check_values: bool = True,
    num_samples: int | None = None,
    defer_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, MetricValue] | PendingMetrics]:
    """Loss of one micro-batch row on this rank, and its metric contributions (SPEC §3.3, §15.2, B.8–B.10, B.14).

    Args:
        hidden: ``[N, H]`` float, requires grad: hidden states at each trained token's prediction index.
        lm_head_weight: ``[V, H]`` (unsharded) output projection; ``lm_head_bias``: optional ``[V]``.
        target_ids: ``[N]`` int64 trained tokens.
        advantages: ``[N]`` float32 advantage of each token's sample.
        sampler_logprobs: ``[N]`` float32 processed sampler log-probs (must be finite).
        sample_index: ``[N]`` int64, which sample (completion) each token belongs to; only equality
            matters (per-completion clip fractions, B.14).
        global_num_trained_tokens: trained tokens of this micro-batch summed over all ranks (>= N).
        num_processes: data-parallel world size (B.9).
        config: :class:`LossConfig` (default: SPEC defaults).
        sampler_top_ids: ``[N, K]`` int64 sampler top ids, ``-1`` padded (required with score centering).
        sampler_top_logprobs: ``[N, K]`` float32 their processed log-probs (padding entries ignored).
        candidate_ids: ``[N, M]`` int64 candidate sets, ``-1`` padded, ids unique per row; an all-padding
            row (or ``None`` for the whole tensor) means the full vocabulary (SPEC §7).
        global_num_samples: samples of this micro-batch summed over all ranks (``grpo``/``dr_grpo`` only).
        ref_logprobs: ``[N]`` float, the reference policy's processed log-probs of the trained tokens
            (required when ``config.beta`` > 0): ``beta × k3`` is added to each token loss, ``kl`` logged.
        check_values: check the values of the sampler log-probs and ids here (host reads, a device sync each on a
            GPU); False when the caller checked them on the host (`packed_loss.check_row_values`).
        num_samples: an int above every ``sample_index`` value (the row's samples), known on the host: the
            per-sample clip fractions then need no ``torch.unique`` (a device sync); None = ``unique``.
        defer_metrics: return the metrics as :class:`PendingMetrics` (device values, read later with every other
            micro-batch's in one sync, :func:`read_pending`) instead of a dict read here.

    Returns:
        ``(loss, metrics)``: ``loss`` is a float32 (float64 for float64 inputs) scalar,
        :func:`normalised_loss` of the token losses (default ``dapo``:
        ``Σ_t ℓ_t × num_processes / global_num_trained_tokens``); ``metrics`` maps SPEC §15.2 names to
        ``(sum, count)`` pairs (``*mean`` names, and ``entropy``) or floats (``*min``/``*max`` names), see
        the module docstring. ``sampling/sampler_mass`` only with score centering. The ``clip_ratio/*``
        and ``sampling/importance_sampling_ratio/*`` populations are all trained tokens, before masking.

    Raises:
        ValueError: mismatched shapes, non-finite sampler log-probs, missing top ids with score
            centering, ``global_num_trained_tokens`` < N, or any error of :func:`chunked_token_logprobs`.
    """
    config = config or LossConfig()
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    n = hidden.shape[0]
    _check_vector("advantages", advantages, n, floating=True)
    _check_vector("sampler_logprobs", sampler_logprobs, n, floating=True)
    _check_vector("sample_index", sample_index, n, floating=False)
    if isinstance(global_num_trained_tokens, torch.Tensor):
        global_num_trained_tokens = float(global_num_trained_tokens.item())
    if global_num_trained_tokens < n:
        raise ValueError(
            f"global_num_trained_tokens={global_num_trained_tokens} is smaller than this rank's {n} trained "
            "tokens; pass the micro-batch's trained tokens summed over all ranks"
        )
    scale = loss_scale(global_num_trained_tokens, num_processes)
    if check_values:
        check_sampler_logprobs(sampler_logprobs)
    if config.score_centering:
        if sampler_top_ids is None or sampler_top_logprobs is None:
            raise ValueError(
                "score_centering=True needs sampler_top_ids and sampler_top_logprobs ([N, K], K = "
                "num_sampler_logprobs); set num_sampler_logprobs > 0 or score_centering=False"
            )
    if (sampler_top_ids is None) != (sampler_top_logprobs is None):
        raise ValueError("give sampler_top_ids and sampler_top_logprobs together (both [N, K]) or neither")
    if sampler_top_ids is not None and tuple(sampler_top_ids.shape) != tuple(sampler_top_logprobs.shape):
        raise ValueError(
            f"sampler_top_ids {tuple(sampler_top_ids.shape)} and sampler_top_logprobs "
            f"{tuple(sampler_top_logprobs.shape)} must have the same [N, K] shape"
        )

    lp = chunked_token_logprobs(
        hidden, lm_head_weight, target_ids,
        lm_head_bias=lm_head_bias,
        temperature=config.temperature,
        top_ids=sampler_top_ids if config.score_centering else None,
        candidate_ids=candidate_ids,
        token_chunk_size=config.token_chunk_size,
        vocab_chunk_size=config.vocab_chunk_size,
        compile_backend=config.compile_backend,
        check_values=check_values,
    )
    terms = token_terms(
        lp.target_logprobs, advantages, sampler_logprobs, config,
        top_logprobs=lp.top_logprobs, top_valid=lp.top_valid, sampler_top_logprobs=sampler_top_logprobs,
        sample_index=sample_index,
    )
    if config.beta > 0:
        if ref_logprobs is None or tuple(ref_logprobs.shape) != (n,):
            raise ValueError(f"beta={config.beta} needs ref_logprobs [N]=[{n}] (the reference policy's log-probs of the "
                             f"trained tokens), got {None if ref_logprobs is None else tuple(ref_logprobs.shape)}")
        kl = k3_kl(ref_logprobs, lp.target_logprobs)
        terms.losses = terms.losses + config.beta * kl
    if config.loss_type in ("dapo", "cispo"):
        loss = terms.losses.sum() * scale
    else:
        loss = normalised_loss(terms.losses, sample_index, config, global_num_trained_tokens=global_num_trained_tokens,
                               num_processes=num_processes, global_num_samples=global_num_samples)
    metrics = _metrics(lp.target_logprobs.detach(), terms, lp.entropy, sampler_logprobs, sample_index,
                       sampler_top_ids, sampler_top_logprobs, config, num_samples,
                       kl.detach() if config.beta > 0 else None)
    return loss, (metrics if defer_metrics else metrics.read())


def check_sampler_logprobs(sampler_logprobs: torch.Tensor) -> None:
    """Every trained token's sampler log-prob is finite (a host read: run on the CPU copy in the trainer).

    Raises:
        ValueError: names the first non-finite entry.
    """
    if sampler_logprobs.numel() and not bool(torch.isfinite(sampler_logprobs).all()):
        bad = int((~torch.isfinite(sampler_logprobs)).nonzero()[0, 0])
        raise ValueError(
            f"sampler_logprobs[{bad}]={float(sampler_logprobs[bad])} is not finite; every trained token needs "
            "the sampler's log-prob of the token it drew"
        )


@dataclass
class PendingMetrics:
    """A micro-batch's metric contributions still on the device: ``values`` ``[k]`` float64 for ``names``;
    ``counts[name]`` is the count of a ``(sum, count)`` name (absent: a min/max float); ``ready`` holds values
    already on the host. :meth:`read` (one sync) or :func:`read_pending` (one sync for many) gives the dict."""

    names: list[str]
    values: torch.Tensor
    counts: dict[str, float]
    ready: dict[str, MetricValue] = field(default_factory=dict)

    def resolve(self, values: list[float]) -> dict[str, MetricValue]:
        out: dict[str, MetricValue] = {}
        for name, value in zip(self.names, values, strict=True):
            out[name] = (value, self.counts[name]) if name in self.counts else value
        out.update(self.ready)
        return out

    def read(self) -> dict[str, MetricValue]:
        return self.resolve(self.values.tolist())  # one device sync


def read_pending(tensors: list[torch.Tensor], metrics: list[Any]) -> tuple[list[float], list[dict[str, MetricValue]]]:
    """Read the 0-dim ``tensors`` (e.g. the micro-batches' detached losses) and every :class:`PendingMetrics` of
    ``metrics`` (dicts pass through) in one host-device sync; returns ``(floats, metric dicts)``. A tensor's float
    is the same as ``float(t)``: every float dtype widens to float64 exactly."""
    pending = [m for m in metrics if isinstance(m, PendingMetrics)]
    parts = [t.detach().reshape(1).double() for t in tensors] + [p.values.reshape(-1) for p in pending]
    if not parts:
        return [], list(metrics)
    flat = torch.cat([p.to(parts[0].device) for p in parts]).tolist()  # the one sync
    floats, at = flat[:len(tensors)], len(tensors)
    out = []
    for m in metrics:
        if isinstance(m, PendingMetrics):
            out.append(m.resolve(flat[at:at + len(m.names)]))
            at += len(m.names)
        else:
            out.append(m)
    return floats, out


@torch.no_grad()
def _metrics(target_lp, terms, entropy, sampler_lp, sample_index, top_ids, top_lp, config, num_samples=None,
             kl=None) -> PendingMetrics:
    """Metric contributions of one micro-batch (see the module docstring for the format).

    ``sampling/masked_mean`` is the fraction of tokens the off-policy correction changed (masked, or
    truncated in the ``*_truncate`` modes); ``clip_ratio/*`` count the ratio the trust region clips."""
    n = target_lp.shape[0]
    f64 = torch.float64
    ratio = terms.ratio
    logp_diff = (target_lp.to(f64) - sampler_lp.to(f64)).abs()
    masked, low, high = terms.corrected, terms.low, terms.high
    sums = {
        "entropy": entropy.to(f64).sum(),
        "sampling/sampling_logp_difference/mean": logp_diff.sum(),
        "sampling/importance_sampling_ratio/mean": ratio.sum(),
        "sampling/masked_mean": masked.to(f64).sum(),
        "clip_ratio/region_mean": (low | high).to(f64).sum(),
        "clip_ratio/low_mean": low.to(f64).sum(),
        "clip_ratio/high_mean": high.to(f64).sum(),
    }
    if config.score_centering:
        valid = (top_ids >= 0) & torch.isfinite(top_lp)
        mass = torch.where(valid, top_lp.to(f64), torch.full((), -math.inf, dtype=f64, device=top_lp.device))
        sums["sampling/sampler_mass"] = mass.exp().sum()
    if kl is not None:
        sums["kl"] = kl.double().sum()
    extremes: dict[str, torch.Tensor] = {}
    if n:
        if num_samples is None:  # torch.unique: a device sync (its output size depends on the values)
            _, inverse = torch.unique(sample_index, return_inverse=True)
            per_sample = torch.bincount(inverse).to(f64)
            low_frac = torch.bincount(inverse, weights=low.to(f64)) / per_sample
            high_frac = torch.bincount(inverse, weights=high.to(f64)) / per_sample
            low_min, high_max = low_frac.min(), high_frac.max()
        else:  # sizes known on the host: sums of 0/1 in float64 are exact, so the same fractions; empty samples skipped
            def per_sample_sum(v):
                return torch.zeros(num_samples, dtype=f64, device=v.device).index_add_(0, sample_index, v.to(f64))
            per_sample = per_sample_sum(torch.ones_like(ratio))
            present = per_sample > 0
            low_min = torch.where(present, per_sample_sum(low) / per_sample, math.inf).amin()
            high_max = torch.where(present, per_sample_sum(high) / per_sample, -math.inf).amax()
        extremes = {
            "sampling/sampling_logp_difference/max": logp_diff.max(),
            "sampling/importance_sampling_ratio/min": ratio.min(),
            "sampling/importance_sampling_ratio/max": ratio.max(),
            "clip_ratio/low_min": low_min,
            "clip_ratio/high_max": high_max,
        }
    return PendingMetrics(list(sums) + list(extremes), torch.stack([*sums.values(), *extremes.values()]),
                          {name: float(n) for name in sums})


def _kind(name: str) -> str:
    last = name.rsplit("/", 1)[-1]
    if "min" in last:
        return "min"
    if "max" in last:
        return "max"
    return "mean"


def merge_metric_contributions(contributions: Iterable[Mapping[str, MetricValue]]) -> dict[str, MetricValue]:
    """Combine contributions of several micro-batches / ranks: pairs add, ``*min`` floats min, ``*max`` max.

    Raises:
        ValueError: a name's value has the wrong form (a pair for a min/max name or vice versa).
    """
    merged: dict[str, MetricValue] = {}
    for contribution in contributions:
        for name, value in contribution.items():
            kind = _kind(name)
            if (kind == "mean") != isinstance(value, tuple):
                raise ValueError(f"metric {name!r}: expected a {'(sum, count) pair' if kind == 'mean' else 'float'}, got {value!r}")
            if name not in merged:
                merged[name] = value
            elif kind == "mean":
                s, c = merged[name]
                merged[name] = (s + value[0], c + value[1])
            elif kind == "min":
                merged[name] = min(merged[name], value)
            else:
                merged[name] = max(merged[name], value)
    return merged


def finalize_metrics(contribution: Mapping[str, MetricValue]) -> dict[str, float]:
    """Turn (merged) contributions into logged values: pairs become ``sum / count`` (dropped when count is 0)."""
    out: dict[str, float] = {}
    for name, value in contribution.items():
        if isinstance(value, tuple):
            if value[1] > 0:
                out[name] = value[0] / value[1]
        else:
            out[name] = float(value)
    return out
