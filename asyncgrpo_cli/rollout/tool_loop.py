"""The multi-turn tool loop of one rollout (SPEC §13.1, §16.5) and the tool metrics it records (SPEC §15.4).

`AsyncRolloutLoop.generate_one` calls `run_tool_loop` when the prompt has tools. The loop goes through the
rollout loop's own hooks (``render_prompt``, ``generate_one_turn``), so a subclass that overrides them
changes every turn here too.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any, Protocol

from .metrics import MetricsWindow
from .tools import ToolBox, ToolResult, parse_assistant_reply, run_tool_call
from .types import Rollout, TurnRecord

__all__ = ["TurnLoop", "record_tool_call", "record_tool_counters", "run_tool_loop", "static_tool_names"]


class TurnLoop(Protocol):
    """What the tool loop uses of its rollout loop (`AsyncRolloutLoop` is one): its hooks, tokenizer, config,
    metrics window and tool settings. A protocol, so this module does not import the loop that calls it."""

    config: Any
    tokenizer: Any
    metrics: MetricsWindow
    tool_executor: Executor | None

    @property
    def tool_call_timeout(self) -> float | None: ...

    def render_prompt(self, prompt: list[dict[str, Any]], tools: list[dict] | None = None,
                      cache: bool = True) -> list[int]: ...

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord: ...


async def run_tool_loop(loop: TurnLoop, prompt: list[dict[str, Any]], toolbox: ToolBox) -> Rollout:
    """One rollout of ``prompt`` with the tools of ``toolbox`` (non-empty), turn after turn.

    Each turn renders the whole conversation (``loop.render_prompt`` with the tool schemas; the first turn
    cached, later ones one-off) and samples one reply (``loop.generate_one_turn``). The reply's tool calls
    run one after the other in emitted order (``loop.tool_executor`` for sync tools, ``loop.tool_call_timeout``
    each), each result appended as a ``tool`` message. The loop ends at a reply without calls, a reply cut
    at ``max_completion_length`` (``finish_reason == "length"``), or a reply that still calls tools after
    ``config.max_tool_calling_iterations`` tool turns (``Rollout.loop_exhausted``; those calls are not run).

    Returns:
        The `Rollout`: the assistant and tool messages, the generated token ids of every turn in order, the
        `TurnRecord` of each turn, and the tool call and failure counts.
    """
    cap = loop.config.max_tool_calling_iterations
    messages = [dict(m) for m in prompt]
    completion: list[dict[str, Any]] = []
    turns: list[TurnRecord] = []
    completion_ids: list[int] = []
    calls = failures = iterations = 0
    exhausted = False
    while True:
        prompt_ids = loop.render_prompt(messages, toolbox.schemas, cache=not turns)  # later turns: one-off
        turn = await loop.generate_one_turn(prompt_ids)
        turns.append(turn)
        completion_ids.extend(turn.output_ids)
        text = loop.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
        reply = parse_assistant_reply(text, loop.tokenizer, toolbox.schemas, prefix=prompt_ids)
        messages.append(reply.message)
        completion.append(reply.message)
        if not reply.calls or turn.finish_reason == "length":
            break
        if cap is not None and iterations >= cap:
            exhausted = True
            break
        iterations += 1
        loop.metrics.add("tools/parallel_calls_mean", len(reply.calls))
        for call in reply.calls:  # sequentially, in the order the model emitted them (SPEC §13.1)
            result = await run_tool_call(call, toolbox, loop.tool_executor, loop.tool_call_timeout)
            record_tool_call(loop.metrics, result)
            calls += 1
            failures += int(result.failed)
            message = {"role": "tool", "content": result.content}
            if result.name is not None:
                message["name"] = result.name
            messages.append(message)
            completion.append(message)
    return Rollout(completion=completion, completion_ids=completion_ids, turns=turns, tool_call_count=calls,
                   tool_failure_count=failures, loop_exhausted=exhausted)


def record_tool_call(metrics: MetricsWindow, result: ToolResult) -> None:
    """Add one tool call to the window: ``tools/failure_frequency``, ``tools/unknown_name_count`` (unknown
    name), and for a tool that ran ``tools/latency_s`` (seconds) and ``tools/<name>/latency_s``,
    ``/call_count``, ``/failure_count`` (SPEC §15.4). A malformed call (no tool ran) adds to the failure frequency only."""
    metrics.add("tools/failure_frequency", float(result.failed))
    if result.unknown:
        metrics.add("tools/unknown_name_count", 1)
        return
    if result.name is None:  # malformed call: no tool ran
        return
    metrics.add("tools/latency_s", result.latency_s)
    metrics.add(f"tools/{result.name}/latency_s", result.latency_s)
    metrics.add(f"tools/{result.name}/call_count", 1)
    metrics.add(f"tools/{result.name}/failure_count", int(result.failed))


def static_tool_names(tools: Any, environment_factory: Any) -> set[str]:
    """The tool names known before any rollout: the standalone tools' and the public methods of every
    environment class of ``environment_factory`` (one class or a dict of them; a factory function's tools are
    known once it made an instance)."""
    from .environments import _public_method_names

    names = {t.__name__ for t in tools or [] if hasattr(t, "__name__")}
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    for factory in factories:
        if isinstance(factory, type):
            names.update(_public_method_names(factory))
    return names


def record_tool_counters(metrics: MetricsWindow, names: Any) -> None:
    """Add 0 to ``tools/unknown_name_count`` and to ``tools/<name>/call_count`` / ``/failure_count`` of every
    tool in ``names``: a window without a call then logs these counters as 0 (SPEC §15.4), not as absent
    (which reads as "not measured"). Sums, so the calls `record_tool_call` adds are unchanged."""
    metrics.add("tools/unknown_name_count", 0)
    for name in sorted(names):
        metrics.add(f"tools/{name}/call_count", 0)
        metrics.add(f"tools/{name}/failure_count", 0)
