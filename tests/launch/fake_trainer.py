"""Stand-in for ``asyncgrpo_cli.train.main`` in supervisor tests.

``python fake_trainer.py --fake-mode MODE [--fake-pid-dir DIR] [--fake-steps N] ... --config PATH``
reads the supervisor's composed config (``--config``, as the real trainer does), and as rank 0 writes
``status.json``, ``metrics.jsonl`` and ``completions.jsonl`` into ``trainer.output_dir``. Modes:

- ok: N logging steps, then state ``done`` and exit 0;
- fail: one step, then a traceback on stderr and exit 3;
- hang: one step, then runs until SIGINT; on SIGINT prints ``fake trainer: got SIGINT``, writes a
  ``checkpoint-1`` folder, state ``saving`` and exits 0. With ``--fake-pid-dir`` each rank writes
  ``rank<R>.pid`` and rank 0 spawns a "rollout worker" that ignores SIGINT and SIGTERM (``worker.pid``),
  so only a group SIGKILL can end it.
- slowsave: as hang, but a complete ``checkpoint-1`` is there from the start and step 2 is trained; on SIGINT it
  creates ``.checkpoint-2.partial/`` and takes 60 s to save it (a second signal cuts the save).
- silent: as ok, but first reports a sampler server that does not answer: ``server_status`` is the line of the
  real `asyncgrpo_cli.train.server_watch.ServerWatch`, given the server pid the supervisor passed (if any), for 1 s.
- orphan: as hang, but like the real trainer: it follows the supervisor's pid
  (`asyncgrpo_cli.train.main._follow_supervisor`), SIGTERM stops it as SIGINT does, and its "rollout worker"
  is bound to it (`asyncgrpo_cli.rollout.worker.bind_to_parent`) instead of ignoring signals.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from omegaconf import OmegaConf


def write_status(out, **fields):
    status = {"state": "running", "step": None, "max_steps": None, "epoch": None, "num_train_epochs": None,
              "model_version": None, "queue_size": None, "concurrency": None, "concurrency_cap": None,
              "max_concurrent_rollouts": None, "kv_cache_usage_frac": None, "requests_running": None,
              "requests_waiting": None, "worker_heartbeat_age_s": 0.5, "num_processes": 1, "last_error": None,
              "started_at": START, "updated_at": time.time(), "pid": os.getpid()}
    status.update(fields)
    tmp = os.path.join(out, "status.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(status, fh)
    os.replace(tmp, os.path.join(out, "status.json"))


def metrics_line(step, reward):
    return {"step": step, "epoch": step / 10, "time": time.time(), "reward": reward, "reward_kept": reward,
            "reward_dropped": 0.0, "frac_reward_zero_std": 0.2, "completions/duplicate_frac": 0.0,
            "rewards/accuracy_reward/mean": reward, "rollout/generated_tokens_per_s": 100.0 + step,
            "perf/fwd_bwd_forwarded_tokens_per_s": 500.0, "perf/wall_clock_trained_tokens_per_s": 80.0,
            "perf/step_s": 1.0, "perf/rollout_wait_s": 0.01, "rollout/backpressure_s": 0.0,
            "rollout/queue_size": 4, "sample/staleness_mean": 0.5, "sample/staleness_max": 1,
            "sample/dropped_stale_count": 0}


def append(path, obj):
    with open(path, "a") as fh:
        fh.write(json.dumps(obj) + "\n")


def write_checkpoint(out, step):
    """A complete ``checkpoint-<step>`` as `asyncgrpo_cli.run.checkpoints` judges it."""
    from asyncgrpo_cli.run.state import save_rollout_state

    folder = os.path.join(out, f"checkpoint-{step}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "trainer_state.json"), "w") as fh:
        json.dump({"global_step": step}, fh)
    with open(os.path.join(folder, "model.safetensors"), "wb") as fh:
        fh.write(b"x")
    save_rollout_state(folder, position=step, num_prompts=10)


START = time.time()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fake-mode", default="ok")
    p.add_argument("--fake-pid-dir", default=None)
    p.add_argument("--fake-steps", type=int, default=3)
    args, rest = p.parse_known_args(sys.argv[1:])
    config = rest[rest.index("--config") + 1]
    cfg = OmegaConf.load(config)
    out = cfg.trainer.output_dir
    rank = int(os.environ.get("RANK", "0"))
    stop = {"sig": None}

    def on_sigint(signum, _frame):
        stop["sig"] = signum

    signal.signal(signal.SIGINT, on_sigint)
    if args.fake_mode == "orphan":
        from asyncgrpo_cli.train.main import _follow_supervisor

        signal.signal(signal.SIGTERM, on_sigint)
        _follow_supervisor()
    if args.fake_pid_dir:
        with open(os.path.join(args.fake_pid_dir, f"rank{rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    if rank != 0:
        while args.fake_mode in ("hang", "orphan", "slowsave") and stop["sig"] is None:
            time.sleep(0.05)
        return 0
    print(f"fake trainer: model {cfg.model.name} gguf {cfg.model.gguf_file} url {cfg.sampler.url}", flush=True)
    if args.fake_mode in ("hang", "orphan", "slowsave") and args.fake_pid_dir:
        code = ("import signal, time\n"
                "signal.signal(signal.SIGINT, signal.SIG_IGN)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "while True: time.sleep(0.2)\n")
        if args.fake_mode == "orphan":
            code = (f"from asyncgrpo_cli.rollout.worker import bind_to_parent\nbind_to_parent({os.getpid()})\n"
                    "import time\nwhile True: time.sleep(0.2)\n")
        worker = subprocess.Popen([sys.executable, "-c", code])
        with open(os.path.join(args.fake_pid_dir, "worker.pid"), "w") as fh:
            fh.write(str(worker.pid))
    write_status(out, state="starting", max_steps=args.fake_steps)
    if args.fake_mode == "slowsave":
        write_checkpoint(out, 1)  # there before the status says running
    if args.fake_mode == "silent":
        from asyncgrpo_cli.train.server_watch import SILENT, ServerWatch, server_pid_from_env

        now = [0.0]
        watch = ServerWatch(f"http://127.0.0.1:{cfg.sampler.port}", 60.0, probe=lambda url, t: (SILENT, "ReadTimeout"),
                            clock=lambda: now[0], server_pid=server_pid_from_env())
        now[0] = 16.0
        watch.check()
        print(f"fake trainer: server_status {watch.status()}", flush=True)
        write_status(out, state="running", max_steps=args.fake_steps, server_status=watch.status())
        time.sleep(1.0)  # several polls of the supervisor
    steps = args.fake_steps if args.fake_mode in ("ok", "silent") else 1
    for step in range(1, steps + 1):
        append(os.path.join(out, "metrics.jsonl"), metrics_line(step, 0.25 * step))
        append(os.path.join(out, "completions.jsonl"),
               {"step": step, "prompt": [{"role": "user", "content": f"What is {step}+1?"}],
                "completion": f"The answer is {step + 1}", "reward": 1.0})
        write_status(out, step=step, max_steps=args.fake_steps, model_version=step, queue_size=4, concurrency=8,
                     concurrency_cap=16, max_concurrent_rollouts=16, kv_cache_usage_frac=0.3)
    if args.fake_mode == "fail":
        print("Traceback (most recent call last):\nRuntimeError: fake trainer failure", file=sys.stderr, flush=True)
        write_status(out, state="failed", step=1, last_error="RuntimeError: fake trainer failure")
        return 3
    if args.fake_mode == "own_error":  # as `train.main` after the hang watchdog: its own error line, exit 1
        print("error: the sampler server at http://h:1 (pid 7) has not answered for 20 s: it is hung\n"
              "(checkpoint-1 holds the last completed step)", file=sys.stderr, flush=True)
        write_status(out, state="failed: ServerHungError: the sampler server at http://h:1 (pid 7) has not answered",
                     step=1, last_error="ServerHungError: the sampler server at http://h:1 (pid 7) has not answered")
        return 1
    if args.fake_mode == "slowsave":
        append(os.path.join(out, "metrics.jsonl"), metrics_line(2, 0.5))
        while stop["sig"] is None:
            write_status(out, step=2, max_steps=args.fake_steps)
            time.sleep(0.05)
        print(f"fake trainer: got {signal.Signals(stop['sig']).name}, saving checkpoint-2", flush=True)
        write_status(out, state="saving", step=2)
        os.makedirs(os.path.join(out, ".checkpoint-2.partial"))
        time.sleep(60.0)  # the test's second signal ends this
        write_checkpoint(out, 2)
        return 0
    if args.fake_mode in ("hang", "orphan"):
        while stop["sig"] is None:
            write_status(out, step=1, max_steps=args.fake_steps)
            time.sleep(0.05)
        print(f"fake trainer: got {signal.Signals(stop['sig']).name}, saving a checkpoint", flush=True)
        write_status(out, state="saving", step=1)
        time.sleep(1.0)  # a save that outlives accelerate's single-process launcher (it dies on SIGINT)
        os.makedirs(os.path.join(out, "checkpoint-1"), exist_ok=True)
        print("fake trainer: saved checkpoint-1", flush=True)
        return 0
    write_status(out, state="done", step=steps, max_steps=args.fake_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
