"""Issue #42: a trainer idle in waves under deadline admission, and the max_staleness that feeds it."""
from __future__ import annotations

import pytest

from asyncgrpo_cli.dashboard.diagnosis import MetricsHistory, RunSettings, steady_diagnosis, trainer_idle
from asyncgrpo_cli.dashboard.idle import deadline_staleness, generation_latency_steps, trainer_idle_in_waves

SETTINGS = RunSettings(max_staleness=4, max_concurrent_rollouts=1024, num_generations=8)


def _window(step: int, wait: float, duration: float | None = None) -> dict:
    """One logged step of the realistic job's shape: the trainer's own step 2.3 s, deadline admission holding the
    producer all the window, ``wait`` seconds waited for samples."""
    row = {"step": step, "perf/step_s": 2.3 + wait, "perf/rollout_wait_s": wait, "rollout/backpressure_s": 2.0,
           "rollout/held_deadline_frac": 1.0, "rollout/held_allowance_frac": 0.0, "rollout/held_cap_frac": 0.0,
           "rollout/concurrency": 110.0, "rollout/concurrency_cap": 437.0, "batch/samples_per_step": 64.0}
    if duration is not None:
        row["rollout/duration_s"] = duration
    return row


def _waves(n: int) -> MetricsHistory:
    """Two full steps, then one that waits 2.7 s (busy 46%), as the s21 job's windows ran; a rollout 7.5 s long
    is logged in the idle windows (the waves' finishes)."""
    h = MetricsHistory()
    for step in range(1, n + 1):
        idle = step % 3 == 0
        h.push(_window(step, 2.7 if idle else 0.0, 7.5 if idle else None))
    return h


def test_latency_in_trainer_steps_uses_the_median_own_step():
    h = MetricsHistory()
    h.push({**_window(1, 6.0, 4.0), "perf/step_s": 26.0})  # the first step's compile: 20 s of its own
    for step in range(2, 6):
        h.push(_window(step, 0.0, 8.0))
    steps, rollout_s, step_s = generation_latency_steps(h)
    assert step_s == pytest.approx(2.3) and rollout_s == pytest.approx(7.2)
    assert steps == pytest.approx(7.2 / 2.3)
    assert generation_latency_steps(MetricsHistory()) is None


def test_the_staleness_that_feeds_generation_grows_with_the_latency():
    # 2 x latency + 0.25 (the schedule's margin) + 1, rounded up; at least one more than now
    assert deadline_staleness(3.2, 4) == 8
    assert deadline_staleness(2.7, 4) == 7
    assert deadline_staleness(0.5, 4) == 5
    assert deadline_staleness(1.0, 1) == 4


def test_waves_of_busy_and_idle_steps_are_one_finding_with_a_sized_fix():
    h = _waves(9)
    line = steady_diagnosis(h, SETTINGS)
    assert line.rule == "trainer_idle_deadline" and line.severity == "warn"
    assert line.text.startswith("in waves over steps 4-9 (busy 46%-100%): trainer idle ") and " of these steps " in line.text
    assert "deadline admission holds generation back 100% of the time" in line.text
    # 7.5 s / 2.3 s = 3.3 steps: 2 x 3.3 + 1.25 -> 8
    assert "fix: staleness.max_staleness=8 (a rollout takes 7.5 s to generate, 3.3 of the trainer's own 2.30 s" in line.text


def test_no_waves_without_an_idle_window_or_when_the_windows_together_are_busy():
    busy = MetricsHistory()
    for step in range(1, 7):
        busy.push(_window(step, 0.0))
    assert trainer_idle_in_waves(busy, SETTINGS) is None
    one_dip = MetricsHistory()
    for step in range(1, 7):  # one window idle 30% among five full ones: 6% idle together
        one_dip.push(_window(step, 1.0 if step == 6 else 0.0))
    assert trainer_idle_in_waves(one_dip, SETTINGS) is None
    assert trainer_idle_in_waves(_waves(2), SETTINGS) is None  # fewer windows than hold_windows


def test_before_waves_the_fix_is_one_more_version():
    h = MetricsHistory()
    h.push(_window(1, 2.7))  # no rollout duration logged yet
    assert "fix: staleness.max_staleness=5 (one more version of headroom per group)" in trainer_idle(h, SETTINGS).text


def test_a_low_overtake_share_names_the_observed_order():
    h = MetricsHistory()
    h.push({**_window(1, 2.7), "rollout/deadline_overtake_share": 0.02})
    text = trainer_idle(h, SETTINGS).text
    assert "or staleness.deadline_order=observed (opt-in: groups of later versions finished before an older one for at most 2%" in text
    h.push({**_window(2, 2.7), "rollout/deadline_overtake_share": 0.9})  # short groups overtake long ones
    assert "deadline_order" not in trainer_idle(h, SETTINGS).text
    h.push({**_window(3, 2.7), "rollout/deadline_overtake_share": 0.0})
    observed = RunSettings(max_staleness=4, max_concurrent_rollouts=1024, deadline_order="observed")
    assert "deadline_order" not in trainer_idle(h, observed).text  # already on


def test_one_busy_window_among_idle_ones_is_no_wave():
    h = MetricsHistory()
    for step in range(1, 7):  # idle 60% but one full step (the smoke run of a CPU trial)
        h.push(_window(step, 0.0 if step == 4 else 3.5, 7.0))
    line = trainer_idle_in_waves(h, SETTINGS)
    assert line.text.startswith("over steps 1-6 (busy 40%-100%): trainer idle ")


