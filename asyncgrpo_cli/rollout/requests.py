"""How the rollout worker's requests go out (issue #41), a mixin of `AsyncRolloutLoop`: the concurrency slots a
rollout (or a whole group) holds, one request per group (``n = num_generations`` on ``/v1/completions``) when the
rollouts are single-turn, and the worker's own timing of each request (``rollout/request_s``: the HTTP round trip;
``rollout/parse_s``: reading the response).

One request per group instead of ``num_generations``: the server fans it out into that many engine requests that
share the prompt (vLLM's parallel sampling; the same seeds, ``seed + i``, as separate requests would get from the
client's seed sequence), and the worker pays one HTTP round trip, one JSON body and one task wake-up per group.
The group's stamp, the staleness allowance and the concurrency cap (which counts rollouts) see the same numbers
either way.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from .types import Rollout, TurnRecord


class RequestPaths:
    """Mixin of `AsyncRolloutLoop` (which sets ``config``, ``client``, ``metrics``, ``cap``, ``tools``,
    ``environment_factory``, ``sampling``, the slot counters and ``_slot_changed``)."""

    async def generate_group_turns(self, prompt_ids: list[int], n: int) -> list[TurnRecord]:
        """``n`` completions of one prompt in ONE sampling request (``n`` of ``/v1/completions``, issue #41) →
        ``n`` `TurnRecord`, as ``n`` calls of `generate_one_turn` would give (distinct seeds included). The
        default loop uses it for a group's single-turn rollouts (``rollout.group_requests``,
        `group_requests_apply`)."""
        results = await self._request(lambda model: self.client.generate_turns(prompt_ids, self.sampling, n,
                                                                               model=model))
        self._record_request(results[0])
        return [r.to_turn_record() for r in results]

    async def _request(self, send):
        """``await send(model)`` with the served model; a 404 for an adapter a restarted server lost is sent
        once more under the current adapter (see `generate_one_turn`)."""
        from ..sampler.protocol import SamplerRequestError

        model = self.served_model()
        outage = getattr(self.client, "outage", None)
        recoveries = outage.recoveries if outage is not None else 0
        try:
            return await send(model)
        except SamplerRequestError as exc:
            current = self.served_model()
            if not (exc.status == 404 and outage is not None and outage.recoveries != recoveries and current != model):
                raise
            return await send(current)

    def _record_request(self, result) -> None:
        """The worker's side of one request's time (issue #41): the HTTP round trip and the response's parse."""
        request_s = getattr(result, "request_s", None)
        if request_s:
            self.metrics.add("rollout/request_s", float(request_s))
            self.metrics.add("rollout/parse_s", float(getattr(result, "parse_s", 0.0) or 0.0))

    @functools.cached_property
    def group_requests_apply(self) -> bool:
        """Whether a group's rollouts go out as ONE request with ``n = num_generations`` (issue #41): with
        ``rollout.group_requests`` (default on), ``num_generations > 1``, single-turn rollouts (no tools, no
        environment), the default `generate_one` / `generate_one_turn` (a subclass that overrides either
        gets one call per rollout, as before), no sampling masks (their route answers one completion per
        request) and a client that offers ``generate_turns``."""
        cls = type(self)
        return (bool(getattr(self.config, "group_requests", True)) and int(self.config.num_generations) > 1
                and not self.tools and self.environment_factory is None
                and cls.generate_one.__qualname__ == "AsyncRolloutLoop.generate_one"
                and cls.generate_one_turn.__qualname__ == "AsyncRolloutLoop.generate_one_turn"
                and not self.sampling.return_sampling_mask and hasattr(self.client, "generate_turns"))

    async def _acquire_slot(self, count: int = 1) -> None:
        """Wait for ``count`` concurrency slots under the cap and take them (a group request takes one per
        completion; when the cap is below ``count`` they are taken once nothing else is in flight); a rollout
        cancelled while it waits (its group can no longer be trained, `_cancel_doomed`) stops waiting without."""
        acquired = False
        try:
            async with self._slot_changed:
                await self._slot_changed.wait_for(
                    lambda: self._in_flight + count <= self.cap.value or (count > 1 and self._in_flight == 0))
                self._in_flight += count
                self._waiting_rollouts -= count
                acquired = True
                self._slot_changed.notify_all()
        finally:
            if not acquired:
                self._waiting_rollouts -= count

    async def _release_slot(self, count: int = 1) -> None:
        async with self._slot_changed:
            self._in_flight -= count
            self._slot_changed.notify_all()

    def _stamp(self, group_id: int, stamp: list[int]) -> None:
        if not stamp:  # the group's model version: the policy when its first rollout starts (SPEC §3.1)
            stamp.append(int(self.model_version_value.value))
            self._group_stamps[group_id] = stamp
            if self.rounds is not None:
                self.rounds.on_group_stamped(group_id, stamp[0])

    async def _group_rollouts(self, row: dict[str, Any], group_id: int, stamp: list[int]) -> list[Any]:
        """The group's ``num_generations`` rollouts from ONE request (`group_requests_apply`)."""
        G = int(self.config.num_generations)
        await self._acquire_slot(G)
        self._stamp(group_id, stamp)
        start = time.monotonic()
        prompt = row["prompt"]
        try:
            turns = await self.generate_group_turns(self.render_prompt(prompt), G)
        finally:
            await self._release_slot(G)
        self.cap.on_rollout_completed(G)
        duration = time.monotonic() - start
        results = []
        for turn in turns:
            text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
            result = _RolloutResult(Rollout(completion=[{"role": "assistant", "content": text}],
                                            completion_ids=list(turn.output_ids), turns=[turn]), prompt)
            result.duration = duration
            results.append(result)
        return results


class _RolloutResult:
    """One rollout of a group with what the group needs beside it: its prompt (an environment's ``reset``
    may make it), the environment reward, the failure reason of a failed environment hook, its wall time."""

    __slots__ = ("rollout", "prompt", "env_reward", "failed", "duration")

    def __init__(self, rollout: Rollout, prompt: list[dict[str, Any]], env_reward: tuple[type, float] | None = None,
                 failed: str | None = None) -> None:
        self.rollout = rollout
        self.prompt = prompt
        self.env_reward = env_reward
        self.failed = failed
        self.duration = 0.0
