"""TokenAllowance and the trainer-side allowance formulas (SPEC §4.1, Appendix B.3, B.4, B.6)."""

import pytest

from asyncgrpo_cli.rollout.allowance import (
    IN_FLIGHT_ESTIMATES,
    KEPT_FLOOR_FRACTION,
    KEPT_MIN_DECIDED_ROLLOUTS,
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


# ----------------------------------------------------------------------------- staleness.in_flight_estimate
def _group(a: TokenAllowance, tokens: list[float], kept: bool) -> None:
    """One whole group through the allowance: started, its rollouts back, then queued (kept) or discarded."""
    a.on_group_started(len(tokens))
    for t in tokens:
        a.on_rollout_finished(t)
    a.on_group_finished()
    if kept:
        a.on_samples_queued(sum(tokens), rollouts=len(tokens))
    else:
        a.on_samples_discarded(sum(tokens), rollouts=len(tokens))


@pytest.mark.parametrize("estimate", IN_FLIGHT_ESTIMATES)
def test_both_estimates_start_alike_one_group_at_a_time_then_the_plain_mean(estimate):
    """Before any rollout finished nothing is estimated; before any group is decided "kept" is the plain mean."""
    a = TokenAllowance(estimate)
    assert a.in_flight_estimate == estimate and a.in_flight_tokens_per_rollout is None
    a.on_group_started(4)
    assert a.in_flight_tokens == 0.0 and not a.can_start_group(10**9)  # one group at a time
    for t in (100, 300, 200, 200):
        a.on_rollout_finished(t)
    a.on_group_finished()  # back, not yet scored: no group decided
    assert a.kept_tokens_per_rollout is None and a.decided_rollouts_total == 0
    a.on_group_started(4)
    assert a.in_flight_tokens_per_rollout == pytest.approx(200.0)  # the plain mean, either way
    assert a.committed_tokens == pytest.approx(800 + 4 * 200)


def test_mean_and_kept_driven_step_by_step_with_discarded_groups():
    """Three of four groups dropped (zero reward std): "mean" still counts each rollout in flight at 100 tokens,
    "kept" at what a rollout put into the queue, 25, and so admits four times the rollouts."""
    mean, kept = TokenAllowance("mean"), TokenAllowance("kept", kept_min_decided=1)
    for a in (mean, kept):
        _group(a, [100, 100], kept=True)
        for _ in range(3):
            _group(a, [100, 100], kept=False)
    assert mean.tokens_per_rollout == kept.tokens_per_rollout == pytest.approx(100.0)
    assert kept.queued_tokens_total == 200 and kept.decided_rollouts_total == 8
    assert kept.kept_tokens_per_rollout == pytest.approx(25.0)
    assert mean.in_flight_tokens_per_rollout == pytest.approx(100.0)  # SPEC B.4, unchanged
    assert kept.in_flight_tokens_per_rollout == pytest.approx(25.0)
    for a in (mean, kept):
        a.on_samples_consumed(200)  # the trainer pulled the kept group
        assert a.committed_tokens == 0
    admitted = {}
    for name, a in (("mean", mean), ("kept", kept)):
        n = 0
        while a.can_start_group(1000):  # allowance 1,000 sample tokens, groups of 2
            a.on_group_started(2)
            n += 2
        admitted[name] = n
    assert admitted == {"mean": 10, "kept": 40}
    assert kept.in_flight_tokens == pytest.approx(40 * 25.0) and mean.in_flight_tokens == pytest.approx(1000.0)
    # Finished rollouts waiting for their group's verdict count with their real tokens in both.
    kept.on_rollout_finished(100)
    assert kept.committed_tokens == pytest.approx(100 + 39 * 25.0)


def test_kept_counts_a_partly_discarded_group_once():
    """A kept group whose cut completions are not trained: part discarded (rollouts=0), the rest queued with the
    group's rollouts; the group's two rollouts are decided once."""
    a = TokenAllowance("kept", kept_min_decided=1)
    a.on_group_started(2)
    a.on_rollout_finished(60)
    a.on_rollout_finished(40)
    a.on_group_finished()
    a.on_samples_discarded(40)  # the untrained part
    a.on_samples_queued(60, rollouts=2)
    assert a.decided_rollouts_total == 2 and a.queued_tokens_total == 60
    assert a.kept_tokens_per_rollout == pytest.approx(30.0) and a.in_flight_tokens_per_rollout == pytest.approx(30.0)
    a.on_samples_consumed(60)
    assert a.queued_tokens_total == 60  # a running total of what entered the queue: consumption does not change it
    with pytest.raises(ValueError, match="rollouts"):
        a.on_samples_queued(0, rollouts=-1)


def test_kept_floor_when_every_group_so_far_was_discarded():
    """Every group dropped: what rollouts put in the queue is 0, but each rollout in flight still counts
    KEPT_FLOOR_FRACTION (0.1) of the plain mean, so at most 10x what "mean" admits is in flight."""
    assert KEPT_FLOOR_FRACTION == 0.1
    a = TokenAllowance("kept", kept_min_decided=1)
    for _ in range(3):
        _group(a, [100, 100], kept=False)
    assert a.kept_tokens_per_rollout == 0.0 and a.committed_tokens == 0
    assert a.in_flight_tokens_per_rollout == pytest.approx(10.0)
    n = 0
    while a.can_start_group(1000):
        a.on_group_started(2)
        n += 2
    assert n == 100 and a.in_flight_tokens == pytest.approx(1000.0)  # "mean" would admit 10
    # A low keep rate above the floor is used as it is; a custom floor binds instead.
    b = TokenAllowance("kept", kept_floor=0.5, kept_min_decided=1)
    _group(b, [100, 100], kept=True)
    for _ in range(3):
        _group(b, [100, 100], kept=False)
    assert b.kept_tokens_per_rollout == pytest.approx(25.0) and b.in_flight_tokens_per_rollout == pytest.approx(50.0)


def test_kept_is_the_plain_mean_until_64_rollouts_are_decided():
    """One group's verdict is no keep rate: the one-GPU job's first group was dropped, "kept" fell to its floor and
    936 rollouts went in flight at once. Until the decided groups hold KEPT_MIN_DECIDED_ROLLOUTS (64) rollouts the
    estimate is the plain mean; from then on what rollouts put in the queue."""
    assert KEPT_MIN_DECIDED_ROLLOUTS == 64
    a = TokenAllowance("kept")
    for i in range(7):  # 7 groups of 8: 56 rollouts decided, one group kept
        _group(a, [100] * 8, kept=i == 0)
        assert a.in_flight_tokens_per_rollout == pytest.approx(100.0), i
    _group(a, [100] * 8, kept=False)  # the 8th group: 64 rollouts decided, 800 of 6,400 tokens queued
    assert a.decided_rollouts_total == 64 and a.in_flight_tokens_per_rollout == pytest.approx(12.5)
    b = TokenAllowance("kept", kept_min_decided=8)
    _group(b, [100] * 8, kept=False)
    assert b.in_flight_tokens_per_rollout == pytest.approx(10.0)  # the floor, 0.1 x the mean


def test_kept_never_counts_more_than_the_plain_mean():
    """Kept groups longer than the rollouts finished since (still waiting for their verdict): "kept" is capped at
    the plain mean, so it never admits fewer rollouts than "mean"."""
    a = TokenAllowance("kept", kept_min_decided=1)
    _group(a, [300, 300], kept=True)
    a.on_group_started(4)
    for _ in range(4):
        a.on_rollout_finished(0)  # four empty (failed) rollouts, group not yet scored
    a.on_group_finished()
    assert a.kept_tokens_per_rollout == pytest.approx(300.0) and a.tokens_per_rollout == pytest.approx(100.0)
    assert a.in_flight_tokens_per_rollout == pytest.approx(100.0)


def test_the_estimate_and_its_floor_are_checked():
    with pytest.raises(ValueError, match="in_flight_estimate='queued'"):
        TokenAllowance("queued")
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="kept_floor"):
            TokenAllowance("kept", kept_floor=bad)
    with pytest.raises(ValueError, match="kept_min_decided"):
        TokenAllowance("kept", kept_min_decided=0)
    assert "in_flight_estimate='kept'" in repr(TokenAllowance("kept"))


