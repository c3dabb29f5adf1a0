"""Environments: stateful objects that own a rollout's tools, prompt and reward (SPEC §13.2, Appendix B.2, B.25).

- :class:`EnvironmentPool` keeps one instance per in-flight rollout, per environment name: a rollout takes
  a free instance (or builds one with the factory, on the tool thread pool: ``__init__`` may be slow) and
  gives it back when it ends, so instances are reused across episodes with ``reset`` between them.
- :func:`environment_tools` lists an instance's public methods other than ``reset`` / ``get_reward``: the
  tools shown to the model for that rollout.
- :func:`compose_prompt` applies B.2: a string from ``reset`` is appended to the row's last user message,
  or becomes the only user message when the row has no prompt.
- :class:`EnvironmentOwnedPrompts` stands in for ``train_dataset=None``: one empty row, epoch after epoch,
  so every rollout's task comes from ``reset()`` and ``max_steps`` bounds training.
- :func:`check_environment_factory` is the trainer's start-up check.
"""

from __future__ import annotations

import asyncio
import inspect
import types
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from .tools import check_tools

__all__ = ["RESERVED_METHODS", "EnvironmentHookError", "EnvironmentOwnedPrompts", "EnvironmentPool",
           "check_environment_factory", "compose_prompt", "environment_tools", "route_environment"]

#: Lifecycle hooks of an environment, never shown as tools (SPEC §13.2).
RESERVED_METHODS = ("reset", "get_reward")
#: Dataset column that picks the environment of a row with a dict ``environment_factory``; not passed to reset.
ENVIRONMENT_COLUMN = "environment"


class EnvironmentHookError(RuntimeError):
    """An environment's ``reset`` or ``get_reward`` raised: that rollout fails, the worker goes on."""


def _public_method_names(cls: type) -> list[str]:
    names = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        if inspect.isfunction(member):  # plain or async methods defined on the class (not static/class methods)
            names.append(name)
    return names


def environment_tools(env: Any) -> list[Callable[..., Any]]:
    """The bound public methods of ``env`` other than ``reset`` / ``get_reward``: its tools (SPEC §13.2)."""
    return [getattr(env, name) for name in _public_method_names(type(env))]


class EnvironmentOwnedPrompts:
    """The prompt source of ``train_dataset=None``: one row without columns, repeated every epoch.

    Each rollout's task then comes from ``reset()`` (self-sampled or procedural, SPEC §13.2); ``max_steps``
    is the only bound on training.
    """

    column_names: list[str] = []

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index != 0:
            raise IndexError(index)
        return {}


def check_environment_factory(factory: Any) -> None:
    """Start-up check of ``environment_factory`` (SPEC §13.2): a zero-argument callable or a dict of them.

    When a factory is a class, its ``reset`` must exist and every public method must give a tool schema
    (typed arguments, Google-style docstring); a factory function is checked when its first instance is made.

    Raises:
        TypeError: not callable, a dict with a non-callable value or a non-string key, or no ``reset``.
        ValueError: a method cannot be shown as a tool (named, with the fix).
    """
    factories = factory.items() if isinstance(factory, dict) else [(None, factory)]
    if isinstance(factory, dict) and not factory:
        raise TypeError("environment_factory is an empty dict; give at least one name -> environment class")
    for name, fn in factories:
        where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        if name is not None and not isinstance(name, str):
            raise TypeError(f"environment_factory keys must be strings (the dataset's 'environment' values); "
                            f"got {name!r}")
        if not callable(fn):
            raise TypeError(f"{where} is {fn!r}; it must be a zero-argument callable (typically the class)")
        if isinstance(fn, type):
            if not callable(getattr(fn, "reset", None)):
                raise TypeError(f"{where}: {fn.__name__} has no reset(self, **kwargs) method, which every "
                                "environment needs")
            probe = object()  # binds the methods (drops self) without building an environment
            check_tools([types.MethodType(getattr(fn, n), probe) for n in _public_method_names(fn)],
                        f"{where} ({fn.__name__}) methods")


def route_environment(factory: Any, row: dict[str, Any]) -> str | None:
    """The environment name a row selects: None for a single factory, else the row's ``environment`` value.

    Raises:
        ValueError: a dict factory and the row has no ``environment`` column, or names an unknown environment.
    """
    if not isinstance(factory, dict):
        return None
    if ENVIRONMENT_COLUMN not in row:
        raise ValueError(f"environment_factory is a dict ({sorted(factory)}) but the dataset row has no "
                         f"'{ENVIRONMENT_COLUMN}' column to pick one. Fix: add an '{ENVIRONMENT_COLUMN}' column "
                         "naming the environment of each row")
    name = row[ENVIRONMENT_COLUMN]
    if name not in factory:
        raise ValueError(f"the dataset row's '{ENVIRONMENT_COLUMN}' is {name!r}, which is not an environment; the "
                         f"known names are {sorted(factory)}. Fix: use one of them or add it to environment_factory")
    return name


def compose_prompt(row_prompt: list[dict[str, Any]] | None, reset_text: str | None) -> list[dict[str, Any]]:
    """The rollout's prompt from the row's and ``reset()``'s (Appendix B.2).

    Raises:
        ValueError: ``reset`` returned None and the row has no prompt (nothing to generate from), or
            ``reset`` returned something other than a string or None.
    """
    if reset_text is not None and not isinstance(reset_text, str):
        raise ValueError(f"reset() returned {type(reset_text).__name__} {reset_text!r}; it must return a string "
                         "(the prompt) or None (keep the row's prompt)")
    messages = [dict(m) for m in (row_prompt or [])]
    if reset_text is None:
        if not messages:
            raise ValueError("reset() returned None and the row has no 'prompt': the rollout has nothing to answer. "
                             "Fix: return the task from reset(), or give the dataset a 'prompt' column")
        return messages
    for message in reversed(messages):
        if message.get("role") == "user":
            message["content"] = f"{message.get('content') or ''}{reset_text}"
            return messages
    return [*messages, {"role": "user", "content": reset_text}]


class EnvironmentPool:
    """Environment instances of the in-flight rollouts, reused across episodes (SPEC §13.2).

    Args:
        factory: a zero-argument callable, or a dict name -> callable.
        executor: the tool thread pool; factories run there.
    """

    def __init__(self, factory: Any, executor: Executor | None) -> None:
        self.factory = factory
        self.executor = executor
        self._free: dict[str | None, list[Any]] = {}
        self.created = 0

    async def acquire(self, name: str | None) -> Any:
        """A free instance of environment ``name`` (None: the single factory), built when none is free."""
        free = self._free.get(name)
        if free:
            return free.pop()
        fn = self.factory[name] if name is not None else self.factory
        env = await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        self.created += 1
        if not callable(getattr(env, "reset", None)):
            raise TypeError(f"environment_factory{'' if name is None else f'[{name!r}]'} returned "
                            f"{type(env).__name__}, which has no reset(**kwargs) method")
        return env

    def release(self, name: str | None, env: Any) -> None:
        """Give ``env`` back for the next rollout of the same environment."""
        self._free.setdefault(name, []).append(env)
