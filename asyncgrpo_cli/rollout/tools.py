"""Tools shown to the model and run by the rollout worker (SPEC §13.1, §15.4).

- :class:`ToolBox` holds the tools of one rollout by ``__name__`` with their JSON schemas, built by
  ``transformers.utils.get_json_schema`` from the type hints and the Google-style docstring (schemas
  are cached per function, so per-rollout tool boxes of environment methods cost a dict lookup).
- :func:`parse_assistant_reply` splits a generated reply into the assistant message (``content``,
  ``reasoning_content`` where the chat template renders it) and its tool calls. A tokenizer that carries
  a ``response_schema`` is parsed by transformers' ``parse_response``; otherwise the Qwen3/Hermes format
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` is read.
- :func:`run_tool_call` runs one call: a sync tool on the worker's tool thread pool, an async one on the
  event loop, both under ``tool_call_timeout``. Failures are data: an unknown name, malformed call JSON,
  a tool that raises or hangs each become a ``tool`` message the model reads, flagged as failed.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedReply", "ToolBox", "ToolCall", "ToolResult", "check_tools", "parse_assistant_reply",
           "run_tool_call", "tool_schema"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_SCHEMAS: dict[Any, dict] = {}


def _schema_key(func: Callable[..., Any]) -> Any:
    if isinstance(func, types.MethodType):  # an environment method: one schema per class and name
        return (type(func.__self__), func.__func__)
    return func


def tool_schema(func: Callable[..., Any]) -> dict:
    """The JSON schema of one tool (``{"type": "function", "function": {...}}``), cached.

    Raises:
        ValueError: the tool has no type hints or no Google-style docstring describing every argument
            (transformers' message, with the tool's name and the fix).
    """
    key = _schema_key(func)
    schema = _SCHEMAS.get(key)
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(func)
        except Exception as exc:  # DocstringParsingException, TypeHintParsingException
            name = getattr(func, "__name__", repr(func))
            raise ValueError(f"tool {name!r} cannot be shown to the model: {exc}. Fix: give every argument and the "
                             "return value a type hint and write a Google-style docstring with an 'Args:' entry "
                             "per argument (SPEC §13.1)") from exc
        _SCHEMAS[key] = schema
    return schema


def check_tools(tools: Sequence[Callable[..., Any]] | None, what: str = "tools") -> None:
    """Start-up check of ``tools`` (SPEC §13.1): callables with a ``__name__``, a schema, unique names.

    Raises:
        TypeError: an entry is not callable or has no ``__name__`` (a partial or an instance).
        ValueError: no schema can be built (see `tool_schema`), or two tools share a name.
    """
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        if not callable(tool) or not isinstance(getattr(tool, "__name__", None), str):
            raise TypeError(f"{what}[{i}] is {tool!r}: a tool must be a module-level function (the model calls it "
                            "by its __name__, SPEC §13.1)")
        if tool.__name__ in seen:
            raise ValueError(f"{what}: two tools are named {tool.__name__!r}; the model calls tools by name, so "
                             "names must be unique")
        seen.add(tool.__name__)
        tool_schema(tool)


class ToolBox:
    """The tools of one rollout, by name, with their schemas in the order given.

    Args:
        tools: functions or bound methods (environment tools); each is registered under ``__name__``.

    Raises:
        ValueError: two tools share a name (e.g. a standalone tool and an environment method).
    """

    def __init__(self, tools: Sequence[Callable[..., Any]] = ()) -> None:
        self.by_name: dict[str, Callable[..., Any]] = {}
        for tool in tools:
            name = tool.__name__
            if name in self.by_name:
                raise ValueError(f"two tools of this rollout are named {name!r} (a standalone tool and an environment "
                                 "method, or two methods); rename one: the model calls tools by name")
            self.by_name[name] = tool
        self.schemas = [tool_schema(t) for t in self.by_name.values()]

    def __bool__(self) -> bool:
        return bool(self.by_name)

    @property
    def names(self) -> list[str]:
        """Tool names in order."""
        return list(self.by_name)


@dataclass
class ToolCall:
    """One call parsed from a reply: ``name`` and ``arguments``, or ``error`` when it could not be read."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (transformers' chat format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    """A reply split for the conversation: the assistant message and the calls in emitted order."""

    message: dict[str, Any]
    calls: list[ToolCall]


def _read_call(body: str) -> ToolCall:
    body = body.strip()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(None, error='the tool call must be a JSON object with a string "name"')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(data["name"], error='"arguments" is a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], error='"arguments" must be a JSON object of argument names to values')
    return ToolCall(data["name"], arguments)


def _split_reasoning(text: str) -> tuple[str | None, str]:
    head, sep, tail = text.partition("</think>")
    if not sep:
        return None, text
    return head.replace("<think>", "", 1).strip("\n"), tail.lstrip("\n")


def parse_assistant_reply(text: str, tokenizer: Any = None, schemas: list[dict] | None = None,
                          prefix: list[int] | str | None = None) -> ParsedReply:
    """Split one generated reply into an assistant message and its tool calls (SPEC §13.1).

    With a tokenizer carrying a ``response_template``, transformers' ``parse_response`` reads the reply with
    the turn's prompt as ``prefix`` (a reply it cannot parse yields one malformed call). Otherwise the Qwen3/Hermes format is read: every
    ``<tool_call>{json}</tool_call>`` block (an unclosed last block counts) is one call; ``content`` is the
    text before the first block, one trailing newline removed (the template writes it back between content
    and the first call). When the chat template renders ``reasoning_content``, a ``<think>...</think>``
    head becomes the message's ``reasoning_content``.

    Args:
        text: the decoded reply (special tokens skipped).
        tokenizer: the worker's tokenizer, or None.
        schemas: the rollout's tool schemas (``parse_response`` casts arguments with them).
        prefix: the turn's prompt (token ids or text), which ``parse_response`` needs; None = ``""``.

    Returns:
        A `ParsedReply`; malformed calls carry ``error`` and are not in the message's ``tool_calls``.
    """
    if tokenizer is not None and getattr(tokenizer, "response_template", None):
        try:
            parsed = tokenizer.parse_response(text, prefix=prefix if prefix is not None else "", tools=schemas or None)
        except Exception as exc:  # noqa: BLE001 - a reply the schema cannot read is the policy's error
            return ParsedReply({"role": "assistant", "content": text},
                               [ToolCall(None, error=f"the reply could not be parsed ({type(exc).__name__}: {exc})")]
                               if "<tool_call>" in text or "tool" in text.lower() else [])
        message = {"role": "assistant", **{k: v for k, v in dict(parsed).items() if k != "role"}}
        calls = []
        for raw in message.get("tool_calls") or []:
            fn = raw.get("function", raw) if isinstance(raw, dict) else {}
            args = fn.get("arguments", {})
            if isinstance(args, str):
                calls.append(_read_call(json.dumps({"name": fn.get("name"), "arguments": args})))
            else:
                ok = isinstance(fn.get("name"), str) and isinstance(args, dict)
                calls.append(ToolCall(fn.get("name"), args) if ok else
                             ToolCall(None, error="the tool call has no name or its arguments are not an object"))
        message["tool_calls"] = [c.as_message_call() for c in calls if c.error is None] or None
        if message["tool_calls"] is None:
            message.pop("tool_calls")
        message.setdefault("content", "")
        return ParsedReply(message, calls)
    reasoning = None
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str) and "reasoning_content" in template:
        reasoning, text = _split_reasoning(text)
    start = text.find("<tool_call>")
    message: dict[str, Any] = {"role": "assistant"}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if start < 0:
        message["content"] = text
        return ParsedReply(message, [])
    content = text[:start]
    message["content"] = content[:-1] if content.endswith("\n") else content
    calls = [_read_call(body) for body in _TOOL_CALL.findall(text, start)]
    good = [c.as_message_call() for c in calls if c.error is None]
    if good:
        message["tool_calls"] = good
    return ParsedReply(message, calls)


@dataclass
class ToolResult:
    """What one call gave: the ``tool`` message content, and how it went (for §15.4's metrics)."""

    name: str | None
    content: str
    failed: bool = False
    unknown: bool = False
    latency_s: float = 0.0


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def is_async_tool(func: Callable[..., Any]) -> bool:
    """True for ``async def`` functions and methods."""
    return inspect.iscoroutinefunction(func)


async def run_tool_call(call: ToolCall, toolbox: ToolBox, executor: Executor | None,
                        timeout_s: float | None) -> ToolResult:
    """Run one parsed call and return the ``tool`` message content; never raises for the tool's own errors.

    Sync tools run on ``executor`` (the worker's tool thread pool, size ``max_concurrent_rollouts``), async
    tools are awaited on the running loop; both are given ``timeout_s`` seconds (None = no limit). A sync tool
    past its timeout keeps its thread until it returns (Python cannot stop a thread); the rollout goes on.

    Returns:
        A `ToolResult`: the tool's return value as text (JSON for non-strings), or an ``Error: ...`` text
        the model reads for an unknown name (``unknown``), malformed call JSON, bad arguments, an exception
        or a timeout (``failed``); ``latency_s`` is the tool's execution time in seconds (0 when it never ran).
    """
    if call.error is not None:
        return ToolResult(call.name, f"Error: {call.error}. Call a tool as <tool_call>{{\"name\": \"<tool name>\", "
                                     f"\"arguments\": {{...}}}}</tool_call>.", failed=True)
    tool = toolbox.by_name.get(call.name)
    if tool is None:
        known = ", ".join(toolbox.names) or "none"
        return ToolResult(call.name, f"Error: there is no tool named {call.name!r}. The tools are: {known}.",
                          failed=True, unknown=True)
    start = time.monotonic()
    try:
        if is_async_tool(tool):
            value = await asyncio.wait_for(tool(**call.arguments), timeout_s)
        else:
            future = asyncio.get_running_loop().run_in_executor(executor, functools.partial(tool, **call.arguments))
            value = await asyncio.wait_for(future, timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        return ToolResult(call.name, f"Error: tool {call.name!r} did not finish within {timeout_s:g} s.", failed=True,
                          latency_s=time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - the model reads the failure
        return ToolResult(call.name, f"Error: tool {call.name!r} raised {type(exc).__name__}: {exc}", failed=True,
                          latency_s=time.monotonic() - start)
    return ToolResult(call.name, _as_text(value), latency_s=time.monotonic() - start)
