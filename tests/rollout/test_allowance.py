"""TokenAllowance and the trainer-side allowance formulas (SPEC §4.1, Appendix B.3, B.4, B.6)."""

import pytest

from asyncgrpo_cli.rollout.allowance import (
    TokenAllowance,
    allowance_after_step,
    allowance_steps,
    initial_allowance,
)


def test_trainer_formulas():
    # B.3: max(max_staleness, 1) x weight_sync_steps x token_budget x grad_accum x num_processes
    assert initial_allowance(4, 1, 4096, 2, 3) == 4 * 4096 * 2 * 3
    assert initial_allowance(0, 1, 100, 1, 1) == 100  # max(0, 1) = 1
    assert initial_allowance(2, 3, 100, 1, 2) == 2 * 3 * 100 * 2
    # B.4/B.6
    assert allowance_after_step(4, 1, 1000) == 4000
    assert allowance_after_step(0, 2, 1000) == 2000
    assert allowance_after_step(3, 2, 0) == 0
    assert allowance_steps(4, 2) == 8


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(max_staleness=-1, weight_sync_steps=1, token_budget=1, gradient_accumulation_steps=1, num_processes=1), "max_staleness"),
        (dict(max_staleness=1, weight_sync_steps=0, token_budget=1, gradient_accumulation_steps=1, num_processes=1), "weight_sync_steps"),
        (dict(max_staleness=1, weight_sync_steps=1, token_budget=0, gradient_accumulation_steps=1, num_processes=1), "token_budget"),
        (dict(max_staleness=1, weight_sync_steps=1, token_budget=1, gradient_accumulation_steps=0, num_processes=1), "gradient_accumulation_steps"),
        (dict(max_staleness=1, weight_sync_steps=1, token_budget=1, gradient_accumulation_steps=1, num_processes=0), "num_processes"),
    ],
)
def test_initial_allowance_rejects_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        initial_allowance(**kwargs)


def test_after_step_rejects_negative_and_float():
    with pytest.raises(ValueError, match="tokens_consumed_by_last_step"):
        allowance_after_step(4, 1, -5)
    with pytest.raises(TypeError, match="tokens_consumed_by_last_step"):
        allowance_after_step(4, 1, 5.5)


def test_one_group_at_a_time_until_first_group_finishes():
    a = TokenAllowance()
    huge = 10**9
    assert a.can_start_group(huge)
    a.on_group_started(4)
    # Not even a huge allowance lets a second group start before the first one finishes.
    assert not a.can_start_group(huge)
    for tokens in (100, 200, 300):
        a.on_rollout_finished(tokens)
        assert not a.can_start_group(huge)
    a.on_rollout_finished(400)
    assert not a.can_start_group(huge)  # all rollouts back, but the group is not marked finished yet
    a.on_group_finished()
    assert a.first_group_finished
    assert a.tokens_per_rollout == pytest.approx(250.0)
    assert a.committed_tokens == pytest.approx(1000.0)
    assert a.can_start_group(1001)
    assert not a.can_start_group(1000)  # "under the allowance" is strict


def test_in_flight_counts_running_mean_and_queue_lifecycle():
    a = TokenAllowance()
    a.on_group_started(2)
    a.on_rollout_finished(100)
    a.on_rollout_finished(300)
    a.on_group_finished()
    # finished, not yet scored: real tokens count
    assert a.committed_tokens == 400
    a.on_samples_queued(400)
    assert a.queued_tokens == 400 and a.finished_tokens == 0
    assert a.committed_tokens == 400

    # Two more groups in flight: each rollout is estimated at the mean, 200 tokens.
    a.on_group_started(2)
    a.on_group_started(2)
    assert a.in_flight_tokens == pytest.approx(4 * 200)
    assert a.committed_tokens == pytest.approx(400 + 800)
    assert a.can_start_group(1201)
    assert not a.can_start_group(1200)

    # A long rollout comes back: the mean moves to (100 + 300 + 600) / 3.
    a.on_rollout_finished(600)
    assert a.tokens_per_rollout == pytest.approx(1000 / 3)
    assert a.committed_tokens == pytest.approx(400 + 600 + 3 * 1000 / 3)

    # The trainer consumes the queued samples: they stop counting.
    a.on_samples_consumed(400)
    assert a.queued_tokens == 0
    assert a.committed_tokens == pytest.approx(600 + 1000)


def test_dropped_group_releases_tokens_and_consumption_clamps():
    a = TokenAllowance()
    a.on_group_started(2)
    a.on_rollout_finished(50)
    a.on_rollout_finished(50)
    a.on_group_finished()
    a.on_samples_discarded(100)  # zero-std group
    assert a.committed_tokens == 0
    assert a.can_start_group(0)  # nothing committed at all: never stall
    a.on_group_started(2)
    assert not a.can_start_group(0)
    assert a.can_start_group(101)  # 2 in flight x 50
    a.on_samples_consumed(10**6)  # over-reported consumption clamps at zero
    assert a.queued_tokens == 0


def test_sync_consumed_total():
    a = TokenAllowance()
    a.on_group_started(1)
    a.on_rollout_finished(500)
    a.on_group_finished()
    a.on_samples_queued(500)
    assert a.sync_consumed_total(200) == 200
    assert a.queued_tokens == 300
    assert a.sync_consumed_total(200) == 0
    assert a.sync_consumed_total(500) == 300
    assert a.queued_tokens == 0
    with pytest.raises(ValueError, match="went down"):
        a.sync_consumed_total(100)


def test_allowance_shrinking_below_commitment_blocks_until_consumed():
    a = TokenAllowance()
    a.on_group_started(2)
    a.on_rollout_finished(1000)
    a.on_rollout_finished(1000)
    a.on_group_finished()
    a.on_samples_queued(2000)
    assert a.can_start_group(2001)
    assert not a.can_start_group(1500)  # trainer published a smaller allowance
    a.on_samples_consumed(1000)
    assert a.can_start_group(1500)


def test_bad_events_raise():
    a = TokenAllowance()
    with pytest.raises(ValueError, match="no rollout is in flight"):
        a.on_rollout_finished(10)
    with pytest.raises(ValueError, match="no group is in flight"):
        a.on_group_finished()
    with pytest.raises(ValueError, match="num_rollouts"):
        a.on_group_started(0)
    a.on_group_started(1)
    with pytest.raises(ValueError, match="sample_tokens"):
        a.on_rollout_finished(-1)
    a.on_rollout_finished(10)
    with pytest.raises(ValueError, match="exceed"):
        a.on_samples_queued(11)
    with pytest.raises(ValueError, match="allowance"):
        a.can_start_group(-1)
    with pytest.raises(ValueError, match="allowance"):
        a.can_start_group(float("nan"))


def test_cancelled_rollout_leaves_flight():
    a = TokenAllowance()
    a.on_group_started(2)
    a.on_rollout_cancelled()
    assert a.rollouts_in_flight == 1
    a.on_rollout_cancelled()
    with pytest.raises(ValueError):
        a.on_rollout_cancelled()
