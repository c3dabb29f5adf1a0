"""`asyncgrpo`: the command line (DESIGN.md §1). Every command takes Hydra overrides as extra arguments."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .config.rules import ConfigError

app = typer.Typer(
    name="asyncgrpo",
    help="Asynchronous GRPO post-training: a vLLM sampler, a rollout worker and a tree-packed FSDP2 trainer, "
         "composed from Hydra configs and recipes.\n\nExamples:\n\n"
         "  asyncgrpo train +recipe=smoke\n\n"
         "  asyncgrpo serve +recipe=deepmath --dry-run\n\n"
         "  asyncgrpo config +recipe=deepmath rollout.num_generations=16",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()

OVERRIDES_HELP = "Hydra overrides, e.g. +recipe=deepmath rollout.temperature=0.8 trainer.max_steps=100"
RECIPES_DIR_HELP = "Extra folder of recipes (NAME.yaml) for +recipe=NAME; may be repeated."


def _print_error(exc: BaseException, label: str = "config error") -> None:
    """One user error, without a traceback; its text is printed as is (a value like ``[a, b]`` is not markup)."""
    from rich.markup import escape

    err.print(f"[bold red]{label}:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)


def _compose(overrides: list[str] | None, recipes_dirs: list[Path] | None):
    from .config.compose import compose

    try:
        return compose(overrides or [], extra_recipe_dirs=recipes_dirs)
    except ConfigError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None


def _validate(cfg, command: str) -> None:
    """The deep pass of `asyncgrpo_cli.config.validate` before anything starts: exit 2 on a problem,
    print its warnings otherwise."""
    from rich.markup import escape

    from .config.validate import validate_run

    try:
        warnings = validate_run(cfg, command)
    except ConfigError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    for w in warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)


def _resolve_model(cfg, export: bool = True) -> str | None:
    """Point ``model.name`` at the folder the server and trainer load. A packaged GGUF is exported once
    (with ``export``); without it, a note saying the folder is made on the first real start is returned."""
    from .models import plan_model_path, resolve_model_path

    if not cfg.model.name:
        return None
    name, gguf_file = str(cfg.model.name), cfg.model.gguf_file
    note = None
    if export:
        cfg.model.name = resolve_model_path(name, gguf_file)
    else:
        try:
            cfg.model.name, gguf = plan_model_path(name, gguf_file)
        except ConfigError as exc:  # a dry run still prints the line; the note says what a real start needs
            return f"a real start would stop here: {exc}"
        if gguf is not None:
            note = f"{cfg.model.name} does not exist yet: asyncgrpo serve/train export {gguf} there on first start"
    cfg.model.gguf_file = None
    return note


@app.command("config")
def config_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """Print the composed, validated config as YAML."""
    from .config.compose import to_yaml

    cfg = _compose(overrides, recipes_dir)
    sys.stdout.write(to_yaml(cfg))


@app.command("recipes")
def recipes_cmd(
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """List the recipes, each with its one-line description."""
    from .config.compose import list_recipes

    try:
        recipes = list_recipes(recipes_dir)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    table = Table("recipe", "description", box=None, show_header=True, header_style="bold")
    for r in recipes:
        table.add_row(f"+recipe={r.name}", r.description or "(no description)")
    out.print(table)


@app.command("serve")
def serve_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and environment instead of starting it."),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """Start the inference server (vLLM, or the embedded sampler) with exactly the flags the config needs."""
    from .launch.server_command import build_server_command
    from .launch.supervisor import server_exec_argv

    cfg = _compose(overrides, recipes_dir)
    _validate(cfg, "serve")
    try:
        export_note = _resolve_model(cfg, export=not dry_run)
        command = build_server_command(cfg)
    except ConfigError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    if export_note:
        command.notes.append(export_note)
    if dry_run:
        for note in command.notes:
            sys.stdout.write(f"# {note}\n")
        sys.stdout.write(command.shell_line() + "\n")
        return
    for note in command.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)
    try:
        argv = server_exec_argv(command)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    env = {**os.environ, **command.env}
    err.print(f"[dim]$ {command.shell_line()}[/]", highlight=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)


@app.command("doctor", context_settings={"allow_extra_args": True})
def doctor_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """Check a running server against the config (flags, LoRA limits, versions, GPUs) and print the fix."""
    try:
        from .doctor.checks import run_doctor
    except ImportError:
        err.print("asyncgrpo doctor: not yet available in this version.")
        raise typer.Exit(1) from None
    cfg = _compose(overrides, recipes_dir)
    try:
        _resolve_model(cfg)  # compare against the folder `serve` and `train` give the server
    except ConfigError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    raise typer.Exit(run_doctor(cfg, as_json=as_json))


@app.command("train")
def train_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch plan only."),
    recipes_dir: Optional[list[Path]] = typer.Option(None, "--recipes-dir", help=RECIPES_DIR_HELP),
) -> None:
    """Run the main job: the sampler, the FSDP2 trainer and its rollout worker, with live panels."""
    try:
        from .launch.supervisor import run_train
    except ImportError:
        cfg = _compose(overrides, recipes_dir)
        err.print("asyncgrpo train: not yet available in this version; `asyncgrpo config` shows the composed config "
                  "and `asyncgrpo serve` starts the sampler.")
        raise typer.Exit(1) from None
    cfg = _compose(overrides, recipes_dir)
    _validate(cfg, "train")
    raise typer.Exit(run_train(cfg, dry_run=dry_run))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
