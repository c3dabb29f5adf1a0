"""The diagnosis rules on scripted metric windows: every row of SPEC §4.4, §5.1, §5.2 and §5.3."""

from __future__ import annotations

import dataclasses
import math

import pytest

from asyncgrpo_cli.dashboard.diagnosis import (
    ALERT,
    INFO,
    OK,
    WARN,
    MetricsHistory,
    RunSettings,
    active_limit,
    bottleneck,
    diagnose,
    duplicates,
    num,
    reward_range,
    saturation,
    steady_diagnosis,
)

SETTINGS = RunSettings(max_staleness=4, max_concurrent_rollouts=64, num_generations=8)


def history_of(*windows: dict) -> MetricsHistory:
    h = MetricsHistory()
    for i, w in enumerate(windows):
        h.push({"step": i + 1, **w})
    return h


def ramp(name: str, start: float, stop: float, n: int = 6, **fixed) -> list[dict]:
    """``n`` windows with ``name`` moving linearly from start to stop, plus fixed values."""
    return [{name: start + (stop - start) * i / (n - 1), **fixed} for i in range(n)]


def merge(*series: list[dict]) -> list[dict]:
    return [dict(kv for w in ws for kv in w.items()) for ws in zip(*series)]


# ----------------------------------------------------------------------------- helpers
def test_num_and_trend():
    assert num({"a": "1.5"}, "a") == 1.5 and num({"a": None}, "a") is None and num({"a": math.nan}, "a") is None
    assert num({"a": True}, "a") is None and num(None, "a") is None
    h = history_of(*ramp("x", 0.0, 1.0))
    assert h.trend("x", 3) == pytest.approx(0.6)
    assert history_of(*ramp("x", 0, 1, n=5)).trend("x", 3) is None  # needs 2k windows
    assert h.observed_range(["x"]) == (0.0, 1.0)


def test_reward_range_inferred_or_given():
    assert reward_range(history_of({"reward": 0.3})) == (0.0, 1.0)
    assert reward_range(history_of({"reward": 1.7, "reward_dropped": -0.5})) == (-0.5, 1.7)
    assert reward_range(history_of({"reward": 0.3}), RunSettings(reward_range=(0.0, 2.0))) == (0.0, 2.0)


# ----------------------------------------------------------------------------- §5.1 queue table
def test_generation_bound():
    d = bottleneck({"rollout/queue_size": 0, "perf/rollout_wait_s": 0.5, "perf/step_s": 1.0,
                    "rollout/backpressure_s": 0.0, "batch/samples_per_step": 16}, SETTINGS)
    assert d.rule == "generation_bound" and d.severity == WARN
    assert "50% of the step" in d.text and "queue nearly empty" in d.text
    assert "rollout/generated_tokens_per_s" in d.text and "rollout/score_queue_size" in d.text


def test_trainer_bound():
    d = bottleneck({"rollout/queue_size": 40, "perf/rollout_wait_s": 0.0, "perf/step_s": 2.0,
                    "rollout/backpressure_s": 0.9, "batch/samples_per_step": 16, "sample/staleness_mean": 3.6},
                   SETTINGS)
    assert d.rule == "trainer_bound" and d.severity == INFO
    assert "staleness 3.6/4" in d.text and "max_staleness steps" in d.text


def test_trainer_bound_on_a_gpu_names_torch_compile_when_it_is_off():
    """Issue #42: the 1.7B job at 512 tokens is bound by the trainer's own step (generation waits for the staleness
    limit); the line names the lever, `trainer.torch_compile=true`, for a trainer on a GPU that does not compile."""
    m = {"rollout/queue_size": 40, "perf/rollout_wait_s": 0.0, "perf/step_s": 3.0, "rollout/backpressure_s": 2.5,
         "batch/samples_per_step": 62, "sample/staleness_mean": 4.0, "perf/gpu_memory_peak_gib": 33.0}
    off = dataclasses.replace(SETTINGS, torch_compile=False)
    d = bottleneck(m, off)
    assert d.rule == "trainer_bound" and d.text.endswith(
        "(expected when inference is faster than training); to shorten the trainer's step: trainer.torch_compile=true "
        "(compiles each layer; the first step takes a minute or two longer; README: One GPU)")
    held = bottleneck({**m, "rollout/held_deadline_frac": 0.9}, off)
    assert "deadline admission" in held.text and "trainer.torch_compile=true" in held.text
    assert "torch_compile" not in bottleneck(m, dataclasses.replace(SETTINGS, torch_compile=True)).text
    assert "torch_compile" not in bottleneck(m, SETTINGS).text  # the config unknown
    cpu = {k: v for k, v in m.items() if k != "perf/gpu_memory_peak_gib"}
    assert "torch_compile" not in bottleneck(cpu, off).text  # a CPU trainer: compiling is not the lever there


def test_staleness_too_tight():
    d = bottleneck({"perf/rollout_wait_s": 0.4, "rollout/backpressure_s": 0.5, "perf/step_s": 1.0}, SETTINGS)
    assert d.rule == "staleness_too_tight" and d.severity == WARN and "raise staleness.max_staleness (now 4)" in d.text


def test_balanced():
    d = bottleneck({"perf/rollout_wait_s": 0.01, "rollout/backpressure_s": 0.0, "perf/step_s": 1.0}, SETTINGS)
    assert d.rule == "balanced" and d.severity == OK
    # between "≈ 0" and "high": still balanced, with the small waits shown
    d = bottleneck({"perf/rollout_wait_s": 0.1, "rollout/backpressure_s": 0.0, "perf/step_s": 1.0}, SETTINGS)
    assert d.rule == "balanced" and "small waits" in d.text


def test_absolute_thresholds_without_step_time():
    assert bottleneck({"perf/rollout_wait_s": 2.0, "rollout/backpressure_s": 0.0}).rule == "generation_bound"
    assert bottleneck({"perf/rollout_wait_s": 0.0, "rollout/backpressure_s": 0.01}).rule == "balanced"
    assert bottleneck({"reward": 1.0}) is None


# ----------------------------------------------------------------------------- §4.4 active limit
def test_limit_staleness():
    d = active_limit({"rollout/backpressure_s": 0.3, "rollout/concurrency": 10, "rollout/concurrency_cap": 10},
                     SETTINGS)
    assert d.rule == "limit_staleness"


