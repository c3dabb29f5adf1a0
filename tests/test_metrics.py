"""MetricsWindow: the SPEC §15.1 window aggregation rules, NaN handling and cross-process merge."""

import math
import pickle

import pytest

from asyncgrpo_cli.rollout.metrics import MetricsWindow, metric_kind


@pytest.mark.parametrize(
    "name, kind",
    [
        ("reward", "mean"),
        ("rollout/turns_mean", "mean"),
        ("rollout/turns_max", "max"),
        ("completions/max_length", "max"),
        ("completions/min_length", "min"),
        ("completions/mean_terminated_length", "mean"),  # "terminated" contains the letters "min"
        ("completions/max_terminated_length", "max"),
        ("completions/min_terminated_length", "min"),
        ("sample/forwarded_tokens_max", "max"),
        ("sample/staleness_max", "max"),
        ("clip_ratio/low_min", "min"),
        ("clip_ratio/high_max", "max"),
        ("sampling/importance_sampling_ratio/min", "min"),
        ("sampling/sampling_logp_difference/max", "max"),
        ("sample/dropped_stale_count", "sum"),
        ("tools/get_weather/call_count", "sum"),
        ("rollout/vllm_preemption_count", "sum"),
        ("batch/dropped_oversize_count", "sum"),
        ("tools/failure_frequency", "mean"),
        ("rollout/backpressure_s", "mean"),
        ("rewards/max_reward_func/mean", "mean"),  # only the last path segment matters
    ],
)
def test_metric_kind(name, kind):
    assert metric_kind(name) == kind


def test_item_weighted_means_and_single_values():
    w = MetricsWindow()
    w.add_many("reward", [1.0, 0.0, 0.0, 1.0])  # group of 4
    w.add_many("reward", [1.0, 1.0])  # group of 2
    w.add("rollout/backpressure_s", 2.0)
    w.add("rollout/backpressure_s", 4.0)
    out = w.flush()
    assert out["reward"] == pytest.approx(4 / 6)  # not the mean of the group means (0.75)
    assert out["rollout/backpressure_s"] == pytest.approx(3.0)
    assert w.flush() == {}  # flush resets


def test_counts_sum_and_extremes():
    w = MetricsWindow()
    for v in (2, 3):
        w.add("sample/dropped_stale_count", v)
    w.add_many("tools/search/call_count", [1, 0, 2])
    w.add_many("completions/max_length", [10, 40, 20])
    w.add("completions/max_length", 30)
    w.add_many("completions/min_length", [10, 4, 20])
    w.add("clip_ratio/low_min", 0.2)
    w.add("clip_ratio/low_min", 0.1)
    w.add_many("completions/mean_terminated_length", [10, 20])
    out = w.flush()
    assert out["sample/dropped_stale_count"] == 5
    assert out["tools/search/call_count"] == 3
    assert out["completions/max_length"] == 40
    assert out["completions/min_length"] == 4
    assert out["clip_ratio/low_min"] == 0.1
    assert out["completions/mean_terminated_length"] == 15


def test_rates_are_total_over_total():
    w = MetricsWindow()
    w.add_rate("rollout/generated_tokens_per_s", 1000, 1.0)
    w.add_rate("rollout/generated_tokens_per_s", 0, 9.0)
    out = w.flush()
    assert out["rollout/generated_tokens_per_s"] == pytest.approx(100.0)  # not mean(1000, 0)
    with pytest.raises(ValueError, match="seconds"):
        w.add_rate("x_tokens_per_s", 1, -1)


def test_ratio_with_zero_denominator_is_nan():
    w = MetricsWindow()
    w.add_ratio("tools/failure_frequency", 0, 0)
    assert math.isnan(w.flush()["tools/failure_frequency"])


def test_nan_ignored_unless_all_nan_and_none_skipped():
    w = MetricsWindow()
    w.add_many("tools/failure_frequency", [float("nan"), 0.5, 1.0])
    w.add("only_nan", float("nan"))
    w.add("sample/staleness_max", float("nan"))
    w.add("sample/staleness_max", 3)
    w.add_many("rewards/f/mean", [None, 1.0, None])
    w.add("only_none", None)
    out = w.flush()
    assert out["tools/failure_frequency"] == pytest.approx(0.75)
    assert math.isnan(out["only_nan"])
    assert out["sample/staleness_max"] == 3
    assert out["rewards/f/mean"] == 1.0
    assert "only_none" not in out


def test_bad_values_and_mixed_kinds_raise():
    w = MetricsWindow()
    with pytest.raises(TypeError, match="'reward'"):
        w.add("reward", "high")
    w.add_rate("rollout/generated_tokens_per_s", 10, 1)
    with pytest.raises(ValueError, match="rollout/generated_tokens_per_s"):
        w.add("rollout/generated_tokens_per_s", 10)


def test_merge_snapshots_from_another_process():
    worker = MetricsWindow()
    worker.add_many("reward", [1.0, 0.0])
    worker.add("rollout/vllm_retry_count", 2)
    worker.add("sample/staleness_max", 5)
    worker.add("clip_ratio/low_min", 0.3)
    worker.add_rate("rollout/generated_tokens_per_s", 500, 1.0)
    worker.add("only_nan", float("nan"))
    snap = pickle.loads(pickle.dumps(worker.snapshot(reset=True)))  # crosses a queue
    assert len(worker) == 0

    trainer = MetricsWindow()
    trainer.add_many("reward", [1.0, 1.0, 1.0, 1.0])
    trainer.add("rollout/vllm_retry_count", 1)
    trainer.add("sample/staleness_max", 2)
    trainer.add("clip_ratio/low_min", 0.1)
    trainer.add_rate("rollout/generated_tokens_per_s", 100, 3.0)
    trainer.merge(snap)
    trainer.merge(MetricsWindow().snapshot())  # empty snapshot is a no-op
    out = trainer.flush()
    assert out["reward"] == pytest.approx(5 / 6)
    assert out["rollout/vllm_retry_count"] == 3
    assert out["sample/staleness_max"] == 5
    assert out["clip_ratio/low_min"] == 0.1
    assert out["rollout/generated_tokens_per_s"] == pytest.approx(600 / 4.0)
    assert math.isnan(out["only_nan"])


def test_merge_rejects_garbage_and_kind_mismatch():
    w = MetricsWindow()
    with pytest.raises(ValueError, match="snapshot"):
        w.merge({"reward": (1.0, 2)})
    w.add("reward", 1.0)
    other = MetricsWindow()
    other.add_rate("reward", 1.0, 1.0)
    with pytest.raises(ValueError, match="'reward'"):
        w.merge(other.snapshot())


def test_snapshot_without_reset_keeps_window():
    w = MetricsWindow()
    w.add("reward", 1.0)
    w.snapshot()
    assert w.compute() == {"reward": 1.0}
    assert "reward" in w
