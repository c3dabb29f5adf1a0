"""Diagnosis rules of the live panels: SPEC §4.4 (which concurrency limit is active), §5.1 (where the bottleneck
is, and why an idle trainer waits), §5.2 (saturation) and §5.3 (duplicates), as pure functions of logged metrics.

Inputs are metrics windows as logged (one dict per logging step, SPEC §15 names) kept in a small `MetricsHistory`,
plus a few config values (`RunSettings`). Every function returns a `Diagnosis` (a stable ``rule`` id, a short
``text`` and a ``severity``: ok < info < warn < alert) or None when the metrics it needs are absent. `diagnose`
picks the ONE finding of the newest window; `steady_diagnosis`, what the dashboard shows, shows a warning only once
the same finding has held over ``Thresholds.hold_windows`` consecutive windows, and says over which steps it was
measured (one noisy window of a short run is not a diagnosis).

Thresholds (`Thresholds`; every one can be changed):

- "High" wait: ``perf/rollout_wait_s`` (or ``rollout/backpressure_s``) above 20% of ``perf/step_s``;
  "≈ 0": below 5% of it. Without ``perf/step_s``: above 1.0 s / below 0.05 s. ``rollout/backpressure_s``
  is a mean over the waits of the window (SPEC §4.1), compared with the step time all the same.
- Staleness limit active (§4.4): ``rollout/backpressure_s`` > 0.01 s.
- A concurrency "equals" a limit when it is at least 95% of it; the KV cache is "low" below 50% usage.
- Queue "nearly empty": fewer samples than half a step (``batch/samples_per_step``; 1 sample when
  unknown); "about ``max_staleness`` steps' worth": at least half of ``max_staleness`` steps of samples.
- ``frac_reward_zero_std`` is "low" below 0.3 and "high" from 0.5. Trends compare the mean of the newest
  3 windows with the mean of the 3 before (so they need 6 windows): ``frac_reward_zero_std`` is "rising"
  when it grew by more than 0.05; ``reward`` / ``reward_dropped`` rise or fall when they moved by more than
  2% of the reward range. Without enough history a trend counts as flat.
- Reward range: ``RunSettings.reward_range`` when given, else [min(0, lowest seen), max(1, highest seen)]
  over ``reward``, ``reward_kept`` and ``reward_dropped``. "Near the top": in the upper 20% of the range;
  "near the bottom": in the lower 20%; "mid-range": in between.
- Duplicates: "near 0" below 0.1; "jumps toward (G-1)/G" from 80% of ``(num_generations - 1) /
  num_generations``; "creeps up": the trend of ``completions/duplicate_frac`` above +0.02 while the trend of
  ``entropy`` is negative by more than 2% of its earlier mean: collapse (an alert) when the reward does not rise,
  converging (info) when it does (the policy settling on the credited answer, issue #41).

The trainer's busy share (`busy_share`) is ``1 - perf/rollout_wait_s / perf/step_s`` clamped to [0, 1]. The
trainer is idle (`trainer_idle`, issue #33) when its wait is "high" as above (the premise of generation-bound).
Its cause is the first of these that holds, each with the CLI override that fixes it:

1. ``trainer_idle_api_servers``: ``sampler.backend=vllm`` with one API server (``sampler.api_server_count=1``,
   or LoRA, which forces 1) and ``rollout.num_sampler_logprobs`` > 0: the one API server serialises the
   top log-probs (measured with a 0.6B model on one H200: top-8 cost 80% of generation throughput with 1
   server, 37% with 8). Fix ``sampler.api_server_count=8``.
2. ``trainer_idle_eager``: vllm with ``--enforce-eager`` in ``sampler.extra_args`` (no CUDA graphs; measured
   0.54 vs 0.73 steps/s, SmolLM2-135M on one H200). Fix: the extra args without it.
3. ``trainer_idle_on_policy``: ``staleness.max_staleness=0``: on-policy rounds (issue #33) generate each step's
   samples after the last weight sync, so training and generation take turns by design. Fix: ``max_staleness=1``.
4. ``trainer_idle_allowance``: the staleness token allowance holds generation back: ``rollout/backpressure_s``
   active (> ``backpressure_active_s``), or ``rollout/concurrency`` below ``inflight_low_frac`` (0.5) of
   ``rollout/concurrency_cap`` while the allowance admits fewer rollouts than the cap (unknown counts as
   fewer). It admits ~``max(max_staleness, 1) x weight_sync_steps x batch/samples_per_step`` rollouts (queued
   included); fix: ``max_staleness`` or (unless the step closed on ``packing.max_groups_per_step``) ``token_budget``
   scaled by cap / admitted (at least one more step's worth), the budget rounded up to 256 tokens.
5. ``trainer_idle_stale_drops``: ``sample/dropped_stale_token_frac`` above ``stale_waste_frac`` (5%), mean over
   the newest ``stale_windows`` windows: generation the trainer never gets. Fix: twice ``max_staleness``.
6. ``trainer_idle_engine_core``: vllm whose engine core uses ``engine_core_busy`` (0.9) of a CPU core or more
   (``server/engine_core_cpu``, issue #41): its host loop bounds generation (two servers on one H200 generated
   2.0-2.3x). Fix: one more server, ``sampler.engines``.
7. ``trainer_idle_cap``: over the newest ``cap_windows`` (3) windows the adaptive cap stayed at one value below
   ``max_concurrent_rollouts``, ``rollout/concurrency`` at it and the KV cache "low" (< 50%). With requests
   waiting in vLLM (mean ``rollout/vllm_queued_requests`` > 0; the cap grows only when none waits) the fix is
   ``--max-num-seqs max_concurrent_rollouts`` in ``sampler.extra_args``; with none waiting, a higher
   starting cap (KV-cache tokens / ``sampler.max_model_len``).
8. ``trainer_idle_ceiling``: ``rollout/concurrency`` at ``max_concurrent_rollouts`` with the KV cache low. Fix:
   twice ``staleness.max_concurrent_rollouts`` (if environments and tools allow).

Order: the config causes (1, 2) first, named only when the metrics confirm them: the trainer waits and the KV cache
is not full (at most ``engine_full_kv_frac``, 80%; above it vLLM's memory, not a flag, limits generation); their
cost is measured and their fix costs nothing. On-policy training (3) follows: it waits by design, whatever the
metrics. The metric causes follow (4-8): slow generation itself keeps rollouts longer in the allowance and makes
them go stale, so they are named once the config is right. When no cause holds, the finding stays
``generation_bound``; with both waits high cause 4 holds (unless 1-3 does), so `diagnose` no longer shows
``staleness_too_tight`` (`bottleneck` still returns it). An idle trainer outranks "mix" at equal severity."""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..run.metrics_line import breakdown_text, busy_share, num, request_breakdown  # noqa: F401 - busy_share re-exported
from .overrides import _bare_ok, _drop_flag, _hydra_str, _list_override  # noqa: F401 - _bare_ok, _hydra_str: re-exported

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
    """Numbers behind the words of SPEC's tables (see the module docstring)."""

    high_wait_frac: float = 0.20
    zero_wait_frac: float = 0.05
    high_wait_s: float = 1.0
    zero_wait_s: float = 0.05
    backpressure_active_s: float = 0.01
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
                   engines=int(cfg.sampler.get("engines", 1)))


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


