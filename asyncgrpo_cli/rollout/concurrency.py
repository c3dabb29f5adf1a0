"""The vLLM-load adaptive cap on concurrent rollouts (SPEC §4.2, Appendix B.5).

:class:`ConcurrencyCap` is the state machine the rollout loop feeds with one observation per poll
(every 5 s) and with rollout completions; pure: no I/O, no clocks. The observations are
:class:`ServerLoad` values (`asyncgrpo_cli.sampler.server_load`, shared with the sampler boundary; re-exported here).
"""

from __future__ import annotations

import math

from ..sampler.server_load import ServerLoad, reduce_vllm_metrics

__all__ = ["ConcurrencyCap", "ServerLoad", "reduce_vllm_metrics", "POLL_INTERVAL_S"]

#: How often the rollout loop reads the server's ``/metrics`` (SPEC §4.2), in seconds.
POLL_INTERVAL_S = 5.0


class ConcurrencyCap:
    """Live cap on in-flight rollouts that follows the server's KV-cache load (SPEC §4.2, B.5).

    - Initial value: ``min(max_concurrent_rollouts, max(1, kv_cache_tokens // max_model_len))``, the
      number of requests that fit in the KV cache at full length.
    - Fallback: without load metrics (``adaptive=False``, the default when ``kv_cache_tokens`` is
      ``None``) the cap is ``max_concurrent_rollouts`` and stays there. With metrics but no known KV
      capacity (``adaptive=True``, ``kv_cache_tokens=None``) it starts at ``max_concurrent_rollouts``
      and adapts.
    - :meth:`observe`, once per poll: usage ``> 0.8`` shrinks to ``max(1, floor(cap × 0.7))``; usage
      ``< 0.6`` with no waiting requests, after at least ``cap`` rollouts completed since the last
      increase, grows to ``min(max_concurrent_rollouts, max(cap + 1, floor(cap × 1.25)))``. At most
      one change per call.
    - Always within ``[1, max_concurrent_rollouts]``.

    Args:
        max_concurrent_rollouts: the user's hard ceiling (>= 1).
        kv_cache_tokens: server KV capacity in tokens (summed over engines); ``None`` = no metrics.
        max_model_len: the server's ``--max-model-len`` in tokens (>= 1); needed with ``kv_cache_tokens``.
        adaptive: whether :meth:`observe` may move the cap; default: ``kv_cache_tokens is not None``.

    Raises:
        ValueError: a bad argument, named in the message.
    """

    SHRINK_ABOVE_FRAC = 0.8
    GROW_BELOW_FRAC = 0.6
    SHRINK_FACTOR = 0.7
    GROW_FACTOR = 1.25

    def __init__(
        self,
        max_concurrent_rollouts: int,
        kv_cache_tokens: int | None = None,
        max_model_len: int | None = None,
        adaptive: bool | None = None,
    ) -> None:
        if isinstance(max_concurrent_rollouts, bool) or not isinstance(max_concurrent_rollouts, int):
            raise TypeError(
                f"max_concurrent_rollouts must be an int, got {max_concurrent_rollouts!r}"
            )
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        self._max = max_concurrent_rollouts
        self._completed_since_increase = 0
        self._adaptive = (kv_cache_tokens is not None) if adaptive is None else bool(adaptive)
        if kv_cache_tokens is None:
            self._cap = self._max
            return
        if kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0, got {kv_cache_tokens}")
        if max_model_len is None or max_model_len < 1:
            raise ValueError(
                f"max_model_len must be an int >= 1 when kv_cache_tokens is given, got {max_model_len!r}"
            )
        self._cap = min(self._max, max(1, int(kv_cache_tokens) // int(max_model_len)))

    @classmethod
    def from_server_load(
        cls, max_concurrent_rollouts: int, load: ServerLoad | None, max_model_len: int | None
    ) -> ConcurrencyCap:
        """Build the cap from a first scrape.

        ``load=None`` (the server has no ``/metrics``) gives the fixed fallback at
        ``max_concurrent_rollouts``; a load without KV capacity starts there but adapts.
        """
        if load is None:
            return cls(max_concurrent_rollouts, adaptive=False)
        kv_tokens = load.kv_cache_tokens
        return cls(
            max_concurrent_rollouts,
            kv_tokens,
            max_model_len if kv_tokens is not None else None,
            adaptive=True,
        )

    @property
    def value(self) -> int:
        """The current cap on in-flight rollouts (logged as ``rollout/concurrency_cap``)."""
        return self._cap

    @property
    def max_concurrent_rollouts(self) -> int:
        """The hard ceiling the cap is clamped to."""
        return self._max

    @property
    def adaptive(self) -> bool:
        """``False`` in fallback mode (no server metrics): the cap stays at the ceiling."""
        return self._adaptive

    @property
    def completed_since_increase(self) -> int:
        """Rollouts completed since the last increase (or since start)."""
        return self._completed_since_increase

    def on_rollout_completed(self, count: int = 1) -> None:
        """Record ``count`` completed rollouts (counts toward the next increase).

        Raises:
            ValueError: ``count < 0``.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._completed_since_increase += count

    def observe(self, kv_cache_usage_frac: float | None, num_requests_waiting: int) -> int:
        """Apply one poll of server load and return the (possibly changed) cap.

        Args:
            kv_cache_usage_frac: KV-cache usage in [0, 1], max over engines; ``None`` or NaN = not
                reported this poll (no change).
            num_requests_waiting: requests waiting in the server, summed over engines (>= 0).

        Raises:
            ValueError: ``num_requests_waiting < 0`` or usage outside [0, 1] (beyond float slack).
        """
        if num_requests_waiting < 0:
            raise ValueError(f"num_requests_waiting must be >= 0, got {num_requests_waiting}")
        if not self._adaptive or kv_cache_usage_frac is None or math.isnan(kv_cache_usage_frac):
            return self._cap
        usage = float(kv_cache_usage_frac)
        if usage < -1e-6 or usage > 1.0 + 1e-6:
            raise ValueError(
                f"kv_cache_usage_frac must be a fraction in [0, 1], got {kv_cache_usage_frac}"
            )
        if usage > self.SHRINK_ABOVE_FRAC:
            self._cap = max(1, math.floor(self._cap * self.SHRINK_FACTOR))
        elif (
            usage < self.GROW_BELOW_FRAC
            and num_requests_waiting == 0
            and self._completed_since_increase >= self._cap
            and self._cap < self._max
        ):
            grown = max(self._cap + 1, math.floor(self._cap * self.GROW_FACTOR))
            self._cap = min(self._max, grown)
            self._completed_since_increase = 0
        return self._cap

    def observe_load(self, load: ServerLoad | None) -> int:
        """:meth:`observe` with a :class:`ServerLoad` (``None`` = scrape failed: no change)."""
        if load is None:
            return self._cap
        return self.observe(load.kv_cache_usage_frac, load.num_requests_waiting)

    def __repr__(self) -> str:
        return (
            f"ConcurrencyCap(value={self._cap}, max_concurrent_rollouts={self._max}, "
            f"adaptive={self._adaptive}, completed_since_increase={self._completed_since_increase})"
        )
