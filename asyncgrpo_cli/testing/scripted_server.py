"""A scripted sampler for tests and benchmarks: vLLM's ``/v1/completions`` protocol, chosen completions.

`ScriptedServer` answers the routes the rollout worker reads (``/health``, ``/v1/models``,
``/v1/completions``; ``/metrics`` is absent, so the concurrency cap stays at ``max_concurrent_rollouts``)
on the aiohttp stack of the embedded sampler. Each completion request is answered by ``script(prompt_text)``,
which returns the reply text (tokenized with the tokenizer, EOS appended) or token ids. Nothing is
sampled: tests choose tool calls, malformed calls, unknown names or rewritten histories.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

__all__ = ["ScriptedServer"]

LOGPROB = -0.5  # the log-prob reported for every scripted token


class ScriptedServer:
    """A scripted completions server in a background thread.

    Args:
        tokenizer: turns prompts into text for the script and reply text into ids.
        script: ``prompt_text -> reply text | token ids``; called once per request, possibly from one thread
            only (the server's loop), so it may keep state.
        delay_s: seconds each request waits before answering (a slow sampler).
        max_model_len: what ``/v1/models`` announces.

    Attributes:
        prompts: the token-id prompt of every request, in arrival order.
        url: base URL once started.
    """

    def __init__(self, tokenizer: Any, script: Callable[[str], str | list[int]], delay_s: float = 0.0,
                 max_model_len: int = 8192) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.delay_s = delay_s
        self.max_model_len = max_model_len
        self.prompts: list[list[int]] = []
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "scripted", "object": "model", "max_model_len": self.max_model_len, "root": "scripted",
             "parent": None}]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = list(body["prompt"])
        self.prompts.append(prompt)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self.script(self.tokenizer.decode(prompt, skip_special_tokens=False))
        if isinstance(reply, str):
            ids = list(self.tokenizer.encode(reply, add_special_tokens=False)) + [int(self.tokenizer.eos_token_id)]
        else:
            ids = [int(t) for t in reply]
        n = int(body.get("logprobs") or 0)
        logprobs = {"token_logprobs": [LOGPROB] * len(ids),
                    "top_logprobs": [{f"token_id:{t}": LOGPROB} for t in ids] if n > 0 else None}
        return web.json_response({"id": "cmpl-scripted", "object": "text_completion", "model": "scripted",
                                  "choices": [{"index": 0, "text": "", "token_ids": ids, "logprobs": logprobs,
                                               "finish_reason": "stop"}]})

    def start(self, timeout_s: float = 30.0) -> "ScriptedServer":
        """Serve on 127.0.0.1 (a free port) from a daemon thread; returns self once it accepts requests."""
        self._thread = threading.Thread(target=self._main, name="scripted-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the scripted server did not start within {timeout_s} s")
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def serve() -> None:
            self._runner = web.AppRunner(self._app(), access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)  # hundreds of rollouts connect at once
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the bound port of port 0
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()

        loop.run_until_complete(serve())
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and join the thread."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)

    def __enter__(self) -> "ScriptedServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
