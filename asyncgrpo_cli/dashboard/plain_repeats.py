"""The finding a plain step line carries, said in full once (SPEC §5; README "What the panels say").

A steady finding is shown on every step line while it holds, and its text names the cause and the fix: 500-700
characters a line. A run's log repeated it on every step (a fresh-user trial of the twenty-sixth session: an
on-policy run of 20 steps printed the same `trainer idle ... fix: staleness.max_staleness=1` explanation 19 times).
`PlainRepeats` gives the full text on the first line of a run of steps that carry one finding, and again whenever
its fix changes; the lines after it carry the finding's first words (with this step's figures) and where it was
given in full: ``trainer idle 41% of the step (in full at step 4; held over steps 2-9)``. A pure state machine, no
I/O: the dashboard feeds it each step's finding in order.
"""

from __future__ import annotations

import re

from .findings import OK, Diagnosis

_HELD = re.compile(r"\s*\((held over [^()]*)\)$")
_OVER = re.compile(r"^((?:in waves )?over (?:steps \d+-\d+|\d+ windows) \([^()]*\)): ")  # `idle.trainer_idle_in_waves`
_FIX = re.compile(r"\bfix: ([^ (;,]+)")


def _key(d: Diagnosis) -> tuple[str, tuple[str, ...]]:
    """What makes a finding the same as the one given in full: its rule and the overrides its fix names."""
    return d.rule, tuple(_FIX.findall(d.text))


class PlainRepeats:
    """Each step's finding as its plain line carries it (module docstring).

    ``text(d, step)`` returns ``d.text`` when ``d`` is ok (a short line that names no cause), new (another rule or
    another fix than the finding last given in full) or neither a held one (``... (held over steps A-B)``) nor an
    idle trainer over the last windows (``over steps A-B (busy X-Y%): ...``, ``in waves over ...``); else the
    finding's words up to its first ``(`` or ``;`` and ``(in full at step N; held over steps A-B)``, or for the
    latter ``over steps A-B (busy X-Y%): <its words> (in full at step N)``."""

    def __init__(self) -> None:
        self._full: tuple[tuple[str, tuple[str, ...]], int] | None = None  # (key, step) of the last full text

    def text(self, d: Diagnosis | None, step: int | None) -> str | None:
        if d is None:
            return None
        held, over = _HELD.search(d.text), _OVER.match(d.text)
        if d.severity == OK or (held is None and over is None) or step is None:
            self._full = None
            return d.text
        key = _key(d)
        if self._full is None or self._full[0] != key:
            self._full = (key, step)
            return d.text
        rest = d.text[over.end():] if over is not None else d.text
        words = re.split(r"[(;]", rest, maxsplit=1)[0].strip().rstrip(":") or d.rule
        if over is not None:
            return f"{over.group(1)}: {words} (in full at step {self._full[1]})"
        return f"{words} (in full at step {self._full[1]}; {held.group(1)})"