def bottleneck(m: Mapping[str, Any], settings: RunSettings = RunSettings(),
               th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """SPEC §5.1: generation-bound, trainer-bound, ``max_staleness`` too tight, or balanced.

    Reads ``perf/rollout_wait_s``, ``rollout/backpressure_s``, ``perf/step_s``, ``rollout/queue_size``,
    ``batch/samples_per_step`` and ``sample/staleness_mean``. Returns None when neither wait is logged.
    """
    wait, bp = num(m, "perf/rollout_wait_s"), num(m, "rollout/backpressure_s")
    if wait is None and bp is None:
        return None
    step_s = num(m, "perf/step_s")
    wl, bl = _level(wait, step_s, th), _level(bp, step_s, th)
    queue = num(m, "rollout/queue_size")
    per_step = num(m, "batch/samples_per_step")
    if wl == "high" and bl == "high":
        return Diagnosis("staleness_too_tight",
                         f"max_staleness too tight: the trainer waits {_wait_text(wait, step_s)} while generation "
                         f"is throttled ({bp:.2f} s): raise staleness.max_staleness (now {settings.max_staleness})",
                         WARN)
    if wl == "high":
        empty = queue is not None and queue < max(1.0, th.queue_empty_steps * (per_step or 0.0))
        q = "queue nearly empty" if empty else f"queue {queue:.0f}" if queue is not None else "queue ?"
        rate = breakdown_text(request_breakdown(m))  # issue #41: the rate and the request's binding stage
        return Diagnosis("generation_bound",
                         f"generation-bound{f' ({rate})' if rate else ''}: the trainer waits "
                         f"{_wait_text(wait, step_s)} for samples ({q}); check rollout/generated_tokens_per_s, "
                         "rollout/concurrency, rollout/score_queue_size", WARN)
    if bl == "high":
        stale = num(m, "sample/staleness_mean")
        full = queue is not None and per_step is not None \
            and queue >= th.queue_full_frac * settings.max_staleness * per_step
        extra = f", staleness {stale:.1f}/{settings.max_staleness}" if stale is not None else ""
        extra += ", queue holds ~max_staleness steps" if full else ""
        return Diagnosis("trainer_bound",
                         f"trainer-bound: generation waits {bp:.2f} s for the staleness limit{extra} (expected when "
                         "inference is faster than training)", INFO)
    if wl in ("zero", None) and bl in ("zero", None):
        return Diagnosis("balanced", "balanced (no waits)", OK)
    return Diagnosis("balanced",
                     f"balanced (small waits: trainer {_wait_text(wait, step_s)}, generation "
                     f"{'?' if bp is None else f'{bp:.2f} s'})", OK)


def active_limit(m: Mapping[str, Any], settings: RunSettings = RunSettings(),
                 th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """SPEC §4.4: which limit holds the number of in-flight rollouts: the staleness limit, the vLLM
    load cap, the ``max_concurrent_rollouts`` ceiling, or none.

    Reads ``rollout/backpressure_s``, ``rollout/concurrency``, ``rollout/concurrency_cap``,
    ``rollout/vllm_kv_cache_usage_frac``, ``perf/rollout_wait_s`` and ``perf/step_s``. None when neither
    the concurrency nor the backpressure is logged. Not staleness while the trainer waits much for samples.
    """
    bp, conc = num(m, "rollout/backpressure_s"), num(m, "rollout/concurrency")
    cap, kv = num(m, "rollout/concurrency_cap"), num(m, "rollout/vllm_kv_cache_usage_frac")
    ceiling = settings.max_concurrent_rollouts
    if bp is None and conc is None:
        return None
    wl = _level(num(m, "perf/rollout_wait_s"), num(m, "perf/step_s"), th)  # a trainer that waits much: not ahead
    if bp is not None and bp > th.backpressure_active_s and wl != "high":
        return Diagnosis("limit_staleness", f"active limit: staleness (generation waits {bp:.2f} s; it is ahead "
                         "of training)", INFO)
    if conc is None:
        return None
    if cap is not None and cap < ceiling and conc >= th.at_limit_frac * cap:
        return Diagnosis("limit_server_load", f"active limit: vLLM load cap ({conc:.0f} in flight = cap {cap:.0f} "
                         f"< max_concurrent_rollouts {ceiling})", INFO)
    if conc >= th.at_limit_frac * ceiling:
        if kv is not None and kv < th.low_kv_frac and wl == "high":
            return Diagnosis("limit_resource", f"active limit: max_concurrent_rollouts={ceiling} with the KV cache "
                             f"at {kv:.0%} while the trainer waits: raise staleness.max_concurrent_rollouts if "
                             "environments and tools allow", WARN)
        return Diagnosis("limit_resource", f"active limit: max_concurrent_rollouts={ceiling} reached", INFO)
    return Diagnosis("limit_none", f"no concurrency limit active ({conc:.0f} in flight"
                     + (f", cap {cap:.0f}" if cap is not None else "") + ")", OK)


def reward_range(history: MetricsHistory, settings: RunSettings = RunSettings()) -> tuple[float, float]:
    """(lowest, highest) total reward: ``settings.reward_range`` or [min(0, seen), max(1, seen)]."""
    if settings.reward_range is not None:
        lo, hi = settings.reward_range
    else:
        seen = history.observed_range(REWARD_NAMES)
        lo, hi = (min(0.0, seen[0]), max(1.0, seen[1])) if seen else (0.0, 1.0)
    return (float(lo), float(hi)) if hi > lo else (float(lo), float(lo) + 1.0)


def saturation(history: MetricsHistory, settings: RunSettings = RunSettings(),
               th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """SPEC §5.2 (with Appendix B.15): healthy, saturating at the top, stuck at the bottom, regression,
    or a mix, from ``frac_reward_zero_std``, ``reward_dropped`` and ``reward`` and their trends.

    Rows are tried in this order: regression, healthy (low zero-std fraction), saturating at the top,
    stuck at the bottom, mix, then a plain "N% of groups carry no signal". None without
    ``frac_reward_zero_std`` in the newest window.
    """
    m = history.latest
    zero = num(m, "frac_reward_zero_std")
    if zero is None:
        return None
    lo, hi = reward_range(history, settings)
    span = hi - lo
    reward, dropped = num(m, "reward"), num(m, "reward_dropped")
    k = th.trend_windows
    z_trend = history.trend("frac_reward_zero_std", k)
    r_trend, d_trend = history.trend("reward", k), history.trend("reward_dropped", k)
    z_rising = z_trend is not None and z_trend > th.zero_std_rising
    r_rising = r_trend is not None and r_trend > th.reward_trend_frac * span
    r_falling = r_trend is not None and r_trend < -th.reward_trend_frac * span
    d_falling = d_trend is not None and d_trend < -th.reward_trend_frac * span

    def pos(x: float | None) -> float | None:
        return None if x is None else (x - lo) / span

    dpos, rpos = pos(dropped), pos(reward)
    rtxt = "?" if reward is None else f"{reward:.3g}"
    dtxt = "?" if dropped is None else f"{dropped:.3g}"
    if z_rising and d_falling and r_falling:
        return Diagnosis("regression", f"regression: groups that used to succeed now fail together (reward {rtxt} "
                         f"falling, {zero:.0%} of groups without signal); check completions/duplicate_frac and "
                         "entropy for collapse", ALERT)
    if zero < th.zero_std_low:
        return Diagnosis("healthy_groups", f"{1 - zero:.0%} of groups carry a gradient", OK)
    high = zero >= th.zero_std_high
    if (z_rising or high) and dpos is not None and dpos >= th.top_frac and not r_falling:
        return Diagnosis("saturating_top", f"saturating at the top: {zero:.0%} of groups all equal, dropped groups "
                         f"at reward {dtxt} (reward {rtxt}): prompts got too easy; stop or use harder prompts", WARN)
    if high and dpos is not None and dpos <= th.bottom_frac and rpos is not None and rpos <= th.bottom_frac \
            and not r_rising:
        clipped = num(m, "completions/clipped_ratio")
        ctxt = f" (now {clipped:.0%})" if clipped is not None else ""
        return Diagnosis("stuck_bottom", f"stuck at the bottom: {zero:.0%} of groups get no credit (reward {rtxt}); "
                         f"check completions/clipped_ratio{ctxt}, then read completions to verify the reward parses "
                         "them", ALERT)
    if high and dpos is not None and th.bottom_frac < dpos < th.top_frac:
        return Diagnosis("mix", f"mix: in {zero:.0%} of groups every rollout got the same reward, on average {dtxt} "
                         "(mid-range: a partial score all rollouts share, e.g. one reward function always met and "
                         "another never, or easy and hard prompts mixed): read the rollouts", WARN)
    return Diagnosis("zero_std", f"{zero:.0%} of groups carry no signal (reward {rtxt})", INFO if high else OK)


def duplicates(history: MetricsHistory, settings: RunSettings = RunSettings(),
               th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """SPEC §5.3: healthy, sampler no longer random, or collapse, from ``completions/duplicate_frac``
    (and the trend of ``entropy``). None without ``completions/duplicate_frac`` in the newest window."""
    m = history.latest
    dup = num(m, "completions/duplicate_frac")
    if dup is None:
        return None
    g = settings.num_generations
    top = (g - 1) / g if g >= 2 else 0.0
    if top > 0 and dup >= th.dup_jump_frac * top:
        return Diagnosis("sampler_not_random", f"sampler not random: {dup:.0%} of rollouts copy an earlier one of "
                         f"their group (all copies = {top:.0%}); check temperature > 0 and per-request seeds", ALERT)
    k = th.trend_windows
    d_trend, e_trend = history.trend("completions/duplicate_frac", k), history.trend("entropy", k)
    e_base = history.earlier_mean("entropy", k)
    falling = e_trend is not None and e_base is not None and e_trend < -th.entropy_fall_frac * abs(e_base)
    if d_trend is not None and d_trend > th.dup_creep and falling:
        ent = num(m, "entropy")
        etxt = f" ({ent:.3g})" if ent is not None else ""
        lo, hi = reward_range(history, settings)
        r_trend, reward = history.trend("reward", k), num(m, "reward")
        if reward is not None and r_trend is not None and r_trend > th.reward_trend_frac * (hi - lo):  # learning (#41)
            return Diagnosis("converging", f"converging: duplicates creep up ({dup:.0%}) while entropy falls{etxt} and "
                             f"the reward rises ({reward:.3g}): the policy settles on one answer per prompt", INFO)
        return Diagnosis("collapse", f"collapse: duplicates creep up ({dup:.0%}) while entropy falls{etxt} and the "
                         "reward does not rise: the policy converges to one answer per prompt", ALERT)
    if dup < th.dup_near_zero:
        return Diagnosis("healthy_duplicates", f"duplicates {dup:.0%}", OK)
    return Diagnosis("duplicates", f"duplicates at {dup:.0%} (short completions can repeat by chance)", INFO)


def tool_use(m: Mapping[str, Any], th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """Agent runs (SPEC §13, §15.4): failing tool calls, rollouts cut at ``max_tool_calling_iterations``,
    turns that fork because the chat template re-renders the history. None without tool metrics."""
    fail = num(m, "tools/failure_frequency")
    exhausted = num(m, "tools/loop_exhausted_frac")
    fork = num(m, "rollout/fork_frac")
    if fail is None and exhausted is None and num(m, "tools/call_frequency") is None:
        return None
    if fail is not None and fail >= th.high_wait_frac:
        unknown = num(m, "tools/unknown_name_count")
        extra = f", {unknown:.0f} to unknown names" if unknown else ""
        return Diagnosis("tool_failures", f"tool failures {fail:.0%}{extra}: read the tool messages "
                         "(log_completions) and the tools' docstrings", WARN)
    if exhausted is not None and exhausted >= th.high_wait_frac:
        return Diagnosis("tool_loop_exhausted", f"{exhausted:.0%} of rollouts cut at max_tool_calling_iterations "
                         "while still calling tools: raise rollout.max_tool_calling_iterations", WARN)
    if fork is not None and fork >= th.high_wait_frac:
        return Diagnosis("tool_forks", f"{fork:.0%} of turns fork (the chat template re-renders the history): "
                         "forward cost grows; use a prefix-preserving template", INFO)
    calls = num(m, "tools/call_frequency")
    return Diagnosis("tools_ok", f"tools {calls:.2g} calls/rollout" if calls is not None else "tools ok", OK)


def length_bias(history: MetricsHistory, settings: RunSettings = RunSettings(),
                th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """Stale drops that fall on long completions, so the trainer sees fewer long prompts than the data holds
    (issue #28).

    Reads ``sample/trained_frac_short`` / ``sample/trained_frac_long`` (share of each completion-length third
    trained rather than dropped stale) and ``sample/dropped_stale_token_frac``, averaged over the newest
    ``th.stale_windows`` windows that logged them. Length bias (warn): the short share exceeds the long one by
    ``th.length_bias_gap`` or more. Stale waste (info): ``th.stale_waste_frac`` or more of the generated tokens
    dropped. None when the waste metric was never logged.
    """
    def recent(name: str) -> float | None:
        vals = history.values(name)[-th.stale_windows:]
        return sum(vals) / len(vals) if vals else None

    waste = recent("sample/dropped_stale_token_frac")
    if waste is None:
        return None
    short, long_ = recent("sample/trained_frac_short"), recent("sample/trained_frac_long")
    limit = settings.max_staleness
    if short is not None and long_ is not None and short - long_ >= th.length_bias_gap:
        return Diagnosis("length_bias", f"length bias: {1 - long_:.0%} of long completions dropped stale against "
                         f"{1 - short:.0%} of short ones ({waste:.0%} of generated tokens): long prompts are trained "
                         f"less than the data holds; raise staleness.max_staleness (now {limit})", WARN)
    if waste >= th.stale_waste_frac:
        return Diagnosis("stale_waste", f"{waste:.0%} of generated tokens dropped stale (no length bias); raise "
                         f"staleness.max_staleness (now {limit}) to waste less", INFO)
    return Diagnosis("stale_ok", f"{waste:.0%} of generated tokens dropped stale", OK)


# ------------------------------------------------------------------------------------ idle trainer (#33)
EAGER_FLAGS = ("--enforce-eager", "--enforce_eager")
NUM_SEQS_FLAGS = ("--max-num-seqs", "--max_num_seqs")
#: Rounding of a suggested ``packing.token_budget`` (tokens).
BUDGET_ROUND = 256




def _is_eager(args: Iterable[str]) -> bool:
    """Whether ``--enforce-eager`` is on in vLLM's extra args (``--enforce-eager=false`` is not)."""
    for a in args:
        name, _, value = a.partition("=")
        if name in EAGER_FLAGS and value.lower() not in ("false", "0", "no"):
            return True
    return False


def _round_up(value: float, step: int) -> int:
    return int(math.ceil(value / step) * step)


def _engine_full(m: Mapping[str, Any] | None, th: Thresholds) -> bool:
    """vLLM's KV cache above ``th.engine_full_kv_frac``: its memory, not a flag, limits generation."""
    kv = num(m, "rollout/vllm_kv_cache_usage_frac")
    return kv is not None and kv > th.engine_full_kv_frac


def _cause_api_servers(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 1: one vLLM API server serialising the sampler's top log-probs."""
    m = history.latest
    if s.backend != "vllm" or s.api_server_count != 1 or s.num_sampler_logprobs <= 0 or _engine_full(m, th):
        return None
    conc, running = num(m, "rollout/concurrency"), num(m, "rollout/vllm_running_requests")
    seen = ""
    if conc and running is not None:  # in flight but neither running nor waiting in the engine: in transit
        transit = max(0.0, conc - running - (num(m, "rollout/vllm_queued_requests") or 0.0))
        seen = f"; now {transit:.0f} of {conc:.0f} rollouts in flight are outside the engine"
    why = (f"one vLLM API server serialises the top-{s.num_sampler_logprobs} sampler log-probs (measured: 80% of "
           f"generation throughput lost with 1 server, 37% with 8{seen})")
    fix = ("sampler.api_server_count=8" if not s.lora else "LoRA forces one API server: peft.enabled=false, or "
           "loss.score_centering=false rollout.num_sampler_logprobs=0")
    return "trainer_idle_api_servers", why, fix


def _cause_eager(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 2: vLLM without CUDA graphs (``--enforce-eager`` in ``sampler.extra_args``)."""
    if s.backend != "vllm" or not _is_eager(s.sampler_extra_args) or _engine_full(history.latest, th):
        return None
    rest = _drop_flag(s.sampler_extra_args, EAGER_FLAGS, takes_value=False)
    return ("trainer_idle_eager", "vLLM runs without CUDA graphs (--enforce-eager in sampler.extra_args; "
            "measured 1.35x slower steps)", _list_override("sampler.extra_args", rest))


def _cause_on_policy(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 3: ``max_staleness=0`` (on-policy rounds, issue #33): each step's samples are generated after the
    previous step's weight sync, so the trainer waits for every round by design (and generation for every step)."""
    if s.max_staleness != 0:
        return None
    return ("trainer_idle_on_policy", "on-policy training (staleness.max_staleness=0) generates each step's samples "
            "after the last weight sync, so training and generation take turns by design",
            "staleness.max_staleness=1 to overlap them (one version of lag; the importance ratio corrects for it)")


def _allowance_rollouts(m: Mapping[str, Any] | None, s: RunSettings) -> float | None:
    """Rollouts the staleness token allowance admits (queued included): ``max(max_staleness, 1) x
    weight_sync_steps`` steps of ``batch/samples_per_step`` samples; None when that is not logged."""
    per_step = num(m, "batch/samples_per_step")
    return None if not per_step else max(s.max_staleness, 1) * s.weight_sync_steps * per_step


def _allowance_fix(admitted: float | None, target: float, s: RunSettings, group_bound: bool = False) -> str:
    """``staleness.max_staleness=N`` or ``packing.token_budget=M`` (not when ``group_bound``: the step closed on
    ``packing.max_groups_per_step``) that let ``target`` rollouts in flight where ``admitted`` are now."""
    steps = max(s.max_staleness, 1)
    factor = max(target / admitted if admitted else 2.0, (steps + 1) / steps)
    fix = f"staleness.max_staleness={max(s.max_staleness + 1, math.ceil(steps * factor - 1e-9))}"
    if s.token_budget and not group_bound:
        fix += f" or packing.token_budget={_round_up(s.token_budget * factor, BUDGET_ROUND)}"
    return fix


def _cause_allowance(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 3: the staleness token allowance bounds the rollouts in flight."""
    m = history.latest
    bp, conc = num(m, "rollout/backpressure_s"), num(m, "rollout/concurrency")
    cap, admitted = num(m, "rollout/concurrency_cap"), _allowance_rollouts(m, s)
    held = bp is not None and bp > th.backpressure_active_s
    low = conc is not None and cap is not None and conc < th.inflight_low_frac * cap \
        and (admitted is None or admitted < cap)
    if not (held or low):
        return None
    parts = []
    if held:
        parts.append(f"generation waits {bp:.2f} s")
    if conc is not None:
        parts.append(f"{conc:.0f} rollouts in flight" + (f", cap {cap:.0f}" if cap is not None else ""))
    if admitted is not None:
        parts.append(f"it admits ~{admitted:.0f}: {max(s.max_staleness, 1) * s.weight_sync_steps} steps of "
                     f"{num(m, 'batch/samples_per_step'):.0f} samples")
    why = f"the staleness token allowance holds generation back ({'; '.join(parts)})"
    target = cap if cap is not None else float(s.max_concurrent_rollouts)
    group_bound = bool(s.max_groups_per_step) and (num(m, "batch/groups_per_step") or 0) >= s.max_groups_per_step
    return "trainer_idle_allowance", why, _allowance_fix(admitted or conc, target, s, group_bound)


def _cause_stale_drops(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 4: generated tokens dropped stale (mean over the newest ``th.stale_windows`` windows)."""
    vals = history.values("sample/dropped_stale_token_frac")[-th.stale_windows:]
    waste = sum(vals) / len(vals) if vals else None
    if waste is None or waste <= th.stale_waste_frac:
        return None
    return ("trainer_idle_stale_drops", f"{waste:.0%} of generated tokens were dropped stale (generation the "
            "trainer never gets)", f"staleness.max_staleness={2 * max(s.max_staleness, 1)}")


def _flat_cap(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[float, float] | None:
    """(cap, mean KV usage) when over the newest ``th.cap_windows`` windows the cap stayed at one value below
    ``max_concurrent_rollouts`` with the rollouts in flight at it and the KV cache low; else None."""
    rows = history.rows[-th.cap_windows:]
    if len(rows) < th.cap_windows:
        return None
    caps = [num(r, "rollout/concurrency_cap") for r in rows]
    kvs = [num(r, "rollout/vllm_kv_cache_usage_frac") for r in rows]
    concs = [num(r, "rollout/concurrency") for r in rows]
    if any(v is None for v in (*caps, *kvs, *concs)) or len(set(caps)) != 1:
        return None
    cap = caps[0]
    if cap >= s.max_concurrent_rollouts or any(c < th.at_limit_frac * cap for c in concs) \
            or any(kv >= th.low_kv_frac for kv in kvs):
        return None
    return cap, sum(kvs) / len(kvs)


def _cause_cap(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 5: the adaptive concurrency cap never grows although the KV cache is low."""
    flat = _flat_cap(history, s, th)
    if flat is None:
        return None
    cap, kv = flat
    waits = history.values("rollout/vllm_queued_requests")[-th.cap_windows:]
    waiting = sum(waits) / len(waits) if waits else 0.0
    why = (f"the adaptive concurrency cap stays at {cap:.0f} (< max_concurrent_rollouts {s.max_concurrent_rollouts}) "
           f"over {th.cap_windows} windows with the KV cache at {kv:.0%}")
    if waiting > 0:  # the cap grows only when none waits: vLLM's batch limit holds them
        if s.backend != "vllm":
            return None
        args = _drop_flag(s.sampler_extra_args, NUM_SEQS_FLAGS, takes_value=True)
        return ("trainer_idle_cap", f"{why} and {waiting:.3g} requests waiting in vLLM on average (the cap grows "
                "only when none waits; vLLM's --max-num-seqs likely binds)",
                _list_override("sampler.extra_args", [*args, "--max-num-seqs", str(s.max_concurrent_rollouts)]))
    now = f" (now {s.max_model_len})" if s.max_model_len else ""
    return ("trainer_idle_cap", f"{why} and nothing waiting (it grows 25% at a 5 s poll only after `cap` rollouts "
            "completed; it starts at the KV cache's tokens / sampler.max_model_len)",
            f"a lower sampler.max_model_len{now} or a higher sampler.gpu_memory_utilization starts it higher")


def _cause_ceiling(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 6: the rollouts in flight at ``max_concurrent_rollouts`` with the KV cache low."""
    m = history.latest
    conc, kv = num(m, "rollout/concurrency"), num(m, "rollout/vllm_kv_cache_usage_frac")
    ceiling = s.max_concurrent_rollouts
    if conc is None or kv is None or conc < th.at_limit_frac * ceiling or kv >= th.low_kv_frac:
        return None
    return ("trainer_idle_ceiling", f"max_concurrent_rollouts={ceiling} reached with the KV cache at {kv:.0%}",
            f"staleness.max_concurrent_rollouts={2 * ceiling} (if environments and tools allow)")


def _cause_engine_core(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 6: vLLM's engine core busy on its CPU core (``server/engine_core_cpu`` of ``th.engine_core_busy``
    cores or more): its host loop, not the GPU, bounds generation, and more requests in flight buy little
    (issue #41: on an H200 two servers generated 2.0-2.3x the rollouts/s of one; `train.engine_cpu`)."""
    m = history.latest
    cores = num(m, "server/engine_core_cpu")
    if s.backend != "vllm" or cores is None or cores < th.engine_core_busy or _engine_full(m, th):
        return None
    return ("trainer_idle_engine_core",
            f"vLLM's engine core uses {cores:.2f} of a CPU core: its host loop bounds generation, not the GPU "
            "(measured on an H200 with a 135M model: two servers, two engine cores, 2.0-2.3x the rollouts/s of one)",
            f"sampler.engines={s.engines + 1} (one more server on the GPU; README: Several servers on one GPU)")


#: The causes of an idle trainer, in the order they are tried (see the module docstring).
IDLE_CAUSES = (_cause_api_servers, _cause_eager, _cause_on_policy, _cause_allowance, _cause_stale_drops,
               _cause_engine_core, _cause_cap, _cause_ceiling)


def trainer_idle(history: MetricsHistory, settings: RunSettings = RunSettings(),
                 th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """Issue #33: the trainer waits for samples a "high" share of the step (``perf/rollout_wait_s`` against
    ``perf/step_s``), with its most likely cause and the CLI override that fixes it (the causes and their
    order: the module docstring). None when the trainer is not idle or no cause holds (generation-bound
    then says what to check)."""
    m = history.latest
    wait, step_s = num(m, "perf/rollout_wait_s"), num(m, "perf/step_s")
    if _level(wait, step_s, th) != "high":
        return None
    busy = busy_share(m)
    rate = breakdown_text(request_breakdown(m))  # issue #41: generation's rate and its request's binding stage
    head = (f"trainer idle {1 - busy:.0%} of the step" if busy is not None else "trainer idle") \
        + f" (waits {wait:.2f} s for samples{f'; generation {rate}' if rate else ''})"
    for cause in IDLE_CAUSES:
        found = cause(history, settings, th)
        if found is not None:
            rule, why, fix = found
            return Diagnosis(rule, f"{head}: {why}; fix: {fix}", WARN)
    return None


def _findings(history: MetricsHistory, settings: RunSettings, th: Thresholds) -> tuple[list[Diagnosis], Diagnosis | None]:
    """Every finding of the newest window of ``history`` (in `diagnose`'s tie order) and the active limit."""
    m = history.latest
    limit = active_limit(m, settings, th)
    neck = trainer_idle(history, settings, th) or bottleneck(m, settings, th)
    sat = saturation(history, settings, th)
    mix = sat if sat is not None and sat.rule == "mix" else None  # after an idle trainer (issue #41): see diagnose
    found = [d for d in (duplicates(history, settings, th), None if mix else sat, neck, mix, limit,
                         length_bias(history, settings, th), tool_use(m, th)) if d is not None]
    return found, limit



def _shown(best: Diagnosis, limit: Diagnosis | None) -> Diagnosis:
    """The line for finding ``best``: a generation-bound finding gets the active limit appended."""
    if best.rule == "generation_bound" and limit is not None and limit.rule != "limit_staleness":
        return Diagnosis(best.rule, f"{best.text}; {limit.text}", best.severity)
    return best


def diagnose(history: MetricsHistory, settings: RunSettings = RunSettings(),
             th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis:
    """The ONE diagnosis line of the dashboard for the newest window of ``history``.

    The most severe finding wins (ties: duplicates, saturation, bottleneck, concurrency limit, length bias, in that
    order; saturation's "mix", read the rollouts, after the bottleneck: it hid an idle trainer's fix, issue #41).
    The bottleneck is `trainer_idle` when the trainer is idle for a cause it names (it
    replaces generation-bound and staleness-too-tight), else `bottleneck`. A generation-bound diagnosis gets
    the active concurrency limit appended (SPEC §4.4 says what holds generation back). When everything is ok
    the line starts with ``healthy:`` and lists the findings.
    """
    if not history.latest:
        return Diagnosis("waiting", "waiting for the first logged step", OK)
    found, limit = _findings(history, settings, th)
    if not found:
        return Diagnosis("no_data", "no diagnosable metrics in this step", OK)
    best = max(found, key=lambda d: d.rank)  # max keeps the first of equal ranks
    if best.severity == OK:
        return Diagnosis("healthy", "healthy: " + "; ".join(d.text for d in found if d.rule != "limit_none"), OK)
    return _shown(best, limit)


def steady_diagnosis(history: MetricsHistory, settings: RunSettings = RunSettings(),
                     th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis:
    """The dashboard's line: `diagnose` of the newest window when it is ok; otherwise the most severe warning
    (info and above) found in each of the newest ``th.hold_windows`` windows, each finding counted on its own
    (one that held while a worse one came and went is shown; an idle trainer holds with or without its cause named
    in each window), its text then ending with the steps it held over (``held over steps 4-6``). Until one has
    held, the line says that no finding has held yet, naming the newest one, with severity ok."""
    def _family(rule: str) -> str:  # an idle trainer is one finding whether a window names its cause or not
        return "idle" if rule.startswith("trainer_idle") or rule == "generation_bound" else rule
    current = diagnose(history, settings, th)
    if current.severity == OK or th.hold_windows <= 1:
        return current
    rows = history.rows
    hold = th.hold_windows
    steps = [num(r, "step") for r in rows[-hold:]]
    if len(rows) >= hold:
        found, limit = _findings(history, settings, th)
        held = {_family(d.rule) for d in found if d.severity != OK}
        for back in range(1, hold):
            past = MetricsHistory(maxlen=len(rows))
            for r in rows[:-back]:
                past.push(r)
            held &= {_family(d.rule) for d in _findings(past, settings, th)[0] if d.severity != OK}
        steady = [d for d in found if _family(d.rule) in held]
        if steady:
            best = _shown(max(steady, key=lambda d: d.rank), limit)
            span = (f"steps {steps[0]:.0f}-{steps[-1]:.0f}" if steps[0] is not None and steps[-1] is not None
                    else f"the last {hold} windows")
            return Diagnosis(best.rule, f"{best.text} (held over {span})", best.severity)
    newest = re.split(r"[(;]", current.text, maxsplit=1)[0].strip() or current.rule  # its words, not its rule id
    return Diagnosis("settling", f"no steady finding yet (newest: {newest}; shown once it holds over {hold} windows)", OK)