def test_the_config_and_the_allowance_know_the_same_estimates():
    from asyncgrpo_cli.config import rules

    assert rules.IN_FLIGHT_ESTIMATES == IN_FLIGHT_ESTIMATES


def test_expected_queue_tokens_counts_rollouts_in_flight_at_the_keep_rate_whatever_the_estimate():
    """Deadline admission compares with tokens the trainer pulls, so it counts a rollout in flight at what it is
    expected to queue (25 here: three of four groups dropped) even when the allowance keeps B.4's mean (100)."""
    mean, kept = TokenAllowance("mean", kept_min_decided=1), TokenAllowance("kept", kept_min_decided=1)
    for a in (mean, kept):
        _group(a, [100, 100], kept=True)
        for _ in range(3):
            _group(a, [100, 100], kept=False)
        a.on_samples_consumed(200)
        a.on_group_started(8)
        a.on_rollout_finished(40)  # one back, its group not yet decided: counts in full
        assert a.expected_kept_tokens_per_rollout == pytest.approx(25.0)
        assert a.expected_queue_tokens == pytest.approx(40 + 7 * 25.0)
    assert mean.committed_tokens == pytest.approx(40 + 7 * mean.tokens_per_rollout)  # the allowance: B.4, unchanged
    assert kept.committed_tokens == pytest.approx(kept.expected_queue_tokens)
    fresh = TokenAllowance("mean")
    assert fresh.expected_kept_tokens_per_rollout is None and fresh.expected_queue_tokens == 0
    fresh.on_group_started(2)
    fresh.on_rollout_finished(30)
    assert fresh.expected_kept_tokens_per_rollout == pytest.approx(30.0)  # the plain mean until 64 are decided
    assert fresh.expected_queue_tokens == pytest.approx(30 + 30.0)
