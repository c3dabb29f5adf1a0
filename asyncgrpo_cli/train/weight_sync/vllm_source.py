"""Our `FullWeightSource` stream as the ``WeightSource`` vLLM's trainer-side engines read (vLLM 0.28+).

vLLM's source type changed shape between releases, and its engines take one at ``trainer_init``:

- the shape the 0.28 adapters were written for: ``metadata()`` a method, the stream read by iterating the
  source itself;
- vLLM 0.33 (read from its ``vllm/distributed/weight_transfer/base.py`` and run on the lent H200):
  ``metadata`` must be a ``functools.cached_property`` (the class refuses anything else at definition),
  the stream is ``iter_full()`` (NCCL broadcast and CUDA IPC) and ``owned_names(rank)`` derives from
  ``ParamMeta.owners`` (None = every rank).

`vllm_weight_source` builds the right one for the installed vLLM. The parameter names, shapes and dtypes
are the model's and do not change between syncs, so caching the metadata of the first sync is exact.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .names import ParamMeta


def _checked(meta: list[ParamMeta], tensors: Iterator[tuple[str, torch.Tensor]],
             device: torch.device | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` moved to ``device``, checked against the announced metadata, in order."""
    count = 0
    for index, (name, tensor) in enumerate(tensors):
        expected = meta[index] if index < len(meta) else None
        if expected is None or expected.name != name or tuple(tensor.shape) != expected.shape \
                or tensor.dtype != expected.dtype:
            raise RuntimeError(
                f"weight stream disagrees with its metadata at #{index}: got {name!r} "
                f"{tuple(tensor.shape)} {tensor.dtype}, announced {expected}"
            )
        if device is not None and tensor.device != device:
            tensor = tensor.to(device, non_blocking=True)
        count += 1
        yield name, tensor
    if count != len(meta):
        raise RuntimeError(f"weight stream yielded {count} tensors, metadata announced {len(meta)}")


def metadata_is_cached_property(api: Any) -> bool:
    """True when the installed vLLM's ``WeightSource.metadata`` is a property (vLLM 0.33 and later)."""
    base = getattr(api, "WeightSource", None)
    return base is not None and isinstance(inspect.getattr_static(base, "metadata", None), property)


def vllm_weight_source(api: Any, metadata: Callable[[], list[ParamMeta]],
                       tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> Any:
    """A vLLM ``WeightSource`` over our weights.

    Args:
        api: namespace with vLLM's ``WeightSource`` and ``ParamMeta`` (or recording fakes in tests).
        metadata: our metadata of the sync in progress (``FullWeightSource.metadata()``), in stream order.
        tensors: a fresh, checked stream of ``(name, tensor)`` pairs of the sync in progress, in the same
            order; every call starts a new pass (vLLM reads it once per sync).

    Returns:
        an instance of a subclass of ``api.WeightSource`` in the installed vLLM's shape.
    """
    base = getattr(api, "WeightSource", None) or object

    def vllm_metadata() -> list[Any]:
        return [api.ParamMeta(m.name, m.dtype, tuple(m.shape)) for m in metadata()]

    if metadata_is_cached_property(api):
        class _Source(base):  # type: ignore[misc, valid-type]
            """vLLM 0.33 shape: cached ``metadata``, ``iter_full`` (every rank owns every name)."""

            @functools.cached_property
            def metadata(self) -> list[Any]:
                return vllm_metadata()

            def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
                return tensors()

        return _Source()

    class _LegacySource(base):  # type: ignore[misc, valid-type]
        """The 0.28 shape: ``metadata()`` a method, the stream by iteration."""

        def metadata(self) -> list[Any]:
            return vllm_metadata()

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return tensors()

    return _LegacySource()


class CurrentSource:
    """The `FullWeightSource` of the sync in progress, handed to vLLM's engine as its ``WeightSource``.

    A backend sets ``_current`` for the length of a sync; vLLM's engine, which holds the source from
    ``trainer_init`` on, reads the metadata and the checked stream (``_live`` keeps the generator, so a failure
    can drain the gathers the other ranks wait on). Needs ``_api`` (vLLM's names) and ``device`` on the backend.
    """

    _current: Any = None
    _live: Iterator[tuple[str, torch.Tensor]] | None = None
    _api: Any
    device: torch.device | None

    def _source(self) -> Any:
        if self._current is None:
            raise RuntimeError(f"{type(self).__name__}: vLLM asked for weights outside sync()")
        return self._current

    def _vllm_source(self) -> Any:
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            source = self._source()
            self._live = source.tensors()
            return _checked(source.metadata(), self._live, self.device)

        return vllm_weight_source(self._api, lambda: self._source().metadata(), tensors)
