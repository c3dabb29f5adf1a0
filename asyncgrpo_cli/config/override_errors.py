"""User-facing messages for the two override mistakes OmegaConf reports in its own terms: a value of the
wrong type (``field X: value V is not <type>. Fix: ...``) and an unknown key (the nearest real keys by
their full dotted path, with difflib).

The schema (`schema.AppConfig` and its group dataclasses) is the only source: the expected type, the
default shown as an example, and the list of real keys all come from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from typing import Any

from ..run.redact import HIDDEN, is_secret_name

_MISSING = object()


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a generated class: its fields carry real types already
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type without Optional, whether None is allowed)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


def _dataclass_of(tp: Any) -> type | None:
    tp, _ = _unwrap(tp)
    if typing.get_origin(tp) is list:  # rewards: a list of RewardFuncConfig
        tp = typing.get_args(tp)[0]
    return tp if dataclasses.is_dataclass(tp) else None


def field_at(path: str) -> tuple[Any, Any] | None:
    """(type annotation, default) of the schema field at the dotted ``path`` (``rollout.temperature``);
    None when no such field exists. The default is ``_MISSING`` when it is made by a factory."""
    from .schema import AppConfig

    cls: type | None = AppConfig
    parts = [p for p in path.split(".") if not p.isdigit()]  # rewards.0.func -> rewards.func
    for i, part in enumerate(parts):
        if cls is None:
            return None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return None
        f = fields[part]
        tp = _hints(cls).get(part, f.type)
        if i == len(parts) - 1:
            return tp, (f.default if f.default is not dataclasses.MISSING else _MISSING)
        cls = _dataclass_of(tp)
    return None


def all_keys() -> list[str]:
    """Every dotted key of the schema (groups and their fields, e.g. ``rollout`` and ``rollout.top_k``)."""
    from .schema import AppConfig

    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            out.append(key)
            sub = _dataclass_of(_hints(cls).get(f.name, f.type))
            if sub is not None:
                walk(sub, key + ".")

    walk(AppConfig, "")
    return out


def describe_type(tp: Any) -> str:
    """``an integer``, ``a number``, ``true or false``, ``one of vllm, embedded, external``, ...; with
    ``(or null)`` when None is allowed."""
    tp, optional = _unwrap(tp)
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        text = "one of " + ", ".join(str(m.value) for m in tp)
    elif tp is bool:
        text = "true or false"
    elif tp is int:
        text = "an integer"
    elif tp is float:
        text = "a number"
    elif tp is str:
        text = "a string"
    elif origin is list or tp is list:
        text = "a list, e.g. [a, b]"
    elif origin is dict or tp is dict:
        text = "a mapping, e.g. {a: 1}"
    else:
        text = f"a {getattr(tp, '__name__', str(tp))}"
    return text + (" (or null)" if optional else "")


EXAMPLES: dict[str, str] = {
    "launch.stop_timeout": "300", "sampler.gpu_memory_utilization": "0.9", "sampler.max_model_len": "4096",
    "sampler.max_logprobs": "8", "sampler.kv_cache_tokens": "65536", "sampler.weight_transfer_port": "29600",
    "launch.main_process_port": "29500", "packing.token_budget": "4096", "rollout.min_p": "0.05",
    "rollout.max_tool_calling_iterations": "10", "rollout.tool_call_timeout": "300", "loss.epsilon_high": "0.28",
    "model.router_aux_loss_coef": "0.001", "logging.num_completions_to_print": "4", "data.eval_seed": "1",
    "rollout.reward_weights": "[1.0]",
}
"""Example values of the keys whose default is null (a placeholder like 0.5 means nothing for seconds or ports)."""


def _example(key: str, tp: Any, default: Any, current: Any = _MISSING) -> str:
    tp, optional = _unwrap(tp)
    if key in EXAMPLES and (current is _MISSING or current is None) and default in (None, _MISSING):
        return f"{key}={EXAMPLES[key]}" + (f" or {key}=null (its default)" if optional and default is None else "")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " or ".join(f"{key}={m.value}" for m in tp)
    if tp is bool:
        return f"{key}=true or {key}=false"
    if current is not _MISSING and default is not _MISSING and current == default:
        current = _MISSING  # said as "its default"
    for value, source in ((current, "its value without this override"), (default, "its default")):
        if value is not _MISSING and value is not None:
            shown = value.value if isinstance(value, enum.Enum) else value
            shown = str(shown).lower() if isinstance(shown, bool) else shown
            return f"{key}={shown} ({source})"
    if typing.get_origin(tp) is list or tp is list:
        item = (typing.get_args(tp) or (str,))[0]
        return f"{key}=[0,1]" if item is int else f"{key}=[a,b]"
    placeholder = {int: "8", float: "0.5", str: "text"}.get(tp, "VALUE")
    return f"{key}={placeholder}"


def type_error_message(full_key: str, value: Any, current: Any = _MISSING) -> str | None:
    """``field X: value V is not <type>. Fix: X=...`` for a value OmegaConf could not convert to the
    field's type; None when ``full_key`` is not a schema field (the caller keeps OmegaConf's text).
    ``current``: the key's value in the config composed without the bad override (a recipe's value), shown as
    the example in place of the schema default when given."""
    import re

    item = re.fullmatch(r"(.+)\[(\d+)\]", full_key)  # one entry of a list: rollout.reward_weights[0]
    if item is not None:
        found = field_at(item.group(1))
        if found is None:
            return None
        tp, default = found
        inner, _ = _unwrap(tp)
        args = typing.get_args(inner) if typing.get_origin(inner) is list else ()
        if not args:
            return None
        base = item.group(1)
        shown = f"'{value}'" if isinstance(value, str) else str(value)
        example = _example(base, tp, default, current)
        return (f"field {base}: item {item.group(2)} ({shown}) is not {describe_type(args[0])}; {base} is a list of "
                f"them. Fix: {example} (`asyncgrpo config --doc` describes every key)")
    found = field_at(full_key)
    if found is None:
        return None
    tp, default = found
    shown = f"'{value}'" if isinstance(value, str) else "null" if value is None else str(value)
    example = _example(full_key, tp, default, current)
    inner, _ = _unwrap(tp)  # an enum's or a bool's values are the description already
    plain = not (inner is bool or (isinstance(inner, type) and issubclass(inner, enum.Enum)))
    about = field_summary(full_key) if plain else None
    return (f"field {full_key}: value {shown} is not {describe_type(tp)}{f' ({about})' if about else ''}. "
            f"Fix: {example} (`asyncgrpo config --doc` describes every key)")


def field_summary(full_key: str, limit: int = 160) -> str | None:
    """The first sentence of the description `asyncgrpo config --doc` gives ``full_key`` (``Top-k filter; 0 disables
    it``), without its full stop; None when there is none or it is longer than ``limit`` characters (a fix such as
    ``rollout.top_k=0`` says nothing about what 0 means without it: a trial)."""
    from .field_docs import field_docs
    from .schema import AppConfig

    *groups, name = [p for p in full_key.split(".") if not p.isdigit()]
    try:
        cls: type | None = AppConfig
        for group in groups:
            cls = _dataclass_of(_hints(cls).get(group)) if cls is not None else None
        doc = field_docs(cls).get(name, "") if cls is not None and groups else ""
    except Exception:  # noqa: BLE001 - a description is an extra
        return None
    first = re.split(r"(?<=[.!?])\s", " ".join(doc.split()), maxsplit=1)[0].rstrip(".") if doc else ""
    return first if first and len(first) <= limit else None


def unknown_key_message(user_key: str, value: str | None = None) -> str:
    """An unknown ``user_key`` (a full dotted key such as ``rollouts.x``): the nearest real keys by full
    path; when its group is misspelt, the same key under the nearest group (``rollout.x``) if that
    exists, else that group itself. ``value``: the value the override gave it, named after the key."""
    keys = all_keys()
    real = set(keys)
    parts = user_key.split(".")
    valid = 0
    while valid < len(parts) and ".".join(parts[: valid + 1]) in real:
        valid += 1
    if valid == len(parts):
        return f"key {user_key!r} could not be set. Fix: check it against `asyncgrpo config --doc`"
    prefix = ".".join(parts[:valid])
    level = [k for k in keys if k.count(".") == valid and (not prefix or k.startswith(prefix + "."))]
    names = [k.rsplit(".", 1)[-1] for k in level]
    suggestions: list[str] = []
    for name in difflib.get_close_matches(parts[valid], names, n=3, cutoff=0.75):
        node = ".".join([*parts[:valid], name])
        fixed = ".".join([node, *parts[valid + 1:]])
        suggestions.append(fixed if fixed in real else node)
    depth = user_key.count(".")
    for key in difflib.get_close_matches(user_key, [k for k in keys if k.count(".") == depth], n=3, cutoff=0.8):
        if key not in suggestions:
            suggestions.append(key)
    where = f"the {prefix} group has no field {parts[valid]!r}" if prefix else f"there is no group {parts[0]!r}"
    if suggestions:
        fix = "did you mean " + " or ".join(suggestions[:3]) + "?"
        if all(s.count(".") < user_key.count(".") for s in suggestions):  # only a group matched
            fix += f" (`asyncgrpo config --doc` lists the keys of {suggestions[0]})"
    elif prefix:
        fix = f"`asyncgrpo config --doc` lists every key of the {prefix} group"
    else:
        groups = [k for k in keys if "." not in k]
        fix = f"the groups are {', '.join(groups)}"
    if value is not None and any(is_secret_name(k.rsplit(".", 1)[-1]) for k in (user_key, *suggestions)):
        value = HIDDEN  # a (mistyped) token key must not print the token
    given = f" (given {value!r})" if value is not None else ""
    return f"unknown key {user_key!r}{given}: {where}. Fix: {fix}"


def added_unknown_keys(cfg: Any) -> list[str]:
    """Dotted keys of the composed ``cfg`` that are no schema field: what ``+group.key=V`` (or a recipe) added
    next to the real keys. The free-form mappings (``data.task_kwargs``, ``sampler.env``, ...) and the
    entries of a list group (``rewards``) are not looked into beyond their own fields."""
    from omegaconf import DictConfig, ListConfig

    from .schema import AppConfig

    out: list[str] = []

    def walk(node: Any, cls: type, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = _hints(cls)
        for key in node.keys():
            path = f"{prefix}{key}"
            if key not in fields:
                out.append(path)
                continue
            sub = _dataclass_of(hints.get(key, fields[key].type))
            child = node._get_node(key)
            if sub is None or child is None or child._is_none() or child._is_missing():
                continue
            if isinstance(child, DictConfig):
                walk(child, sub, path + ".")
            elif isinstance(child, ListConfig):
                for i, item in enumerate(child):
                    if isinstance(item, DictConfig):
                        walk(item, sub, f"{path}.{i}.")

    walk(cfg, AppConfig, "")
    return out
