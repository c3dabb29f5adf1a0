"""Run state on disk: the trained prompt position (`rollout_state.json`, SPEC §12) and the live files of
DESIGN.md §2 (`status.json`, `metrics.jsonl`), all written atomically.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROLLOUT_STATE_NAME = "rollout_state.json"


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace`` (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=_jsonable)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class TrainedPosition:
    """The first prompt position not yet trained (SPEC §12), from outcomes that may finish out of order.

    A position is *done* when its prompt was filtered, its group dropped, or every one of its samples was
    trained (or dropped as stale or oversize: those never pin the position). Positions are global:
    ``epoch × len(dataset) + row_index``.

    Args:
        start: the position the worker started from (``dataset_start_index``).
    """

    def __init__(self, start: int = 0) -> None:
        self.value = int(start)
        self._done: set[int] = set()
        self._remaining: dict[int, int] = {}

    def add_samples(self, position: int, count: int) -> None:
        """``count`` samples of ``position`` are pending (pulled, not yet trained)."""
        if count <= 0:
            self.finish(position)
        else:
            self._remaining[position] = self._remaining.get(position, 0) + count

    def sample_done(self, position: int) -> None:
        """One pending sample of ``position`` was trained or dropped."""
        left = self._remaining.get(position, 0) - 1
        if left <= 0:
            self._remaining.pop(position, None)
            self.finish(position)
        else:
            self._remaining[position] = left

    def finish(self, position: int) -> None:
        """``position`` is done (filtered, dropped group, or all samples trained)."""
        if position < self.value:
            return
        self._done.add(position)
        while self.value in self._done:
            self._done.discard(self.value)
            self.value += 1


def save_rollout_state(checkpoint_dir: str | Path, position: int, num_prompts: int | None) -> None:
    """Write ``rollout_state.json`` next to a checkpoint: the first prompt position not yet trained."""
    write_json_atomic(Path(checkpoint_dir) / ROLLOUT_STATE_NAME,
                      {"dataset_start_index": int(position), "num_prompts": num_prompts, "saved_at": time.time()})


def load_rollout_state(checkpoint_dir: str | Path) -> int:
    """The saved ``dataset_start_index`` of a checkpoint (0 when the file is absent)."""
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
    if not path.is_file():
        return 0
    return int(json.loads(path.read_text())["dataset_start_index"])


class LiveFiles:
    """`status.json` (rewritten at most once per ``min_interval_s``) and `metrics.jsonl` (one line per log)."""

    def __init__(self, output_dir: str | Path, min_interval_s: float = 1.0) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.status: dict[str, Any] = {"state": "starting", "started_at": time.time(), "pid": os.getpid()}
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def update(self, force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the status and rewrite ``status.json`` if due (or ``force``). Thread-safe."""
        with self._lock:
            self.status.update(fields)
            now = time.monotonic()
            if force or now - self._last >= self.min_interval_s:
                self._last = now
                self.status["updated_at"] = time.time()
                write_json_atomic(self.dir / "status.json", self.status)

    def start_ticker(self, refresh) -> None:
        """Call ``refresh()`` (which should call `update`) about once per ``min_interval_s`` on a daemon thread,
        so ``status.json`` stays fresh while a long step runs."""
        def tick() -> None:
            while not self._stop.wait(self.min_interval_s):
                try:
                    refresh()
                except Exception:  # noqa: BLE001 - the live view must never break training
                    pass

        self._ticker = threading.Thread(target=tick, name="status-ticker", daemon=True)
        self._ticker.start()

    def stop_ticker(self) -> None:
        """Stop the ticker thread (idempotent)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
            self._ticker = None

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line to ``metrics.jsonl`` (NaN written as null)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(clean, default=_jsonable) + "\n")

    def mark_resume(self, step: int, checkpoint: str) -> None:
        """Append the resume marker ``{"event": "resume", "step": N, "from": "checkpoint-N", "time": ...}`` to
        ``metrics.jsonl``: the windows after step N that an earlier run logged are trained again."""
        self.append_metrics({"event": "resume", "step": int(step), "from": Path(str(checkpoint)).name,
                             "path": str(checkpoint), "time": time.time()})

    def append_completions(self, records: list[dict[str, Any]]) -> None:
        """Append completion records to ``completions.jsonl``."""
        with open(self.dir / "completions.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps(r, default=_jsonable) + "\n")
