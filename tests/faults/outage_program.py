"""Programs of the server-outage fault tests, run as real processes (tests/faults/test_server_outage.py).

``python outage_program.py server --events FILE -- <embedded sampler flags>``: the embedded sampler
(``python -m asyncgrpo_cli.sampler.embedded``) that also appends one line per weight update finished and
per generation request received to FILE (``<pid> <route>``), so a test can tell what a restarted server
saw first. ``--die-on ROUTE[@N]``: the first (N-th) request to ROUTE writes ``FILE.hit`` and SIGKILLs the server (kill -9
in the middle of a weight sync); ``--hang-on ROUTE``: it writes ``FILE.hit`` and never answers; a SIGTERM (the
parent-death signal) then ends the server at once.

``python outage_program.py train --model DIR --url URL --out DIR ...``: a Python-API training run
(`AsyncGRPOTrainer.train()`, no CLI supervisor) against that server; prints ``TRAINED <steps>`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

GENERATION_ROUTES = ("/v1/completions", "/inference/v1/generate")


def token_parity_reward(completion_ids, **kwargs):
    """Picklable reward with spread inside groups (random for a random model)."""
    return [float(bool(ids) and ids[0] % 2 == ids[-1] % 2) for ids in completion_ids]


def serve(events: str, argv: list[str], die_on: str | None = None, hang_on: str | None = None) -> int:
    from aiohttp import web

    from asyncgrpo_cli.sampler.embedded import __main__ as embedded
    from asyncgrpo_cli.sampler.embedded.server import EmbeddedServer

    build_app = EmbeddedServer.build_app
    # ``ROUTE@N``: the fault hits the N-th request to ROUTE (default 1). Every run pushes its weights once as
    # model version 0 before its first request, so "the weight sync after step 1" is /update_weights@2.
    fault_route, nth = (die_on or hang_on or "@1").rsplit("@", 1) if "@" in (die_on or hang_on or "") else \
        (die_on or hang_on, "1")
    die_on = fault_route if die_on else None
    hang_on = fault_route if hang_on else None
    seen = {"n": 0}

    def recording_app(self):
        app = build_app(self)

        @web.middleware
        async def record(request, handler):
            if request.path in GENERATION_ROUTES:
                _append(events, request.path)
            if request.path in (die_on, hang_on):
                seen["n"] += 1
            if request.path in (die_on, hang_on) and seen["n"] >= int(nth):
                with open(events + ".hit", "w") as f:
                    f.write(f"{os.getpid()} {request.path}\n")
                if request.path == die_on:
                    os.kill(os.getpid(), signal.SIGKILL)
                # like vLLM, die of the parent-death signal at once (the embedded server would first wait for
                # this request to end)
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, os._exit, 143)
                await asyncio.Event().wait()
            response = await handler(request)
            if request.path == "/finish_weight_update" and response.status == 200:
                _append(events, request.path)
            return response

        app.middlewares.append(record)
        return app

    EmbeddedServer.build_app = recording_app
    return embedded.main(argv)


def _append(path: str, route: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {route}\n")


def train(args: argparse.Namespace) -> int:
    import datasets

    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer

    rewards = [token_parity_reward]
    if args.accuracy:
        from asyncgrpo_cli.rewards import accuracy_reward

        rewards.append(accuracy_reward)
    prompts = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}],
                                           "answer": str(i + 3)} for i in range(16)])
    config = AsyncGRPOConfig(
        output_dir=args.out, max_steps=args.max_steps, num_generations=4, max_completion_length=8,
        num_sampler_logprobs=3, vllm_server_base_url=args.url, learning_rate=1e-2, save_strategy="no",
        logging_steps=1, report_to="none", max_staleness=2, vllm_server_timeout=args.timeout,
        rollout_worker_timeout=120.0, seed=0, optim="sgd", max_grad_norm=0.0, max_concurrent_rollouts=8,
        max_groups_without_signal=0)  # an outage job: the no-signal stop must not end it first (conftest.cli_argv)
    trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=rewards, args=config, train_dataset=prompts)
    result = trainer.train()
    print(f"TRAINED {result.global_step}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "server":
        p = argparse.ArgumentParser()
        p.add_argument("--events", required=True)
        p.add_argument("--die-on", default=None)
        p.add_argument("--hang-on", default=None)
        split = argv.index("--")
        known = p.parse_args(argv[1:split])
        return serve(known.events, argv[split + 1:], known.die_on, known.hang_on)
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--accuracy", action="store_true", help="add accuracy_reward (its math-verify process pool)")
    return train(p.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
