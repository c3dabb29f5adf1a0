"""What an output folder already holds, and whether and how a run may start in it (`asyncgrpo train`).

`start_problem` refuses a start that would overwrite an earlier run or resume from nothing, `earlier_run`
reads what is there, `earlier_checkpoints_note` warns about incomplete leftovers, and `resume_command` is the
command line that continues a stopped run. No process is started here.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from typing import Any

from .checkpoints import CheckpointError, checkpoint_step, list_checkpoints, newest_complete_checkpoint, resolve_resume

__all__ = ["TRAIN_ARGV_ENV", "earlier_checkpoints_note", "earlier_run", "how_it_ended", "resume_command",
           "resume_command_from_env", "start_problem", "train_command"]

TRAIN_ARGV_ENV = "ASYNCGRPO_TRAIN_ARGV"
"""The supervisor's command line (a JSON list), in the trainer's environment: the trainer records the command that
resumes from each checkpoint it saves in ``status.json`` (``resume_command``), so a run whose supervisor died
still says how to continue."""


USER_ENV = ("ASYNCGRPO_CACHE", "ASYNCGRPO_MATH_VERIFY_WORKERS", "ASYNCGRPO_GDN_KERNEL")
"""The environment settings of ours that change where a run finds its files or how it computes (the model export
cache, the math-verify worker count, the Gated DeltaNet kernel): a printed command that continues or restarts a run
sets those this process had, so it runs as this one did (not secrets: nothing else of the environment is printed)."""


def env_words(environ: dict[str, str] | None = None) -> list[str]:
    """``NAME=value`` (value shell-quoted) for every `USER_ENV` setting in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return [f"{name}={shlex.quote(env[name])}" for name in USER_ENV if env.get(name)]


def _command(words: list[str], environ: dict[str, str] | None = None) -> str:
    """``words`` as one shell line, after the `USER_ENV` settings of ``environ`` (``NAME=value`` stays an
    assignment: only its value is quoted)."""
    return " ".join([*env_words(environ), shlex.join(words)])


NOT_REPEATED = ("--dry-run", "--check", "--doc")
"""Flags of the command line that the printed command leaves out (a printed way to continue is a real run, also
when ``asyncgrpo config --check`` printed it)."""


def _launcher(argv: list[str]) -> list[str] | None:
    """How this process was started as ``asyncgrpo train`` (or ``asyncgrpo config --check``, which runs train's
    checks, so its fixes are train commands too): ``["asyncgrpo"]`` for the console script, ``["python", "-m",
    "asyncgrpo_cli"]`` for ``python -m asyncgrpo_cli``; None for anything else."""
    checking = len(argv) >= 2 and argv[1] == "config" and "--check" in argv
    if len(argv) < 2 or not (argv[1] == "train" or checking) or any(a in ("-m", "--multirun") for a in argv):
        return None
    program = Path(argv[0])
    if program.name == "asyncgrpo":
        return ["asyncgrpo"]
    if program.name == "__main__.py" and program.parent.name == "asyncgrpo_cli":
        return ["python", "-m", "asyncgrpo_cli"]
    return None


def train_command(overrides: list[str], argv: list[str] | None = None,
                  environ: dict[str, str] | None = None) -> str | None:
    """This ``asyncgrpo train`` command line (``argv``, default ``sys.argv``) with ``overrides`` (``key=value``)
    in place of its own overrides of the same keys, after this run's `USER_ENV` settings (``environ``, default
    ``os.environ``); None when the process is not ``asyncgrpo train`` (the Python API) or is a sweep (``-m``)."""
    argv = list(sys.argv if argv is None else argv)
    launcher = _launcher(argv)
    if launcher is None:
        return None
    keys = {o.split("=", 1)[0] for o in overrides}
    kept = [a for a in argv[2:] if a.lstrip("+~").split("=", 1)[0] not in keys and a not in NOT_REPEATED]
    return _command([*launcher, "train", *kept, *overrides], environ)


