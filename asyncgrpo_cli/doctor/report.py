"""`asyncgrpo doctor`: print the checks of a running server against the config (`server.checks`) as a
table or JSON and, on failure, the complete restart command."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from omegaconf import DictConfig

from ..config.compose import sampler_url
from ..server.checks import (FAIL, PASS, SKIP, WARN, ServerFacts, _expected_colocation, evaluate, read_facts,
                             restart_command)

__all__ = ["run_doctor"]


def run_doctor(cfg: DictConfig, as_json: bool = False, facts: ServerFacts | None = None) -> int:
    """Run every check, print them, and return the exit status (0 = no failure, 1 = a failure).

    It takes the whole composed config because it is the top of ``asyncgrpo doctor``: the checks get only
    the groups they read (`server.checks.evaluate`), and the restart command is rebuilt from the whole
    config (`server.checks.restart_command`, the address in ``sampler.url``).

    Args:
        cfg: composed config (`asyncgrpo_cli.config.compose`).
        as_json: print the checks and the restart command as JSON instead of a table.
        facts: what the server answered (None = read it from ``sampler.url`` now, `read_facts`).

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
    if as_json:
        payload = {"url": facts.url, "ok": not failed, "checks": [asdict(c) for c in checks],
                   "restart_command": restart.shell_line() if restart else None}
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
    if restart is not None:
        console.print("[bold]Start the server with:[/]" if not facts.reachable else "[bold]Restart the server with:[/]")
        sys.stdout.write(restart.shell_line() + "\n")
    elif not failed:
        console.print("[green]The server matches the config.[/]")
    return 1 if failed else 0
