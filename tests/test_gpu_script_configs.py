"""Every config a GPU script runs is composed and passed through the checks `train`/`serve` run, on CPU (issue #24).

A GPU session is short and starts bare: a script refused by the project's own newer checks (seen:
``one_gpu.py bench``'s random model had no chat template, and its 2048-token default completion did not fit
``max_model_len`` 1024) wastes it. The scripts build their overrides with the functions imported here, so the
test sees exactly what they run. The one check that needs the GPU itself, transformers' bf16 test, is
switched off here with ``trainer.bf16=false`` (on the GPU the recipes keep bf16).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.run_checks import validate_run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
sys.path.insert(0, str(ROOT / "scripts" / "gpu" / "vllm033"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import one_gpu  # noqa: E402
import rollouts as vllm033_rollouts  # noqa: E402
import rollouts_two as vllm033_rollouts_two  # noqa: E402
import e1t_shared as vllm033_e1t_shared  # noqa: E402
import runs as vllm033_runs  # noqa: E402
import speed as vllm033_speed  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=1000000.0,
            rms_norm_eps=1e-6)
CPU_ONLY = ["trainer.bf16=false"]


def on_cpu(overrides: list[str]) -> list[str]:
    """``overrides`` with `CPU_ONLY` in place of their own values of the same keys (a key given twice is refused)."""
    keys = {o.split("=", 1)[0] for o in CPU_ONLY}
    return [*(o for o in overrides if o.lstrip("+").split("=", 1)[0] not in keys), *CPU_ONLY]


@pytest.fixture(scope="module")
def shaped_model(tmp_path_factory) -> Path:
    """The bench scripts' random model (same tokenizer, chat template and vocabulary), at a tiny width."""
    return one_gpu.make_qwen3_06b(tmp_path_factory.mktemp("gpu_cfg") / "shaped", shape=TINY, device="cpu")


def check(overrides: list[str], command: str) -> None:
    cfg = compose(on_cpu(overrides))
    validate_run(cfg, command)  # raises ConfigError naming the refused field


@pytest.mark.parametrize("name,overrides", [
    ("one_gpu.py train", one_gpu.train_overrides("/tmp/x/arith_vllm_1gpu")),
    ("one_gpu.py train, resumed (run 2)", [*one_gpu.train_overrides("/tmp/x/r"), "trainer.resume_from_checkpoint=null"]),
    ("one_gpu.py bench, embedded run", one_gpu.embedded_overrides("/tmp/x/arith_embedded")),
    ("vllm033 runs.py masks", vllm033_runs.masks_overrides("/tmp/x/masks")),
    ("vllm033 run.sh train", [*one_gpu.train_overrides("/tmp/x/t", 16), "logging.log_completions=true",
                              "logging.num_completions_to_print=8"]),
    ("vllm_e2e.py train (2 GPUs)", ["+recipe=arith_vllm", "sampler.port=8000", "sampler.backend=external",
                                    "sampler.url=http://127.0.0.1:8000", "logging.dashboard=plain"]),
    ("run_arith.sh (2 GPUs)", ["+recipe=arith", "logging.dashboard=plain", "trainer.output_dir=/tmp/x/arith"]),
])
def test_train_configs_of_gpu_scripts_pass_the_train_checks(name, overrides):
    check(overrides, "train")


def _train_overrides(argv: list[str]) -> list[str]:
    """The Hydra overrides of a ``python -m asyncgrpo_cli train ...`` command line."""
    return argv[argv.index("train") + 1:]


@pytest.mark.parametrize("name,overrides,steps", [
    ("full", [], vllm033_speed.FULL_STEPS),
    *[(n, o, s) for n, (o, s, _) in vllm033_speed.ALL_NEW.items()],
    *[(n, o, s) for n, code, o, s, _ in vllm033_speed.OLD_VARIANTS if code == "new"],
])
def test_the_speed_runs_of_issue_33_pass_the_train_checks(name, overrides, steps):
    import bench_e2e

    external = None if name == "full" else vllm033_speed.URL
    argv = bench_e2e.train_argv(vllm033_speed.RECIPE, [], overrides, steps, Path("/tmp/x") / name, external)
    check(_train_overrides(argv), "train")


def test_the_speed_server_passes_the_serve_checks():
    argv = vllm033_speed.serve_argv()
    check(argv[argv.index("serve") + 1:], "serve")


@pytest.mark.parametrize("name", ["async", "sync"])
@pytest.mark.parametrize("winner", sorted(vllm033_rollouts.WINNER_OVERRIDES))
def test_the_rollout_jobs_of_issue_41_pass_the_train_checks(name, winner):
    argv = vllm033_rollouts.job_argv(name, Path("/tmp/x") / name, vllm033_rollouts.WINNER_OVERRIDES[winner])
    overrides = _train_overrides(argv)
    assert f"trainer.max_steps={vllm033_rollouts.STEPS}" in overrides
    assert ("staleness.max_staleness=0" in overrides) == (name == "sync")
    check(overrides, "train")


def test_the_rollout_screen_server_passes_the_serve_checks():
    argv = vllm033_rollouts.serve_argv()
    check(argv[argv.index("serve") + 1:], "serve")


