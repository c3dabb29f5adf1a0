"""P6: rollout-worker ingest on a CPU machine like CI's (2 cores), against a synthetic server that answers
instantly with top-8 log-probs: generated tokens/s accepted, scored and queued by `AsyncRolloutLoop`.

    python scripts/bench/bench_worker_ingest.py --seconds 20 --out scripts/bench/results

The synthetic server (aiohttp, in its own process) answers ``/v1/completions`` with ``--completion`` tokens,
each with its sampler log-prob and 8 ``"token_id:N"`` top log-probs (vLLM 0.26's shape), from a response
prepared once. The loop runs in this process with a cheap reward (``--reward accuracy``: `accuracy_reward` and its
math-verify pool, on answers "The answer is i."); a consumer drains the rollout queue (and the metrics queue, as
the trainer does) and reports consumption, so the staleness allowance never binds. The result also gives the CPU
per queued rollout of this process and of its reward processes. Target: >= 50,000 tokens/s.

``--queue process`` (the default) makes the rollout and metrics queues ``multiprocessing`` queues read by a
consumer process, as between the real worker and the trainer: samples are pickled on the way (in the
queue's feeder thread, inside the worker process). ``--queue thread`` keeps them in this process
(``queue.Queue`` and a consumer thread: no pickling; the measurement before 2026-11-30).

P6_PROFILE=1 profiles the loop thread with cProfile and prints the top functions; P6_PROFILE_OUT=path also
writes the stats file (read it with ``pstats``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def serve(port: int, completion: int, ready, answers: list[list[int]] | None = None) -> None:
    """The synthetic server: fixed answers, no model. ``answers``: choice i's tokens start with ``answers[i]``
    (for ``--reward accuracy``: "The answer is i."), padded to ``completion`` tokens."""
    from aiohttp import web

    def choice_of(i: int) -> dict:
        head = list(answers[i % len(answers)])[:completion] if answers else []
        tokens = head + [100 + (k % 50) for k in range(completion - len(head))]
        return {"index": i, "text": "", "token_ids": tokens, "finish_reason": "length",
                "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-1.0] * completion,
                             "top_logprobs": [{f"token_id:{t + k}": -1.0 - k for k in range(8)} for t in tokens]}}
    bodies: dict[int, bytes] = {}  # one prepared answer per n (a request with n gets n choices, issue #41)

    async def completions(request):
        n = int(json.loads(await request.read()).get("n", 1))
        body = bodies.get(n)
        if body is None:
            body = bodies[n] = json.dumps({"id": "x", "object": "text_completion", "model": "synthetic",
                                           "choices": [choice_of(i) for i in range(n)]}).encode()
        return web.Response(body=body, content_type="application/json")

    async def models(request):
        return web.json_response({"data": [{"id": "synthetic", "max_model_len": 4096, "root": "synthetic"}]})

    async def ok(request):
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    ready.set()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def alternating_reward(completions, **kwargs):
    """Cheap reward with spread inside every group (no group is dropped)."""
    return [float(i % 2) for i in range(len(completions))]


class _Value:
    def __init__(self, value):
        self.value = value


def _drain(q) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def consume(buf, metrics, consumed, counted) -> None:
    """The trainer's side: take outcomes, count trained tokens from the second one on, report consumption.

    ``counted`` holds ``generated``, ``samples`` and ``start`` (``time.monotonic()`` of the first outcome;
    0 until then) as ``.value`` attributes: shared values when this runs in its own process.
    """
    while True:
        outcome = buf.get()
        if outcome is None:
            return
        _drain(metrics)
        if not counted["start"].value:
            counted["start"].value = time.monotonic()
            continue  # measure from the first queued group on (connections warm)
        counted["generated"].value += sum(s.num_trained_tokens for s in outcome.samples)
        counted["samples"].value += len(outcome.samples)
        consumed.value += sum(s.num_tokens for s in outcome.samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--queue", choices=("process", "thread"), default="process",
                    help="rollout queue to a consumer process (pickled, as in training) or thread (not pickled)")
    ap.add_argument("--group-requests", choices=("on", "off"), default="on",
                    help="one request per group with n = 8 (rollout.group_requests, issue #41) or one per rollout")
    ap.add_argument("--reward", choices=("cheap", "accuracy"), default="cheap",
                    help="cheap: a reward computed in the worker's thread; accuracy: accuracy_reward (math-verify in "
                         "its process pool) on answers 'The answer is i.' against a column of 3s")
    ap.add_argument("--tag", default="", help="suffix of the result file: P6<tag>.json")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "bench" / "results"))
    ns = ap.parse_args()

    import datasets

    from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
    from asyncgrpo_cli.testing import make_tiny_tokenizer
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig
    from asyncgrpo_cli.train.model_loading import prepare_tokenizer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    tokenizer = prepare_tokenizer(make_tiny_tokenizer())
    answers = None
    if ns.reward == "accuracy":  # choice i answers i: one right answer (3) in each group of 8
        answers = [tokenizer.encode(f"The answer is {i}.", add_special_tokens=False) for i in range(8)]
    server = ctx.Process(target=serve, args=(port, ns.completion, ready, answers), daemon=True)
    server.start()
    ready.wait(60)
    prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}],
                                           "answer": "3"} for i in range(512)])
    if ns.reward == "accuracy":
        from asyncgrpo_cli.rewards import accuracy_reward
        from asyncgrpo_cli.rewards.accuracy import warm_up_verification_pool

        warm_up_verification_pool()
        reward = accuracy_reward
    else:
        reward = alternating_reward
    cfg = AsyncGRPOConfig(output_dir="/tmp/p6", num_generations=8, max_completion_length=ns.completion,
                          num_sampler_logprobs=8, vllm_server_base_url=f"http://127.0.0.1:{port}",
                          max_concurrent_rollouts=ns.concurrency, vllm_server_timeout=60.0, report_to="none",
                          **({"group_requests": ns.group_requests == "on"} if "group_requests" in
                             AsyncGRPOConfig.__dataclass_fields__ else {}))
    errors = queue.Queue()
    if ns.queue == "process":
        buf, metrics = ctx.Queue(), ctx.Queue()
        consumed = ctx.Value("d", 0.0)
        counted = {"generated": ctx.Value("q", 0), "samples": ctx.Value("q", 0), "start": ctx.Value("d", 0.0)}
        consumer = ctx.Process(target=consume, args=(buf, metrics, consumed, counted), daemon=True)
    else:
        buf, metrics = queue.Queue(), queue.Queue()
        consumed = _Value(0.0)
        counted = {"generated": _Value(0), "samples": _Value(0), "start": _Value(0.0)}
        consumer = threading.Thread(target=consume, args=(buf, metrics, consumed, counted), daemon=True)
    loop = AsyncRolloutLoop(cfg, "synthetic", prompts, [reward], tokenizer, [tokenizer.eos_token_id],
                            buf, _Value(0), _Value(1e15), _Value(0.0), threading.Event(), errors, metrics,
                            consumed_tokens_value=consumed)
    consumer.start()
    profile = None
    if os.environ.get("P6_PROFILE"):
        import cProfile

        profile = cProfile.Profile()

    def run_loop():
        if profile is not None:
            profile.enable()
        try:
            asyncio.run(loop.run_async())
        finally:
            if profile is not None:
                profile.disable()

    runner = threading.Thread(target=run_loop, daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not counted["start"].value and time.monotonic() < deadline:
        time.sleep(0.05)
    import psutil

    me = psutil.Process()
    others = {server.pid, getattr(consumer, "pid", None)}

    def cpu_s() -> tuple[float, float]:
        """(this process, its reward processes): CPU seconds so far; the server and the consumer left out."""
        pool = 0.0
        for child in me.children(recursive=True):
            if child.pid not in others:
                with contextlib.suppress(psutil.Error):
                    times = child.cpu_times()
                    pool += times.user + times.system
        own = me.cpu_times()
        return own.user + own.system, pool

    generated0, samples0, t0 = counted["generated"].value, counted["samples"].value, time.monotonic()
    cpu0 = cpu_s()
    time.sleep(ns.seconds)
    cpu1 = cpu_s()
    generated = counted["generated"].value - generated0
    samples = counted["samples"].value - samples0
    elapsed = time.monotonic() - t0
    loop.stop()
    runner.join(30)
    buf.put(None)
    consumer.join(30)
    server.terminate()
    tps = generated / elapsed
    if profile is not None:
        import pstats

        if os.environ.get("P6_PROFILE_OUT"):
            profile.dump_stats(os.environ["P6_PROFILE_OUT"])  # for pstats callers / callees
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    result = {"target": ">= 50000", "generated_tokens_per_s": tps, "ratio": tps / 50000, "seconds": elapsed,
              "samples": samples, "rollouts_per_s": samples / elapsed, "group_requests": ns.group_requests,
              "queue": ns.queue, "reward": ns.reward, "completion_tokens": ns.completion,
              # CPU of the worker's process (the loop, its reward threads, the queue's feeder) and of its reward
              # processes, per rollout queued, over the same window; the server and the consumer not counted
              "worker_cpu_ms_per_rollout": round(1e3 * (cpu1[0] - cpu0[0]) / max(samples, 1), 4),
              "reward_processes_cpu_ms_per_rollout": round(1e3 * (cpu1[1] - cpu0[1]) / max(samples, 1), 4),
              "worker_cores": round((cpu1[0] - cpu0[0]) / elapsed, 3), "concurrency": ns.concurrency,
              "num_generations": 8, "top_logprobs": 8, "cpus": os.cpu_count(), "python": sys.version.split()[0],
              "date": datetime.date.today().isoformat()}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"P6{ns.tag}.json").write_text(json.dumps(result, indent=1))
    print(f"P6  {tps:,.0f} generated tokens/s accepted, scored and queued (target >= 50,000; ratio {tps / 50000:.2f}); "
          f"{samples / elapsed:,.0f} rollouts/s; worker {result['worker_cpu_ms_per_rollout']:.3f} ms CPU a rollout "
          f"({result['worker_cores']:.2f} cores), reward processes {result['reward_processes_cpu_ms_per_rollout']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
