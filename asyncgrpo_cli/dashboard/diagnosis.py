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
- Host saturated (issue #41): ``host/cpu_busy_frac`` from 0.9 and the trainer's run-queue wait
  ``perf/fwd_bwd_cpu_wait_s`` from 25% of ``perf/fwd_bwd_s``, for a trainer on a GPU.
- A generation-bound line names the weight sync's pause when ``perf/weight_sync_s`` is 10% of ``perf/step_s`` or
  more: the server is paused through each sync, so generation cannot overlap it (issue #41).

An idle trainer (`trainer_idle`, issue #33) and its causes live in `asyncgrpo_cli.dashboard.idle`; an idle trainer
outranks "mix" at equal severity."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..run.metrics_line import (breakdown_text, busy_share, fmt, num,  # noqa: F401 - busy_share re-exported
                                request_breakdown)
from .findings import (  # noqa: F401 - re-exported: the rules' shared types
    ALERT, DEFAULT_THRESHOLDS, INFO, OK, REWARD_NAMES, SEVERITY_RANK, WARN, Diagnosis, MetricsHistory, RunSettings,
    Thresholds, _level, _pct, _wait_text, held_shares)
from .idle import IDLE_CAUSES, trainer_idle, trainer_idle_in_waves  # noqa: F401 - IDLE_CAUSES re-exported
from .overrides import _bare_ok, _hydra_str, _list_override  # noqa: F401 - re-exported


def bottleneck(m: Mapping[str, Any], settings: RunSettings = RunSettings(),
               th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """SPEC §5.1: generation-bound, trainer-bound, ``max_staleness`` too tight, or balanced.

    Reads ``perf/rollout_wait_s``, ``rollout/backpressure_s``, ``perf/step_s``, ``rollout/queue_size``,
    ``batch/samples_per_step``, ``sample/staleness_mean`` and ``perf/weight_sync_s``. Returns None when neither
    wait is logged. ``rollout/backpressure_s`` counts the producer's waits at every gate; where
    ``rollout/held_{gate}_frac`` says another gate than the staleness limit held it longest (the concurrency cap,
    the on-policy round, deadline admission, the scoring queue), trainer-bound names that gate (second trial of
    2026-12-05: it blamed the staleness limit while the cap of 16 held generation 95% of the window).
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
        sync = num(m, "perf/weight_sync_s")
        # the server is paused through each weight sync: generation cannot overlap it (issue #41 item 6)
        paused = (f"; each weight sync pauses generation {sync:.2f} s ({sync / step_s:.0%} of a step, "
                  "perf/weight_sync_transfer_s)" if sync and step_s and sync >= th.sync_pause_frac * step_s else "")
        return Diagnosis("generation_bound",
                         f"generation-bound{f' ({rate})' if rate else ''}: the trainer waits "
                         f"{_wait_text(wait, step_s)} for samples ({q}){paused}; check rollout/generated_tokens_per_s, "
                         "rollout/concurrency, rollout/score_queue_size", WARN)
    if bl == "high":
        held = _holding_gate(m)
        faster = _faster_trainer(m, settings)
        if held is not None and held[0] != "allowance":  # another gate held the producer: name it, not staleness
            return Diagnosis("trainer_bound",
                             f"trainer-bound: generation waits {bp:.2f} s {_GATE_TEXT[held[0]](m, settings)} (held "
                             f"{held[1]:.0%} of the window; expected when inference is faster than training){faster}",
                             INFO)
        stale = num(m, "sample/staleness_mean")
        full = queue is not None and per_step is not None \
            and queue >= th.queue_full_frac * settings.max_staleness * per_step
        extra = f", staleness {stale:.1f}/{settings.max_staleness}" if stale is not None else ""
        extra += ", queue holds ~max_staleness steps" if full else ""
        return Diagnosis("trainer_bound",
                         f"trainer-bound: generation waits {bp:.2f} s for the staleness limit{extra} (expected when "
                         f"inference is faster than training){faster}", INFO)
    if wl in ("zero", None) and bl in ("zero", None):
        return Diagnosis("balanced", "balanced (no waits)", OK)
    return Diagnosis("balanced",
                     f"balanced (small waits: trainer {_wait_text(wait, step_s)}, generation "
                     f"{'?' if bp is None else f'{bp:.2f} s'})", OK)


def _faster_trainer(m: Mapping[str, Any], settings: RunSettings) -> str:
    """The trainer-bound line's way to a faster step: ``trainer.torch_compile=true`` for a trainer on a GPU (it logs
    ``perf/gpu_memory_peak_gib``) that does not compile (issue #42: the trainer's own step bounds a 1.7B job at 512
    tokens); empty otherwise, and when the config is unknown (``settings.torch_compile`` None)."""
    if settings.torch_compile is not False or num(m, "perf/gpu_memory_peak_gib") is None:
        return ""
    return ("; to shorten the trainer's step: trainer.torch_compile=true (compiles each layer; the first step takes a "
            "minute or two longer; README: One GPU)")


#: What holds the producer at each gate of `asyncgrpo_cli.rollout.holds` (``rollout/held_{gate}_frac``), in words.
_GATE_TEXT = {
    "round": lambda m, s: "for the on-policy round to close (staleness.max_staleness=0)",
    "allowance": lambda m, s: "for the staleness limit",
    "deadline": lambda m, s: "for deadline admission (on since the first stale drop)",
    "cap": lambda m, s: "for a free slot: the rollouts in flight are at their cap "
                        f"({fmt(num(m, 'rollout/concurrency_cap') or s.max_concurrent_rollouts, '.0f')}, "
                        f"staleness.max_concurrent_rollouts={s.max_concurrent_rollouts})",
    "score": lambda m, s: "for room in the scoring queue (rewards are behind)",
}


def _holding_gate(m: Mapping[str, Any]) -> tuple[str, float] | None:
    """The gate that held the producer longest in the window and its share (`held_shares`); None when none is
    logged or none held it."""
    shares = [(gate, share) for gate, share in held_shares(m) if share > 0 and gate in _GATE_TEXT]
    return shares[0] if shares else None


def active_limit(m: Mapping[str, Any], settings: RunSettings = RunSettings(),
                 th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """SPEC §4.4: which limit holds the number of in-flight rollouts: the staleness limit, the vLLM
    load cap, the ``max_concurrent_rollouts`` ceiling, or none.

    Reads ``rollout/backpressure_s``, ``rollout/concurrency``, ``rollout/concurrency_cap``,
    ``rollout/vllm_kv_cache_usage_frac``, ``perf/rollout_wait_s`` and ``perf/step_s``. None when neither
    the concurrency nor the backpressure is logged. Not staleness while the trainer waits much for samples, nor
    when generation waited under ``backpressure_step_frac`` (5%) of the step.
    """
    bp, conc = num(m, "rollout/backpressure_s"), num(m, "rollout/concurrency")
    cap, kv = num(m, "rollout/concurrency_cap"), num(m, "rollout/vllm_kv_cache_usage_frac")
    ceiling = settings.max_concurrent_rollouts
    if bp is None and conc is None:
        return None
    step = num(m, "perf/step_s")
    wl = _level(num(m, "perf/rollout_wait_s"), step, th)  # a trainer that waits much: not ahead
    # A wait that is a sliver of the step (0.03 s of several) does not make staleness the limit (trial, s11).
    held = bp is not None and bp > max(th.backpressure_active_s, th.backpressure_step_frac * (step or 0.0))
    if held and wl != "high":
        return Diagnosis("limit_staleness", f"active limit: staleness (generation waits {bp:.2f} s; it is ahead "
                         "of training)", INFO)
    if conc is None:
        return None
    if cap is not None and cap < ceiling and conc >= th.at_limit_frac * cap:
        return Diagnosis("limit_server_load", f"active limit: vLLM load cap ({conc:.0f} in flight = cap {cap:.0f} "
                         f"< max_concurrent_rollouts {ceiling})", INFO)
    if conc >= th.at_limit_frac * ceiling:
        if kv is not None and kv < th.low_kv_frac and wl == "high":
            # its own rule: "held over" a window where the ceiling was only reached would claim the trainer waited
            return Diagnosis("limit_resource_idle", f"active limit: max_concurrent_rollouts={ceiling} with the KV cache "
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


def trainer_memory(m: Mapping[str, Any]) -> Diagnosis | None:
    """The trainer's allocator ran short of GPU memory (``perf/cuda_alloc_retries`` > 0 in the window: each retry
    frees its cache and synchronises the device, a slow step with no other sign; `train.cuda_memory`). None
    without the metric (a CPU trainer) or without a retry."""
    retries = num(m, "perf/cuda_alloc_retries")
    if not retries:
        return None
    peak = num(m, "perf/gpu_memory_peak_gib")
    held = f" (peak {peak:.1f} GiB)" if peak is not None else ""
    return Diagnosis("trainer_memory", f"trainer short of GPU memory: {retries:.0f} allocator retries a step{held}, "
                     "each synchronising the GPU; fix: a lower sampler.gpu_memory_utilization when vLLM shares its "
                     "GPU, or a smaller packing.token_budget", WARN)


def host_saturated(m: Mapping[str, Any], settings: RunSettings = RunSettings(),
                   th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """The machine's cores are all busy and the trainer waits for one (issue #41): ``host/cpu_busy_frac`` at
    ``th.host_busy_frac`` or more and ``perf/fwd_bwd_cpu_wait_s`` at least ``th.host_wait_frac`` of
    ``perf/fwd_bwd_s`` (`train.host_load`, `train.host_time`). The fix halves vLLM's API servers when it runs
    more than two (``sampler.api_server_count``; they take the host's cores beside the engine core, the rollout
    worker and the trainer). None without the metrics (not Linux), below either threshold, or for a trainer on the
    CPU (no ``perf/gpu_memory_peak_gib``): there its forward and backward are the host's work, and on the CPU smoke
    job (two cores, the embedded sampler beside it) every core is busy by design."""
    frac, cores = num(m, "host/cpu_busy_frac"), num(m, "host/cpu_busy_cores")
    wait, fwd_bwd = num(m, "perf/fwd_bwd_cpu_wait_s"), num(m, "perf/fwd_bwd_s")
    if None in (frac, cores, wait, fwd_bwd) or frac < th.host_busy_frac or not fwd_bwd or \
            wait < th.host_wait_frac * fwd_bwd or num(m, "perf/gpu_memory_peak_gib") is None:
        return None
    total = f" of {cores / frac:.0f}" if frac > 0 else ""
    servers = settings.api_server_count * max(1, settings.engines)
    if settings.backend == "vllm" and settings.api_server_count > 2:
        fix = (f"sampler.api_server_count={settings.api_server_count // 2} (vLLM's {servers} API servers share the "
               "cores with its engine core, the rollout worker and the trainer), or fewer other processes here")
    else:
        fix = "fewer other processes on this machine, or one with more cores"
    return Diagnosis("host_saturated", f"host CPUs saturated: {cores:.1f}{total} cores busy; the trainer waited "
                     f"{wait:.2f} s for a core in its {fwd_bwd:.2f} s forward and backward; fix: {fix}", WARN)


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


def _findings(history: MetricsHistory, settings: RunSettings, th: Thresholds) -> tuple[list[Diagnosis], Diagnosis | None]:
    """Every finding of the newest window of ``history`` (in `diagnose`'s tie order) and the active limit."""
    m = history.latest
    limit = active_limit(m, settings, th)
    neck = trainer_idle(history, settings, th) or bottleneck(m, settings, th)
    sat = saturation(history, settings, th)
    mix = sat if sat is not None and sat.rule == "mix" else None  # after an idle trainer (issue #41): see diagnose
    found = [d for d in (duplicates(history, settings, th), None if mix else sat, neck, mix, limit,
                         length_bias(history, settings, th), tool_use(m, th), trainer_memory(m),
                                   host_saturated(m, settings, th)) if d is not None]
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


def _family(rule: str) -> str:
    """The finding a rule belongs to when counting holds: an idle trainer is one finding whether a window names its
    cause or not."""
    return "idle" if rule.startswith("trainer_idle") or rule == "generation_bound" else rule


def _words(d: Diagnosis) -> str:
    """A finding in words, as the settling line names it: its text up to the first ``(`` or ``;``."""
    return re.split(r"[(;]", d.text, maxsplit=1)[0].strip() or d.rule  # its words, not its rule id


def _span(rows: list[dict[str, Any]], first: int, last: int) -> str:
    """``steps 4-6`` for the windows ``rows[first..last]``; when a step is not logged, ``the last N windows`` (they
    end with the newest) or ``N windows``."""
    a, b = num(rows[first], "step"), num(rows[last], "step")
    if a is not None and b is not None:
        return f"steps {a:.0f}-{b:.0f}"
    return f"{'the last ' if last == len(rows) - 1 else ''}{last - first + 1} windows"


def _forgot_windows(history: MetricsHistory) -> bool:
    """Whether ``history`` is full, so it may have forgotten the run's first windows."""
    maxlen = getattr(getattr(history, "_rows", None), "maxlen", None)
    return maxlen is not None and len(history) >= maxlen


def steady_diagnosis(history: MetricsHistory, settings: RunSettings = RunSettings(),
                     th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis:
    """The dashboard's line: `diagnose` of the newest window when it is ok; otherwise the most severe warning
    (info and above) found in each of the newest ``th.hold_windows`` windows, each finding counted on its own
    (one that held while a worse one came and went is shown; an idle trainer holds with or without its cause named
    in each window), its text then ending with the steps it held over (``held over steps 4-6``).

    While none holds, the line (severity ok) names the newest finding and says that no finding has held: ``no steady
    finding yet (newest: ...)`` while none has held in the kept windows of the run, and once one has, ``no steady
    finding now (the last one held over steps 4-7: <its words>; newest: ...)``, the steps being the whole run of
    windows that found it. A full `MetricsHistory` may have forgotten a finding that held early in the run: its line
    says ``now`` without naming one."""
    current = diagnose(history, settings, th)
    if th.hold_windows <= 1:
        return current
    waves = trainer_idle_in_waves(history, settings, th)
    if current.severity == OK:
        return current if waves is None else waves
    rows = history.rows
    hold = th.hold_windows
    findings: dict[int, tuple[list[Diagnosis], Diagnosis | None]] = {}  # `_findings` of the windows up to each

    def found_up_to(end: int) -> tuple[list[Diagnosis], Diagnosis | None]:
        if end not in findings:
            past = MetricsHistory(maxlen=len(rows))
            for r in rows[:end + 1]:
                past.push(r)
            findings[end] = _findings(past, settings, th)
        return findings[end]

    def families(end: int) -> set[str]:
        return {_family(d.rule) for d in found_up_to(end)[0] if d.severity != OK}

    def held(end: int) -> list[Diagnosis]:  # the warnings of window ``end`` that held over the ``hold`` up to it
        fams = families(end)
        for back in range(1, hold):
            fams &= families(end - back)
        return [d for d in findings[end][0] if _family(d.rule) in fams]

    def start(rule: str, end: int) -> int:  # the first of the run of windows up to ``end`` that found ``rule``
        first = end - hold + 1
        while first > 0 and _family(rule) in families(first - 1):
            first -= 1
        return first

    last = len(rows) - 1
    if len(rows) >= hold and (steady := held(last)):  # the whole run it held over, as the line after it says
        best = _shown(max(steady, key=lambda d: d.rank), findings[last][1])
        if waves is None or waves.rank <= best.rank or _family(best.rule) == "idle":
            return Diagnosis(best.rule, f"{best.text} (held over {_span(rows, start(best.rule, last), last)})",
                             best.severity)
    if waves is not None:  # windows that alternate between busy and idle: together they are idle (issue #42)
        return waves
    tail = f"newest: {_words(current)}; shown once it holds over {hold} windows"
    for end in range(last - 1, hold - 2, -1):  # the newest earlier window where a finding had held
        if steady := held(end):
            best = max(steady, key=lambda d: d.rank)
            first = start(best.rule, end)
            return Diagnosis("settling", f"no steady finding now (the last one held over {_span(rows, first, end)}: "
                             f"{_words(best)}; {tail})", OK)
    if _forgot_windows(history):
        return Diagnosis("settling", f"no steady finding now ({tail})", OK)
    return Diagnosis("settling", f"no steady finding yet ({tail})", OK)
