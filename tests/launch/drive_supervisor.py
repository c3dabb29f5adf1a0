"""Runs `run_train` in its own process (so a test can send it SIGINT like a user pressing Ctrl-C).

``python drive_supervisor.py OUT_DIR PORT PID_DIR TRAINER_MODE CPU_PROCESSES [TRAINER_GRACE_S]`` composes the
test config, starts the fake server and the fake trainer through the real ``accelerate launch`` command, and
exits with run_train's status. ``TRAINER_GRACE_S`` (default 60) is `Timeouts.trainer_grace_s`.
"""

import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from asyncgrpo_cli.config.compose import compose  # noqa: E402
from asyncgrpo_cli.launch.supervisor import Timeouts, run_train  # noqa: E402
from tests.launch.conftest import base_overrides, hook  # noqa: E402


def main() -> int:
    out, port, pid_dir, mode, procs = sys.argv[1:6]
    grace = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    cfg = compose(base_overrides(Path(out), int(port), f"launch.cpu_processes={procs}"))
    console = Console(file=sys.stdout, width=160, force_terminal=False)
    timeouts = Timeouts(trainer_grace_s=grace, group_term_s=1.0, poll_s=0.2)
    return run_train(cfg, console=console, gpu_count=0, timeouts=timeouts,
                     _commands=hook("ok", mode, Path(pid_dir), use_accelerate=True))


if __name__ == "__main__":
    sys.exit(main())
