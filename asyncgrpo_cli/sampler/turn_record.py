"""`TurnRecord`: one sampling request and what the sampler produced (SPEC §16.7).

It crosses the sampler boundary (`sampler.protocol.TurnResult.to_turn_record`) and the rollout side
(`rollout.types.Rollout.turns`), so it lives here, depending on nothing of the project: the sampler
imports nothing from `rollout/`. `asyncgrpo_cli.rollout.types` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent to the sampler and what it produced (SPEC §16.7).

    Attributes:
        prompt_ids: token ids of the full prompt of this turn (all earlier turns included).
        output_ids: token ids the sampler generated.
        output_log_probs: sampler (processed) log-prob of each output token, natural log.
        output_mask: per output token, 1 = trained, 0 = context only; ``None`` = train all.
        output_sampling_mask: per output token, the candidate token ids under top-k/top-p/min-p;
            ``None`` = the full vocabulary.
        output_sampler_logprobs: per output token, the sampler's top-``num_sampler_logprobs``
            log-probs keyed by token id (score centering, SPEC §3.3.2).
        finish_reason: ``"stop"`` (EOS or stop token) or ``"length"`` (hit ``max_tokens``).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
