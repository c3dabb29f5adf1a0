"""`config.reward_probe`: each reward function called once before the start (issue #45), in isolation."""

from __future__ import annotations

import functools
import threading

import pytest

from asyncgrpo_cli.config.reward_probe import STAND_IN_COMPLETION, STAND_IN_COMPLETIONS, probe_reward_funcs, stand_in_kwargs
from asyncgrpo_cli.config.rules import ConfigError, ConfigErrors

ROW = {"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5", "level": 1}
seen: list[dict] = []


def recording_reward(completions, prompts, completion_ids, answer, level, **kwargs):
    seen.append({"completions": completions, "prompts": prompts, "ids": completion_ids, "answer": answer,
                 "level": level})
    return [1.0] * len(completions)


def judge(completions, **kwargs):
    raise RuntimeError("charged a cent")


judge.probe_at_start = False


def scaled(completions, scale, **kwargs):
    return [scale] * len(completions)


async def async_none(completions, **kwargs):
    return [None, 0.5]


def key(i):
    return f"reward_funcs[{i}]"


def test_the_call_is_the_workers_call_for_one_completion_of_the_first_row():
    seen.clear()
    assert probe_reward_funcs([recording_reward], ROW, key) == []
    (call,) = seen
    assert call["completions"] == [[{"role": "assistant", "content": text}] for text in STAND_IN_COMPLETIONS]
    assert call["completions"][0] == [{"role": "assistant", "content": STAND_IN_COMPLETION}]
    assert call["prompts"] == [ROW["prompt"]] * 2 and call["answer"] == ["5"] * 2 and call["level"] == [1] * 2
    assert len(call["ids"]) == 2 and all(call["ids"])
    assert stand_in_kwargs({"prompt": "2+3?"})["completions"] == list(STAND_IN_COMPLETIONS)  # a text prompt: text


def test_numbers_none_async_and_partials_pass_and_the_opt_outs_are_not_called():
    assert probe_reward_funcs([functools.partial(scaled, scale=2), async_none], ROW, key) == []
    assert probe_reward_funcs([judge, functools.partial(judge)], ROW, key) == []  # the attribute, through a partial
    assert probe_reward_funcs([functools.partial(scaled, scale="not a number")], ROW, key, skip=[True]) == []


@pytest.mark.parametrize("result,text", [("0.5", "it returned str"), ([1.0, True], "(bool)"), ([float("inf"), 0.0], "finite"),
                                         ([1.0], "1 rewards for 2 completions"), ([[1.0], [1.0]], "(list)")])
def test_anything_but_one_number_or_none_is_refused_with_the_fix(result, text):
    def reward(completions, **kwargs):
        return result

    with pytest.raises(ConfigError) as info:
        probe_reward_funcs([reward], ROW, key, names=["mymod:reward"])
    message = str(info.value)
    assert message.startswith("reward_funcs[0]='mymod:reward': called once before the start") and text in message
    assert "Fix: return a list with one number (or None) per completion" in message and "probe_at_start" in message


def test_every_failing_function_is_reported_with_its_own_error():
    def bad_key(completions, **kwargs):
        return [{"a": 1}["b"]]

    with pytest.raises(ConfigErrors) as info:
        probe_reward_funcs([bad_key, functools.partial(scaled, scale="x"), recording_reward, bad_key], ROW, key)
    keys = [e.key for e in info.value.errors]
    assert keys == ["reward_funcs[0]", "reward_funcs[1]", "reward_funcs[3]"], keys
    assert "it raised KeyError: 'b' (at " in str(info.value.errors[0])


def test_a_call_that_does_not_return_in_time_is_left_unchecked_with_a_warning():
    release = threading.Event()

    def slow_judge(completions, **kwargs):
        release.wait(60)
        return [0.0]

    try:
        warnings = probe_reward_funcs([slow_judge], ROW, key, timeout_s=0.2)
    finally:
        release.set()
    assert len(warnings) == 1 and "had not returned after 0.2 s; it was not checked" in warnings[0], warnings
