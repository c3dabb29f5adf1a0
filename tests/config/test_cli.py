"""The Typer CLI: recipes, config and errors as a user sees them."""

from typer.testing import CliRunner

from asyncgrpo_cli.cli import app

runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("train", "serve", "doctor", "config", "recipes"):
        assert name in result.output


def test_recipes_lists_descriptions():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0
    assert "+recipe=deepmath" in result.output and "+recipe=smoke" in result.output
    assert "DeepMath" in result.output


def test_config_prints_composed_yaml():
    result = runner.invoke(app, ["config", "+recipe=smoke", "rollout.num_generations=6"])
    assert result.exit_code == 0, result.output
    assert "num_generations: 6" in result.output and "backend: embedded" in result.output


def test_config_check_runs_the_checks_train_runs(tmp_path):
    """What train refuses, config --check prints and refuses too (exit 2), its problems without the YAML (240
    lines of it came first and hid them: a fresh-user trial); a valid config prints the YAML, then the line that
    the checks passed; the bare defaults say what was not checked."""
    overrides = ["+recipe=smoke", "rollout.max_completion_length=1000"]
    assert runner.invoke(app, ["config", *overrides]).exit_code == 0  # composing alone: types and rules
    result = runner.invoke(app, ["config", "--check", *overrides])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("config error: rollout.max_completion_length=1000: not below "
                                    "sampler.max_model_len=256"), result.output[:500]
    assert "Fix: rollout.max_completion_length=48" in result.output
    assert "max_completion_length: 1000" not in result.output and "model:\n" not in result.output  # no YAML
    valid = runner.invoke(app, ["config", "--check", "+recipe=smoke", f"trainer.output_dir={tmp_path / 'out'}",
                                f"sampler.port={_free_port()}"])
    assert valid.exit_code == 0, valid.output
    assert valid.output.startswith("model:\n") and "max_completion_length: 48" in valid.output  # the YAML first
    assert valid.output.rstrip().endswith("(the server's own checks run when it answers: asyncgrpo doctor)")
    assert valid.output.index("max_completion_length: 48") < valid.output.index("every check train runs before "
                                                                                 "it starts passed")
    assert "is unused" not in valid.output
    unused = runner.invoke(app, ["config", "--check", "+recipe=smoke", f"trainer.output_dir={tmp_path / 'out'}",
                                 f"sampler.port={_free_port()}", "launch.mps_trainer_priority=below_normal"])
    assert unused.exit_code == 0, unused.output  # a setting this plan leaves without effect: said, as train's plan does
    assert "note: launch.mps_trainer_priority=below_normal is unused: this job runs without MPS (the trainer runs " \
           "on the CPU)" in unused.output
    used = tmp_path / "used"  # a refusal of train's start (`early_refusal`): no YAML either
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"x")
    refused = runner.invoke(app, ["config", "--check", "+recipe=smoke", f"trainer.output_dir={used}",
                                  f"sampler.port={_free_port()}"])
    assert refused.exit_code == 2 and refused.output.startswith(f"error: trainer.output_dir={used} already holds "
                                                                "an earlier run"), refused.output[:500]
    assert "max_completion_length: 48" not in refused.output
    bare = runner.invoke(app, ["config", "--check"])
    assert bare.exit_code == 0 and "model.name is unset, so only types and rules were checked" in bare.output


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_config_error_exit_code_and_message():
    result = runner.invoke(app, ["config", "rollout.top_p=0.5"])
    assert result.exit_code == 2
    assert "rollout.top_p=0.5" in result.output and "rollout.top_k" in result.output


def test_user_recipes_dir(tmp_path):
    (tmp_path / "tiny.yaml").write_text("# description: tiny test recipe\n# @package _global_\nmodel:\n  name: x/y\n")
    result = runner.invoke(app, ["recipes", "--recipes-dir", str(tmp_path)])
    assert "+recipe=tiny" in result.output and "tiny test recipe" in result.output
    result = runner.invoke(app, ["config", "+recipe=tiny", "--recipes-dir", str(tmp_path)])
    assert result.exit_code == 0 and "name: x/y" in result.output


def test_every_command_line_of_the_top_level_help_is_whole_on_a_wide_terminal():
    """Issue #45: in ``asyncgrpo --help`` the config command's line broke mid-sentence ("--doc: with" / "each
    key's description)."), the docstring's own line break; on a terminal wide enough, each command is one line."""
    import typer.main

    from asyncgrpo_cli.cli import app as cli_app

    result = CliRunner().invoke(cli_app, ["--help"], env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    group = typer.main.get_group(cli_app)
    for name, command in group.commands.items():
        text = " ".join((command.help or "").split())
        row = next((ln for ln in lines if ln.startswith(f"│ {name} ")), None)
        assert row is not None, (name, result.output)
        assert text in " ".join(row.strip("│ ").split()), (name, row, text)


def test_sigint_ignored_by_the_shell_stops_the_cli_from_its_first_line():
    # a job started with & by a non-interactive shell inherits SIGINT ignored (a fresh-user trial's kill -INT in the
    # first seconds was dropped)
    import signal

    from asyncgrpo_cli.cli import sigint_stops

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sigint_stops()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, handler := (lambda *a: None))
        sigint_stops()  # a handler of someone's own is left alone
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)
