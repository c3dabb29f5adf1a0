"""``sampler.engines``: several servers behind one router (`asyncgrpo_cli.server.router`, issue #41).

The pure parts (port rewriting, least-busy choice, metrics merging), then the router as a process in front of two
stand-in engines (`fake_engine.py`): generation spread over both, weight-sync routes to both, a failure named by
engine, health, an engine's death and a SIGTERM ending everything; then the config: the server command, what
is refused and why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.sampler.prometheus import parse_server_load
from asyncgrpo_cli.server.router import engine_argv, merge_metrics, pick_engine
from asyncgrpo_cli.testing import poll_until

from .conftest import alive

FAKE = Path(__file__).with_name("fake_engine.py")
DEADLINE_S = 60.0


def _ports(n: int) -> int:
    """A port with the ``n`` ports after it free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def _wait(cond, what: str, timeout: float = DEADLINE_S):
    return poll_until(cond, what, timeout, poll_s=0.1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def router(tmp_path):
    """A router at a free port in front of two fake engines; yields (url, popen, record dir, engine ports)."""
    port = _ports(2)
    argv = [sys.executable, "-m", "asyncgrpo_cli.server.router", "--port", str(port), "--engines", "2", "--",
            sys.executable, str(FAKE), "--record", str(tmp_path), "--port", "0", "--fail-port", str(port + 2)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: proc.poll() is not None or _healthy(url), "the router and both engines")
        assert proc.poll() is None, proc.stdout.read()
        yield url, proc, tmp_path, (port + 1, port + 2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _engine_pids(record: Path, ports) -> list[int]:
    return [int((record / f"{p}.pid").read_text()) for p in ports]


def test_engine_argv_rewrites_or_adds_the_port():
    assert engine_argv(["vllm", "serve", "m", "--port", "8000", "--x"], 8002) == ["vllm", "serve", "m", "--port",
                                                                                 "8002", "--x"]
    assert engine_argv(["srv"], 9) == ["srv", "--port", "9"]
    with pytest.raises(ValueError, match="--port"):
        engine_argv(["srv", "--port"], 9)


def test_the_least_busy_engine_gets_the_next_request_and_ties_take_turns():
    assert pick_engine([3, 1, 2], -1) == 1
    assert pick_engine([0, 0], -1) == 0 and pick_engine([0, 0], 0) == 1 and pick_engine([0, 0], 1) == 0
    assert pick_engine([2, 1, 1], 1) == 2


def test_merged_metrics_sum_running_requests_and_keep_the_busiest_kv_usage():
    one = ('# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n'
           'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
           '# HELP vllm:kv_cache_usage_perc u\n# TYPE vllm:kv_cache_usage_perc gauge\n'
           'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
           'vllm:num_requests_waiting{engine="0",model_name="m"} 2\nplain_total 1\n')
    two = one.replace(" 3.0", " 4.0").replace("0.25", "0.5")
    text = merge_metrics([one, two])
    load = parse_server_load(text)
    assert (load.num_requests_running, load.num_requests_waiting, load.kv_cache_usage_frac, load.num_engines) == \
        (7, 4, 0.5, 2)
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'plain_total{engine="1"} 1' in text and 'engine="1.0"' in text


def test_generation_is_spread_and_weight_sync_routes_reach_every_engine(router):
    url, proc, record, ports = router
    answered = [httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2]}, timeout=10).json()["port"]
                for _ in range(10)]
    assert sorted(set(answered)) == list(ports) and answered.count(ports[0]) == 5
    r = httpx.post(f"{url}/update_weights", content=b"x" * 1000, timeout=10)
    assert r.status_code == 200 and r.json()["port"] == ports[0]
    r = httpx.post(f"{url}/reset_prefix_cache?reset_running_requests=true", timeout=10)
    assert r.json()["query"] == "reset_running_requests=true"
    for port in ports:
        lines = (record / f"{port}.log").read_text().splitlines()
        assert "/update_weights 1000" in lines and "/reset_prefix_cache 0" in lines
        assert sum(line.startswith("/v1/completions") for line in lines) == 5
    assert httpx.get(f"{url}/version", timeout=10).json()["port"] == ports[0]  # every other route: engine 0's
    load = parse_server_load(httpx.get(f"{url}/metrics", timeout=10).text)
    assert load.num_requests_running == 2 and load.num_engines == 2
    described = httpx.get(f"{url}/router", timeout=10).json()
    assert described["engines"] == 2 and described["ports"] == list(ports) and described["requests"] == [5, 5]


