"""The worker's request path (issue #41): one request per group with ``n = num_generations`` by default, one per
rollout with ``rollout.group_requests=false`` or a loop whose hooks need it, the same groups either way, and the
request timing metrics (``rollout/request_s``, ``parse_s``, ``assembly_s``, ``rollouts_per_s``, ``groups_per_s``)."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.sampler.client import SamplerClient
from asyncgrpo_cli.testing import deadline_s as machine_deadline

from test_worker import _Loop, _Value, alternating_reward, config, model_dir, prompts, server, tokenizer  # noqa: F401


class CountingClient(SamplerClient):
    """The real client, counting the generation requests it sends and the completions each asked for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sizes: list[int] = []

    async def generate_turns(self, prompt_ids, sampling, n, model=None):
        self.sizes.append(n)
        return await super().generate_turns(prompt_ids, sampling, n, model)


class OwnTurnLoop(_Loop):
    """A subclass with its own ``generate_one_turn`` hook: it must be called once per rollout."""

    calls = 0

    async def generate_one_turn(self, prompt_ids):
        OwnTurnLoop.calls += 1
        return await super().generate_one_turn(prompt_ids)


def run_groups(cls, server_url, tokenizer, tmp_path, groups=2, **kw):
    cfg = config(tmp_path, server_url, **kw)
    buf, metrics, errors = queue.Queue(), queue.Queue(), queue.Queue()
    client = CountingClient(server_url, max_concurrency=8, timeout_s=60)
    loop = cls(cfg, "tiny", prompts(), [alternating_reward], tokenizer, [tokenizer.eos_token_id], buf, _Value(0),
               _Value(10.0**9), _Value(0.0), threading.Event(), errors, metrics, consumed_tokens_value=_Value(0.0),
               client=client)
    thread = threading.Thread(target=lambda: asyncio.run(loop.run_async()), daemon=True)
    thread.start()
    try:
        outcomes = [buf.get(timeout=machine_deadline(120)) for _ in range(groups)]
    finally:
        loop.stop()
        thread.join(timeout=30)
    names: set[str] = set()
    while not metrics.empty():
        names |= set(metrics.get())
    return loop, client, outcomes, names


def test_one_request_per_group_by_default(server, tokenizer, tmp_path):
    loop, client, outcomes, names = run_groups(_Loop, server.url, tokenizer, tmp_path)
    assert loop.group_requests_apply and client.sizes and set(client.sizes) == {4}  # num_generations=4
    assert all(o.kind == "kept" and len(o.samples) == 4 for o in outcomes)
    for o in outcomes:  # four distinct rollouts of the group, one prompt
        assert len({tuple(s.input_ids) for s in o.samples}) >= 2
    assert {"rollout/request_s", "rollout/parse_s", "rollout/assembly_s", "rollout/rollouts_per_s",
            "rollout/groups_per_s"} <= names
    assert loop.cap is not None and loop._in_flight == 0 and loop._waiting_rollouts == 0


@pytest.mark.parametrize("cls, kw", [(_Loop, {"group_requests": False}), (OwnTurnLoop, {})])
def test_one_request_per_rollout_when_off_or_hooks_overridden(cls, kw, server, tokenizer, tmp_path):
    OwnTurnLoop.calls = 0
    loop, client, outcomes, _ = run_groups(cls, server.url, tokenizer, tmp_path, **kw)
    assert not loop.group_requests_apply and set(client.sizes) == {1}
    assert all(len(o.samples) == 4 for o in outcomes)
    if cls is OwnTurnLoop:
        assert OwnTurnLoop.calls == len(client.sizes)


def test_group_requests_need_single_turn_rollouts_and_no_masks():
    class Cfg:
        group_requests, num_generations, top_k, top_p, min_p = True, 8, 0, 1.0, None

    loop = AsyncRolloutLoop.__new__(AsyncRolloutLoop)
    loop.config, loop.tools, loop.environment_factory, loop.client = Cfg(), [], None, SamplerClient("http://x")
    loop.sampling = type("S", (), {"return_sampling_mask": False})()
    assert AsyncRolloutLoop.group_requests_apply.func(loop)
    for change in ({"tools": [print]}, {"environment_factory": object}):
        probe = AsyncRolloutLoop.__new__(AsyncRolloutLoop)
        probe.__dict__.update(loop.__dict__, **change)
        assert not AsyncRolloutLoop.group_requests_apply.func(probe)
    loop.sampling = type("S", (), {"return_sampling_mask": True})()
    assert not AsyncRolloutLoop.group_requests_apply.func(loop)
    loop.sampling = type("S", (), {"return_sampling_mask": False})()
    Cfg.num_generations = 1
    assert not AsyncRolloutLoop.group_requests_apply.func(loop)
