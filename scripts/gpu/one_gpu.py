"""One GPU, real vLLM 0.26, started by `asyncgrpo train` itself (issue #17). Run by scripts/gpu/run_one_gpu.sh.

Phases (``python3 scripts/gpu/one_gpu.py train|bench``), each writing ``$OUT/one_gpu_<phase>.json``:

train
  1. ``asyncgrpo train +recipe=arith_vllm_1gpu`` in a pseudo-terminal (rich panels, captured to
     ``$OUT/run1_panels.txt``); once the run has passed step `INTERRUPT_AT_STEP`, a Ctrl-C is typed
     into the terminal (``\\x03``: SIGINT to the foreground process group, as a person would). Then
     ``nvidia-smi`` must list no compute process and no process of the run may be left.
  2. The same command with ``trainer.resume_from_checkpoint=<the checkpoint run 1 saved>``, to
     `MAX_STEPS` (>= 30 steps in this run), exit 0; panels in ``$OUT/run2_panels.txt``.
     Figures from its ``metrics.jsonl`` (weight-sync split, tokens/s, waiting share, reward) and the
     ``POST /update_weights`` lines of vLLM's log (one IPC sync per step).
bench
  3. A Qwen3-0.6B-shaped random model (bf16 checkpoint made here): ``asyncgrpo serve`` (colocated
     flags), then `make_weight_sync` (must pick `VllmIpcSync`) and `SYNCS` timed syncs: pause /
     transfer / resume split; the server's sampled-token log-probs against the trainer's before a
     perturbation, after it without a sync, and after a sync (the sync must close the gap); then, after a
     second perturbation, the same syncs packed (``sampler.weight_sync_packed``: one IPC handle per 1 GiB chunk)
     and the gap after them (``packed`` in the JSON).
  4. The arith run with the embedded sampler on the same GPU (``EMBEDDED_STEPS`` steps), for the
     comparison of generated tokens/s, trained tokens/s and the trainer's waiting share.

Environment: OUT, TRAIN_DEADLINE_S (phase train: wall-clock budget, default 520), PYTHONPATH with vLLM.
"""

from __future__ import annotations

import fcntl
import importlib.metadata as md
import json
import math
import os
import pty
import re
import signal
import statistics
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT") or "gpu_out")
WORK = Path("/tmp/asyncgrpo_one_gpu")
CLI = [sys.executable, "-m", "asyncgrpo_cli"]
RECIPE = ["+recipe=arith_vllm_1gpu", *os.environ.get("EXTRA_OVERRIDES", "").split()]
INTERRUPT_AT_STEP = 4
MAX_STEPS = int(os.environ.get("MAX_STEPS", 38))  # run 2 then trains >= MAX_STEPS - 8 steps (from step 4-7)
RESULT_PREFIX = os.environ.get("RESULT_PREFIX", "one_gpu")
SYNCS = 10
EMBEDDED_STEPS = 5
T0 = time.monotonic()
result: dict = {"date": time.strftime("%Y-%m-%d"), "phase": None}

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_e2e import summarize_metrics  # noqa: E402  (same figures as the 2-GPU run)


def train_overrides(run_dir: Path | str, max_steps: int = MAX_STEPS) -> list[str]:
    """The Hydra overrides of phase train's run 1 (run 2 adds the resume); also checked on CPU in CI."""
    return [*RECIPE, f"trainer.output_dir={run_dir}", f"trainer.max_steps={max_steps}", "logging.dashboard=rich"]


def bench_serve_overrides(model_dir: Path | str, port: int) -> list[str]:
    """The overrides of phase bench's ``asyncgrpo serve`` of the Qwen3-0.6B-shaped model (checked on CPU in CI)."""
    return [f"model.name={model_dir}", f"sampler.port={port}", "sampler.max_model_len=1024",
            "rollout.max_completion_length=512", "sampler.api_server_count=1", "sampler.extra_args=[--enforce-eager]",
            "staleness.max_concurrent_rollouts=64"]


def embedded_overrides(run_dir: Path | str) -> list[str]:
    """The overrides of phase bench's embedded-sampler run on the same GPU (checked on CPU in CI)."""
    return [*RECIPE, "sampler.backend=embedded", "sampler.device=cuda", "sampler.kv_cache_tokens=131072",
            "sampler.extra_args=[]", f"trainer.max_steps={EMBEDDED_STEPS}", f"trainer.output_dir={run_dir}",
            "logging.dashboard=plain"]


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{RESULT_PREFIX}_{result['phase']}.json").write_text(json.dumps(result, indent=1))


