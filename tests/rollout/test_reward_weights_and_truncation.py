"""reward_weights (applied before the group advantage) and mask_truncated_completions (cut completions scored,
counted in the advantage, not trained) in the worker's scorer (issue #27, README "Loss variants")."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from asyncgrpo_cli.rollout.metrics import MetricsWindow
from asyncgrpo_cli.rollout.advantages import weighted_rewards
from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.rollout.types import Rollout, RolloutGroup, TrainingSequence
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
from asyncgrpo_cli.sampler.turn_record import TurnRecord

G = 4


class _Value:
    def __init__(self, value):
        self.value = value


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


def _loop(tmp_path, **kw):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=G, max_completion_length=4, report_to="none",
                          vllm_server_base_url="http://127.0.0.1:1", max_concurrent_rollouts=8, **kw)
    dataset = [{"prompt": [{"role": "user", "content": "q"}]}]
    return AsyncRolloutLoop(cfg, "m", dataset, [_reward, _reward], None, [0], queue.Queue(), _Value(0), _Value(1e9),
                            _Value(0.0), threading.Event(), queue.Queue(), queue.Queue(), consumed_tokens_value=_Value(0.0))


def _group(loop, finish_reasons):
    rollouts, sequences = [], []
    loop.allowance.on_group_started(G)
    for i, reason in enumerate(finish_reasons):
        seq = TrainingSequence(input_ids=[1, 2, 3 + i], trained_mask=[0, 1, 1], sampler_logprobs=[0.0, -0.5, -0.5],
                               advantage=0.0, group_id=0, row_index=0, model_version=0)
        loop.allowance.on_rollout_finished(seq.num_tokens)
        turn = TurnRecord(prompt_ids=[1], output_ids=[2, 3 + i], output_log_probs=[-0.5, -0.5], finish_reason=reason)
        rollouts.append(Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=[2, 3 + i],
                                turns=[turn]))
        sequences.append([seq])
    loop.allowance.on_group_finished()
    group = RolloutGroup(prompts=[[{"role": "user", "content": "q"}]] * G, reward_kwargs={},
                         completions=[r.completion for r in rollouts], completions_ids=[r.completion_ids for r in rollouts],
                         completions_sequences=sequences, tool_call_counts=[0] * G, tool_failure_counts=[0] * G,
                         model_version=0, group_id=0, row_index=0, env_rewards=[None] * G,
                         rollout_rewards=[None] * G, queued_at=time.monotonic())
    return group, rollouts


def _finish(loop, per_function, finish_reasons=("stop",) * G):
    """Score one group; returns it, its outcome and the metrics the worker shipped (window values)."""
    group, rollouts = _group(loop, finish_reasons)
    loop._finish_group(group, rollouts, 7, SimpleNamespace(per_function=per_function))
    window = MetricsWindow()
    while not loop.metrics_queue.empty():
        window.merge(loop.metrics_queue.get_nowait())
    return group, loop.rollout_buffer.get_nowait(), window.compute()


def test_weighted_rewards_helper():
    assert weighted_rewards([[1.0, None], [2.0, 3.0]], [0.5, -2.0]) == [[0.5, None], [-4.0, -6.0]]
    assert weighted_rewards([[1.0, None]], None) == [[1.0, None]]
    with pytest.raises(ValueError, match="one weight per reward function"):
        weighted_rewards([[1.0]], [1.0, 2.0])


def test_reward_weights_apply_before_the_group_advantage(tmp_path):
    per_function = {"f": [1.0, 0.0, 1.0, 0.0], "g": [0.0, 4.0, 0.0, 4.0]}
    # Unweighted (default): totals 1, 4, 1, 4: kept, advantages ±1.
    _, outcome, _ = _finish(_loop(tmp_path / "a"), per_function)
    assert outcome.kind == "kept"
    assert [s.advantage for s in outcome.samples] == pytest.approx([-1.0, 1.0, -1.0, 1.0])
    # Weights 2 and 0.5: totals 2, 2, 2, 2: no spread, the group is dropped.
    group, outcome, metrics = _finish(_loop(tmp_path / "b", reward_weights=[2.0, 0.5]), per_function)
    assert outcome.kind == "dropped" and np.allclose(group.rewards, 2.0)
    # Weights 1 and -1: totals 1, -4, 1, -4: the sign flips against the unweighted run.
    group, outcome, metrics = _finish(_loop(tmp_path / "c", reward_weights=[1.0, -1.0]), per_function)
    assert list(group.rewards) == [1.0, -4.0, 1.0, -4.0]
    assert [s.advantage for s in outcome.samples] == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert metrics["rewards/g/mean"] == pytest.approx(2.0)  # logged unweighted: mean of 0, 4, 0, 4
    assert metrics["rewards/f/weight"] == 1.0 and metrics["rewards/g/weight"] == -1.0
    assert metrics["reward"] == pytest.approx(-1.5)  # the weighted totals


def test_default_logs_no_weights(tmp_path):
    _, _, metrics = _finish(_loop(tmp_path), {"f": [1.0, 0.0, 1.0, 0.0], "g": [0.0, 4.0, 0.0, 4.0]})
    assert not any(name.endswith("/weight") for name in metrics)
    assert "completions/masked_truncated_frac" not in metrics


def test_mask_truncated_completions(tmp_path):
    per_function = {"f": [1.0, 0.0, 1.0, 0.0], "g": [0.0, 0.0, 0.0, 0.0]}
    reasons = ("length", "stop", "stop", "length")
    # Default: every completion is trained.
    _, outcome, _ = _finish(_loop(tmp_path / "a"), per_function, reasons)
    assert len(outcome.samples) == G
    # On: the cut ones (0 and 3) still shape the advantages of the others but are not trained; each travels as an
    # untrained stub (its context only) so that it counts as a sequence in grpo / dr_grpo, as TRL's empty-mask row.
    loop = _loop(tmp_path / "b", mask_truncated_completions=True)
    queued_before = loop.allowance.queued_tokens
    _, outcome, metrics = _finish(loop, per_function, reasons)
    assert outcome.kind == "kept" and metrics["completions/masked_truncated_frac"] == 0.5
    trained = [s for s in outcome.samples if s.num_trained_tokens]
    stubs = [s for s in outcome.samples if not s.num_trained_tokens]
    assert [s.input_ids[-1] for s in trained] == [4, 5]
    assert [s.advantage for s in trained] == pytest.approx([-1.0, 1.0])  # group of 4: mean 0.5, std 0.5
    assert [s.input_ids for s in stubs] == [[1], [1]]  # the context before the first trained token
    assert [s.advantage for s in stubs] == pytest.approx([1.0, -1.0])  # counted, never trained
    assert loop.allowance.queued_tokens - queued_before == sum(s.num_tokens for s in outcome.samples)
    assert loop.allowance.finished_tokens == 0  # the cut samples' generated tokens were released, not left counted
    # Every completion cut: the group's samples are all stubs, nothing to train (a step of them has zero loss).
    loop = _loop(tmp_path / "c", mask_truncated_completions=True)
    _, outcome, _ = _finish(loop, per_function, ("length",) * G)
    assert outcome.kind == "kept" and len(outcome.samples) == G
    assert all(s.num_trained_tokens == 0 and s.input_ids == [1] for s in outcome.samples)


def test_scale_rewards_none_reaches_the_worker(tmp_path):
    per_function = {"f": [1.0, 0.0, 1.0, 0.0], "g": [0.0, 4.0, 0.0, 2.0]}  # totals 1, 4, 1, 2: mean 2
    _, outcome, _ = _finish(_loop(tmp_path / "a", scale_rewards="none"), per_function)
    assert [s.advantage for s in outcome.samples] == pytest.approx([-1.0, 2.0, -1.0, 0.0])
    _, outcome, _ = _finish(_loop(tmp_path / "b"), per_function)  # group: divided by the population std
    assert [s.advantage for s in outcome.samples] == pytest.approx([-1.0 / 1.2247449, 2.0 / 1.2247449,
                                                                    -1.0 / 1.2247449, 0.0], rel=1e-6)