def test_limit_server_load():
    d = active_limit({"rollout/backpressure_s": 0.0, "rollout/concurrency": 24, "rollout/concurrency_cap": 24},
                     SETTINGS)
    assert d.rule == "limit_server_load" and "cap 24 < max_concurrent_rollouts 64" in d.text


def test_limit_resource_ceiling():
    m = {"rollout/backpressure_s": 0.0, "rollout/concurrency": 64, "rollout/concurrency_cap": 64,
         "rollout/vllm_kv_cache_usage_frac": 0.2, "perf/rollout_wait_s": 0.6, "perf/step_s": 1.0}
    d = active_limit(m, SETTINGS)
    assert d.rule == "limit_resource_idle" and d.severity == WARN
    assert "raise staleness.max_concurrent_rollouts" in d.text and "20%" in d.text
    # at the ceiling with a busy KV cache: reported, but no advice to raise it
    d = active_limit({**m, "rollout/vllm_kv_cache_usage_frac": 0.9}, SETTINGS)
    assert d.rule == "limit_resource" and d.severity == INFO
    # Fresh-user trial: reached with the trainer busy in steps 11-12, waiting in 13: not "held over steps 11-13"
    busy = {**m, "perf/rollout_wait_s": 0.0}
    rows = [{**busy, "step": 11}, {**busy, "step": 12}, {**m, "step": 13}]
    assert "held over" not in steady_diagnosis(history_of(*rows), SETTINGS).text


def test_no_limit_active():
    d = active_limit({"rollout/backpressure_s": 0.0, "rollout/concurrency": 5, "rollout/concurrency_cap": 30},
                     SETTINGS)
    assert d.rule == "limit_none" and d.severity == OK
    assert active_limit({"reward": 1}, SETTINGS) is None


def test_generation_bound_line_names_the_active_limit():
    h = history_of({"perf/rollout_wait_s": 0.8, "perf/step_s": 1.0, "rollout/backpressure_s": 0.0,
                    "rollout/queue_size": 0, "rollout/concurrency": 24, "rollout/concurrency_cap": 24})
    d = diagnose(h, SETTINGS)
    assert d.rule == "generation_bound" and "vLLM load cap" in d.text


# ----------------------------------------------------------------------------- §5.2 saturation
def test_saturation_healthy():
    d = saturation(history_of({"frac_reward_zero_std": 0.1, "reward": 0.4, "reward_dropped": 0.5}), SETTINGS)
    assert d.rule == "healthy_groups" and d.severity == OK and "90% of groups" in d.text


def test_saturating_at_the_top():
    windows = merge(ramp("frac_reward_zero_std", 0.2, 0.6), ramp("reward", 0.5, 0.85), ramp("reward_dropped", 0.9, 0.95))
    d = saturation(history_of(*windows), SETTINGS)
    assert d.rule == "saturating_top" and d.severity == WARN and "harder prompts" in d.text


def test_stuck_at_the_bottom():
    windows = [{"frac_reward_zero_std": 0.9, "reward": 0.02, "reward_dropped": 0.0,
                "completions/clipped_ratio": 0.7}] * 6
    d = saturation(history_of(*windows), SETTINGS)
    assert d.rule == "stuck_bottom" and d.severity == ALERT
    assert "completions/clipped_ratio (now 70%)" in d.text and "reward parses" in d.text
    # already at the first window (no trend yet): flat counts as flat
    assert saturation(history_of(windows[0]), SETTINGS).rule == "stuck_bottom"


def test_regression():
    windows = merge(ramp("frac_reward_zero_std", 0.3, 0.6), ramp("reward_dropped", 0.9, 0.4), ramp("reward", 0.7, 0.35))
    d = saturation(history_of(*windows), SETTINGS)
    assert d.rule == "regression" and d.severity == ALERT and "entropy" in d.text


def test_mix():
    d = saturation(history_of({"frac_reward_zero_std": 0.7, "reward": 0.5, "reward_dropped": 0.5}), SETTINGS)
    assert d.rule == "mix" and d.severity == WARN and "read the rollouts" in d.text
    assert "every rollout got the same reward" in d.text and "partial score" in d.text  # what mid-range means


def test_saturation_uses_the_given_reward_range():
    settings = RunSettings(reward_range=(0.0, 2.0))
    m = {"frac_reward_zero_std": 0.7, "reward": 1.0, "reward_dropped": 0.95}
    assert saturation(history_of(m), settings).rule == "mix"  # 0.95 is mid-range of [0, 2]
    assert saturation(history_of(m), SETTINGS).rule == "saturating_top"  # but near the top of [0, 1]
    assert saturation(history_of({"reward": 1.0}), SETTINGS) is None


# ----------------------------------------------------------------------------- §5.3 duplicates
def test_duplicates_healthy():
    d = duplicates(history_of({"completions/duplicate_frac": 0.03}), SETTINGS)
    assert d.rule == "healthy_duplicates" and d.severity == OK


def test_duplicates_jump_toward_all_copies():
    d = duplicates(history_of({"completions/duplicate_frac": 0.85}), SETTINGS)  # (8-1)/8 = 0.875
    assert d.rule == "sampler_not_random" and d.severity == ALERT and "temperature" in d.text and "seeds" in d.text
    # with G = 2 the ceiling is 0.5
    assert duplicates(history_of({"completions/duplicate_frac": 0.45}), RunSettings(num_generations=2)).rule \
        == "sampler_not_random"


