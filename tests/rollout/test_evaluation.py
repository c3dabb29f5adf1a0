"""Evaluation (issue #27 item 6, README "Evaluation"): the trainer's schedule, the aggregation of one round, the
worker's round (never a training sample, never in the staleness allowance, at most half the concurrency cap)
and the start-up refusals."""

from __future__ import annotations

import asyncio
import copy
import math
import queue
import threading
import time

import datasets
import numpy as np
import pytest

from asyncgrpo_cli.config.errors import ConfigError
from asyncgrpo_cli.config.eval_rules import check_eval_dataset, check_eval_setup
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
from asyncgrpo_cli.rollout.concurrency import ConcurrencyCap
from asyncgrpo_cli.rollout.evaluation import EvalResult, eval_metrics, eval_slot_limit
from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.rollout.metrics import MetricsWindow
from asyncgrpo_cli.rollout.types import Rollout
from asyncgrpo_cli.rewards import accuracy_reward
from asyncgrpo_cli.train.evaluation import EvalSchedule, TrainerEvaluation, eval_log


class _Value:
    def __init__(self, value):
        self.value = value


# ------------------------------------------------------------------------------------ schedule (pure)
def test_schedule_every_eval_steps_then_the_final_step():
    s = EvalSchedule(eval_steps=2)
    asked = []
    for step in range(1, 8):
        if s.due(step):
            s.request(step)
            asked.append(step)
            s.receive(step)  # the round came back before the next step
    assert asked == [2, 4, 6]
    assert s.due(7, final=True) and not s.due(6, final=True)  # the last step once, never twice


def test_a_round_due_while_one_runs_is_skipped_and_counted():
    s = EvalSchedule(eval_steps=1)
    assert s.due(1)
    s.request(1)
    assert s.in_flight and not s.due(2) and not s.due(3) and s.skipped == 2
    assert not s.due(3, final=True) and s.skipped == 2  # the final round waits (the caller waits), not skipped
    s.receive(1)
    assert s.due(3, final=True)


def test_schedule_off():
    s = EvalSchedule(eval_steps=0)
    assert not s.enabled and not any(s.due(step) for step in range(1, 5)) and not s.due(5, final=True)
    args = AsyncGRPOConfig(output_dir="/tmp/x", report_to="none", eval_strategy="steps", eval_steps=3)
    assert TrainerEvaluation(args, has_eval_dataset=False).schedule.eval_steps == 0
    assert TrainerEvaluation(args, has_eval_dataset=True).schedule.eval_steps == 3


# ------------------------------------------------------------------------------------ aggregation (pure)
def test_eval_metrics_means_and_pass_rate():
    per_function = {"acc": [1.0, 0.0, None, 1.0], "fmt": [0.5, 0.5, None, -2.0]}
    totals = np.array([1.5, 0.5, np.nan, -1.0])  # the third completion: no function scored it
    m = eval_metrics(per_function, totals)
    assert m["eval/reward"] == pytest.approx(1.0 / 3)
    assert m["eval/rewards/acc/mean"] == pytest.approx(2 / 3) and m["eval/rewards/fmt/mean"] == pytest.approx(-1 / 3)
    assert m["eval/pass_rate"] == pytest.approx(2 / 3)  # total > 0: 1.5 and 0.5, of 3 scored
    assert m["eval/num_completions"] == 4 and m["eval/num_scored"] == 3
    empty = eval_metrics({"acc": [None]}, np.array([np.nan]))
    assert math.isnan(empty["eval/reward"]) and math.isnan(empty["eval/pass_rate"])
    logged = eval_log(EvalResult(step=4, model_version=3, metrics=empty, duration_s=0.5), skipped=1)
    assert logged["eval/reward"] is None and logged["eval/step"] == 4.0 and logged["eval/skipped_rounds"] == 1.0


def test_trainer_side_writes_each_round_once_and_waits_at_the_end():
    class FakeWorker:
        def __init__(self):
            self.asked, self.results = [], []

        def request_eval(self, step):
            self.asked.append(step)
            self.results.append(EvalResult(step=step, model_version=step, metrics={"eval/reward": step / 10}))

        def drain_metrics(self):
            return []

        def take_eval_results(self):
            out, self.results = self.results, []
            return out

        def check_alive(self):
            pass

    class FakeLive:
        def __init__(self):
            self.lines = []

        def append_metrics(self, record):
            self.lines.append(record)

    class FakeTrainer:
        def __init__(self):
            self.worker, self.window, self.live, self.logged = FakeWorker(), MetricsWindow(), FakeLive(), []

        def log(self, logs):
            self.logged.append(logs)

    args = AsyncGRPOConfig(output_dir="/tmp/x", report_to="none", eval_strategy="steps", eval_steps=2)
    ev, trainer = TrainerEvaluation(args, True), FakeTrainer()
    for step in (1, 2, 3):
        ev.after_step(trainer, step)
    ev.after_step(trainer, 4)  # the round of step 2 is written here; step 4's is asked for
    assert trainer.worker.asked == [2, 4] and [line["step"] for line in trainer.live.lines] == [2]
    ev.after_step(trainer, 5, final=True)  # waits for step 4's round, asks for the final one, waits for it
    assert trainer.worker.asked == [2, 4, 5]
    assert [(line["event"], line["step"], line["eval/reward"]) for line in trainer.live.lines] == [
        ("eval", 2, 0.2), ("eval", 4, 0.4), ("eval", 5, 0.5)]
    assert [logs["eval/step"] for logs in trainer.logged] == [2.0, 4.0, 5.0]  # the trackers: once per round
    ev.after_step(trainer, 5, final=True)
    assert trainer.worker.asked == [2, 4, 5]  # never twice for one step