@pytest.mark.parametrize("port", vllm033_rollouts_two.PORTS)
def test_the_two_engine_servers_pass_the_serve_checks(port):
    argv = vllm033_rollouts_two.serve_argv(port)
    assert f"sampler.port={port}" in argv
    check(argv[argv.index("serve") + 1:], "serve")


def test_the_e1t_beside_vllm_runs_compose_and_run(tmp_path):
    """Issues #41/#43: the server line passes the serve checks, the benchmark line runs (on this CPU, tiny shape)
    and writes the figures the script reads, and the ratios chain each phase to the one before."""
    argv = vllm033_e1t_shared.serve_argv()
    check(argv[argv.index("serve") + 1:], "serve")
    run_sh = (ROOT / "scripts/gpu/vllm033/run.sh").read_text()
    assert "e1t_shared) python3 scripts/gpu/vllm033/e1t_shared.py" in run_sh and "cuda_tests) timeout" in run_sh
    bench = vllm033_e1t_shared.bench_argv("stack_idle", tmp_path)
    done = subprocess.run([*bench, "--device", "cpu", "--shape", "tiny", "--steps", "2"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "E1t_tiny_stack_idle.json").read_text())
    early = data["figures"]["early"]
    assert early["cpu_s_per_step"] > 0 and early["cpu_wait_s_per_step"] >= 0 and 0 < early["host_cpu_busy_frac"] <= 1
    phases = {"stack_idle": {"fwd_bwd_s": 0.616}, "server_idle": {"error": "x"}, "server_busy": {"fwd_bwd_s": 1.232}}
    assert vllm033_e1t_shared.ratios(phases) == {"stack_idle_over_image_idle": 2.0,
                                                 "server_busy_over_stack_idle": 2.0}


def test_two_engines_are_compared_with_one_at_the_same_total_in_flight():
    runs = [{"variant": "one_1024", "rollouts_per_s": 400.0}, {"variant": "two_1024", "rollouts_per_s": 600.0},
            {"variant": "two_2048", "rollouts_per_s": 900.0}, {"variant": "one_2048_short", "error": "x"},
            {"variant": "two_2048_short", "rollouts_per_s": 1.0}]
    assert vllm033_rollouts_two.two_over_one(runs) == {"1024": 1.5}
    assert all(v[0] in (1, 2) and v[1] % v[0] == 0 for v in vllm033_rollouts_two.VARIANTS.values())


