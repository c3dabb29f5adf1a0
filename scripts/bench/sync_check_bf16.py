#!/usr/bin/env python3
"""The weight-sync check against a bf16 server, on the CPU (issue #44 item 1; the eleventh session's GPU failure).

The eleventh session's GPU job (SmolLM2-135M, vLLM 0.33 in bf16, `sampler.check_weight_sync=true`) stopped at start:
after the perturbed sync the probe gap was 3.92 nats per token against a floor of 0.0075. This script asks whether a
sync that took effect can give that: the "server" here is a bf16 copy of the trainer's model, replaced by a fresh
copy at every sync (a sync that always takes effect), sampling the probe itself; the trainer computes in float32
under bf16 autocast, as the one-GPU recipe trains. Then the same with syncs that never reach the server.

    .venv/bin/python scripts/bench/sync_check_bf16.py [--model DIR] [--out FILE]

``--model`` defaults to the smoke recipe's exported SmolLM2-135M in the user cache (``asyncgrpo train
+recipe=smoke`` exports it once). Writes JSON: for each perturbation plan (the old fixed 0.5x, the escalating
`PERTURB_SCALES`) and each server (synced, never synced), the verdict and the four gaps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncgrpo_cli.config.models import cache_root  # noqa: E402
from asyncgrpo_cli.train import sync_check  # noqa: E402


def run(model_dir: Path, scales: tuple[float, ...], syncs: bool) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    server = {"model": copy.deepcopy(model).to(torch.bfloat16)}

    def sync(version: int) -> None:
        if syncs:
            server["model"] = copy.deepcopy(model).to(torch.bfloat16)

    @torch.no_grad()
    def sample(prompt: list[int], sampling) -> tuple[list[int], list[float]]:
        gen = torch.Generator().manual_seed(sampling.seed)
        ids, logprobs = list(prompt), []
        for _ in range(sampling.max_tokens):
            row = torch.log_softmax(server["model"](torch.tensor([ids])).logits.float()[0, -1], -1)
            token = int(torch.multinomial(row.exp(), 1, generator=gen))
            ids.append(token)
            logprobs.append(float(row[token]))
        return ids[len(prompt):], logprobs

    saved = sync_check.PERTURB_SCALES
    sync_check.PERTURB_SCALES = scales
    try:
        check = sync_check.SyncCheck(model, sync, sample, lambda obj: obj, sync_check.probe_prompt(tokenizer),
                                     autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        try:
            result = check.check_at_start(0)
        except sync_check.WeightSyncCheckError as exc:
            return {"status": "fail", "message": str(exc)}
        return {"status": result.status, "scale": result.scale, "synced": round(result.synced, 4),
                "apart": round(result.apart, 4), "follow": round(result.follow, 4), "back": round(result.back, 4)}
    finally:
        sync_check.PERTURB_SCALES = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=cache_root() / "models" / "SmolLM2-135M-Instruct.Q4_1")
    parser.add_argument("--out", type=Path, default=ROOT / "scripts/bench/results/sync_check_bf16_cpu.json")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        print(f"sync_check_bf16: no model at {args.model}; run `asyncgrpo train +recipe=smoke` once to export it, "
              f"or pass --model DIR", file=sys.stderr)
        return 2
    plans = {"fixed 0.5x (before the eleventh session)": (0.5,), "escalating": sync_check.PERTURB_SCALES}
    rows = [{"plan": plan, "scales": list(scales), "server": server,
             **run(args.model, scales, syncs=server == "synced every sync")}
            for plan, scales in plans.items() for server in ("synced every sync", "never synced")]
    out = {"what": "weight-sync check, trainer float32 + bf16 autocast against a bf16 copy as the server (CPU)",
           "model": str(args.model), "date": datetime.date.today().isoformat(),
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "command": "python scripts/bench/sync_check_bf16.py", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        print(json.dumps(row)[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
