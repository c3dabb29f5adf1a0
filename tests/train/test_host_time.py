"""``perf/fwd_bwd_cpu_s`` and ``perf/fwd_bwd_cpu_wait_s`` (``asyncgrpo_cli.train.host_time``; issues #41, #43)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from asyncgrpo_cli.train.host_time import ThreadTimes, host_time_metrics


def test_metrics_are_the_threads_deltas_with_new_threads_from_zero_and_ended_ones_left_out():
    before = ThreadTimes({1: (1_000_000_000, 100_000_000), 2: (5_000_000_000, 0), 3: (7, 7)})
    after = ThreadTimes({1: (1_500_000_000, 400_000_000), 2: (5_250_000_000, 50_000_000), 4: (250_000_000, 0)})
    got = host_time_metrics(before, after)
    assert got == pytest.approx({"perf/fwd_bwd_cpu_s": 0.5 + 0.25 + 0.25, "perf/fwd_bwd_cpu_wait_s": 0.3 + 0.05})
    assert host_time_metrics(None, after) == {} and host_time_metrics(before, None) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/thread-self/schedstat"),
                    reason="needs Linux scheduler statistics")
def test_a_reading_of_this_process_sees_a_busy_threads_cpu_time():
    before = ThreadTimes.read()
    assert before is not None and threading.get_native_id() in before.threads

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    worker = threading.Thread(target=spin, args=(0.3,))
    worker.start()
    spin(0.2)
    worker.join()
    got = host_time_metrics(before, ThreadTimes.read())
    # the main thread's 0.2 s at least (the worker's 0.3 s are lost if it ended before the second reading)
    assert got["perf/fwd_bwd_cpu_s"] >= 0.19 and got["perf/fwd_bwd_cpu_wait_s"] >= 0.0


def test_no_proc_no_reading(monkeypatch):
    monkeypatch.setattr(os, "listdir", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert ThreadTimes.read() is None


def test_compiles_are_the_graph_count_delta():
    before = ThreadTimes({1: (0, 0)}, graphs=3)
    assert host_time_metrics(before, ThreadTimes({1: (0, 0)}, graphs=5))["perf/fwd_bwd_compile_count"] == 2.0
    assert host_time_metrics(ThreadTimes({1: (0, 0)}), ThreadTimes({1: (0, 0)}, graphs=1))["perf/fwd_bwd_compile_count"] == 1.0
    assert "perf/fwd_bwd_compile_count" not in host_time_metrics(before, ThreadTimes({1: (0, 0)}))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/thread-self/schedstat"),
                    reason="needs Linux scheduler statistics")
def test_a_recompile_between_two_readings_is_counted():
    import torch

    fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=True)
    fn(torch.ones(5))  # traced with a dynamic size
    before = ThreadTimes.read()
    fn(torch.ones(7))  # the same trace
    same = host_time_metrics(before, ThreadTimes.read())
    fn(torch.ones(1))  # a size of 1 is specialised: a new graph (the trainer's short-row stall, tree_attention.py)
    again = host_time_metrics(before, ThreadTimes.read())
    assert same["perf/fwd_bwd_compile_count"] == 0.0 and again["perf/fwd_bwd_compile_count"] == 1.0