def test_collapse_duplicates_creep_while_entropy_falls():
    windows = merge(ramp("completions/duplicate_frac", 0.02, 0.25), ramp("entropy", 1.2, 0.6))
    d = duplicates(history_of(*windows), SETTINGS)
    assert d.rule == "collapse" and d.severity == ALERT and "one answer per prompt" in d.text
    # the same creep while the reward rises is the policy converging on the credited answer (issue #41): info, so
    # a generation-bound warning beside it stays the line
    rising = merge(ramp("completions/duplicate_frac", 0.02, 0.25), ramp("entropy", 1.2, 0.6), ramp("reward", 0.1, 0.5))
    d = duplicates(history_of(*rising), SETTINGS)
    assert d.rule == "converging" and d.severity == INFO and "reward rises (0.5)" in d.text
    waits = [dict(w, **{"perf/rollout_wait_s": 3.0, "perf/step_s": 4.0, "rollout/rollouts_per_s": 765.0}) for w in rising]
    line = diagnose(history_of(*waits), SETTINGS)
    assert line.rule == "generation_bound" and "765 rollouts/s" in line.text
    falling = merge(ramp("completions/duplicate_frac", 0.02, 0.25), ramp("entropy", 1.2, 0.6), ramp("reward", 0.5, 0.1))
    assert duplicates(history_of(*falling), SETTINGS).rule == "collapse"
    # the same creep with a steady entropy is not collapse
    steady = merge(ramp("completions/duplicate_frac", 0.02, 0.25), ramp("entropy", 1.0, 1.0))
    d = duplicates(history_of(*steady), SETTINGS)
    assert d.rule == "duplicates" and d.severity == INFO


# ----------------------------------------------------------------------------- the one line
def test_diagnose_picks_the_most_severe():
    assert diagnose(MetricsHistory(), SETTINGS).rule == "waiting"
    healthy = {"perf/rollout_wait_s": 0.0, "rollout/backpressure_s": 0.0, "perf/step_s": 1.0,
               "frac_reward_zero_std": 0.1, "completions/duplicate_frac": 0.0, "rollout/concurrency": 4,
               "rollout/concurrency_cap": 16}
    d = diagnose(history_of(healthy), SETTINGS)
    assert d.severity == OK and d.text.startswith("healthy:") and "balanced" in d.text and "90%" in d.text
    bad = {**healthy, "completions/duplicate_frac": 0.86, "perf/rollout_wait_s": 0.9}
    d = diagnose(history_of(bad), SETTINGS)
    assert d.rule == "sampler_not_random"  # alert beats the generation-bound warning
    assert diagnose(history_of({"step": 1}), SETTINGS).rule == "no_data"


def test_a_diagnosis_shows_only_once_it_holds_over_several_windows():
    healthy = {"perf/rollout_wait_s": 0.0, "rollout/backpressure_s": 0.0, "perf/step_s": 1.0,
               "frac_reward_zero_std": 0.1, "completions/duplicate_frac": 0.0}
    mix = {**healthy, "frac_reward_zero_std": 0.7, "reward": 0.5, "reward_dropped": 0.5}
    copies = {**healthy, "completions/duplicate_frac": 0.86}
    # a smoke run whose one-window finding changes every step: never a warning, the line says why
    flipping = history_of(mix, copies, mix, copies)
    assert diagnose(flipping, SETTINGS).severity == ALERT  # the raw rule of the newest window alone
    d = steady_diagnosis(flipping, SETTINGS)
    assert d.rule == "settling" and d.severity == OK and "holds over 3 windows" in d.text
    assert steady_diagnosis(history_of(mix, mix), SETTINGS).rule == "settling"  # too few windows yet
    # the same finding three windows running is shown, with the steps it was measured over
    d = steady_diagnosis(history_of(healthy, mix, mix, mix), SETTINGS)
    assert d.rule == "mix" and d.severity == WARN and d.text.endswith("(held over steps 2-4)")
    # an ok line needs no holding
    assert steady_diagnosis(history_of(mix, healthy), SETTINGS).text.startswith("healthy:")


# ----------------------------------------------------------------------------- length bias (issue #28)
def _stale_history(windows):
    from asyncgrpo_cli.dashboard.diagnosis import MetricsHistory

    h = MetricsHistory()
    for w in windows:
        h.push(w)
    return h


def test_length_bias_is_named_when_long_completions_are_the_ones_dropped_stale():
    from asyncgrpo_cli.dashboard.diagnosis import RunSettings, diagnose, length_bias

    biased = {"sample/dropped_stale_token_frac": 0.39, "sample/trained_frac_short": 0.99,
              "sample/trained_frac_long": 0.55}
    h = _stale_history([biased] * 3)
    d = length_bias(h, RunSettings(max_staleness=1))
    assert d.rule == "length_bias" and d.severity == "warn"
    assert "45% of long completions" in d.text and "1% of short" in d.text and "max_staleness (now 1)" in d.text
    assert diagnose(h, RunSettings(max_staleness=1)).rule == "length_bias"


def test_stale_waste_without_length_bias_and_no_finding_without_the_metric():
    from asyncgrpo_cli.dashboard.diagnosis import length_bias

    even = {"sample/dropped_stale_token_frac": 0.2, "sample/trained_frac_short": 0.8, "sample/trained_frac_long": 0.78}
    assert length_bias(_stale_history([even])).rule == "stale_waste"
    low = {"sample/dropped_stale_token_frac": 0.01, "sample/trained_frac_short": 1.0, "sample/trained_frac_long": 0.97}
    assert length_bias(_stale_history([low])).rule == "stale_ok"
    assert length_bias(_stale_history([{"loss": 1.0}])) is None


# ----------------------------------------------------------------------------- idle trainer (issue #33)
def _idle(**extra) -> dict:
    """A window where the trainer waits 1.2 s of a 1.8 s step (67% idle), generation not held back, the
    engine's KV cache low, rollouts in flight at a cap of 256 (the ceiling)."""
    return {"perf/rollout_wait_s": 1.2, "perf/step_s": 1.8, "rollout/backpressure_s": 0.0, "rollout/queue_size": 0,
            "rollout/concurrency": 250, "rollout/concurrency_cap": 256, "rollout/vllm_kv_cache_usage_frac": 0.7,
            "rollout/vllm_running_requests": 200, "rollout/vllm_queued_requests": 0, "batch/samples_per_step": 65,
            "perf/gpu_memory_peak_gib": 30.0, **extra}


VLLM = RunSettings(max_staleness=2, max_concurrent_rollouts=256, backend="vllm", api_server_count=8,
                   num_sampler_logprobs=8, token_budget=4096, max_model_len=512)


def test_busy_share_is_clamped_and_absent_without_its_metrics():
    from asyncgrpo_cli.dashboard.diagnosis import busy_share

    assert busy_share({"perf/rollout_wait_s": 1.18, "perf/step_s": 2.0}) == pytest.approx(0.41)
    assert busy_share({"perf/rollout_wait_s": 3.0, "perf/step_s": 2.0}) == 0.0  # clamped to [0, 1]
    assert busy_share({"perf/rollout_wait_s": -1.0, "perf/step_s": 2.0}) == 1.0
    assert busy_share({"perf/step_s": 2.0}) is None and busy_share({"perf/rollout_wait_s": 1.0}) is None
    assert busy_share({"perf/rollout_wait_s": 0.0, "perf/step_s": 0.0}) is None and busy_share(None) is None


