"""A hung sampler server (SIGSTOP: it accepts connections and never answers) is shown within about 30 s in
``status.json``, the plain log and the panels, and once it has lasted ``sampler.timeout`` the run ends with
the cause, a checkpoint of the last completed step and no process left (issue #36; docs/FAULTS.md, the row
"the server hangs"). The unit tests drive `ServerWatch` with a scripted probe and clock; the drill runs the
real ``asyncgrpo train`` on the tiny model and stops its server with SIGSTOP."""

from __future__ import annotations

import os
import re
import signal
import time

from asyncgrpo_cli.sampler.retry import ServerOutage
from asyncgrpo_cli.train.liveness import WorkerWatch
from asyncgrpo_cli.run.state import SERVER_PID_ENV
from asyncgrpo_cli.train.server_watch import (
    ANSWERED,
    REFUSED,
    SILENT,
    ServerWatch,
    hang_limit,
    server_pid_from_env,
)

from .conftest import cli_argv, metrics_steps, status, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scripted(outcomes: list[str]):
    """A probe answering each call with the next outcome (the last one repeats)."""
    calls = []

    def probe(url: str, timeout_s: float) -> tuple[str, str]:
        calls.append((url, timeout_s))
        outcome = outcomes[min(len(calls) - 1, len(outcomes) - 1)]
        return outcome, "" if outcome == ANSWERED else f"ReadTimeout: timed out ({outcome})"
    return probe, calls


def test_a_silent_server_is_reported_after_15_s_and_fails_the_run_at_the_timeout():
    clock = Clock()
    probe, calls = scripted([ANSWERED, SILENT])
    watch = ServerWatch("http://127.0.0.1:8000/", 60.0, probe=probe, clock=clock)
    assert watch.check() is None and watch.status() is None  # it answers
    clock.now += 5
    assert watch.check() is None and watch.silent_s() == 5.0  # silent since its last answer
    assert watch.status() is None and watch.shown_silence_s() is None  # a slow moment is not reported
    clock.now += 10
    assert watch.check() is None
    line = watch.status()
    assert watch.shown_silence_s() == 15.0  # status.json's server_silent_s: the console counts from the last answer
    assert line is not None and line.startswith("server not answering: no answer to GET /health for 15 s"), line
    assert "sampler.timeout=60 s (45 s left)" in line
    clock.now += 45
    problem = watch.check()
    assert problem is not None and watch.problem == problem
    assert "the sampler server at http://127.0.0.1:8000 has not answered for 60 s" in problem
    assert "hung (stopped with SIGSTOP or Ctrl-Z" in problem and "vllm_server_timeout=60 s (CLI: sampler.timeout)" \
        in problem and "Fix:" in problem and "kill -CONT" in problem
    assert calls[0] == ("http://127.0.0.1:8000", 5.0)  # each probe waits at most 5 s


def test_a_hung_server_stops_the_run_at_the_hang_limit_not_the_whole_sampler_timeout():
    """A fresh user's trial (NOTES, seventeenth session): a SIGSTOPped server was named within 15 s, then the run
    waited out ``sampler.timeout=1800`` s. The hang limit is ``sampler.hang_timeout`` (120 s by default), or
    ``sampler.timeout`` when that is lower; the lines name the one that applies."""
    from asyncgrpo_cli.config.grpo_config import AsyncGRPOConfig

    defaults = AsyncGRPOConfig(output_dir="/tmp/x", use_cpu=True)
    assert (defaults.vllm_server_timeout, defaults.vllm_server_hang_timeout) == (1800.0, 120.0)
    assert hang_limit(defaults) == (120.0, "vllm_server_hang_timeout")
    lowered = AsyncGRPOConfig(output_dir="/tmp/x", use_cpu=True, vllm_server_timeout=60.0)
    assert hang_limit(lowered) == (60.0, "vllm_server_timeout")
    clock = Clock()
    limit_s, field = hang_limit(defaults)
    watch = ServerWatch("http://h:1", limit_s, limit_field=field, probe=scripted([ANSWERED, SILENT])[0], clock=clock)
    watch.check()
    clock.now += 20
    watch.check()
    assert watch.status().endswith("the run stops with a checkpoint at sampler.hang_timeout=120 s (100 s left)")
    clock.now += 99
    assert watch.check() is None
    clock.now += 1
    problem = watch.check()
    assert "gave up after vllm_server_hang_timeout=120 s (CLI: sampler.hang_timeout)" in problem, problem
    assert problem.endswith("raise sampler.hang_timeout to wait longer"), problem


def external_message(clock) -> str:
    return ServerWatch("http://h:1", 60.0, probe=scripted([SILENT])[0], clock=clock).hung_message(60.0)


