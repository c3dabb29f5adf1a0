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


def test_a_block_far_past_its_timeout_is_a_stopped_process_not_waiting():
    """A fresh-user trial's 48 s SIGSTOP of the trainer, while it polled an empty queue, read as 48 s of waiting
    for samples, and the idle finding blamed generation. Past the timeout by more than STOPPED_OVER_S, a block
    counts as the timeout; a slow return within that margin (a loaded machine) still counts in full."""
    from asyncgrpo_cli.train.step_pull import STOPPED_OVER_S

    q = FakeQueue([None, "outcome"], block_s=48.0)
    outcome, waited = pull_outcome(q.get, 0.25, q.clock)
    assert outcome == "outcome" and waited == 0.25
    q = FakeQueue([None, None], block_s=0.25 + STOPPED_OVER_S)
    assert pull_outcome(q.get, 0.25, q.clock)[1] == 0.25 + STOPPED_OVER_S