def test_the_windows_together_average_the_rate_and_the_cpu_readings():
    """A CPU trial: the newest window finished no rollout and its sampler got 0.76 cores; the windows together
    say the rate and the sampler's share of the run, not one window's (no 'generation 0 rollouts/s', no flicker
    to another cause)."""
    embedded = RunSettings(max_staleness=4, max_concurrent_rollouts=16, num_generations=4, backend="embedded")
    h = MetricsHistory()
    for step in range(1, 7):
        last = step == 6
        h.push({"step": step, "perf/step_s": 10.0, "perf/rollout_wait_s": 5.0 if step % 2 else 0.0,
                "rollout/backpressure_s": 0.0, "rollout/concurrency": 16.0, "rollout/concurrency_cap": 16.0,
                "rollout/vllm_kv_cache_usage_frac": 0.2, "batch/samples_per_step": 8.0, "rollout/request_s": 9.0,
                "rollout/rollouts_per_s": 0.0 if last else 1.2, "server/frontend_cpu": 0.76 if last else 1.0})
    line = trainer_idle_in_waves(h, embedded)
    assert line.rule == "trainer_idle_embedded"
    assert "generation 1 rollouts/s" in line.text and "the embedded sampler uses 0.96 CPU cores" in line.text


def test_the_gate_named_is_the_one_holding_in_the_newest_windows():
    """A CPU trial: the allowance held generation in steps 1-3, the concurrency cap from step 4; over six windows
    the allowance's mean share was a hair higher, and the finding named it with a fix that would not help."""
    h = MetricsHistory()
    for step in range(1, 7):
        early = step <= 3
        h.push({"step": step, "perf/step_s": 10.0, "perf/rollout_wait_s": 5.0 if step % 2 else 0.0,
                "rollout/backpressure_s": 6.0, "rollout/held_allowance_frac": 1.0 if early else 0.01,
                "rollout/held_cap_frac": 0.0 if early else 0.98, "rollout/concurrency": 16.0,
                "rollout/concurrency_cap": 16.0, "batch/samples_per_step": 8.0, "perf/gpu_memory_peak_gib": 2.0})
    settings = RunSettings(max_staleness=4, max_concurrent_rollouts=16, num_generations=4, backend="embedded")
    assert trainer_idle_in_waves(h, settings) is None  # an embedded sampler on a GPU, the cap at 16, no KV reading
    h.push({**h.latest, "step": 7, "perf/rollout_wait_s": 5.0, "server/frontend_cpu": 1.0})  # the sampler's process busy: that one
    assert trainer_idle_in_waves(h, settings).rule == "trainer_idle_embedded"


def test_a_silent_server_is_named_before_any_setting():
    """A fresh-user trial's 40 s SIGSTOP of the server was blamed on the staleness allowance."""
    h = MetricsHistory()
    h.push({**_window(1, 0.0), "rollout/held_allowance_frac": 1.0, "rollout/held_deadline_frac": 0.0})
    h.push({**_window(2, 63.6), "perf/step_s": 72.3, "server/silent_s": 45.2, "rollout/held_allowance_frac": 1.0,
            "rollout/held_deadline_frac": 0.0})
    d = trainer_idle(h, SETTINGS)
    assert d.rule == "trainer_idle_server_silent" and "the server did not answer for 45 s of it" in d.text
    assert "kill -CONT" in d.text
    h.push({**_window(3, 63.6), "perf/step_s": 72.3, "server/silent_s": 10.0})  # silent for a sixth: a setting
    assert trainer_idle(h, SETTINGS).rule != "trainer_idle_server_silent"


def test_windows_taken_together_leave_out_a_silence_that_has_ended():
    """Twenty-fourth session's trial: four steps after a 40 s SIGSTOP of the server ended, the line over the windows
    still named the silent server (its 45 s averaged in), while the embedded sampler paced the steps. Once the newest
    window answers, the silences leave the waits and steps, and what holds now is named."""
    h = MetricsHistory()
    h.push({**_window(1, 0.0), "server/silent_s": 0.0})
    h.push({**_window(2, 48.0), "perf/step_s": 50.3, "server/silent_s": 45.0})
    h.push({**_window(3, 2.7), "server/silent_s": 0.0})
    d = trainer_idle_in_waves(h, SETTINGS)
    assert d is not None and d.rule != "trainer_idle_server_silent", d
    assert "waits 1.90 s for samples" in d.text, d.text  # (0 + 3 + 2.7) / 3: the 45 s left out
    assert "; the server's 45 s of silence left out): " in d.text, d.text  # a trial could not square step 2's busy
    h.push({**_window(4, 30.0), "perf/step_s": 32.3, "server/silent_s": 28.0})  # silent again, now: named first
    d = trainer_idle_in_waves(h, SETTINGS)
    assert d.rule == "trainer_idle_server_silent" and "kill -CONT" in d.text
    quiet = MetricsHistory()  # an ended silence alone, the rest busy: no idle finding at all
    for step, wait, silent in ((1, 0.0, 0.0), (2, 40.0, 40.0), (3, 0.0, 0.0)):
        quiet.push({**_window(step, wait), "server/silent_s": silent})
    assert trainer_idle_in_waves(quiet, SETTINGS) is None
