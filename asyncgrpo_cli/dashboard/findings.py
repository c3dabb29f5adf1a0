"""What the diagnosis rules share (`asyncgrpo_cli.dashboard.diagnosis`, `asyncgrpo_cli.dashboard.idle`): a
finding (`Diagnosis`) and its severities, the numbers behind the rules' words (`Thresholds`; the diagnosis
module's docstring says what each means), the config values they compare against (`RunSettings`), the logged
windows they read (`MetricsHistory`) and how a wait is judged against the step (`_level`)."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..run.metrics_line import num

OK, INFO, WARN, ALERT = "ok", "info", "warn", "alert"
SEVERITY_RANK = {OK: 0, INFO: 1, WARN: 2, ALERT: 3}
REWARD_NAMES = ("reward", "reward_kept", "reward_dropped")


@dataclass(frozen=True)
class Diagnosis:
    """One finding: ``rule`` (stable id, e.g. ``generation_bound``), ``text`` (one short line) and
    ``severity`` (``ok``, ``info``, ``warn``, ``alert``)."""

    rule: str
    text: str
    severity: str = OK

    @property
    def rank(self) -> int:  # 0 (ok) … 3 (alert)
        return SEVERITY_RANK[self.severity]


@dataclass(frozen=True)
class Thresholds:
    """Numbers behind the words of SPEC's tables (`asyncgrpo_cli.dashboard.diagnosis`'s docstring says what each
    means)."""

    high_wait_frac: float = 0.20
    zero_wait_frac: float = 0.05
    high_wait_s: float = 1.0
    zero_wait_s: float = 0.05
    backpressure_active_s: float = 0.01
    backpressure_step_frac: float = 0.05
    at_limit_frac: float = 0.95
    low_kv_frac: float = 0.5
    queue_empty_steps: float = 0.5
    queue_full_frac: float = 0.5
    zero_std_low: float = 0.3
    zero_std_high: float = 0.5
    trend_windows: int = 3
    zero_std_rising: float = 0.05
    reward_trend_frac: float = 0.02
    top_frac: float = 0.8
    bottom_frac: float = 0.2
    dup_near_zero: float = 0.1
    dup_jump_frac: float = 0.8
    dup_creep: float = 0.02
    entropy_fall_frac: float = 0.02
    hold_windows: int = 3
    length_bias_gap: float = 0.10
    stale_waste_frac: float = 0.05
    stale_windows: int = 10
    engine_full_kv_frac: float = 0.8
    inflight_low_frac: float = 0.5
    cap_windows: int = 3
    engine_core_busy: float = 0.9
    embedded_busy: float = 0.9
    worker_busy: float = 0.9
    host_busy_frac: float = 0.9
    host_wait_frac: float = 0.25
    sync_pause_frac: float = 0.10


DEFAULT_THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class RunSettings:
    """Config values the rules compare against.

    Attributes:
        max_staleness: ``staleness.max_staleness`` (weight updates).
        max_concurrent_rollouts: ``staleness.max_concurrent_rollouts``.
        num_generations: ``rollout.num_generations`` (G).
        reward_range: (lowest, highest) total reward; None = inferred from the metrics seen.
        rollout_worker_timeout: ``staleness.rollout_worker_timeout`` in seconds (heartbeat display).
        weight_sync_steps: ``staleness.weight_sync_steps`` (optimizer steps per weight update).
        backend: ``sampler.backend`` (``vllm``, ``embedded``, ``external``).
        api_server_count: vLLM's ``--api-server-count`` as started: ``sampler.api_server_count``, 1 with LoRA.
        lora: ``peft.enabled`` (runtime LoRA updating forces one API server).
        sampler_extra_args: ``sampler.extra_args`` (appended to the server command).
        num_sampler_logprobs: ``rollout.num_sampler_logprobs`` (top log-probs per generated token).
        token_budget: ``packing.token_budget`` in tokens, or ``sampler.max_model_len`` when unset; None = unknown.
        max_model_len: ``sampler.max_model_len`` in tokens; None = the server's.
        max_groups_per_step: ``packing.max_groups_per_step`` (groups a step holds at most); None = unbounded.
        engines: ``sampler.engines`` (servers behind the router).
        in_flight_estimate: ``staleness.in_flight_estimate`` (``mean`` or ``kept``).
        deadline_release_versions: ``staleness.deadline_release_versions`` (None: deadline admission stays on).
        deadline_order: ``staleness.deadline_order`` (``pessimistic`` or ``observed``).
        torch_compile: ``trainer.torch_compile``; None = unknown (no hint that depends on it).
    """

    max_staleness: int = 4
    max_concurrent_rollouts: int = 512
    num_generations: int = 8
    reward_range: tuple[float, float] | None = None
    rollout_worker_timeout: float = 300.0
    weight_sync_steps: int = 1
    backend: str = "vllm"
    api_server_count: int = 8
    lora: bool = False
    sampler_extra_args: tuple[str, ...] = ()
    num_sampler_logprobs: int = 8
    token_budget: int | None = None
    max_model_len: int | None = None
    max_groups_per_step: int | None = None
    engines: int = 1
    in_flight_estimate: str = "mean"
    deadline_release_versions: int | None = None
    deadline_order: str = "pessimistic"
    torch_compile: bool | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> RunSettings:
        """Read the settings from a composed config (`asyncgrpo_cli.config.compose`)."""
        from ..server.command import api_server_count

        max_len = cfg.sampler.max_model_len
        budget = cfg.packing.token_budget if cfg.packing.token_budget is not None else max_len
        return cls(max_staleness=int(cfg.staleness.max_staleness),
                   max_concurrent_rollouts=int(cfg.staleness.max_concurrent_rollouts),
                   num_generations=int(cfg.rollout.num_generations),
                   rollout_worker_timeout=float(cfg.staleness.rollout_worker_timeout),
                   weight_sync_steps=int(cfg.staleness.weight_sync_steps),
                   backend=str(getattr(cfg.sampler.backend, "value", cfg.sampler.backend)),
                   api_server_count=int(api_server_count(cfg.sampler, cfg.peft)), lora=bool(cfg.peft.enabled),
                   sampler_extra_args=tuple(str(a) for a in cfg.sampler.extra_args),
                   num_sampler_logprobs=int(cfg.rollout.num_sampler_logprobs),
                   token_budget=None if budget is None else int(budget),
                   max_model_len=None if max_len is None else int(max_len),
                   max_groups_per_step=cfg.packing.max_groups_per_step,
                   engines=int(cfg.sampler.get("engines", 1)),
                   in_flight_estimate=str(cfg.staleness.get("in_flight_estimate", "mean")),
                   deadline_release_versions=cfg.staleness.get("deadline_release_versions", None),
                   deadline_order=str(cfg.staleness.get("deadline_order", "pessimistic")),
                   torch_compile=bool(cfg.trainer.get("torch_compile", False)))


class MetricsHistory:
    """The last ``maxlen`` metrics windows (oldest first), for trends and the ETA.

    Args:
        maxlen: windows kept (older ones are forgotten).
    """

    def __init__(self, maxlen: int = 50) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def push(self, metrics: Mapping[str, Any]) -> None:
        """Add one logged window (a dict of SPEC §15 names plus ``step``/``epoch``/``time``)."""
        self._rows.append(dict(metrics))

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The kept windows, oldest first."""
        return list(self._rows)

    @property
    def latest(self) -> dict[str, Any] | None:
        """The newest window, or None."""
        return self._rows[-1] if self._rows else None

    def values(self, name: str) -> list[float]:
        """The finite values of ``name`` over the kept windows, oldest first."""
        return [v for v in (num(r, name) for r in self._rows) if v is not None]

    def trend(self, name: str, k: int = 3) -> float | None:
        """Mean of the newest ``k`` values of ``name`` minus the mean of the ``k`` before; None with fewer
        than ``2k`` values."""
        vals = self.values(name)
        if k < 1 or len(vals) < 2 * k:
            return None
        return sum(vals[-k:]) / k - sum(vals[-2 * k:-k]) / k

    def earlier_mean(self, name: str, k: int = 3) -> float | None:
        """Mean of the ``k`` values before the newest ``k`` (the base of `trend`), or None."""
        vals = self.values(name)
        if len(vals) < 2 * k:
            return None
        return sum(vals[-2 * k:-k]) / k

    def observed_range(self, names: Iterable[str]) -> tuple[float, float] | None:
        """(min, max) over every value of ``names`` seen, or None when none was seen."""
        vals = [v for n in names for v in self.values(n)]
        return (min(vals), max(vals)) if vals else None


