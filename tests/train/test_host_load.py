"""``host/cpu_busy_cores``, ``host/cpu_busy_frac`` and ``rollout/worker_cpu`` (``asyncgrpo_cli.train.host_load``;
issue #41): the pure trackers on given readings, and the real readings of this machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncgrpo_cli.train.host_load import HostCpuLoad, HostLoadWatch, ProcessTreeLoad, read_host_cpu


def test_a_process_tree_between_two_readings():
    load = ProcessTreeLoad(min_gap_s=0.5)
    load.observe({10: 1.0}, 0.0)
    assert load.cores() is None  # one reading
    load.observe({10: 1.5, 11: 0.5}, 2.0)  # pid 11 started in between: all its 0.5 s count
    assert load.cores() == 0.5
    load.observe({10: 1.6}, 2.2)  # too soon: kept
    assert load.cores() == 0.5
    load.observe({10: 3.5}, 4.0)  # pid 11 ended: its last interval is lost, not negative
    assert load.cores() == 1.0
    load.observe({}, 5.0)  # the tree is gone
    assert load.cores() is None
    load.observe({20: 1.0}, 6.0)  # a new worker (a restart) needs two readings of its own
    assert load.cores() is None


def test_the_machine_between_two_readings():
    load = HostCpuLoad(min_gap_s=0.5)
    load.observe(busy_s=100.0, total_s=400.0, t=0.0)
    assert load.busy_cores() is None and load.busy_frac() is None
    load.observe(busy_s=106.0, total_s=416.0, t=2.0)  # 4 cores for 2 s: 6 of 16 CPU seconds busy
    assert load.busy_cores() == 3.0 and load.busy_frac() == 0.375
    load.observe(busy_s=1.0, total_s=2.0, t=4.0)  # counters went back (another boot's): no figure
    assert load.busy_cores() is None
    load.observe(busy_s=2.0, total_s=4.0, t=5.0)
    assert load.busy_cores() == 1.0 and load.busy_frac() == 0.5


def test_the_watch_reports_once_two_readings_are_apart():
    clock = iter([0.0, 1.0, 1.1, 3.0])
    host = iter([(10.0, 40.0), (12.0, 44.0), (12.1, 44.4), (14.0, 52.0)])
    trees = iter([{5: 1.0, 6: 0.5}, {5: 1.1, 6: 0.6}, {5: 1.2, 6: 0.9}])  # from the second step on (no worker
    # before); pid 6 is a reward process under the worker (pid 5)
    pids = iter([None, 5, 5, 5])
    watch = HostLoadWatch(lambda: next(pids), read_host=lambda: next(host), read_tree=lambda pid: next(trees),
                          clock=lambda: next(clock))
    assert watch.step() == {}  # the first reading; no worker yet
    assert watch.step() == {"host/cpu_busy_cores": 2.0, "host/cpu_busy_frac": 0.5}  # the worker's first reading
    assert watch.step() == {"host/cpu_busy_cores": 2.0, "host/cpu_busy_frac": 0.5}  # 0.1 s later: kept
    assert watch.step() == {"host/cpu_busy_cores": 1.0, "host/cpu_busy_frac": 0.25, "rollout/worker_cpu": 0.3,
                            "rollout/worker_main_cpu": 0.1}


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc")
def test_real_readings_see_a_busy_child():
    busy0, total0 = read_host_cpu()
    assert 0 < busy0 < total0
    code = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\nprint(1, flush=True)\ninput()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        watch = HostLoadWatch(lambda: child.pid, clock=iter([0.0, 1.0]).__next__)
        watch.step()
        assert child.stdout.readline().strip() == b"1"
        got = watch.step()  # 1 s of the fake clock: the child's CPU seconds since the first reading
        assert got["rollout/worker_cpu"] > 0.1 and 0 < got["host/cpu_busy_frac"] <= 1
        assert got["rollout/worker_main_cpu"] == got["rollout/worker_cpu"]  # a tree of one process
    finally:
        child.stdin.close()
        child.wait(30)
