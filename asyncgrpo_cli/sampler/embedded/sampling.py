"""Sampling math of the embedded sampler: penalties, temperature, min-p, top-k, top-p, processed log-probs.

Everything here is pure torch on one batch of next-token logits and holds no state, so it can be
tested against hand-computed distributions. The order follows vLLM's sampler (SPEC §7, §8.1
``--logprobs-mode processed_logprobs``):

1. repetition penalty over the tokens seen so far (prompt and output): a positive logit is divided by
   the penalty, a negative one multiplied by it;
2. temperature: logits divided by ``temperature`` (a greedy row, ``temperature == 0``, keeps 1.0);
3. min-p: tokens whose probability is below ``min_p × max probability`` are removed;
4. top-k: only the ``top_k`` most likely tokens are kept (0 = off);
5. top-p: the smallest set of most likely tokens whose mass (of the distribution left by step 4)
   reaches ``top_p`` is kept;
6. processed log-probs = log-softmax over what is kept, renormalised over that candidate set
   (``-inf`` elsewhere). Sampling draws from exactly this distribution; a greedy row takes its argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: vLLM writes ``-inf`` log-probs (tokens outside the candidate set) as this value in JSON.
LOGPROB_FLOOR = -9999.0

#: A temperature below this is greedy decoding.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingOptions:
    """Validated per-request sampling parameters, in the units of vLLM's ``SamplingParams``.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: >= 0; 0 = greedy.
        top_p: in (0, 1]; 1 = off.
        top_k: >= 0 top tokens kept; 0 = off (vLLM's -1 is normalised to 0 by the caller).
        min_p: in [0, 1]; 0 = off.
        repetition_penalty: > 0; 1 = off.
        seed: per-request seed of the sampling generator; ``None`` = drawn by the server.
        logprobs: top-N log-probs returned per position; ``None`` = no log-probs at all,
            0 = only the sampled token's.
        stop_token_ids: ids that end the request (finish reason ``"stop"``) besides EOS.
        ignore_eos: keep generating past EOS.
        return_sampling_mask: record each token's candidate set (only meaningful when a filter is on).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    return_sampling_mask: bool = False

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (``temperature`` below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def filters_active(self) -> bool:
        """True when top-k, top-p or min-p narrows the candidate set."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def apply_repetition_penalty(
    logits: torch.Tensor, seen_ids: list[torch.Tensor | None], penalties: list[float]
) -> torch.Tensor:
    """Apply vLLM's repetition penalty row by row, returning a new tensor.

    Args:
        logits: ``[B, V]`` float32 next-token logits.
        seen_ids: per row, a 1-D long tensor of token ids already in the sequence (prompt and
            output), or ``None`` for a row without penalty.
        penalties: per row, the penalty (> 0; 1.0 = none).

    Returns:
        ``[B, V]`` float32: for each seen token, a positive logit divided by the penalty and a
        negative one multiplied by it.
    """
    out = logits.clone()
    for row, (ids, penalty) in enumerate(zip(seen_ids, penalties)):
        if ids is None or penalty == 1.0 or ids.numel() == 0:
            continue
        ids = torch.unique(ids.to(out.device))
        vals = out[row, ids]
        out[row, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Turn next-token logits into processed log-probs (steps 2-6 of the module docstring).

    Args:
        logits: ``[B, V]`` float logits (penalties already applied).
        temperature: ``[B]`` float; rows below 1e-5 are greedy and use 1.0 here.
        top_k: ``[B]`` long; 0 = off; values above ``V`` act as off.
        top_p: ``[B]`` float in (0, 1]; 1 = off.
        min_p: ``[B]`` float in [0, 1]; 0 = off.

    Returns:
        ``[B, V]`` float32 log-probs that sum (in probability) to 1 over each row's candidate set
        and are ``-inf`` outside it.
    """
    x = logits.float()
    batch, vocab = x.shape
    device = x.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    temp = torch.where(temperature < GREEDY_TEMPERATURE, torch.ones_like(temperature), temperature)
    x = x / temp[:, None]

    min_p = min_p.to(device=device, dtype=torch.float32)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        threshold = min_p * probs.max(dim=-1).values
        x = x.masked_fill(probs < threshold[:, None], float("-inf"))

    top_k = top_k.to(device=device, dtype=torch.long)
    top_p = top_p.to(device=device, dtype=torch.float32)
    use_k = bool(((top_k > 0) & (top_k < vocab)).any())
    use_p = bool((top_p < 1.0).any())
    if use_k or use_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if use_k:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
            ranks = torch.arange(vocab, device=device)[None, :]
            remove |= ranks >= k[:, None]
            sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        if use_p:
            probs = torch.softmax(sorted_x, dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            p = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))
            remove_p = mass_before >= p[:, None]
            remove_p[:, 0] = False  # the most likely token always stays
            remove |= remove_p
        mask = torch.zeros_like(remove).scatter_(1, order, remove)
        x = x.masked_fill(mask, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logprobs: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Draw one token per row from processed log-probs.

    Args:
        logprobs: ``[B, V]`` processed log-probs (from `process_logits`).
        greedy: per row, take the argmax instead of sampling.
        generators: per row, the request's own ``torch.Generator`` (on ``logprobs.device``) so the
            draw depends only on the request's seed; ``None`` uses torch's global generator.

    Returns:
        ``[B]`` long token ids.
    """
    out = torch.empty(logprobs.shape[0], dtype=torch.long, device=logprobs.device)
    probs = None
    for row in range(logprobs.shape[0]):
        if greedy[row]:
            out[row] = torch.argmax(logprobs[row])
            continue
        if probs is None:
            probs = torch.exp(logprobs)
        out[row] = torch.multinomial(probs[row], 1, generator=generators[row])[0]
    return out


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest processed log-probs of every row.

    Args:
        logprobs: ``[B, V]`` processed log-probs.
        n: how many per row (0 <= n <= V).

    Returns:
        ``(values [B, n] float32, ids [B, n] long)``, most likely first; tokens outside the
        candidate set appear with ``-inf`` when the set is smaller than ``n``.
    """
    n = min(n, logprobs.shape[-1])
    values, ids = torch.topk(logprobs, n, dim=-1)
    return values, ids


def candidate_set(logprobs_row: torch.Tensor) -> list[int]:
    """Token ids of one row's candidate set (finite processed log-prob), ascending.

    Args:
        logprobs_row: ``[V]`` processed log-probs.
    """
    return torch.nonzero(torch.isfinite(logprobs_row), as_tuple=False).flatten().tolist()


def finite_logprob(value: float) -> float:
    """A log-prob as vLLM writes it to JSON: ``-inf`` (and NaN) become `LOGPROB_FLOOR`."""
    if value != value or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return float(value)
