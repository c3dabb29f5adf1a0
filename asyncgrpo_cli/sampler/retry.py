"""The retry decisions of the sampler client (SPEC Appendix B.17), free of I/O: callers send and sleep.

- `ServerOutage`: one per client. It starts at the first refused connection and ends at the next answer
  from the server, whatever the request; while it lasts every request waits for the server, for at most
  ``timeout_s`` (``vllm_server_timeout``) counted from the outage's start, not per request. It counts the
  outages that ended (``recoveries``): after one, the server may have lost its weights (a restart). It logs
  one line when an outage starts (how long it is waited out, until what time) and one when it ends (after how
  long), whatever the number of requests waiting: the live countdown is ``status()`` (``status.json``).
- `_RetryState`: the decisions for one request: connection refused → wait with backoff until the
  outage's deadline; timeout / 5xx / dropped connection → at most ``max_retries`` retries with backoff
  (``base_s`` doubling to ``max_s``); 4xx → `SamplerRequestError`, never retried.
- `_Readiness`: the ``/health`` polling of ``wait_until_ready``.

Every clock is injectable (``clock=``) so the decisions are tested without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from .protocol import (
    GENERATE_ROUTE,
    SamplerConnectionLost,
    SamplerRequestError,
    SamplerRetryError,
    SamplerUnavailableError,
    request_summary,
    server_error_message,
)

Clock = Callable[[], float]
log = logging.getLogger("asyncgrpo_cli.sampler.client")  # the clients' logger: one place to configure

TRANSPORT_ERRORS = (httpx.TimeoutException, httpx.TransportError, asyncio.TimeoutError)
WAKE_S = 0.2
"""The longest slice of a sleep between tries: a sleep ends this soon after `ServerOutage.abandon`."""


def unreachable_text(seconds_left: float, stopping: str | None = None) -> str:
    """The live status line of an outage (``status.json`` ``server_status``, the dashboard); once the job is
    stopping (``stopping``: why), it promises no wait."""
    if stopping:
        return f"server unreachable; not waited out: the job is stopping ({stopping})"
    return f"server unreachable, retrying ({max(0.0, seconds_left):.0f} s left)"


class ServerOutage:
    """The client-wide outage clock (SPEC B.17): how long the server has been unreachable.

    Args:
        url: the server's base URL (named in errors and the status line).
        timeout_s: ``vllm_server_timeout``: the longest outage waited out, seconds.
        clock: monotonic clock (seconds); ``wall``: wall clock for `deadline_wall`.

    Attributes:
        since: clock time of the outage's first refused connection, None while the server answers.
        started: outages begun so far; ``recoveries``: outages that ended with an answer.
        last_error: the last connection error seen, for messages.
        peer_deadline: optional ``() -> wall-clock time`` at which another client of the same server (another
            process: the trainer's weight sync and the rollout worker) gives up on its outage, 0.0 when it has
            none. An outage seen here adopts the peer's earlier start (when that start is after this client's
            last answer), so both give up together, ``timeout_s`` after the first refusal either of them saw.
        stop_under_way: optional ``() -> why or None``: whether the job is already stopping (the supervisor saw the
            server it started exit: `run.stop_reason.stop_under_way`); the outage's lines then promise no wait.
    """

    def __init__(self, url: str, timeout_s: float, clock: Clock = time.monotonic, wall: Clock = time.time) -> None:
        self.url, self.timeout_s = url, float(timeout_s)
        self.clock, self.wall = clock, wall
        self.since: float | None = None
        self.started = 0
        self.recoveries = 0
        self.last_error = ""
        self.abandoned: str | None = None
        self.peer_deadline: Callable[[], float] | None = None
        self.stop_under_way: Callable[[], str | None] | None = None
        self._last_answer: float | None = None

    def abandon(self, reason: str) -> None:
        """Stop waiting for the server: every later retry decision raises `SamplerUnavailableError` naming
        ``reason`` (a stop signal, the supervisor saw the server die). Only sets an attribute, so it is safe
        in a signal handler; the clients' sleeps between tries check it at least every `WAKE_S` s."""
        self.abandoned = reason

    @property
    def active(self) -> bool:
        """True while the server is unreachable."""
        return self.since is not None

    def refused(self, error: Any) -> float:
        """Record a refused (or failed) connection; returns the seconds left before giving up (<= 0: give up)."""
        now = self.clock()
        first = self.since is None
        if first:
            self.since = now
            self.started += 1
        self._adopt_peer_start(now)
        self.last_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if first and self.abandoned is None:
            log.warning("%s", self.start_line())
        return self.timeout_s - (now - self.since)

    def stopping(self) -> str | None:
        """Why the job is already stopping (`stop_under_way`), or None (also when the probe fails)."""
        try:
            return self.stop_under_way() if self.stop_under_way is not None else None
        except Exception:  # noqa: BLE001 - a line about the outage must not fail the request
            return None

    def start_line(self) -> str:
        """The one log line of an outage's start: the URL, the error, how long requests wait and until when;
        when the job is already stopping (`stopping`), why, and no wait promised."""
        why = self.stopping()
        if why:
            return (f"sampler {self.url}: server unreachable ({self.last_error}); not waited out: the job is "
                    f"already stopping ({why})")
        left = self.seconds_left() or 0.0
        until = time.strftime("%H:%M:%S", time.localtime(self.wall() + left))
        return (f"sampler {self.url}: server unreachable ({self.last_error}); every request waits for it, "
                f"{left:.0f} s more at most (until {until}; vllm_server_timeout={self.timeout_s:g} s, CLI: "
                f"sampler.timeout); one line more when it answers")

    def _adopt_peer_start(self, now: float) -> None:
        """Move ``since`` back to the start of the peer's outage (`peer_deadline`) when that is earlier and
        after this client's last answer (an older outage of the peer is not this one)."""
        if self.peer_deadline is None or self.since is None:
            return
        try:
            deadline = float(self.peer_deadline())
        except Exception:  # noqa: BLE001 - the peer is gone: keep this client's own clock
            return
        if deadline <= 0:
            return
        peer_since = now - (self.timeout_s - (deadline - self.wall()))
        if peer_since < self.since and (self._last_answer is None or peer_since > self._last_answer):
            self.since = peer_since

    def waited(self) -> float:
        """Seconds since the outage began (0 when there is none)."""
        return 0.0 if self.since is None else self.clock() - self.since

    def seconds_left(self) -> float | None:
        """Seconds before the client gives up, None when there is no outage."""
        return None if self.since is None else self.timeout_s - (self.clock() - self.since)

    def answered(self) -> bool:
        """The server answered: end the outage. Returns True when one was in progress (it just ended)."""
        self._last_answer = self.clock()
        if self.since is None:
            return False
        lasted = self._last_answer - self.since
        self.since = None
        self.recoveries += 1
        log.warning("sampler %s answers again after %.0f s unreachable (outage %d ended)", self.url, lasted,
                    self.recoveries)
        return True

    def deadline_wall(self) -> float:
        """Wall-clock time (``time.time``) at which the client gives up, 0.0 when there is no outage."""
        left = self.seconds_left()
        return 0.0 if left is None else self.wall() + left

    def status(self) -> str | None:
        """``"server unreachable, retrying (N s left)"`` during an outage (`unreachable_text`: no wait promised
        once the job is stopping), else None."""
        left = self.seconds_left()
        return None if left is None else unreachable_text(left, self.stopping())

    def give_up_error(self, route: str, body: Any) -> SamplerUnavailableError:
        """The error that ends the wait: the URL, how long it waited, the last error and the fix."""
        return SamplerUnavailableError(
            f"{self.url}{route}: the sampler server has been unreachable (connection refused) for "
            f"{self.waited():.0f} s (last error: {self.last_error or 'none'}); gave up after vllm_server_timeout="
            f"{self.timeout_s:g} s (CLI: sampler.timeout). Fix: start the server again (or point "
            f"vllm_server_base_url / sampler.url at a running one) and resume from the last checkpoint; "
            f"raise the timeout to wait longer for a restart. Request: {request_summary(body)}",
            route,
        )


