"""The async client against aiohttp servers that misbehave (SPEC Appendix B.17)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncgrpo_cli.sampler import (
    SamplerClient,
    SamplerProtocolError,
    SamplerRequestError,
    SamplerRetryError,
    SamplerUnavailableError,
    SamplingParams,
    SyncSamplerClient,
)

from .conftest import run

PARAMS = SamplingParams(max_tokens=2, logprobs=1)
GOOD = {
    "choices": [
        {
            "token_ids": [7, 8],
            "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.1, -0.2], "top_logprobs": [{"token_id:7": -0.1}, {"token_id:8": -0.2}]},
        }
    ]
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(handler, port: int | None = None, route: str = "/v1/completions") -> TestServer:
    app = web.Application()
    app.router.add_route("*", route, handler)
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server()
    return server


def fast_client(url: str, **kw) -> SamplerClient:
    kw.setdefault("timeout_s", 5.0)
    return SamplerClient(url, max_concurrency=4, backoff_base_s=0.01, backoff_max_s=0.05, **kw)


def url_of(server: TestServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def test_pool_is_sized_to_the_concurrency_limit():
    c = SamplerClient("http://127.0.0.1:1/v1", max_concurrency=700)
    assert c.limits.max_connections == 704 and c.limits.max_keepalive_connections == 704
    assert c.base_url == "http://127.0.0.1:1"
    run(c.aclose())
    with pytest.raises(ValueError, match="base_url"):
        SamplerClient("localhost:8000")


def test_concurrency_never_exceeds_the_limit():
    limit = 3
    state = {"inflight": 0, "max": 0}
    release = asyncio.Event()

    async def handler(request):
        state["inflight"] += 1
        state["max"] = max(state["max"], state["inflight"])
        if state["inflight"] >= limit:
            release.set()
        await release.wait()
        state["inflight"] -= 1
        return web.json_response(GOOD)

    async def main():
        server = await serve(handler)
        try:
            async with SamplerClient(url_of(server), max_concurrency=limit, timeout_s=30) as c:
                turns = await asyncio.gather(*(c.generate_turn([1], PARAMS) for _ in range(3 * limit)))
        finally:
            await server.close()
        return turns

    turns = run(main())
    assert len(turns) == 9 and state["max"] == limit
    assert len({t.seed for t in turns}) == 9


def test_5xx_then_ok_is_retried_and_counted():
    calls = []

    async def handler(request):
        calls.append(await request.json())
        if len(calls) <= 2:
            return web.json_response({"error": {"message": "engine busy"}}, status=503)
        return web.json_response(GOOD)

    async def main():
        server = await serve(handler)
        try:
            async with fast_client(url_of(server)) as c:
                turn = await c.generate_turn([1, 2], PARAMS)
                return turn, c.retry_count
        finally:
            await server.close()

    turn, retries = run(main())
    assert turn.output_ids == [7, 8] and retries == 2
    assert calls[0]["seed"] == calls[2]["seed"]  # a retry resends the same request


def dropping(calls: list, first: int):
    """A handler that drops the connection without an answer for the first ``first`` requests, then answers."""
    async def handler(request):
        calls.append(1)
        if len(calls) <= first:
            request.transport.close()
            await asyncio.sleep(0)
            return web.Response()
        return web.json_response(GOOD)
    return handler


def test_closed_connection_is_retried():
    calls = []
    handler = dropping(calls, 1)

    async def main():
        server = await serve(handler)
        try:
            async with fast_client(url_of(server)) as c:
                turn = await c.generate_turn([1], PARAMS)
                return turn, c.retry_count
        finally:
            await server.close()

    turn, retries = run(main())
    assert turn.output_ids == [7, 8] and retries == 1


def test_slow_server_times_out_then_gives_up_within_bound():
    async def handler(request):
        await asyncio.Event().wait()  # never answers

    async def main():
        server = await serve(handler)
        try:
            async with fast_client(url_of(server), timeout_s=0.2, max_retries=2) as c:
                start = time.monotonic()
                with pytest.raises(SamplerRetryError) as err:
                    await c.generate_turn([1], PARAMS)
                return err.value, c.retry_count, time.monotonic() - start
        finally:
            await server.close()

    error, retries, elapsed = run(main())
    assert retries == 2
    assert "/v1/completions" in str(error) and "timed out" in str(error) and "after 2 retries" in str(error)
    assert elapsed < 10  # 3 attempts × 0.2 s + backoff, with a generous margin


def test_4xx_is_not_retried_and_carries_message_route_and_request():
    async def handler(request):
        body = {"error": {"message": "This model's maximum context length is 64 tokens.", "type": "BadRequestError", "code": 400}}
        return web.json_response(body, status=400)

    async def main():
        server = await serve(handler)
        try:
            async with fast_client(url_of(server)) as c:
                with pytest.raises(SamplerRequestError) as err:
                    await c.generate_turn([1, 2, 3], PARAMS)
                return err.value, c.retry_count
        finally:
            await server.close()

    error, retries = run(main())
    assert retries == 0 and error.status == 400
    assert error.server_message == "This model's maximum context length is 64 tokens."
    text = str(error)
    assert "/v1/completions" in text and "maximum context length" in text and "prompt=<3 items>" in text


def test_malformed_json_names_the_route():
    async def handler(request):
        return web.Response(text="<html>proxy error</html>", content_type="text/html")

    async def main():
        server = await serve(handler)
        try:
            async with fast_client(url_of(server)) as c:
                with pytest.raises(SamplerProtocolError) as err:
                    await c.generate_turn([1], PARAMS)
                return err.value, c.retry_count
        finally:
            await server.close()

    error, retries = run(main())
    assert retries == 0 and error.route == "/v1/completions"
    assert "not JSON" in str(error) and "proxy error" in str(error)


def test_server_down_gives_up_after_timeout_naming_url():
    port = free_port()

    async def main():
        async with fast_client(f"http://127.0.0.1:{port}", timeout_s=0.5) as c:
            start = time.monotonic()
            with pytest.raises(SamplerUnavailableError) as err:
                await c.generate_turn([1], PARAMS)
            return err.value, c.retry_count, time.monotonic() - start

    error, retries, elapsed = run(main())
    assert retries >= 2  # refused connections are retried beyond max_retries' budget until the deadline
    assert f"127.0.0.1:{port}/v1/completions" in str(error) and "refused" in str(error)
    assert 0.4 <= elapsed < 10


def test_server_coming_back_is_waited_for():
    port = free_port()

    async def handler(request):
        return web.json_response(GOOD)

    async def main():
        async with fast_client(f"http://127.0.0.1:{port}", timeout_s=60) as c:
            task = asyncio.create_task(c.generate_turn([1], PARAMS))
            deadline = time.monotonic() + 30
            while c.retry_count < 1:  # the client has been refused at least once
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            server = await serve(handler, port=port)
            try:
                turn = await asyncio.wait_for(task, 30)
            finally:
                await server.close()
            return turn

    assert run(main()).output_ids == [7, 8]


def test_wait_until_ready_deadline_and_success():
    port = free_port()

    async def health(request):
        return web.Response()

    async def main():
        async with fast_client(f"http://127.0.0.1:{port}") as c:
            with pytest.raises(SamplerUnavailableError) as err:
                await c.wait_until_ready(0.3, poll_s=0.05)
            server = await serve(health, port=port, route="/health")
            try:
                waited = await c.wait_until_ready(10, poll_s=0.05)
            finally:
                await server.close()
            return err.value, waited

    error, waited = run(main())
    assert f"http://127.0.0.1:{port}" in str(error) and "not ready after 0.3 s" in str(error)
    assert waited < 10


def test_metrics_absent_and_server_info_absent_give_none():
    async def other(request):
        return web.json_response({})

    async def main():
        server = await serve(other, route="/other")
        try:
            async with fast_client(url_of(server)) as c:
                return await c.read_metrics(), await c.server_info()
        finally:
            await server.close()

    assert run(main()) == (None, None)


def test_control_routes_fail_fast_with_route_name():
    async def handler(request):
        return web.json_response({"error": "weight transfer not initialised"}, status=500)

    async def main():
        server = await serve(handler, route="/update_weights")
        try:
            async with fast_client(url_of(server)) as c:
                with pytest.raises(SamplerRetryError) as err:
                    await c.update_weights({"names": []})
                return err.value, c.retry_count
        finally:
            await server.close()

    error, retries = run(main())
    assert retries == 0 and "/update_weights" in str(error) and "not initialised" in str(error)


def test_sync_client_reset_prefix_cache_retries_while_false():
    answers = iter([False, False, True])

    async def handler(request):
        return web.json_response({"success": next(answers)})

    async def main():
        server = await serve(handler, route="/reset_prefix_cache")
        try:
            url = url_of(server)
            loop = asyncio.get_running_loop()

            def blocking():
                with SyncSamplerClient(url, timeout_s=5) as sync:
                    return sync.reset_prefix_cache(max_attempts=5, retry_delay_s=0.01)

            return await loop.run_in_executor(None, blocking)
        finally:
            await server.close()

    assert run(main()) is True


def test_health_and_metrics_time_out_as_before():
    """aiohttp's timeouts surface as httpx's: health() says False, read_metrics() names the route."""

    async def never(request):
        await asyncio.Event().wait()

    async def main():
        server = await serve(never, route="/{tail:.*}")
        try:
            async with fast_client(url_of(server), timeout_s=0.2, metrics_timeout_s=0.2) as c:
                healthy = await c.health()
                with pytest.raises(SamplerUnavailableError) as err:
                    await c.read_metrics()
                return healthy, err.value
        finally:
            await server.close()

    healthy, error = run(main())
    assert healthy is False
    assert error.route == "/metrics" and "TimeoutException" in str(error)


def test_httpx_transport_argument_still_drives_requests():
    """`transport=` routes requests through httpx (e.g. a MockTransport) with the same retry rules."""
    import httpx

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        if len(seen) == 1:
            return httpx.Response(503, json={"error": {"message": "engine busy"}})
        return httpx.Response(200, json=GOOD)

    async def main():
        async with fast_client("http://sampler.test", transport=httpx.MockTransport(handler)) as c:
            return await c.generate_turn([1, 2], PARAMS), c.retry_count

    turn, retries = run(main())
    assert turn.output_ids == [7, 8] and retries == 1
    assert seen == [("POST", "/v1/completions")] * 2


def test_closed_client_refuses_requests():
    async def main():
        c = fast_client("http://127.0.0.1:1")
        await c.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await c.generate_turn([1], PARAMS)

    run(main())


def test_readiness_deadline_names_the_last_answer():
    from asyncgrpo_cli.sampler.client import _Readiness

    ready = _Readiness("http://h:1", deadline_s=0.0)
    assert ready.answered(503) is None
    with pytest.raises(SamplerUnavailableError, match=r"http://h:1 not ready after 0 s \(GET /health\): HTTP 503"):
        ready.next_timeout()
    ready = _Readiness("http://h:1", deadline_s=60.0)
    assert 0.05 <= ready.next_timeout() <= 5.0 and ready.pause(0.5) == 0.5
    assert ready.answered(200) >= 0.0


# ---------------------------------------------------------------------------------------------- outages (B.17)
def test_poll_load_survives_slow_and_failed_metrics_reads_and_counts_them():
    """A slow or failing /metrics read never raises from poll_load: the load is unknown (None), counted."""
    answers = iter(["slow", "500", "ok"])
    metrics = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"

    async def handler(request):
        answer = next(answers)
        if answer == "slow":
            await asyncio.sleep(5)
        if answer == "500":
            return web.Response(status=500, text="boom")
        return web.Response(text=metrics, content_type="text/plain")

    async def main():
        server = await serve(handler, route="/metrics")
        try:
            async with fast_client(url_of(server), metrics_timeout_s=0.2) as c:
                loads = [await c.poll_load() for _ in range(3)]
                return loads, c.metrics_failure_count, c.outage.active
        finally:
            await server.close()

    (slow, failed, ok), failures, outage = run(main())
    assert slow is None and failed is None and failures == 2 and outage is False
    assert ok is not None and ok.num_requests_running == 2


def test_poll_load_of_a_server_that_is_down_starts_an_outage_without_raising():
    async def main():
        async with fast_client(f"http://127.0.0.1:{free_port()}", timeout_s=30) as c:
            return await c.poll_load(), c.outage.active, c.outage.status()

    load, active, status = run(main())
    assert load is None and active and status.startswith("server unreachable, retrying (")


def test_control_routes_wait_out_a_refused_connection():
    """/pause and the weight-transfer routes are resent after a refusal (it never reached the server)."""
    port = free_port()
    calls = []

    async def handler(request):
        calls.append(request.path)
        return web.json_response({})

    async def main():
        async with fast_client(f"http://127.0.0.1:{port}", timeout_s=60) as c:
            task = asyncio.create_task(c.pause())
            deadline = time.monotonic() + 30
            while c.retry_count < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handler)
            server = TestServer(app, host="127.0.0.1", port=port)
            await server.start_server()
            try:
                await asyncio.wait_for(task, 30)
            finally:
                await server.close()
            return c.outage.recoveries

    assert run(main()) == 1
    assert calls[-1] == "/pause"


def test_sync_client_control_route_waits_for_the_server_then_gives_up_naming_it():
    port = free_port()
    with SyncSamplerClient(f"http://127.0.0.1:{port}", timeout_s=0.4, backoff_base_s=0.01, backoff_max_s=0.05) as c:
        start = time.monotonic()
        with pytest.raises(SamplerUnavailableError) as err:
            c.update_weights({"names": []})
        elapsed = time.monotonic() - start
    assert 0.35 <= elapsed < 10 and c.retry_count >= 2
    assert f"127.0.0.1:{port}/update_weights" in str(err.value) and "unreachable" in str(err.value)


def test_after_an_outage_generation_waits_for_the_hook_and_is_not_sent_before_it():
    """The generation request is not resent to a server that came back until ``after_outage`` finished
    (the worker waits there for the trainer's re-push); /health probes find the server meanwhile."""
    port = free_port()
    order = []
    hook_may_finish = asyncio.Event()

    async def handler(request):
        order.append(request.path)
        if request.path == "/health":
            return web.Response()
        return web.json_response(GOOD)

    async def after_outage():
        order.append("hook")
        await hook_may_finish.wait()
        order.append("hook done")

    async def main():
        async with fast_client(f"http://127.0.0.1:{port}", timeout_s=60, after_outage=after_outage) as c:
            task = asyncio.create_task(c.generate_turn([1], PARAMS))
            deadline = time.monotonic() + 30
            while c.retry_count < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handler)
            server = TestServer(app, host="127.0.0.1", port=port)
            await server.start_server()
            try:
                while "hook" not in order:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                late = asyncio.create_task(c.generate_turn([2], PARAMS))  # a new request also waits
                await asyncio.sleep(0.1)
                assert "/v1/completions" not in order
                hook_may_finish.set()
                turns = await asyncio.wait_for(asyncio.gather(task, late), 30)
            finally:
                await server.close()
            return turns, c.outage.recoveries

    turns, recoveries = run(main())
    assert [t.output_ids for t in turns] == [[7, 8], [7, 8]] and recoveries == 1
    assert order.index("hook done") < order.index("/v1/completions")
    assert order[0] == "/health"