def resume_command(checkpoint: str | Path, argv: list[str] | None = None,
                   environ: dict[str, str] | None = None) -> str:
    """The command that resumes this run from ``checkpoint``: this ``asyncgrpo train`` command line (``argv``,
    default ``sys.argv``) with its overrides, its own ``trainer.resume_from_checkpoint`` replaced, after this
    run's `USER_ENV` settings (``environ``, default ``os.environ``); only the override itself when the process is
    not ``asyncgrpo train`` (the Python API) or is a sweep (``-m``)."""
    argv = list(sys.argv if argv is None else argv)
    override = f"trainer.resume_from_checkpoint={checkpoint}"
    launcher = _launcher(argv)
    if launcher is None:
        return override
    kept = [a for a in argv[2:] if not a.lstrip("+~").startswith("trainer.resume_from_checkpoint=")
            and a not in NOT_REPEATED]
    return _command([*launcher, "train", *kept, override], environ)


def resume_command_from_env(checkpoint: str | Path, environ: dict[str, str] | None = None) -> str:
    """`resume_command` of the supervisor's command line (`TRAIN_ARGV_ENV` in ``environ``, default
    ``os.environ``); only the override when it is not set or not a JSON list of strings (the Python API)."""
    import json
    import os

    raw = (os.environ if environ is None else environ).get(TRAIN_ARGV_ENV)
    try:
        argv = json.loads(raw) if raw else None
    except ValueError:
        argv = None
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        argv = ["python"]  # not `asyncgrpo train`: the override alone
    return resume_command(checkpoint, argv, environ)


def earlier_run(output_dir: Path) -> tuple[Path | None, bool]:
    """What an earlier run left in ``output_dir``: its newest complete checkpoint (None when there is none) and
    whether its final model (``model.safetensors`` or a LoRA ``adapter_model.safetensors``) is there."""
    final = (output_dir / "model.safetensors").exists() or (output_dir / "adapter_model.safetensors").exists()
    return newest_complete_checkpoint(output_dir), final


def start_problem(trainer: Any, output_dir: Path, argv: list[str] | None = None) -> str | None:
    """Why the run cannot start in ``output_dir`` as configured by the ``trainer`` group (``resume_from_checkpoint``,
    ``max_steps``), in the CLI's key names; None when it can. The fixes are whole ``asyncgrpo train`` commands
    (`train_command` of ``argv``, default ``sys.argv``).

    Either ``trainer.resume_from_checkpoint`` names nothing to resume from (not a complete checkpoint, or none
    in ``output_dir`` for ``true``) or a checkpoint already at ``trainer.max_steps``; or it is unset while
    ``output_dir`` holds an earlier run's complete checkpoint or final model: starting over there would
    overwrite that model, let checkpoint rotation delete one run's checkpoints and mix both runs in
    ``metrics.jsonl``.
    """
    resume = trainer.resume_from_checkpoint
    if not resume:
        newest, final = earlier_run(output_dir)
        if newest is None and not final:
            return None
        from .state import final_model_step

        step_of_final = final_model_step(output_dir)
        final_name = "the final model" + (f" (step {step_of_final})" if step_of_final is not None else "")
        held = ", ".join([*([newest.name] if newest is not None else []), *([final_name] if final else [])])
        fresh = next(output_dir.with_name(f"{output_dir.name}-{i}") for i in range(2, 10_000)
                     if not output_dir.with_name(f"{output_dir.name}-{i}").exists())
        fixes = []
        if newest is not None:
            step, max_steps = checkpoint_step(newest) or 0, int(trainer.max_steps)
            cont = ["trainer.resume_from_checkpoint=true"]
            how, its_max = how_it_ended(output_dir, newest)
            why = f" ({how})"
            if step >= max_steps > 0:  # this command's max_steps would train nothing more
                cont.append(f"trainer.max_steps={its_max if its_max and its_max > step else 2 * step}")
                why = f" ({how}; this command's trainer.max_steps={max_steps} is reached already)"
            fixes.append(_fix(f"continue it{why}", train_command(cont, argv), " ".join(cont)))
        moved = f"trainer.output_dir={fresh}"
        fixes.append(_fix(f"{'or ' if fixes else ''}write this run elsewhere", train_command([moved], argv), moved))
        fixes.append(f"or remove {output_dir} to start over")
        return (f"trainer.output_dir={output_dir} already holds an earlier run ({held}); starting over there would "
                "overwrite it. Fix:\n  " + "\n  ".join(fixes))
    try:
        folder = resolve_resume(True if str(resume).lower() == "true" else str(resume), output_dir)
    except CheckpointError as exc:
        return re.sub(r"(?<![\w.])resume_from_checkpoint", "trainer.resume_from_checkpoint", str(exc))
    step, max_steps = checkpoint_step(folder) or 0, int(trainer.max_steps)
    if step >= max_steps > 0:
        return (f"trainer.resume_from_checkpoint={resume}: {folder.name} is at step {step}, already "
                f"trainer.max_steps={max_steps}: nothing to train. Fix: raise it, e.g. trainer.max_steps={2 * step}")
    return None


