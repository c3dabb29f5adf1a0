"""Full-weight sync to the embedded sampler through safetensors files (DESIGN §5 item 2)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from .base import SyncTimings, WeightSyncBackend, drain_quietly, now
from .names import dtype_name
from .params import FullWeightSource


def _owned_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its whole storage (safetensors refuses shared storage)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def embedded_weights_dir(client: Any) -> Path | None:
    """The folder the embedded sampler reads weight files from (``weight_transfer_config.weights_dir`` of its
    ``/server_info``: the run's ``<output_dir>/.weights`` when ``asyncgrpo`` started it, else its private
    temporary folder); None when the server does not say (an older server, which reads any path)."""
    config = client.server_info()
    transfer = config.get("weight_transfer_config") if isinstance(config, dict) else None
    folder = transfer.get("weights_dir") if isinstance(transfer, dict) else None
    return Path(str(folder)) if folder else None


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` when nothing is left in it (a file still there keeps it)."""
    try:
        folder.rmdir()
    except OSError:
        pass


def _private_folder(parent: Path, version: int) -> tuple[Path, bool]:
    """A new folder of this sync's own inside ``parent`` (``v{version}-XXXXXXXX``), and whether ``parent``
    had to be created. Two trainers may publish to one server (one folder): with private folders neither
    overwrites nor deletes the other's bucket files. ``parent`` removed by another writer between our
    ``mkdir`` and ``mkdtemp`` is made again (a few tries)."""
    created = False
    for _ in range(5):
        created = created or not parent.exists()
        parent.mkdir(parents=True, exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(prefix=f"v{version}-", dir=parent)), created
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{parent} keeps disappearing while a weight sync makes its folder in it")


class EmbeddedPathSync(WeightSyncBackend):
    """Merged/full-weight sync to the embedded sampler (``"server": "asyncgrpo-embedded"``).

    Per sync: ``/server_info`` (the folder the server reads from, `embedded_weights_dir`) →
    ``/pause?mode=keep`` → ``/start_weight_update`` → for each bucket, write
    ``<weights_dir>/v{version}-XXXXXXXX/{i:05d}.safetensors`` (a folder private to this sync, so two
    trainers sharing one server never touch each other's files) and ``POST /update_weights`` with
    ``{"names", "dtype_names", "shapes", "path"}``, deleting the file once the server has
    copied it → ``/finish_weight_update`` (``weight_version = str(version)``) →
    ``/reset_prefix_cache`` → ``/resume``. Disk use is one bucket at a time; the private folder is
    removed after the sync.

    Args:
        client: `SyncSamplerClient` of the embedded server.
        weights_dir: folder both processes can read (``<output_dir>/.weights/``); created for each sync
            and removed after it when the sync created it and it is empty again (no empty folder is left
            in the output folder).
    """

    mode = "full"

    def __init__(self, client: Any, weights_dir: str | Path) -> None:
        super().__init__(client)
        self.weights_dir = Path(weights_dir)

    def _follow_server(self, version: int) -> None:
        """Write into the folder the server reads weights from now (`embedded_weights_dir`): one started
        without ``--weights-dir`` reads from a temporary folder of its own, another one after a restart."""
        if getattr(self.client, "server_info", None) is None:
            return
        folder = self.call("/server_info", version, embedded_weights_dir, self.client)
        if folder is not None:
            self.weights_dir = folder

    def sync(self, source: FullWeightSource, version: int) -> SyncTimings:
        """Publish ``source`` as model ``version`` (see the class doc).

        Raises:
            WeightSyncError: a route failed (named); the server was resumed and the remaining
                buckets were still gathered so the other ranks are not left waiting.
        """
        from safetensors.torch import save_file

        timings = SyncTimings()
        start = now()
        self._follow_server(version)
        folder, created = _private_folder(self.weights_dir, version)
        buckets = source.buckets()
        try:
            with self.paused(version, timings):
                t0 = now()
                self.call("/start_weight_update", version, self.client.start_weight_update)
                for index, bucket in enumerate(buckets):
                    path = folder / f"{index:05d}.safetensors"
                    tensors = {name: _owned_cpu(t) for name, t in bucket}
                    try:
                        save_file(tensors, str(path))
                        info = {
                            "names": list(tensors),
                            "dtype_names": [dtype_name(t.dtype) for t in tensors.values()],
                            "shapes": [list(t.shape) for t in tensors.values()],
                            "path": str(path.resolve()),
                        }
                        self.call("/update_weights", version, self.client.update_weights, info)
                    finally:
                        path.unlink(missing_ok=True)
                    del tensors, bucket
                self.call("/finish_weight_update", version, self.client.finish_weight_update, str(version))
                timings.transfer_s = now() - t0
        except BaseException:
            drain_quietly(buckets)
            raise
        finally:
            _remove_if_empty(folder)
            if created:
                _remove_if_empty(self.weights_dir)
        timings.total_s = now() - start
        return timings
