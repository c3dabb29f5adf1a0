"""Several inference servers on one GPU behind one URL: ``sampler.engines`` (issue #41).

For a small model vLLM's engine core is host-bound: one engine-core process uses one CPU core whatever the GPU
does (2026-12-04, one H200, SmolLM2-135M: the engine core at 1.0 core, the GPU 6-9% busy). Two servers on the
same GPU, each with its own engine core, generated 2.0-2.3x the rollouts per second of one at the same rollouts
in flight (``scripts/gpu/results/vllm033/rollouts_two_engines.json``). This process starts ``--engines`` copies
of one server command on consecutive ports after its own, one after another (each once the one before answers
``/health``: the later starts find vLLM's compile caches warm and the GPU's memory already claimed), and answers
at its own port as if it were one server:

- generation (``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``) goes to the engine
  with the fewest requests in flight, body and answer passed through unread;
- the weight-sync and cache routes (``/pause``, ``/resume``, ``/reset_prefix_cache``, the four weight-update
  routes, LoRA loads) go to every engine at once and answer once all have: the first failure (naming its
  engine), else an engine's ``{"success": false}`` (a cache reset to retry), else the first engine's answer. CUDA-IPC handles are opened by each engine in turn, while the trainer
  holds its tensors (its sender waits for the answer);
- ``/health`` answers 200 once every engine does (503 while one starts or answers otherwise; a hung engine
  makes it hang too, as a hung server would);
- ``/metrics`` is every engine's text, each engine's ``engine`` label prefixed with its index, so the usual
  reduction over engines (`sampler.server_load.reduce_vllm_metrics`) sums their running requests and KV capacity;
- ``/router`` says how many engines there are, their ports, pids and requests in flight;
- every other route is the first engine's (``/version``, ``/v1/models``, ``/server_info``, ...).

If an engine exits, the router stops the others and exits with its code (1 when a signal killed it, after an
``error:`` line naming the engine and the signal, which the supervisor shows as the cause), so the supervisor
reports a dead server, with the engine's own last lines in the shared log. On SIGTERM or
SIGINT it stops the engines first. Each engine gets SIGTERM if the router dies (``PR_SET_PDEATHSIG``).

    python -m asyncgrpo_cli.server.router --host 127.0.0.1 --port 8000 --engines 2 -- vllm serve MODEL --port 8001 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
FAN_OUT_ROUTES = ("/pause", "/resume", "/reset_prefix_cache", "/init_weight_transfer_engine", "/start_weight_update",
                  "/update_weights", "/finish_weight_update", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
HEALTH_TIMEOUT_S = 60.0  # longer than the trainer's hang detection: a hung engine looks like a hung server
STOP_GRACE_S = 25.0
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
_ENGINE_LABEL = re.compile(r'engine="([^"]*)"')


def engine_argv(argv: Sequence[str], port: int) -> list[str]:
    """``argv`` with the value after ``--port`` set to ``port`` (appended when absent).

    Raises:
        ValueError: ``--port`` is the last argument (no value).
    """
    out = list(argv)
    if "--port" in out:
        i = out.index("--port")
        if i + 1 >= len(out):
            raise ValueError("--port has no value in the engine command")
        out[i + 1] = str(port)
    else:
        out += ["--port", str(port)]
    return out


def pick_engine(in_flight: Sequence[int], last: int) -> int:
    """The engine for the next generation request: the fewest requests in flight; among equals, the first
    after ``last`` (round robin)."""
    n = len(in_flight)
    fewest = min(in_flight)
    for k in range(1, n + 1):
        i = (last + k) % n
        if in_flight[i] == fewest:
            return i
    return 0


def merge_metrics(texts: Sequence[str]) -> str:
    """Prometheus exposition texts of several engines as one: each family's comment lines once (from the first
    text that has it), then its samples from every engine, with the ``engine`` label of engine ``i`` made
    ``"i.<label>"`` (added as ``"i"`` where absent) so that no two engines' samples share labels."""
    comments: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    order: list[str] = []
    for index, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in samples:
                        order.append(family)
                        comments[family], samples[family] = [], []
                    if index == 0 or not any(c.split(None, 3)[1:2] == [parts[1]] for c in comments[family]):
                        comments[family].append(line)
                continue
            if family not in samples:
                order.append(family)
                comments[family], samples[family] = [], []
            samples[family].append(_relabel(line, index))
    return "".join(f"{c}\n" for f in order for c in [*comments[f], *samples[f]])