def test_idle_cause_one_api_server_with_sampler_logprobs():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    one = dataclasses.replace(VLLM, api_server_count=1)
    d = trainer_idle(history_of(_idle()), one)
    assert d.rule == "trainer_idle_api_servers" and d.severity == WARN
    assert d.text.startswith("trainer idle 67% of the step (waits 1.20 s for samples): one vLLM API server")
    assert "top-8 sampler log-probs" in d.text and "50 of 250 rollouts in flight are outside the engine" in d.text
    assert d.text.endswith("fix: sampler.api_server_count=8")
    # LoRA forces one API server: the fix says so instead of an override that cannot apply
    assert "peft.enabled=false" in trainer_idle(history_of(_idle()), dataclasses.replace(one, lora=True)).text
    # not the cause: no sampler log-probs, another backend, 8 servers, or vLLM's KV cache full
    for settings in (dataclasses.replace(one, num_sampler_logprobs=0), dataclasses.replace(one, backend="embedded"),
                     VLLM):
        assert trainer_idle(history_of(_idle()), settings) is None, settings
    full = trainer_idle(history_of(_idle(**{"rollout/vllm_kv_cache_usage_frac": 0.9})), one)
    assert full is None or full.rule != "trainer_idle_api_servers"


def test_idle_cause_enforce_eager():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    eager = dataclasses.replace(VLLM, sampler_extra_args=("--enforce-eager",))
    d = trainer_idle(history_of(_idle()), eager)
    assert d.rule == "trainer_idle_eager" and "without CUDA graphs" in d.text
    assert d.text.endswith("fix: sampler.extra_args=[]")
    # the other extra args stay; an argument with "=" is quoted for Hydra and the shell
    kept = dataclasses.replace(VLLM, sampler_extra_args=("--seed", "1", "--enforce-eager", "--kv-cache-dtype=fp8"))
    assert trainer_idle(history_of(_idle()), kept).text.endswith(
        "fix: 'sampler.extra_args=[--seed,1,\"--kv-cache-dtype=fp8\"]'")
    assert trainer_idle(history_of(_idle()), dataclasses.replace(VLLM, sampler_extra_args=("--enforce-eager=false",))) \
        is None
    # config causes come first: one API server wins over eager mode
    both = dataclasses.replace(eager, api_server_count=1)
    assert trainer_idle(history_of(_idle()), both).rule == "trainer_idle_api_servers"


def test_idle_cause_the_staleness_allowance():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    # generation held back while the trainer waits: max_staleness 2 x 65 samples admit ~130 of a cap of 256
    held = _idle(**{"rollout/backpressure_s": 0.3, "rollout/concurrency": 128})
    d = trainer_idle(history_of(held), VLLM)
    assert d.rule == "trainer_idle_allowance" and "generation waits 0.30 s" in d.text
    assert "128 rollouts in flight, cap 256" in d.text and "admits ~130: 2 steps of 65 samples" in d.text
    assert d.text.endswith("fix: staleness.max_staleness=4 or packing.token_budget=8192")
    # no backpressure, but rollouts in flight well below the cap, which the allowance cannot reach
    d = trainer_idle(history_of(_idle(**{"rollout/concurrency": 100})), VLLM)
    assert d.rule == "trainer_idle_allowance" and "generation waits" not in d.text
    # in flight well below the cap while the allowance admits more than the cap: not the allowance
    roomy = dataclasses.replace(VLLM, max_staleness=8)
    assert trainer_idle(history_of(_idle(**{"rollout/concurrency": 100})), roomy) is None
    # without a known token budget only max_staleness is suggested
    d = trainer_idle(history_of(held), dataclasses.replace(VLLM, token_budget=None))
    assert d.text.endswith("fix: staleness.max_staleness=4")
    # a step that closed on packing.max_groups_per_step would not grow with a larger token budget (the one-GPU
    # job late in its run: 64 groups a step, the plain line said "or packing.token_budget=32768")
    bounded = dataclasses.replace(VLLM, max_groups_per_step=64)
    d = trainer_idle(history_of({**held, "batch/groups_per_step": 64}), bounded)
    assert d.text.endswith("fix: staleness.max_staleness=4")
    d = trainer_idle(history_of({**held, "batch/groups_per_step": 40}), bounded)  # closed on tokens
    assert d.text.endswith("fix: staleness.max_staleness=4 or packing.token_budget=8192")
    # both waits high, formerly "max_staleness too tight", now names the allowance with the numbers
    tight = history_of({"perf/rollout_wait_s": 0.4, "rollout/backpressure_s": 0.5, "perf/step_s": 1.0})
    assert diagnose(tight, SETTINGS).rule == "trainer_idle_allowance"
    # the producer's own record wins over a few short waits: the smoke job of the ninth session's trial blamed the
    # allowance (backpressure 0.021 s) at "16 rollouts in flight, cap 16" while the cap held it 99.7% of the time
    capped = {**held, "rollout/held_allowance_frac": 0.002, "rollout/held_cap_frac": 0.997}
    other = trainer_idle(history_of(capped), VLLM)
    assert other is None or other.rule != "trainer_idle_allowance"
    by_record = trainer_idle(history_of({**capped, "rollout/held_allowance_frac": 0.6, "rollout/held_cap_frac": 0.3}),
                             VLLM)
    assert by_record.rule == "trainer_idle_allowance"
    # the record is named (a trial read "16 in flight, cap 16; it admits ~20" as the cap binding, not the allowance)
    assert "the rollout producer waited on it 60% of the window)" in by_record.text, by_record.text
    # the thirteenth session's trial (smoke job, after a 35 s SIGSTOP of the server): "holds generation back (16
    # rollouts in flight, cap 16; it admits ~20 ...)". In flight at a cap below what the allowance admits: the cap is
    # the limit, whether the producer's record says it held longer or no record is logged
    at_cap = {**held, "rollout/concurrency": 120, "rollout/concurrency_cap": 120}  # the allowance admits ~130
    for settings in (VLLM, roomy):
        found = trainer_idle(history_of(at_cap), settings)
        assert found is None or found.rule != "trainer_idle_allowance", found
    more_cap = {**held, "rollout/held_allowance_frac": 0.3, "rollout/held_cap_frac": 0.5}
    other = trainer_idle(history_of(more_cap), VLLM)
    assert other is None or other.rule != "trainer_idle_allowance"


