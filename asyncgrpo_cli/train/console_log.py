"""What the trainer prints per logging step: the plain line of `asyncgrpo train` (`run.metrics_line`), not
transformers' dict of every metric (about 90 of them; issue #36). The whole dict still goes to
``metrics.jsonl`` and to the ``report_to`` trackers; only the console line changes.

`PlainProgressCallback` replaces transformers' `ProgressCallback` (the progress bar stays, the line is written
above it) and `PlainPrinterCallback` its `PrinterCallback` (``disable_tqdm=True``); `use_plain_lines` swaps
them in a trainer's callback handler. Without a terminal (under `asyncgrpo train`, the trainer writes to
``logs/trainer.log``) the bar is dropped too: in a file it is a run of carriage-return redraws around each line,
and the supervisor's own panel shows the progress; each line then starts with the time it was written.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..run.log_lines import stamped
from ..run.metrics_line import metrics_line


def _line(args: Any, state: Any, logs: dict[str, Any] | None) -> str | None:
    if not logs:
        return None
    max_steps = args.max_steps if getattr(args, "max_steps", 0) and args.max_steps > 0 else None
    return metrics_line({"step": state.global_step, **logs}, max_steps)


class PlainProgressCallback(ProgressCallback):
    """transformers' progress bar, whose per-log line is the plain line instead of the metrics dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102 - transformers' hook
        line = _line(args, state, logs)
        if state.is_world_process_zero and self.training_bar is not None and line:
            self.training_bar.write(line)


class PlainPrinterCallback(PrinterCallback):
    """transformers' printer (no progress bar), printing the plain line instead of the metrics dict.

    Args:
        timestamps: start each line with the wall-clock time (`stamped`; for ``logs/trainer.log``).
    """

    def __init__(self, timestamps: bool = False) -> None:
        super().__init__()
        self.timestamps = timestamps

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102 - transformers' hook
        line = _line(args, state, logs)
        if state.is_local_process_zero and line:
            print(stamped(line) if self.timestamps else line, flush=True)


def use_plain_lines(callback_handler: Any, terminal: bool = True) -> None:
    """Replace transformers' `ProgressCallback` / `PrinterCallback` in ``callback_handler`` by the plain ones
    (subclasses are left alone: a user's own printer stays). ``terminal`` False (stdout is a file or a pipe): the
    progress bar gives way to the printer, so the log holds the plain lines only, each after its time (`stamped`)."""
    bar = PlainProgressCallback if terminal else PlainPrinterCallback
    for old, new in ((ProgressCallback, bar), (PrinterCallback, PlainPrinterCallback)):
        if any(type(cb) is old for cb in callback_handler.callbacks):
            callback_handler.remove_callback(old)
            if not any(type(cb) is new for cb in callback_handler.callbacks):
                callback_handler.add_callback(PlainPrinterCallback(timestamps=not terminal)
                                              if new is PlainPrinterCallback else new)