def test_the_lines_name_the_server_this_job_started():
    """Issue #45's fault trial: the line of a silent server named no process. With the pid of the server the
    supervisor started, the live line names it and how to continue its process group, and the failure names it
    (its fix no longer says to continue a server the job stops with the run); without one (an external server)
    they stay as they were."""
    clock = Clock()
    probe, _ = scripted([ANSWERED, SILENT])
    watch = ServerWatch("http://h:1", 60.0, probe=probe, clock=clock, server_pid=4242)
    watch.check()
    clock.now += 16
    watch.check()
    line = watch.status()
    assert line == ("server not answering: no answer to GET /health from the server (pid 4242) for 16 s (hung or "
                    "stopped? a busy server still answers it; if stopped, kill -CONT -- -4242 continues its process "
                    "group); the run stops with a checkpoint at sampler.timeout=60 s (44 s left)"), line
    clock.now += 44
    problem = watch.check()
    assert problem.startswith("the sampler server at http://h:1 (pid 4242) has not answered for 60 s"), problem
    # by the time the failure is read, the job has stopped its own server: no `kill -CONT` advice for it
    assert "Fix: find why it stopped answering in its log (the job stops it with the run)" in problem, problem
    assert "kill -CONT" not in problem and "`kill -CONT PID`" in external_message(clock)
    external = ServerWatch("http://h:1", 60.0, probe=scripted([SILENT])[0], clock=clock)
    external.check()
    clock.now += 16
    assert "pid" not in external.status() and "pid" not in external.hung_message(60.0)
    assert server_pid_from_env({SERVER_PID_ENV: "4242"}) == 4242
    for raw in ("", " ", "0", "-1", "12ab"):  # external (""), or nothing a pid can be
        assert server_pid_from_env({SERVER_PID_ENV: raw}) is None
    assert server_pid_from_env({}) is None  # the Python API: no supervisor


def test_an_answer_or_a_refusal_ends_the_silence():
    """Any answer ends it; a refused connection is not a hang (the server is gone: the outage clock of B.17
    reports that), so it ends the silence too."""
    clock = Clock()
    probe, _ = scripted([SILENT, SILENT, ANSWERED, SILENT, REFUSED])
    watch = ServerWatch("http://h:1", 30.0, probe=probe, clock=clock)
    for _ in range(2):
        clock.now += 10
        watch.check()
    assert watch.status() is not None
    clock.now += 10
    watch.check()
    assert watch.silent_s() is None and watch.status() is None
    clock.now += 20
    watch.check()
    assert watch.silent_s() == 20.0
    clock.now += 20
    assert watch.check() is None and watch.silent_s() is None and watch.problem is None


def test_each_step_takes_its_share_of_the_silence_and_the_line_shows_it():
    """Eleventh session's trial: the step a 40 s SIGSTOP held read only `step 56.19 s | busy 19%`. Each step now
    logs the seconds of it the server did not answer (``server/silent_s``), which the plain line shows."""
    from asyncgrpo_cli.run.metrics_line import metrics_line

    clock = Clock()
    probe, _ = scripted([ANSWERED, SILENT, SILENT, SILENT, ANSWERED])
    watch = ServerWatch("http://h:1", 300.0, probe=probe, clock=clock)
    watch.check()  # answered at 1000
    assert watch.step_metrics() == {"server/silent_s": 0.0}  # no engine figures without a server pid
    for _ in range(2):
        clock.now += 10
        watch.check()  # silent since 1000
    assert watch.take_silent_s() == 20.0  # a step that ended inside the silence takes what had passed
    clock.now += 10
    watch.check()
    clock.now += 5
    watch.check()  # answered at 1035: the silence lasted 35 s
    assert watch.take_silent_s() == 15.0 and watch.take_silent_s() == 0.0  # the rest, once
    line = metrics_line({"step": 7, "perf/step_s": 56.19, "server/silent_s": 40.0})
    assert "| step 56.19 s | server silent 40 s of it |" in line, line
    assert "server silent" not in metrics_line({"step": 7, "perf/step_s": 2.0, "server/silent_s": 0.0})


def test_the_worker_watch_reports_the_server_problem_as_a_server_problem():
    """The training loop stops on `WorkerWatch.problem`; a silent server's problem reaches it, marked as the
    server's (the trainer raises `ServerHungError`, not a rollout-worker error)."""
    class Worker:
        process = None

        def check_alive(self):
            return None

    watch = WorkerWatch(Worker())
    watch.server = type("Server", (), {"problem": None})()
    assert watch.check() is None
    watch.server.problem = "the sampler server at URL has not answered for 60 s"
    assert watch.check() == "the sampler server at URL has not answered for 60 s"
    assert watch.problem_kind == "server"