def test_a_finding_that_holds_is_shown_while_a_worse_one_comes_and_goes():
    # the smoke job (fresh-user trial): the allowance held the trainer idle every step, but a more severe finding
    # in every other window won that window, so the line that asks the same rule 3 windows running said
    # "no steady finding yet" for the whole run
    held = _idle(**{"rollout/backpressure_s": 0.3, "rollout/concurrency": 128})
    worse = {**held, "completions/duplicate_frac": 0.86}
    assert diagnose(history_of(worse), VLLM).rule == "sampler_not_random"
    d = steady_diagnosis(history_of(held, worse, held, worse), VLLM)
    assert d.rule == "trainer_idle_allowance" and d.severity == WARN
    # the whole run of windows that found it (a second trial read 4-6, then "the last one held over steps 3-6")
    assert d.text.endswith("(held over steps 1-4)") and "fix: staleness.max_staleness=4" in d.text
    # the worse one, once it holds too, wins again
    assert steady_diagnosis(history_of(held, worse, worse, worse), VLLM).rule == "sampler_not_random"


def test_idle_cause_stale_drops():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    h = history_of(*[_idle(**{"sample/dropped_stale_token_frac": 0.12})] * 2)
    d = trainer_idle(h, VLLM)
    assert d.rule == "trainer_idle_stale_drops" and "12% of generated tokens were dropped stale" in d.text
    assert d.text.endswith("fix: staleness.max_staleness=4")
    assert trainer_idle(history_of(_idle(**{"sample/dropped_stale_token_frac": 0.05})), VLLM) is None  # not above 5%


def test_an_idle_trainer_notes_the_groups_dropped_without_signal():
    """A fresh-user trial's 30-step smoke run: from step 20 most groups were dropped for want of a reward spread, and
    the idle finding named only the embedded sampler. The head notes the dropped groups now; the cause and its fix
    stay (issue #41's job: 75-88% dropped, the fix was the concurrency ceiling)."""
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    embedded = dataclasses.replace(VLLM, backend="embedded")
    cpu = {k: v for k, v in _idle().items() if k != "perf/gpu_memory_peak_gib"}
    assert "reward spread" not in trainer_idle(history_of(cpu), embedded).text
    h = history_of(*[{**cpu, "frac_reward_zero_std": z} for z in (0.4, 0.7, 0.8, 0.9)])
    d = trainer_idle(h, embedded)  # mean 0.7 over the newest windows
    assert d.rule == "trainer_idle_embedded"
    assert d.text.startswith("trainer idle 67% of the step (waits 1.20 s for samples; 70% of groups dropped without "
                             "reward spread, 3.3 generated per one trained): the embedded sampler")
    assert "almost none trained" in trainer_idle(history_of({**cpu, "frac_reward_zero_std": 1.0}), embedded).text
    ceiling = trainer_idle(history_of(_idle(**{"rollout/vllm_kv_cache_usage_frac": 0.2, "frac_reward_zero_std": 0.8})),
                           VLLM)
    assert ceiling.rule == "trainer_idle_ceiling" and "80% of groups dropped without reward spread" in ceiling.text
    # under half (the mean of the newest windows): no note
    low = history_of({**cpu, "frac_reward_zero_std": 0.9}, {**cpu, "frac_reward_zero_std": 0.0})
    assert "reward spread" not in trainer_idle(low, embedded).text


def test_idle_cause_a_cap_that_never_grows():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    stuck = _idle(**{"rollout/concurrency": 64, "rollout/concurrency_cap": 64, "rollout/vllm_kv_cache_usage_frac": 0.2,
                     "rollout/vllm_running_requests": 48, "rollout/vllm_queued_requests": 16})
    d = trainer_idle(history_of(stuck, stuck, stuck), VLLM)
    assert d.rule == "trainer_idle_cap" and "stays at 64 (< max_concurrent_rollouts 256)" in d.text
    assert "KV cache at 20%" in d.text and "16 requests waiting" in d.text
    assert trainer_idle(history_of(stuck, stuck, stuck), dataclasses.replace(VLLM, backend="embedded")) is None
    assert d.text.endswith("fix: sampler.extra_args=[--max-num-seqs,256]")
    # an earlier --max-num-seqs is replaced, other extra args kept
    seqs = dataclasses.replace(VLLM, sampler_extra_args=("--max-num-seqs", "64", "--seed", "1"))
    assert trainer_idle(history_of(stuck, stuck, stuck), seqs).text.endswith(
        "fix: sampler.extra_args=[--seed,1,--max-num-seqs,256]")
    # nothing waiting: the cap's start is what to change
    idle_engine = {**stuck, "rollout/vllm_queued_requests": 0, "rollout/vllm_running_requests": 64}
    d = trainer_idle(history_of(idle_engine, idle_engine, idle_engine), VLLM)
    assert d.rule == "trainer_idle_cap" and "sampler.max_model_len (now 512)" in d.text
    # fewer windows than cap_windows, or a cap that grew: not "never grows"
    assert trainer_idle(history_of(stuck, stuck), VLLM) is None
    grown = {**stuck, "rollout/concurrency_cap": 80, "rollout/concurrency": 80}
    assert trainer_idle(history_of(stuck, stuck, grown), VLLM) is None