def elapsed() -> float:
    return round(time.monotonic() - T0, 1)


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for dist in ("vllm", "transformers", "accelerate", "ray"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def gpu_processes() -> list[str]:
    """``nvidia-smi``'s compute processes (pid, name, MiB): empty when nothing holds the GPU."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def leftover_processes() -> list[str]:
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        own = "one_gpu.py" in cmd or "vllm033/run" in cmd
        if p.info["pid"] != me and ("vllm serve" in cmd or "vllm.entrypoints" in cmd or "asyncgrpo_cli" in cmd) and not own:
            found.append(f"{p.info['pid']} {cmd[:160]}")
    return found


class PtyRun:
    """A command in a pseudo-terminal of ``cols`` x ``rows`` whose output is copied to ``log``; `ctrl_c`
    types a Ctrl-C into it (the kernel sends SIGINT to the terminal's foreground process group)."""

    def __init__(self, argv: list[str], log: Path, env: dict, cols: int = 160, rows: int = 48) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.master = master
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.log = open(log, "wb")
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.log.write(data)
            self.log.flush()

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def wait(self, timeout: float | None = None) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        self.log.close()
        return rc


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plain_text(path: Path) -> str:
    """The captured terminal output with ANSI escapes removed."""
    raw = path.read_bytes().decode("utf-8", errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Za-z0-9]|\x1b[=>]|\r", "", raw)


def sync_split(rows: list[dict]) -> dict:
    """Mean weight-sync seconds per step: total, pause, transfer, and the rest (prefix-cache reset + resume)."""
    def mean(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(xs) if xs else None

    total, pause, transfer = mean("perf/weight_sync_s"), mean("perf/weight_sync_pause_s"), mean("perf/weight_sync_transfer_s")
    barrier = mean("perf/weight_sync_barrier_s") or 0.0
    out = {"total_s": total, "pause_s": pause, "transfer_s": transfer}
    if None not in (total, pause, transfer):
        out["reset_and_resume_s"] = total - pause - transfer - barrier
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def copy_logs(run_dir: Path, prefix: str) -> None:
    for name in ("server.log", "trainer.log"):
        log = run_dir / "logs" / name
        if log.exists():
            (WORK / f"{prefix}_{name}").write_text("\n".join(log.read_text(errors="replace").splitlines()[-400:]))


# ------------------------------------------------------------------------------------------- phase train
def phase_train() -> int:
    deadline = float(os.environ.get("TRAIN_DEADLINE_S", 520))
    run_dir = WORK / "arith_vllm_1gpu"
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "48"}
    argv = [*CLI, "train", *train_overrides(run_dir)]
    result["gpu_processes_before"] = gpu_processes()

    # Run 1: Ctrl-C once past INTERRUPT_AT_STEP.
    t0 = time.monotonic()
    run = PtyRun(argv, WORK / "run1_panels.raw", env)
    ready_at = None
    interrupted_at = None
    while run.proc.poll() is None:
        status = read_status(run_dir)
        if ready_at is None and (run_dir / "logs" / "trainer.log").exists():
            ready_at = time.monotonic() - t0  # the trainer starts once vLLM answered /health and the doctor passed
        if interrupted_at is None and (status.get("step") or 0) >= INTERRUPT_AT_STEP:
            interrupted_at = status.get("step")
            run.ctrl_c()
        if time.monotonic() - T0 > deadline * 0.45 and interrupted_at is None:
            interrupted_at = status.get("step")
            run.ctrl_c()
        time.sleep(0.5)
    rc1 = run.wait()
    for _ in range(30):  # the driver frees a dead process's memory within a moment
        if not gpu_processes():
            break
        time.sleep(0.5)
    run1 = {"exit": rc1, "wall_s": round(time.monotonic() - t0, 1), "ctrl_c_at_step": interrupted_at,
            "trainer_started_after_s": round(ready_at, 1) if ready_at else None,
            "gpu_processes_after": gpu_processes(), "leftover_processes": leftover_processes(),
            "checkpoints": sorted(p.name for p in run_dir.glob("checkpoint-*"))}
    text = plain_text(WORK / "run1_panels.raw")
    (OUT / "run1_panels.txt").write_text(text)
    m = re.search(r"vLLM ready at \S+ \(([\d.]+) s\)", text)
    run1["server_start_s"] = float(m.group(1)) if m else None
    run1["status"] = read_status(run_dir).get("state")
    result["run1_interrupted"] = run1
    copy_logs(run_dir, "run1")
    save()
    print(f"== run 1: exit {rc1}, ctrl-c at step {interrupted_at}, checkpoints {run1['checkpoints']}, "
          f"gpu processes after: {run1['gpu_processes_after']} ({elapsed()} s)", flush=True)
    if not run1["checkpoints"]:
        return 1

    # Run 2: resume with the command run 1 printed ("resume with: asyncgrpo train ..."), as a user would.
    ckpt = run_dir / run1["checkpoints"][-1]
    resumed_from = int(ckpt.name.split("-")[-1])
    printed = re.findall(r"resume with: ((?:asyncgrpo|python -m asyncgrpo_cli) train .+)", text)
    result["run1_interrupted"]["printed_resume_command"] = printed[-1].strip() if printed else None
    if printed:
        import shlex

        words = shlex.split(printed[-1].strip())
        argv2 = [*CLI, *words[words.index("train"):], "logging.dashboard=rich"]
    else:
        argv2 = [*argv, f"trainer.resume_from_checkpoint={ckpt}"]
    t0 = time.monotonic()
    run = PtyRun(argv2, WORK / "run2_panels.raw", env)
    stopped_at_limit = False
    while run.proc.poll() is None:
        if time.monotonic() - T0 > deadline and not stopped_at_limit:
            stopped_at_limit = True
            run.ctrl_c()
        time.sleep(0.5)
    rc2 = run.wait()
    rows = [r for r in read_metrics(run_dir) if (r.get("step") or 0) > resumed_from]
    status = read_status(run_dir)
    text = plain_text(WORK / "run2_panels.raw")
    (OUT / "run2_panels.txt").write_text(text)
    m = re.search(r"vLLM ready at \S+ \(([\d.]+) s\)", text)
    server_log = (run_dir / "logs" / "server.log").read_text(errors="replace")
    run2_log = server_log.rsplit("\n$ ", 1)[-1]  # the supervisor writes "$ argv" at each start
    result["run2_resumed"] = {
        "exit": rc2, "wall_s": round(time.monotonic() - t0, 1), "stopped_at_limit": stopped_at_limit,
        "resumed_from_step": resumed_from, "final_step": status.get("step"),
        "final_model_version": status.get("model_version"),
        "steps_in_run": (status.get("step") or 0) - resumed_from,
        "server_start_s": float(m.group(1)) if m else None,
        "update_weights_requests": len(re.findall(r"POST /update_weights HTTP/1\.1\" 200", server_log)),
        "update_weights_requests_run2": len(re.findall(r"POST /update_weights HTTP/1\.1\" 200", run2_log)),
        "weight_sync_split_s": sync_split(rows),
        "gpu_processes_after": gpu_processes(), "leftover_processes": leftover_processes(),
        **summarize_metrics(rows, []),
    }
    copy_logs(run_dir, "run2")
    for name in ("metrics.jsonl", "training_curves.png", "completions.jsonl"):
        if (run_dir / name).exists():
            (OUT / name).write_bytes((run_dir / name).read_bytes())
    save()
    print(json.dumps(result, indent=1), flush=True)
    ok = (rc1 == 130 and rc2 == 0 and not run1["gpu_processes_after"]
          and result["run2_resumed"]["steps_in_run"] >= MAX_STEPS - 8)
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------- phase bench
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_qwen3_06b(out: Path, shape: dict | None = None, device: str = "cuda") -> Path:
    """A Qwen3-0.6B-shaped checkpoint with random bf16 weights (``initializer_range`` 0.2, so that its
    next-token distributions are peaked and a weight change shows in log-probs) and a word-level
    tokenizer covering all 151,936 ids (vLLM detokenizes whatever it samples)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists():
        return out
    vocab = {f"<t{i}>": i for i in range(151930)}
    vocab.update({"<|system|>": 151930, "<|user|>": 151931, "<|assistant|>": 151932, "<|tool|>": 151933})
    vocab.update({"<|endoftext|>": 151934, "<|im_end|>": 151935})
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE  # prompts are chat messages (README: Supported setups)
    config = Qwen3Config(vocab_size=151936, eos_token_id=151935, pad_token_id=151934, bos_token_id=None,
                         initializer_range=0.2, **(shape or QWEN3_06B))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started with ``start_new_session``), SIGKILL after 60 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def sampled_logprob_gap(url: str, model, prompt: list[int], seed: int) -> float:
    """Mean |server − trainer| log-prob of the tokens the server samples for ``prompt`` (temperature 1)."""
    import httpx
    import torch

    body = {"model": str(model.name_or_path), "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens = choice.get("token_ids") or [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    server = choice["logprobs"]["token_logprobs"]
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids).logits.float()[0, len(prompt) - 1:-1]
    mine = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].tolist()
    return statistics.fmean(abs(a - b) for a, b in zip(server, mine))


#: Where `phase_bench` leaves its packed-sync choice for `rollouts.py job` (``JOB_PACKED=auto``) on the same machine.
PACKED_CHOICE = Path("/tmp/asyncgrpo_rollouts/packed.txt")


def packed_choice(bench: dict) -> tuple[bool, str]:
    """Whether the job should sync packed (``sampler.weight_sync_packed=true``), from `phase_bench`'s figures: the
    packed sync took effect (its log-prob gap after a perturbed sync within 1.5x, or 0.05 nats, of the plain sync's)
    and its median sync is at least 10% shorter. Returns the choice and the reason, with the figures."""
    packed = bench.get("packed") or {}
    try:
        plain_gap, packed_gap = float(bench["logprob_gap_after_sync"]), float(packed["logprob_gap_after_sync"])
        plain_s, packed_s = float(bench["median_s"]["total_s"]), float(packed["median_s"]["total_s"])
    except (KeyError, TypeError, ValueError):
        return False, "the bench holds no packed figures (it failed or predates them): plain sync"
    if packed_gap > max(1.5 * plain_gap, plain_gap + 0.05):
        return False, f"the packed sync did not take effect (gap {packed_gap} nats against {plain_gap} plain): plain"
    if packed_s > 0.9 * plain_s:
        return False, f"packed sync {packed_s} s is not 10% shorter than plain {plain_s} s: plain"
    return True, f"packed sync {packed_s} s against plain {plain_s} s, gap {packed_gap} nats against {plain_gap}"


def phase_bench() -> int:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.sampler.client import SyncSamplerClient
    from asyncgrpo_cli.train.weight_sync import FullWeightSource, VllmIpcSync, make_weight_sync

    model_dir = make_qwen3_06b(WORK / "qwen3_06b_shape")
    port = 8011
    url = f"http://127.0.0.1:{port}"
    serve_argv = [*CLI, "serve", *bench_serve_overrides(model_dir, port)]
    dry = subprocess.run([*serve_argv, "--dry-run"], capture_output=True, text=True, timeout=120)
    bench: dict = {"model": "Qwen3-0.6B shape, random bf16 weights (596M parameters)", "serve_dry_run": dry.stdout}
    result["qwen3_06b_sync"] = bench
    log = open(WORK / "serve_06b.log", "w")
    server = subprocess.Popen(serve_argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    try:
        while True:
            if server.poll() is not None:
                bench["error"] = f"serve exited with {server.returncode}"
                save()
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 300:
                bench["error"] = "not ready after 300 s"
                save()
                return 1
            time.sleep(1)
        bench["server_start_s"] = round(time.monotonic() - t0, 1)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
        model.name_or_path = str(model_dir)
        client = SyncSamplerClient(url, timeout_s=300, max_retries=2)
        backend = make_weight_sync(client, output_dir=WORK / "bench_out", device=torch.device("cuda", 0))
        bench["backend"] = type(backend).__name__
        assert isinstance(backend, VllmIpcSync), bench["backend"]
        backend.init()
        prompt = list(range(20, 52))
        bench["logprob_gap_initial"] = round(sampled_logprob_gap(url, model, prompt, 1), 4)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * p.float().std() * 0.5)
        bench["logprob_gap_perturbed_unsynced"] = round(sampled_logprob_gap(url, model, prompt, 2), 4)
        source = FullWeightSource(model, dtype=torch.bfloat16)
        timings = []
        for version in range(1, SYNCS + 2):
            torch.cuda.synchronize()
            t = backend.sync(source, version)
            timings.append({"total_s": t.total_s, "pause_s": t.pause_s, "transfer_s": t.transfer_s,
                            "reset_and_resume_s": t.total_s - t.pause_s - t.transfer_s - t.barrier_s})
        bench["logprob_gap_after_sync"] = round(sampled_logprob_gap(url, model, prompt, 3), 4)
        bench["first_sync"] = {k: round(v, 4) for k, v in timings[0].items()}
        steady = timings[1:]
        bench["syncs_timed"] = len(steady)
        bench["median_s"] = {k: round(statistics.median(t[k] for t in steady), 4) for k in steady[0]}
        bench["max_total_s"] = round(max(t["total_s"] for t in steady), 4)
        bench["requests_per_sync"] = backend.requests
        bench["bytes_per_sync"] = sum(math.prod(m.shape) * 2 for m in source.metadata())
        # sampler.weight_sync_packed: the same syncs in packed chunks (one IPC handle per 1 GiB chunk), after a new
        # perturbation, so that the gap after them shows the packed sync took effect.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * p.float().std() * 0.5)
        packed = make_weight_sync(client, output_dir=WORK / "bench_out", device=torch.device("cuda", 0), packed=True)
        packed.init()
        bench["logprob_gap_perturbed_again"] = round(sampled_logprob_gap(url, model, prompt, 4), 4)
        timed = []
        for version in range(SYNCS + 2, 2 * SYNCS + 4):
            torch.cuda.synchronize()
            t = packed.sync(source, version)
            timed.append({"total_s": t.total_s, "pause_s": t.pause_s, "transfer_s": t.transfer_s,
                          "reset_and_resume_s": t.total_s - t.pause_s - t.transfer_s - t.barrier_s})
        bench["packed"] = {"logprob_gap_after_sync": round(sampled_logprob_gap(url, model, prompt, 5), 4),
                           "first_sync": {k: round(v, 4) for k, v in timed[0].items()},
                           "median_s": {k: round(statistics.median(t[k] for t in timed[1:]), 4) for k in timed[1]},
                           "requests_per_sync": packed.requests}
        bench["gpu_memory"] = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv"],
                                             capture_output=True, text=True).stdout
        client.close()
        del model
        torch.cuda.empty_cache()
    finally:
        stop_server(server)
        log.close()
        (WORK / "serve_06b.tail.log").write_text("\n".join((WORK / "serve_06b.log").read_text(errors="replace")
                                                            .splitlines()[-200:]))
    use_packed, why = packed_choice(bench)
    bench["packed_choice"] = {"packed": use_packed, "why": why}
    PACKED_CHOICE.parent.mkdir(parents=True, exist_ok=True)
    PACKED_CHOICE.write_text(f"sampler.weight_sync_packed={'true' if use_packed else 'false'}\n# {why}\n")
    save()
    print(json.dumps(bench, indent=1), flush=True)
    if os.environ.get("SKIP_EMBEDDED") == "1":
        return 0 if bench.get("backend") == "VllmIpcSync" else 1

    # The same arith run with the embedded sampler sharing the GPU.
    run_dir = WORK / "arith_embedded"
    argv = [*CLI, "train", *embedded_overrides(run_dir)]
    t0 = time.monotonic()
    with open(WORK / "embedded_train.txt", "w") as out:
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=330).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    rows = read_metrics(run_dir)
    result["embedded_same_gpu"] = {"exit": rc, "wall_s": round(time.monotonic() - t0, 1),
                                   "final_step": read_status(run_dir).get("step"),
                                   "weight_sync_split_s": sync_split(rows), **summarize_metrics(rows, [])}
    copy_logs(run_dir, "embedded")
    save()
    print(json.dumps(result["embedded_same_gpu"], indent=1), flush=True)
    return 0 if bench.get("backend") == "VllmIpcSync" and rc == 0 else 1


def main() -> int:
    phase = sys.argv[1] if len(sys.argv) > 1 else "train"
    result["phase"] = phase
    WORK.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    result["versions"] = versions()
    save()
    try:
        return phase_train() if phase == "train" else phase_bench()
    finally:
        result["phase_wall_s"] = elapsed()
        save()
        subprocess.run(["tar", "czf", str(OUT / f"logs_{phase}.tgz"), "-C", str(WORK), "--exclude=qwen3_06b_shape",
                        "--exclude=arith_vllm_1gpu", "--exclude=arith_embedded", "--exclude=bench_out", "."],
                       capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