def test_the_two_engine_screen_reads_a_server_trees_cpu_seconds():
    """The server CPU gauge of the two-engine screen: a child that burns CPU shows in its parent's tree."""
    import subprocess

    burn = "import time,sys\nt=time.process_time()\nwhile time.process_time()-t<0.4: pass\nprint(1,flush=True)\nsys.stdin.read()"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess,sys; c=subprocess.Popen([sys.executable,'-c',{burn!r}],"
                               "stdin=sys.stdin); c.wait()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        before = vllm033_rollouts_two.cpu_seconds(parent)
        assert parent.stdout.readline().strip() == b"1"
        after = vllm033_rollouts_two.cpu_seconds(parent)
        assert len(after) == 2 and max(sec for _, sec in after.values()) >= 0.35
        use = vllm033_rollouts_two.cpu_use({pid: (n, 0.0) for pid, (n, _) in after.items()}, after, 1.0)
        assert use["busiest"][0][1] >= 0.35 and use["cores_all"] >= use["busiest"][0][1]
        assert vllm033_rollouts_two.cpu_use(before, after, 1.0)["cores_all"] >= 0.0
        assert vllm033_rollouts_two.cpu_seconds(None) == {}
    finally:
        parent.stdin.close()
        parent.wait(30)


def test_the_rollout_job_figures_of_issue_41():
    """The figures the GPU runs report, from synthetic metrics rows (one per step, 2 s apart, reward rising)."""
    rows = [{"step": s, "time": 100.0 + 2.0 * s, "perf/step_s": 1.0 if s <= 10 else 3.0, "reward": 0.02 * s,
             "rollout/rollouts_per_s": 500.0} for s in range(1, 41)]
    f = vllm033_rollouts.job_figures(rows, engine_rollouts_per_s=1000.0)
    assert f["step_s_median_2_10"] == 1.0 and f["step_s_median_31_40"] == 3.0 and f["late_over_early_step_s"] == 3.0
    assert f["time_to_reward_040_s"] == 38.0 and f["time_to_reward_045_s"] == 44.0  # steps 20 and 23
    assert f["time_to_reward_040_mean3_s"] == 40.0 and f["time_to_reward_045_mean3_s"] == 46.0  # steps 21 and 24
    assert f["generation_frac_of_engine"] == 0.5 and f["steps_per_s_2_20"] == 0.5
    per_step = vllm033_rollouts.job_rows(rows)
    assert per_step[0]["t_since_step1_s"] == 0.0 and per_step[-1]["step"] == 40
    rows[5].update({"rollout/held_deadline_frac": 0.7, "server/engine_core_cpu": 1.03, "perf/fwd_bwd_cpu_wait_s": 0.4})
    kept = vllm033_rollouts.job_rows(rows)[5]  # what held generation, the engine core, the trainer's host time
    assert kept["rollout/held_deadline_frac"] == 0.7 and kept["server/engine_core_cpu"] == 1.03
    assert kept["perf/fwd_bwd_cpu_wait_s"] == 0.4
    rows[6].update({"server/frontend_cpu": 3.2, "rollout/worker_cpu": 0.95, "host/cpu_busy_frac": 0.9})
    kept = vllm033_rollouts.job_rows(rows)[6]  # who used the host's cores
    assert (kept["server/frontend_cpu"], kept["rollout/worker_cpu"], kept["host/cpu_busy_frac"]) == (3.2, 0.95, 0.9)


def test_the_job_records_the_tree_attention_its_trainer_used(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text("W1204 warning\n  0%|  | 0/40 asyncgrpo: tree attention: flex (packing.attention=auto on cuda)\nx\n")
    assert vllm033_rollouts.tree_attention_line(log) == "tree attention: flex (packing.attention=auto on cuda)"
    log.write_text("no such line\n")
    assert vllm033_rollouts.tree_attention_line(log) is None
    assert vllm033_rollouts.tree_attention_line(tmp_path / "missing.log") is None


def test_one_window_of_few_groups_does_not_make_the_time_to_a_reward():
    """A step whose window scored a group or two can read far above the run (0.500 at step 2 of a run at 0.11-0.13,
    GPU 2026-12-04): the first crossing says 2 s, the sustained figure waits for three steps at the level."""
    rewards = [0.11, 0.50, 0.12, 0.13, 0.20, 0.38, 0.44, 0.46, 0.47, 0.50]
    rows = [{"step": s, "t_since_step1_s": 2.0 * (s - 1), "reward": r} for s, r in enumerate(rewards, start=1)]
    rows.insert(3, {"step": None, "t_since_step1_s": 5.0})  # a row without a reward is not a step of the mean
    assert vllm033_rollouts.time_to_reward_mean(rows, 0.45) == 16.0  # steps 7-9: (0.44 + 0.46 + 0.47) / 3
    assert vllm033_rollouts.time_to_reward_mean(rows, 0.40) == 14.0  # steps 6-8
    assert vllm033_rollouts.time_to_reward_mean(rows, 0.49) is None
    raw = [{"time": 50.0 + 2.0 * (s - 1), "reward": r} for s, r in enumerate(rewards, start=1)]
    assert vllm033_rollouts.time_to_reward_mean(raw, 0.45) == 16.0 and vllm033_rollouts.time_to_reward_mean([], 0.4) is None


def test_the_async_sync_pair_compares_steps_and_trained_groups(tmp_path):
    """Issue #41's pair: steps/s over the same range, and trained groups/s, since on-policy steps can be smaller."""
    def run(step_s: float, groups: int) -> dict:
        rows = [{"step": s, "t_since_step1_s": step_s * (s - 1), "batch/groups_per_step": groups}
                for s in range(1, 41)]
        return {"rows": rows, "figures": {"last_step": 40, "time_to_reward_040_s": 10.0 * step_s}}
    (tmp_path / "a.json").write_text(json.dumps(run(2.0, 64)))
    (tmp_path / "s.json").write_text(json.dumps(run(1.5, 40)))
    out = vllm033_rollouts.combine(str(tmp_path / "a.json"), str(tmp_path / "s.json"), str(tmp_path / "o.json"))
    assert out["steps_compared"] == [2, 40] and out["async_over_sync_steps_per_s"] == 0.75
    assert out["trained_groups_per_s"] == {"async": 32.0, "sync": 26.67}
    assert out["async_over_sync_groups_per_s"] == 1.2 and out["async_over_sync_time_to_reward"] == 0.75
    assert out["trainer_stalls"] == {"async": [], "sync": []}


def test_the_pair_names_a_step_that_stalled_the_trainer():
    """The seventh session's on-policy step 24 (17.2 s against ~2.3 s: a recompile) is named with its figures."""
    rows = [{"step": s, "perf/step_s": 2.3, "perf/fwd_bwd_s": 0.3, "perf/fwd_bwd_compile_count": 0.0}
            for s in range(1, 41)]
    rows[0].update({"perf/step_s": 15.2, "perf/fwd_bwd_compile_count": 4.0})  # step 1: outside the range
    rows[23].update({"perf/step_s": 17.2, "perf/fwd_bwd_s": 14.8, "perf/fwd_bwd_compile_count": 3.0})
    assert vllm033_rollouts.trainer_stalls(rows, 2, 40) == [
        {"step": 24, "step_s": 17.2, "median_step_s": 2.3, "fwd_bwd_s": 14.8, "compile_count": 3.0}]
    assert vllm033_rollouts.trainer_stalls(rows[:23], 2, 40) == [] and vllm033_rollouts.trainer_stalls([], 2, 40) == []


def test_the_pair_reads_its_steps_per_s_without_a_stall_and_bounds_it_by_the_on_policy_budget(tmp_path):
    """Issue #41 item 6: on-policy steps of 2.0 s (0.3 s training, 0.2 s weight sync, 1.5 s the rest) bound the
    asynchronous run at 2.0 / (1.5 + 0.2) (generation overlaps training, not the paused sync); a 12.0 s recompile
    at step 30 is counted at the median for the pair's steps/s without stalls, and left out of the budget."""
    def run(step_s: float) -> list[dict]:
        rows, t = [], 0.0
        for s in range(1, 41):
            length = 12.0 if step_s == 2.0 and s == 30 else step_s
            t += length if s > 1 else 0.0
            rows.append({"step": s, "t_since_step1_s": t, "perf/step_s": length, "perf/fwd_bwd_s": 0.28,
                         "perf/optimizer_s": 0.02, "perf/weight_sync_s": 0.2, "batch/groups_per_step": 64})
        return rows
    (tmp_path / "a.json").write_text(json.dumps({"rows": run(1.8), "figures": {"last_step": 40}}))
    (tmp_path / "s.json").write_text(json.dumps({"rows": run(2.0), "figures": {"last_step": 40}}))
    out = vllm033_rollouts.combine(str(tmp_path / "a.json"), str(tmp_path / "s.json"), str(tmp_path / "o.json"))
    assert [x["step"] for x in out["trainer_stalls"]["sync"]] == [30]
    assert out["async_over_sync_steps_per_s"] == round((38 * 2.0 + 10.0) / (38 * 1.8), 3)
    assert out["async_over_sync_steps_per_s_without_stalls"] == round(2.0 / 1.8, 3)
    bound = out["one_gpu_bound"]
    assert bound["stalls_left_out"] == [30]
    assert bound["sync_step_budget_s"] == {"steps": 37, "step": 2.0, "train": 0.3, "weight_sync": 0.2, "rest": 1.5}
    assert bound["async_over_sync_steps_per_s_max"] == round(2.0 / 1.7, 3) and bound["without_the_pause"] == round(2.0 / 1.5, 3)
    assert out["async_step_budget_s"]["rest"] == 1.3
    assert vllm033_rollouts.one_gpu_bound([], 2, 40) is None


def test_generation_against_the_served_engine_at_the_steps_length():
    """Issue #41's anchor: a rollout's time linear in its tokens between the screen's 12- and 44-token rows."""
    screen = {"runs": [{"variant": "group", "rollouts_per_s": 400.0, "completion_tokens_mean": 44.0},
                       {"variant": "group_short", "rollouts_per_s": 1000.0, "completion_tokens_mean": 12.0}]}
    assert vllm033_rollouts.served_rate(screen, 12.0) == pytest.approx(1000.0)
    assert vllm033_rollouts.served_rate(screen, 44.0) == pytest.approx(400.0)
    assert vllm033_rollouts.served_rate(screen, 28.0) == pytest.approx(1 / ((1 / 1000 + 1 / 400) / 2))
    assert vllm033_rollouts.served_rate(screen, 5.0) == pytest.approx(1000.0)  # clamped to the measured range
    rows = [{"step": s, "rollout/rollouts_per_s": 500.0 if s <= 10 else 700.0,
             "completions/mean_length": 44.0 if s <= 10 else 12.0} for s in range(1, 41)]
    g = vllm033_rollouts.generation_against_served(rows, screen)
    assert g["steps_2_10"] == 1.25 and g["steps_31_40"] == 0.7
    assert vllm033_rollouts.served_rate({"runs": []}, 20.0) is None


def test_serve_configs_of_gpu_scripts_pass_the_serve_checks(shaped_model):
    check(one_gpu.bench_serve_overrides(shaped_model, 8011), "serve")
    for api_servers in (8, 1):
        check(vllm033_runs.p9_serve_overrides(shaped_model, 8021, api_servers), "serve")
    check(["+recipe=arith_vllm", "sampler.port=8000"], "serve")  # vllm_e2e.py's serve


def test_the_hard_coded_lines_still_match_their_scripts():
    """The two shell/2-GPU entries above are written out here: fail when the scripts stop running them."""
    assert "train +recipe=arith logging.dashboard=plain" in (ROOT / "scripts/gpu/run_arith.sh").read_text()
    e2e = (ROOT / "scripts/gpu/vllm_e2e.py").read_text()
    assert 'RECIPE = ["+recipe=arith_vllm", f"sampler.port={PORT}"' in e2e
    assert 'EXTERNAL = ["sampler.backend=external", f"sampler.url={URL}"]' in e2e


def test_the_old_bench_config_is_refused(shaped_model, tmp_path):
    """The check bites: the bench's earlier serve overrides (no completion bound) are refused on CPU too."""
    from asyncgrpo_cli.config.rules import ConfigError

    old = [o for o in one_gpu.bench_serve_overrides(shaped_model, 8011) if not o.startswith("rollout.max_completion")]
    with pytest.raises(ConfigError, match="max_completion_length"):
        check(old, "serve")


@pytest.fixture(scope="module")
def offline_assets(tmp_path_factory) -> Path:
    """Issue #37's offline stand-ins (scripts/gpu/vllm033/offline.py) at the tiny shape, on CPU."""
    import offline

    dest = tmp_path_factory.mktemp("offline")
    offline.make_deepmath_data(dest / "deepmath.jsonl", n=64)
    offline.make_deepmath_model(dest / "deepmath_model", "tiny", "cpu")
    offline.make_moe_model(dest / "moe_model", "tiny", "cpu")
    return dest


def test_the_offline_deepmath_assets_load_as_the_recipe_reads_them(offline_assets):
    """The data in the recipe's schema (prompt messages, a solution accuracy_reward scores), a tokenizer whose
    prompts are real words, and the Qwen3.5 vision-language class the released checkpoint has."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from asyncgrpo_cli.rewards import accuracy_reward

    row = json.loads((offline_assets / "deepmath.jsonl").read_text().splitlines()[0])
    assert row["prompt"][0]["role"] == "user" and row["solution"].isdigit()
    tokenizer = AutoTokenizer.from_pretrained(offline_assets / "deepmath_model")
    ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.unk_token_id not in ids  # every word of the problem is in the vocabulary
    answer = [[{"role": "assistant", "content": f"The answer is \\boxed{{{row['solution']}}}"}]]
    assert accuracy_reward(answer, solution=[row["solution"]]) == [1.0]
    config = AutoConfig.from_pretrained(offline_assets / "deepmath_model")
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert "linear_attention" in config.text_config.layer_types
    moe = AutoConfig.from_pretrained(offline_assets / "moe_model")
    assert moe.architectures == ["Qwen3MoeForCausalLM"] and moe.num_experts > moe.num_experts_per_tok


def test_the_full_deepmath_shape_is_qwen35_2b_and_its_vocabulary_is_covered():
    import offline

    import bench_gdn

    shape = offline.QWEN35_2B_TEXT
    assert {k: shape[k] for k in bench_gdn.SHAPES["qwen3.5-2b"]} == bench_gdn.SHAPES["qwen3.5-2b"]
    vocab = offline.word_vocab(shape["vocab_size"])
    assert sorted(vocab.values()) == list(range(shape["vocab_size"]))  # vLLM detokenizes any sampled id


@pytest.mark.parametrize("run", ["deepmath", "lora", "moe"])
def test_the_runs_of_issue_37_pass_the_train_checks(offline_assets, run):
    import offline

    overrides = {"deepmath": offline.deepmath_overrides(offline_assets / "deepmath_model",
                                                        offline_assets / "deepmath.jsonl", "/tmp/x/deepmath"),
                 "lora": offline.lora_overrides("/tmp/x/lora"),
                 "moe": offline.moe_overrides(offline_assets / "moe_model", "/tmp/x/moe")}[run]
    check(overrides, "train")


@pytest.fixture(scope="module")
def realistic_assets(tmp_path_factory) -> Path:
    """Issue #42's stand-in (scripts/gpu/vllm033/realistic.py) at the tiny shape, on CPU."""
    import realistic

    work = tmp_path_factory.mktemp("realistic")
    realistic.build(work, shape="tiny", device="cpu", rows=64)
    return work


@pytest.mark.parametrize("name", ["async", "sync", "async_clip", "sync_clip", "async_mps", "async_clip_mps",
                                  "async_compile", "sync_compile", "async_stale8", "async_mps_stale8",
                                  "async_extmps", "async_mps_stale8_kill9", "async_nomps", "async_observed",
                                  "async_clip_release4", "async_clip_compile", "sync_clip_compile",
                                  "async_clip_stale8", "async_clip_overlap", "async_clip_compile_overlap",
                                  "async_clip_compile_lowprio"])
def test_the_realistic_jobs_of_issue_42_pass_the_train_checks(realistic_assets, name):
    """Both of issue #42's runs, as `realistic.py job NAME` runs them (the tiny model in place of the 1.7B one),
    through train's checks: a prompt of the data plus 512 completion tokens must fit max_model_len, the reward
    must import, one GPU is shared with vLLM."""
    import realistic

    overrides = realistic.job_overrides(*realistic.paths(realistic_assets), "/tmp/x/realistic", name)
    check(overrides, "train")
    cfg = compose(on_cpu(overrides))
    assert cfg.rollout.num_generations == 8 and cfg.rollout.max_completion_length == 512
    assert cfg.trainer.max_steps == realistic.STEPS + (realistic.KILL9_EXTRA_STEPS if "kill9" in name else 0)
    assert cfg.staleness.max_staleness == (0 if name.startswith("sync") else 8 if "stale8" in name else 4)
    assert cfg.trainer.activation_checkpointing and cfg.launch.colocate and cfg.sampler.backend.value == "vllm"
    clip = "clip" in name.split("_")
    assert cfg.loss.score_centering is not clip and (cfg.rollout.num_sampler_logprobs == 0) is clip
    assert cfg.trainer.torch_compile is ("compile" in name.split("_"))
    assert cfg.staleness.deadline_release_versions == (4 if "release4" in name.split("_") else None)
    assert cfg.sampler.weight_sync_overlap is ("overlap" in name.split("_"))  # one process, no check, no LoRA: allowed
    tags = name.split("_")
    # _extmps: the harness starts the daemon itself; _nomps: without it; else automatic (null)
    assert cfg.launch.mps is (True if "mps" in tags else False if {"extmps", "nomps"} & set(tags) else None)
    if cfg.launch.mps is not False:  # the plan on the one GPU it runs on (an H100), with nvidia-cuda-mps-control on PATH
        from asyncgrpo_cli.launch import mps
        from asyncgrpo_cli.launch.plan import build_launch_plan

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mps.shutil, "which", lambda program: f"/usr/bin/{program}")
            mp.setattr(mps, "gpu_uuid", lambda device: f"GPU-of-{device}")  # nvidia-smi's answer on the GPU
            plan = build_launch_plan(compose(overrides), gpu_count=1, gpu_memory=81559 * 2**20)
        assert not plan.problems and (plan.mps is not None) is (cfg.staleness.max_staleness > 0), plan.problems
        if plan.mps is None:
            return
        assert plan.trainer_env["CUDA_VISIBLE_DEVICES"] == "GPU-of-0" == plan.server.env["CUDA_VISIBLE_DEVICES"]
        assert plan.trainer_env.get("CUDA_MPS_CLIENT_PRIORITY") == ("1" if "lowprio" in tags else None)


def test_a_realistic_job_names_its_mode_and_tags_or_is_refused():
    """`realistic.py job|start|follow NAME`: ``async``/``sync`` with the `JOB_TAGS` (each once); anything else is
    refused with the names it takes, before a GPU call is spent on it."""
    import realistic

    assert realistic.job_variant("async") == ("async", [])
    assert realistic.job_variant("sync_clip_mps") == ("sync", ["clip", "mps"])
    assert realistic.detached_spec("async_mps")[:3] == (["job", "async_mps"], "realistic_job_async_mps.json",
                                                        "job_async_mps.log")
    assert realistic.detached_spec("trl") == realistic.DETACHED["trl"]
    for bad in ("fast", "async_turbo", "async_clip_clip", "clip"):
        with pytest.raises(ValueError, match="use async or sync"):
            realistic.job_variant(bad)
        assert realistic.detached_spec(bad) is None


def test_the_realistic_preflight_is_the_gpu_job_on_the_cpu(realistic_assets):
    """`realistic.py preflight` runs the GPU job's own overrides with only what a CPU needs changed: the embedded
    sampler, fp32, short completions and rows, no colocation; the rest (checkpointing, staleness, the reward,
    the step's rows) stays, and it passes train's checks on this machine."""
    import realistic

    job = realistic.job_overrides(*realistic.paths(realistic_assets), "/tmp/x/realistic_cpu", "sync")
    cpu = realistic.cpu_overrides(job, port=8151)
    changed = sorted(set(cpu) - set(job))
    assert changed == ["packing.token_budget=256", "rollout.max_completion_length=16", "sampler.backend=embedded",
                       "sampler.max_model_len=128", "sampler.port=8151", "trainer.bf16=false"]
    assert sorted(set(job) - set(cpu)) == sorted(o for o in job if o.split("=", 1)[0] in (
        "packing.token_budget", "rollout.max_completion_length", "sampler.backend", "sampler.max_model_len",
        "trainer.bf16", "launch.colocate"))
    assert "staleness.max_staleness=0" in cpu and "trainer.activation_checkpointing=true" in cpu
    check(cpu, "train")
    mps = realistic.job_overrides(*realistic.paths(realistic_assets), "/tmp/x/realistic_cpu", "async_mps")
    assert "launch.mps=true" in mps and not any(o.startswith("launch.mps") for o in realistic.cpu_overrides(mps))


def test_the_realistic_job_check_bites(realistic_assets):
    """A max_model_len that a prompt plus 512 completion tokens does not fit is refused on CPU too."""
    import realistic

    from asyncgrpo_cli.config.rules import ConfigError

    overrides = realistic.job_overrides(*realistic.paths(realistic_assets), "/tmp/x/realistic")
    with pytest.raises(ConfigError, match="max_model_len"):
        check([*overrides, "sampler.max_model_len=520"], "train")


def test_trl_runs_the_same_job_as_ours(realistic_assets):
    """TRL's GRPOConfig arguments (trl_run.py) against our job's: model settings, data, G, completion length, learning
    rate, bf16, checkpointing; a step of whole groups; server mode needs its URL."""
    import realistic
    import trl_run

    cfg = compose(realistic.job_overrides(*realistic.paths(realistic_assets), "/tmp/x/realistic"))
    kw = trl_run.grpo_kwargs("colocate", "/tmp/x/trl", 20, 48, learning_rate=cfg.trainer.learning_rate,
                             completion=cfg.rollout.max_completion_length, max_model_len=cfg.sampler.max_model_len)
    assert kw["num_generations"] == cfg.rollout.num_generations and kw["max_completion_length"] == 512
    assert kw["learning_rate"] == cfg.trainer.learning_rate and kw["vllm_max_model_length"] == 1024
    assert kw["bf16"] is cfg.trainer.bf16 is True and kw["gradient_checkpointing"] is True
    assert kw["use_vllm"] and kw["vllm_mode"] == "colocate" and kw["beta"] == cfg.loss.beta == 0.0
    assert kw["loss_type"] == cfg.loss.loss_type and kw["lr_scheduler_type"] == cfg.trainer.lr_scheduler_type
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 48
    with pytest.raises(ValueError, match="multiple of num_generations"):
        trl_run.grpo_kwargs("colocate", "/tmp/x", 20, 44, learning_rate=1e-6, completion=512, max_model_len=1024)
    with pytest.raises(ValueError, match="--server-url"):
        trl_run.grpo_kwargs("server", "/tmp/x", 20, 48, learning_rate=1e-6, completion=512, max_model_len=1024)
    argv = " ".join(__import__("realistic_trl").trl_argv("colocate", Path("/tmp/x/r.jsonl"), {"steps": 20, "per_step": 48}))
    assert f"--model {realistic.paths()[0]}" in argv and "--learning-rate 1e-06" in argv and "--completion 512" in argv


def test_the_full_realistic_shape_is_qwen3_17b_and_its_vocabulary_is_covered():
    import bench_packing
    import offline
    import realistic

    assert bench_packing.SHAPES["qwen3-1.7b"]["num_hidden_layers"] == 28 and realistic.VOCAB == 151936
    vocab = offline.word_vocab(realistic.VOCAB)
    assert sorted(vocab.values()) == list(range(realistic.VOCAB))  # vLLM detokenizes any sampled id


def test_the_realistic_phases_are_in_run_sh():
    text = (ROOT / "scripts/gpu/vllm033/run.sh").read_text()
    for line in ("realistic.py engine", 'realistic.py job "${1#realistic_job_}"', "realistic.py trl colocate",
                 "realistic.py trl server"):
        assert line in text


def test_the_rollout_screen_picks_the_ceiling_that_gains_and_the_job_line_composes():
    def row(inflight, tokens, rate):
        return {"variant": f"group_{inflight}", "n": 8, "logprobs": 8, "request_seeds": True, "tokens_route": False,
                "load_processes": 1, "inflight_rollouts": inflight, "max_tokens": tokens, "rollouts_per_s": rate}

    base = [row(512, 64, 450.0), row(512, 12, 1200.0)]
    choice = vllm033_rollouts.ceiling_choice([*base, row(1024, 64, 700.0), row(1024, 12, 1500.0),
                                              row(2048, 64, 900.0), row(2048, 12, 1800.0)])
    assert choice["inflight"] == 2048 and choice["gain"] == round((2.0 * 1.5) ** 0.5, 3)
    assert choice["overrides"] == ["staleness.max_concurrent_rollouts=2048", "sampler.extra_args=[--max-num-seqs,2048]"]
    for name in ("async_ceiling", "sync_ceiling"):
        check(_train_overrides(vllm033_rollouts.job_argv(name, Path("/tmp/x") / name, choice["overrides"])), "train")
    # A gain under 5% keeps the recipe's ceiling; a value missing one of its two rows is not compared.
    same = vllm033_rollouts.ceiling_choice([*base, row(1024, 64, 460.0), row(1024, 12, 1230.0), row(2048, 64, 9e9)])
    assert same["overrides"] == [] and same["inflight"] == 512 and 2048 not in same["gains"]
    small = vllm033_rollouts.ceiling_choice([*base, row(1024, 64, 600.0), row(1024, 12, 1300.0)])
    assert small["overrides"] == ["staleness.max_concurrent_rollouts=1024"]


@pytest.mark.parametrize("name", ["async_engines2", "sync_engines2"])
def test_the_rollout_job_with_two_servers_on_the_gpu_composes(name):
    argv = vllm033_rollouts.job_argv(name, Path("/tmp/x") / name)
    assert "sampler.engines=2" in argv and ("staleness.max_staleness=0" in argv) == name.startswith("sync")
    check(_train_overrides(argv), "train")


@pytest.mark.parametrize("name", ["async_engines2", "sync_engines2", "async", "sync"])
def test_the_rollout_jobs_with_the_packed_weight_sync_compose(name):
    """The next GPU run of issue #41 adds ``sampler.weight_sync_packed=true`` to both runs (NOTES, tenth session):
    the recipe's colocated vLLM takes it without a warning that it has no effect."""
    extra = ["staleness.max_concurrent_rollouts=1024", "sampler.weight_sync_packed=true"]
    overrides = _train_overrides(vllm033_rollouts.job_argv(name, Path("/tmp/x") / name, extra))
    check(overrides, "train")
    cfg = compose(overrides, validate=False)
    assert cfg.sampler.weight_sync_packed is True and cfg.launch.colocate is True and not cfg.peft.enabled
    assert str(getattr(cfg.sampler.backend, "value", cfg.sampler.backend)) == "vllm"  # else a no-effect warning


def test_the_bench_chooses_the_packed_sync_only_when_it_takes_effect_and_is_shorter():
    """``run.sh bench`` leaves its choice for ``JOB_PACKED=auto`` jobs (the eleventh session had to drop the bench for
    lack of device time, and a choice made by hand between calls costs the 30 s a machine waits)."""
    bench = {"logprob_gap_after_sync": 0.214, "median_s": {"total_s": 0.185},
             "packed": {"logprob_gap_after_sync": 0.22, "median_s": {"total_s": 0.06}}}
    assert one_gpu.packed_choice(bench)[0] is True
    stuck = {**bench, "packed": {**bench["packed"], "logprob_gap_after_sync": 30.5}}  # the server kept its weights
    assert one_gpu.packed_choice(stuck) == (False, "the packed sync did not take effect (gap 30.5 nats against 0.214 "
                                                   "plain): plain")
    slow = {**bench, "packed": {**bench["packed"], "median_s": {"total_s": 0.17}}}
    assert one_gpu.packed_choice(slow)[0] is False and "not 10% shorter" in one_gpu.packed_choice(slow)[1]
    committed = json.loads((ROOT / "scripts/gpu/results/vllm033/vllm033_bench.json").read_text())["qwen3_06b_sync"]
    assert one_gpu.packed_choice(committed) == (False, "the bench holds no packed figures (it failed or predates "
                                                       "them): plain sync")


def test_the_rollout_job_with_the_kept_in_flight_estimate_composes():
    """The next GPU run of issue #41 passes ``JOB_EXTRA=staleness.in_flight_estimate=kept`` to the async job."""
    extra = ["staleness.in_flight_estimate=kept"]
    overrides = _train_overrides(vllm033_rollouts.job_argv("async_kept", Path("/tmp/x") / "k", extra))
    assert "staleness.in_flight_estimate=kept" in overrides and "staleness.max_staleness=0" not in overrides
    check(overrides, "train")
    assert compose(overrides, validate=False).staleness.in_flight_estimate == "kept"

def _faults_module():
    """scripts/gpu/vllm033/faults.py, loaded by path: ``faults`` is also the name of tests/faults/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm033_faults", ROOT / "scripts/gpu/vllm033/faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fault_drills_of_issue_45_run_the_users_job():
    """The drills' job is the user's: the recipe, 40 steps, plain log, one window per step, through train's checks;
    `run.sh faults` runs them."""
    faults = _faults_module()
    argv = faults.job_argv(Path("/tmp/x/faults/run"))
    assert argv[1:4] == ["-m", "asyncgrpo_cli", "train"]
    overrides = _train_overrides(argv)
    for o in ("+recipe=arith_vllm_1gpu", "trainer.max_steps=40", "trainer.output_dir=/tmp/x/faults/run",
              "logging.dashboard=plain", "trainer.logging_steps=1"):
        assert o in overrides
    check(overrides, "train")
    assert "faults) python3 scripts/gpu/vllm033/faults.py" in (ROOT / "scripts/gpu/vllm033/run.sh").read_text()
    assert faults.drill_names(None) == list(faults.DRILLS) == faults.drill_names(" ")
    assert faults.drill_names("sigint, server_stop") == ["sigint", "server_stop"]
    with pytest.raises(ValueError, match="server_kil"):
        faults.drill_names("server_kil")


def test_the_fault_drills_pick_the_top_vllm_server_of_the_job():
    """vLLM 0.33 with 8 API servers: the supervisor's child ``vllm serve`` (pid 20), not its forked API servers
    (same command line), the retitled engine core, the supervisor (its recipe name holds "vllm") or the trainer."""
    faults = _faults_module()
    serve = ["/usr/bin/python3", "/tmp/vsite/bin/vllm", "serve", "/m", "--api-server-count", "8"]
    rows = [{"pid": 10, "ppid": 1, "argv": ["python3", "-m", "asyncgrpo_cli", "train", "+recipe=arith_vllm_1gpu"]},
            {"pid": 20, "ppid": 10, "argv": serve},
            {"pid": 30, "ppid": 10, "argv": ["python3", "-m", "accelerate.commands.launch", "-m",
                                             "asyncgrpo_cli.train.main", "--config", "/tmp/vllm/serve.yaml"]},
            {"pid": 21, "ppid": 20, "argv": ["VLLM::EngineCore"]},
            *[{"pid": 22 + i, "ppid": 20, "argv": serve} for i in range(8)]]
    assert faults.pick_server(rows) == 20
    module_form = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert faults.pick_server([rows[0], {"pid": 40, "ppid": 10, "argv": module_form}]) == 40
    assert faults.pick_server([rows[0], rows[2], rows[3]]) is None
    assert faults.SYNC_MARK.search('INFO:     127.0.0.1:45540 - "POST /pause?mode=keep HTTP/1.1" 200 OK')
    # engine_kill_sync's victim: the retitled engine core (the first GPU run's tree: padded with spaces)
    assert faults.engine_core(rows) == 21
    assert faults.engine_core([{"pid": 5816, "ppid": 5753, "argv": ["VLLM::EngineCore" + " " * 40]}]) == 5816
    assert faults.engine_core(rows[:3]) is None
    assert not faults.SYNC_MARK.search('Route: /pause, Methods: POST')