def test_idle_cause_a_busy_engine_core():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    busy = _idle(**{"server/engine_core_cpu": 0.97, "rollout/vllm_kv_cache_usage_frac": 0.2})
    d = trainer_idle(history_of(busy), VLLM)
    assert d.rule == "trainer_idle_engine_core" and "vLLM's engine core uses 0.97 of a CPU core" in d.text
    tail = "(one more server on the GPU; its start, about 2 minutes more, pays back over a long run: README, Several servers on one GPU)"
    assert d.text.endswith(f"fix: sampler.engines=2 {tail}")
    assert trainer_idle(history_of(busy), dataclasses.replace(VLLM, engines=2)).text.endswith(
        f"fix: sampler.engines=3 {tail}")
    # below 0.9 of a core, a full KV cache (memory binds), or not vLLM: another cause, or none
    assert trainer_idle(history_of({**busy, "server/engine_core_cpu": 0.8}), VLLM).rule == "trainer_idle_ceiling"
    assert trainer_idle(history_of({**busy, "rollout/vllm_kv_cache_usage_frac": 0.9}), VLLM) is None
    assert trainer_idle(history_of(busy), dataclasses.replace(VLLM, backend="embedded")).rule == "trainer_idle_ceiling"


def test_idle_cause_a_busy_embedded_sampler():
    """The CPU smoke job's idle trainer names the embedded sampler's process when it is busy, before the ceiling."""
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    embedded = dataclasses.replace(VLLM, backend="embedded")
    busy = _idle(**{"server/frontend_cpu": 1.43, "rollout/vllm_kv_cache_usage_frac": 0.2})
    d = trainer_idle(history_of(busy), embedded)
    assert d.rule == "trainer_idle_embedded" and "the embedded sampler uses 1.43 CPU cores" in d.text
    assert "one model step at a time on one model thread" in d.text
    assert d.text.endswith("with a GPU, sampler.backend=vllm (README)")
    # a sampler process below 0.9 cores, or a vLLM server's front end however busy: not this cause
    assert trainer_idle(history_of({**busy, "server/frontend_cpu": 0.5}), embedded).rule == "trainer_idle_ceiling"
    # ... unless the machine's cores are all busy: the sampler gets less than a core, and that paces it
    loaded = {**busy, "server/frontend_cpu": 0.62, "host/cpu_busy_frac": 0.97}
    d = trainer_idle(history_of(loaded), embedded)
    assert d.rule == "trainer_idle_embedded" and "the embedded sampler uses 0.62 CPU cores of a machine 97% busy (the trainer and other programs take the rest)" in d.text
    assert trainer_idle(history_of({**loaded, "host/cpu_busy_frac": 0.7}), embedded).rule == "trainer_idle_ceiling"
    assert trainer_idle(history_of(busy), VLLM).rule == "trainer_idle_ceiling"
    # a CPU job (no GPU memory logged): the sampler is the CPU's, whatever share of it this window read
    cpu_job = {k: v for k, v in busy.items() if k != "perf/gpu_memory_peak_gib"}
    d = trainer_idle(history_of({**cpu_job, "server/frontend_cpu": 0.5}), embedded)
    assert d.rule == "trainer_idle_embedded" and "the embedded sampler uses 0.50 CPU cores:" in d.text
    assert "fix: none in concurrency or staleness; shorter completions (rollout.max_completion_length)" in d.text
    no_reading = {k: v for k, v in cpu_job.items() if k != "server/frontend_cpu"}
    assert "the embedded sampler runs on this machine's CPU (95% busy):" in trainer_idle(
        history_of({**no_reading, "host/cpu_busy_frac": 0.95}), embedded).text


def test_idle_cause_the_concurrency_ceiling():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    d = trainer_idle(history_of(_idle(**{"rollout/vllm_kv_cache_usage_frac": 0.2})), VLLM)
    assert d.rule == "trainer_idle_ceiling" and "max_concurrent_rollouts=256 reached with the KV cache at 20%" in d.text
    assert "fix: staleness.max_concurrent_rollouts=512" in d.text


def test_idle_trainer_replaces_generation_bound_and_holds_in_the_dashboard_line():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    one = dataclasses.replace(VLLM, api_server_count=1)
    h = history_of(_idle(), _idle(), _idle())
    assert diagnose(h, VLLM).rule == "generation_bound"  # idle, no cause found: the generic finding stays
    assert diagnose(h, one).rule == "trainer_idle_api_servers"
    d = steady_diagnosis(h, one)
    assert d.rule == "trainer_idle_api_servers" and d.text.endswith("(held over steps 1-3)")
    # not idle (wait 5% of the step): no finding
    assert trainer_idle(history_of(_idle(**{"perf/rollout_wait_s": 0.09})), one) is None
    # without a step time the absolute threshold applies and the share is not shown
    d = trainer_idle(history_of({"perf/rollout_wait_s": 2.0}), one)
    assert d.text.startswith("trainer idle (waits 2.00 s for samples): one vLLM API server")


def test_run_settings_from_the_one_gpu_recipe_config():
    from asyncgrpo_cli.config.compose import compose

    s = RunSettings.from_config(compose(["+recipe=arith_vllm_1gpu", "sampler.api_server_count=1",
                                         "sampler.extra_args=[--enforce-eager]", "packing.token_budget=4096"]))
    assert (s.backend, s.api_server_count, s.sampler_extra_args, s.num_sampler_logprobs) == \
        ("vllm", 1, ("--enforce-eager",), 8)
    assert (s.max_staleness, s.weight_sync_steps, s.token_budget, s.max_model_len, s.lora) == (2, 1, 4096, 512, False)
    assert s.torch_compile is False
    assert RunSettings.from_config(compose(["+recipe=arith_vllm_1gpu", "trainer.torch_compile=true"])).torch_compile
    # every suggested override composes
    fixed = compose(["+recipe=arith_vllm_1gpu", "sampler.api_server_count=8", "sampler.extra_args=[]",
                     "staleness.max_staleness=4", "packing.token_budget=8192", "staleness.max_concurrent_rollouts=512",
                     "sampler.extra_args=[--max-num-seqs,256]"])
    s = RunSettings.from_config(fixed)
    assert s.api_server_count == 8 and s.sampler_extra_args == ("--max-num-seqs", "256") and s.token_budget == 8192
    # token_budget unset: the server's max_model_len
    unset = compose(["+recipe=arith_vllm_1gpu", "packing.token_budget=null"])
    assert RunSettings.from_config(unset).token_budget == 512


def test_a_suggested_extra_args_override_composes_back_to_the_same_list():
    import shlex

    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.dashboard.diagnosis import _list_override

    args = ["--seed", "1", "--kv-cache-dtype=fp8", '--compilation-config={"level":3}', "true", "0.90", "null", "a b",
            "it's", "007"]
    typed = shlex.split(_list_override("sampler.extra_args", args))  # what the shell passes on
    assert len(typed) == 1 and list(compose(["+recipe=smoke", typed[0]]).sampler.extra_args) == args
    assert _list_override("sampler.extra_args", ["--enforce-eager"]) == "sampler.extra_args=[--enforce-eager]"


