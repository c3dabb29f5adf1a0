"""Stop a run that cannot learn: too many consecutive groups without a learning signal (issue #19).

A group carries no signal when it is dropped (SPEC §3.2): every scored completion got the same total
reward, or fewer than two were scored at all (rewards None / NaN); or when its rewards spread but none of its
completions is trained (with ``mask_truncated_completions`` every one was cut at ``max_completion_length``).
A reward that never spreads inside a group leaves the trainer waiting forever while the worker cycles the
dataset. `NoSignalWatch` counts
consecutive such groups and, at ``limit``, returns a diagnosis naming each reward function, what it
returned lately and what to check. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..config.citations import cite_shipped

LIMIT_KEY = "rollout.max_groups_without_signal"
MASK_KEY = "loss.mask_truncated_completions"
LENGTH_KEY = "rollout.max_completion_length"


class NoLearningSignalError(RuntimeError):
    """No group of the last ``limit`` had reward spread: the run would train nothing. The message is the
    diagnosis (reward functions, their last values, what to check); it reaches the user without a traceback."""

    report_without_traceback = True


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


@dataclass
class _FunctionStats:
    none: int = 0
    scored: int = 0
    values: set = field(default_factory=set)
    last: list = field(default_factory=list)


@dataclass
class NoSignalWatch:
    """Counts consecutive groups without a learning signal.

    Args:
        limit: consecutive signal-less groups that end the run (0 = never).

    Groups where fewer than two completions got any reward (all None / NaN) are unambiguous, a reward that
    cannot score anything: ``unscored_limit`` (``min(limit, max(4, limit // 4))``, 16 for the default 64)
    consecutive ones end the run sooner.
    """

    limit: int
    consecutive: int = 0
    unscored: int = 0  # of the consecutive groups: those with fewer than two scored completions
    unscored_run: int = 0  # consecutive unscored groups
    untrained: int = 0  # of the consecutive groups: kept, but every completion masked as truncated
    all_cut: int = 0  # of the consecutive groups: every completion cut and masked (kept or dropped)
    fired: str | None = None  # the diagnosis once given: the run stops, later groups change nothing
    _stats: dict[str, _FunctionStats] = field(default_factory=dict)

    @property
    def unscored_limit(self) -> int:
        return min(self.limit, max(4, self.limit // 4)) if self.limit > 0 else 0

    def observe(self, has_signal: bool, num_scored: int, per_function: Mapping[str, Sequence[float | None]],
                num_trained: int | None = None) -> str | None:
        """Account one scored group.

        Args:
            has_signal: the group was kept (its rewards spread).
            num_scored: completions with a total reward (not None / NaN).
            per_function: reward function name → its G values for this group.
            num_trained: the completions that would be trained (``None``: all; with ``mask_truncated_completions``
                those ending with EOS). A kept group with none carries no signal either; groups with none,
                kept or dropped, are counted so the diagnosis can name truncation as the cause.

        Returns:
            None, or the diagnosis when this group makes ``limit`` consecutive groups without signal. Once
            given, every later call returns the same diagnosis and counts nothing (another scorer may finish a
            group before the stop reaches it).
        """
        if self.fired is not None:
            return self.fired
        untrained = has_signal and num_trained is not None and num_trained <= 0
        if has_signal and not untrained:
            self.consecutive, self.unscored, self.unscored_run, self.untrained, self.all_cut = 0, 0, 0, 0, 0
            self._stats.clear()
            return None
        self.consecutive += 1
        self.untrained += int(untrained)
        self.all_cut += int(num_trained is not None and num_trained <= 0)
        self.unscored += int(num_scored < 2)
        self.unscored_run = self.unscored_run + 1 if num_scored < 2 else 0
        for name, values in ({} if untrained else per_function).items():  # their rewards spread: not the cause
            st = self._stats.setdefault(name, _FunctionStats())
            for v in values:
                if _missing(v):
                    st.none += 1
                else:
                    st.scored += 1
                    if len(st.values) < 8:
                        st.values.add(round(float(v), 6))
            st.last = list(values)
        if self.limit <= 0 or (self.consecutive < self.limit and self.unscored_run < self.unscored_limit):
            return None
        self.fired = self.diagnosis()
        return self.fired

    def diagnosis(self) -> str:
        """What the last consecutive groups looked like and what to check."""
        n = self.consecutive
        same = n - self.unscored - self.untrained
        kept = f", {self.untrained} kept with nothing to train" if self.untrained else ""
        cut = (f"; every completion of {self.all_cut} of them was cut at {LENGTH_KEY}, which {MASK_KEY}=true "
               "does not train" if self.all_cut else "")
        lines = [f"no learning signal: the last {n} groups were all dropped ({same} with every "
                 f"completion scored the same, {self.unscored} with fewer than two completions scored at all{kept})"
                 f"{cut}, so the trainer has nothing to train on (SPEC §3.2)"]
        if same + self.unscored:
            lines.append("The reward functions returned:")
        checks = []
        if self.all_cut:
            checks.append(f"no completion ends with EOS within {LENGTH_KEY}, and {MASK_KEY}=true trains only those "
                          f"that do: raise {LENGTH_KEY} or set {MASK_KEY}=false")
        for name, st in self._stats.items():
            total = st.none + st.scored
            shown = ", ".join("None" if _missing(v) else f"{float(v):g}" for v in st.last)
            if st.scored == 0:
                what = f"None/NaN for all {total} completions"
                checks.append(f"{name} returns None for every completion: it usually cannot find its ground truth "
                              "(check that the dataset column it reads exists and is filled, e.g. 'answer' or "
                              "'solution') or it does not recognise the completions' format")
            elif len(st.values) == 1:
                what = f"always {next(iter(st.values)):g} ({st.none} None)"
                checks.append(f"{name} always gives {next(iter(st.values)):g}: the task may be too hard or too easy "
                              "for this model (read a few completions with logging.log_completions=true), or the "
                              "reward ignores the completion")
            else:
                what = f"values {sorted(st.values)[:6]} but never different within one group"
            lines.append(f"  - {name}: {what}; last group: [{shown}]")
        if not self._stats and same + self.unscored:
            lines.append("  - (no reward function: only rollout/environment rewards, none of which spread)")
        lines.append("Check: " + ("; ".join(checks) if checks else "the rewards should differ between the "
                                  "completions of one prompt (raise rollout.temperature, or rollout.num_generations)"))
        fix = (f"raise {LENGTH_KEY} or set {MASK_KEY}=false" if self.all_cut == n
               else "correct the reward or the data")
        lines.append(f"Fix: {fix}, or raise {LIMIT_KEY} (0 never stops)")
        return cite_shipped("\n".join(lines))
