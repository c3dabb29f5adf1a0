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
"""

from __future__ import annotations

import argparse
import datetime
import math
import json
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncgrpo_cli.rollout.types import TrainingSequence  # noqa: E402
from asyncgrpo_cli.train.loss import LossConfig  # noqa: E402
from asyncgrpo_cli.train.packed_loss import install_loss_head, row_loss  # noqa: E402
from asyncgrpo_cli.train.packing import TokenBudgetBatcher, pack_row  # noqa: E402
from asyncgrpo_cli.train.tree_attention import apply_tree_attention  # noqa: E402

SHAPES = {  # Qwen3 shapes (random weights are fine for speed); "tiny" checks the script on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}
VOCAB = 151936


DEVICE = "cuda"


def build_model(shape: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    return model


def make_samples(num_groups: int, group: int, completion: int, prompt: int, shared: bool, seed: int):
    """``num_groups`` GRPO groups of ``group`` samples; ``shared`` = the group's samples share their prompt."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        base = [rng.randrange(VOCAB) for _ in range(prompt)]
        for _ in range(group):
            p = base if shared else [rng.randrange(VOCAB) for _ in range(prompt)]
            ids = p + [rng.randrange(VOCAB) for _ in range(completion)]
            n = len(ids)
            trained = [0] * prompt + [1] * completion
            out.append(TrainingSequence(
                # uniform sampler log-probs: random weights give ratios near 1, so no token is masked and the
                # loss-equality check before timing is not vacuous
                input_ids=ids, trained_mask=trained, sampler_logprobs=[-math.log(VOCAB) if t else 0.0 for t in trained],
                advantage=rng.choice([-1.0, 1.0]), group_id=g, row_index=g, model_version=0,
                sampler_top_ids=[[rng.randrange(VOCAB) for _ in range(8)] if t else [] for t in trained],
                sampler_top_logprobs=[[-3.0] * 8 if t else [] for t in trained]))
            assert n == prompt + completion
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


def packed_step(model, rows, cfg):
    def run():
        total = sum(r.num_trained_tokens for r in rows)
        loss_sum = 0.0
        for row in rows:
            loss, _ = row_loss(model, row, cfg, total, 1)
            loss.backward()
            loss_sum += float(loss.detach())
        model.zero_grad(set_to_none=True)
        return loss_sum
    return run


def padded_step(model, samples, batch: int):
    """Stock transformers SDPA, padded [batch, max_len], full logits, one row per sample."""
    def run():
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
            logits = model.plain_forward(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            ratio = torch.exp(lp + math.log(VOCAB))
            loss = -(ratio * adv[:, 1:])[trained[:, 1:]].sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        model.zero_grad(set_to_none=True)
        return loss_sum
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--prompt-ratio", type=float, default=4.0)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--padded-batch", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "bench" / "results"))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (tiny shape)")
    ns = ap.parse_args()
    global DEVICE, VOCAB
    DEVICE = ns.device
    if ns.shape == "tiny":
        VOCAB = 512
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(ns.shape)
    plain_forward = model.forward
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backend = "flex" if DEVICE == "cuda" else "sdpa"
    apply_tree_attention(model, backend)
    install_loss_head(model)
    cfg = LossConfig(score_centering=False)
    prompt = int(ns.completion * ns.prompt_ratio)
    results = {}
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "shape": ns.shape,
            "date": datetime.date.today().isoformat(), "G": 8, "completion": ns.completion, "prompt": prompt,
            "token_budget": ns.budget, "steps": ns.steps}
    for target, shared in (("P1", True), ("P2", False)):
        samples = make_samples(ns.groups, 8, ns.completion, prompt, shared, seed=1)
        plans = TokenBudgetBatcher(ns.budget, 1).plan(samples)
        tree_rows = [pack_row(p.rows[0]) for p in plans]
        plain_plans = TokenBudgetBatcher(ns.budget, 1).plan(samples)  # same samples...
        plain_rows = []
        for p in plain_plans:  # ...laid out with nothing shared
            plain_rows.append(concat_rows([pack_row([s]) for s in p.rows[0]]))
        # plain packing needs more tokens per row: split plain rows to respect the budget
        ratio = sum(s.num_tokens for s in samples) / sum(r.num_tokens for r in tree_rows)
        l_tree = packed_step(model, tree_rows, cfg)()
        t_tree, _ = time_fn(packed_step(model, tree_rows, cfg), ns.steps)
        plain_split = []
        cur, cur_tokens = [], 0
        for s in samples:
            if cur and cur_tokens + s.num_tokens > ns.budget:
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
                               tree_trained_tokens_per_s=trained / t_tree, plain_trained_tokens_per_s=trained / t_plain,
                               ratio=t_plain / t_tree, loss_tree=l_tree, loss_plain=l_plain_split,
                               target=">= 3.2" if shared else ">= 0.97")
        if shared:
            model.plain_forward = plain_forward
            model.config._attn_implementation_backup = model.config._attn_implementation
            model.set_attn_implementation("sdpa")
            l_pad = padded_step(model, samples, ns.padded_batch)()
            t_pad, _ = time_fn(padded_step(model, samples, ns.padded_batch), max(3, ns.steps // 2))
            apply_tree_attention(model, backend)
            results["P4"] = dict(meta, padded_s=t_pad, tree_s=t_tree, ratio=t_pad / t_tree,
                                 padded_trained_tokens_per_s=trained / t_pad, tree_trained_tokens_per_s=trained / t_tree,
                                 loss_padded=l_pad, loss_tree=l_tree, target=">= 4")
    # M1: peak memory of one row of ~budget forwarded tokens, tree-packed groups vs plain packing.
    groups = make_samples(64, 8, ns.completion, prompt, True, seed=2)
    row = pack_row(TokenBudgetBatcher(ns.budget, 1).plan(groups)[0].rows[0])
    singles, tokens = [], 0
    for s in make_samples(256, 1, ns.completion, prompt, False, seed=3):
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
        peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 1
        peaks[name] = (peak, r.num_tokens)
    results["M1"] = dict(meta, tree_peak_bytes=peaks["tree"][0], tree_row_tokens=peaks["tree"][1],
                         plain_peak_bytes=peaks["plain"][0], plain_row_tokens=peaks["plain"][1],
                         ratio=peaks["tree"][0] / peaks["plain"][0], target="<= 1.2")
    for target, r in results.items():
        (out / f"{target}_{ns.shape}.json").write_text(json.dumps(r, indent=1))
    print(f"{'id':4} {'measured':>40} {'ratio':>8} {'target':>8}")
    for target, r in results.items():
        detail = {k: round(v, 1) for k, v in r.items() if k.endswith("tokens_per_s")}
        print(f"{target:4} {json.dumps(detail):>40} {r['ratio']:8.2f} {r['target']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