class _Readiness:
    """The ``/health`` polling decision shared by both clients' ``wait_until_ready`` (no I/O here).

    ``next_timeout()`` gives the timeout of the next probe (at most 5 s) or raises once ``deadline_s``
    has passed; ``answered(status)`` / ``failed(exc)`` record a probe; ``pause(poll_s)`` is the sleep
    before the next one.
    """

    def __init__(self, base_url: str, deadline_s: float, clock: Clock = time.monotonic) -> None:
        self.base_url, self.deadline_s = base_url, deadline_s
        self.clock = clock
        self.start = clock()
        self.last = "no answer yet"

    def remaining(self) -> float:
        return self.deadline_s - (self.clock() - self.start)

    def next_timeout(self) -> float:
        remaining = self.remaining()
        if remaining <= 0:
            raise SamplerUnavailableError(f"sampler at {self.base_url} not ready after {self.deadline_s:g} s "
                                          f"(GET /health): {self.last}", "/health")
        return max(min(5.0, remaining), 0.05)

    def answered(self, status: int) -> float | None:
        """Seconds waited when ``status`` is 200, else None (and the status is remembered)."""
        if status == 200:
            return self.clock() - self.start
        self.last = f"HTTP {status}"
        return None

    def failed(self, exc: Exception) -> None:
        self.last = f"{type(exc).__name__}: {exc}"

    def pause(self, poll_s: float) -> float:
        return min(poll_s, max(self.remaining(), 0))


