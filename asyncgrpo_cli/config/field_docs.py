"""Descriptions of the config's fields, read from the schema's source (attribute docstrings) or from the
`TrainingArguments` help of the same name: what `asyncgrpo config --doc` and the error messages print. Below the
modules that use them (`docs`, `override_errors`), importing nothing of the package at module level."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

__all__ = ["attribute_docstrings", "field_docs"]


@functools.lru_cache(maxsize=None)
def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in ``cls``'s body (``x: int = 0`` then ``\"\"\"...\"\"\"``).

    Returns {} when the source cannot be read (e.g. a class made with ``make_dataclass``).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> description for a schema dataclass: attribute docstrings, else ``metadata["help"]``
    of the same-named `AsyncGRPOConfig` field (the generated ``trainer`` group)."""
    docs = dict(attribute_docstrings(cls))
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
    if missing:
        from .grpo_config import AsyncGRPOConfig

        helps: dict[str, str] = {}
        for base in AsyncGRPOConfig.__mro__:  # a field redefined without help keeps TrainingArguments' help
            if dataclasses.is_dataclass(base):
                for f in dataclasses.fields(base):
                    if not helps.get(f.name):
                        helps[f.name] = f.metadata.get("help", "")
        for name in missing:
            if helps.get(name):
                docs[name] = " ".join(str(helps[name]).split())
    return docs
