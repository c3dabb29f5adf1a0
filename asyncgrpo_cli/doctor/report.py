"""`asyncgrpo doctor`: print the checks of a running server against the config (`server.checks`) as a
table or JSON and, on failure, the complete restart command (with no server yet: the ``asyncgrpo serve``
line with the user's own overrides, then the command it runs)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig

from ..config.compose import sampler_url
from ..run.redact import HIDDEN, is_secret_name, redact_argv
from ..server.checks import (FAIL, PASS, SKIP, WARN, ServerFacts, _expected_colocation, evaluate, read_facts,
                             restart_command)

__all__ = ["run_doctor"]


def run_doctor(cfg: DictConfig, as_json: bool = False, facts: ServerFacts | None = None,
               serve_args: Sequence[str] | None = None) -> int:
    """Run every check, print them, and return the exit status (0 = no failure, 1 = a failure).

    It takes the whole composed config because it is the top of ``asyncgrpo doctor``: the checks get only
    the groups they read (`server.checks.evaluate`), and the restart command is rebuilt from the whole
    config (`server.checks.restart_command`, the address in ``sampler.url``).

    Args:
        cfg: composed config (`asyncgrpo_cli.config.compose`).
        as_json: print the checks and the restart command as JSON instead of a table.
        facts: what the server answered (None = read it from ``sampler.url`` now, `read_facts`).
        serve_args: the arguments the user gave ``asyncgrpo doctor`` (overrides, ``--recipes-dir``), as typed:
            with no server answering, the fix shown first is ``asyncgrpo serve`` with them (`serve_line`).
            None = unknown: only the server command is shown.

    Raises:
        ConfigError: from `server.checks.restart_command` when a check failed and the server command cannot
            be built (e.g. an invalid LoRA rank).
    """
    from rich.console import Console
    from rich.table import Table

    if facts is None:
        facts = read_facts(sampler_url(cfg.sampler), timeout=min(float(cfg.sampler.timeout), 10.0))
    checks = evaluate(facts, colocated=_expected_colocation(launch=cfg.launch, sampler=cfg.sampler),
                      model=cfg.model, rollout=cfg.rollout, sampler=cfg.sampler, staleness=cfg.staleness,
                      trainer=cfg.trainer, peft=cfg.peft, launch=cfg.launch)
    failed = any(c.status == FAIL for c in checks)
    restart = restart_command(cfg, facts) if failed and cfg.model.name else None
    start = (serve_line(serve_args, sampler=cfg.sampler)
             if restart is not None and not facts.reachable and serve_args is not None else None)
    if as_json:
        payload = {"url": facts.url, "ok": not failed, "checks": [asdict(c) for c in checks],
                   "restart_command": hidden_shell_line(restart) if restart else None}
        if start is not None:
            payload["serve_command"] = start
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return 1 if failed else 0
    console = Console()
    table = Table("check", "status", "detail", "fix", title=f"asyncgrpo doctor: {facts.url}", show_lines=False)
    for column in table.columns:  # a plain 80-column console wraps a fix, never ends it in "…"
        column.overflow = "fold"
    style = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.message, c.fix)
    console.print(table)
    if start is not None:  # the command the "server reachable" fix names, then what it runs
        console.print("[bold]Start the server with:[/]")
        sys.stdout.write(f"{start}\n(it runs: {hidden_shell_line(restart)})\n")
    elif restart is not None:
        console.print("[bold]Start the server with:[/]" if not facts.reachable else "[bold]Restart the server with:[/]")
        sys.stdout.write(hidden_shell_line(restart) + "\n")
    elif not failed:
        console.print("[green]The server matches the config.[/]")
    return 1 if failed else 0


def serve_line(serve_args: Sequence[str], *, sampler: Any) -> str:
    """The ``asyncgrpo serve`` line that starts the server doctor looked for, after this shell's `USER_ENV`
    settings (``ASYNCGRPO_CACHE=...``: a fresh shell would look for the model elsewhere): the user's own arguments
    as typed (shell-quoted, secret values hidden: `run.redact.redact_argv`), plus ``sampler.host``/``sampler.port``
    from ``sampler.url`` when it names another address (``serve`` starts a vLLM or embedded server at
    ``sampler.host:sampler.port``; an external one is looked for at ``sampler.url`` already).

    Args:
        serve_args: what the user gave ``asyncgrpo doctor`` (overrides, ``--recipes-dir``).
        sampler: ``url``, ``host``, ``port``, ``backend`` (`SamplerConfig`).
    """
    from urllib.parse import urlsplit

    args = list(serve_args)
    backend = getattr(sampler.backend, "value", sampler.backend)
    if sampler.url and backend != "external":
        parts = urlsplit(str(sampler.url))
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        if parts.hostname and parts.hostname != str(sampler.host):
            _set_override(args, "sampler.host", parts.hostname)
        if port and port != int(sampler.port):
            _set_override(args, "sampler.port", str(port))
    from ..run.folder import env_words  # ASYNCGRPO_CACHE=... as this shell has it, as `resume with:` lines do

    return " ".join([*env_words(), "asyncgrpo", "serve", *(shlex.quote(_hide_in_list(a)) for a in redact_argv(args))])


def _set_override(args: list[str], key: str, value: str) -> None:
    """Set ``key=value`` in ``args``: in place of the user's own ``key=...`` (``serve`` refuses a key given
    twice), else at the end."""
    for i, arg in enumerate(args):
        name, sep, _old = arg.partition("=")
        if sep and name.lstrip("+~") == key:
            args[i] = f"{name}={value}"
            return
    args.append(f"{key}={value}")


def _hide_in_list(arg: str) -> str:
    """``arg`` with the secret values inside a list override hidden (``sampler.extra_args=[--api-key,KEY]``
    becomes ``sampler.extra_args=[--api-key,***]``; `run.redact.redact_argv` sees only whole arguments)."""
    key, sep, value = arg.partition("=")
    if not (sep and value.startswith("[") and value.endswith("]")):
        return arg
    return f"{key}=[{','.join(redact_argv([item.strip() for item in value[1:-1].split(',')]))}]"


def hidden_shell_line(command: Any) -> str:
    """``command.shell_line()`` (`server.command.ServerCommand`) with secret values hidden: each environment
    variable with a secret name (`run.redact.is_secret_name`) and each secret ``--flag value`` or
    ``key=value`` argument (`run.redact.redact_argv`)."""
    env = " ".join(f"{k}={HIDDEN if is_secret_name(k) else shlex.quote(v)}" for k, v in command.env.items())
    cmd = " ".join(shlex.quote(a) for a in redact_argv(command.argv))
    return f"{env} {cmd}".strip()
