"""One ``metrics.jsonl`` window as the plain log line (issue #36): what `asyncgrpo train` prints per logging step
in plain mode and what the Python API prints instead of transformers' dict of every metric (the dict stays in
``metrics.jsonl``). The dashboard adds its diagnosis to the same line; the trainer has none to add.

Example: ``step 3/8 | reward 0.25 | gen 1.2k tok/s 40 rollouts/s | train 3.4k tok/s | step 2.10 s | busy 41% | queue 5 | stale 0.50``
(``| dropped stale 3 (92% of generated tokens)`` follows in a window that dropped samples stale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

DASH = "—"


def num(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    """``metrics[name]`` as a finite float, or None when absent, null, NaN or not a number."""
    if not metrics:
        return None
    value = metrics.get(name)
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def busy_share(m: Mapping[str, Any] | None) -> float | None:
    """The trainer's busy share of a step: ``1 - perf/rollout_wait_s / perf/step_s`` clamped to [0, 1]
    (a fraction); None when either is missing or the step time is not positive."""
    wait, step_s = num(m, "perf/rollout_wait_s"), num(m, "perf/step_s")
    if wait is None or step_s is None or step_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - wait / step_s))


SYNC_SHOWN_FRAC = 0.25  # the weight sync's share of a step from which the plain line shows it

#: The stages of one generation request, as `request_breakdown` names them, with the metric each is read from.
REQUEST_STAGES = (("queue", "rollout/vllm_queue_s"), ("prefill", "rollout/vllm_prefill_s"),
                  ("decode", "rollout/vllm_decode_s"))


def request_breakdown(m: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Where one generation request's time goes (issue #41), from a window's metrics: vLLM's own per-request
    means (``rollout/vllm_queue_s``, ``_prefill_s``, ``_decode_s``), the worker's HTTP round trip
    (``rollout/request_s``; what it holds beyond vLLM's three stages is the API server, the HTTP transport and
    the worker's event loop: ``server+http``) and its parse of the answer (``rollout/parse_s``).

    Returns:
        ``{"rollouts_per_s", "groups_per_s", "request_s", "shares": {stage: fraction of request + parse},
        "binding": the largest stage}``; None without ``rollout/request_s`` and ``rollout/rollouts_per_s``.
        ``shares`` is empty and ``binding`` None when the server reports none of vLLM's three stages (the
        embedded sampler has no such histograms): the worker's parse alone would not say where the time goes.
    """
    rate, request = num(m, "rollout/rollouts_per_s"), num(m, "rollout/request_s")
    if rate is None and request is None:
        return None
    out: dict[str, Any] = {"rollouts_per_s": rate, "groups_per_s": num(m, "rollout/groups_per_s"),
                           "request_s": request, "shares": {}, "binding": None}
    if request is None or request <= 0:
        return out
    parse = num(m, "rollout/parse_s") or 0.0
    whole = request + parse
    parts = {name: v for name, key in REQUEST_STAGES if (v := num(m, key)) is not None}
    if not parts:
        return out
    parts["server+http"] = max(0.0, request - sum(parts.values()))
    parts["parse"] = parse
    out["shares"] = {name: min(1.0, v / whole) for name, v in parts.items()}
    out["binding"] = max(out["shares"], key=out["shares"].get)
    return out


def breakdown_text(b: Mapping[str, Any] | None) -> str | None:
    """``700 rollouts/s; decode 60% of a request`` (the binding stage with its share), or None when unknown."""
    if not b or b.get("rollouts_per_s") is None:
        return None
    text = f"{fmt_rate(b['rollouts_per_s'])} rollouts/s"
    if b.get("binding"):
        text += f"; {b['binding']} {b['shares'][b['binding']]:.0%} of a request"
    return text


def fmt(value: float | None, spec: str = ".3g") -> str:
    """A number with ``spec``, or ``—`` when unknown."""
    return DASH if value is None else format(value, spec)


def fmt_pct(value: float | None) -> str:
    """A fraction as a percentage (``0.25`` → ``25%``), or ``—``."""
    return DASH if value is None else f"{value:.0%}"


def fmt_rate(value: float | None) -> str:
    """Tokens per second with a k/M suffix (``1234.5`` → ``1.23k``), or ``—``."""
    if value is None:
        return DASH
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


def _gen_text(tokens_per_s: float | None, rollouts_per_s: float | None, in_flight: float | None = None) -> str:
    """``gen 1.2k tok/s 40 rollouts/s``; ``gen — (no generation figures in this window)`` when the window holds
    neither (a bare ``gen — tok/s`` read like a broken field beside another window's ``gen 0 tok/s``); a window
    in which no rollout finished while ``in_flight`` requests ran adds ``(16 in flight, none finished in this
    window)``, so that ``gen 0`` beside a reached concurrency limit does not read as a stalled sampler."""
    if tokens_per_s is None and rollouts_per_s is None:
        return f"gen {DASH} (no generation figures in this window)"
    text = f"gen {fmt_rate(tokens_per_s)} tok/s"
    text += f" {fmt_rate(rollouts_per_s)} rollouts/s" if rollouts_per_s is not None else ""
    finished = rollouts_per_s if rollouts_per_s is not None else tokens_per_s
    if finished == 0 and in_flight:
        text += f" ({in_flight:.0f} in flight, none finished in this window)"
    return text


