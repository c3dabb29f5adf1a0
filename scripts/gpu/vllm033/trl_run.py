"""TRL's ``GRPOTrainer`` on the issue #42 stand-in, one step per row (run by ``realistic.py trl``).

    python3 scripts/gpu/vllm033/trl_run.py --mode colocate|server|none --model DIR --data FILE --steps N \\
        --per-step C --rows FILE.jsonl [--server-url URL] [--no-bf16]

``colocate``: ``use_vllm=True, vllm_mode="colocate"`` (vLLM inside this process, on the same GPU); ``server``:
``vllm_mode="server"`` against ``--server-url`` (started by the caller); ``none``: TRL's own transformers
generation, for the CPU check of this script only.

The settings mirror our job (`realistic.job_overrides`): the model (fp32 weights, as ours: TRL loads float32 unless
told otherwise, and ``bf16=True`` is mixed precision), ``num_generations`` 8, 512 completion tokens, learning rate,
bf16, gradient checkpointing, ``beta`` 0 and the ``dapo`` loss (both sides' defaults), a constant learning rate
(ours; TRL's default schedule is transformers' linear decay), `offline.number_reward`.
A step trains ``--per-step`` completions (a multiple of 8): ``per_device_train_batch_size`` 8 (one group per
micro-batch) times ``gradient_accumulation_steps``, generated in one batch per step (TRL's default
``steps_per_generation`` = ``gradient_accumulation_steps``: on-policy).

Rows (JSON lines, appended as they happen): ``{"versions": ...}`` first; per optimizer step ``{"step", "time"
(wall s), "completions", "completion_tokens", "generate_s", "train_s"}`` where completions and tokens are counted in
the reward call (every completion TRL generates is scored once), ``generate_s`` runs from the previous step's end
to that call (weight sync, generation, decoding) and ``train_s`` from it to the step's end; ``{"log": ...}`` for each
of TRL's logs; ``{"error", "traceback"}`` when it fails (the exit status is then 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
G = 8


def grpo_kwargs(mode: str, output_dir: str, steps: int, per_step: int, *, learning_rate: float, completion: int,
                max_model_len: int, server_url: str | None = None, gpu_memory_utilization: float = 0.3,
                bf16: bool = True) -> dict:
    """``GRPOConfig`` keyword arguments (module docstring). Raises ValueError: ``mode`` not colocate / server /
    none, ``per_step`` not a positive multiple of 8, or server mode without ``server_url``."""
    if mode not in ("colocate", "server", "none"):
        raise ValueError(f"--mode {mode!r}: use colocate, server or none")
    if per_step <= 0 or per_step % G:
        raise ValueError(f"--per-step {per_step}: must be a positive multiple of num_generations={G} (e.g. 48)")
    if mode == "server" and not server_url:
        raise ValueError("--mode server needs --server-url (e.g. http://127.0.0.1:8011)")
    kwargs = dict(output_dir=output_dir, max_steps=steps, learning_rate=learning_rate, num_generations=G,
                  max_completion_length=completion, per_device_train_batch_size=G,
                  gradient_accumulation_steps=per_step // G, bf16=bf16, gradient_checkpointing=True, beta=0.0,
                  loss_type="dapo", temperature=1.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, use_vllm=mode != "none")
    if mode != "none":
        kwargs.update(vllm_mode=mode, vllm_max_model_length=max_model_len,
                      vllm_gpu_memory_utilization=gpu_memory_utilization)
    if mode == "server":
        kwargs["vllm_server_base_url"] = server_url
    return kwargs


class Counter:
    """The reward function TRL calls (`offline.number_reward`), counting the completions and completion tokens
    it scores and when."""

    def __init__(self):
        self.completions = 0
        self.tokens = 0
        self.last_call = None

    def reward(self, completions, completion_ids=None, **kwargs) -> list[float]:
        import offline

        self.completions += len(completions)
        self.tokens += sum(len(ids) for ids in completion_ids or [])
        self.last_call = time.time()
        return offline.number_reward(completions)


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for dist in ("trl", "vllm", "torch", "transformers", "accelerate", "datasets"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--per-step", type=int, required=True)
    p.add_argument("--rows", type=Path, required=True)
    p.add_argument("--output-dir", default="/tmp/asyncgrpo_realistic/trl_out")
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--server-url")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--no-bf16", action="store_true")
    a = p.parse_args(argv)
    kwargs = grpo_kwargs(a.mode, a.output_dir, a.steps, a.per_step, learning_rate=a.learning_rate,
                         completion=a.completion, max_model_len=a.max_model_len, server_url=a.server_url,
                         gpu_memory_utilization=a.gpu_memory_utilization, bf16=not a.no_bf16)
    a.rows.parent.mkdir(parents=True, exist_ok=True)
    rows = open(a.rows, "a")

    def emit(record: dict) -> None:
        rows.write(json.dumps(record) + "\n")
        rows.flush()

    emit({"versions": versions(), "grpo_config": kwargs})
    try:
        from datasets import load_dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        counter = Counter()

        def number_reward(completions, completion_ids=None, **kw):  # TRL names a reward by its __name__
            return counter.reward(completions, completion_ids, **kw)

        class StepClock(TrainerCallback):
            def __init__(self):
                self.last_end, self.seen = time.time(), (0, 0)

            def on_train_begin(self, args, state, control, **kw):
                self.last_end = time.time()  # model and vLLM loaded: step 1's generate_s starts here

            def on_step_end(self, args, state, control, **kw):
                now = time.time()
                call = counter.last_call or now
                emit({"step": state.global_step, "time": now, "completions": counter.completions - self.seen[0],
                      "completion_tokens": counter.tokens - self.seen[1],
                      "generate_s": round(call - self.last_end, 3), "train_s": round(now - call, 3)})
                self.last_end, self.seen = now, (counter.completions, counter.tokens)

            def on_log(self, args, state, control, logs=None, **kw):
                emit({"log": {"step": state.global_step, **(logs or {})}})

        dataset = load_dataset("json", data_files=a.data, split="train")
        trainer = GRPOTrainer(model=a.model, reward_funcs=[number_reward], args=GRPOConfig(**kwargs),
                              train_dataset=dataset, callbacks=[StepClock()])
        emit({"started": time.time()})
        trainer.train()
    except BaseException as exc:  # noqa: BLE001 - the exact error is the result when it fails (KeyboardInterrupt too)
        emit({"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-6000:]})
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        rows.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))  # offline.number_reward
    sys.exit(main())
