"""Tool overlap in the rollout worker: sync tools on the thread pool must not serialise rollouts (SPEC §13.1).

    python scripts/bench/bench_tools.py --out scripts/bench/results

One group of ``--rollouts`` (256) rollouts runs through the real `AsyncRolloutLoop` against an instant scripted
server (`asyncgrpo_cli.testing.scripted_server`): every rollout makes ``--turns`` (3) tool turns, one call each, to a sync
tool that sleeps ``--sleep-ms`` (50) ms, then answers. The same group with a tool that returns at once gives the
generation time (rendering, requests, parsing, reconciliation). The check: wall ≤ 1.3 × (turns × sleep +
generation), i.e. the sleeps of all rollouts overlap. Writes ``tools.json`` and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import types
from pathlib import Path

import datasets

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.testing.scripted_server import ScriptedServer
from asyncgrpo_cli.testing import make_tiny_tokenizer
from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

SLEEP_S = [0.05]


def lookup(key: int) -> int:
    """Look a key up in a slow store.

    Args:
        key: the key.

    Returns:
        The value.
    """
    if SLEEP_S[0]:
        time.sleep(SLEEP_S[0])
    return key + 1


def alternating(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def script_for(turns: int):
    def script(prompt: str) -> str:
        if prompt.count("<tool_response>") < turns:
            return '<tool_call>\n{"name": "lookup", "arguments": {"key": 1}}\n</tool_call>'
        return "done"
    return script


def run_group(tokenizer, rollouts: int, turns: int, sleep_s: float) -> dict:
    """Seconds from the loop's first request to the scored group in the queue, with ``sleep_s`` per call."""
    SLEEP_S[0] = sleep_s
    server = ScriptedServer(tokenizer, script_for(turns)).start()
    buffer, metrics = queue.Queue(), queue.Queue()
    cfg = AsyncGRPOConfig(output_dir="/tmp/bench-tools", num_generations=rollouts, max_completion_length=64,
                          num_sampler_logprobs=1, vllm_server_base_url=server.url,
                          max_concurrent_rollouts=rollouts, vllm_server_timeout=60.0, report_to="none")
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "look up 1"}]}])
    loop = AsyncRolloutLoop(cfg, "scripted", dataset, [alternating], tokenizer, [tokenizer.eos_token_id], buffer,
                            types.SimpleNamespace(value=0), types.SimpleNamespace(value=1e15),
                            types.SimpleNamespace(value=0.0), threading.Event(), queue.Queue(), metrics,
                            tools=[lookup])
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        while not server.prompts:
            time.sleep(0.001)
        start = time.perf_counter()
        outcome = buffer.get(timeout=600)
        wall = time.perf_counter() - start
        retries = int(getattr(loop.client, "retry_count", 0))
    finally:
        loop.stop()
        thread.join(60)
        server.stop()
    requests = len(server.prompts)
    return {"wall_s": wall, "samples": len(outcome.samples), "requests_by_then": requests, "retries": retries}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--out", default=None, help="folder for tools.json (default: print only)")
    ns = ap.parse_args()
    tokenizer = make_tiny_tokenizer(tool_template=True)
    run_group(tokenizer, 8, ns.turns, 0.0)  # warm-up: imports, template compilation
    generation = run_group(tokenizer, ns.rollouts, ns.turns, 0.0)
    tools = run_group(tokenizer, ns.rollouts, ns.turns, ns.sleep_ms / 1000)
    bound = 1.3 * (ns.turns * ns.sleep_ms / 1000 + generation["wall_s"])
    result = {"bench": "tools", "rollouts": ns.rollouts, "tool_turns": ns.turns, "tool_sleep_s": ns.sleep_ms / 1000,
              "generation_wall_s": round(generation["wall_s"], 3), "tools_wall_s": round(tools["wall_s"], 3),
              "serial_tool_time_s": round(ns.rollouts * ns.turns * ns.sleep_ms / 1000, 2),
              "bound_s": round(bound, 3), "within_bound": tools["wall_s"] <= bound,
              "samples": tools["samples"], "sampler_retries": [generation["retries"], tools["retries"]]}
    print(json.dumps(result, indent=2))
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tools.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