def test_idle_cause_on_policy_training_waits_by_design():
    # issue #33: at max_staleness=0 the trainer waits for every round; the allowance is not the cause to name
    from asyncgrpo_cli.dashboard.diagnosis import MetricsHistory, RunSettings, trainer_idle

    h = MetricsHistory()
    h.push({"perf/step_s": 2.0, "perf/rollout_wait_s": 1.2, "rollout/backpressure_s": 0.8, "rollout/concurrency": 40,
            "rollout/concurrency_cap": 256, "batch/samples_per_step": 64})
    found = trainer_idle(h, RunSettings(max_staleness=0, backend="vllm", api_server_count=8))
    assert found.rule == "trainer_idle_on_policy" and "staleness.max_staleness=1" in found.text
    assert trainer_idle(h, RunSettings(max_staleness=2, backend="vllm", api_server_count=8)).rule == \
        "trainer_idle_allowance"
    # a config cause still comes first: it slows each round's generation
    assert trainer_idle(h, RunSettings(max_staleness=0, backend="vllm", api_server_count=1,
                                       num_sampler_logprobs=8)).rule == "trainer_idle_api_servers"


def test_an_idle_trainer_with_a_fix_outranks_a_mix_of_easy_and_hard_prompts():
    """Issue #41's job: 75-88% of groups all equal at a mid-range reward ("mix": read the rollouts) hid the idle
    trainer's measured fix (max_concurrent_rollouts reached, KV cache at 1%) in the plain line."""
    mixed = {"frac_reward_zero_std": 0.8, "reward_dropped": 0.6, "reward": 0.5}
    d = diagnose(history_of(_idle(**{"rollout/vllm_kv_cache_usage_frac": 0.2}, **mixed)), VLLM)
    assert d.rule == "trainer_idle_ceiling" and "fix: staleness.max_concurrent_rollouts=512" in d.text
    assert diagnose(history_of({**mixed, "perf/rollout_wait_s": 0.0, "perf/step_s": 1.0}), VLLM).rule == "mix"


def test_an_idle_trainer_holds_while_its_cause_flickers():
    """The cause's metrics cross their threshold window by window (KV cache 20% / 70%): the finding is still an
    idle trainer in each window, so it holds and the newest window's text is shown."""
    mixed = {"frac_reward_zero_std": 0.8, "reward_dropped": 0.6, "reward": 0.5}
    ceiling = _idle(**{"rollout/vllm_kv_cache_usage_frac": 0.2}, **mixed)
    plain = _idle(**mixed)
    assert diagnose(history_of(plain), VLLM).rule == "generation_bound"
    d = steady_diagnosis(history_of(ceiling, plain, ceiling), VLLM)
    assert d.rule == "trainer_idle_ceiling" and d.text.endswith("(held over steps 1-3)")
    assert steady_diagnosis(history_of(plain, ceiling, plain), VLLM).rule == "generation_bound"


def test_the_settling_line_says_yet_only_until_a_finding_has_held():
    """Fresh-user trial: after a finding had held over earlier steps and stopped holding, the line said "no steady
    finding yet"; once one has held it says "now" and names the last one and the steps it held over."""
    healthy = {"perf/rollout_wait_s": 0.0, "rollout/backpressure_s": 0.0, "perf/step_s": 1.0,
               "frac_reward_zero_std": 0.1, "completions/duplicate_frac": 0.0}
    mix = {**healthy, "frac_reward_zero_std": 0.7, "reward": 0.5, "reward_dropped": 0.5}
    copies = {**healthy, "completions/duplicate_frac": 0.86}
    newest = diagnose(history_of(copies), SETTINGS).text.split("(")[0].split(";")[0].strip()
    tail = f"; newest: {newest}; shown once it holds over 3 windows)"
    # nothing has held yet
    assert steady_diagnosis(history_of(mix, copies, mix, copies), SETTINGS).text.startswith("no steady finding yet (")
    # "mix" held over steps 2-4, then a new finding has not held yet
    d = steady_diagnosis(history_of(healthy, mix, mix, mix, copies), SETTINGS)
    assert d.rule == "settling" and d.severity == OK
    assert d.text.startswith("no steady finding now (the last one held over steps 2-4: mix: in 70% of groups"), d.text
    assert d.text.endswith(tail), d.text
    # the steps are every window that found it, not only the three that made it hold
    d = steady_diagnosis(history_of(mix, mix, mix, mix, copies, mix, copies), SETTINGS)
    assert d.text.startswith("no steady finding now (the last one held over steps 1-4: mix:"), d.text
    # an ok window between them changes nothing
    d = steady_diagnosis(history_of(mix, mix, mix, healthy, copies), SETTINGS)
    assert d.text.startswith("no steady finding now (the last one held over steps 1-3: mix:"), d.text
    # without steps: counted in windows
    h = MetricsHistory()
    for w in (mix, mix, mix, copies):
        h.push(w)
    assert steady_diagnosis(h, SETTINGS).text.startswith("no steady finding now (the last one held over 3 windows: ")
    # a full history may have forgotten a finding that held early in the run: "now", naming none
    h = MetricsHistory(maxlen=4)
    for i, w in enumerate((mix, mix, mix, copies, mix, copies), start=1):
        h.push({"step": i, **w})
    assert steady_diagnosis(h, SETTINGS).text == "no steady finding now (" + tail[2:]


def test_the_settling_line_names_the_newest_finding_in_words():
    """Fresh-user trial: 'no steady finding yet (newest: limit resource; ...)' named a rule id nobody had seen."""
    d = steady_diagnosis(history_of(_idle(**{"rollout/vllm_kv_cache_usage_frac": 0.2})), VLLM)
    assert d.rule == "settling" and d.text.startswith("no steady finding yet (newest: trainer idle 67% of the step;")
    # the words before the colon alone said "newest: active limit" without the limit (fresh-user trial, again)
    ahead = {"rollout/backpressure_s": 0.5, "perf/rollout_wait_s": 0.0, "perf/step_s": 2.0}
    d = steady_diagnosis(history_of(ahead), VLLM)
    assert d.rule == "settling" and d.text.startswith("no steady finding yet (newest: trainer-bound: generation waits")


