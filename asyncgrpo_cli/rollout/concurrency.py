"""The vLLM-load adaptive cap on concurrent rollouts (SPEC §4.2, Appendix B.5).

:func:`reduce_vllm_metrics` turns the samples of one ``/metrics`` scrape (already parsed, e.g. with
``prometheus_client.parser``) into a :class:`ServerLoad`; :class:`ConcurrencyCap` is the state machine
the rollout loop feeds with one observation per poll (every 5 s) and with rollout completions.
Both are pure: no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ConcurrencyCap", "ServerLoad", "reduce_vllm_metrics", "POLL_INTERVAL_S"]

#: How often the rollout loop reads the server's ``/metrics`` (SPEC §4.2), in seconds.
POLL_INTERVAL_S = 5.0

_KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class ServerLoad:
    """One ``/metrics`` scrape of the inference server, reduced over engines (SPEC §4.2, B.5).

    Attributes:
        kv_cache_usage_frac: KV-cache usage in [0, 1], the maximum over engines; ``None`` when absent.
        num_requests_running: requests being decoded, summed over engines.
        num_requests_waiting: requests accepted but not scheduled, summed over engines.
        num_preemptions_total: cumulative preempted (restarted) requests, summed over engines. A
            counter: the per-window ``rollout/vllm_preemption_count`` is the difference between scrapes.
        kv_cache_tokens: KV-cache capacity in tokens summed over engines, from
            ``vllm:cache_config_info`` (``kv_cache_size_tokens``, else ``num_gpu_blocks × block_size``);
            ``None`` when no engine reports it.
        num_engines: distinct engines seen (by the ``engine`` label).
    """

    kv_cache_usage_frac: float | None
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions_total: int
    kv_cache_tokens: int | None
    num_engines: int


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        value = int(float(raw))
    except (TypeError, ValueError):
        return None  # e.g. "None" before the engine has profiled its memory
    return value if value > 0 else None


def reduce_vllm_metrics(
    samples: Iterable[tuple[str, Mapping[str, str], float]],
) -> ServerLoad | None:
    """Reduce parsed Prometheus samples of vLLM's ``/metrics`` to a :class:`ServerLoad`.

    Args:
        samples: ``(sample_name, labels, value)`` triples, e.g. from
            ``[(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]`` (``prometheus_client.parser``).
            Names are sample names (``vllm:num_preemptions_total``, not the family name). Samples of
            other metrics are ignored.

    Returns:
        The reduced load: KV usage is the maximum over engines; running, waiting and preemptions are
        summed; KV capacity is summed over engines (each engine counted once, by its ``engine`` label).
        ``None`` when the scrape holds none of vLLM's load metrics (the caller then falls back to
        ``max_concurrent_rollouts``, SPEC §4.2).
    """
    usage_by_name: dict[str, list[float]] = {name: [] for name in _KV_USAGE_NAMES}
    running = 0.0
    waiting = 0.0
    preemptions = 0.0
    seen_any = False
    engines: set[str] = set()
    capacity_by_engine: dict[str, int] = {}
    for index, (name, labels, value) in enumerate(samples):
        labels = labels or {}
        engine = labels.get("engine")
        value = float(value)
        if name in usage_by_name:
            if not math.isnan(value):
                usage_by_name[name].append(value)
        elif name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        elif name in _PREEMPTIONS:
            preemptions += value
        elif name == _CACHE_INFO:
            tokens = _label_int(labels, "kv_cache_size_tokens")
            if tokens is None:
                blocks = _label_int(labels, "num_gpu_blocks")
                block_size = _label_int(labels, "block_size")
                if blocks is not None and block_size is not None:
                    tokens = blocks * block_size
            if tokens is not None:
                capacity_by_engine[engine if engine is not None else f"#{index}"] = tokens
        else:
            continue
        seen_any = True
        if engine is not None:
            engines.add(engine)
    if not seen_any:
        return None
    usage_values = next((v for v in usage_by_name.values() if v), [])
    return ServerLoad(
        kv_cache_usage_frac=max(usage_values) if usage_values else None,
        num_requests_running=int(running),
        num_requests_waiting=int(waiting),
        num_preemptions_total=int(preemptions),
        kv_cache_tokens=sum(capacity_by_engine.values()) if capacity_by_engine else None,
        num_engines=max(1, len(engines)),
    )


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
