"""What a user reads from a run, end to end on CPU against the embedded sampler (one 4-step run, logging every
2 steps): every SPEC §15 metric name, ``num_tokens`` as a running total across windows, ``log_completions``
(``completions.jsonl`` with rewards and advantages), and the ``report_to`` trackers read back with their own
packages (tensorboard event files; a wandb offline run's table)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import datasets
import pytest

from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
from asyncgrpo_cli.testing import make_tiny_model

# SPEC §15.2-15.8, every name as SPEC writes it ({reward_func_name} is this run's reward function).
REWARD = "parity_or_flat"
SPEC_METRICS = [
    # 15.2 training
    "num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "completions/clipped_ratio", "completions/duplicate_frac", "tools/call_frequency", "tools/failure_frequency",
    f"rewards/{REWARD}/mean", f"rewards/{REWARD}/group_std", "reward", "reward_group_std", "reward_kept",
    "reward_dropped", "frac_reward_zero_std", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max", "sampling/masked_mean",
    "sampling/sampler_mass", "entropy", "aux_loss", "clip_ratio/region_mean", "clip_ratio/low_mean",
    "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
    # 15.3 rollout
    "rollout/duration_s", "rollout/generated_tokens_per_s", "rollout/concurrency", "rollout/concurrency_cap",
    "rollout/turns_mean", "rollout/turns_max", "rollout/samples_per_rollout", "rollout/fork_frac",
    "rollout/drift_tokens_mean", "rollout/drift_tokens_max", "rollout/score_queue_size", "rollout/queue_size",
    "rollout/score_s", "rollout/score_wait_s", "rollout/score_block_s", "rollout/backpressure_s",
    "rollout/vllm_retry_count", "rollout/vllm_kv_cache_usage_frac", "rollout/vllm_running_requests",
    "rollout/vllm_queued_requests", "rollout/vllm_preemption_count",
    # 15.4 tools, 15.5 environments
    "tools/latency_s", "tools/{tool_name}/latency_s", "tools/{tool_name}/call_count",
    "tools/{tool_name}/failure_count", "tools/unknown_name_count", "tools/parallel_calls_mean",
    "tools/loop_exhausted_frac", "env/reset_s", "env/reward_s",
    # 15.6 samples
    "sample/forwarded_tokens_mean", "sample/forwarded_tokens_max", "sample/trained_tokens_mean",
    "sample/time_in_queue_s", "sample/staleness_mean", "sample/staleness_max", "sample/dropped_stale_count",
    # 15.7 batch
    "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step", "batch/samples_per_step",
    "batch/groups_per_step", "batch/microbatches_per_step", "batch/masked_token_frac", "batch/samples_per_row",
    "batch/row_tokens_mean", "batch/row_tokens_max", "batch/row_fill_frac", "batch/row_imbalance",
    "batch/packing_ratio", "batch/pad_frac", "batch/dropped_oversize_count",
    # 15.8 performance
    "perf/step_s", "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s", "perf/weight_sync_s",
    "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s", "perf/weight_sync_transfer_s",
    "perf/fwd_bwd_forwarded_tokens_per_s", "perf/wall_clock_forwarded_tokens_per_s",
    "perf/wall_clock_trained_tokens_per_s", "perf/fwd_bwd_mfu", "perf/wall_clock_mfu",
]
# Names a one-turn text run without tools cannot produce, with what they need (SPEC's "only logged when ...").
# The tool, environment and multi-turn names are checked where those paths run: tests/rollout/test_tools.py
# (tools/*, rollout/fork_frac, rollout/drift_tokens_*), tests/rollout/test_tools_env.py (env/*,
# tools/call_frequency, tools/loop_exhausted_frac); aux_loss in tests/train/test_moe_aux.py. The MFU pair needs a
# GPU of known peak and no CPU test checks it.
CONDITIONAL = {
    "tools/call_frequency": "tools or environment_factory", "tools/failure_frequency": "tools",
    "tools/latency_s": "tools", "tools/{tool_name}/latency_s": "tools", "tools/{tool_name}/call_count": "tools",
    "tools/{tool_name}/failure_count": "tools", "tools/unknown_name_count": "a call to an unknown tool",
    "tools/parallel_calls_mean": "tools", "tools/loop_exhausted_frac": "tools",
    "env/reset_s": "environment_factory", "env/reward_s": "an environment with get_reward",
    "rollout/fork_frac": "multi-turn rollouts", "rollout/drift_tokens_mean": "multi-turn rollouts",
    "rollout/drift_tokens_max": "multi-turn rollouts", "aux_loss": "a MoE model with router_aux_loss_coef",
    "perf/fwd_bwd_mfu": "a GPU of known peak FLOPS", "perf/wall_clock_mfu": "a GPU of known peak FLOPS",
    "rollout/vllm_preemption_count": "two /metrics polls (5 s apart) in the run",  # a short run may have one
}


def parity_or_flat(prompts, completion_ids, **kwargs):
    """Picklable reward: the same reward for every completion of prompts whose number is a multiple of 3 (their
    groups are dropped, so ``reward_dropped`` is logged), else the parity of the first token (spread inside a
    group, and 0 for a completion that is only EOS, id 2: short completions do not flatten the groups)."""
    out = []
    for prompt, ids in zip(prompts, completion_ids):
        number = int(prompt[-1]["content"].split()[2])
        out.append(1.0 if number % 3 == 0 else float(bool(ids) and ids[0] % 2 == 1))
    return out


def eos_prone(model_dir: Path) -> Path:
    """The tiny random model with its EOS logit scaled up (about 4% a token instead of 0.3%), so that some
    completions of 8 tokens end with EOS and the ``*_terminated_length`` metrics have something to measure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= 20.0
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 4-step run (logging_steps=2, log_completions, report_to tensorboard + wandb offline): its folder."""
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("logging")
    model = eos_prone(make_tiny_model(root / "tiny"))
    reporters = ["tensorboard"]
    try:
        import wandb  # noqa: F401

        reporters.append("wandb")
    except ImportError:
        pass
    server = ServerThread(ServerConfig(model=str(model), port=0, device="cpu", dtype="float32", max_model_len=96,
                                       max_logprobs=8)).start()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true", "WANDB_PROJECT": "asyncgrpo-test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out = root / "run"
    try:
        rows = [{"prompt": [{"role": "user", "content": f"what is {i} plus 3?"}]} for i in range(12)]
        args = AsyncGRPOConfig(output_dir=str(out), max_steps=4, logging_steps=2, num_generations=4,
                               max_completion_length=8, num_sampler_logprobs=3, vllm_server_base_url=server.url,
                               learning_rate=1e-3, save_strategy="no", report_to=reporters, max_staleness=1,
                               vllm_server_timeout=120.0, rollout_worker_timeout=120.0, seed=0, optim="sgd",
                               max_grad_norm=0.0, log_completions=True, num_completions_to_print=3)
        trainer = AsyncGRPOTrainer(model=str(model), reward_funcs=[parity_or_flat], args=args,
                                   train_dataset=datasets.Dataset.from_list(rows))
        trainer.train()
    finally:
        server.stop()
        if "wandb" in reporters:
            import wandb as wandb_module

            wandb_module.finish()  # the offline run's files are complete, and no run stays open for later tests
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"out": out, "root": root, "reporters": reporters}


def windows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_spec_metric_is_logged(run):
    lines = windows(run["out"])
    assert [w["step"] for w in lines] == [2, 4]
    logged = set().union(*lines)
    missing = [n for n in SPEC_METRICS if n not in CONDITIONAL and n not in logged]
    assert not missing, f"SPEC §15 names never logged by a CPU run: {missing}"
    unexpected = [n for n in CONDITIONAL if n in logged and n != "rollout/vllm_preemption_count"]
    assert not unexpected, f"logged although their condition does not hold here: {unexpected}"


def test_each_window_logs_what_its_trained_groups_scored(run):
    """``reward_trained``: the mean total reward of the samples a window trained (scored in it or before), so that a
    window that scored no group still says a reward; it lies within the rewards' range (0 to 1 here)."""
    lines = windows(run["out"])
    assert all("reward_trained" in w for w in lines), [sorted(w) for w in lines]
    assert all(0.0 <= w["reward_trained"] <= 1.0 for w in lines), [w["reward_trained"] for w in lines]


