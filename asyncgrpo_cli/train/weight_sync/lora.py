"""Adapter sync: publish each policy version as a new LoRA adapter on the server (SPEC §9).

Each sync saves the PEFT adapter to ``<output_dir>/.vllm_lora/policy-v{N}/`` and loads it as
adapter ``policy-v{N}`` (a new name per version: vLLM 0.26–0.28 keys its prefix cache on the
name, VLLM.md). The newest ``max_staleness + 1`` versions stay registered so a rollout finishes
under the policy it started with; the next version is loaded *before* the oldest is unloaded,
hence ``--max-loras >= max_staleness + 2``. Directories that leave the window are deleted.
No pause is needed: in-flight requests keep their adapter, new ones use `current_adapter`.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ...sampler.client import SamplerRequestError
from .base import SyncTimings, WeightSyncBackend, now
from .names import ADAPTER_PART, is_peft_model, strip_wrappers
from .params import full_tensor

log = logging.getLogger(__name__)

ADAPTER_PREFIX = "policy"


class AdapterSource:
    """A PEFT model's adapter tensors, gathered in full, for adapter sync (SPEC §9).

    Args:
        model: a ``PeftModel`` (LoRA).

    Raises:
        ValueError: ``model`` is not a PEFT model.

    Like `FullWeightSource`, `state_dict` gathers FSDP2 shards: every rank calls it (or `drain`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        if not is_peft_model(model):
            raise ValueError(
                f"adapter sync needs a PEFT model (peft_config set); got {type(model).__name__}. "
                "Use merged sync (a full-weight backend) for plain models"
            )
        self.model = model

    @property
    def rank(self) -> int:
        """The largest LoRA rank ``r`` over the model's adapters (checked against --max-lora-rank)."""
        return max(int(getattr(c, "r", 0) or 0) for c in self.model.peft_config.values())

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters()
                if ADAPTER_PART.search(n) or ".modules_to_save." in n]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{PEFT state-dict name: full tensor on CPU}`` of the adapter tensors (collective on
        all ranks); FSDP/checkpointing/compile wrapper segments are removed from the names."""
        with torch.no_grad():
            return {strip_wrappers(n, peft=False): full_tensor(p).cpu() for n, p in self._params()}

    def drain(self) -> None:
        """Run the gathers of `state_dict` and drop the result (ranks other than the sender)."""
        self.state_dict()

    def save(self, directory: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Write the adapter (``adapter_config.json`` + safetensors) to ``directory`` (rank 0 only)."""
        self.model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True,
                                   save_embedding_layers=False)


class AdapterWindow:
    """Which adapter versions stay registered: the newest ``keep`` names (pure, no I/O).

    Args:
        keep: versions kept (``max_staleness + 1``), >= 1.

    Raises:
        ValueError: ``keep`` < 1.
    """

    def __init__(self, keep: int) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an integer >= 1 (max_staleness + 1)")
        self.keep = keep
        self.names: list[str] = []

    def push(self, name: str) -> list[str]:
        """Register ``name`` as the newest version; returns the names that left the window
        (oldest first), to unload *after* ``name`` was loaded.

        Raises:
            ValueError: ``name`` is already in the window.
        """
        if name in self.names:
            raise ValueError(f"adapter {name!r} is already registered; every version needs a new name")
        self.names.append(name)
        evicted, self.names = self.names[: -self.keep], self.names[-self.keep:]
        return evicted

    @property
    def newest(self) -> str | None:
        """The latest registered name, None before the first `push`."""
        return self.names[-1] if self.names else None


def adapter_name(version: int, prefix: str = ADAPTER_PREFIX) -> str:
    """``policy-v{version}``."""
    return f"{prefix}-v{int(version)}"


