"""`run.log_lines.stamp_package_logs`: the package's warnings in a run's log carry their time (a fresh-user trial could
not time the retry and outage lines of trainer.log)."""
from __future__ import annotations

import io
import logging
import re

from asyncgrpo_cli.run import log_lines


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_the_time_before_each_warning_and_a_terminal_is_left_alone(monkeypatch):
    logger = logging.getLogger(log_lines.PACKAGE_LOGGER)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    assert not log_lines.stamp_package_logs(Tty())  # a terminal: as before
    out = io.StringIO()
    assert log_lines.stamp_package_logs(out) and not logger.propagate
    assert not log_lines.stamp_package_logs(io.StringIO())  # once only
    logging.getLogger("asyncgrpo_cli.sampler.client").warning("sampler %s: retrying in %.1f s", "http://h:1", 1.0)
    logging.getLogger("asyncgrpo_cli.sampler.client").info("not shown: below WARNING, as the last-resort handler")
    assert re.fullmatch(r"\d\d:\d\d:\d\d sampler http://h:1: retrying in 1\.0 s\n", out.getvalue()), out.getvalue()


def test_an_event_line_gets_its_time_in_a_log_file_and_none_on_a_terminal():
    """Second trial of the twenty-fifth session: ``asyncgrpo: step 3 is trained; its weight sync was abandoned ...``
    and the worker's ``the trainer is stopping`` stood untimed between timed lines of trainer.log."""
    out, tty = io.StringIO(), Tty()
    log_lines.say("asyncgrpo: step 3 is trained", out)
    log_lines.say("asyncgrpo: step 3 is trained", tty)
    assert re.fullmatch(r"\d\d:\d\d:\d\d asyncgrpo: step 3 is trained\n", out.getvalue()), out.getvalue()
    assert tty.getvalue() == "asyncgrpo: step 3 is trained\n"
