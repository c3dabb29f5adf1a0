"""Which asyncgrpo job, if any, holds a local TCP port.

A server that another ``asyncgrpo train`` job started changes its weights at every sync of that job's trainer:
a second run that trained against it (``sampler.backend=external``) would score and ratio completions of another
policy, silently. The start-up checks ask `asyncgrpo_owner` who listens on a busy port, so they can name that job
and refuse it, and keep offering ``sampler.backend=external`` only for a server that ``asyncgrpo serve`` started
(or one that is not ours at all).

Only processes this user may inspect are seen (Linux ``/proc``, through psutil); anything else reads as "not an
asyncgrpo job", which keeps the checks' earlier wording.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .redact import redact_argv

SUBCOMMANDS = ("train", "serve")
"""The asyncgrpo commands that start a server."""

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::", "")
"""Host names that mean this machine (a URL with another host is never looked up here)."""


@dataclass(frozen=True)
class PortOwner:
    """The asyncgrpo process that started the server listening on a port.

    Attributes:
        pid: the ``asyncgrpo train`` / ``asyncgrpo serve`` process (the server itself may be its child).
        command: ``"train"`` or ``"serve"``.
        argv: its command line, secret values hidden (`redact.redact_argv`), at most 200 characters.
        cwd: its working folder (None when unreadable).
    """

    pid: int
    command: str
    argv: str
    cwd: str | None

    def describe(self) -> str:
        """``another asyncgrpo train job (pid 123, `asyncgrpo train +recipe=smoke`, in /home/me)``."""
        where = f", in {self.cwd}" if self.cwd else ""
        return f"another asyncgrpo {self.command} job (pid {self.pid}, `{self.argv}`{where})"


def asyncgrpo_subcommand(argv: list[str]) -> tuple[str, list[str]] | None:
    """The asyncgrpo command ``argv`` runs (the ``asyncgrpo`` script, or ``python -m asyncgrpo_cli``) when it is
    ``train`` or ``serve``, with the arguments after it; else None.

    Args:
        argv: a process's command line, as ``/proc/<pid>/cmdline`` gives it.
    """
    for i, arg in enumerate(argv):
        is_script = Path(arg).name == "asyncgrpo"
        is_module = arg == "-m" and i + 1 < len(argv) and argv[i + 1] in ("asyncgrpo_cli", "asyncgrpo_cli.cli")
        if not (is_script or is_module):
            continue
        start = i + (2 if is_module else 1)
        at = next((j for j in range(start, len(argv)) if not argv[j].startswith("-")), None)
        if at is None or argv[at] not in SUBCOMMANDS:
            return None
        return argv[at], argv[at + 1:]
    return None


def _listening_pid(port: int) -> int | None:
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def asyncgrpo_owner(host: str, port: int) -> PortOwner | None:
    """The asyncgrpo job whose server listens on ``host:port`` of this machine: the process that listens, or its
    nearest ancestor, that runs ``asyncgrpo train`` or ``asyncgrpo serve``. This process and its ancestors never
    count (a job does not own a port against itself).

    Args:
        host: the URL's host; anything but this machine's loopback or wildcard names gives None.
        port: the TCP port.

    Returns:
        The owner, or None: nothing listens, the listener is not an asyncgrpo job's, or it cannot be inspected.
    """
    import psutil

    if str(host).strip("[]").lower() not in LOCAL_HOSTS:
        return None
    pid = _listening_pid(int(port))
    if pid is None:
        return None
    try:
        me = psutil.Process(os.getpid())
        mine = {me.pid, *(p.pid for p in me.parents())}
        proc = psutil.Process(pid)
        chain = [proc, *proc.parents()]
    except psutil.Error:
        return None
    for p in chain:
        if p.pid in mine:
            return None
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        found = asyncgrpo_subcommand(argv)
        if found is None:
            continue
        try:
            cwd = p.cwd()
        except psutil.Error:
            cwd = None
        sub, args = found
        shown = " ".join(["asyncgrpo", sub, *redact_argv(args)])
        return PortOwner(pid=p.pid, command=sub, argv=shown[:200], cwd=cwd)
    return None


def training_owner(host: str, port: int) -> PortOwner | None:
    """`asyncgrpo_owner` when the owner is an ``asyncgrpo train`` job (its trainer changes the server's weights, so
    no other run may use that server), else None."""
    owner = asyncgrpo_owner(host, port)
    return owner if owner is not None and owner.command == "train" else None