def _relabel(line: str, index: int) -> str:
    brace, space = line.find("{"), line.find(" ")
    if brace < 0 or (0 <= space < brace):  # no labels: give it one
        name, _, rest = line.partition(" ")
        return f'{name}{{engine="{index}"}} {rest}'
    if _ENGINE_LABEL.search(line):
        return _ENGINE_LABEL.sub(lambda m: f'engine="{index}.{m.group(1)}"', line, count=1)
    head, tail = line[:brace + 1], line[brace + 1:]
    return f'{head}engine="{index}"{"" if tail.startswith("}") else ","}{tail}'


def _says_failed(body: object) -> bool:
    """Whether an answer's body is a JSON object with ``"success": false``."""
    if not isinstance(body, bytes) or b'"success"' not in body:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("success", True) is False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the router dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:  # noqa: BLE001 - not Linux: the supervisor's process-group stop still covers the engines
        pass


class Router:
    """The engines and the routes in front of them (see the module docstring).

    Args:
        argv: one engine's command; its ``--port`` is replaced by ``port + 1 + i`` for engine ``i``.
        engines: how many (>= 1).
        host / port: where the router listens; the engines listen on ``host``.
    """

    def __init__(self, argv: Sequence[str], engines: int, host: str, port: int) -> None:
        if engines < 1:
            raise ValueError(f"--engines {engines}: must be >= 1")
        self.argv, self.host, self.port = list(argv), host, int(port)
        self.ports = [self.port + 1 + i for i in range(engines)]
        self.urls = [f"http://{'[' + host + ']' if ':' in host else host}:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * engines
        self.ready = [False] * engines
        self.in_flight = [0] * engines
        self.sent = [0] * engines
        self._last = -1
        self.exit_code: int | None = None
        self._stopping = False
        self._session: ClientSession | None = None
        self._done: asyncio.Event | None = None

    # ------------------------------------------------------------------ engines
    def _start(self, i: int) -> None:
        from .command import resolve_vllm_program

        argv = resolve_vllm_program(engine_argv(self.argv, self.ports[i]))
        print(f"asyncgrpo router: starting engine {i} of {len(self.ports)} on port {self.ports[i]}", flush=True)
        self.procs[i] = subprocess.Popen(argv, preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    async def _engine_answers(self, i: int) -> bool:
        try:
            async with self._session.get(f"{self.urls[i]}/health", timeout=ClientTimeout(total=5)) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False

    async def start_engines(self) -> None:
        """Start the engines one after another, each once the one before answers ``/health``."""
        for i in range(len(self.ports)):
            if self._stopping:
                return
            try:
                self._start(i)
            except Exception as exc:  # noqa: BLE001 - vLLM missing, a command that does not run: the job's cause
                print(f"asyncgrpo router: error: engine {i} of {len(self.ports)} could not start: {exc}", flush=True)
                self.exit_code = 1
                self.stop()
                return
            t0 = time.monotonic()
            while not self._stopping and not await self._engine_answers(i):
                await asyncio.sleep(0.5)
            self.ready[i] = True
            print(f"asyncgrpo router: engine {i} answers on port {self.ports[i]} after "
                  f"{time.monotonic() - t0:.0f} s", flush=True)

    async def watch_engines(self) -> None:
        """Stop everything as soon as one engine exits (its code becomes the router's)."""
        while not self._stopping:
            for i, p in enumerate(self.procs):
                code = p.poll() if p is not None else None
                if code is not None:
                    what = f"engine {i} of {len(self.procs)} (pid {p.pid}, port {self.ports[i]})"
                    if code < 0:  # a signal leaves no error in the engine's log: this line is the job's cause
                        try:
                            name = signal.Signals(-code).name
                        except ValueError:
                            name = f"signal {-code}"
                        oom = " (the out-of-memory killer: see `dmesg`, or a `kill`)" if -code == signal.SIGKILL else ""
                        print(f"asyncgrpo router: error: {what} was killed by {name} from outside this job{oom}; "
                              "the router stops the other engines and exits 1", flush=True)
                    else:  # the engine's own last lines above say why
                        print(f"asyncgrpo router: {what} exited with code {code}: stopping the other engines",
                              flush=True)
                    self.exit_code = code if code > 0 else 1
                    self.stop()
                    return
            await asyncio.sleep(0.25)

    def stop(self) -> None:
        """Ask the router to stop its engines and exit."""
        self._stopping = True
        if self._done is not None:
            self._done.set()

    def stop_engines(self) -> None:
        """SIGTERM to every running engine, then SIGKILL to those still there after `STOP_GRACE_S`."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    # ------------------------------------------------------------------ routes
    @staticmethod
    def _headers(request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}

    async def _forward(self, i: int, request: web.Request, body: bytes) -> web.Response:
        url = f"{self.urls[i]}{request.path_qs}"
        async with self._session.request(request.method, url, data=body or None, headers=self._headers(request)) as r:
            data = await r.read()
            return web.Response(body=data, status=r.status, content_type=r.content_type or None,
                                charset=r.charset)

    async def generate(self, request: web.Request) -> web.Response:
        i = pick_engine(self.in_flight, self._last)
        self._last = i
        self.in_flight[i] += 1
        self.sent[i] += 1
        try:
            return await self._forward(i, request, await request.read())
        except Exception as exc:  # noqa: BLE001 - the engine is gone or refused: say which
            return web.Response(status=502, text=f"router: engine {i} (port {self.ports[i]}): {type(exc).__name__}: {exc}")
        finally:
            self.in_flight[i] -= 1

    async def fan_out(self, request: web.Request) -> web.Response:
        body = await request.read()

        async def one(i: int) -> web.Response:
            try:
                return await self._forward(i, request, body)
            except Exception as exc:  # noqa: BLE001
                return web.Response(status=502, text=f"{type(exc).__name__}: {exc}")

        answers = await asyncio.gather(*(one(i) for i in range(len(self.urls))))
        for i, answer in enumerate(answers):
            if answer.status >= 400:
                text = answer.body.decode("utf-8", "replace") if isinstance(answer.body, bytes) else ""
                return web.Response(status=answer.status,
                                    text=f"router: engine {i} (port {self.ports[i]}) answered {request.path} with "
                                         f"{answer.status}: {text}")
        # An engine that answered ``{"success": false}`` (``/reset_prefix_cache`` while requests run) is the answer:
        # the caller retries until every engine has done it.
        return next((a for a in answers if _says_failed(a.body)), answers[0])

    async def health(self, request: web.Request) -> web.Response:
        if not all(self.ready):
            up = sum(self.ready)
            return web.Response(status=503, text=f"router: {up} of {len(self.ready)} engines up")

        async def one(i: int) -> int:
            try:
                async with self._session.get(f"{self.urls[i]}/health",
                                             timeout=ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                    return r.status
            except Exception:  # noqa: BLE001
                return 503

        codes = await asyncio.gather(*(one(i) for i in range(len(self.urls))))
        bad = [f"engine {i}: {c}" for i, c in enumerate(codes) if c != 200]
        return web.Response(status=503, text="router: " + ", ".join(bad)) if bad else web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        async def one(i: int) -> str:
            try:
                async with self._session.get(f"{self.urls[i]}/metrics", timeout=ClientTimeout(total=10)) as r:
                    return await r.text() if r.status == 200 else ""
            except Exception:  # noqa: BLE001 - a missing engine's metrics are left out
                return ""

        texts = await asyncio.gather(*(one(i) for i in range(len(self.urls))))
        if not any(texts):
            return web.Response(status=503, text="router: no engine answered /metrics")
        return web.Response(text=merge_metrics(texts), content_type="text/plain")

    async def describe(self, request: web.Request) -> web.Response:
        return web.json_response({"engines": len(self.ports), "ports": self.ports, "ready": self.ready,
                                  "pids": [p.pid if p is not None else None for p in self.procs],
                                  "in_flight": self.in_flight, "requests": self.sent})

    async def first(self, request: web.Request) -> web.Response:
        if not self.ready[0]:
            return web.Response(status=503, text="router: engine 0 is starting")
        try:
            return await self._forward(0, request, await request.read())
        except Exception as exc:  # noqa: BLE001
            return web.Response(status=502, text=f"router: engine 0: {type(exc).__name__}: {exc}")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024 * 1024 * 1024)
        for route in GENERATION_ROUTES:
            app.router.add_post(route, self.generate)
        for route in FAN_OUT_ROUTES:
            app.router.add_post(route, self.fan_out)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/router", self.describe)
        app.router.add_route("*", "/{tail:.*}", self.first)
        return app

    async def run(self) -> int:
        """Listen, start the engines, serve until one exits or a stop signal; returns the exit status."""
        self._done = asyncio.Event()
        self._session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        print(f"asyncgrpo router: listening on {self.host}:{self.port} for {len(self.ports)} engines "
              f"(ports {self.ports[0]}-{self.ports[-1]})", flush=True)
        tasks = [asyncio.create_task(self.start_engines()), asyncio.create_task(self.watch_engines())]
        await self._done.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await loop.run_in_executor(None, self.stop_engines)
        await runner.cleanup()
        await self._session.close()
        return 0 if self.exit_code is None else self.exit_code


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo_cli.server.router", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then one engine's command")
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no engine command after --")
    return asyncio.run(Router(command, ns.engines, ns.host, ns.port).run())


if __name__ == "__main__":
    sys.exit(main())
