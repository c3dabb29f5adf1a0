"""Built-in rewards: accuracy_reward (math-verify in a process pool), format_reward, length_reward."""

import functools
import signal
import threading

import pytest

from asyncgrpo_cli.rewards import (
    accuracy_reward,
    format_reward,
    length_reward,
    shutdown_verification_pool,
    verification_timeouts,
)
from asyncgrpo_cli.rewards import accuracy as accuracy_module
from asyncgrpo_cli.rollout.reward_runner import check_picklable


@pytest.fixture(scope="module", autouse=True)
def _shutdown_pool_after_module():
    yield
    shutdown_verification_pool()


def assistant(text):
    return [{"role": "assistant", "content": text}]


# ----------------------------------------------------------------------------- format_reward
def test_format_reward_spec_example():
    completions = [
        assistant(
            "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
            "<answer>(1 + 2) * 4 = 12</answer>"
        ),
        assistant("The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."),
    ]
    assert format_reward(completions=completions, prompts=[[], []]) == [1.0, 0.0]


def test_format_reward_multiline_and_partial():
    assert format_reward(["<think>a\nb</think><answer>\n42\n</answer>"]) == [1.0]
    assert format_reward(["<think>a</think><answer>42</answer> trailing"]) == [0.0]
    assert format_reward(["<answer>42</answer>"]) == [0.0]
    assert format_reward([[]]) == [0.0]


# ----------------------------------------------------------------------------- length_reward
def test_length_reward_formula():
    ids = [[0] * 5, [0] * 10, [0] * 15, [0] * 20, [0] * 100]
    assert length_reward(completion_ids=ids, target_length=10) == [0.0, 0.0, -0.5, -1.0, -1.0]
    partial = functools.partial(length_reward, target_length=4)
    check_picklable(partial, "reward function")
    assert partial(completion_ids=[[1, 2, 3, 4, 5, 6]]) == [-0.5]
    with pytest.raises(ValueError, match="target_length"):
        length_reward(completion_ids=[[1]], target_length=0)


# ----------------------------------------------------------------------------- accuracy_reward
def test_accuracy_boxed_plain_and_wrong():
    completions = [
        assistant("First 2 + 2 = 4, then 4 * 10 + 2 = 42. So the answer is 42"),  # plain
        assistant("Therefore the result is \\boxed{42}."),  # boxed
        assistant("The answer is \\boxed{41}."),  # wrong
        assistant("I am not sure."),  # no answer at all
        assistant("We get $\\frac{1}{2}$"),
        "The answer is 0.5",  # plain string completion
    ]
    solution = ["42", "42", "42", "42", "0.5", "\\frac{1}{2}"]
    assert accuracy_reward(completions=completions, solution=solution) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_accuracy_answer_column_and_unparseable_ground_truth():
    completions = [assistant("\\boxed{7}"), assistant("\\boxed{7}"), assistant("7"), assistant("7")]
    rewards = accuracy_reward(completions=completions, answer=["7", "not a number at all", None, ""])
    assert rewards == [1.0, None, None, None]


def test_accuracy_uses_last_assistant_message():
    completion = [
        {"role": "assistant", "content": "Let me call a tool."},
        {"role": "tool", "content": "result: 41"},
        {"role": "assistant", "content": [{"type": "text", "text": "So the answer is \\boxed{41}"}]},
    ]
    assert accuracy_reward(completions=[completion], solution=["41"]) == [1.0]


def test_accuracy_argument_errors():
    with pytest.raises(ValueError, match="'solution' or 'answer'"):
        accuracy_reward(completions=["1"])
    with pytest.raises(ValueError, match="'answer' has 2 values for 1"):
        accuracy_reward(completions=["1"], answer=["1", "2"])
    with pytest.raises(ValueError, match="verification_timeout_s"):
        accuracy_reward(completions=["1"], answer=["1"], verification_timeout_s=0)


def test_accuracy_timeout_scores_zero_and_is_counted():
    before = verification_timeouts()
    quick = functools.partial(accuracy_reward, verification_timeout_s=1e-6)
    check_picklable(quick, "reward function")
    rewards = quick(completions=[assistant("\\boxed{42}")] * 3, solution=["42"] * 3)
    assert rewards == [0.0, 0.0, 0.0]
    assert verification_timeouts() == before + 3
    # the pool still answers normally afterwards
    assert accuracy_reward(completions=[assistant("\\boxed{42}")], solution=["42"]) == [1.0]


def _stuck_verification(gold_text, answer_text, timeout_s):
    """Stands in for a verification stuck where no signal reaches it (e.g. inside C code)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    threading.Event().wait(120)
    return ("ok", 1.0)


def test_stuck_pool_process_is_killed_and_replaced(monkeypatch):
    before = verification_timeouts()
    monkeypatch.setattr(accuracy_module, "_verify_one", _stuck_verification)
    monkeypatch.setattr(accuracy_module, "_POOL_GRACE_S", 1.0)
    rewards = accuracy_reward(completions=["42", "42"], solution=["42", "42"], verification_timeout_s=0.2)
    assert rewards == [0.0, 0.0]
    assert verification_timeouts() == before + 2
    monkeypatch.undo()
    assert accuracy_reward(completions=["\\boxed{3}"], solution=["3"]) == [1.0]


def _crashing_verification(gold_text, answer_text, timeout_s):
    """Stands in for a pool process that dies (e.g. it cannot import the user's main script)."""
    import os

    os._exit(3)


def test_broken_pool_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(accuracy_module, "_verify_one", _crashing_verification)
    with pytest.raises(RuntimeError, match="failed twice.*__main__"):
        accuracy_reward(completions=["42"], solution=["42"])
    monkeypatch.undo()
    assert accuracy_reward(completions=["\\boxed{3}"], solution=["3"]) == [1.0]


def test_accuracy_from_threads():
    """Reward functions run in threads (SPEC §10.2): verification must work there."""
    results = {}

    def call(i):
        results[i] = accuracy_reward(completions=[f"\\boxed{{{i}}}"], solution=[str(i)])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {i: [1.0] for i in range(4)}


def test_a_call_goes_to_the_pool_in_a_few_tasks(monkeypatch):
    """Issue #41: one pool task per completion cost the rollout worker half its CPU per rollout; a call's
    completions now travel in a quarter of the pool's width of tasks, and come back in order."""
    assert [accuracy_module._tasks_per_call(w, 8) for w in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 8]
    assert accuracy_module._tasks_per_call(8, 1) == 1
    sent = []
    submit = accuracy_module.ProcessPoolExecutor.submit

    def counting_submit(pool, fn, *args):
        sent.append(len(args[1]))
        return submit(pool, fn, *args)

    monkeypatch.setattr(accuracy_module.ProcessPoolExecutor, "submit", counting_submit)
    monkeypatch.setattr(accuracy_module, "_tasks_per_call", lambda workers, jobs: 3)
    completions = [f"The answer is {i}." for i in range(8)]
    assert accuracy_reward(completions=completions, answer=["3"] * 8) == [float(i == 3) for i in range(8)]
    assert sent == [3, 3, 2]
