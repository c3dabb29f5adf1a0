"""`plan_edge_first` (issue #28): the step's last micro-batch is re-planned oldest-first when a carried sample
would be past ``max_staleness`` at the next step, so the sample at the edge trains instead of being dropped."""

from __future__ import annotations

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher, plan_edge_first


def sample(n: int, version: int, group: int, first: int = 0) -> TrainingSequence:
    ids = list(range(first, first + n))  # distinct tokens: nothing shared between groups
    return TrainingSequence(ids, [0] * 2 + [1] * (n - 2), [0.0] * n, 1.0, group, group, version)


def fill(batcher, samples):
    return [p for p in (batcher.add(s) for s in samples) if p is not None]


def test_the_sample_at_the_staleness_edge_trains_now_and_a_fresher_one_waits():
    b = TokenBudgetBatcher(token_budget=100, num_processes=1)
    fresh = [sample(40, version=1, group=1, first=0), sample(40, version=1, group=2, first=100)]
    edge = sample(40, version=0, group=3, first=200)  # version 0 at step version 1: edge of max_staleness=1
    plans = fill(b, [*fresh, edge])
    assert len(plans) == 1 and b.pending() == [edge]  # before: the edge sample would train at version 2, stale
    extra = plan_edge_first(plans, b, version=1, max_staleness=1)
    assert extra == []
    trained = [s for row in plans[0].rows for s in row]
    assert edge in trained and len(trained) == 2
    assert len(b.pending()) == 1 and b.pending()[0] in fresh
    assert all(t <= 100 for t in plans[0].row_tokens)
    # every sample trained now or next step is within max_staleness of the version it trains at
    assert all(1 - s.model_version <= 1 for s in trained)
    assert all(2 - s.model_version <= 1 for s in b.pending())


def test_nothing_changes_when_no_carried_sample_is_at_the_edge():
    b = TokenBudgetBatcher(token_budget=100, num_processes=1)
    plans = fill(b, [sample(40, 1, 1, 0), sample(40, 1, 2, 100), sample(40, 1, 3, 200)])
    before = [list(r) for r in plans[0].rows], b.pending()
    assert plan_edge_first(plans, b, version=1, max_staleness=1) == []
    assert ([list(r) for r in plans[0].rows], b.pending()) == before
    assert plan_edge_first([], b, version=5, max_staleness=0) == []
