"""What holds the rollout producer (issue #41): `HoldClock` on a fake clock, the loop's admission gate naming the
rule that holds a group back, and the dashboard's reading of ``rollout/held_{gate}_frac``."""

from __future__ import annotations

import queue
import threading

import pytest

from asyncgrpo_cli.dashboard.diagnosis import MetricsHistory, RunSettings, trainer_idle
from asyncgrpo_cli.dashboard.findings import held_shares
from asyncgrpo_cli.dashboard.panels import held_text
from asyncgrpo_cli.rollout.holds import HOLD_GATES, HoldClock, held_metric
from asyncgrpo_cli.rollout.metrics import MetricsWindow


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hold_clock_credits_each_gate_its_own_seconds():
    clock = FakeClock()
    holds = HoldClock(clock)
    clock.now += 1.0                      # free
    holds.hold("allowance")
    clock.now += 2.0
    holds.hold("deadline")                # allowance 2 s
    clock.now += 3.0
    holds.hold("deadline")                # the same gate again: no new period, nothing lost
    clock.now += 1.0
    holds.hold(None)                      # deadline 4 s
    clock.now += 2.0
    seconds, elapsed = holds.take()
    assert elapsed == pytest.approx(9.0)
    assert seconds == {"round": 0.0, "allowance": 2.0, "deadline": 4.0, "cap": 0.0, "score": 0.0}
    assert holds.take() == (dict.fromkeys(HOLD_GATES, 0.0), 0.0)


def test_a_hold_that_spans_takes_is_split_between_them_and_never_exceeds_the_elapsed_time():
    clock = FakeClock()
    holds = HoldClock(clock)
    holds.hold("cap")
    clock.now += 1.5
    first, elapsed1 = holds.take()
    clock.now += 0.5
    second, elapsed2 = holds.take()
    assert (first["cap"], elapsed1) == (1.5, 1.5)
    assert (second["cap"], elapsed2) == (0.5, 0.5)
    assert holds.gate == "cap"
    window = MetricsWindow()  # as the loop's monitor records them: a share of the window's wall time
    for seconds, elapsed in ((first, elapsed1), (second, elapsed2)):
        for gate, s in seconds.items():
            window.add_rate(held_metric(gate), s, elapsed)
    out = window.flush()
    assert out["rollout/held_cap_frac"] == pytest.approx(1.0)
    assert out["rollout/held_deadline_frac"] == 0.0


def test_unknown_gates_are_refused():
    with pytest.raises(ValueError, match="unknown hold gate 'slots'"):
        HoldClock(FakeClock()).hold("slots")
    with pytest.raises(ValueError, match="unknown hold gate"):
        held_metric("nope")


class _Value:
    def __init__(self, value):
        self.value = value


def _loop(tmp_path, max_staleness: int):
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop

    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=2, max_completion_length=4,
                          max_staleness=max_staleness, vllm_server_base_url="http://127.0.0.1:1",
                          max_concurrent_rollouts=8, report_to="none")
    return AsyncRolloutLoop(cfg, "m", [], [], None, [0], queue.Queue(), _Value(1), _Value(1e9), _Value(0.0),
                            threading.Event(), queue.Queue(), queue.Queue(), consumed_tokens_value=_Value(0.0),
                            stale_dropped_value=_Value(0))


def test_the_admission_gate_names_the_rule_that_holds_a_group_back(tmp_path):
    loop = _loop(tmp_path, max_staleness=1)
    assert loop._admission_gate(1e9) is None                   # nothing in flight: a group always starts
    loop.allowance.on_group_started(2)
    assert loop._admission_gate(1e9) == "allowance"            # the first group runs alone (SPEC §4.1)
    for _ in range(2):
        loop.allowance.on_rollout_finished(10)
    loop.allowance.on_group_finished()
    loop.allowance.on_samples_queued(20, rollouts=2)
    loop.allowance.on_group_started(2)                          # 2 rollouts in flight at 10 tokens each
    loop.schedule.on_group_started(0, 0, 20.0)
    loop.schedule.observe(1, 0.0)
    # committed 40 (20 queued + 20 in flight): under an allowance of 50, and deadline admission is off
    assert loop._admission_gate(50.0) is None
    loop.schedule.on_dropped_stale()
    # group 0 (stamped 0, trainer at 1, max_staleness 1) may see 0.75 x 50 = 37.5 tokens pulled before it; the
    # 40 committed less its own 20 plus the new group's 20 is 40: the new group would push it past its deadline
    assert loop._admission_gate(50.0) == "deadline"
    assert loop._admission_gate(40.0) == "allowance"           # the allowance is asked first
    loop.schedule.on_group_finished(0, 1)                      # group 0 back: no group in flight to protect
    assert loop._admission_gate(50.0) is None


