"""A weight sync that fails at a route, then fails to resume the server (a server killed mid-sync): the first error
is the one raised, the /resume failure rides on it as a note, and the log tells one story (`WeightSyncBackend.paused`)."""
from __future__ import annotations

import pytest

from asyncgrpo_cli.sampler.client import SamplerError
from asyncgrpo_cli.train.weight_sync import SyncTimings, WeightSyncBackend, WeightSyncError


class DeadServer:
    """Answers /pause, then is gone: every later route raises as a killed server's client does."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def pause(self, mode: str) -> None:
        self.events.append(f"/pause?mode={mode}")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.events.append("/reset_prefix_cache")
        return True

    def start_weight_update(self) -> None:
        self.events.append("/start_weight_update")
        raise SamplerError("connection refused", "/start_weight_update")

    def resume(self) -> None:
        self.events.append("/resume")
        raise SamplerError("resume down", "/resume")


class OneRoute(WeightSyncBackend):
    """The smallest backend: pause, one route, resume."""

    def sync(self, source, version):
        timings = SyncTimings()
        with self.paused(version, timings):
            self.call("/start_weight_update", version, self.client.start_weight_update)
        return timings


def test_the_first_error_is_raised_and_the_resume_failure_noted():
    server = DeadServer()
    with pytest.raises(WeightSyncError, match="/start_weight_update") as info:
        OneRoute(server).sync(None, 1)
    assert server.events == ["/pause?mode=keep", "/start_weight_update", "/resume"]  # resumed whatever failed
    assert any("resuming the server afterwards failed too" in note and "/resume" in note
               for note in info.value.__notes__)


def test_one_log_line_names_the_route_that_failed_first(caplog):
    """Twenty-second session's trial: a line naming only /resume, logged before the caller's error about the failing
    route, read as a second failure."""
    with caplog.at_level("ERROR"), pytest.raises(WeightSyncError):
        OneRoute(DeadServer()).sync(None, 3)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert lines == ["weight sync to model version 3 failed at /start_weight_update; resuming the server afterwards "
                     "failed too (SamplerError: resume down)"]