def test_a_trainer_that_waits_for_samples_is_not_behind_a_staleness_limit():
    """Fresh-user trial (smoke, CPU): 'busy 15%' beside 'active limit: staleness (generation waits 0.02 s; it is
    ahead of training)': 20 ms of backpressure in a 30 s step whose trainer waited 85% of it."""
    from asyncgrpo_cli.dashboard.diagnosis import active_limit

    m = {"rollout/backpressure_s": 0.02, "perf/rollout_wait_s": 25.5, "perf/step_s": 30.0, "rollout/concurrency": 8}
    assert active_limit(m, VLLM).rule != "limit_staleness"
    # Eleventh session's trial: 'active limit: staleness (generation waits 0.03 s; ...)' read oddly: a wait that is
    # a sliver of the step is not the limit, whatever the trainer's wait; one of 10% is.
    assert active_limit({**m, "perf/rollout_wait_s": 0.5}, VLLM).rule != "limit_staleness"
    assert active_limit({**m, "perf/rollout_wait_s": 0.5, "rollout/backpressure_s": 3.0}, VLLM).rule == \
        "limit_staleness"


def test_allocator_retries_name_the_trainers_memory_and_the_fix():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_memory

    assert trainer_memory({"perf/cuda_alloc_retries": 0.0, "perf/gpu_memory_peak_gib": 20.0}) is None
    assert trainer_memory({}) is None  # a CPU trainer logs no such metric
    d = diagnose(history_of({"perf/cuda_alloc_retries": 3.0, "perf/gpu_memory_peak_gib": 20.0}))
    assert d.rule == "trainer_memory" and d.severity == WARN
    assert "3 allocator retries a step (peak 20.0 GiB)" in d.text and "sampler.gpu_memory_utilization" in d.text


def test_a_saturated_host_names_the_trainers_wait_and_halves_the_api_servers():
    """Issue #41: every core busy and the trainer waiting for one in its forward and backward."""
    from asyncgrpo_cli.dashboard.diagnosis import host_saturated

    busy = {"host/cpu_busy_frac": 0.95, "host/cpu_busy_cores": 15.2, "perf/fwd_bwd_cpu_wait_s": 0.40,
            "perf/fwd_bwd_s": 1.30, "perf/gpu_memory_peak_gib": 20.0}
    d = host_saturated(busy, dataclasses.replace(VLLM, api_server_count=8, engines=2))
    assert d.rule == "host_saturated" and d.severity == WARN
    assert "15.2 of 16 cores busy" in d.text and "waited 0.40 s for a core in its 1.30 s" in d.text
    assert "sampler.api_server_count=4 (vLLM's 16 API servers" in d.text
    assert host_saturated({**busy, "host/cpu_busy_frac": 0.85}, VLLM) is None  # cores to spare
    assert host_saturated({**busy, "perf/fwd_bwd_cpu_wait_s": 0.2}, VLLM) is None  # the trainer hardly waits
    assert host_saturated({"perf/fwd_bwd_s": 1.0}, VLLM) is None  # not Linux: no figures
    cpu_trainer = {k: v for k, v in busy.items() if k != "perf/gpu_memory_peak_gib"}
    assert host_saturated(cpu_trainer, VLLM) is None  # its fwd+bwd is the host's work (the CPU smoke job)
    embedded = host_saturated(busy, dataclasses.replace(VLLM, backend="embedded"))
    assert "fix: fewer other processes on this machine" in embedded.text
    assert diagnose(history_of(busy), VLLM).rule == "host_saturated"


def test_idle_cause_a_busy_rollout_worker_comes_before_the_engine_core():
    from asyncgrpo_cli.dashboard.diagnosis import trainer_idle

    both = _idle(**{"server/engine_core_cpu": 0.97, "rollout/vllm_kv_cache_usage_frac": 0.2,
                    "rollout/worker_main_cpu": 0.96, "rollout/worker_cpu": 2.4})
    d = trainer_idle(history_of(both), VLLM)
    assert d.rule == "trainer_idle_worker" and "the rollout worker's own process uses 0.96 of a CPU core" in d.text
    assert "none as an option yet" in d.text and "sampler.engines" not in d.text
    # the reward processes beside it (rollout/worker_cpu) do not count: only the worker's own process
    spread = {**both, "rollout/worker_main_cpu": 0.6}
    assert trainer_idle(history_of(spread), VLLM).rule == "trainer_idle_engine_core"
    # any backend: the worker paces the embedded sampler's requests too
    alone = {**_idle(**{"rollout/vllm_kv_cache_usage_frac": 0.2}), "rollout/worker_main_cpu": 0.92}
    assert trainer_idle(history_of(alone), dataclasses.replace(VLLM, backend="embedded")).rule == "trainer_idle_worker"


def test_trainer_bound_names_the_gate_that_held_generation():
    """Second trial of 2026-12-05: "generation waits 3.64 s for the staleness limit, staleness 1.0/4" while the cap
    of 16 rollouts held the producer 95% of the window (allowance 5%). The finding names the gate that held it."""
    base = {"perf/rollout_wait_s": 0.0, "rollout/backpressure_s": 3.64, "perf/step_s": 5.44,
            "sample/staleness_mean": 1.0, "rollout/concurrency_cap": 16.0}
    settings = RunSettings(max_concurrent_rollouts=16)
    capped = bottleneck({**base, "rollout/held_cap_frac": 0.953, "rollout/held_allowance_frac": 0.046}, settings)
    assert capped.rule == "trainer_bound" and "staleness limit" not in capped.text
    assert "at their cap (16, staleness.max_concurrent_rollouts=16)" in capped.text and "95%" in capped.text
    allowance = bottleneck({**base, "rollout/held_cap_frac": 0.1, "rollout/held_allowance_frac": 0.8}, settings)
    assert "for the staleness limit, staleness 1.0/4" in allowance.text
    assert "for the staleness limit" in bottleneck(base, settings).text  # no hold shares logged: as before
    on_policy = bottleneck({**base, "rollout/held_round_frac": 0.9}, settings)
    assert "on-policy round" in on_policy.text