def test_a_failing_after_outage_hook_fails_the_waiting_generation():
    port = free_port()

    async def handler(request):
        return web.Response() if request.path == "/health" else web.json_response(GOOD)

    async def after_outage():
        raise RuntimeError("no re-push within vllm_server_timeout")

    async def main():
        async with fast_client(f"http://127.0.0.1:{port}", timeout_s=60, after_outage=after_outage) as c:
            task = asyncio.create_task(c.generate_turn([1], PARAMS))
            deadline = time.monotonic() + 30
            while c.retry_count < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handler)
            server = TestServer(app, host="127.0.0.1", port=port)
            await server.start_server()
            try:
                with pytest.raises(RuntimeError, match="no re-push"):
                    await asyncio.wait_for(task, 30)
            finally:
                await server.close()

    run(main())


def test_an_outage_is_one_log_line_when_it_starts_and_one_when_it_ends_whatever_the_requests(caplog):
    """Issue #45: 16 generation requests waiting out one outage printed a line per request and backoff doubling
    (64 lines of 'retrying in 8.0 s ... (1793 s left)' in one trainer.log), the time left never moving. Now the
    outage says once when it starts (until when it is waited out) and once when it ends (after how long)."""
    port = free_port()

    async def handler(request):
        return web.json_response(GOOD)

    async def main():
        async with SamplerClient(f"http://127.0.0.1:{port}", max_concurrency=16, timeout_s=600, backoff_base_s=0.01,
                                 backoff_max_s=0.05) as c:
            tasks = [asyncio.create_task(c.generate_turn([1], PARAMS)) for _ in range(16)]
            deadline = time.monotonic() + 30
            while c.retry_count < 16 * 6:  # every request has retried several times (backoff doubled)
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            server = await serve(handler, port=port)
            try:
                turns = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            finally:
                await server.close()
            return turns, c.outage.recoveries

    with caplog.at_level("DEBUG", logger="asyncgrpo_cli.sampler.client"):
        turns, recoveries = run(main())
    assert len(turns) == 16 and recoveries == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"sampler http://127.0.0.1:{port}: server unreachable (") and \
        "600 s more at most (until " in warnings[0] and "sampler.timeout" in warnings[0], warnings
    assert warnings[1].startswith(f"sampler http://127.0.0.1:{port} answers again after ") and \
        "s unreachable (outage 1 ended)" in warnings[1], warnings


