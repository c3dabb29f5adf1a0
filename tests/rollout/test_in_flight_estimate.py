"""``staleness.in_flight_estimate=kept`` through the rollout loop against the embedded sampler: the loop reports
each decided group's rollouts to its `TokenAllowance` (kept and dropped groups alike), the in-flight estimate is
what finished rollouts put into the rollout queue, and ``rollout/in_flight_tokens_per_rollout`` is logged."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from asyncgrpo_cli.testing import deadline_s as machine_deadline

from test_worker import _Loop, _Value, config, model_dir, prompts, server, tokenizer  # noqa: F401


def every_other_prompt_reward(completions, answer, **kwargs):
    """Spread inside the groups of prompts 0, 2, 4 (answers 0, 4, 8): kept; none for 1, 3, 5: dropped."""
    if int(answer[0]) % 4:
        return [0.0 for _ in completions]
    return [float(i % 2) for i in range(len(completions))]


@pytest.mark.parametrize("estimate", ["mean", "kept"])
def test_the_loop_reports_decided_groups_and_the_estimate_follows_the_queue(estimate, server, tokenizer, tmp_path):
    cfg = config(tmp_path, server.url, in_flight_estimate=estimate)
    buf, metrics, errors = queue.Queue(), queue.Queue(), queue.Queue()
    loop = _Loop(cfg, "tiny", prompts(), [every_other_prompt_reward], tokenizer, [tokenizer.eos_token_id], buf,
                 _Value(0), _Value(10.0**9), _Value(0.0), threading.Event(), errors, metrics,
                 consumed_tokens_value=_Value(0.0))
    assert loop.allowance.in_flight_estimate == estimate
    loop.allowance.kept_min_decided = 1  # six groups of 4 here; the 64-rollout warm-up is test_allowance's
    thread = threading.Thread(target=lambda: asyncio.run(loop.run_async()), daemon=True)
    thread.start()
    outcomes, names = [], set()
    try:
        end = time.monotonic() + machine_deadline(120)
        while len(outcomes) < 6 or "rollout/in_flight_tokens_per_rollout" not in names:
            assert time.monotonic() < end, (len(outcomes), errors.qsize())
            try:
                outcomes.append(buf.get(timeout=0.05))
            except queue.Empty:
                pass
            while not metrics.empty():
                names |= set(metrics.get())
    finally:
        loop.stop()
        thread.join(timeout=30)
    while not buf.empty():
        outcomes.append(buf.get())
    kinds = [o.kind for o in outcomes]
    assert set(kinds) == {"kept", "dropped"}, kinds
    a = loop.allowance
    assert a.decided_rollouts_total == 4 * len(outcomes)  # num_generations=4, every group once, dropped ones too
    queued = sum(s.num_tokens for o in outcomes if o.kind == "kept" for s in o.samples)
    assert a.queued_tokens_total == pytest.approx(queued)
    assert a.kept_tokens_per_rollout == pytest.approx(queued / (4 * len(outcomes)))
    mean = a.tokens_per_rollout
    if estimate == "mean":
        assert a.in_flight_tokens_per_rollout == pytest.approx(mean)  # SPEC B.4
    else:
        assert a.in_flight_tokens_per_rollout == pytest.approx(min(mean, max(a.kept_tokens_per_rollout, 0.1 * mean)))
        assert a.in_flight_tokens_per_rollout < mean  # half the groups dropped


def test_the_opt_in_is_shown_at_start_and_a_no_effect_combination_is_named():
    """Fresh-user trial: nothing on screen said `kept` was on, and `kept` with max_staleness=0 passed silently."""
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.config.run_checks import in_flight_estimate_notes, validate_run

    on = validate_run(compose(["+recipe=smoke", "staleness.in_flight_estimate=kept"]), "train")
    assert any(w.startswith("staleness.in_flight_estimate=kept (opt-in)") for w in on)
    idle = validate_run(compose(["+recipe=smoke", "staleness.in_flight_estimate=kept", "staleness.max_staleness=0"]),
                        "train")
    assert any("has no effect at staleness.max_staleness=0" in w for w in idle)
    assert not any("in_flight_estimate" in w for w in validate_run(compose(["+recipe=smoke"]), "train"))
    assert in_flight_estimate_notes("kept", 0, str)[0].startswith("in_flight_estimate=kept has no effect at max_staleness=0")
    assert in_flight_estimate_notes("mean", 0, str) == []


def test_the_api_error_spells_the_fix_in_python():
    import pytest

    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.config.rules import ConfigError

    with pytest.raises(ConfigError, match='Fix: set in_flight_estimate="mean", or in_flight_estimate="kept"'):
        AsyncGRPOConfig(output_dir="/tmp/unused_api_check", in_flight_estimate="queued")