def _level(value: float | None, step_s: float | None, th: Thresholds) -> str | None:
    """'high', 'zero' or 'some' for a waiting time (see the module docstring), None when unknown."""
    if value is None:
        return None
    if step_s is not None and step_s > 0:
        frac = value / step_s
        return "high" if frac > th.high_wait_frac else "zero" if frac < th.zero_wait_frac else "some"
    return "high" if value > th.high_wait_s else "zero" if value < th.zero_wait_s else "some"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0%}"


def _wait_text(wait: float | None, step_s: float | None) -> str:
    if wait is None:
        return "?"
    if step_s:
        return f"{wait:.2f} s ({wait / step_s:.0%} of the step)"
    return f"{wait:.2f} s"


_HELD = re.compile(r"rollout/held_([a-z]+)_frac")


def held_shares(m: Mapping[str, Any] | None) -> list[tuple[str, float]]:
    """What held the rollout producer over the window (`asyncgrpo_cli.rollout.holds`): ``(gate, share of wall
    time)`` for every ``rollout/held_{gate}_frac`` logged, largest first; [] when none is."""
    found = []
    for name in m or {}:
        match = _HELD.fullmatch(name)
        value = num(m, name) if match else None
        if value is not None:
            found.append((match.group(1), value))
    return sorted(found, key=lambda kv: -kv[1])