def test_an_outage_met_late_gives_up_with_the_peer_that_met_it_first():
    """The worker saw the server refuse 50 s ago (its deadline is 10 s away); a weight sync meeting the outage
    now adopts that start: both give up together, not the sync T after its own first refusal."""
    clock, wall = Clock(), Clock()
    wall.now = 5000.0
    outage = ServerOutage("http://h:1", 60.0, clock=clock, wall=wall)
    outage.peer_deadline = lambda: wall.now + 10.0
    left = outage.refused("refused")
    assert abs(left - 10.0) < 1e-6 and abs(outage.waited() - 50.0) < 1e-6
    # a peer outage that began before this client's last answer is another outage: not adopted
    outage = ServerOutage("http://h:1", 60.0, clock=clock, wall=wall)
    outage.answered()
    clock.now += 5.0  # answered 5 s ago; the peer's outage began 50 s ago
    outage.peer_deadline = lambda: wall.now + 10.0
    assert outage.refused("refused") == 60.0
    outage = ServerOutage("http://h:1", 60.0, clock=clock, wall=wall)
    outage.peer_deadline = lambda: 0.0  # the peer has no outage
    assert outage.refused("refused") == 60.0


# ---------------------------------------------------------------------------------------------- the drill
# sampler.hang_timeout of the drill (sampler.timeout stays at its 1,800 s, as users have it: the run must not wait
# for that): above the 15 s after which the silence is reported (`REPORT_AFTER_S`), with room for a 10 s cycle of
# the watch (a 5 s probe, 5 s apart) between the report and the end of the run.
HANG_TIMEOUT_S = 25.0
BOOT_S = 400.0  # start-up and step 1 on two loaded cores
SHOWN_BOUND_S = 40.0  # "within about 30 s", with room for a loaded machine
END_BOUND_S = 120.0  # after the timeout: the step in progress, one save of the tiny model, the teardown


def test_a_server_stopped_with_sigstop_is_shown_then_ends_the_run_with_a_checkpoint(
        tiny_model, prompt_file, tmp_path, jobs):
    out = tmp_path / "run"
    job = jobs(cli_argv(tiny_model, prompt_file, out, "trainer.max_steps=200",
                        f"sampler.hang_timeout={HANG_TIMEOUT_S:g}", "launch.stop_timeout=300"), "job")
    started = wait_for(lambda: re.search(r"started the server \(pid (\d+)\)", job.output()), 60, "the server", job)
    server_pid = int(started.group(1))
    wait_for(lambda: metrics_steps(out), BOOT_S, "a trained step", job)
    os.kill(server_pid, signal.SIGSTOP)
    stopped = time.monotonic()
    line = wait_for(lambda: str(status(out).get("server_status") or "").startswith("server not answering") and
                    status(out)["server_status"], SHOWN_BOUND_S, "status.json to show the silent server", job)
    shown = time.monotonic() - stopped
    assert f"sampler.hang_timeout={HANG_TIMEOUT_S:g} s" in line, line
    assert f"from the server (pid {server_pid})" in line and f"kill -CONT -- -{server_pid}" in line, line
    wait_for(lambda: f"server not answering: no answer to GET /health from the server (pid {server_pid})" in
             job.output(), 10, "the plain log line", job)
    rc = job.wait(HANG_TIMEOUT_S + END_BOUND_S)
    ended = time.monotonic() - stopped
    text = job.output()
    print(f"measured: server SIGSTOP -> shown in status.json after {shown:.1f} s, job exit after {ended:.1f} s "
          f"(sampler.hang_timeout={HANG_TIMEOUT_S:g})")  # docs/FAULTS.md
    assert rc == 1, text[-4000:]
    assert ended >= HANG_TIMEOUT_S - 15, (ended, text[-4000:])  # it waited for the timeout (from the last answer)
    job.assert_no_process_left(30)  # the stopped server too
    cause = next((ln for ln in text.splitlines() if ln.startswith("cause: ")), "")
    assert "has not answered for" in cause and "hung (stopped with SIGSTOP" in cause, text[-4000:]
    assert text.count("has not answered for") == 1, text[-4000:]  # once: not again in the log's last lines
    assert "has not answered for" in (out / "logs" / "summary.txt").read_text()  # kept there
    final = status(out)
    assert final["state"].startswith("failed: ServerHungError: the sampler server at"), final
    checkpoint = final.get("last_checkpoint")
    assert checkpoint and f"checkpoint saved: {checkpoint}" in text, text[-4000:]
    assert int(checkpoint.rsplit("-", 1)[1]) == max(metrics_steps(out))  # the last completed step, logged
    assert "resume with: " in text and f"trainer.resume_from_checkpoint={checkpoint}" in text


