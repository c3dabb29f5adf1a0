"""Server outages and the worker's lifetime, with real processes (SPEC Appendix B.17; issue 16).

Every test starts its own embedded sampler (``outage_program.py server``, the embedded sampler recording
what it receives) and a Python-API training run (``outage_program.py train``, `AsyncGRPOTrainer.train()`
without the CLI) over a tiny random model, each in a session of its own; whatever a test starts is
SIGKILLed at teardown (process groups and every descendant seen), pass or fail.

- the server is kill -9'ed mid-run and started again on the same port: ``status.json`` says "server
  unreachable, retrying (N s left)" meanwhile, the run ends with exit 0, and the restarted server
  received the trainer's weights before it generated anything;
- the trainer is kill -9'ed: its rollout worker and the worker's math-verify pool are gone within
  `ORPHAN_BOUND_S`;
- the server stays down: the run exits non-zero within ``vllm_server_timeout`` + `DOWN_BOUND_S`, with the
  error naming the URL, how long it waited and the fix, and leaves no process.

Plus the retry decisions of `ServerOutage` / `_RetryState` on a fake clock (no sleeps).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from asyncgrpo_cli.sampler.protocol import SamplerConnectionLost, SamplerRequestError, SamplerRetryError
from asyncgrpo_cli.sampler.retry import ServerOutage, _RetryState, unreachable_text
from asyncgrpo_cli.testing import poll_until

HERE = Path(__file__).resolve().parent
PROGRAM = str(HERE / "outage_program.py")
REPO = HERE.parent.parent

DOWN_TIMEOUT_S = 12.0  # vllm_server_timeout of the stays-down run
DOWN_BOUND_S = 40.0  # exit within vllm_server_timeout + this (give-up, worker/trainer teardown, loaded CI)
ORPHAN_BOUND_S = 15.0  # worker and reward pool gone this long after the trainer's kill -9
RUN_DEADLINE_S = 300.0  # a whole training run, at most (2 loaded cores)


# ---------------------------------------------------------------------------------------------- pure
class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def retry_state(clock, timeout_s=10.0, max_retries=2):
    outage = ServerOutage("http://h:1", timeout_s, clock=clock, wall=clock)
    return _RetryState("http://h:1", "/v1/completions", timeout_s, max_retries, 1.0, 4.0, outage=outage), outage


def test_refusals_back_off_until_the_outage_deadline_then_name_url_wait_and_fix():
    clock = FakeClock()
    state, outage = retry_state(clock)
    delays = []
    for _ in range(4):
        delays.append(state.on_refused(ConnectionRefusedError("refused"), {"prompt": [1]}))
        clock.t += delays[-1]
    assert delays == [1.0, 2.0, 4.0, 3.0]  # doubling, capped at max_s, then cut to the time left
    assert outage.active and outage.started == 1 and outage.seconds_left() == pytest.approx(0.0)
    with pytest.raises(Exception) as err:
        state.on_refused(ConnectionRefusedError("refused"), {"prompt": [1]})
    text = str(err.value)
    assert "http://h:1/v1/completions" in text and "unreachable" in text and "for 10 s" in text
    assert "vllm_server_timeout=10 s" in text and "sampler.timeout" in text and "Fix:" in text


def test_the_outage_clock_is_shared_by_requests_and_ends_with_an_answer():
    clock = FakeClock()
    first, outage = retry_state(clock)
    second = _RetryState("http://h:1", "/metrics", 10.0, 0, 1.0, 4.0, outage=outage)
    first.on_refused("refused", None)
    clock.t += 6.0
    assert second.on_refused("refused", None) == pytest.approx(1.0)  # its own backoff, the shared deadline
    assert outage.status() == unreachable_text(4.0) == "server unreachable, retrying (4 s left)"
    assert outage.deadline_wall() == pytest.approx(clock.t + 4.0)
    assert outage.answered() is True and outage.recoveries == 1 and not outage.active
    assert outage.answered() is False and outage.status() is None and outage.deadline_wall() == 0.0
    clock.t += 100.0  # a new outage gets the whole timeout again
    assert first.on_refused("refused", None) > 0 and outage.started == 2


def test_an_outage_met_while_the_job_already_stops_promises_no_wait(caplog):
    """A ``kill -9`` of the server the supervisor started: the worker's outage line promised "1800 s more at most"
    though the supervisor had seen the server die and was stopping the job (a fresh-user trial)."""
    clock = FakeClock()
    waited = ServerOutage("http://h:1", 1800.0, clock=clock, wall=clock)
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.sampler.client"):
        waited.refused(ConnectionRefusedError("refused"))
    assert "every request waits for it, 1800 s more at most" in caplog.text  # no stop: the wait is promised
    assert waited.status() == "server unreachable, retrying (1800 s left)"
    caplog.clear()
    why = "the server (pid 4242) was killed by SIGKILL"
    stopping = ServerOutage("http://h:1", 1800.0, clock=clock, wall=clock)
    stopping.stop_under_way = lambda: why
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.sampler.client"):
        stopping.refused(ConnectionRefusedError("refused"))
    assert f"server unreachable (ConnectionRefusedError: refused); not waited out: the job is already stopping ({why})" \
        in caplog.text, caplog.text
    assert "1800" not in caplog.text and "more at most" not in caplog.text
    assert stopping.status() == f"server unreachable; not waited out: the job is stopping ({why})"
    assert stopping.seconds_left() == pytest.approx(1800.0)  # only the words change: the stop ends the wait
    broken = ServerOutage("http://h:1", 1800.0, clock=clock, wall=clock)
    broken.stop_under_way = lambda: 1 / 0  # a failing probe leaves the ordinary line
    broken.refused(ConnectionRefusedError("refused"))
    assert broken.status() == "server unreachable, retrying (1800 s left)"


def test_stop_under_way_says_why_once_the_server_the_supervisor_started_is_gone(tmp_path, monkeypatch):
    """`run.stop_reason.stop_under_way`: the supervisor's line, else the server's exit; nothing for a server this
    job did not start (no `SERVER_PID_ENV`), or one that runs."""
    from asyncgrpo_cli.run.state import SERVER_PID_ENV
    from asyncgrpo_cli.run.stop_reason import stop_under_way, write_stop_reason

    monkeypatch.delenv(SERVER_PID_ENV, raising=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid no longer runs
    assert stop_under_way(tmp_path) is None  # the Python API or an external server: outages are waited out
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stop_under_way(tmp_path, running.pid) is None
        monkeypatch.setenv(SERVER_PID_ENV, str(running.pid))
        assert stop_under_way(tmp_path) is None
    finally:
        running.kill()
        running.wait()
    assert stop_under_way(tmp_path) == f"the server (pid {running.pid}) is gone"  # before the supervisor's line
    assert stop_under_way(tmp_path, gone.pid) == f"the server (pid {gone.pid}) is gone"
    write_stop_reason(tmp_path, "the server (pid 4242) was killed by SIGKILL")
    assert stop_under_way(tmp_path) == "the server (pid 4242) was killed by SIGKILL"
    assert stop_under_way(None, gone.pid) == f"the server (pid {gone.pid}) is gone"
    from types import SimpleNamespace

    from asyncgrpo_cli.train.stopping import StopHandling

    trainer = StopHandling()  # the trainer's side: its weight sync's outage and status.json's server_status
    trainer.args, trainer._stop_requested = SimpleNamespace(output_dir=str(tmp_path)), False
    assert trainer._stop_under_way() == "the server (pid 4242) was killed by SIGKILL"
    trainer._stop_requested, trainer._stop_reason = True, "SIGINT from the supervisor: the server (pid 4242) ..."
    assert trainer._stop_under_way() == "SIGINT from the supervisor: the server (pid 4242) ..."
    monkeypatch.delenv(SERVER_PID_ENV)
    trainer._stop_requested = False
    assert trainer._stop_under_way() is None  # no server of the supervisor's: a stale line means nothing


def test_failures_are_retried_max_retries_times_and_say_whether_the_transport_failed():
    clock = FakeClock()
    state, outage = retry_state(clock, max_retries=2)
    assert [state.on_failure("HTTP 503", None), state.on_failure("HTTP 503", None)] == [1.0, 2.0]
    with pytest.raises(SamplerRetryError) as err:
        state.on_failure("HTTP 503", None)
    assert not isinstance(err.value, SamplerConnectionLost) and "after 2 retries" in str(err.value)
    state, _ = retry_state(clock, max_retries=0)  # control routes: not resent after a dropped connection
    with pytest.raises(SamplerConnectionLost):
        state.on_error(httpx.ReadError("reset"), None)
    # ... but a refused connection never reached the server: waited out even with max_retries=0
    assert state.on_error(httpx.ConnectError("refused"), None) == 1.0


def test_an_abandoned_outage_ends_every_wait_at_once():
    """A stop signal abandons the wait for the server (issue 25): the next decision raises, naming why."""
    from asyncgrpo_cli.sampler.protocol import SamplerUnavailableError

    clock = FakeClock()
    state, outage = retry_state(clock, timeout_s=1000.0)
    assert state.on_refused(ConnectionRefusedError("refused"), None) == 1.0
    outage.abandon("SIGINT: the trainer stops")
    for decide in (lambda: state.on_refused(ConnectionRefusedError("refused"), None),
                   lambda: state.on_failure("HTTP 503", None)):
        with pytest.raises(SamplerUnavailableError, match=r"stopped waiting for the sampler server \(SIGINT"):
            decide()


def test_a_sync_client_sleeping_between_tries_wakes_up_when_the_wait_is_abandoned():
    import threading

    from asyncgrpo_cli.sampler.client import SyncSamplerClient
    from asyncgrpo_cli.sampler.protocol import SamplerUnavailableError

    tried = threading.Event()

    def refuse(request):
        tried.set()
        raise httpx.ConnectError("[Errno 111] Connection refused")

    client = SyncSamplerClient("http://127.0.0.1:9", timeout_s=1000.0, backoff_base_s=60.0, backoff_max_s=60.0,
                               transport=httpx.MockTransport(refuse))
    result = {}

    def call():
        start = time.monotonic()
        try:
            client.pause("keep")
        except SamplerUnavailableError as exc:
            result["error"] = str(exc)
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    assert tried.wait(30), "the client never tried"
    client.outage.abandon("SIGTERM: the supervisor (pid 1) is gone")  # it now sleeps a 60 s backoff
    thread.join(30)
    assert not thread.is_alive() and result["elapsed"] < 20, result
    assert "stopped waiting for the sampler server (SIGTERM: the supervisor (pid 1) is gone)" in result["error"]
    client.close()


def test_4xx_is_final_and_5xx_is_retried():
    state, _ = retry_state(FakeClock())
    assert state.on_response(httpx.Response(200), None, allow_404=False) == (True, 0.0)
    assert state.on_response(httpx.Response(404), None, allow_404=True) == (True, 0.0)
    assert state.on_response(httpx.Response(503, json={"error": "busy"}), None, allow_404=False) == (False, 1.0)
    with pytest.raises(SamplerRequestError):
        state.on_response(httpx.Response(400, json={"error": "bad"}), None, allow_404=False)


class FlakyBackend:
    """A weight-sync backend whose first syncs fail with ``errors`` (then succeed); records every call."""

    mode = "full"

    def __init__(self, *errors: BaseException) -> None:
        self.client = type("Client", (), {"outage": ServerOutage("http://h:1", 10.0)})()
        self.errors = list(errors)
        self.calls: list[tuple] = []

    def _attempt(self, kind: str, version: int):
        from asyncgrpo_cli.train.weight_sync import SyncTimings

        self.calls.append((kind, version))
        if self.errors:
            raise self.errors.pop(0)
        return SyncTimings(transfer_s=0.5)

    def sync(self, source, version):
        return self._attempt("sync", version)

    def push_current(self, source, version):
        return self._attempt("push", version)

    def reconnect(self) -> None:
        self.calls.append(("reconnect",))


def weight_sync_over(backend):
    import torch

    from asyncgrpo_cli.train.weight_sync import WeightSync

    return WeightSync(torch.nn.Linear(2, 2), backend)


def lost(route="/update_weights"):
    from asyncgrpo_cli.train.weight_sync import WeightSyncError

    error = WeightSyncError(f"weight sync failed at {route}", route, 3)
    error.__cause__ = SamplerConnectionLost("connection dropped", route)
    return error


def test_a_sync_the_server_went_away_during_is_pushed_again_after_reconnect():
    backend = FlakyBackend(lost())
    metrics = weight_sync_over(backend).sync(3)
    assert backend.calls == [("sync", 3), ("reconnect",), ("push", 3)]
    assert metrics["perf/weight_sync_transfer_s"] == 0.5


def test_a_sync_during_which_an_outage_began_is_pushed_again():
    from asyncgrpo_cli.train.weight_sync import WeightSyncError

    backend = FlakyBackend()
    error = WeightSyncError("finish failed: HTTP 400 no update in progress", "/finish_weight_update", 3)
    error.__cause__ = SamplerRequestError("400", "/finish_weight_update", 400, "no update in progress")

    def failing_after_an_outage(source, version):  # the server restarted mid-sync: a 4xx from the new one
        backend.calls.append(("sync", version))
        backend.client.outage.refused("refused")
        backend.client.outage.answered()
        raise error

    backend.sync = failing_after_an_outage
    weight_sync_over(backend).sync(3)
    assert backend.calls == [("sync", 3), ("reconnect",), ("push", 3)]


def test_weight_sync_failures_that_are_not_the_server_going_away_are_final():
    from asyncgrpo_cli.sampler.protocol import SamplerUnavailableError
    from asyncgrpo_cli.train.weight_sync import WeightSyncError

    rejected = WeightSyncError("rejected", "/update_weights", 3)
    rejected.__cause__ = SamplerRequestError("400", "/update_weights", 400, "bad names")
    backend = FlakyBackend(rejected)
    with pytest.raises(WeightSyncError, match="rejected"):
        weight_sync_over(backend).sync(3)
    assert backend.calls == [("sync", 3)]
    gone = WeightSyncError("gave up", "/pause", 3)  # the server stayed down past vllm_server_timeout
    gone.__cause__ = SamplerUnavailableError("unreachable for 10 s", "/pause")
    backend = FlakyBackend(gone)
    with pytest.raises(WeightSyncError, match="gave up"):
        weight_sync_over(backend).sync(3)
    backend = FlakyBackend(lost(), lost(), lost())
    with pytest.raises(WeightSyncError):
        weight_sync_over(backend).sync(3)
    assert [c[0] for c in backend.calls].count("reconnect") == 2  # MAX_PUSH_ATTEMPTS = 3 attempts


def test_a_sync_the_server_went_away_during_is_not_pushed_again_once_the_job_is_stopping():
    """Twenty-fifth session's trial: after `kill -9` of the server, trainer.log said "pushing the whole version
    again once the server answers (attempt 2 of 3)", then "its weight sync was abandoned by the stop": a stopping
    job (`ServerOutage.stopping`) now fails the sync at once, with no promise of another push."""
    from asyncgrpo_cli.train.weight_sync import WeightSyncError

    backend = FlakyBackend(lost())
    backend.client.outage.stop_under_way = lambda: "the server (pid 4242) is gone"
    with pytest.raises(WeightSyncError, match="connection|failed"):
        weight_sync_over(backend).sync(3)
    assert backend.calls == [("sync", 3)]


def test_push_current_reconnects_first_and_republishes_the_current_version():
    backend = FlakyBackend()
    weight_sync_over(backend).push_current(4)
    assert backend.calls == [("reconnect",), ("push", 4)]


class HeldWorker:
    """The worker's outage counters (`RolloutWorker.needs_repush` / `ack_repush`), shared with a fake sync."""

    def __init__(self, returns: int = 0) -> None:
        self.returns, self.repushed = returns, 0

    def server_returns_seen(self) -> int:
        return self.returns

    def needs_repush(self) -> bool:
        return self.returns > self.repushed

    def ack_repush(self, seen: int) -> None:
        self.repushed = max(self.repushed, seen)


