"""Staleness bias: does the trained mix follow the data when rollouts differ in length (issue #28)?

    python scripts/bench/bench_staleness_bias.py --out DIR [--steps 40] [--label NAME] [--seed 0]
        [--mixes two_class,three_class] [--staleness 1,4] [--drop-frac 0.7]

(writes ``DIR/staleness_bias_NAME.json``; the committed figures, `scripts/bench/results/staleness_bias.json`,
were run with ``--steps 80``, one code tree after another per seed: see its ``command`` and NOTES.md.)

CPU, the embedded sampler in this process (a thread), a tiny random Qwen3-shaped model
(`asyncgrpo_cli.testing.make_tiny_model`) and a real `AsyncGRPOTrainer` with its spawned rollout worker.
Each prompt names its completion length ("len 40 ..."); the loop below asks the sampler for exactly that
many tokens (``ignore_eos``), so a length class is a property of the prompt, as a hard prompt is in real
data. Two mixes, each at ``max_staleness`` 1 and 4:

- ``two_class``: half the prompts generate 40 tokens, half 4 (the issue's workload);
- ``three_class``: a third each at 4, 16 and 40 tokens.

``--drop-frac F`` gives a share F of the prompts one reward for their whole group (dropped for zero std, never
trained: `some_groups_flat_reward`), as most of the one-GPU job's late groups are; deadline admission then counts
what rollouts in flight are expected to queue, not their tokens (issue #41). Default 0: every group has spread.

``num_generations=2``, ``max_concurrent_rollouts=16``, ``token_budget=256`` (one row of about 5 long or 15
short samples per step), SGD. The trainer subclass records every trained sample (length class, completion
tokens, staleness at the step that trains it) and every sample dropped stale. Figures per run:

- ``long_share_data`` / ``long_share_trained``: share of the longest class among the prompts of the data and
  among the trained samples;
- ``class_share_trained``: the same for every class;
- ``dropped_generated_token_frac``: generated (completion) tokens of samples dropped stale (by the trainer, and
  by the worker for groups that came back stale and were re-queued) / the same plus the generated tokens of the
  trained samples; ``dropped_stale_by_class`` counts the trainer's drops, ``requeued_stale_groups`` the worker's;
- ``trained_tokens_per_s``: trained (completion) tokens / wall seconds from the end of step 1 to the end of the
  last step (start-up excluded);
- ``staleness_max``: the largest staleness of a trained sample (must be <= ``max_staleness``).

Targets (issue #28): long share within 0.05 of the data, dropped generated tokens <= 5% at max_staleness=1,
throughput not lower than before the change.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MIXES = {"two_class": (4, 40), "three_class": (4, 16, 40)}


def length_of(prompt) -> int:
    """The completion length a prompt asks for: its user message starts with ``len N``."""
    return int(prompt[-1]["content"].split()[1])


def alternating_reward(completions, **kwargs):
    """Reward with spread inside every group (no group is dropped for zero std)."""
    return [float(i % 2) for i in range(len(completions))]


#: ``--drop-frac``: the share of prompts whose group gets no reward spread (dropped for zero std, never trained).
DROP_FRAC_ENV = "BENCH_STALENESS_DROP_FRAC"


def some_groups_flat_reward(completions, prompts=None, **kwargs):
    """`alternating_reward`, except for a share of prompts (``--drop-frac``, read from `DROP_FRAC_ENV`: the spawned
    worker inherits it) whose group gets one reward for all: dropped for zero std, as 65-75% of the one-GPU job's
    groups are late in its run. Which prompts: ``item × golden ratio mod 1 < share``, independent of the length
    class (item ``i`` asks for ``lengths[i % len(lengths)]`` tokens)."""
    share = float(os.environ.get(DROP_FRAC_ENV, "0"))
    item = int(prompts[0][-1]["content"].split()[3])
    if (item * 0.6180339887498949) % 1.0 < share:
        return [0.0 for _ in completions]
    return alternating_reward(completions)


def _loop_cls():
    from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
    from asyncgrpo_cli.rollout.types import Rollout

    class LengthLoop(AsyncRolloutLoop):
        """Generates exactly the length the prompt names."""

        async def generate_one(self, prompt, tools, group_id=0):
            sampling = dataclasses.replace(self.sampling, max_tokens=length_of(prompt), ignore_eos=True)
            result = await self.client.generate_turn(self.render_prompt(prompt), sampling, model=self.served_model())
            turn = result.to_turn_record()
            return Rollout(completion=[{"role": "assistant", "content": ""}], completion_ids=list(turn.output_ids),
                           turns=[turn])

    LengthLoop.__module__ = "bench_staleness_bias"
    LengthLoop.__qualname__ = "LengthLoop"
    return LengthLoop


def __getattr__(name):  # the spawned worker unpickles ``bench_staleness_bias.LengthLoop``
    if name == "LengthLoop":
        cls = _loop_cls()
        globals()["LengthLoop"] = cls
        return cls
    raise AttributeError(name)


def make_dataset(lengths: tuple[int, ...], n: int, seed: int):
    import datasets

    rng = random.Random(seed)
    rows = [{"prompt": [{"role": "user", "content": f"len {lengths[i % len(lengths)]} item {i}"}]} for i in range(n)]
    rng.shuffle(rows)
    return datasets.Dataset.from_list(rows)


def run_one(model_dir: Path, url: str, lengths: tuple[int, ...], max_staleness: int, steps: int, out_dir: Path,
            seed: int) -> dict:
    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer

    trained: list[tuple[int, int, int]] = []  # (length class, completion tokens, staleness)
    dropped: list[tuple[int, int]] = []
    step_ends: list[float] = []
    step_tokens: list[int] = []
    lengths_by_row: dict[int, int] = {}
    worker = {"dropped_generated": 0.0, "requeued": 0.0}

    class Trainer(AsyncGRPOTrainer):
        loop_cls = __getattr__("LengthLoop")

        def _drop_if_stale(self, sample):
            gone = super()._drop_if_stale(sample)
            if gone:
                dropped.append((lengths_by_row[sample.row_index], sample.num_trained_tokens))
            return gone

        def _finish_step(self, plan, *args, **kwargs):
            trained_version = args[-1]
            samples = [s for rows in plan.rows for row in rows for s in row]
            for s in samples:
                trained.append((lengths_by_row[s.row_index], s.num_trained_tokens, trained_version - s.model_version))
            step_ends.append(time.monotonic())
            step_tokens.append(sum(s.num_trained_tokens for s in samples))
            for snapshot in self.worker.drain_metrics():  # the worker's own stale drops (re-queued groups)
                worker["dropped_generated"] += snapshot.get("sample/dropped_stale_token_frac", (0, 0.0))[1]
                worker["requeued"] += snapshot.get("rollout/requeued_stale_count", (0, 0.0))[1]
                self.window.merge(snapshot)
            return super()._finish_step(plan, *args, **kwargs)

    dataset = make_dataset(lengths, 4000, seed)
    for i, row in enumerate(dataset):
        lengths_by_row[i] = length_of(row["prompt"])
    args = AsyncGRPOConfig(output_dir=str(out_dir), max_steps=steps, save_strategy="no", num_generations=2,
                           max_completion_length=max(lengths), num_sampler_logprobs=3, vllm_server_base_url=url,
                           learning_rate=1e-3, logging_steps=10**6, report_to="none", disable_tqdm=True, max_staleness=max_staleness,
                           vllm_server_timeout=60.0, rollout_worker_timeout=120.0, seed=seed, optim="sgd",
                           max_grad_norm=0.0, max_concurrent_rollouts=16, token_budget=256,
                           activation_checkpointing=False, max_groups_without_signal=0)
    trainer = Trainer(model=str(model_dir), reward_funcs=[some_groups_flat_reward], args=args, train_dataset=dataset)
    trainer.train()
    longest = max(lengths)
    n_trained = len(trained)
    shares = {str(c): sum(1 for t in trained if t[0] == c) / n_trained if n_trained else 0.0 for c in lengths}
    gen_trained = sum(t[1] for t in trained)
    gen_dropped = sum(d[1] for d in dropped) + worker["dropped_generated"]
    wall = step_ends[-1] - step_ends[0] if len(step_ends) > 1 else float("nan")
    return {
        "max_staleness": max_staleness,
        "steps": len(step_ends),
        "long_share_data": 1.0 / len(lengths),
        "long_share_trained": shares[str(longest)],
        "class_share_data": {str(c): 1.0 / len(lengths) for c in lengths},
        "class_share_trained": shares,
        "trained_samples": n_trained,
        "dropped_stale_samples": len(dropped),
        "dropped_stale_by_class": {str(c): sum(1 for d in dropped if d[0] == c) for c in lengths},
        "requeued_stale_groups": int(worker["requeued"]),
        "dropped_generated_token_frac": gen_dropped / (gen_dropped + gen_trained) if gen_dropped + gen_trained else 0.0,
        "trained_generated_tokens": gen_trained,
        "trained_tokens_per_s": sum(step_tokens[1:]) / wall if len(step_ends) > 1 else float("nan"),
        "staleness_max": max((t[2] for t in trained), default=0),
        "staleness_bound_holds": all(t[2] <= max_staleness for t in trained),
        "wall_s_after_step1": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "scripts" / "bench" / "results"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--label", default="run")
    parser.add_argument("--mixes", default="two_class,three_class")
    parser.add_argument("--staleness", default="1,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-frac", type=float, default=0.0,
                        help="share of prompts whose group has no reward spread (dropped for zero std); default 0")
    ns = parser.parse_args()
    os.environ[DROP_FRAC_ENV] = str(ns.drop_frac)

    from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
    from asyncgrpo_cli.testing import make_tiny_model

    sys.modules.setdefault("bench_staleness_bias", sys.modules[__name__])
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_staleness_") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model")
        server = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                           max_model_len=128, max_logprobs=4)).start()
        try:
            for mix in ns.mixes.split(","):
                for s in (int(x) for x in ns.staleness.split(",")):
                    t0 = time.monotonic()
                    r = run_one(model_dir, server.url, MIXES[mix], s, ns.steps, Path(tmp) / f"{mix}_{s}", ns.seed)
                    r["mix"] = mix
                    r["run_wall_s"] = time.monotonic() - t0
                    print(json.dumps(r), flush=True)
                    results.append(r)
        finally:
            server.stop()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    doc = {"benchmark": "staleness_bias", "label": ns.label, "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "workload": {"model": "tiny qwen3 (hidden 64, 2 layers), float32, CPU", "sampler": "embedded, in-process",
                        "mixes": {m: list(MIXES[m]) for m in ns.mixes.split(",")}, "num_generations": 2,
                        "max_concurrent_rollouts": 16, "token_budget": 256, "max_steps": ns.steps,
                        "optimizer": "sgd lr 1e-3", "cpus": os.cpu_count(),
                        "groups_without_spread_frac": ns.drop_frac},
           "targets": {"long_share_abs_diff_max": 0.05, "dropped_generated_token_frac_max_at_staleness_1": 0.05},
           "runs": results}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"staleness_bias_{ns.label}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