def test_the_sync_client_logs_an_outage_once_too(caplog):
    port = free_port()
    with caplog.at_level("DEBUG", logger="asyncgrpo_cli.sampler.client"):
        with SyncSamplerClient(f"http://127.0.0.1:{port}", timeout_s=0.5, backoff_base_s=0.01,
                               backoff_max_s=0.02) as c:
            with pytest.raises(SamplerUnavailableError):
                c.update_weights({"names": []})
    assert c.retry_count >= 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "server unreachable (" in warnings[0], warnings


def test_a_server_dying_mid_request_is_one_retry_warning_not_one_per_request(caplog):
    """A GPU drill's trainer.log: the server killed with 13 requests in flight, each request's first retry a
    warning line (13 lines). One client says it once per `RETRY_SAY_EVERY_S`, the count of the others on the next."""
    from asyncgrpo_cli.sampler.client import RETRY_SAY_EVERY_S

    handler = dropping([], 16)  # every request's first try: the connection dropped without an answer

    async def main():
        server = await serve(handler)
        try:
            async with SamplerClient(url_of(server), max_concurrency=16, timeout_s=5.0, backoff_base_s=0.01,
                                     backoff_max_s=0.05) as c:
                return await asyncio.wait_for(asyncio.gather(*(c.generate_turn([1], PARAMS) for _ in range(16))), 30)
        finally:
            await server.close()

    with caplog.at_level("DEBUG", logger="asyncgrpo_cli.sampler.client"):
        turns = run(main())
    assert len(turns) == 16 and RETRY_SAY_EVERY_S >= 5
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    warned = [r.getMessage() for r in retries if r.levelname == "WARNING"]
    assert len(retries) >= 16 and len(warned) == 1, warned


def test_a_stopping_job_logs_no_retry_warning(caplog):
    """Twenty-third session's trial: after `kill -9` of the server, the worker's first ``retrying in 1.0 s`` line (a
    dropped request, before the outage had started) read as a wait the job would sit out; the outage's own lines
    already said ``not waited out``. The twenty-fifth session's trial then read "retrying in 1.0 s" beside "not
    waited out" and "no request is retried any more" in the same second: a stopping job's retries are DEBUG."""
    handler = dropping([], 1)  # the first try: the connection dropped without an answer

    async def main():
        server = await serve(handler)
        try:
            async with SamplerClient(url_of(server), timeout_s=5.0, backoff_base_s=0.01, backoff_max_s=0.05) as c:
                c.outage.stop_under_way = lambda: "the server (pid 4242) was killed by SIGKILL"
                return await asyncio.wait_for(c.generate_turn([1], PARAMS), 30)
        finally:
            await server.close()

    with caplog.at_level("DEBUG", logger="asyncgrpo_cli.sampler.client"):
        run(main())
    retried = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert retried and all(r.levelname == "DEBUG" for r in retried), [(r.levelname, r.getMessage()) for r in retried]