class _RetryState:
    """The retry decisions of SPEC Appendix B.17 for one request (no I/O: callers sleep).

    Args:
        url / route: named in errors.
        timeout_s: ``vllm_server_timeout``; the outage deadline when ``outage`` is None.
        max_retries: retries after timeouts, 5xx and dropped connections (0: none; refusals are still
            waited out: a refused request never reached the server, so resending it is always safe).
        base_s / max_s: exponential backoff, first delay and cap, seconds.
        outage: the client's `ServerOutage` (shared by its requests); None: one of its own.
    """

    def __init__(self, url: str, route: str, timeout_s: float, max_retries: int, base_s: float, max_s: float,
                 outage: ServerOutage | None = None) -> None:
        self.url, self.route = url, route
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.base_s, self.max_s = base_s, max_s
        self.outage = outage if outage is not None else ServerOutage(url, timeout_s)
        self.retries = 0  # retries after timeouts / 5xx / dropped connections
        self.refusals = 0

    def _backoff(self, n: int) -> float:
        return min(self.base_s * (2**n), self.max_s)

    def _raise_if_abandoned(self, reason: Any) -> None:
        if self.outage.abandoned is not None:
            raise SamplerUnavailableError(f"{self.url}{self.route}: stopped waiting for the sampler server "
                                          f"({self.outage.abandoned}); last error: {reason}", self.route)

    def on_refused(self, exc: Any, body: Any) -> float:
        """Connection refused (or a failed ``/health`` probe during an outage): the delay before the next
        try, or raise `SamplerUnavailableError` once the outage has lasted ``timeout_s`` or was abandoned."""
        remaining = self.outage.refused(exc)
        self._raise_if_abandoned(self.outage.last_error)
        if remaining <= 0:
            raise self.outage.give_up_error(self.route, body)
        delay = min(self._backoff(self.refusals), remaining)
        self.refusals += 1
        return delay

    def on_failure(self, reason: str, body: Any, transport: bool = False) -> float:
        """Timeout, 5xx or dropped connection: the delay before retrying, or raise when exhausted
        (`SamplerConnectionLost` when ``transport``, the last failure being no HTTP answer); after
        `ServerOutage.abandon`, `SamplerUnavailableError` at once."""
        self._raise_if_abandoned(reason)
        if self.retries >= self.max_retries:
            tried = f" after {self.retries} retries" if self.retries else ""
            error = SamplerConnectionLost if transport else SamplerRetryError
            raise error(f"{self.url}{self.route}: failed{tried}: {reason}; request: {request_summary(body)}",
                        self.route)
        delay = self._backoff(self.retries)
        self.retries += 1
        return delay

    def on_error(self, exc: Exception, body: Any, retry: bool = True) -> float:
        """A transport error: the delay before the next try, or raise (the errors of `on_refused` /
        `on_failure`). ``retry`` is kept for callers; ``max_retries`` decides."""
        if isinstance(exc, httpx.ConnectError):
            return self.on_refused(exc, body)
        return self.on_failure(_classify(exc, self.timeout_s), body, transport=True)

    def on_response(self, response: httpx.Response, body: Any, allow_404: bool) -> tuple[bool, float]:
        """An HTTP answer (it ends any outage): ``(True, 0)`` when it is the result (2xx/3xx, or 404 with
        ``allow_404``), ``(False, delay)`` to retry a 5xx; a 4xx raises `SamplerRequestError` (B.17)."""
        status = response.status_code
        if status < 400 or (status == 404 and allow_404):
            return True, 0.0
        if status < 500:
            _raise_for_4xx(self.url, self.route, response, body)
        return False, self.on_failure(f"HTTP {status}: {server_error_message(response)}", body)


def _classify(exc: Exception, timeout_s: float) -> str:
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        return f"timed out after {timeout_s:g} s ({type(exc).__name__})"
    return f"connection error ({type(exc).__name__}: {exc})"


def _raise_for_4xx(url: str, route: str, response: httpx.Response, body: Any) -> None:
    message = server_error_message(response)
    hint = ""
    route_missing = response.status_code == 403 or (response.status_code == 404 and "model" not in message.lower())
    if route == GENERATE_ROUTE and route_missing:
        hint = " (this vLLM needs --enable-scale-out for /inference/v1/generate, or is older than 0.26)"
    raise SamplerRequestError(
        f"{url}{route} rejected the request with HTTP {response.status_code}: {message}{hint}; "
        f"request: {request_summary(body)}",
        route,
        response.status_code,
        message,
    )