def test_the_on_policy_round_is_its_own_gate(tmp_path):
    loop = _loop(tmp_path, max_staleness=0)
    assert loop.rounds is not None
    loop.rounds.observe(0, 1, 1000.0)  # the trainer closed its step: samples pulled now train at version 1
    assert loop.rounds.closed
    assert loop._admission_gate(1e9) == "round"


def _idle(**extra) -> dict:
    """A window whose trainer waits 60% of the step, its rollouts in flight far under the cap."""
    return {"step": 1, "perf/rollout_wait_s": 1.2, "perf/step_s": 2.0, "rollout/concurrency": 150.0,
            "rollout/concurrency_cap": 1024.0, "batch/samples_per_step": 512.0, "rollout/backpressure_s": 0.04,
            **extra}


def test_an_idle_trainer_held_by_deadline_admission_names_it_with_its_fixes():
    h = MetricsHistory()
    h.push(_idle(**{"rollout/held_deadline_frac": 0.7, "rollout/held_allowance_frac": 0.05,
                    "rollout/held_cap_frac": 0.0, "frac_reward_zero_std": 0.72}))
    d = trainer_idle(h, RunSettings(max_staleness=2, max_concurrent_rollouts=1024))
    assert d.rule == "trainer_idle_deadline"
    assert "deadline admission holds generation back 70% of the time; 150 rollouts in flight, cap 1024" in d.text
    assert "fix: staleness.max_staleness=3" in d.text
    assert ", with staleness.in_flight_estimate=kept (72% of groups are discarded" in d.text
    kept = trainer_idle(h, RunSettings(max_staleness=2, max_concurrent_rollouts=1024, in_flight_estimate="kept"))
    assert kept.rule == "trainer_idle_deadline" and "in_flight_estimate" not in kept.text
    assert "or staleness.deadline_release_versions=4 (opt-in" in d.text
    released = trainer_idle(h, RunSettings(max_staleness=2, deadline_release_versions=8))
    assert "until 8 weight updates pass without another" in released.text
    assert "deadline_release_versions=4" not in released.text


def test_the_allowance_cause_stays_when_the_allowance_holds_more_than_deadline_admission():
    h = MetricsHistory()
    h.push(_idle(**{"rollout/held_deadline_frac": 0.3, "rollout/held_allowance_frac": 0.6}))
    assert trainer_idle(h, RunSettings(max_staleness=2, max_concurrent_rollouts=1024)).rule == "trainer_idle_allowance"
    h2 = MetricsHistory()
    h2.push(_idle())  # a run from before the hold metrics: as before
    assert trainer_idle(h2, RunSettings(max_staleness=2, max_concurrent_rollouts=1024)).rule == "trainer_idle_allowance"


def test_the_panel_lists_the_gates_that_held_the_producer():
    m = {"rollout/held_deadline_frac": 0.62, "rollout/held_cap_frac": 0.11, "rollout/held_allowance_frac": 0.01,
         "rollout/held_round_frac": 0.0, "rollout/held_score_frac": 0.0}
    assert held_shares(m)[:2] == [("deadline", 0.62), ("cap", 0.11)]
    assert held_text(m) == "deadline 62% · cap 11%"
    assert held_text({"rollout/held_cap_frac": 0.01}) == "nothing"
    assert held_text({}) == "—"
