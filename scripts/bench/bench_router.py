"""What the ``sampler.engines`` router (`asyncgrpo_cli.server.router`) costs per generation request (issue #41).

    python scripts/bench/bench_router.py --out scripts/bench/results

Two stand-in engines (aiohttp, each answering every ``/v1/completions`` at once with a fixed body the size of a
group's answer: 8 completions x ``--tokens`` tokens with top-8 log-probs as vLLM's JSON, ~``--body-kb`` KB) sit
behind the router; a client keeps ``--inflight`` requests in flight for ``--seconds`` s, first straight to the two
engines (alternating), then through the router. It records requests/s both ways and the router process's CPU
seconds per request. The job sends one request per group: 2,400 rollouts/s (two vLLM servers on an H200, the
2026-12-04 screen) is 300 requests/s, so the router's CPU per request times 300 is the share of a core it needs.
Writes ``router.json`` (device, versions, date, workload, figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = '''
import sys
from aiohttp import web
body = b"x" * int(sys.argv[1])
async def completions(request):
    await request.read()
    return web.Response(body=body, content_type="application/json")
async def health(request):
    return web.Response(text="")
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[sys.argv.index("--port") + 1]), print=None, access_log=None)
'''


def _free_base(n: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, base + n + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


async def _load(urls: list[str], inflight: int, seconds: float, prompt: bytes) -> int:
    from aiohttp import ClientSession, TCPConnector

    done = 0
    stop = time.monotonic() + seconds
    async with ClientSession(connector=TCPConnector(limit=0)) as http:
        async def worker(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < stop:
                async with http.post(f"{urls[i % len(urls)]}/v1/completions", data=prompt,
                                     headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                done += 1
                i += 1

        await asyncio.gather(*(worker(k) for k in range(inflight)))
    return done


def _wait_health(url: str, seconds: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


def main() -> int:
    import psutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inflight", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    # vLLM's JSON per token with top-8 log-probs is ~0.45 KB; a group answer holds 8 completions.
    body = int(8 * args.tokens * 450 + 2000)
    prompt = json.dumps({"prompt": list(range(100)), "n": 8, "max_tokens": args.tokens, "logprobs": 8}).encode()
    base = _free_base(2)
    router = subprocess.Popen([sys.executable, "-m", "asyncgrpo_cli.server.router", "--port", str(base),
                               "--engines", "2", "--", sys.executable, "-c", ENGINE, str(body), "--port", "0"],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    url = f"http://127.0.0.1:{base}"
    try:
        _wait_health(url)
        engines = [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"]
        direct = asyncio.run(_load(engines, args.inflight, args.seconds, prompt))
        proc = psutil.Process(router.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        routed = asyncio.run(_load([url], args.inflight, args.seconds, prompt))
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    finally:
        os.killpg(router.pid, 15)
        router.wait(30)
    result = {"id": "router", "issue": 41, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "versions": {"python": platform.python_version()},
              "workload": {"inflight": args.inflight, "seconds": args.seconds, "tokens": args.tokens, "body_bytes": body,
                           "engines": 2, "note": "stand-in engines answer at once: the router's own cost"},
              "direct_requests_per_s": round(direct / args.seconds, 1),
              "routed_requests_per_s": round(routed / args.seconds, 1),
              "router_cpu_ms_per_request": round(1000 * cpu / max(1, routed), 3),
              "router_core_share_at_300_requests_per_s": round(0.3 * cpu / max(1, routed) * 1000, 3)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