def push_with(worker: HeldWorker, again: bool, version: int, during=None):
    """`AsyncGRPOTrainer._push_weights` on a stand-in trainer; ``during`` runs inside the sync (and sees the
    trainer's ``server_status`` then). Returns the stand-in."""
    from types import SimpleNamespace

    from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer

    trainer = SimpleNamespace(worker=worker, args=SimpleNamespace(vllm_server_base_url="http://127.0.0.1:8000"),
                              _repush_status=None, seen_status=[])

    def sync(v):
        trainer.seen_status.append(trainer._repush_status)
        if during is not None:
            during()
        return {"weight_sync/s": 0.1}

    trainer.weight_sync = SimpleNamespace(sync=sync, push_current=sync)
    AsyncGRPOTrainer._push_weights(trainer, version, again=again)
    return trainer


def test_a_push_that_held_generation_waits_for_says_so_and_when_generation_resumes(capsys):
    """The re-push after an outage is logged (issue #36), and so is a step's own sync when generation waits for
    it (the worker saw the server come back before the sync began): in the smoke drill ``external-back`` the
    step's sync, not a re-push, released generation, and no line said so."""
    url = "http://127.0.0.1:8000"
    again = push_with(HeldWorker(returns=1), again=True, version=3)
    out = capsys.readouterr().out
    assert f"the sampler server at {url} answers again after an outage: pushing the weights of model version 3 " \
           "again before generation resumes" in out, out
    assert f"re-pushed model version 3 to {url} in " in out and "s; generation resumes" in out, out
    assert again.seen_status == ["server back: pushing the weights of model version 3 again"]
    assert again._repush_status is None and not again.worker.needs_repush()

    step = push_with(HeldWorker(returns=1), again=False, version=4)
    out = capsys.readouterr().out
    assert "pushing the weights of model version 4 (this step's weight sync) before generation resumes" in out
    assert f"pushed model version 4 to {url} in " in out and "re-pushed" not in out, out
    assert step.seen_status == ["server back: pushing the weights of model version 4"]

    worker = HeldWorker()  # the server comes back while this sync runs: this push does not release generation

    def comes_back():
        worker.returns += 1

    quiet = push_with(worker, again=False, version=5, during=comes_back)
    assert capsys.readouterr().out == "" and quiet.seen_status == [None] and worker.needs_repush()
    push_with(worker, again=False, version=6)  # the next push does, and says so
    assert "model version 6 to http://127.0.0.1:8000 in " in capsys.readouterr().out
    assert not worker.needs_repush()


