"""The window a stop signal cuts short logs no generation rate (issue #45's fault trial: SIGINT one second into a
smoke step printed ``step 2/50 | ... | gen 0 tok/s 0 rollouts/s | ...``: generation ended at the signal while the
step went on, and no group had finished in the second between the last log and the signal). The trainer's
`_log_window` on a stand-in worker; no model."""

from __future__ import annotations

from types import SimpleNamespace

from asyncgrpo_cli.rollout.loop import GENERATION_RATES
from asyncgrpo_cli.rollout.metrics import MetricsWindow
from asyncgrpo_cli.run.metrics_line import metrics_line
from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer


class Worker:
    """Ships what the rollout worker shipped between the last log and the signal: 0.8 s, no group finished."""

    def drain_metrics(self):
        shipped = MetricsWindow()
        for name in GENERATION_RATES:
            shipped.add_rate(name, 0, 0.8)
        shipped.add("rollout/concurrency", 16)
        return [shipped.snapshot()]


def log_a_window(stopped: bool) -> dict:
    trainer = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)
    written: list[dict] = []
    trainer.worker, trainer.window, trainer._stop_requested, trainer._num_tokens = Worker(), MetricsWindow(), stopped, 0
    trainer.window.add("perf/step_s", 6.7)
    trainer.is_world_process_zero = lambda: True
    trainer.log = lambda logs: None  # transformers' trackers and progress bar
    trainer.live = SimpleNamespace(update=lambda **fields: None, append_metrics=written.append)
    trainer.state = SimpleNamespace(global_step=2, epoch=None)
    trainer.args = SimpleNamespace(log_completions=False)
    trainer._log_window()
    return written[0]


def test_the_window_a_stop_cut_short_logs_no_generation_rate():
    stopped = log_a_window(stopped=True)
    assert not set(GENERATION_RATES) & set(stopped), stopped
    assert stopped["rollout/concurrency"] == 16 and stopped["perf/step_s"] == 6.7  # the rest of the window stays
    line = metrics_line(stopped, 50)
    assert line.startswith("step 2/50 | ") and "| gen — (no generation figures in this window) |" in line, line
    running = log_a_window(stopped=False)  # a window the run went on through: its measured rates, zero included
    assert all(running[name] == 0.0 for name in GENERATION_RATES), running
    assert "| gen 0 tok/s 0 rollouts/s (16 in flight, none finished in this window) |" in metrics_line(running, 50)


def test_a_second_stop_signal_names_itself_in_the_final_status(tmp_path):
    """A fresh user's trial (eighteenth session) sent one SIGINT; the supervisor's SIGTERM after its stop timeout
    was the second signal, and ``status.json`` said only "second signal". The note names the signal that cut the
    save (the supervisor's console names its timeout)."""
    import signal

    import pytest

    trainer = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)
    updates: list[dict] = []
    trainer.live = SimpleNamespace(update=lambda **fields: updates.append(fields))
    trainer.state = SimpleNamespace(global_step=2)
    trainer.args = SimpleNamespace(output_dir=str(tmp_path))
    trainer._stop_requested = False
    trainer._on_stop_signal(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        trainer._on_stop_signal(signal.SIGTERM, None)
    trainer._on_failure(None, None, KeyboardInterrupt())
    assert updates[-1]["state"] == "stopped" and updates[-1]["note"] == (
        "a second stop signal (SIGTERM) while saving the last completed step: stopped without saving")
