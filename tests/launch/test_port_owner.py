"""A busy port held by another asyncgrpo job's server (`run.port_owner`): named, and never offered as an external
sampler when a trainer changes that server's weights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncgrpo_cli.config.compose import compose
from asyncgrpo_cli.config.rules import ConfigError
from asyncgrpo_cli.config.start_checks import check_external_sampler
from asyncgrpo_cli.launch.preflight import check_server_port
from asyncgrpo_cli.run.port_owner import asyncgrpo_owner, asyncgrpo_subcommand

# A stand-in for `asyncgrpo <command> ...`: a script named `asyncgrpo` whose child answers GET /health, as the
# supervisor's server child does; the child writes its port once it listens.
_JOB = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", '''
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    s = http.server.HTTPServer(("127.0.0.1", 0), H)
    open(sys.argv[1] + ".tmp", "w").write(str(s.server_address[1]))
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    s.serve_forever()
    ''', sys.argv[-1]])
    child.wait()
""")


@pytest.fixture
def job(tmp_path):
    """Start the stand-in as `asyncgrpo <command> ...`; yields (pid, port); ends its process group."""
    started = []

    def start(command: str, *args: str) -> tuple[int, int]:
        script = tmp_path / "bin" / "asyncgrpo"
        script.parent.mkdir(exist_ok=True)
        script.write_text(_JOB)
        port_file = tmp_path / f"port-{len(started)}"
        proc = subprocess.Popen([sys.executable, str(script), command, *args, str(port_file)],
                                cwd=tmp_path, start_new_session=True)
        started.append(proc)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in job did not start"
            time.sleep(0.05)
        return proc.pid, int(port_file.read_text())

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def test_subcommand_of_a_command_line():
    assert asyncgrpo_subcommand(["/v/bin/python", "/v/bin/asyncgrpo", "train", "+recipe=smoke"]) == ("train", ["+recipe=smoke"])
    assert asyncgrpo_subcommand(["python", "-m", "asyncgrpo_cli", "serve", "x=1"]) == ("serve", ["x=1"])
    assert asyncgrpo_subcommand(["/v/bin/asyncgrpo", "--verbose", "train"]) == ("train", [])
    assert asyncgrpo_subcommand(["/v/bin/asyncgrpo", "doctor"]) is None
    assert asyncgrpo_subcommand(["python", "-m", "vllm.entrypoints.openai.api_server"]) is None
    assert asyncgrpo_subcommand(["/opt/asyncgrpo-data/run.sh", "train"]) is None


def test_a_training_jobs_server_is_named_and_never_offered(job, tmp_path):
    pid, port = job("train", "+recipe=smoke", "hub_token=hf_secret")
    owner = asyncgrpo_owner("127.0.0.1", port)
    assert owner is not None and owner.pid == pid and owner.command == "train"
    assert owner.argv.startswith("asyncgrpo train +recipe=smoke hub_token=***") and "hf_secret" not in owner.argv
    assert owner.cwd == str(tmp_path)
    assert asyncgrpo_owner("10.1.2.3", port) is None  # another machine's URL is never looked up here

    with pytest.raises(ConfigError) as err:
        check_server_port(compose(["+recipe=smoke", f"sampler.port={port}"]).sampler)
    text = str(err.value)
    assert f"another asyncgrpo train job (pid {pid}" in text and "sampler.backend=external" not in text
    assert "hf_secret" not in text and "Fix: use a free port, e.g. sampler.port=" in text

    external = compose(["+recipe=smoke", "sampler.backend=external", f"sampler.url=http://127.0.0.1:{port}"])
    with pytest.raises(ConfigError) as err:
        check_external_sampler(external)
    text = str(err.value)
    assert "sampler.url" in text and f"pid {pid}" in text and "another policy" in text and "asyncgrpo serve" in text


def test_a_served_server_is_named_and_still_offered(job):
    pid, port = job("serve", "+recipe=smoke")
    with pytest.raises(ConfigError) as err:
        check_server_port(compose(["+recipe=smoke", f"sampler.port={port}"]).sampler)
    text = str(err.value)
    assert f"another asyncgrpo serve job (pid {pid}" in text
    assert f"sampler.backend=external sampler.url=http://127.0.0.1:{port}" in text
    check_external_sampler(compose(["+recipe=smoke", "sampler.backend=external",
                                    f"sampler.url=http://127.0.0.1:{port}"]))  # what `serve` is for: accepted


def test_a_port_nobody_holds_has_no_owner():
    from asyncgrpo_cli.launch.preflight import free_port

    assert asyncgrpo_owner("127.0.0.1", free_port()) is None


def test_the_suggested_free_port_stays_near_the_busy_one():
    """A user kept to a range of ports (the fifteenth session's trial: 8170-8199) was offered 38725."""
    import socket

    from asyncgrpo_cli.launch.preflight import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        if busy > 65000:
            pytest.skip("the kernel gave a port at the top of the range")
        with pytest.raises(ConfigError, match=r"sampler.port=(\d+)") as err:
            check_server_port(compose(["+recipe=smoke", f"sampler.port={busy}"]).sampler)
    suggested = int(re.search(r"e\.g\. sampler\.port=(\d+)", str(err.value)).group(1))
    assert busy < suggested <= busy + 100, str(err.value)
    assert 7999 < free_port(near=7999) <= 8099
