"""The trainer's console: the plain line in place of transformers' metrics dict, and no progress bar where stdout
is not a terminal (trainer.log under `asyncgrpo train`)."""

from __future__ import annotations

import re
import types

from transformers.trainer_callback import CallbackHandler, PrinterCallback, ProgressCallback

from asyncgrpo_cli.train.console_log import PlainPrinterCallback, PlainProgressCallback, use_plain_lines


def _handler(*callbacks):
    return CallbackHandler(list(callbacks), model=None, processing_class=None, optimizer=None, lr_scheduler=None)


def _kinds(handler):
    return [type(cb) for cb in handler.callbacks]


def test_on_a_terminal_the_bar_stays_with_the_plain_line():
    handler = _handler(ProgressCallback)
    use_plain_lines(handler, terminal=True)
    assert _kinds(handler) == [PlainProgressCallback]


def test_without_a_terminal_the_bar_gives_way_to_the_plain_printer(capsys):
    handler = _handler(ProgressCallback)
    use_plain_lines(handler, terminal=False)
    assert _kinds(handler) == [PlainPrinterCallback]
    args = types.SimpleNamespace(max_steps=8)
    state = types.SimpleNamespace(global_step=3, is_local_process_zero=True, is_world_process_zero=True)
    handler.callbacks[0].on_log(args, state, None, logs={"loss": 0.5, "reward": 0.25})
    out = capsys.readouterr().out
    assert re.match(r"\d\d:\d\d:\d\d step 3/8 \|", out) and "\r" not in out and "it/s" not in out


def test_the_printer_stamps_lines_only_for_a_log_file(capsys):
    args = types.SimpleNamespace(max_steps=0)
    state = types.SimpleNamespace(global_step=2, is_local_process_zero=True, is_world_process_zero=True)
    PlainPrinterCallback().on_log(args, state, None, logs={"reward": 0.5})
    PlainPrinterCallback(timestamps=True).on_log(args, state, None, logs={"reward": 0.5})
    plain, stamped = capsys.readouterr().out.splitlines()
    assert plain.startswith("step 2 |") and stamped.endswith(plain) and re.fullmatch(r"\d\d:\d\d:\d\d ", stamped[:9])


def test_one_printer_only_and_a_users_own_callback_stays():
    class Mine(ProgressCallback):
        pass

    handler = _handler(ProgressCallback, PrinterCallback, Mine)
    use_plain_lines(handler, terminal=False)
    assert sorted(k.__name__ for k in _kinds(handler)) == ["Mine", "PlainPrinterCallback"]
