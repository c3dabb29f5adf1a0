"""Agent training in the real rollout loop against a scripted vLLM-protocol server (SPEC §13, §15.4–15.5).

The loop runs in-process (its own thread and event loop) with the tiny tokenizer's prefix-preserving tool
template; the server answers every turn with a reply chosen by the test from the prompt it received.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import types

import datasets
import pytest

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.rollout.tools import ToolBox, ToolCall, parse_assistant_reply, run_tool_call
from asyncgrpo_cli.testing.scripted_server import ScriptedServer
from asyncgrpo_cli.testing import make_tiny_tokenizer
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig


# ------------------------------------------------------------------------------------------- tools
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: first factor.
        b: second factor.

    Returns:
        The product.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first term.
        b: second term.

    Returns:
        The sum.
    """
    await asyncio.sleep(0)
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: ignored.

    Returns:
        Nothing: it raises.
    """
    raise RuntimeError("boom")


def hang(x: int) -> int:
    """Sleeps past the tool timeout.

    Args:
        x: ignored.

    Returns:
        x, too late.
    """
    time.sleep(3.0)
    return x


_BARRIER = threading.Barrier(4, timeout=60)
_CALL_LOG: list[tuple[str, int, str, float, float]] = []
_CALL_LOCK = threading.Lock()


def rendezvous(tag: str, index: int) -> str:
    """Waits until four calls (from different rollouts) are running at once, then logs its call.

    Args:
        tag: the rollout's tag.
        index: the call's position in its turn.

    Returns:
        "ok".
    """
    start = time.monotonic()
    if index == 0:
        _BARRIER.wait()  # only passes when four sync tool calls run at the same time
    with _CALL_LOCK:
        _CALL_LOG.append((tag, index, threading.current_thread().name, start, time.monotonic()))
    return "ok"


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def responses(prompt: str) -> int:
    return prompt.count("<tool_response>")


# ------------------------------------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(tool_template=True)


def rows(n=2, **columns):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"compute task {i}"}],
                                        **{k: v[i] if isinstance(v, list) else v for k, v in columns.items()}}
                                       for i in range(n)])


def alternating_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


class Harness:
    """The real loop on a thread, fed by a scripted server; collects outcomes and metric snapshots.

    ``allowance=0`` lets exactly one group run (B.4: the first group may always start; its kept samples are
    never consumed here, so no token allowance is left for a second one): its metrics are then exact."""

    def __init__(self, tokenizer, script, dataset, tools=None, environment_factory=None, reward_funcs=None,
                 allowance=1e12, **config):
        self.server = ScriptedServer(tokenizer, script).start()
        base = dict(output_dir="/tmp/asyncgrpo-test-tools", num_generations=2, max_completion_length=64,
                    num_sampler_logprobs=1, vllm_server_base_url=self.server.url, max_concurrent_rollouts=8,
                    vllm_server_timeout=30.0, report_to="none")
        base.update(config)
        self.buffer, self.metrics_q, self.errors = queue.Queue(), queue.Queue(), queue.Queue()
        self.failed = threading.Event()
        self.loop = AsyncRolloutLoop(
            AsyncGRPOConfig(**base), "scripted", dataset,
            [alternating_reward] if reward_funcs is None else reward_funcs, tokenizer, [tokenizer.eos_token_id],
            self.buffer, types.SimpleNamespace(value=0), types.SimpleNamespace(value=allowance),
            types.SimpleNamespace(value=0.0), self.failed, self.errors, self.metrics_q, tools=tools,
            environment_factory=environment_factory)
        self.loop.freeze_startup_heap = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.loop.run()
        except BaseException:  # noqa: BLE001 - reported through failed/errors
            pass

    def outcomes(self, n, deadline_s=60.0, kind=None):
        got, end = [], time.monotonic() + deadline_s
        while len(got) < n:
            if self.failed.is_set():
                raise AssertionError(self.errors.get(timeout=5))
            assert time.monotonic() < end, f"only {len(got)} outcomes after {deadline_s} s"
            try:
                out = self.buffer.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind is None or out.kind == kind:
                got.append(out)
        return got

    def metrics(self):
        from asyncgrpo_cli.rollout.metrics import MetricsWindow

        window = MetricsWindow()  # a group's metrics are shipped before its outcome is queued
        while True:
            try:
                window.merge(self.metrics_q.get_nowait())
            except queue.Empty:
                return window.flush()

    def close(self):
        self.loop.stop()
        self.thread.join(30)
        self.server.stop()
        assert not self.thread.is_alive()


@pytest.fixture
def harness(tokenizer):
    made = []

    def make(script, dataset=None, **kw):
        h = Harness(tokenizer, script, rows() if dataset is None else dataset, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# ------------------------------------------------------------------------------------------- tests
def multiply_script(prompt):
    if responses(prompt) == 0:
        return "Let me compute.\n" + call("multiply", a=3, b=4)
    return "The answer is 12."


def test_clean_chain_is_one_sample_with_tool_tokens_masked(harness, tokenizer):
    h = harness(multiply_script, tools=[multiply], allowance=0)
    (out,) = h.outcomes(1, kind="kept")
    assert len(out.samples) == 2  # G = 2 rollouts, one sample each
    eos = tokenizer.eos_token_id
    for s in out.samples:
        text = tokenizer.decode(s.input_ids)
        assert text.count("<tool_response>\n12\n</tool_response>") == 1
        trained = tokenizer.decode([t for t, m in zip(s.input_ids, s.trained_mask) if m])
        expected = "Let me compute.\n" + call("multiply", a=3, b=4) + "<|im_end|>The answer is 12.<|im_end|>"
        assert trained == expected  # every generated token, once; tool output and prompts are context
        assert sum(1 for t, m in zip(s.input_ids, s.trained_mask) if m and t == eos) == 2
    # the schema reached the model through the chat template
    first = tokenizer.decode(h.server.prompts[0])
    assert '"name": "multiply"' in first and "<tools>" in first
    m = h.metrics()
    assert m["tools/multiply/call_count"] == 2 and m["tools/multiply/failure_count"] == 0
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.0
    assert m["rollout/fork_frac"] == 0.0 and m["rollout/samples_per_rollout"] == 1.0
    assert m["rollout/turns_mean"] == 2.0 and m["tools/loop_exhausted_frac"] == 0.0
    assert m["tools/parallel_calls_mean"] == 1.0 and m["tools/latency_s"] >= 0.0


def rewritten_script(prompt):
    # key order the template does not reproduce: the re-rendered history differs from the generated tokens
    if responses(prompt) == 0:
        return '<tool_call>\n{"arguments": {"a": 3, "b": 4}, "name": "multiply"}\n</tool_call>'
    if responses(prompt) == 1:
        return '<tool_call>\n{"arguments": {"a": 12, "b": 2}, "name": "multiply"}\n</tool_call>'
    return "Done: 24."


def test_rewritten_history_forks_and_trains_every_token_once(harness, tokenizer):
    h = harness(rewritten_script, tools=[multiply])
    (out,) = h.outcomes(1, kind="kept")
    by_rollout: dict[str, list] = {}
    for s in out.samples:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    assert len(by_rollout) == 2
    for samples in by_rollout.values():
        assert len(samples) == 3  # two forks
        trained = [tokenizer.decode([t for t, m in zip(s.input_ids, s.trained_mask) if m]) for s in samples]
        assert trained == [rewritten_script("")[:] + "<|im_end|>",
                           rewritten_script("<tool_response>") + "<|im_end|>",
                           "Done: 24.<|im_end|>"]
        for s in samples[1:]:  # each fork re-renders its history as context, with the tool results
            assert "<tool_response>" in tokenizer.decode(s.input_ids)
    m = h.metrics()
    assert m["rollout/fork_frac"] == 1.0 and m["rollout/samples_per_rollout"] == 3.0
    assert m["rollout/drift_tokens_mean"] > 0 and m["rollout/drift_tokens_max"] >= m["rollout/drift_tokens_mean"]


def failures_script(prompt):
    n = responses(prompt)
    if n == 0:
        return ("<tool_call>\n{not json}\n</tool_call>\n" + call("nope", x=1) + "\n" + call("explode", x=1) + "\n"
                + call("hang", x=1) + "\n" + call("async_add", a=2, b=5))
    return "I give up."


def test_failures_are_tool_messages_and_counted(harness, tokenizer):
    h = harness(failures_script, tools=[explode, hang, async_add], tool_call_timeout=0.5, allowance=0)
    (out,) = h.outcomes(1, kind="kept")
    text = tokenizer.decode(out.samples[-1].input_ids)  # the malformed call is not re-rendered: a fork
    assert "not valid JSON" in text and "no tool named 'nope'" in text and "explode', 'hang', 'async_add'" not in text
    assert "The tools are: explode, hang, async_add." in text
    assert "raised RuntimeError: boom" in text and "did not finish within 0.5 s" in text
    assert "<tool_response>\n7\n</tool_response>" in text  # the async tool still ran, after the failures
    m = h.metrics()
    assert m["tools/unknown_name_count"] == 2
    assert m["tools/explode/failure_count"] == 2 and m["tools/hang/failure_count"] == 2
    assert m["tools/async_add/call_count"] == 2 and m["tools/async_add/failure_count"] == 0
    assert m["tools/failure_frequency"] == pytest.approx(4 / 5)
    assert m["tools/parallel_calls_mean"] == 5.0


def test_tool_counters_are_zero_in_a_window_without_calls(harness):
    """A window where no rollout called a tool logs the call and failure counters as 0 (a missing key reads
    as "not measured"); the failure frequency stays NaN (no calls to divide by, SPEC §15.2)."""
    h = harness(lambda prompt: "No tool needed: 12.", tools=[multiply, explode], allowance=0)
    h.outcomes(1, kind="kept")
    m = h.metrics()
    assert m["tools/unknown_name_count"] == 0
    for name in ("multiply", "explode"):
        assert m[f"tools/{name}/call_count"] == 0 and m[f"tools/{name}/failure_count"] == 0
    assert m["tools/call_frequency"] == 0.0 and m["tools/failure_frequency"] != m["tools/failure_frequency"]


def always_calls(prompt):
    return call("multiply", a=1, b=responses(prompt))


def test_cap_counts_loop_exhausted(harness):
    h = harness(always_calls, tools=[multiply], max_tool_calling_iterations=2, allowance=0)
    (out,) = h.outcomes(1, kind="kept")
    assert all(len(s.input_ids) > 0 for s in out.samples)
    m = h.metrics()
    assert m["rollout/turns_mean"] == 3.0  # two tool turns, then the third reply still calls: cut
    assert m["tools/loop_exhausted_frac"] == 1.0 and m["tools/multiply/call_count"] == 4


_FIRST_TURNS = iter(range(10**6))


def rendezvous_script(prompt):
    if responses(prompt) == 0:  # one tag per rollout (the server answers on one thread)
        tag = f"r{next(_FIRST_TURNS)}"
        return "\n".join(call("rendezvous", tag=tag, index=i) for i in range(3))
    return "ok"


def test_sync_tools_overlap_across_rollouts_and_stay_ordered_within_a_turn(harness):
    _CALL_LOG.clear()
    # B.4: the first group runs alone, so its G = 4 rollouts are the ones that must meet at the barrier
    h = harness(rendezvous_script, dataset=rows(2), tools=[rendezvous], num_generations=4)
    h.outcomes(2)  # without four sync tools running at once the barrier times out and nothing arrives
    by_tag: dict[str, list] = {}
    for tag, index, thread, start, end in list(_CALL_LOG):
        by_tag.setdefault(tag, []).append((index, start, end))
    assert len(by_tag) >= 8
    for calls in by_tag.values():
        assert [c[0] for c in calls] == list(range(len(calls)))  # emitted order
        for (_, _, end), (_, start, _) in zip(calls, calls[1:]):
            assert start >= end  # sequential within the turn


# ------------------------------------------------------------------------------------------- units
def test_parse_reply_formats(tokenizer):
    schemas = ToolBox([multiply]).schemas
    r = parse_assistant_reply("hi", tokenizer, schemas)
    assert r.calls == [] and r.message == {"role": "assistant", "content": "hi"}
    r = parse_assistant_reply(call("multiply", a=1, b=2) + "\n<tool_call>\n{\"name\": \"x\"", tokenizer, schemas)
    assert [c.name for c in r.calls] == ["multiply", None] and r.message["content"] == ""
    assert "not valid JSON" in r.calls[1].error and len(r.message["tool_calls"]) == 1  # cut-off last call
    r = parse_assistant_reply('<tool_call>{"name": "m", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert r.calls[0].arguments == {"a": 1}
    r = parse_assistant_reply('<tool_call>[1, 2]</tool_call>')
    assert r.calls[0].error and "tool_calls" not in r.message


def test_tool_without_docstring_is_refused():
    from asyncgrpo_cli.rollout.tools import check_tools

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="undocumented.*Google-style"):
        check_tools([undocumented])
    with pytest.raises(TypeError, match="module-level function"):
        check_tools([object()])


def test_bad_arguments_are_a_failure_message():
    box = ToolBox([multiply])
    result = asyncio.run(run_tool_call(ToolCall("multiply", {"a": 1}), box, None, 5.0))
    assert result.failed and "TypeError" in result.content


def test_training_template_is_prefix_preserving_with_thinking_and_tools(tokenizer):
    """B.27: appending an assistant reply (think block, calls) and tool results never changes earlier text,
    with and without enable_thinking=False; Qwen3-style and tool-less ChatML templates are replaced."""
    from asyncgrpo_cli.rollout.chat_templates import TOOLS_CHATML_TEMPLATE, training_chat_template

    schemas = ToolBox([multiply]).schemas
    for kwargs, reply in (({"enable_thinking": False}, "Sure.\n" + call("multiply", a=2, b=3)),
                          ({}, "<think>\nneed a product\n</think>\n\n" + call("multiply", a=2, b=3))):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 times 3?"}]
        for _ in range(2):
            before = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True,
                                                   tokenize=False, **kwargs)
            parsed = parse_assistant_reply(reply, tokenizer, schemas)
            messages += [parsed.message, {"role": "tool", "name": "multiply", "content": "6"}]
            after = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True,
                                                  tokenize=False, **kwargs)
            assert after.startswith(before + reply + "<|im_end|>"), (before, after)
    qwen3_like = "<|im_start|>{% set ns = namespace(last_query_index=0) %}<tool_call>{{ reasoning_content }}"
    assert training_chat_template(types.SimpleNamespace(chat_template=qwen3_like)) == TOOLS_CHATML_TEMPLATE
    smollm2_like = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    assert training_chat_template(types.SimpleNamespace(chat_template=smollm2_like)) == TOOLS_CHATML_TEMPLATE
    assert training_chat_template(types.SimpleNamespace(chat_template=TOOLS_CHATML_TEMPLATE)) is None
    assert training_chat_template(types.SimpleNamespace(chat_template="[INST]{{ tools }}[/INST]")) is None


def test_tokenizer_response_template_is_used_with_the_prompt_as_prefix():
    """A tokenizer with transformers' response parsing is read through ``parse_response`` (its result shape)."""
    seen = {}

    class Parsing:
        response_template = {"fields": "set"}

        def parse_response(self, text, prefix=None, tools=None):
            seen.update(text=text, prefix=prefix, tools=tools)
            return {"role": "assistant", "content": "ok",
                    "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 1, "b": 2}}},
                                   {"type": "function", "function": {"name": "multiply", "arguments": "{bad"}}]}

    schemas = ToolBox([multiply]).schemas
    r = parse_assistant_reply("raw", Parsing(), schemas, prefix=[1, 2, 3])
    assert seen == {"text": "raw", "prefix": [1, 2, 3], "tools": schemas}
    assert [c.name for c in r.calls] == ["multiply", "multiply"] and r.calls[1].error
    assert r.message["tool_calls"] == [r.calls[0].as_message_call()] and r.message["content"] == "ok"
