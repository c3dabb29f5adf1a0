"""A fault-suite job through the Python API: an in-process embedded sampler on a tiny model and an
`AsyncGRPOTrainer` on a local prompt file (one process tree: this process and its rollout worker).

    python -m tests.faults.api_job --model DIR --data FILE --out DIR [--max-steps N] [--resume] [--hang-save-at N]

``--hang-save-at N`` makes the save of step N hang after the weights are written (marker file
``<out>/hang-save-N`` appears), so a test can kill -9 the trainer in the middle of a save. Exit status:
the trainer's (0, 130 / 143 after SIGINT / SIGTERM), 1 when training raised.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--save-steps", type=int, default=1000)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hang-save-at", type=int, default=None)
    parser.add_argument("--worker-timeout", type=float, default=60.0)
    parser.add_argument("--reward", default="logged_parity")
    ns = parser.parse_args()

    import datasets

    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
    from tests.faults import rewards

    rows = [json.loads(line) for line in Path(ns.data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "index": r["index"]}
                                          for r in rows])
    hang_at = ns.hang_save_at

    class Trainer(AsyncGRPOTrainer):
        def _save_rng_state(self, output_dir):
            if hang_at is not None and self.state.global_step == hang_at:
                (Path(ns.out) / f"hang-save-{hang_at}").write_text(output_dir)
                time.sleep(3600)
            return super()._save_rng_state(output_dir)

    server = ServerThread(ServerConfig(model=ns.model, port=0, device="cpu", dtype="float32", max_model_len=128,
                                       max_logprobs=4,  # the run's folder: a kill -9 leaves nothing in /tmp
                                       weights_dir=str(Path(ns.out) / ".weights"))).start()
    try:
        args = AsyncGRPOConfig(output_dir=ns.out, max_steps=ns.max_steps, save_steps=ns.save_steps, num_generations=4,
                               max_completion_length=8, num_sampler_logprobs=3, vllm_server_base_url=server.url,
                               learning_rate=1e-2, logging_steps=1, report_to="none", max_staleness=2,
                               vllm_server_timeout=60.0, rollout_worker_timeout=ns.worker_timeout, seed=0,
                               optim="sgd", max_grad_norm=0.0, max_concurrent_rollouts=8,
                               activation_checkpointing=False,
                               max_groups_without_signal=0)  # a stop-path job: see cli_argv in conftest.py
        trainer = Trainer(model=ns.model, reward_funcs=[getattr(rewards, ns.reward)], args=args,
                          train_dataset=dataset)
        try:
            trainer.train(resume_from_checkpoint=True if ns.resume else None)
        except Exception:  # noqa: BLE001 - the test reads the message
            traceback.print_exc()
            return 1
        return trainer.exit_code
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
