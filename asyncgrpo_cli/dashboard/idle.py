"""Why an idle trainer waits (SPEC §5.1, issue #33): `trainer_idle` and its causes, as pure functions of logged
metrics (`asyncgrpo_cli.dashboard.findings`); `asyncgrpo_cli.dashboard.diagnosis` ranks it with the other
findings.

The trainer's busy share (`busy_share`) is ``1 - perf/rollout_wait_s / perf/step_s`` clamped to [0, 1]. The
trainer is idle (`trainer_idle`, issue #33) when its wait is "high" as above (the premise of generation-bound).
Its cause is the first of these that holds, each with the CLI override that fixes it:

0. ``trainer_idle_server_silent``: the server did not answer (``server/silent_s``) for half the wait or more:
   stopped or hung, no setting; a stopped one continues with ``kill -CONT``.
1. ``trainer_idle_api_servers``: ``sampler.backend=vllm`` with one API server (``sampler.api_server_count=1``,
   or LoRA, which forces 1) and ``rollout.num_sampler_logprobs`` > 0: the one API server serialises the
   top log-probs (measured with a 0.6B model on one H200: top-8 cost 80% of generation throughput with 1
   server, 37% with 8). Fix ``sampler.api_server_count=8``.
2. ``trainer_idle_eager``: vllm with ``--enforce-eager`` in ``sampler.extra_args`` (no CUDA graphs; measured
   0.54 vs 0.73 steps/s, SmolLM2-135M on one H200). Fix: the extra args without it.
3. ``trainer_idle_on_policy``: ``staleness.max_staleness=0``: on-policy rounds (issue #33) generate each step's
   samples after the last weight sync, so training and generation take turns by design. Fix: ``max_staleness=1``.
4. ``trainer_idle_allowance``: the staleness token allowance holds generation back (where the producer logs what held
   it, ``rollout/held_allowance_frac`` at least ``high_wait_frac``, 20%, of the window and at least
   ``rollout/held_cap_frac`` first; where it does not, not with the rollouts in flight at the cap while the allowance
   admits as many: then the cap is the limit): ``rollout/backpressure_s``
   active (> ``backpressure_active_s``), or ``rollout/concurrency`` below ``inflight_low_frac`` (0.5) of
   ``rollout/concurrency_cap`` while the allowance admits fewer rollouts than the cap (unknown counts as
   fewer). It admits ~``max(max_staleness, 1) x weight_sync_steps x batch/samples_per_step`` rollouts (queued
   included); fix: ``max_staleness`` or (unless the step closed on ``packing.max_groups_per_step``) ``token_budget``
   scaled by cap / admitted (at least one more step's worth), the budget rounded up to 256 tokens.
   ``trainer_idle_deadline`` instead when deadline admission held the rollout producer (`rollout.holds`):
   ``rollout/held_deadline_frac`` at least ``high_wait_frac`` (20%) and above ``rollout/held_allowance_frac``.
   Fix: ``max_staleness`` one higher (deadline admission already counts a rollout in flight at what it is
   expected to queue, so ``in_flight_estimate`` does not loosen it), and with ``in_flight_estimate=mean`` and
   ``frac_reward_zero_std`` from ``zero_std_high`` (0.5), ``staleness.in_flight_estimate=kept`` for the allowance
   that binds next; or, while it is unset, ``staleness.deadline_release_versions=4`` (opt-in release).
5. ``trainer_idle_stale_drops``: ``sample/dropped_stale_token_frac`` above ``stale_waste_frac`` (5%), mean over
   the newest ``stale_windows`` windows: generation the trainer never gets. Fix: twice ``max_staleness``.
6. ``trainer_idle_worker``: the rollout worker's own process uses ``worker_busy`` (0.9) of a CPU core or more
   (``rollout/worker_main_cpu``, issue #41): its Python parses every answer and builds every sample one thread at
   a time, so more engines cannot lift generation. No option adds a worker process yet; the text says what
   lightens it (its reward processes are counted apart, in ``rollout/worker_cpu``).
   ``trainer_idle_engine_core``: vllm whose engine core uses ``engine_core_busy`` (0.9) of a CPU core or more
   (``server/engine_core_cpu``, issue #41): its host loop bounds generation (two servers on one H200 generated
   2.0-2.3x). Fix: one more server, ``sampler.engines``.
   ``trainer_idle_embedded``: the embedded sampler on a CPU job (no GPU memory logged), or whose process uses
   ``embedded_busy`` (0.9) CPU cores or more (``server/frontend_cpu``), or on a machine whose cores are all busy
   (``host/cpu_busy_frac`` from ``host_busy_frac``, 0.9): one model step at a time on one model thread paces
   generation (the CPU smoke job). Fix: shorter completions or smaller groups; ``sampler.backend=vllm`` on a GPU.
7. ``trainer_idle_cap``: over the newest ``cap_windows`` (3) windows the adaptive cap stayed at one value below
   ``max_concurrent_rollouts``, ``rollout/concurrency`` at it and the KV cache "low" (< 50%). With requests
   waiting in vLLM (mean ``rollout/vllm_queued_requests`` > 0; the cap grows only when none waits) the fix is
   ``--max-num-seqs max_concurrent_rollouts`` in ``sampler.extra_args``; with none waiting, a higher
   starting cap (KV-cache tokens / ``sampler.max_model_len``).
8. ``trainer_idle_ceiling``: ``rollout/concurrency`` at ``max_concurrent_rollouts`` with the KV cache low. Fix:
   twice ``staleness.max_concurrent_rollouts`` (if environments and tools allow).

Beside any cause, the head notes groups dropped without reward spread when they are half or more
(`no_signal_note`): no setting fixes that, and it multiplies whatever wait the cause makes.

Order: the config causes (1, 2) first, named only when the metrics confirm them: the trainer waits and the KV cache
is not full (at most ``engine_full_kv_frac``, 80%; above it vLLM's memory, not a flag, limits generation); their
cost is measured and their fix costs nothing. On-policy training (3) follows: it waits by design, whatever the
metrics. The metric causes follow (4-8): slow generation itself keeps rollouts longer in the allowance and makes
them go stale, so they are named once the config is right. When no cause holds, the finding stays
``generation_bound``; with both waits high cause 4 holds (unless 1-3 does), so `diagnose` no longer shows
``staleness_too_tight`` (`bottleneck` still returns it). An idle trainer outranks "mix" at equal severity."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from ..rollout.stale_schedule import HEADROOM_MARGIN, RELEASE_AFTER_VERSIONS
from ..run.metrics_line import breakdown_text, busy_share, num, request_breakdown
from .findings import (DEFAULT_THRESHOLDS, WARN, Diagnosis, MetricsHistory, RunSettings, Thresholds, _level,
                       held_shares)
from .overrides import _drop_flag, _list_override


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


#: Deadline admission's fix names ``staleness.deadline_order=observed`` while ``rollout/deadline_overtake_share`` is at
#: most this (newer groups rarely finish before older ones, so counting them in full is what holds generation).
OBSERVED_SHARE_FRAC = 0.5


def generation_latency_steps(history: MetricsHistory,
                             th: Thresholds = DEFAULT_THRESHOLDS) -> tuple[float, float, float] | None:
    """How many of the trainer's own steps one rollout takes to generate, over the newest ``th.stale_windows``
    windows: ``(steps, rollout seconds, trainer step seconds)``, where the rollout seconds are the mean of the
    windows' ``rollout/duration_s`` (windows where no rollout finished have none) and the trainer's step is the
    median over the same windows of ``perf/step_s - perf/rollout_wait_s`` (its time without the wait for samples;
    the median, since the first step's compile is ten of the others).
    None when either is missing or the trainer's step is not positive."""
    rows = history.rows[-th.stale_windows:]
    durations = [d for d in (num(r, "rollout/duration_s") for r in rows) if d is not None and d > 0]
    own = [s - (num(r, "perf/rollout_wait_s") or 0.0) for r in rows if (s := num(r, "perf/step_s")) is not None]
    if not durations or not own or sum(own) <= 0:
        return None
    rollout_s, step_s = sum(durations) / len(durations), statistics.median(own)
    return rollout_s / step_s, rollout_s, step_s


def deadline_staleness(latency_steps: float, max_staleness: int) -> int:
    """The ``max_staleness`` at which deadline admission keeps generation fed when a rollout takes
    ``latency_steps`` trainer steps (> 0) to generate: ``ceil(2 x latency + HEADROOM_MARGIN + 1)``, at least one
    more than ``max_staleness``.

    Why: a group may be pulled while the trainer is at most ``max_staleness`` versions past its stamp, less
    `StaleSchedule`'s margin (0.25 of a version), and deadline admission counts everything committed (the queue,
    and every group in flight, the newer ones too) as pulled before it. To keep the trainer busy, about
    ``latency`` steps of rollouts must be in flight and one step's worth queued while the oldest group in flight is
    ``latency`` versions old: ``(latency + 1) <= max_staleness + 0.75 - latency``. The latency is measured at
    today's rollouts in flight, and more in flight decode slower, so one version more; it is still a floor (a run
    at the suggestion measures a longer latency and may suggest more). The simulation of the realistic job's shape
    (`scripts/bench/bench_deadline_waves.py`: 512-token completions, a rollout taking ~2.1 steps at 4) suggests 6:
    busy 72% at 4 (6 of 55 steps under 70%), 81% at 6 (3), 85% at 8 (1); on the GPU (issue #42) 4 kept the trainer
    busy 70% (5 of 19 steps under 70%), 8 kept it 85% (one step under)."""
    need = math.ceil(2.0 * latency_steps + HEADROOM_MARGIN + 1.0 - 1e-9)
    return max(max_staleness + 1, need)


def _deadline_held(m: Mapping[str, Any] | None, s: RunSettings, th: Thresholds,
                   history: MetricsHistory | None = None) -> tuple[str, str, str] | None:
    """Cause 4 when deadline admission, not the allowance, held the producer (``rollout/held_deadline_frac`` at
    least ``th.high_wait_frac`` and above ``rollout/held_allowance_frac``; `asyncgrpo_cli.rollout.holds`). Its fix
    sizes ``max_staleness`` from the rollouts' generation time when ``history`` logs it (`deadline_staleness`)."""
    shares = dict(held_shares(m))
    deadline = shares.get("deadline", 0.0)
    if deadline < th.high_wait_frac or deadline <= shares.get("allowance", 0.0):
        return None
    conc, cap = num(m, "rollout/concurrency"), num(m, "rollout/concurrency_cap")
    flight = f"; {conc:.0f} rollouts in flight" + (f", cap {cap:.0f}" if cap is not None else "") if conc is not None else ""
    release = s.deadline_release_versions
    until = (f", until {release} weight updates pass without another (twice as many after each new drop)"
             if release else "")
    why = (f"deadline admission holds generation back {deadline:.0%} of the time{flight} (on since a sample was "
           f"dropped stale{until}: a group starts only if every group in flight can still be trained after all "
           "that is committed, each rollout in flight counted at what it is expected to queue)")
    latency = generation_latency_steps(history, th) if history is not None else None
    if latency is None:
        fix = f"staleness.max_staleness={s.max_staleness + 1} (one more version of headroom per group)"
    else:
        steps, rollout_s, step_s = latency
        fix = (f"staleness.max_staleness={deadline_staleness(steps, s.max_staleness)} (a rollout takes "
               f"{rollout_s:.1f} s to generate, {steps:.1f} of the trainer's own {step_s:.2f} s steps; with every "
               f"committed token counted as pulled first, generation stays fed from max_staleness >= "
               f"2 x {steps:.1f} + {HEADROOM_MARGIN:g} + 1)")
    share = num(m, "rollout/deadline_overtake_share")
    if s.deadline_order == "pessimistic" and share is not None and share <= OBSERVED_SHARE_FRAC:
        fix += (f", or staleness.deadline_order=observed (opt-in: groups of later versions finished before an older "
                f"one for at most {share:.0%} of their tokens, so they count at that share against older groups, not "
                "in full)")
    if not release:
        n = RELEASE_AFTER_VERSIONS
        fix += (f", or staleness.deadline_release_versions={n} (opt-in: it turns off again after {n} weight updates "
                "without a stale drop; watch sample/dropped_stale_count)")
    zero = num(m, "frac_reward_zero_std")
    if s.in_flight_estimate == "mean" and zero is not None and zero >= th.zero_std_high:
        fix += (f", with staleness.in_flight_estimate=kept ({zero:.0%} of groups are discarded, never trained, yet "
                "each of their rollouts counts in full against the allowance, which binds next)")
    return "trainer_idle_deadline", why, fix


def _cause_allowance(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 4: the staleness token allowance (or deadline admission, `_deadline_held`) bounds the rollouts in
    flight."""
    m = history.latest
    held_by_deadline = _deadline_held(m, s, th, history)
    if held_by_deadline is not None:
        return held_by_deadline
    bp, conc = num(m, "rollout/backpressure_s"), num(m, "rollout/concurrency")
    cap, admitted = num(m, "rollout/concurrency_cap"), _allowance_rollouts(m, s)
    shares = dict(held_shares(m))
    if shares and (shares.get("allowance", 0.0) < th.high_wait_frac
                   or shares.get("cap", 0.0) > shares.get("allowance", 0.0)):
        return None  # the producer's own record: something else held it (a few short waits are not the bound)
    if not shares and conc is not None and cap is not None and conc >= th.at_limit_frac * cap \
            and admitted is not None and admitted >= cap:
        return None  # in flight at the cap, which admits fewer than the allowance: the cap is the limit
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
    if shares:  # the producer's own record: it waited on the allowance, also where the estimate above reads roomy
        parts.append(f"the rollout producer waited on it {shares.get('allowance', 0.0):.0%} of the window")
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
            f"sampler.engines={s.engines + 1} (one more server on the GPU; its start, about 2 minutes more, pays back over a long run: README, Several servers on one GPU)")


def _cause_embedded(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 6, for the embedded sampler: on a CPU job (no ``perf/gpu_memory_peak_gib`` logged: the trainer, and
    so the sampler's ``auto`` device, is the CPU), or with its process busy (``server/frontend_cpu``, the whole
    embedded server, of ``th.embedded_busy`` cores or more), or with the machine's cores all busy
    (``host/cpu_busy_frac`` from ``th.host_busy_frac``). It runs one batched model step at a time on one model
    thread, so no concurrency or staleness option lifts generation: two fresh-user trials' CPU runs were told to
    double ``max_concurrent_rollouts`` (followed: no faster, and the next fix changed every window) whenever the
    sampler's CPU share dipped under a threshold on a machine shared with a test suite."""
    m = history.latest
    cores, host = num(m, "server/frontend_cpu"), num(m, "host/cpu_busy_frac")
    on_cpu = num(m, "perf/gpu_memory_peak_gib") is None
    if s.backend != "embedded" or not (on_cpu or (cores is not None and cores >= th.embedded_busy) or
                                       (host is not None and host >= th.host_busy_frac)):
        return None
    busy = host is not None and host >= th.host_busy_frac
    if cores is None:
        uses = "runs on this machine's CPU" + (f" ({host:.0%} busy)" if busy else "")
    else:
        uses = f"uses {cores:.2f} CPU cores" + (f" of a machine {host:.0%} busy" if busy else "") + (
            " (the trainer and other programs take the rest)" if busy and cores < th.embedded_busy else "")
    return ("trainer_idle_embedded",
            f"the embedded sampler {uses}: it runs one model step at a time on one model thread "
            "(sampler.backend=embedded, the stand-in for vLLM), and that step paces generation, not a limit",
            "none in concurrency or staleness; shorter completions (rollout.max_completion_length) or smaller groups "
            "(rollout.num_generations) make each step's generation shorter; with a GPU, sampler.backend=vllm "
            "(README)")


def _cause_server_silent(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 0: the server did not answer for half the trainer's wait or more (``server/silent_s`` against
    ``perf/rollout_wait_s``): stopped (SIGSTOP, Ctrl-Z) or hung, not a setting, held generation (a fresh-user
    trial's 40 s SIGSTOP of the server was blamed on the staleness allowance)."""
    m = history.latest
    silent, wait = num(m, "server/silent_s"), num(m, "perf/rollout_wait_s")
    if silent is None or wait is None or wait <= 0 or silent < 0.5 * wait:
        return None
    return ("trainer_idle_server_silent",
            f"the server did not answer for {silent:.0f} s of it (stopped or hung: see the processes panel)",
            "none in the config: a stopped server continues with kill -CONT; a hung one ends the run with a "
            "checkpoint at sampler.hang_timeout")


def _cause_worker(history: MetricsHistory, s: RunSettings, th: Thresholds) -> tuple[str, str, str] | None:
    """Cause 6, first: the rollout worker's own process busy on its core (``rollout/worker_main_cpu`` of
    ``th.worker_busy`` cores or more, `train.host_load`): one Python thread at a time parses the answers and
    builds the samples, so neither more engines nor more rollouts in flight lift generation."""
    cores = num(history.latest, "rollout/worker_main_cpu")
    if cores is None or cores < th.worker_busy:
        return None
    return ("trainer_idle_worker",
            f"the rollout worker's own process uses {cores:.2f} of a CPU core: its Python (parsing each answer's "
            "log-probs, building the samples, handing groups to the reward functions) paces generation, not the "
            "server",
            "none as an option yet: a run has one rollout worker process (issue #41); a slow synchronous reward "
            "function shares its core unless it works in processes of its own, as accuracy_reward does")


#: The causes of an idle trainer, in the order they are tried (see the module docstring).
IDLE_CAUSES = (_cause_server_silent, _cause_api_servers, _cause_eager, _cause_on_policy, _cause_allowance, _cause_stale_drops,
               _cause_worker, _cause_engine_core, _cause_embedded, _cause_cap, _cause_ceiling)


def no_signal_note(history: MetricsHistory, th: Thresholds = DEFAULT_THRESHOLDS) -> str | None:
    """Why the wait grows as the policy learns, beside any cause: ``frac_reward_zero_std`` from ``th.zero_std_high``
    (mean over the newest ``th.stale_windows`` windows). A group without reward spread has no advantage and is
    dropped (SPEC §3.2, Appendix B.7), so generation makes ``1 / (1 - share)`` groups for each one trained, whatever
    bounds generation. No setting makes a dropped group count (the saturation finding says whether the prompts got
    too easy or too hard), so this is a note in the finding's head, not a cause that would hide one with a fix
    (issue #41's job: 75-88% of groups dropped, and the fix was the concurrency ceiling). A fresh-user trial's 30-step
    smoke run named only the embedded sampler from step 20 on, with most groups dropped. None below the threshold."""
    vals = history.values("frac_reward_zero_std")[-th.stale_windows:]
    share = sum(vals) / len(vals) if vals else None
    if share is None or share < th.zero_std_high:
        return None
    per = "almost none trained" if share >= 0.99 else f"{1 / (1 - share):.1f} generated per one trained"
    return f"{share:.0%} of groups dropped without reward spread, {per}"


def trainer_idle(history: MetricsHistory, settings: RunSettings = RunSettings(),
                 th: Thresholds = DEFAULT_THRESHOLDS, share_of: str = "the step") -> Diagnosis | None:
    """Issue #33: the trainer waits for samples a "high" share of the step (``perf/rollout_wait_s`` against
    ``perf/step_s``), with its most likely cause and the CLI override that fixes it (the causes and their
    order: the module docstring). None when the trainer is not idle or no cause holds (generation-bound
    then says what to check). ``share_of``: what the idle share is of, in the text (`trainer_idle_in_waves`:
    ``these steps``, its windows merged into one)."""
    m = history.latest
    wait, step_s = num(m, "perf/rollout_wait_s"), num(m, "perf/step_s")
    if _level(wait, step_s, th) != "high":
        return None
    busy = busy_share(m)
    rate = breakdown_text(request_breakdown(m))  # issue #41: generation's rate and its request's binding stage
    dropped = no_signal_note(history, th)
    head = (f"trainer idle {1 - busy:.0%} of {share_of}" if busy is not None else "trainer idle") \
        + f" (waits {wait:.2f} s for samples{f'; generation {rate}' if rate else ''}{f'; {dropped}' if dropped else ''})"
    for cause in IDLE_CAUSES:
        found = cause(history, settings, th)
        if found is not None:
            rule, why, fix = found
            return Diagnosis(rule, f"{head}: {why}; fix: {fix}", WARN)
    return None


#: `trainer_idle_in_waves` reads this many times ``hold_windows`` windows (fewer early in a run, at least
#: ``hold_windows``): the s21 job's waves ran four steps long, and three windows of them flickered around 20% idle.
WAVE_HOLDS = 2

#: Metrics `trainer_idle_in_waves` averages over the windows it reads (the rest are the newest window's).
#: The generation rate and the CPU readings too: a fresh-user trial's CPU run read "generation 0 rollouts/s" from a
#: newest window in which no rollout happened to finish, and its cause flickered with one window's CPU share.
WAVE_MEAN_KEYS = ("perf/rollout_wait_s", "perf/step_s", "rollout/backpressure_s", "rollout/concurrency",
                  "rollout/rollouts_per_s", "rollout/groups_per_s", "server/frontend_cpu", "host/cpu_busy_frac",
                  "server/silent_s")


#: A newest window silent for less than this (seconds of ``server/silent_s``) answers again: `trainer_idle_in_waves`
#: then leaves the older windows' silences out of their waits and steps.
SILENCE_OVER_S = 1.0


def _without_silence(row: dict) -> dict:
    """``row`` with its server's silence (``server/silent_s``) taken out of the trainer's wait and step: a silence
    that has ended is not what holds the trainer now (twenty-fourth session's trial: four steps after a 40 s SIGSTOP
    ended, the line over the windows still named the silent server, while the embedded sampler paced the steps)."""
    silent = num(row, "server/silent_s") or 0.0
    wait, step = num(row, "perf/rollout_wait_s"), num(row, "perf/step_s")
    if silent <= 0 or wait is None or step is None:
        return row
    cut = min(silent, wait)
    return {**row, "perf/rollout_wait_s": wait - cut, "perf/step_s": max(step - cut, 1e-9), "server/silent_s": 0.0}


def trainer_idle_in_waves(history: MetricsHistory, settings: RunSettings = RunSettings(),
                          th: Thresholds = DEFAULT_THRESHOLDS) -> Diagnosis | None:
    """An idle trainer over the newest ``WAVE_HOLDS x th.hold_windows`` windows (at least ``hold_windows``) taken
    together, when single windows disagree.

    Issue #42: with completions that all take about as long, groups admitted together finish together, and steps
    alternate between a full queue (busy 100%, generation held) and an empty one (busy 46-62%); no finding then
    holds over ``hold_windows`` windows in a row, and the dashboard said "no steady finding" while deadline admission
    held generation 99-100% of the run. Here the windows are one: ``perf/rollout_wait_s``, ``perf/step_s``,
    ``rollout/backpressure_s``, ``rollout/concurrency``, the generation rate and the CPU readings (`WAVE_MEAN_KEYS`)
    are averaged over them into the newest window, every ``rollout/held_{gate}_frac`` over the newest
    ``hold_windows`` of them (the gate that holds now; the rest is the newest window's own), and `trainer_idle`
    judges it with the windows before it as logged. Once the newest window's server answers again (silent under
    `SILENCE_OVER_S`), the older windows' silences leave their waits and steps (`_without_silence`).

    Returns `trainer_idle`'s finding, its text starting ``in waves over steps A-B (busy X-Y%)`` with the idlest and
    busiest windows' shares (``over steps A-B`` when fewer than two windows were busy or idle: a fresh-user trial's
    CPU run, idle but for one full step, read as waves), or None when fewer than ``hold_windows`` windows are logged, one lacks the step's wait or
    time, no window was idle, or the windows together are not.
    """
    rows = history.rows[-WAVE_HOLDS * th.hold_windows:]
    if len(rows) < th.hold_windows or th.hold_windows < 2:
        return None
    left_out = 0.0
    if (num(rows[-1], "server/silent_s") or 0.0) < SILENCE_OVER_S:
        left_out = sum(num(r, "server/silent_s") or 0.0 for r in rows)
        rows = [_without_silence(r) for r in rows]
    shares = [busy_share(r) for r in rows]
    if any(b is None for b in shares) or min(shares) >= 1 - th.high_wait_frac:
        return None
    merged = dict(rows[-1])
    held = {k for r in rows for k in r if k.startswith("rollout/held_") and k.endswith("_frac")}
    for key in set(WAVE_MEAN_KEYS) | held:
        # Which gate holds generation changes over a run (a CPU trial: the allowance in steps 1-3, the cap from
        # step 4, 0.502 against 0.494 over six windows): the gates' shares are the newest hold_windows' alone.
        over = rows[-th.hold_windows:] if key in held else rows
        vals = [v for v in (num(r, key) for r in over) if v is not None]
        if vals:
            merged[key] = sum(vals) / len(vals)
    together = MetricsHistory(maxlen=len(history.rows))
    for r in history.rows[:-1]:  # the rules that read several windows (stale drops, rollout times) see them all
        together.push(r)
    together.push(merged)
    # the share is of these steps taken together, not of the newest one (a trial read "busy 100% | ... trainer
    # idle 47% of the step" on one line)
    found = trainer_idle(together, settings, th, share_of="these steps")
    if found is None:
        return None
    first, last = num(rows[0], "step"), num(rows[-1], "step")
    span = f"steps {first:.0f}-{last:.0f}" if first is not None and last is not None else f"{len(rows)} windows"
    busy = sum(b >= 1 - th.high_wait_frac for b in shares)
    waves = "in waves over" if busy >= 2 and len(shares) - busy >= 2 else "over"  # one busy window is no wave
    silence = f"; the server's {left_out:.0f} s of silence left out" if left_out >= SILENCE_OVER_S else ""
    return Diagnosis(found.rule, f"{waves} {span} (busy {min(shares):.0%}-{max(shares):.0%}{silence}): {found.text}",
                     found.severity)