def test_what_held_the_rollout_producer_is_logged_as_shares_of_the_window(run):
    # issue #41: rollout/held_{gate}_frac for every gate (rollout/holds.py), each a share of wall time, at most 1
    # in all; rollout/deadline_admission says whether the staleness schedule's deadline rule is on.
    from asyncgrpo_cli.rollout.holds import HOLD_GATES, held_metric

    # A window may hold no snapshot of the worker's (the last one, once generation stopped, on a loaded machine),
    # as for rollout/concurrency: every window that has them is checked, and one at least must.
    logged = [w for w in windows(run["out"]) if held_metric("allowance") in w]
    assert logged, "rollout/held_*_frac never logged"
    for w in logged:
        shares = [w[held_metric(g)] for g in HOLD_GATES]
        assert all(0.0 <= s <= 1.0 for s in shares), (w["step"], shares)
        assert sum(shares) <= 1.0 + 1e-6, (w["step"], shares)
        assert 0.0 <= w["rollout/deadline_admission"] <= 1.0


def test_num_tokens_is_the_running_total_across_windows(run):
    lines = windows(run["out"])
    # batch/forwarded_tokens_per_step is the mean over the window's 2 steps: 2 x it, summed, is every token so far.
    total = 0.0
    for w in lines:
        total += 2 * w["batch/forwarded_tokens_per_step"]
        assert w["num_tokens"] == pytest.approx(total), w["step"]
    assert lines[1]["num_tokens"] > lines[0]["num_tokens"]
    assert 0 < lines[0]["perf/fwd_s"] < lines[0]["perf/fwd_bwd_s"]
    if os.path.exists("/proc/thread-self/schedstat"):  # host_time.py: the trainer's threads during fwd+bwd
        assert 0 < lines[0]["perf/fwd_bwd_cpu_s"] and lines[0]["perf/fwd_bwd_cpu_wait_s"] >= 0
    # host_load.py: the machine's busy cores and the rollout worker's, from the second reading on (0.25 s apart)
    later = [w for w in lines if "host/cpu_busy_frac" in w]
    assert later, "host/cpu_busy_frac never logged"
    for w in later:
        assert 0 < w["host/cpu_busy_cores"] <= os.cpu_count() + 0.5 and 0 < w["host/cpu_busy_frac"] <= 1
    assert any(w.get("rollout/worker_cpu", 0) > 0 for w in lines), "rollout/worker_cpu never logged"
    mains = [w for w in lines if "rollout/worker_main_cpu" in w]
    assert mains and all(0 <= w["rollout/worker_main_cpu"] <= w["rollout/worker_cpu"] + 1e-3 for w in mains)