def _reward_text(reward: float | None, zero_std_frac: float | None, trained: float | None = None) -> str:
    """``reward 0.25``; a window whose every scored group had one reward for all its completions (no spread, so
    none was kept for training: ``frac_reward_zero_std`` 1) says so, since what trained in it came from groups
    scored before (the line's ``train`` part counts them). A window that scored no group gives what the groups it
    trained had scored (``reward_trained``, their samples' mean), so that the step still shows a reward."""
    if reward is None:
        return "reward — (no group scored in this window" + (
            f"; the trained groups had scored {fmt(trained, '.4g')})" if trained is not None else ")")
    return f"reward {fmt(reward, '.4g')}" + (" (the groups scored in this window all alike: none kept)"
                                             if zero_std_frac == 1.0 else "")


def _train_text(tokens_per_s: float | None, groups_per_step: float | None, scored_earlier: bool = False) -> str:
    """``train 3.4k tok/s``, with the groups a step trained when known: ``train 3.4k tok/s (64 groups)``, ``(1 group)``
    (a mean over a window of several steps can be fractional: ``(1.5 groups)``); ``scored_earlier`` (no group of
    this window was kept) adds that the trained ones were scored before it: ``(2 groups, scored earlier)``."""
    text = f"train {fmt_rate(tokens_per_s)} tok/s"
    if not groups_per_step:
        return text
    shown = f"{groups_per_step:.0f}" if abs(groups_per_step - round(groups_per_step)) < 0.05 else f"{groups_per_step:.1f}"
    return text + f" ({shown} {'group' if shown == '1' else 'groups'}{', scored earlier' if scored_earlier else ''})"


def metrics_line(metrics: Mapping[str, Any], max_steps: float | None = None, diagnosis: str | None = None) -> str:
    """The plain line of one window: step (of ``max_steps``), reward (and whether no group scored in the window
    was kept), generated and trained tokens per second (with the groups a step trained),
    step time, the seconds of it the server did not answer (1 s or more: a stopped or hung server), the weight
    sync's time when it took 1 s and a quarter of the step or more (a slow or hung server; the busy share counts
    it), the trainer's busy share (left out when unknown), queue, mean staleness, the samples dropped stale (only
    when some were, with their share of the generated tokens), the graphs ``torch.compile`` built in the window
    (only when it built some) and ``diagnosis`` (if any)."""
    step = num(metrics, "step")
    busy = busy_share(metrics)
    step_s, sync_s = num(metrics, "perf/step_s"), num(metrics, "perf/weight_sync_s")
    silent = num(metrics, "server/silent_s")  # the server stalled through part of the step (`ServerWatch`)
    # A weight sync that took a good part of the step (a slow or hung server: it counts as busy) is shown.
    long_sync = sync_s is not None and step_s and sync_s >= max(1.0, SYNC_SHOWN_FRAC * step_s)
    reward, zero_std = num(metrics, "reward"), num(metrics, "frac_reward_zero_std")
    parts = [f"step {fmt(step, '.0f')}" + (f"/{max_steps:.0f}" if max_steps and max_steps > 0 else ""),
             _reward_text(reward, zero_std, num(metrics, "reward_trained")),
             _gen_text(num(metrics, "rollout/generated_tokens_per_s"), num(metrics, "rollout/rollouts_per_s"),
                       num(metrics, "rollout/concurrency")),
             _train_text(num(metrics, "perf/wall_clock_trained_tokens_per_s"), num(metrics, "batch/groups_per_step"),
                         reward is None or zero_std == 1.0),
             f"step {fmt(step_s, '.2f')} s",
             *([f"server silent {silent:.0f} s of it"] if silent is not None and silent >= 1.0 else []),
             *([f"weight sync {sync_s:.2f} s"] if long_sync else []),
             *([f"busy {fmt_pct(busy)}"] if busy is not None else []),
             f"queue {fmt(num(metrics, 'rollout/queue_size'), '.0f')}",
             f"stale {fmt(num(metrics, 'sample/staleness_mean'), '.2f')}"]
    dropped = num(metrics, "sample/dropped_stale_count")
    if dropped:
        share = num(metrics, "sample/dropped_stale_token_frac")
        parts.append(f"dropped stale {dropped:.0f}" + (f" ({share:.0%} of generated tokens)" if share else ""))
    compiled = num(metrics, "perf/fwd_bwd_compile_count")
    if compiled:  # the first step's compile, or a shape the compiled code had not seen (train/host_time.py)
        parts.append(f"compiled {compiled:.0f} graph{'s' if compiled != 1 else ''}")
    if diagnosis:
        parts.append(diagnosis)
    return " | ".join(parts)