def test_a_failing_engine_is_named_in_the_answer(router):
    url, proc, record, ports = router
    r = httpx.post(f"{url}/pause?mode=keep", timeout=10)
    assert r.status_code == 500
    assert f"engine 1 (port {ports[1]}) answered /pause with 500: engine failed on purpose" in r.text
    assert "/pause 0" in (record / f"{ports[0]}.log").read_text()  # the other engine still got it


def test_an_engine_that_could_not_reset_its_cache_is_the_answer(tmp_path):
    port = _ports(2)
    argv = [sys.executable, "-m", "asyncgrpo_cli.server.router", "--port", str(port), "--engines", "2", "--",
            sys.executable, str(FAKE), "--record", str(tmp_path), "--port", "0", "--unreset-port", str(port + 2)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: proc.poll() is not None or _healthy(url), "the router and both engines")
        answer = httpx.post(f"{url}/reset_prefix_cache?reset_running_requests=true", timeout=10).json()
        assert answer == {"success": False, "port": port + 2}  # the client retries until every engine has reset
        assert httpx.post(f"{url}/resume", timeout=10).json()["port"] == port + 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_a_killed_engine_ends_the_router_with_an_error_line_naming_it_and_the_other_engine_with_it(router):
    from asyncgrpo_cli.launch.log_tail import failure_cause

    url, proc, record, ports = router
    first, second = _engine_pids(record, ports)
    os.kill(second, signal.SIGKILL)
    assert proc.wait(DEADLINE_S) == 1
    out = proc.stdout.read()
    line = (f"engine 1 of 2 (pid {second}, port {ports[1]}) was killed by SIGKILL from outside this job (the "
            "out-of-memory killer: see `dmesg`, or a `kill`); the router stops the other engines and exits 1")
    assert failure_cause(out.splitlines()) == line  # the supervisor's cause line names the engine, not the router
    _wait(lambda: not alive(first), "the other engine to end")


def test_an_engine_that_exits_leaves_its_own_error_as_the_cause(tmp_path):
    from asyncgrpo_cli.launch.log_tail import failure_cause

    port = _ports(1)
    dying = [sys.executable, "-c", "import sys; print('RuntimeError: Engine core process EngineCore died unexpectedly.',"
             " flush=True); sys.exit(3)", "--port", "0"]
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo_cli.server.router", "--port", str(port), "--engines", "1",
                           "--", *dying], capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 3
    assert "engine 0 of 1" in proc.stdout and "exited with code 3: stopping the other engines" in proc.stdout
    assert failure_cause(proc.stdout.splitlines()) == "RuntimeError: Engine core process EngineCore died unexpectedly."


def test_sigterm_stops_both_engines_and_the_router(router):
    url, proc, record, ports = router
    pids = _engine_pids(record, ports)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DEADLINE_S) == 0
    _wait(lambda: not any(alive(p) for p in pids), "both engines to end")


def test_a_killed_router_takes_its_engines_with_it(router):
    url, proc, record, ports = router
    pids = _engine_pids(record, ports)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(DEADLINE_S)
    _wait(lambda: not any(alive(p) for p in pids), "the engines to end after the router (PR_SET_PDEATHSIG)")


def _cfg(*overrides: str):
    return compose(["+recipe=smoke", "trainer.output_dir=/tmp/asyncgrpo-router-test", *overrides])


def test_the_server_command_of_two_embedded_engines_is_the_router_in_front_of_them():
    from asyncgrpo_cli.server.command import server_command_here

    cfg = _cfg("sampler.engines=2", "sampler.port=8100")
    command = server_command_here(cfg)
    assert command.argv[1:9] == ["-m", "asyncgrpo_cli.server.router", "--host", "127.0.0.1", "--port", "8100",
                                 "--engines", "2"]
    inner = command.argv[command.argv.index("--") + 1:]
    assert inner[1:3] == ["-m", "asyncgrpo_cli.sampler.embedded"] and engine_argv(inner, 1)[-1] != "8100"
    assert inner[inner.index("--port") + 1] == "8101" and not command.problems
    assert any("2 servers on ports 8101-8102" in n for n in command.notes)
    assert server_command_here(_cfg("sampler.port=8100")).argv[1:3] == ["-m", "asyncgrpo_cli.sampler.embedded"]


def test_engines_are_refused_where_the_weight_sync_cannot_reach_them_all():
    from asyncgrpo_cli.server.command import engines_problems

    class S(dict):
        __getattr__ = dict.get

    assert engines_problems(S(engines=2), colocated=True, vllm=True) == []
    assert engines_problems(S(engines=2), colocated=False, vllm=False) == []  # the embedded sync reaches them all
    assert engines_problems(S(engines=1), colocated=False, vllm=True) == []
    (nccl,) = engines_problems(S(engines=2), colocated=False, vllm=True)
    assert "sampler.engines=2 without the colocated layout" in nccl and "Fix: sampler.engines=1" in nccl


