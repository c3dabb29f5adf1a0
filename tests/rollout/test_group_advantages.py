"""Reward sums, group advantages and the zero-std drop rule (SPEC §3.2, Appendix B.7)."""

import math

import numpy as np
import pytest

from asyncgrpo_cli.rollout.advantages import (
    group_advantages,
    group_reward_std,
    should_drop_group,
    sum_rewards,
    total_rewards,
)


def test_sum_rewards_skips_none_and_marks_unscored_nan():
    totals = sum_rewards([[1.0, None, None, 0.5], [2, 3.0, None, float("nan")], None], 4)
    assert totals.dtype == np.float64 and totals.shape == (4,)
    assert totals[0] == 3.0 and totals[1] == 3.0 and totals[3] == 0.5
    assert math.isnan(totals[2])


def test_sum_rewards_wrong_length_names_source():
    with pytest.raises(ValueError, match="#1 has 2 entries"):
        sum_rewards([[1, 2, 3], [1, 2]], 3)


def test_total_rewards_all_three_sources():
    totals = total_rewards(
        [[1.0, None, None], [0.5, None, None]],
        env_rewards=[None, 2.0, None],
        rollout_rewards=[1.0, None, None],
    )
    np.testing.assert_array_equal(totals[:2], [2.5, 2.0])
    assert math.isnan(totals[2])
    assert math.isnan(total_rewards([], num_completions=2)[0])
    with pytest.raises(ValueError, match="num_completions"):
        total_rewards([])


def test_group_advantages_population_std():
    r = [1.0, 0.0, 0.0, 1.0]
    adv = group_advantages(r)
    # mean 0.5, population std 0.5
    np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, 1.0], rtol=1e-6)
    r = np.array([3.0, 1.0, 2.0])
    expected = (r - r.mean()) / (r.std(ddof=0) + 1e-8)
    np.testing.assert_allclose(group_advantages(r), expected)


def test_group_advantages_nan_gets_zero_and_is_excluded():
    adv = group_advantages([1.0, float("nan"), 0.0, None])
    assert adv[1] == 0.0 and adv[3] == 0.0
    np.testing.assert_allclose(adv[[0, 2]], [1.0, -1.0], rtol=1e-6)
    assert np.all(group_advantages([None, float("nan")]) == 0.0)


def test_zero_std_group_advantages_are_zero():
    np.testing.assert_array_equal(group_advantages([2.0, 2.0, 2.0]), [0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    "rewards, dropped",
    [
        ([1.0, 1.0, 1.0, 1.0], True),  # all correct
        ([0.0, 0.0, 0.0, 0.0], True),  # all wrong
        ([1.0, float("nan"), float("nan")], True),  # one scored
        ([None, None], True),  # nothing scored
        ([1.0, 0.0, float("nan")], False),
        ([1.0, 1.0, float("nan"), 0.0], False),
        ([0.1 + 0.2, 0.3], True),  # equal up to float rounding of summed sources
        ([0.3, 0.30001], False),
    ],
)
def test_should_drop_group(rewards, dropped):
    assert should_drop_group(rewards) is dropped


def test_group_reward_std():
    assert group_reward_std([1.0, 0.0, float("nan")]) == pytest.approx(0.5)
    assert math.isnan(group_reward_std([None, float("nan")]))


def _trl_group_advantages(rewards, scale_rewards):
    """TRL 1.16 GRPOTrainer's advantage of one group (sum_then_normalize), from its formula: reward minus the
    group's nan-mean, divided (scale_rewards="group") by the Bessel-corrected nan-std + 1e-4; NaN -> 0."""
    r = np.asarray(rewards, dtype=np.float64)
    scored = r[~np.isnan(r)]
    centred = r - scored.mean()
    if scale_rewards == "group":
        centred = centred / (np.std(scored, ddof=1) + 1e-4)
    return np.nan_to_num(centred, nan=0.0)


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25], [2.0, -1.0], [1.0, np.nan, 0.0, 3.0]])
def test_scale_rewards_against_trl(rewards):
    """scale_rewards=none is TRL's number exactly (Dr. GRPO); group is B.7's population std + 1e-8, TRL's
    Bessel-corrected std + 1e-4: ours × sqrt((n-1)/n) is TRL's up to the two epsilons (README: Loss variants)."""
    n = int(np.sum(~np.isnan(rewards)))
    np.testing.assert_allclose(group_advantages(rewards, "none"), _trl_group_advantages(rewards, "none"),
                               rtol=0, atol=1e-15)
    ours, trl = group_advantages(rewards, "group"), _trl_group_advantages(rewards, "group")
    np.testing.assert_allclose(ours * math.sqrt((n - 1) / n), trl, rtol=1e-3)  # 1e-4 against std ~0.5
    assert not np.allclose(ours, trl, rtol=1e-2)  # the difference is real: sqrt((n-1)/n) = 0.935 at n = 8
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        group_advantages(rewards, "batch")
