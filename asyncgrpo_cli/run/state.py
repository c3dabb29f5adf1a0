"""Run state on disk: the trained prompt position (`rollout_state.json`, SPEC §12) and the live files of
DESIGN.md §2 (`status.json`, `metrics.jsonl`), all written atomically.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROLLOUT_STATE_NAME = "rollout_state.json"


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace`` (never half-written)."""
    write_text_atomic(path, json.dumps(data, indent=1, default=_jsonable))


def _temp_beside(path: Path) -> tuple[int, str]:
    """A new file ``.<name>.<pid>.<random>.tmp`` in ``path``'s folder, open for writing, created with mode 0o666
    less the process's umask, as a plain ``open`` makes it (``tempfile.mkstemp`` makes 0o600: status.json,
    summary.txt and the other files written through `write_text_atomic` were readable by their owner alone, where
    the run's other files follow the umask; a fresh-user trial of 2026-12-07 saw the difference)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in its folder and ``os.replace``: a reader, or a
    process killed mid-write, sees the old file or the new one, never half of it. The file's mode follows the
    umask, as a plain write's does (`_temp_beside`).

    Raises:
        OSError: the folder cannot be made or written (the temporary file is removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf), nested in dicts and lists, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


FINAL_MODEL_NAME = "final_model.json"
"""``<output_dir>/final_model.json``: ``{"step": N, "saved_at": ...}``, the step the final model (or adapter) saved
into ``output_dir`` holds. It is removed before that model is written and written after, so a top-level model
without it is not claimed as any step's (an older run, or a save that did not end)."""


def mark_final_model(output_dir: str | Path, step: int | None) -> None:
    """Record that the final model in ``output_dir`` holds ``step`` (None: remove the record, before a save)."""
    path = Path(output_dir) / FINAL_MODEL_NAME
    if step is None:
        path.unlink(missing_ok=True)
    else:
        write_json_atomic(path, {"step": int(step), "saved_at": time.time()})


