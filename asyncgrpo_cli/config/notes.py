"""Start-up lines that inform rather than warn (an opt-in's cost, what a setting does).

The start-up checks return warnings and notes in one list of strings; a `Note` among them is printed as
``note:`` by the CLI and written as ``note: ...`` to stderr by the trainer, where a plain ``str`` is printed as
``warning:`` and raised as a ``UserWarning``.
"""

from __future__ import annotations


class Note(str):
    """A start-up line that informs; nothing in the run needs fixing."""


def is_note(line: str) -> bool:
    """Whether a start-up line is a `Note` (else a warning)."""
    return isinstance(line, Note)
