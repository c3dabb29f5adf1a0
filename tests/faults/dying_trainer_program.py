"""A stand-in trainer for `test_supervisor_gone.py`: it follows its supervisor's pid as the real trainer does
(`train.main._follow_supervisor`), writes ``status.json`` as the trainer does (``running``, then ``stopping`` on
SIGTERM) and, on SIGTERM, starts a save of step ``--step`` that never ends (``.checkpoint-N.partial/``, then a
``saving`` marker in ``--out``): the test kills it there, as whatever cut the save in issue #45 did.

    python -m tests.faults.dying_trainer_program --out DIR --step N
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=1)
    ns = parser.parse_args()
    out = Path(ns.out)
    config = out / "asyncgrpo_config.yaml"
    config.write_text(f"trainer:\n  output_dir: {out}\n")
    from asyncgrpo_cli.run.state import LiveFiles
    from asyncgrpo_cli.train.main import _follow_supervisor

    live = LiveFiles(out)
    live.update(force=True, state="running", step=ns.step)
    saving = threading.Event()

    def on_term(signum, frame) -> None:  # noqa: ARG001
        live.update(force=True, stopping=f"SIGTERM: the supervisor is gone: saving the last completed step "
                                         f"(step {ns.step}) and stopping")
        (out / f".checkpoint-{ns.step}.partial").mkdir(exist_ok=True)
        saving.set()

    signal.signal(signal.SIGTERM, on_term)
    _follow_supervisor(str(config))
    (out / "following").write_text("ready\n")
    saving.wait()
    (out / "saving").write_text("saving\n")
    threading.Event().wait()  # the save that never ends: the test kills this process here
    return 0


if __name__ == "__main__":
    sys.exit(main())
