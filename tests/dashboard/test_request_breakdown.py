"""Where a generation request's time goes (issue #41): vLLM's per-request histograms read from ``/metrics``,
their means per window, the breakdown the panels, the plain line and the generation-bound diagnosis show."""

from __future__ import annotations

import pytest

from asyncgrpo_cli.dashboard.diagnosis import bottleneck
from asyncgrpo_cli.dashboard.panels import request_rows
from asyncgrpo_cli.run.metrics_line import breakdown_text, metrics_line, request_breakdown
from asyncgrpo_cli.sampler.prometheus import parse_server_load
from asyncgrpo_cli.sampler.server_load import request_time_means


def scrape(decode_sum: float, decode_count: float, queue_sum: float = 0.0) -> str:
    """A vLLM 0.33 ``/metrics`` excerpt with two engines' decode and queue histograms."""
    lines = ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
             "# TYPE vllm:request_decode_time_seconds histogram",
             "# TYPE vllm:request_queue_time_seconds histogram"]
    for engine in ("0", "1"):
        lines += [f'vllm:request_decode_time_seconds_bucket{{engine="{engine}",le="+Inf",model_name="m"}} {decode_count / 2}',
                  f'vllm:request_decode_time_seconds_count{{engine="{engine}",model_name="m"}} {decode_count / 2}',
                  f'vllm:request_decode_time_seconds_sum{{engine="{engine}",model_name="m"}} {decode_sum / 2}',
                  f'vllm:request_queue_time_seconds_count{{engine="{engine}",model_name="m"}} {decode_count / 2}',
                  f'vllm:request_queue_time_seconds_sum{{engine="{engine}",model_name="m"}} {queue_sum / 2}']
    return "\n".join(lines) + "\n"


def test_request_times_summed_over_engines_and_differenced_per_window():
    first, second = parse_server_load(scrape(10.0, 20.0, 1.0)), parse_server_load(scrape(16.0, 30.0, 1.5))
    assert first.request_times == {"decode": (10.0, 20.0), "queue": (1.0, 20.0)}
    assert request_time_means(first, second) == pytest.approx({"decode": 0.6, "queue": 0.05})
    assert request_time_means(None, first) == pytest.approx({"decode": 0.5, "queue": 0.05})
    assert request_time_means(second, second) == {}  # no request finished in between
    assert request_time_means(second, first) == {}  # a restarted server's counters went back


WINDOW = {"rollout/rollouts_per_s": 700.0, "rollout/groups_per_s": 87.5, "rollout/request_s": 0.5,
          "rollout/parse_s": 0.002, "rollout/vllm_queue_s": 0.02, "rollout/vllm_prefill_s": 0.01,
          "rollout/vllm_decode_s": 0.3, "perf/rollout_wait_s": 3.0, "perf/step_s": 4.0}


def test_breakdown_names_the_binding_stage():
    b = request_breakdown(WINDOW)
    assert b["binding"] == "decode" and b["shares"]["decode"] == pytest.approx(0.3 / 0.502)
    assert b["shares"]["server+http"] == pytest.approx(0.17 / 0.502)
    assert breakdown_text(b) == "700 rollouts/s; decode 60% of a request"
    slow_http = dict(WINDOW, **{"rollout/request_s": 2.0})
    assert request_breakdown(slow_http)["binding"] == "server+http"
    # no vLLM stages (the embedded sampler): no shares, no binding stage; the rate alone is shown
    worker_only = {"rollout/rollouts_per_s": 0.648, "rollout/request_s": 25.4, "rollout/parse_s": 0.001}
    b = request_breakdown(worker_only)
    assert b["binding"] is None and b["shares"] == {} and breakdown_text(b) == "0.648 rollouts/s"
    assert dict(request_rows(worker_only))["request"] == "25.40 s (no per-stage times from this server)"
    assert request_breakdown({"reward": 1.0}) is None and breakdown_text(None) is None


def test_generation_bound_line_panels_and_plain_line_show_it():
    d = bottleneck(WINDOW)
    assert d.rule == "generation_bound" and d.text.startswith("generation-bound (700 rollouts/s; decode 60% of a request)")
    without = bottleneck({k: v for k, v in WINDOW.items() if not k.startswith("rollout/")})
    assert without.text.startswith("generation-bound: the trainer waits")
    rows = dict(request_rows(WINDOW))
    assert rows["rollouts/s · groups/s"] == "700 · 87.5"
    assert rows["request"].startswith("0.50 s (queue 4% prefill 2% decode 60% server+http 34% parse 0%)")
    assert request_rows({"reward": 1.0}) == []
    assert "gen — tok/s 700 rollouts/s" in metrics_line(WINDOW)
    bare = metrics_line({"step": 2, "perf/step_s": 3.0})  # the tenth session's trial: a window without either
    assert "| gen — (no generation figures in this window) |" in bare
    assert "| gen 0 tok/s 0 rollouts/s |" in metrics_line({"step": 2, "rollout/generated_tokens_per_s": 0.0,
                                                          "rollout/rollouts_per_s": 0.0})
    # The eleventh session's smoke job: 16 requests ran through a window in which none finished.
    busy = metrics_line({"step": 3, "rollout/generated_tokens_per_s": 0.0, "rollout/rollouts_per_s": 0.0,
                         "rollout/concurrency": 16.0})
    assert "| gen 0 tok/s 0 rollouts/s (16 in flight, none finished in this window) |" in busy, busy


