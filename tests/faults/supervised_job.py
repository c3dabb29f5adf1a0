"""``asyncgrpo train`` (the real CLI, supervisor, ``accelerate launch`` and trainer) whose embedded sampler is
`outage_program.py server`, so that a fault-suite test can have the server die or hang at a chosen request:

    python -m tests.faults.supervised_job --events FILE (--die-on ROUTE | --hang-on ROUTE) -- train ARGS...

``ARGS`` are those of `conftest.cli_argv` after ``-m asyncgrpo_cli``. The server command the supervisor
builds is only wrapped (same flags); everything else runs as in a user's ``asyncgrpo train``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROGRAM = str(Path(__file__).with_name("outage_program.py"))


def main() -> None:
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", required=True)
    parser.add_argument("--die-on", default=None)
    parser.add_argument("--hang-on", default=None)
    ns = parser.parse_args(sys.argv[1:split])
    wrap = ["--events", ns.events, *(["--die-on", ns.die_on] if ns.die_on else []),
            *(["--hang-on", ns.hang_on] if ns.hang_on else [])]

    def commands(name: str, argv: list[str]) -> list[str]:
        if name == "server" and argv[1:3] == ["-m", "asyncgrpo_cli.sampler.embedded"]:
            return [argv[0], PROGRAM, "server", *wrap, "--", *argv[3:]]
        return argv

    from asyncgrpo_cli.launch import supervisor

    run_train = supervisor.run_train

    def wrapped(cfg, dry_run=False, **kwargs):
        return run_train(cfg, dry_run, _commands=commands, **kwargs)

    supervisor.run_train = wrapped  # the CLI imports it from the module when `train` runs
    from asyncgrpo_cli.cli import main as cli_main

    sys.argv = ["asyncgrpo", *sys.argv[split + 1:]]
    cli_main()


if __name__ == "__main__":
    main()
