"""`asyncgrpo config --doc`: the composed config as YAML with each field's description as a comment.

Descriptions come from the schema itself: the attribute docstring under each field of the group dataclasses
(`schema.py`, read with the standard library's `ast` from the class source) and, for the ``trainer`` group
(generated from `AsyncGRPOConfig`), each `TrainingArguments` field's ``metadata["help"]``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

COMMENT_WIDTH = 100

from .citations import README_SECTIONS, cite_shipped  # noqa: F401  (re-exported)
from .field_docs import attribute_docstrings, field_docs  # noqa: F401  (re-exported)


def _group_classes() -> dict[str, tuple[type | None, str]]:
    """Group name -> (the dataclass of its fields, the group's description); a group that is a plain value
    (``tools``: a list of import paths) has no dataclass, and its description is ``AppConfig``'s for it."""
    from .schema import AppConfig

    hints = typing.get_type_hints(AppConfig)
    own = attribute_docstrings(AppConfig)
    out: dict[str, tuple[type | None, str]] = {}
    for f in dataclasses.fields(AppConfig):
        tp = hints[f.name]
        if typing.get_origin(tp) is list:  # rewards: a list of RewardFuncConfig
            tp = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp):
            out[f.name] = (tp, inspect.cleandoc(tp.__doc__ or ""))
        else:
            out[f.name] = (None, own.get(f.name, ""))
    return out


def _comment(text: str, indent: str) -> list[str]:
    """``text`` as ``#`` comment lines: each paragraph (blank-line separated) rewrapped as a whole, so a docstring's
    own line breaks never cut a sentence."""
    lines: list[str] = []
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", cite_shipped(text))] or [""]
    for i, para in enumerate(paragraphs):
        if i:
            lines.append("")
        lines += textwrap.wrap(para, COMMENT_WIDTH - len(indent) - 2) or [""]
    return [f"{indent}# {line}".rstrip() for line in lines]


def _yaml_of(key: str, value: Any, indent: str) -> list[str]:
    text = OmegaConf.to_yaml(OmegaConf.create({key: value})).rstrip("\n")
    return [f"{indent}{line}" for line in text.splitlines()]


def documented_yaml(cfg: DictConfig) -> str:
    """The composed config as YAML, each group and field preceded by its description as ``#`` comments
    (still valid YAML: ``asyncgrpo config --doc > my.yaml`` loads back)."""
    from .compose import to_plain

    plain = to_plain(cfg)
    lines: list[str] = []
    for group, (cls, group_doc) in _group_classes().items():
        lines += _comment(f"{group}: {group_doc}" if group_doc else group, "")
        value = plain.get(group)
        if cls is None:  # a plain value (a list of import paths)
            lines += _yaml_of(group, value, "")
            lines.append("")
            continue
        docs = field_docs(cls)
        if isinstance(value, list):  # rewards: document the fields of one entry, then the list
            for name in (f.name for f in dataclasses.fields(cls)):
                if docs.get(name):
                    lines += _comment(f"- {name}: {docs[name]}", "")
            lines += _yaml_of(group, value, "")
        else:
            lines.append(f"{group}:")
            for name, v in (value or {}).items():
                if docs.get(name):
                    lines += _comment(docs[name], "  ")
                lines += _yaml_of(name, v, "  ")
        lines.append("")
    return "\n".join(lines)
