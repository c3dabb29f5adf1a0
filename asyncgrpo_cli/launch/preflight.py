"""Checks before a job starts anything: the server's port (free, not answered by a server this job did not
start) and the run folder's lock (`run.state.RunLock`). Pure of the supervisor's state; the CLI's `serve`
and `run_train` call them before the model is exported or loaded."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ..config.compose import sampler_url
from ..config.rules import ConfigError
from ..config.validate import free_port  # noqa: F401 - the one free-port pick (re-exported for the supervisor)
from ..run.port_owner import asyncgrpo_owner

if TYPE_CHECKING:
    from ..config.schema import SamplerConfig


def probe_health(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET {url}/health`` answers 200 within ``timeout`` seconds."""
    import httpx

    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def health_refused(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET {url}/health`` fails because the connection is refused: nothing listens at ``url``
    (unlike a server that accepts connections while it loads)."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout)
    except httpx.ConnectError as exc:
        return "refused" in str(exc).lower() or isinstance(exc.__cause__, ConnectionRefusedError)
    except httpx.HTTPError:
        return False
    return False


def port_in_use(host: str, port: int) -> bool:
    """Whether another process holds ``host:port`` (binding it fails; ``SO_REUSEADDR`` is set as servers
    do, so only a socket that listens there counts, not one in TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return True
    return False


#: The label of a refusal because another live job (or its trainer) holds the run folder's lock: not a problem of
#: the config, so not ``config error:`` (a fresh-user trial read it as one).
RUN_FOLDER_IN_USE = "run folder in use"


def _check_run_lock(cfg: DictConfig) -> str | None:
    """Whether another live job holds ``trainer.output_dir``'s run lock (`RunLock`; taken for real when the
    supervisor starts).

    Returns:
        None when the folder is free, else the refusal (``run folder in use: ...``) naming the running job's pid
        (or its trainer's) and the fix.
    """
    from ..run.state import LOCK_NAME, RunLock, RunLockedError

    out = Path(str(cfg.trainer.output_dir))
    if not (out / LOCK_NAME).exists():
        return None
    lock = RunLock(out)
    try:
        lock.acquire()
    except RunLockedError as exc:
        return f"{RUN_FOLDER_IN_USE}: trainer.output_dir={out}: {exc}"
    except OSError:
        return None  # an unwritable folder is reported with its own fix when the job starts
    finally:
        lock.release()
    return None


def folder_or_port_refusal(cfg: DictConfig, answering: bool | None = None) -> str | None:
    """Another live job in ``trainer.output_dir`` (``run folder in use: ...``, `_check_run_lock`: that job is the
    reason, before its port), else a busy ``sampler.port`` (``config error: ...``, `check_server_port`; ``answering``
    as there), else None."""
    in_use = _check_run_lock(cfg)
    if in_use:
        return in_use
    try:
        check_server_port(cfg.sampler, answering=answering)
    except ConfigError as exc:
        return f"config error: {exc}"
    return None


def check_server_port(sampler: SamplerConfig, *, answering: bool | None = None, command: str = "train") -> None:
    """Before the model is loaded: the server this job starts can take ``sampler.host:sampler.port``.

    Args:
        sampler: the ``sampler`` group (``backend``, ``host``, ``port``, ``url``; nothing is checked for
            ``sampler.backend=external``).
        answering: whether a server already answers ``/health`` at the URL (None = probe it now).
        command: the CLI command asking, ``"train"`` or ``"serve"``; it picks the fix the message gives.

    Raises:
        ConfigError: a server this job did not start already answers there (use it with
            ``sampler.backend=external sampler.url=URL``), or another process holds the port; the
            message names ``sampler.port`` and suggests a free port. A server another ``asyncgrpo train`` job
            started (`run.port_owner`) is named, and never offered as an external sampler: its trainer changes
            its weights.
    """
    backend = getattr(sampler.backend, "value", sampler.backend)
    if backend == "external":
        return
    host, port, url = str(sampler.host), int(sampler.port), sampler_url(sampler)
    if answering is None:
        answering = probe_health(url, timeout=1.0)
    busy = answering or port_in_use(host, port)
    owner = asyncgrpo_owner(host, port) if busy else None
    whose = f" ({owner.describe()} started it)" if owner is not None else ""
    if owner is not None and owner.command == "train":
        raise ConfigError(f"sampler.port={port}: {url} is the server of {owner.describe()}. That job's trainer "
                          f"changes the server's weights, so this one can neither share it nor start its own there. "
                          f"Fix: use a free port, e.g. sampler.port={free_port(near=port)}, or stop that job first")
    if answering and command == "serve":
        raise ConfigError(f"sampler.port={port}: a server already answers at {url}/health{whose}. Fix: to check it serves "
                          f"this config, run asyncgrpo doctor with the same overrides; to start another, use a free "
                          f"port, e.g. sampler.port={free_port(near=port)}")
    if answering:
        raise ConfigError(f"sampler.port={port}: a server this job did not start already answers at {url}/health{whose}. "
                          f"Fix: to train against it, add sampler.backend=external sampler.url={url} (asyncgrpo "
                          f"doctor checks it matches the config); to start a new one, use a free port, e.g. "
                          f"sampler.port={free_port(near=port)}")
    if busy:
        raise ConfigError(f"sampler.port={port}: another process already listens on {host}:{port}. Fix: use a free "
                          f"port, e.g. sampler.port={free_port(near=port)}, or stop that process")
    engines = int(sampler.get("engines", 1) if hasattr(sampler, "get") else getattr(sampler, "engines", 1))
    for engine_port in range(port + 1, port + 1 + engines) if engines > 1 else ():
        if port_in_use(host, engine_port):
            raise ConfigError(f"sampler.port={port}: with sampler.engines={engines} the servers listen on ports "
                              f"{port + 1}-{port + engines}, and another process already listens on "
                              f"{host}:{engine_port}. Fix: use a port with {engines} free ports after it, e.g. "
                              f"sampler.port={free_port(near=port + engines)}, or stop that process")


def early_refusal(cfg: DictConfig, whole_commands: bool = True) -> str | None:
    """What ``asyncgrpo train`` refuses without the model, the data or transformers, so it comes in a second
    (it came after the deep checks: 60-90 s on a loaded 2-core machine): another job in ``trainer.output_dir``,
    a busy ``sampler.port``, a folder that holds an earlier run, an unwritable folder, an external sampler that
    does not answer. Machine 0 only (the others share its folder and server).

    ``whole_commands``: a used folder's fixes are whole ``asyncgrpo train`` commands (this command line with the
    override added); false gives the override alone, for a command line with other problems (a trial pasted such a
    command and got the same problems again).

    Returns:
        The message to print (with its ``run folder in use:`` / ``config error:`` / ``error:`` label), or None
        when none applies.
    """
    from ..config.run_checks import check_output_dir
    from ..config.start_checks import check_external_sampler
    from ..run.folder import start_problem
    from .plan import output_dir_of

    if int(cfg.launch.machine_rank) != 0:
        return None
    refused = folder_or_port_refusal(cfg)
    if refused:
        return refused
    typed = Path(str(cfg.trainer.output_dir or output_dir_of(cfg.trainer))).expanduser()
    problem = start_problem(cfg.trainer, typed, None if whole_commands else [])
    if problem:
        return f"error: {problem}"
    try:
        check_output_dir(cfg.trainer.get("output_dir"))
        check_external_sampler(cfg)
    except ConfigError as exc:
        return f"config error: {exc}"
    return None


def dry_run_refusals(cfg: DictConfig, running: bool, whole_commands: bool = True) -> list[str]:
    """What a real start would refuse before loading anything, as problems of a dry run's plan: another live job
    in ``trainer.output_dir`` (`_check_run_lock`, ``run folder in use: ...``; then nothing else of the folder is
    named), a busy ``sampler.port`` (`check_server_port`) and a folder that holds an earlier run
    (`run.folder.start_problem`, named as the start names it). Machine 0 only (the others share its folder and
    server).

    Args:
        cfg: the composed config.
        running: whether a server already answers at the sampler's URL.
        whole_commands: as `early_refusal`'s (false when the plan has other problems).

    Returns:
        The problems, each one line (empty when none).
    """
    from ..run.folder import start_problem
    from .plan import output_dir_of

    if int(cfg.launch.machine_rank) != 0:
        return []
    in_use = _check_run_lock(cfg)  # a live job there is the reason, before its port and its files
    if in_use:
        return [in_use]
    problems = []
    try:
        check_server_port(cfg.sampler, answering=running)
    except ConfigError as exc:
        problems.append(str(exc))
    typed = Path(str(cfg.trainer.output_dir or output_dir_of(cfg.trainer))).expanduser()  # as the user wrote it
    problem = start_problem(cfg.trainer, typed, None if whole_commands else [])
    if problem:
        problems.append(problem)
    return problems
