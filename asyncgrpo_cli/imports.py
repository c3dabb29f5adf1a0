"""Objects named by import path in configs: ``module:attr`` or ``module.attr``."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from .config.rules import ConfigError


def import_object(path: str, key: str = "import path") -> Any:
    """The object at ``path`` (``package.module:name`` or ``package.module.name``).

    Raises:
        ConfigError: the module cannot be imported or has no such attribute (names ``key`` and the path).
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{key}={path!r}: not an import path. Fix: write it as package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}={path!r}: cannot import {module_name!r} ({exc}). Fix: install it or correct "
                          "the path") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}={path!r}: {module_name!r} has no attribute {attr!r}. Fix: correct the name")
        obj = getattr(obj, part)
    return obj


def reward_functions(specs: list[Any]) -> list[Any]:
    """Reward callables from the ``rewards`` group: each ``{func, kwargs}`` (kwargs bound with functools.partial)."""
    funcs = []
    for i, spec in enumerate(specs):
        func = import_object(str(spec["func"]), f"rewards[{i}].func")
        if not callable(func):
            raise ConfigError(f"rewards[{i}].func={spec['func']!r} is not callable. Fix: name a function")
        kwargs = spec.get("kwargs") or {}
        if hasattr(kwargs, "_metadata"):  # an OmegaConf node: plain containers, or the partial cannot be pickled
            from omegaconf import OmegaConf

            kwargs = OmegaConf.to_container(kwargs, resolve=True)
        kwargs = dict(kwargs)
        funcs.append(functools.partial(func, **kwargs) if kwargs else func)
    return funcs
