"""Deadline admission's waves at the realistic job's shape, simulated (issue #42; no GPU, no model, ~10 s).

    python scripts/bench/bench_deadline_waves.py [--out scripts/bench/results/deadline_waves.json]
        [--staleness 4,5,6,7,8] [--steps 60] [--order pessimistic,observed]

Drives the real `TokenAllowance` and `StaleSchedule` (the rollout worker's admission: the staleness allowance,
then deadline admission, on from the start as after the first stale drop) with a modelled server and trainer,
fitted to the twenty-first session's job (`scripts/gpu/results/vllm033/realistic_job_async_mps_kill9_s21.json`,
one H100, Qwen3-1.7B shape, MPS):

- the server decodes one token for every rollout in flight per decode step of ``a + b x in_flight`` seconds
  (``rollout/vllm_per_output_token_s``: 6.4 ms at 48 in flight, 9.7 at 104, 12.7 at 150, 19.1 at 240: a = 3.5 ms,
  b = 0.065 ms);
- every completion is 512 tokens (a random model runs to the limit), prompts 23 tokens, groups of 8;
- the trainer pulls 8 groups a step once the queue holds them (dropping any more than ``max_staleness`` behind,
  the trainer's rule), trains for 2.2 s plus 0.35 s of the rest of its step (the job's ``fwd_bwd_s`` and step),
  its first step 20 s (the compile).

Each ``max_staleness`` runs with each ``--order`` and ``--release`` (``staleness.deadline_release_versions``) of deadline admission (``staleness.deadline_order``:
``pessimistic``, the default, counts every committed token as pulled before a group in flight; ``observed`` counts
the groups started at a later version at the share seen to finish first, 0 here since every completion is as long;
the groups that finish in one decode step are taken in a random order, as a burst's groups finish on the GPU).
Figures per run over steps 6 to the end: mean step (s), the trainer's busy share (2.2 s of
training over the step's wall time: mean, lowest, steps under 70%), stale drops, and the mean rollouts in flight
at the trainer's pulls. What the model leaves out: the weight sync's pause, the server's speed-up while the trainer
is idle, and the trainer's token-budget rows (it pulls whole groups). On the GPU the same job gave busy 70% mean
(lowest 46%) at 4 and 85% (18 of 19 steps at 99-100%) at 8 (s21, s20); the model gives 72-73% and 85%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncgrpo_cli.rollout.allowance import TokenAllowance  # noqa: E402
from asyncgrpo_cli.rollout.stale_schedule import StaleSchedule  # noqa: E402

G, GROUPS_PER_STEP, PROMPT, COMPLETION = 8, 8, 23, 512
DECODE_A_S, DECODE_B_S = 0.0035, 0.000065
TRAIN_S, REST_S, FIRST_STEP_S = 2.2, 0.35, 20.0
BUSY_TARGET = 0.7


def simulate(max_staleness: int, steps: int, order: str = "pessimistic", release: int | None = None) -> dict:
    """One run of the model (module docstring); returns its figures and one row per trainer step. ``release``:
    ``staleness.deadline_release_versions`` (None: admission stays on, the default)."""
    rng = random.Random(0)
    allowance = TokenAllowance()
    schedule = StaleSchedule(max_staleness, order=order, release_after_versions=release)
    schedule.on_dropped_stale()  # deadline admission on, as after the first stale drop
    published = max(max_staleness, 1) * GROUPS_PER_STEP * G * (PROMPT + COMPLETION)
    clock, version, consumed, next_id = 0.0, 0, 0.0, 0
    in_flight: dict[int, tuple[int, list[int], list[int]]] = {}  # group -> (stamp, tokens left, lengths)
    queue: list[tuple[int, float]] = []  # (stamp, sample tokens) per finished group, in finishing order
    busy_until, ends, rows, drops = None, [0.0], [], 0
    while len(ends) <= steps:
        schedule.observe(version, consumed)
        while allowance.can_start_group(published):
            new = G * (allowance.expected_kept_tokens_per_rollout or 0.0)
            if not schedule.can_admit(allowance.expected_queue_tokens, new, published / max(max_staleness, 1)):
                break
            lens = [COMPLETION] * G
            allowance.on_group_started(G)
            schedule.on_group_started(next_id, version, new)
            in_flight[next_id] = (version, list(lens), lens)
            next_id += 1
        n = allowance.rollouts_in_flight
        clock += DECODE_A_S + DECODE_B_S * n if n else 0.01
        finishing_order = list(in_flight)
        rng.shuffle(finishing_order)  # groups admitted together finish in any order, as on the GPU
        for gid in finishing_order:
            stamp, left, lens = in_flight[gid]
            for i, tokens in enumerate(left):
                if tokens > 0:
                    left[i] = tokens - 1
                    if tokens == 1:
                        allowance.on_rollout_finished(PROMPT + lens[i])
            if all(t == 0 for t in left):
                del in_flight[gid]
                allowance.on_group_finished()
                sample_tokens = float(sum(PROMPT + x for x in lens))
                if schedule.on_group_finished(gid, version):
                    allowance.on_samples_discarded(sample_tokens, rollouts=G)
                else:
                    allowance.on_samples_queued(sample_tokens, rollouts=G)
                    queue.append((stamp, sample_tokens))
        if busy_until is not None and clock >= busy_until:
            version, busy_until = version + 1, None
            ends.append(clock)
        if busy_until is None:
            for item in [q for q in queue if version - q[0] > max_staleness]:
                queue.remove(item)
                consumed += item[1]
                allowance.on_samples_consumed(item[1])
                schedule.on_dropped_stale()
                drops += 1
            if len(queue) >= GROUPS_PER_STEP:
                pulled = queue[:GROUPS_PER_STEP]
                del queue[:GROUPS_PER_STEP]
                tokens = sum(q[1] for q in pulled)
                consumed += tokens
                allowance.on_samples_consumed(tokens)
                published = max(max_staleness, 1) * tokens
                busy_until = clock + (FIRST_STEP_S if len(ends) == 1 else TRAIN_S + REST_S)
                rows.append({"step": len(ends), "pulled_at_s": round(clock, 3),
                             "rollouts_in_flight": allowance.rollouts_in_flight})
    rows = rows[:len(ends) - 1]  # the pull after the last step's end starts a step the run does not finish
    for row, start, end in zip(rows, ends, ends[1:]):
        row["step_s"] = round(end - start, 3)
        row["busy"] = round(min(1.0, (FIRST_STEP_S if row["step"] == 1 else TRAIN_S) / (end - start)), 4)
    measured = rows[5:]
    busy = [r["busy"] for r in measured]
    return {"max_staleness": max_staleness, "order": order, "release_after_versions": release,
            "overtake_share": schedule.overtake_share, "steps": steps,
            "step_s_mean": round(statistics.mean(r["step_s"] for r in measured), 3),
            "busy_mean": round(TRAIN_S * len(measured) / sum(r["step_s"] for r in measured), 3),
            "busy_lowest": min(busy), "steps_under_target": sum(b < BUSY_TARGET for b in busy),
            "steps_measured": len(measured), "stale_drops": drops,
            "rollouts_in_flight_mean": round(statistics.mean(r["rollouts_in_flight"] for r in measured), 1),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "scripts/bench/results/deadline_waves.json"))
    parser.add_argument("--staleness", default="4,5,6,7,8")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--order", default="pessimistic,observed")
    parser.add_argument("--release", default="none",
                        help="staleness.deadline_release_versions values, comma-separated; none = stays on")
    args = parser.parse_args(argv)
    releases = [None if v == "none" else int(v) for v in args.release.split(",")]
    runs = [simulate(int(s), args.steps, order, release) for release in releases for order in args.order.split(",")
            for s in args.staleness.split(",")]
    for r in runs:
        release = "" if r["release_after_versions"] is None else f" release {r['release_after_versions']}"
        print(f"{r['order']:11s}{release} max_staleness {r['max_staleness']}: step {r['step_s_mean']:.2f} s, busy {r['busy_mean']:.0%} "
              f"(lowest {r['busy_lowest']:.0%}, {r['steps_under_target']}/{r['steps_measured']} steps under "
              f"{BUSY_TARGET:.0%}), {r['rollouts_in_flight_mean']:.0f} in flight, {r['stale_drops']} stale drops")
    result = {"issue": 42, "bench": "deadline_waves", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "versions": {"python": platform.python_version()},
              "command": "python scripts/bench/bench_deadline_waves.py " + " ".join(argv or sys.argv[1:]),
              "model": {"decode_s": f"{DECODE_A_S} + {DECODE_B_S} x in_flight", "train_s": TRAIN_S, "rest_s": REST_S,
                        "first_step_s": FIRST_STEP_S, "groups_per_step": GROUPS_PER_STEP, "num_generations": G,
                        "prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
                        "deadline_admission": "on from the start; with --release, off again after that many "
                                              "weight updates without a stale drop"},
              "target": f"trainer busy >= {BUSY_TARGET:.0%} of each step (issue #42)", "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