# ------------------------------------------------------------------------------------ the worker's round
def reward_first_char(completions, target, **kwargs):
    return [float(c[0]["content"] == t) for c, t in zip(completions, target)]


class EvalLoop(AsyncRolloutLoop):
    """Answers each prompt with its last character; records how many eval rollouts run at once."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.running = self.max_running = 0

    async def generate_one(self, prompt, tools, group_id=0):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(0)
        self.running -= 1
        text = prompt[-1]["content"][-1]
        return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=[ord(text)], turns=[])


def make_eval_loop(tmp_path, evals, request):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=4, max_completion_length=4, report_to="none",
                          vllm_server_base_url="http://127.0.0.1:1", max_concurrent_rollouts=8,
                          reward_weights=[2.0])
    train = [{"prompt": [{"role": "user", "content": "q"}], "target": "q"}]
    loop = EvalLoop(cfg, "m", train, [reward_first_char], None, [0], queue.Queue(), _Value(3), _Value(1e9),
                    _Value(0.0), threading.Event(), queue.Queue(), queue.Queue(), consumed_tokens_value=_Value(0.0),
                    eval_dataset=evals, eval_request_value=request)
    loop.cap = ConcurrencyCap(8)
    return loop


def test_eval_round_is_scored_never_trained_nor_in_the_allowance(tmp_path):
    evals = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"say {c}"}], "target": t}
                                        for c, t in zip("abcde", "abxdy")])
    request = _Value(0)
    loop = make_eval_loop(tmp_path, evals, request)
    allowance_before = copy.deepcopy(vars(loop.allowance))
    schedule_before = copy.deepcopy(vars(loop.schedule))

    async def main():
        loop._slot_changed = asyncio.Condition()
        task = asyncio.create_task(loop._eval_rounds())
        request.value = 6  # the trainer asks for a round after step 6
        deadline = time.monotonic() + 60
        while loop.metrics_queue.empty():
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.01)
        loop._stop = True
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    result = loop.metrics_queue.get_nowait()
    assert isinstance(result, EvalResult) and result.step == 6 and result.model_version == 3
    m = result.metrics
    assert m["eval/rewards/reward_first_char/mean"] == pytest.approx(3 / 5)  # a, b, d right; c, e wrong
    assert m["eval/reward"] == pytest.approx(2 * 3 / 5)  # reward_weights=[2.0] apply to the total
    assert m["eval/pass_rate"] == pytest.approx(3 / 5) and m["eval/num_completions"] == 5
    assert loop.rollout_buffer.empty()  # nothing reaches the trainer's batches
    assert vars(loop.allowance) == allowance_before and vars(loop.schedule) == schedule_before
    assert loop._group_counter == 0 and loop._in_flight == 0
    assert loop.max_running <= eval_slot_limit(8) == 4


def test_eval_requests_reach_the_loop_only_with_an_eval_dataset():
    from asyncgrpo_cli.rollout.worker import RolloutWorker

    args = AsyncGRPOConfig(output_dir="/tmp/x", report_to="none")
    plain = RolloutWorker(args, "m", [], [reward_first_char], None, [0])
    assert "eval_dataset" not in plain._kwargs  # a custom loop_cls without these arguments keeps working
    worker = RolloutWorker(args, "m", [], [reward_first_char], None, [0], eval_dataset=[{"prompt": []}])
    assert worker._kwargs["eval_request_value"] is worker.eval_request_value
    worker.request_eval(4)
    worker.request_eval(2)  # never goes back
    assert worker.eval_request_value.value == 4


# ------------------------------------------------------------------------------------ start-up refusals
def test_steps_needs_eval_steps_and_data():
    with pytest.raises(ConfigError, match=r"eval_dataset=None.*Fix"):
        check_eval_setup("steps", 5, False)
    with pytest.raises(ConfigError, match=r"eval_steps=0.5.*Fix: set eval_steps=50"):
        check_eval_setup("steps", 0.5, True)
    with pytest.raises(ConfigError, match=r"eval_strategy='epoch'.*Fix"):
        check_eval_setup("epoch", None, True)
    with pytest.raises(ConfigError, match=r"trainer.eval_steps=0"):
        check_eval_setup("steps", 0, True, steps_key="trainer.eval_steps")
    check_eval_setup("no", None, False)
    check_eval_setup("steps", 10, True)


def test_eval_dataset_without_the_ground_truth_column_is_refused():
    evals = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "gold": "2"}])
    with pytest.raises(ValueError, match=r"eval_dataset.*accuracy_reward.*solution.*Fix"):
        check_eval_dataset(evals, [accuracy_reward], "eval_dataset")
    ok = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}])
    assert "solution" in check_eval_dataset(ok, [accuracy_reward], "eval_dataset")


def test_the_api_refuses_at_construction(tmp_path):
    from asyncgrpo_cli import AsyncGRPOTrainer
    from asyncgrpo_cli.testing import make_tiny_model
    from asyncgrpo_cli.train.evaluation import check_eval_inputs

    train = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}])
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", eval_strategy="steps", eval_steps=2)
    with pytest.raises(ConfigError, match=r"eval_dataset=None: eval_strategy=steps needs eval prompts"):
        AsyncGRPOTrainer(model=str(make_tiny_model(tmp_path / "tiny")), reward_funcs=[accuracy_reward], args=args,
                         train_dataset=train)
    gold = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "gold": "2"}])
    with pytest.raises(ValueError, match=r"eval_dataset.*ground-truth column"):
        check_eval_inputs(args, gold, [accuracy_reward])
    with pytest.raises(ConfigError, match=r"environment_factory is not supported"):
        check_eval_inputs(args, train, [accuracy_reward], environment_factory=object)
    off = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.warns(UserWarning, match="never evaluated"):
        check_eval_inputs(off, train, [accuracy_reward])


def test_the_cli_checks_name_the_data_eval_keys(tmp_path):
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.config.run_checks import check_cli_eval
    from asyncgrpo_cli.imports import reward_functions

    base = ["+recipe=smoke", f"trainer.output_dir={tmp_path}/out"]
    with pytest.raises(ConfigError, match=r"data.eval_name=null: trainer.eval_strategy=steps needs eval prompts"):
        check_cli_eval(compose([*base, "trainer.eval_strategy=steps", "trainer.eval_steps=2"]))
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"prompt": "1+1?", "gold": "2"}\n')
    cfg = compose([*base, "trainer.eval_strategy=steps", "trainer.eval_steps=2", f"data.eval_name={bad}"])
    funcs = (reward_functions(list(cfg.rewards)), ["asyncgrpo_cli.rewards:accuracy_reward"])
    with pytest.raises(ValueError, match=r"rewards\[0\].func \(on data.eval_name\).*ground-truth.*Fix"):
        check_cli_eval(cfg, funcs)
    with pytest.raises(ConfigError, match=r"data.eval_name='.*missing.jsonl'"):
        check_cli_eval(compose([*base, "trainer.eval_strategy=steps", f"data.eval_name={tmp_path}/missing.jsonl"]))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"prompt": "{i}+1?", "solution": "{i + 1}"}}\n' for i in range(5)))
    cfg = compose([*base, "trainer.eval_strategy=steps", f"data.eval_name={good}", "data.eval_size=3"])
    check_cli_eval(cfg, funcs)
    from asyncgrpo_cli.data import load_eval_prompts

    assert len(load_eval_prompts(cfg)) == 3 and load_eval_prompts(compose(base)) is None
    # eval_steps=0 is no "unset": it is refused (it became an eval every step); eval_on_start by its CLI key
    with pytest.raises(ConfigError, match=r"trainer.eval_steps=0: .*whole number"):
        check_cli_eval(compose([*base, "trainer.eval_strategy=steps", "trainer.eval_steps=0", f"data.eval_name={good}"]))
    with pytest.raises(ConfigError, match=r"trainer.eval_steps=-1: "):
        check_cli_eval(compose([*base, "trainer.eval_strategy=steps", "trainer.eval_steps=-1", f"data.eval_name={good}"]))
    with pytest.raises(ConfigError, match=r"trainer.eval_on_start=true: .*Fix: set trainer.eval_on_start=false"):
        check_cli_eval(compose([*base, "trainer.eval_strategy=steps", "trainer.eval_on_start=true",
                                f"data.eval_name={good}"]))
    gen = load_eval_prompts(compose([*base, "data.eval_generator=reasoning_gym", "data.eval_size=5"]))
    assert len(gen) == 5 and "prompt" in gen.column_names
