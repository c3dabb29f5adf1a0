"""The async sampler client's connection pool: one HTTP request in, one `httpx.Response` out.

`AiohttpPool` is the default. httpx's async pool scans every connection on each request
(``_assign_requests_to_connections``), which at the worker's 256-512 connections cost a third of
the rollout worker's event loop (P6 in scripts/bench/NOTES.md); aiohttp's pool hands out an idle
connection in constant time. `HttpxPool` serves a caller-supplied ``httpx.AsyncBaseTransport``
(the ``transport`` argument of `SamplerClient`, e.g. ``httpx.MockTransport`` in tests).

Both speak httpx's vocabulary, so `SamplerClient` and `SyncSamplerClient` share the retry decisions
and error messages (SPEC Appendix B.17): answers are `httpx.Response` objects with the body read;
a refused or failed connect raises `httpx.ConnectError`, a timeout `httpx.TimeoutException`, any
other transport failure (dropped connection, truncated body) an `httpx.TransportError`. The
original exception is chained as ``__cause__``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import httpx

KEEPALIVE_S = 5.0
"""Seconds an idle connection is kept open (httpx's default; vLLM's uvicorn closes idle ones after 5 s)."""

_json_dumps = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
"""Request bodies as httpx writes them: compact UTF-8, and NaN / infinity refused (ValueError)."""


class AiohttpPool:
    """A pool of at most ``size`` keep-alive connections to ``base_url`` on an ``aiohttp.ClientSession``.

    The session is opened on the first request, inside the running event loop (aiohttp binds it to
    that loop). Like httpx's default (``trust_env``), the ``HTTP(S)_PROXY`` / ``NO_PROXY`` variables
    are read once when the session opens, and https certificates are checked against httpx's CA
    bundle (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured). JSON bodies are written as httpx writes them,
    and redirects are not followed (httpx's default).

    Args:
        base_url: ``http(s)://host:port[/prefix]`` without a trailing slash; routes are appended.
        size: most connections open at once (requests beyond wait for a free one, within their timeout).
        timeout_s: default per-request timeout, seconds: connect, send and the whole answer read.
    """

    def __init__(self, base_url: str, size: int, timeout_s: float) -> None:
        self.base_url = base_url
        self.size = size
        self.timeout_s = timeout_s
        self._session: Any = None
        self._proxy: Any = None
        self._proxy_auth: Any = None
        self._timeouts: dict[float, Any] = {}
        self._urls: dict[str, Any] = {}
        self._closed = False

    def _open(self) -> None:
        import aiohttp
        from aiohttp.helpers import get_env_proxy_for_url
        from yarl import URL

        if self._closed:
            raise RuntimeError("SamplerClient: the connection pool was closed (aclose); build a new client")
        ssl: Any = True
        if self.base_url.startswith("https://"):
            ssl = httpx.create_ssl_context(trust_env=True)
        try:
            self._proxy, self._proxy_auth = get_env_proxy_for_url(URL(self.base_url))
        except LookupError:
            self._proxy, self._proxy_auth = None, None
        connector = aiohttp.TCPConnector(limit=self.size, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, ssl=ssl)
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False, json_serialize=_json_dumps,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    def _url(self, route: str) -> Any:
        url = self._urls.get(route)
        if url is None:
            from yarl import URL

            url = self._urls[route] = URL(self.base_url + route)
        return url

    def _timeout(self, timeout_s: float) -> Any:
        timeout = self._timeouts.get(timeout_s)
        if timeout is None:
            import aiohttp

            timeout = self._timeouts[timeout_s] = aiohttp.ClientTimeout(total=timeout_s)
        return timeout

    async def request(self, method: str, route: str, *, json: Any = None, params: dict | None = None,
                      timeout: float | None = None) -> httpx.Response:
        """Send one request and read the whole answer, within ``timeout`` seconds (default the pool's).

        Returns:
            the answer, any status (the caller decides what an error status means).

        Raises:
            httpx.ConnectError / httpx.TimeoutException / httpx.TransportError: see the module docstring.
        """
        import aiohttp

        if self._session is None:
            self._open()
        timeout_s = self.timeout_s if timeout is None else timeout
        try:
            async with self._session.request(method, self._url(route), json=json, params=params,
                                             timeout=self._timeout(timeout_s), allow_redirects=False,
                                             proxy=self._proxy, proxy_auth=self._proxy_auth) as answer:
                content = await answer.read()
                status = answer.status
                content_type = answer.headers.get("Content-Type")
        except asyncio.TimeoutError as exc:  # aiohttp's own timeouts are subclasses
            raise httpx.TimeoutException(f"no complete answer within {timeout_s:g} s ({type(exc).__name__})") from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.InvalidURL:
            raise  # a bad URL, not a transport failure: never retried
        except aiohttp.ClientError as exc:
            raise httpx.TransportError(f"{type(exc).__name__}: {exc}") from exc
        headers = [("Content-Type", content_type)] if content_type else None
        return httpx.Response(status, headers=headers, content=content)

    async def aclose(self) -> None:
        """Close every connection; later requests raise RuntimeError."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpxPool:
    """The pool of an ``httpx.AsyncClient`` over a caller-supplied transport (``SamplerClient(transport=...)``).

    Args:
        base_url / timeout_s: as in `AiohttpPool`.
        limits: the pool's ``httpx.Limits``.
        transport: the ``httpx.AsyncBaseTransport`` that sends the requests.
    """

    def __init__(self, base_url: str, limits: httpx.Limits, timeout_s: float,
                 transport: httpx.AsyncBaseTransport) -> None:
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(timeout_s),
                                         transport=transport)

    async def request(self, method: str, route: str, *, json: Any = None, params: dict | None = None,
                      timeout: float | None = None) -> httpx.Response:
        """As `AiohttpPool.request`."""
        timeout_s = self.timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(
                self._client.request(method, route, json=json, params=params, timeout=timeout_s), timeout_s)
        except asyncio.TimeoutError as exc:
            raise httpx.TimeoutException(f"no complete answer within {timeout_s:g} s") from exc

    async def aclose(self) -> None:
        """Close the httpx client."""
        await self._client.aclose()
