"""`pull_outcome`: what counts as the trainer waiting for rollouts (perf/rollout_wait_s)."""

from __future__ import annotations

from asyncgrpo_cli.train.step_pull import pull_outcome


class FakeQueue:
    """`get(timeout)` over scripted answers; each blocking call advances a fake clock."""

    def __init__(self, answers: list, block_s: float) -> None:
        self.answers, self.block_s, self.now, self.timeouts = list(answers), block_s, 100.0, []

    def get(self, timeout: float):
        self.timeouts.append(timeout)
        if timeout > 0:
            self.now += self.block_s
        return self.answers.pop(0)

    def clock(self) -> float:
        return self.now


def test_queued_outcome_costs_no_wait():
    q = FakeQueue(["outcome"], block_s=0.05)
    assert pull_outcome(q.get, 0.05, q.clock) == ("outcome", 0.0)
    assert q.timeouts == [0.0]


def test_time_blocked_until_an_outcome_arrives_is_waiting():
    # The outcome arrived while blocked: that time is waiting too (it used to go uncounted).
    q = FakeQueue([None, "outcome"], block_s=0.03)
    outcome, waited = pull_outcome(q.get, 0.05, q.clock)
    assert outcome == "outcome" and abs(waited - 0.03) < 1e-9
    assert q.timeouts == [0.0, 0.05]


def test_empty_poll_is_waiting():
    q = FakeQueue([None, None], block_s=0.05)
    outcome, waited = pull_outcome(q.get, 0.05, q.clock)
    assert outcome is None and abs(waited - 0.05) < 1e-9
