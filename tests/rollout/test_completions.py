"""log_completions records: what the worker ships per group (text, total and per-function rewards, advantage),
how the trainer side splits them from metric snapshots, writes them and hands them to trackers."""

from __future__ import annotations

import json
import math
import queue
import types

import numpy as np
import pytest

from asyncgrpo_cli.rollout.completions import CompletionRecords, group_records, messages_text, ship_group_records
from asyncgrpo_cli.rollout.types import RolloutGroup
from asyncgrpo_cli.rollout.worker import RolloutWorker
from asyncgrpo_cli.run.state import LiveFiles
from asyncgrpo_cli.train.trackers import log_completions, markdown_table, send_to_trackers, table_rows


class Judge:  # an environment class: its get_reward is logged under the class name
    pass


def make_group() -> RolloutGroup:
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    group = RolloutGroup(prompts=[prompt, prompt], reward_kwargs={},
                         completions=[[{"role": "assistant", "content": "4"}],
                                      [{"role": "assistant", "content": "",
                                        "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]},
                                       {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4"}]],
                         completions_ids=[[1], [2]], completions_sequences=[[], []], tool_call_counts=[0, 1],
                         tool_failure_counts=[0, 0], model_version=3, group_id=7, row_index=0,
                         env_rewards=[None, (Judge, 0.5)], rollout_rewards=[None, None])
    group.rewards = np.array([1.0, np.nan])
    return group


def test_group_records_carry_text_rewards_and_advantage():
    records = group_records(make_group(), np.array([0.7, np.nan]), {"accuracy": [1.0, None]}, dropped=False)
    assert len(records) == 2
    first, second = records
    assert first["prompt"][-1]["content"] == "2+2?" and first["completion"] == "4"
    assert first["reward"] == 1.0 and first["advantage"] == pytest.approx(0.7)
    assert first["rewards"] == {"accuracy": 1.0} and first["group_id"] == 7 and first["model_version"] == 3
    assert second["reward"] is None and second["advantage"] is None  # unscored: NaN becomes None
    assert second["rewards"] == {"accuracy": None, "Judge": 0.5}
    assert second["completion"] == "[call add({'a': 2})]\n[tool] 4\nIt is 4"
    json.dumps(records)  # one JSON line each, as is
    assert messages_text("plain") == "plain" and messages_text([{"role": "assistant", "content": " x "}]) == "x"


def test_records_are_shipped_only_with_log_completions():
    q: queue.Queue = queue.Queue()
    args = (make_group(), np.array([0.7, 0.0]), {"accuracy": [1.0, 0.0]}, True)
    ship_group_records(types.SimpleNamespace(log_completions=False), q, *args)
    assert q.empty()
    ship_group_records(types.SimpleNamespace(log_completions=True), q, *args)
    item = q.get_nowait()
    assert isinstance(item, CompletionRecords) and len(item.records) == 2 and item.records[0]["dropped"] is True


def test_worker_drain_keeps_completions_apart_from_metric_snapshots():
    fake = types.SimpleNamespace(metrics_queue=queue.Queue(), _completions=[])
    fake.metrics_queue.put({"reward": ("mean", 1.0, 1, None, False, 0.0)})
    fake.metrics_queue.put(CompletionRecords([{"completion": "a"}]))
    fake.metrics_queue.put(CompletionRecords([{"completion": "b"}]))
    snapshots = RolloutWorker.drain_metrics(fake)
    assert snapshots == [{"reward": ("mean", 1.0, 1, None, False, 0.0)}]
    assert [r["completion"] for r in RolloutWorker.take_completions(fake)] == ["a", "b"]
    assert RolloutWorker.take_completions(fake) == []


def test_log_completions_writes_at_most_n_stamped_lines_with_nan_as_null(tmp_path):
    live = LiveFiles(tmp_path)
    records = [{"prompt": "p", "completion": f"c{i}", "reward": math.nan, "rewards": {"f": math.nan},
                "advantage": 0.0} for i in range(5)]
    shown = log_completions(records, step=6, limit=2, live=live, callbacks=[])
    assert [r["completion"] for r in shown] == ["c0", "c1"]
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"], r["reward"], r["rewards"]["f"]) for r in lines] == \
        [(6, "c0", None, None), (6, "c1", None, None)]
    assert log_completions([], step=7, limit=None, live=live, callbacks=[]) == []
    assert len((tmp_path / "completions.jsonl").read_text().splitlines()) == 2


def test_table_rows_and_markdown():
    columns, rows = table_rows([{"step": 1, "prompt": [{"role": "user", "content": "q|1"}], "completion": "a\nb",
                                 "reward": 1.0, "advantage": 0.5, "rewards": {"acc": 1.0}}])
    assert columns == ["step", "prompt", "completion", "reward", "advantage", "acc"]
    assert rows == [[1, "q|1", "a\nb", 1.0, 0.5, 1.0]]
    text = markdown_table(columns, rows)
    assert "| 1 | q\\|1 | a<br>b | 1 | 0.5 | 1 |" in text.splitlines()


def test_a_failing_tracker_warns_and_training_goes_on():
    class WandbCallback:  # named like transformers' callback; its wandb module raises on log
        _wandb = types.SimpleNamespace(run=object(), Table=lambda **kw: kw,
                                       log=lambda data: (_ for _ in ()).throw(RuntimeError("offline disk full")))

    with pytest.warns(UserWarning, match="WandbCallback tracker did not take the completions table.*disk full"):
        assert send_to_trackers([WandbCallback()], [{"step": 1, "prompt": "p", "completion": "c"}], 1) == []


def test_trackio_gets_a_dataframe_table():
    """trackio itself is not installed in CI (an optional extra): its callback's Table and log stand in."""
    logged = []

    class TrackioCallback:
        _initialized = True
        _trackio = types.SimpleNamespace(Table=lambda dataframe: dataframe, log=logged.append)

    sent = send_to_trackers([TrackioCallback()], [{"step": 2, "prompt": "p", "completion": "c", "reward": 1.0,
                                                   "advantage": 0.5, "rewards": {"acc": 1.0}}], 2)
    assert sent == ["trackio"] and logged[0]["train/global_step"] == 2
    frame = logged[0]["completions"]
    assert list(frame.columns) == ["step", "prompt", "completion", "reward", "advantage", "acc"]
    assert frame.iloc[0]["completion"] == "c"