@pytest.mark.parametrize("overrides,needle", [
    (["sampler.engines=0"], "sampler.engines=0: must be >= 1"),
    (["sampler.engines=2", "rollout.request_seeds=false"], "rollout.request_seeds=false with sampler.engines=2"),
    (["sampler.engines=2", "peft.enabled=true"], "sampler.engines=2 with peft.enabled=true"),
    (["sampler.engines=2", "sampler.data_parallel_size=2"], "sampler.engines=2 with sampler.data_parallel_size=2"),
])
def test_bad_engine_settings_are_refused_with_the_fix(overrides, needle):
    from asyncgrpo_cli.config.compose import validate_config

    with pytest.raises(ConfigError, match="Fix:") as info:
        validate_config(_cfg(*overrides))
    assert needle in str(info.value)


def test_a_busy_engine_port_is_refused_before_start():
    from asyncgrpo_cli.launch.preflight import check_server_port

    port = _ports(2)
    cfg = _cfg("sampler.engines=2", f"sampler.port={port}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 2))
        s.listen()
        with pytest.raises(ConfigError, match=f"sampler.engines=2 the servers listen on ports {port + 1}-{port + 2}"):
            check_server_port(cfg.sampler, answering=False)
    check_server_port(cfg.sampler, answering=False)
    assert json.dumps(list(cfg.sampler.keys())).count("engines") == 1


@pytest.mark.parametrize("router_answer,engines,status", [
    ({"engines": 2, "ports": [8001, 8002]}, 2, "pass"), ({"engines": 2}, 3, "warn"), (None, 2, "warn"), (None, 1, None),
])
def test_doctor_compares_the_router_with_sampler_engines(router_answer, engines, status):
    from types import SimpleNamespace

    from asyncgrpo_cli.server.checks import _engine_checks

    found = []
    facts = SimpleNamespace(url="http://127.0.0.1:8000", extra={"router": router_answer})
    _engine_checks(facts, _cfg(f"sampler.engines={engines}").sampler, found.append)
    assert [c.status.lower() if isinstance(c.status, str) else str(c.status).lower() for c in found][:1] == \
        ([status] if status else [])
    if status == "warn":
        assert "sampler.engines" in found[0].fix


def test_two_colocated_vllm_engines_share_the_memory_split_and_keep_the_ipc_transfer():
    from asyncgrpo_cli.server.colocate import Layout, MemorySplit
    from asyncgrpo_cli.server.command import build_server_command

    cfg = compose(["+recipe=arith_vllm_1gpu", "sampler.engines=2", "sampler.port=8200"])
    split = MemorySplit(total_bytes=100, gpu_memory_utilization=0.24, vllm_bytes=24, trainer_bytes=70,
                        trainer_need_bytes=None, vllm_need_bytes=None, kv_tokens=None, source="estimate", reason="r")
    layout = Layout(colocated=True, reason="one GPU", gpu=0, memory=split)
    command = build_server_command("0.33.0", layout=layout, model=cfg.model, sampler=cfg.sampler, launch=cfg.launch,
                                   rollout=cfg.rollout, trainer=cfg.trainer, peft=cfg.peft, staleness=cfg.staleness,
                                   use_installed=False)
    inner = command.argv[command.argv.index("--") + 1:]
    assert inner[:2] == ["vllm", "serve"] and inner[inner.index("--port") + 1] == "8201"
    assert inner[inner.index("--gpu-memory-utilization") + 1] == "0.12"
    assert inner[inner.index("--weight-transfer-config") + 1] == '{"backend": "ipc"}'
    assert command.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and not command.problems
    assert any("each with --gpu-memory-utilization 0.12 (1/2 of 0.24)" in n for n in command.notes)
    apart = Layout(colocated=False, reason="two GPUs")
    refused = build_server_command("0.33.0", layout=apart, model=cfg.model, sampler=cfg.sampler, launch=cfg.launch,
                                   rollout=cfg.rollout, trainer=cfg.trainer, peft=cfg.peft, staleness=cfg.staleness,
                                   use_installed=False)
    assert any("without the colocated layout" in p for p in refused.problems)


def test_an_engine_command_that_cannot_start_ends_the_router_with_the_reason():
    from asyncgrpo_cli.launch.log_tail import failure_cause

    port = _ports(1)
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo_cli.server.router", "--port", str(port), "--engines", "2",
                           "--", "/nonexistent/engine-program", "--port", "0"], capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert proc.returncode == 1
    assert failure_cause(proc.stdout.splitlines()).startswith("engine 0 of 2 could not start: [Errno 2]")