def _fix(what: str, command: str | None, overrides: str) -> str:
    """One fix of `start_problem`: ``what`` then the whole command alone on the next line, ready to paste;
    ``what with: overrides`` on one line when there is no command (the Python API, or a command line with other
    problems), saying that each replaces a value of its key already given (a second trial added
    ``trainer.max_steps=16`` beside its own and was refused for a key given twice)."""
    if command:
        return f"{what}:\n    {command}"
    keys = [o.split("=", 1)[0] for o in overrides.split()]
    note = (f"it replaces your own {keys[0]}=..., if any" if len(keys) == 1
            else "each replaces your own value of its key, if any")
    return f"{what} with: {overrides} ({note})"


def how_it_ended(output_dir: Path, checkpoint: Path) -> tuple[str, int | None]:
    """How the earlier run of ``output_dir`` ended, as far as its files say, and its ``max_steps`` (None when
    unknown or unbounded): ``"it stopped at step 10 of 16"`` when its ``status.json`` is final at the
    checkpoint's step, else ``"its newest checkpoint is at step 10 of 16"`` (the ``max_steps`` recorded in the
    checkpoint's ``trainer_state.json``; ``of N`` left out when it is not there)."""
    import json

    step = checkpoint_step(checkpoint) or 0
    its_max = None
    try:
        saved = json.loads((checkpoint / "trainer_state.json").read_text()).get("max_steps")
        its_max = int(saved) if isinstance(saved, int) and 0 < saved < 10**9 else None
    except (OSError, ValueError, AttributeError):
        pass
    of = f" of {its_max}" if its_max else ""
    try:
        status = json.loads((output_dir / "status.json").read_text())
    except (OSError, ValueError):
        status = {}
    state = str(status.get("state", "")) if isinstance(status, dict) else ""
    if isinstance(status, dict) and status.get("step") == step and state:
        word = next((w for w in ("finished", "stopped", "failed") if state.startswith(w)), None)
        if word is not None:
            return f"it {word} at step {step}{of}", its_max
    return f"its newest checkpoint is at step {step}{of}", its_max


def earlier_checkpoints_note(trainer: Any) -> str | None:
    """A warning when the ``trainer`` group's ``output_dir`` already holds checkpoints and this run does not resume
    from one: it starts from scratch and its checkpoints replace those of the same step."""
    if trainer.resume_from_checkpoint:
        return None
    found = [str(p) for p in list_checkpoints(trainer.output_dir)]
    if not found or earlier_run(Path(trainer.output_dir)) != (None, False):
        return None  # nothing there, or a run `start_problem` refuses to start over
    return (f"note: {trainer.output_dir} holds {len(found)} checkpoint(s) of an earlier run (newest "
            f"{Path(found[-1]).name}); this run starts from scratch and overwrites checkpoints of the same step. "
            f"To continue that run instead: trainer.resume_from_checkpoint={found[-1]}; to keep it: "
            "trainer.output_dir=ANOTHER_DIR")
