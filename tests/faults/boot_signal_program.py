"""A stop signal to the trainer's process group while the rollout worker boots (tests/faults/test_stops.py).

``python boot_signal_program.py MODEL_DIR OUT_DIR``, run in its own session: the main thread starts a
`RolloutWorker` (an idle loop that only reports ready) while a second thread, as soon as the worker's pid
exists and that process is still in this process group (booting, before `bind_to_parent` gives it its own),
sends SIGINT to the whole group, as the CLI's supervisor does on Ctrl-C. Prints one JSON line: whether the
signal reached the booting worker, whether the worker came up anyway, and the signals this process saw.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop


class IdleLoop(AsyncRolloutLoop):
    """Reports ready at once and idles until stopped (no server needed)."""

    def __init__(self, **kwargs) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def run(self) -> None:
        self.ready_event.set()
        while not self.stopped:
            time.sleep(0.05)


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def main(model_dir: str, out: str) -> None:
    import datasets
    from transformers import AutoTokenizer

    from asyncgrpo_cli.rollout.worker import RolloutWorker
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

    seen: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    cfg = AsyncGRPOConfig(output_dir=out, num_generations=2, max_completion_length=4, num_sampler_logprobs=1,
                          vllm_server_base_url="http://127.0.0.1:9", report_to="none",
                          rollout_worker_timeout=120.0, vllm_server_timeout=60.0)
    worker = RolloutWorker(cfg, "tiny", datasets.Dataset.from_list([{"prompt": "hi"}]), [zero_reward],
                           AutoTokenizer.from_pretrained(model_dir), [0], loop_cls=IdleLoop)
    hit = {"booting": False}

    def interrupt_the_boot() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            proc = worker.process
            if proc is not None and proc.pid is not None:
                hit["booting"] = os.getpgid(proc.pid) == os.getpgrp()
                os.killpg(os.getpgrp(), signal.SIGINT)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=interrupt_the_boot, daemon=True)
    thread.start()
    ready, error = False, None
    try:
        worker.start(ready_timeout_s=120)
        ready = worker.process.is_alive()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"[:2000]
    thread.join(10)
    worker.stop()
    print(json.dumps({"booting": hit["booting"], "ready": ready, "error": error, "seen": seen}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