def final_model_step(output_dir: str | Path) -> int | None:
    """The step the final model in ``output_dir`` holds (`mark_final_model`), None when not recorded."""
    try:
        step = json.loads((Path(output_dir) / FINAL_MODEL_NAME).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


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


class RolloutStateError(ValueError):
    """``rollout_state.json`` is missing a field, holds a wrong value, or is not JSON (message names it)."""


def save_rollout_state(checkpoint_dir: str | Path, position: int, num_prompts: int | None,
                       num_tokens: int = 0, global_step: int | None = None) -> None:
    """Write ``rollout_state.json`` into a checkpoint: the first prompt position not yet trained (SPEC §12),
    the dataset size (None for an IterableDataset), the forwarded tokens so far (``num_tokens``, SPEC §15)
    and the step it belongs to."""
    write_json_atomic(Path(checkpoint_dir) / ROLLOUT_STATE_NAME,
                      {"dataset_start_index": int(position), "num_prompts": num_prompts, "num_tokens": int(num_tokens),
                       "global_step": global_step, "saved_at": time.time()})


def read_rollout_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The checked content of a checkpoint's ``rollout_state.json``.

    Raises:
        RolloutStateError: the file is absent, not JSON, or ``dataset_start_index`` / ``num_tokens`` is not a
            non-negative integer (the message names the file, the field, the value and the fix).
    """
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
    fix = "Fix: resume from another (complete) checkpoint, or start without resume_from_checkpoint"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RolloutStateError(f"{path} is missing. {fix}") from None
    except (OSError, ValueError) as exc:
        raise RolloutStateError(f"{path} is corrupt ({exc}). {fix}") from None
    if not isinstance(data, dict):
        raise RolloutStateError(f"{path} holds {type(data).__name__}, not an object. {fix}")
    for key in ("dataset_start_index", "num_tokens"):
        value = data.get(key, 0 if key == "num_tokens" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RolloutStateError(f"{path}: {key}={value!r} must be an integer >= 0. {fix}")
    return data


def load_rollout_state(checkpoint_dir: str | Path) -> int:
    """The saved ``dataset_start_index`` of a checkpoint.

    Raises:
        RolloutStateError: the file is absent or corrupt (see `read_rollout_state`).
    """
    return int(read_rollout_state(checkpoint_dir)["dataset_start_index"])


FINAL_STATES = ("finished", "stopped", "failed")


def outcome_of(state: str) -> str | None:
    """The one word of a final ``status.json`` ``state`` (its ``outcome``: ``finished``, ``stopped`` or ``failed``;
    ``state`` of a failure is a sentence, ``failed: the server ...``), for a program that reads the file; None for
    a state that is not final (``running``, ``saving``)."""
    word = str(state).split(":", 1)[0].strip()
    return word if word in FINAL_STATES else None


ALWAYS_KEYS = ("outcome", "stopping", "note", "trainer_state", "resume_command")
"""Keys `status.json` holds from its first write to its last, null when they do not apply (a program reading the
file finds the same keys whatever the outcome): ``outcome`` (the final state's one word), ``stopping`` (a stop in
progress: why, and the step being saved), ``note`` (how the run ended, when that needs saying), ``trainer_state``
(the trainer's own final state, when the job's differs) and ``resume_command``."""


def with_always_keys(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` with every key of `ALWAYS_KEYS` present (null where unset); the same dict, returned."""
    for key in ALWAYS_KEYS:
        status.setdefault(key, None)
    return status


def _job_pids() -> dict[str, int | None]:
    """``job_pid``: the ``asyncgrpo train`` process that started this trainer (SIGINT to it stops the whole run with a
    checkpoint; null under the Python API, where ``pid``, this process, is the one); ``server_pid``: the sampler
    server it started (null for an external server, or none). Read from `LOCK_OWNER_ENV` and `SERVER_PID_ENV`."""
    def pid(name: str) -> int | None:
        raw = os.environ.get(name, "").strip()
        return int(raw) if raw.isdigit() else None

    return {"job_pid": pid(LOCK_OWNER_ENV), "server_pid": pid(SERVER_PID_ENV)}


class LiveFiles:
    """`status.json` (rewritten at most once per ``min_interval_s``) and `metrics.jsonl` (one line per log)."""

    def __init__(self, output_dir: str | Path, min_interval_s: float = 1.0) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.status: dict[str, Any] = with_always_keys({"state": "starting", "started_at": time.time(),
                                                        "pid": os.getpid(), **_job_pids()})
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def update(self, force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the status and rewrite ``status.json`` if due (or ``force``). Thread-safe."""
        with self._lock:
            self.status.update(fields)
            if "state" in fields:
                self.status["outcome"] = outcome_of(self.status["state"])
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

    def mark_start(self, step: int, checkpoint: str | None) -> None:
        """The marker of a training start in ``metrics.jsonl``: `mark_resume` from ``checkpoint``; without one, a
        ``{"event": "start", "step": 0, "time": ..., "note": ...}`` line when the file already holds lines (an
        earlier attempt that saved no checkpoint, started again in the same folder), so that its windows are not
        read as this run's; nothing for a first start."""
        if checkpoint is not None:
            self.mark_resume(step, checkpoint)
            return
        path = self.dir / "metrics.jsonl"
        if path.exists() and path.stat().st_size > 0:
            self.append_metrics({"event": "start", "step": int(step), "time": time.time(),
                                 "note": "a start from step 0: the lines above belong to an earlier attempt"})

    def append_completions(self, records: list[dict[str, Any]]) -> None:
        """Append completion records to ``completions.jsonl``, one JSON line each (NaN written as null), in one
        write: a reader (`dashboard.JsonlTail`) sees whole lines only."""
        lines = "".join(json.dumps(_finite(r), default=_jsonable) + "\n" for r in records)
        if lines:
            with open(self.dir / "completions.jsonl", "a") as f:
                f.write(lines)


# ------------------------------------------------------------------------------------------ one run per folder
LOCK_NAME = ".asyncgrpo.lock"
#: A process sharing the run lock (the trainer) writes ``<output_dir>/<MEMBER_PREFIX><pid>`` (`RunLock`).
MEMBER_PREFIX = ".asyncgrpo.lock-member."
#: Environment variable a supervisor sets for the trainer it starts: the pid whose lock the trainer may share.
LOCK_OWNER_ENV = "ASYNCGRPO_RUN_LOCK_OWNER"
#: Environment variable a supervisor sets for the trainer it starts: the pid of the sampler server it started
#: ("" for an external server); the trainer names it when the server stops answering (`ServerWatch`).
SERVER_PID_ENV = "ASYNCGRPO_SERVER_PID"


def server_pid_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid of the server the supervisor started (`SERVER_PID_ENV` in ``environ``, default ``os.environ``);
    None for an external server, the Python API, or a value that is not a pid."""
    raw = (os.environ if environ is None else environ).get(SERVER_PID_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


class RunLockedError(RuntimeError):
    """Another job already runs in this ``output_dir`` (message names its pid and host)."""


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - gone, or not ours to inspect
        return None


def _pid_alive(pid: int, started: float | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now_started = _process_started(pid)
    if now_started is not None and started is not None and abs(now_started - started) > 1.0:
        return False  # the pid was reused by another process
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


def _running_member(path: Path) -> dict[str, Any] | None:
    """A member file's content when its pid still runs on this host (None: gone, reused or unreadable)."""
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = held.get("pid") if isinstance(held, dict) else None
    return held if isinstance(pid, int) and _pid_alive(pid, held.get("started")) else None


class RunLock:
    """``<output_dir>/.asyncgrpo.lock``: one job per output folder (created with O_EXCL semantics).

    The file holds the owner's pid, host, start time and command (secret values hidden, `redact.redact_argv`). A lock left by a dead process of this
    host (or a reused pid) is taken over; a live owner, or one on another host, makes `acquire` fail.

    A process that shares the lock (the trainer) is a *member*: it writes ``.asyncgrpo.lock-member.<pid>``
    beside the lock and removes it on `release`. The lock is taken over only when its owner **and** every member
    are gone: after a ``kill -9`` of the supervisor its trainer still writes its checkpoint, and a resume started
    then would read that checkpoint half written and share the GPU with it.

    Args:
        output_dir: the run's folder (created).
        shared_with: a pid whose lock this process may share (the supervisor that started the trainer).
    """

    def __init__(self, output_dir: str | Path, shared_with: int | None = None) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self.shared_with = shared_with
        self.owned = False
        self.member: Path | None = None

    def _members(self) -> list[Path]:
        return sorted(self.path.parent.glob(MEMBER_PREFIX + "*"))

    def _live_member(self, host: str) -> dict[str, Any] | None:
        """The first member of this host that still runs (not this process), or None."""
        for path in self._members():
            held = _running_member(path)
            if held is not None and held["pid"] != os.getpid() and held.get("host") == host:
                return held
        return None

    def read(self) -> dict[str, Any] | None:
        """The current lock's content (None when absent; ``{}`` when unreadable)."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        """Take the lock (or share the one of ``shared_with``).

        Raises:
            RunLockedError: another live job holds it (message: its pid, host, command and the fix).
            OSError: the folder cannot be written.
        """
        import socket
        import sys

        from .redact import redact_argv

        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_started(os.getpid()),
              "command": " ".join(redact_argv(sys.argv))[:300], "created_at": time.time()}
        for _attempt in range(3):
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f"{LOCK_NAME}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            try:
                os.link(tmp, self.path)  # atomic: fails when the lock exists
                self.owned = True
                return
            except FileExistsError:
                pass
            finally:
                Path(tmp).unlink(missing_ok=True)
            held = self.read()
            if held is None:
                continue
            pid, host = held.get("pid"), held.get("host")
            if self.shared_with is not None and pid == self.shared_with and host == me["host"]:
                self.member = self.path.parent / f"{MEMBER_PREFIX}{me['pid']}"
                write_text_atomic(self.member, json.dumps(me))
                return  # the supervisor that started this trainer holds it
            if isinstance(pid, int) and host == me["host"] and not _pid_alive(pid, held.get("started")):
                member = self._live_member(me["host"])
                if member is not None:
                    raise RunLockedError(
                        f"the job that held {self.path} (pid {pid}) is gone, but its trainer (pid {member['pid']}) "
                        f"still runs in {self.path.parent}: it writes its checkpoint after its supervisor's death "
                        f"and exits once that is done. Fix: wait for pid {member['pid']} to exit, then run this "
                        f"again (or stop it: kill -INT {member['pid']})")
                for path in self._members():  # stale: its owner and every member died
                    path.unlink(missing_ok=True)
                self.path.unlink(missing_ok=True)
                continue
            if held == {}:
                raise RunLockedError(f"{self.path} exists but is unreadable; another job may be using "
                                     f"{self.path.parent}. Fix: delete {self.path} if no job runs there")
            raise RunLockedError(
                f"another job (pid {pid} on {host}, started {time.ctime(held.get('created_at', 0))}: "
                f"{held.get('command', '?')}) is already running in {self.path.parent}. Fix: wait for it or stop "
                f"it (kill -INT {pid}), or choose another trainer.output_dir"
                + (f"; if it is gone, delete {self.path}" if host != me["host"] else ""))
        raise RunLockedError(f"could not take {self.path} (it keeps changing). Fix: choose another trainer.output_dir")

    def release(self) -> None:
        """Remove the lock if this process created it, or this process's member file (idempotent)."""
        if self.member is not None:
            self.member.unlink(missing_ok=True)
            self.member = None
        if not self.owned:
            return
        held = self.read()
        if held is not None and held.get("pid") == os.getpid():
            for path in self._members():  # a member killed with SIGKILL left its file
                if _running_member(path) is None:
                    path.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
        self.owned = False