def test_completions_jsonl_holds_text_rewards_and_advantages(run):
    records = [json.loads(line) for line in (run["out"] / "completions.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert set(steps) == {2, 4} and steps.count(2) <= 3 and steps.count(4) <= 3  # num_completions_to_print=3
    for r in records:
        assert r["prompt"][-1]["content"].startswith("what is") and isinstance(r["completion"], str)
        assert set(r["rewards"]) == {REWARD} and r["reward"] == pytest.approx(r["rewards"][REWARD])
        assert r["advantage"] is not None or r["reward"] is None
        assert isinstance(r["dropped"], bool) and r["model_version"] >= 0


def test_tensorboard_events_read_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(run["out"] / "runs" / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, "report_to=tensorboard wrote no event file under output_dir/runs"
    acc = EventAccumulator(os.path.dirname(files[0]), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert "train/reward" in scalars and "train/num_tokens" in scalars and "train/perf/fwd_s" in scalars
    assert [e.step for e in acc.Scalars("train/num_tokens")] == [2, 4]
    text_tags = [t for t in acc.Tags()["tensors"] if t.startswith("completions")]
    assert text_tags, acc.Tags()["tensors"]
    events = acc.Tensors(text_tags[0])
    assert [e.step for e in events] == [2, 4]
    table = events[-1].tensor_proto.string_val[0].decode()
    assert "| step | prompt | completion | reward | advantage |" in table and "what is" in table


def test_wandb_offline_run_has_the_completions_table(run):
    if "wandb" not in run["reporters"]:
        pytest.skip("wandb is not installed")
    tables = glob.glob(str(run["root"] / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.table.json"))
    assert tables, "no wandb table in the offline run"
    content = json.loads(Path(sorted(tables)[-1]).read_text())
    assert content["columns"][:5] == ["step", "prompt", "completion", "reward", "advantage"]
    assert content["data"] and content["data"][0][1].startswith("what is")