def test_while_the_server_is_silent_a_request_waits_only_what_is_left_of_the_timeout():
    """The trainer's client asks the watch how much longer the server may stay silent: a weight sync meeting a
    hung server waits that (at least 1 s), not the whole timeout for each route and each attempt."""
    import httpx

    from asyncgrpo_cli.sampler.client import SyncSamplerClient

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"]["read"])
        return httpx.Response(200, json={"is_paused": False})

    client = SyncSamplerClient("http://h:1", timeout_s=60.0, transport=httpx.MockTransport(handler))
    budgets = iter([None, 12.5, -3.0])
    client.silence_budget = lambda: next(budgets)
    for _ in range(3):
        client.is_paused()
    assert seen == [60.0, 12.5, 1.0]


def test_a_request_already_waiting_when_the_server_goes_silent_ends_when_the_watch_gives_up():
    """A fresh user's trial (eighteenth session): a weight sync's request started before the watch noticed the
    silence, so it had the whole ``sampler.timeout``; the run outlived ``sampler.hang_timeout`` by minutes, and a
    Ctrl-C then saved nothing (the request held the trainer past the supervisor's stop timeout). Against a socket
    that accepts and never answers, the request now ends within a slice of the abandonment (the watch's
    ``on_problem``, a stop signal), not at its 60 s timeout."""
    import socket
    import threading

    import pytest

    from asyncgrpo_cli.sampler.client import SamplerUnavailableError, SyncSamplerClient

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # accepts (the kernel does), never answers: a stopped server
    try:
        client = SyncSamplerClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=60.0)
        client.silence_budget = lambda: None  # the watch has not noticed anything yet
        threading.Timer(1.0, client.outage.abandon, args=("the server has not answered for 40 s",)).start()
        started = time.monotonic()
        with pytest.raises(SamplerUnavailableError, match="stopped waiting for the sampler server .the server has "
                                                          "not answered for 40 s.*request was left waiting"):
            client.server_info()
        assert time.monotonic() - started < 10.0
        client.close()
    finally:
        listener.close()


def test_a_sync_failing_while_the_server_is_silent_is_reported_as_the_hang():
    """A weight sync that failed while /health went unanswered fails the run as `ServerHungError` (the hang is
    the cause; the timed-out route only its symptom), saying whether the silence reached the timeout."""
    import pytest

    from asyncgrpo_cli.train.server_watch import ServerHungError
    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    clock = Clock()
    probe, _ = scripted([ANSWERED, SILENT])
    watch = ServerWatch("http://h:1", 60.0, probe=probe, clock=clock)
    watch.check()
    clock.now += 20
    watch.check()
    trainer = type("T", (), {"server_watch": watch, "state": type("S", (), {"global_step": 7})()})()
    failure = RuntimeError("weight sync to model version 7 failed at /pause: timed out")
    with pytest.raises(ServerHungError) as raised:
        AsyncGRPOTrainer._raise_sync_failure(trainer, failure)
    text = str(raised.value)
    assert "has not answered for 20 s" in text and "the run stops before vllm_server_timeout=60 s" in text
    assert "step 7 is trained; its weight sync failed: weight sync to model version 7" in text
    probe, _ = scripted([ANSWERED])  # a server that answers: the sync's own failure is the cause
    trainer.server_watch = ServerWatch("http://h:1", 60.0, probe=probe, clock=clock)
    trainer.server_watch.check()
    with pytest.raises(RuntimeError, match="timed out"):
        AsyncGRPOTrainer._raise_sync_failure(trainer, failure)


def test_a_silence_is_said_in_the_trainers_log_when_reported_and_when_it_ends():
    """Twenty-fourth session's trial: after a 40 s SIGSTOP of the server, trainer.log held no line of it (the
    console's plain lines came from status.json alone). The watch now says the silence once when it reports it, and
    when it ends."""
    clock = Clock()
    said: list[str] = []
    probe, _ = scripted([SILENT, SILENT, SILENT, SILENT, ANSWERED, SILENT, SILENT, REFUSED])
    watch = ServerWatch("http://h:1", 60.0, probe=probe, clock=clock, server_pid=4242, say=said.append)
    for _ in range(4):  # 5, 10, 15, 20 s silent: said once, at 15 s
        clock.now += 5
        watch.check()
    assert len(said) == 1 and said[0].startswith("server not answering: no answer to GET /health from the server "
                                                 "(pid 4242) for 15 s"), said
    clock.now += 5
    watch.check()  # it answers
    assert said[1:] == ["sampler server at http://h:1 (pid 4242): answers again after 25 s silent"], said
    for _ in range(2):  # 5 and 10 s: under the report's 15 s, nothing said, nor when it ends
        clock.now += 5
        watch.check()
    clock.now += 5
    watch.check()
    assert len(said) == 2, said