class LoraAdapterSync(WeightSyncBackend):
    """Adapter sync to a server started with ``--enable-lora`` (vLLM or embedded).

    Args:
        client: `SyncSamplerClient` of the server.
        lora_dir: ``<output_dir>/.vllm_lora`` (must be readable by the server); created.
        max_staleness: the staleness limit; ``max_staleness + 1`` versions stay loaded.
        prefix: adapter name prefix (``policy`` → ``policy-v{N}``).

    Raises:
        ValueError: ``max_staleness`` < 0.
    """

    mode = "adapter"

    def __init__(self, client: Any, lora_dir: str | Path, max_staleness: int, prefix: str = ADAPTER_PREFIX) -> None:
        super().__init__(client)
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness!r} must be an integer >= 0")
        self.lora_dir = Path(lora_dir)
        self.prefix = prefix
        self.window = AdapterWindow(max_staleness + 1)
        self._pattern = re.compile(rf"^{re.escape(prefix)}(-r\d+)?-v\d+$")  # -rN: a resumed run's names

    @property
    def current_adapter(self) -> str | None:
        """The newest adapter name (``model`` of new requests); None before the first sync."""
        return self.window.newest

    def init(self) -> None:
        """Unload ``policy-v*`` adapters a previous run left on the server and delete their folders."""
        try:
            cards = self.client.models()
        except Exception as exc:  # noqa: BLE001 - clean-up is best effort
            log.warning("adapter sync: cannot list the server's adapters (%s); stale ones may stay loaded", exc)
            cards = []
        for card in cards:
            name = str(card.get("id", ""))
            if card.get("parent") is not None and self._pattern.match(name):
                self._unload(name, None)
        if self.lora_dir.is_dir():
            for child in self.lora_dir.iterdir():
                if child.is_dir() and self._pattern.match(child.name):
                    shutil.rmtree(child, ignore_errors=True)

    def reconnect(self) -> None:
        """Keep in the window only the adapters the server still has (a restarted server has none), so the
        re-push loads the current one again and nothing it lost is unloaded later."""
        try:
            loaded = {str(card.get("id", "")) for card in self.client.models()}
        except Exception as exc:  # noqa: BLE001 - unknown: assume the server lost them all
            log.warning("adapter sync: cannot list the server's adapters after an outage (%s)", exc)
            loaded = set()
        self.window.names = [n for n in self.window.names if n in loaded]

    def push_current(self, source: AdapterSource, version: int) -> SyncTimings:
        """Publish ``source`` as ``policy-v{version}`` again (after an outage or on resume): the name the
        rollout worker uses for ``version``; one still loaded under it is replaced."""
        name = adapter_name(version, self.prefix)
        if name in self.window.names:
            self.window.names.remove(name)
        return self.sync(source, version)

    def _unload(self, name: str, version: int | None) -> None:
        try:
            self.call("/v1/unload_lora_adapter", version, self.client.unload_lora_adapter, name)
        except Exception as exc:  # noqa: BLE001
            cause = exc.__cause__
            if isinstance(cause, SamplerRequestError) and cause.status == 404:
                log.info("adapter %s was already unloaded", name)
                return
            raise

    def _load(self, name: str, path: Path, version: int) -> None:
        try:
            self.call("/v1/load_lora_adapter", version, self.client.load_lora_adapter, name, str(path))
        except Exception as exc:
            cause = exc.__cause__
            if not (isinstance(cause, SamplerRequestError) and "already" in cause.server_message):
                raise
            # a previous run left this name loaded: replace it (new weights under an old name)
            log.warning("adapter %s was already loaded on the server; replacing it", name)
            self._unload(name, version)
            self.call("/v1/load_lora_adapter", version, self.client.load_lora_adapter, name, str(path))

    def sync(self, source: AdapterSource, version: int) -> SyncTimings:
        """Save the adapter as ``policy-v{version}``, load it, then unload and delete the versions
        that left the window.

        Raises:
            ValueError: ``version`` was already published (versions must increase).
            WeightSyncError: a route failed (named in the message).
        """
        timings = SyncTimings()
        start = now()
        state = source.state_dict()  # a collective: every rank gathers, so check only afterwards
        name = adapter_name(version, self.prefix)
        if name in self.window.names:
            raise ValueError(f"model version {version} was already published as adapter {name!r}; "
                             "versions must increase")
        path = self.lora_dir / name
        if path.exists():
            shutil.rmtree(path)
        self.lora_dir.mkdir(parents=True, exist_ok=True)
        source.save(str(path), state)
        del state
        self._load(name, path.resolve(), version)
        for old in self.window.push(name):
            self._unload(old, version)
            shutil.rmtree(self.lora_dir / old, ignore_errors=True)
        timings.transfer_s = now() - start
        timings.total_s = timings.transfer_s
        return timings
