"""``server/engine_core_cpu`` (issue #41): the cores vLLM's engine core used between two readings of the server's
process tree (`asyncgrpo_cli.train.engine_cpu`), and the real reading of a process tree."""

from __future__ import annotations

import subprocess
import sys

from asyncgrpo_cli.train.engine_cpu import EngineCoreLoad, read_tree_cpu


def test_the_busiest_engine_core_between_two_readings():
    load = EngineCoreLoad(min_gap_s=1.0)
    load.observe({1: ("vllm", 5.0), 2: ("VLLM::EngineCore", 10.0), 3: ("VLLM::APIServer_0", 1.0)}, 100.0)
    assert load.cores() is None and load.engines == 1  # one reading: nothing yet
    load.observe({1: ("vllm", 9.0), 2: ("VLLM::EngineCore", 14.9), 3: ("VLLM::APIServer_0", 3.0)}, 105.0)
    assert load.cores() == 0.98  # 4.9 s of CPU in 5 s; the API server's and the top process's do not count
    load.observe({2: ("VLLM::EngineCore", 15.0)}, 105.5)  # too soon after the last: kept as it was
    assert load.cores() == 0.98
    # two engines behind the router: the busier one; a new engine core (restart) needs two readings of its own
    load.observe({2: ("VLLM::EngineCore", 19.0), 7: ("VLLM::EngineCore", 1.0)}, 110.0)
    assert load.cores() == 0.82 and load.engines == 2
    load.observe({8: ("VLLM::EngineCore_DP0", 3.0)}, 115.0)
    assert load.cores() is None
    load.observe({8: ("VLLM::EngineCore_DP0", 8.0)}, 120.0)
    assert load.cores() == 1.0


def test_no_engine_core_no_figure():
    load = EngineCoreLoad()
    load.observe({1: ("python", 1.0)}, 0.0)
    load.observe({1: ("python", 3.0)}, 2.0)
    assert load.cores() is None and load.engines == 0


def test_read_tree_cpu_names_a_child_and_its_cpu_seconds():
    code = ("import subprocess,sys; c=subprocess.Popen([sys.executable,'-c','import sys,time\\nt=time.process_time()\\n"
            "while time.process_time()-t<0.3: pass\\nprint(1,flush=True)\\nsys.stdin.read()'],stdin=sys.stdin); c.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == b"1"
        tree = read_tree_cpu(parent.pid)
        assert parent.pid in tree and len(tree) == 2 and max(sec for _, sec in tree.values()) >= 0.25
    finally:
        parent.stdin.close()
        parent.wait(30)
    assert read_tree_cpu(parent.pid) == {}


def test_the_servers_other_processes_together():
    """``server/frontend_cpu``: every process of the tree but the engine cores, a newcomer from zero."""
    load = EngineCoreLoad(min_gap_s=1.0)
    load.observe({1: ("vllm", 5.0), 2: ("VLLM::EngineCore", 10.0), 3: ("VLLM::APIServer_0", 1.0)}, 100.0)
    assert load.frontend_cores() is None
    load.observe({1: ("vllm", 6.0), 2: ("VLLM::EngineCore", 14.9), 3: ("VLLM::APIServer_0", 3.0),
                  4: ("VLLM::APIServer_1", 2.0)}, 105.0)
    assert load.frontend_cores() == 1.0  # (1 + 2 + 2) s of CPU in 5 s; the engine core's 4.9 s do not count
    load.observe({1: ("python", 2.0)}, 106.0)  # an embedded server: no engine core, its own CPU is the figure
    assert load.frontend_cores() == 0.0 and load.cores() is None  # pid 1's counter went down: counted as 0