def test_a_generation_bound_line_names_the_weight_syncs_pause():
    """The tenth session's pair: 0.25 s of sync in a 2.1 s step, through which the server is paused."""
    d = bottleneck(dict(WINDOW, **{"perf/weight_sync_s": 0.5}))
    assert "each weight sync pauses generation 0.50 s (12% of a step, perf/weight_sync_transfer_s)" in d.text
    assert "pauses" not in bottleneck(dict(WINDOW, **{"perf/weight_sync_s": 0.3})).text  # 7.5%: not named
    assert "pauses" not in bottleneck(WINDOW).text


def test_the_plain_line_shows_a_weight_sync_that_took_a_good_part_of_the_step():
    """Fresh-user trial (2026-12-04): a sync stalled on a stopped server made 'step 47.49 s | busy 100%' with no
    word of the 41.7 s it waited."""
    hung = {"step": 2, "perf/step_s": 47.49, "perf/weight_sync_s": 41.7, "perf/rollout_wait_s": 0.0}
    assert "step 47.49 s | weight sync 41.70 s | busy 100%" in metrics_line(hung)
    usual = {"step": 2, "perf/step_s": 2.3, "perf/weight_sync_s": 0.22, "perf/rollout_wait_s": 1.6}
    assert "weight sync" not in metrics_line(usual)
    short_step = {"step": 2, "perf/step_s": 0.9, "perf/weight_sync_s": 0.5}  # under 1 s: not shown
    assert "weight sync" not in metrics_line(short_step)


def test_the_plain_line_names_a_step_that_compiled():
    """A step that built torch.compile graphs (the first, or a shape the compiled code had not seen: a 14.8 s step
    in the one-GPU job) says so; one that built none says nothing."""
    base = {"step": 24, "perf/step_s": 17.2, "perf/fwd_bwd_s": 14.8}
    assert metrics_line({**base, "perf/fwd_bwd_compile_count": 3.0}).endswith("| compiled 3 graphs")
    assert "compiled 1 graph" in metrics_line({**base, "perf/fwd_bwd_compile_count": 1.0}, diagnosis="x")
    assert "compiled" not in metrics_line({**base, "perf/fwd_bwd_compile_count": 0.0})
    assert "compiled" not in metrics_line(base)


def test_the_plain_line_says_what_trained_beside_a_reward_of_zero():
    """The eleventh session's trial: ``reward 0 | ... | busy 100%`` left open what the busy trainer trained. Every
    group scored in that window had one reward for all its completions (none kept); what trained came from groups
    scored before, and the line now counts them."""
    window = {"step": 3, "reward": 0.0, "frac_reward_zero_std": 1.0, "perf/step_s": 2.0, "perf/rollout_wait_s": 0.0,
              "perf/wall_clock_trained_tokens_per_s": 1200.0, "batch/groups_per_step": 8.0}
    line = metrics_line(window, 10)
    assert "| reward 0 (the groups scored in this window all alike: none kept) |" in line, line
    assert "| train 1.2k tok/s (8 groups, scored earlier) |" in line and "busy 100%" in line
    some_kept = metrics_line(dict(window, frac_reward_zero_std=0.75, reward=0.1))
    assert "| reward 0.1 |" in some_kept and "none kept" not in some_kept
    assert "| train 1.2k tok/s (8 groups) |" in some_kept  # the second trial: say which groups trained
    unscored = metrics_line({k: v for k, v in window.items() if k not in ("reward", "frac_reward_zero_std")})
    assert "| reward — (no group scored in this window) |" in unscored and "(8 groups, scored earlier)" in unscored
    assert "| train 1.2k tok/s |" in metrics_line({k: v for k, v in window.items() if k != "batch/groups_per_step"})
    assert "| train 1.2k tok/s (1 group, scored earlier) |" in metrics_line(dict(window, **{"batch/groups_per_step": 1.0}))
    assert "(1.5 groups, scored earlier)" in metrics_line(dict(window, **{"batch/groups_per_step": 1.5}))  # a window's mean