class FakeLoraServer:
    """The LoRA routes of a server (models / load / unload), in memory."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.calls: list[tuple[str, str]] = []

    def models(self):
        return [{"id": "base", "parent": None}] + [{"id": n, "parent": "base"} for n in self.loaded]

    def load_lora_adapter(self, name, path, load_inplace=False):
        self.calls.append(("load", name))
        if name not in self.loaded:
            self.loaded.append(name)

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))
        self.loaded.remove(name)


class FakeAdapter:
    def state_dict(self):
        return {}

    def save(self, directory, state):
        Path(directory).mkdir(parents=True, exist_ok=True)


def test_lora_re_push_after_a_restart_loads_the_current_adapter_and_forgets_the_lost_ones(tmp_path):
    from asyncgrpo_cli.train.weight_sync import LoraAdapterSync

    server = FakeLoraServer()
    backend = LoraAdapterSync(server, tmp_path / "lora", max_staleness=1)
    for version in (1, 2, 3):
        backend.sync(FakeAdapter(), version)
    assert server.loaded == ["policy-v2", "policy-v3"]
    server.loaded.clear()  # the server restarted: no adapter any more
    server.calls.clear()
    backend.reconnect()
    backend.push_current(FakeAdapter(), 3)
    assert server.calls == [("load", "policy-v3")] and backend.current_adapter == "policy-v3"
    backend.sync(FakeAdapter(), 4)  # the window goes on: nothing it lost is unloaded
    assert server.loaded == ["policy-v3", "policy-v4"]
    server.calls.clear()
    backend.reconnect()  # a server that kept its adapters keeps them registered
    backend.push_current(FakeAdapter(), 4)
    assert backend.window.names == ["policy-v3", "policy-v4"] and ("unload", "policy-v3") not in server.calls


@pytest.mark.parametrize("group", [False, True], ids=["one request per rollout", "one request per group"])
def test_a_rollout_under_an_adapter_a_restarted_server_lost_is_resent_under_the_current_one(group):
    import asyncio
    from types import SimpleNamespace

    from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop

    outage = ServerOutage("http://h:1", 10.0)
    sent = []

    class Client:
        def __init__(self):
            self.outage = outage

        async def generate_turns(self, prompt_ids, sampling, n, model=None):
            sent.append(model)
            if model == "policy-v2":  # waited through a restart; only policy-v3 was re-pushed
                outage.refused("refused")
                outage.answered()
                raise SamplerRequestError("404", "/v1/completions", 404, "The model `policy-v2` does not exist.")
            return [SimpleNamespace(to_turn_record=lambda: "turn", request_s=0.1, parse_s=0.0) for _ in range(n)]

        async def generate_turn(self, prompt_ids, sampling, model=None):
            return (await self.generate_turns(prompt_ids, sampling, 1, model))[0]

    def make_loop(served_model):
        loop = SimpleNamespace(client=Client(), sampling=None, served_model=served_model,
                               metrics=SimpleNamespace(add=lambda *a: None))
        for name in ("_request", "_record_request"):  # the request path of the loop (rollout/requests.py)
            setattr(loop, name, getattr(AsyncRolloutLoop, name).__get__(loop))
        return loop

    def call(loop, prompt):
        if group:
            return AsyncRolloutLoop.generate_group_turns(loop, prompt, 3)
        return AsyncRolloutLoop.generate_one_turn(loop, prompt)

    names = iter(["policy-v2", "policy-v3"])
    got = asyncio.run(call(make_loop(lambda: next(names)), [1, 2]))
    assert got == (["turn"] * 3 if group else "turn")
    assert sent == ["policy-v2", "policy-v3"]
    # without an outage in between, a 404 is the user's error: raised
    outage.answered()
    with pytest.raises(SamplerRequestError):
        asyncio.run(call(make_loop(lambda: "policy-v2"), [1]))  # recoveries change but the name does not


# ---------------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """What a test started; `reap` SIGKILLs their groups and every descendant ever seen."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.seen: dict[int, float] = {}

    def start(self, argv: list[str], log: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
               "ASYNCGRPO_MATH_VERIFY_WORKERS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        popen = subprocess.Popen([sys.executable, PROGRAM, *argv], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                 cwd=str(REPO), env=env, start_new_session=True)
        self.popens.append(popen)
        return popen

    def descendants(self, popen: subprocess.Popen) -> list[psutil.Process]:
        try:
            found = psutil.Process(popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in found:
            try:
                self.seen.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass
        return found

    def reap(self) -> None:
        for popen in self.popens:
            self.descendants(popen)
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        for popen in self.popens:
            try:
                popen.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs():
    tracker = Processes()
    yield tracker
    tracker.reap()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncgrpo_cli.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def start_server(procs: Processes, model_dir: Path, port: int, events: Path, log: Path) -> subprocess.Popen:
    server = procs.start(["server", "--events", str(events), "--", "--model", str(model_dir), "--port", str(port),
                          "--device", "cpu", "--dtype", "float32", "--max-model-len", "96", "--max-logprobs", "8",
                          "--weights-dir", str(events.parent / "weights"),  # a server killed -9 leaves its folder
                          "--log-level", "WARNING"], log)                   # here, not in /tmp
    wait_for(lambda: "serving" in log.read_text() or server.poll() is not None, 120, "the server to start")
    assert server.poll() is None, log.read_text()
    return server


def start_trainer(procs: Processes, model_dir: Path, port: int, out: Path, *extra: str) -> subprocess.Popen:
    return procs.start(["train", "--model", str(model_dir), "--url", f"http://127.0.0.1:{port}", "--out", str(out),
                        *extra], out.parent / f"{out.name}.log")


def wait_for(condition, timeout_s: float, what: str, every_s: float = 0.1):
    return poll_until(condition, what, timeout_s, poll_s=every_s)


def steps_logged(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=0)


def status_of(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def kill9(popen: subprocess.Popen) -> None:
    os.kill(popen.pid, signal.SIGKILL)
    popen.wait(30)


def test_server_killed_and_restarted_on_the_same_port_run_continues_after_a_re_push(model_dir, procs, tmp_path):
    port, events = free_port(), tmp_path / "events.txt"
    first = start_server(procs, model_dir, port, events, tmp_path / "server1.log")
    out = tmp_path / "run"
    # 8 steps: with max_staleness=2 the samples queued before the kill cover at most 3 more steps, so the
    # run cannot end before it meets the outage (with 3 steps it sometimes did).
    trainer = start_trainer(procs, model_dir, port, out, "--max-steps", "8", "--timeout", "90")
    wait_for(lambda: steps_logged(out) >= 1 or trainer.poll() is not None, RUN_DEADLINE_S, "a synced step")
    assert trainer.poll() is None, (out.parent / "run.log").read_text()[-3000:]
    kill9(first)
    seen = wait_for(lambda: (status_of(out).get("server_status") or ""), 30, "status.json to report the outage")
    assert seen.startswith("server unreachable, retrying (") and seen.endswith(" s left)")
    second = start_server(procs, model_dir, port, events, tmp_path / "server2.log")
    rc = trainer.wait(RUN_DEADLINE_S)
    log = (out.parent / "run.log").read_text()
    assert rc == 0, log[-4000:]
    assert "TRAINED 8" in log
    assert steps_logged(out) == 8 and status_of(out).get("state") == "finished"
    assert status_of(out).get("server_status") is None  # the outage is over
    routes = [line.split()[1] for line in events.read_text().splitlines() if line.split()[0] == str(second.pid)]
    generation = [i for i, r in enumerate(routes) if r != "/finish_weight_update"]
    assert generation, "the restarted server never generated"
    assert "/finish_weight_update" in routes[: generation[0]], routes[:10]  # weights first, then generation
    # the log says so (issue #36): the server is back, the weights go first, generation resumes after
    assert f"the sampler server at http://127.0.0.1:{port} answers again after an outage: pushing the weights of " \
           "model version" in log, log[-4000:]
    # the re-push, or the step's own sync when generation waited for it (which one depends on timing)
    assert "; generation resumes" in log and "pushed model version" in log, log[-4000:]


def test_trainer_sigkill_takes_worker_and_pool_along_and_a_server_that_stays_down_ends_the_run(
        model_dir, procs, tmp_path):
    """Two Python-API runs on one server (their start-ups overlap, to keep CI short): the first is
    kill -9'ed once its worker's math-verify pool runs; then the server is kill -9'ed for good under the
    second, which must exit on its own within the timeout with the clear error and leave no process."""
    port, events = free_port(), tmp_path / "events.txt"
    server = start_server(procs, model_dir, port, events, tmp_path / "server.log")
    killed_out, down_out = tmp_path / "killed", tmp_path / "down"
    victim = start_trainer(procs, model_dir, port, killed_out, "--max-steps", "50", "--accuracy")
    survivor = start_trainer(procs, model_dir, port, down_out, "--max-steps", "50", "--accuracy",
                             "--timeout", str(DOWN_TIMEOUT_S))

    def pool_started(trainer, out):
        assert trainer.poll() is None, (out.parent / f"{out.name}.log").read_text()[-3000:]
        family = [p for p in procs.descendants(trainer) if "resource_tracker" not in " ".join(p.cmdline())]
        workers = [p for p in family if p.ppid() == trainer.pid]
        pool = [p for p in family if p.ppid() != trainer.pid]
        return (workers, pool) if workers and pool else None

    # 1. kill -9 of a trainer (no CLI): its worker and the worker's reward pool follow it
    workers, pool = wait_for(lambda: pool_started(victim, killed_out), RUN_DEADLINE_S,
                             "the worker's math-verify pool", every_s=0.5)
    family = procs.descendants(victim)
    kill9(victim)
    killed = time.monotonic()
    wait_for(lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in family), ORPHAN_BOUND_S,
             f"the worker {[p.pid for p in workers]} and pool {[p.pid for p in pool]} to exit")
    assert time.monotonic() - killed <= ORPHAN_BOUND_S

    # 2. the server goes away for good under the other run
    wait_for(lambda: steps_logged(down_out) >= 1 or survivor.poll() is not None, RUN_DEADLINE_S, "one training step")
    assert survivor.poll() is None, (tmp_path / "down.log").read_text()[-3000:]
    assert pool_started(survivor, down_out)
    family = procs.descendants(survivor)
    kill9(server)
    killed = time.monotonic()
    rc = survivor.wait(DOWN_TIMEOUT_S + DOWN_BOUND_S)
    elapsed = time.monotonic() - killed
    log = (tmp_path / "down.log").read_text()
    assert rc != 0 and "TRAINED" not in log
    assert DOWN_TIMEOUT_S * 0.9 <= elapsed <= DOWN_TIMEOUT_S + DOWN_BOUND_S, elapsed
    assert f"http://127.0.0.1:{port}" in log and "unreachable" in log
    assert f"vllm_server_timeout={DOWN_TIMEOUT_S:g} s" in log and "Fix:" in log
    assert str(status_of(down_out).get("state")).startswith("failed")
    wait_for(lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in family), ORPHAN_BOUND_S,
             "the failed run's worker and pool to exit")


def test_stop_under_way_says_the_supervisor_is_gone_whatever_the_server(tmp_path, monkeypatch):
    """Twenty-fourth session's trial: after `kill -9` of the supervisor, trainer.log read "every request waits for it,
    1800 s more at most" (the outage began before the trainer's watchdog saw the supervisor gone). The job's
    supervisor no longer running is a stop under way too, and the trainer's own reason is said first."""
    from asyncgrpo_cli.run import stop_reason
    from asyncgrpo_cli.run.state import LOCK_OWNER_ENV, SERVER_PID_ENV

    monkeypatch.delenv(SERVER_PID_ENV, raising=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv(LOCK_OWNER_ENV, str(os.getpid()))  # this process is the supervisor (the API's own run lock)
    assert stop_reason.stop_under_way(tmp_path) is None
    monkeypatch.setenv(LOCK_OWNER_ENV, str(os.getppid()))  # a supervisor that runs
    assert stop_reason.stop_under_way(tmp_path) is None
    monkeypatch.setenv(LOCK_OWNER_ENV, str(gone.pid))
    assert stop_reason.stop_under_way(tmp_path) == f"the supervisor (pid {gone.pid}) is gone"
    stop_reason.own_reason.append("the supervisor (pid 77) is gone")
    try:
        assert stop_reason.stop_under_way(tmp_path) == "the supervisor (pid 77) is gone"
    finally:
        stop_reason.own_reason.pop()


def test_a_sync_that_fails_once_the_supervisor_is_seen_gone_is_the_stops():
    """The watchdog that sees the supervisor gone fills `own_reason`, then sends this process SIGTERM; the server the
    supervisor started dies with it. A sync failing in between (before the signal's handler ran) is that stop's,
    not a failure: the trainer saves the step and stops. A suite run under load had it take the failure path, which
    gives the default SIGTERM handler back, and die of the signal without its final line."""
    from types import SimpleNamespace

    from asyncgrpo_cli.run import stop_reason
    from asyncgrpo_cli.train.stopping import StopHandling

    trainer = StopHandling()
    trainer._stop_requested, trainer.accelerator = False, SimpleNamespace(num_processes=1)
    assert not trainer._sync_failed_while_stopping(RuntimeError("reset"))
    stop_reason.own_reason.append("the supervisor (pid 77) is gone")
    try:
        assert trainer._sync_failed_while_stopping(RuntimeError("reset"))
        trainer.accelerator.num_processes = 2  # other ranks may wait in a collective: raised as before
        assert not trainer._sync_failed_while_stopping(RuntimeError("reset"))
    finally:
        stop_reason.own_reason.pop()
    trainer.accelerator.num_processes, trainer._stop_requested = 1, True
    assert trainer._sync_failed_while_stopping(RuntimeError("reset"))
