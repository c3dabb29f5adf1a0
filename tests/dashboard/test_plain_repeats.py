"""`PlainRepeats`: a plain step line carries a held finding in full once, then by its words (twenty-sixth session's
fresh-user trial: 600-700 characters a line, the same explanation on every step)."""

from __future__ import annotations

import json
import time

from rich.console import Console

from asyncgrpo_cli.dashboard import Dashboard
from asyncgrpo_cli.dashboard.findings import INFO, OK, WARN, Diagnosis, RunSettings
from asyncgrpo_cli.dashboard.plain_repeats import PlainRepeats

IDLE = ("trainer idle {pct}% of the step (waits {w} s for samples; generation 12.7 rollouts/s): on-policy training "
        "(staleness.max_staleness=0) generates each step's samples after the last weight sync, so training and "
        "generation take turns by design; fix: staleness.max_staleness={fix} to overlap them (one version of lag) "
        "(held over steps {a}-{b})")


def idle(pct, w, b, fix=1, a=2):
    return Diagnosis("trainer_idle_on_policy", IDLE.format(pct=pct, w=w, a=a, b=b, fix=fix), WARN)


def test_a_held_finding_is_said_in_full_once_then_by_its_words():
    r = PlainRepeats()
    assert r.text(idle(38, 2.09, 4), 4) == idle(38, 2.09, 4).text
    assert r.text(idle(41, 1.81, 5), 5) == "trainer idle 41% of the step (in full at step 4; held over steps 2-5)"
    assert r.text(idle(42, 2.33, 6), 6) == "trainer idle 42% of the step (in full at step 4; held over steps 2-6)"
    # another fix is a new finding: in full again, and the words after it point there
    assert r.text(idle(42, 2.3, 7, fix=2), 7) == idle(42, 2.3, 7, fix=2).text
    assert r.text(idle(40, 2.2, 8, fix=2), 8).endswith("(in full at step 7; held over steps 2-8)")


def test_other_rules_ok_lines_and_findings_not_held_come_in_full():
    r = PlainRepeats()
    r.text(idle(38, 2.09, 4), 4)
    bound = Diagnosis("trainer_bound", "trainer-bound: generation waits 3.00 s for the staleness limit (expected "
                                       "when inference is faster than training) (held over steps 2-5)", INFO)
    assert r.text(bound, 5) == bound.text
    assert r.text(bound, 6) == ("trainer-bound: generation waits 3.00 s for the staleness limit (in full at step 5; "
                                "held over steps 2-5)")
    healthy = Diagnosis("balanced", "healthy: balanced (no waits)", OK)
    assert r.text(healthy, 7) == healthy.text
    assert r.text(bound, 8) == bound.text  # after an ok line the finding is new again
    odd = Diagnosis("trainer_idle", "trainer idle 23% of the step (waits 0.8 s)", WARN)  # neither form: in full
    assert r.text(odd, 9) == odd.text and r.text(odd, 10) == odd.text
    assert r.text(None, 11) is None
    assert r.text(idle(38, 2.0, 12), None) == idle(38, 2.0, 12).text  # a window without a step: in full


def test_the_plain_log_carries_an_on_policy_runs_finding_in_full_once(tmp_path):
    """An on-policy run whose trainer waits 40% of each step: the finding holds from step 3 on, in full on the
    first line that carries it and by its words on the next ones."""
    out = tmp_path / "run"
    out.mkdir()
    console = Console(record=True, width=160, force_terminal=False)
    dash = Dashboard(out, mode="plain", console=console, settings=RunSettings(max_staleness=0),
                     started_at=time.time() - 5)
    rows = [{"step": s, "time": time.time(), "perf/step_s": 5.0, "perf/rollout_wait_s": 2.0,
             "rollout/backpressure_s": 0.0, "rollout/queue_size": 0, "batch/samples_per_step": 64,
             "rollout/held_round_frac": 0.9, "reward": 0.5} for s in range(1, 7)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dash.poll()
    lines = [ln for ln in console.export_text().splitlines() if ln.startswith("step ")]
    assert len(lines) == 6
    full = [ln for ln in lines if "fix:" in ln]
    short = [ln for ln in lines if "(in full at step " in ln]
    assert len(full) == 1 and full[0].startswith("step 3 |") and len(short) == 3, lines
    assert all(ln.endswith(f"(in full at step 3; held over steps 1-{n})") for n, ln in zip((4, 5, 6), short)), short
    assert max(len(ln) for ln in short) < len(full[0]) / 2


def test_an_idle_trainer_over_the_last_windows_is_said_in_full_once():
    """The smoke job's lines (twenty-sixth session): ``over steps 1-5 (busy 19%-100%): trainer idle 60% of these steps
    (...): the embedded sampler uses 0.74 CPU cores ... fix: ...`` on every step; and the realistic job's ``in waves
    over steps 5-10 (...)``."""
    text = ("{lead} (busy 19%-100%): trainer idle {pct}% of these steps (waits 11.36 s for samples; generation 0.895 "
            "rollouts/s): the embedded sampler uses 0.74 CPU cores of a machine 97% busy; fix: sampler.backend=vllm "
            "on a GPU")
    r = PlainRepeats()
    first = Diagnosis("trainer_idle_embedded", text.format(lead="over steps 1-3", pct=61), WARN)
    assert r.text(first, 3) == first.text
    later = Diagnosis("trainer_idle_embedded", text.format(lead="over steps 1-5", pct=60), WARN)
    assert r.text(later, 5) == "over steps 1-5 (busy 19%-100%): trainer idle 60% of these steps (in full at step 3)"
    waves = Diagnosis("trainer_idle_embedded", text.format(lead="in waves over steps 2-7", pct=40), WARN)
    assert r.text(waves, 7) == ("in waves over steps 2-7 (busy 19%-100%): trainer idle 40% of these steps (in full at "
                                "step 3)")
