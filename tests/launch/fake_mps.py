"""Stand-in for ``nvidia-cuda-mps-control`` in supervisor tests.

``python fake_mps.py daemon [MODE]`` is the foreground daemon (``-f``): it makes ``control`` in
``$CUDA_MPS_PIPE_DIRECTORY``, a control log with ``$FAKE_MPS_CLIENTS`` (default 2) ``NEW CLIENT`` lines in
``$CUDA_MPS_LOG_DIRECTORY``, and waits for a ``quit`` file there (mode ``die``: it exits 4 at once, making
nothing; ``leave``: it exits 0.5 s after it is ready). ``python fake_mps.py quit`` is the client the supervisor
gives ``quit`` on stdin: it writes that file.
"""

import os
import sys
import time
from pathlib import Path


def main() -> None:
    pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    if sys.argv[1] == "quit":
        if sys.stdin.read().strip() == "quit":
            (pipe / "quit").write_text("quit")
        return
    print(f"fake mps: pid {os.getpid()} log dir {os.environ.get('CUDA_MPS_LOG_DIRECTORY')}", flush=True)
    if sys.argv[2:] == ["die"]:
        print("fake mps: cannot start (pretend)", flush=True)
        sys.exit(4)
    (pipe / "control").write_text("")
    log = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    log.write_text("".join(f"[fake] NEW CLIENT {n} from user 0: Server already exists\n"
                           for n in range(int(os.environ.get("FAKE_MPS_CLIENTS", "2")))))
    if sys.argv[2:] == ["leave"]:  # gone during the run
        time.sleep(0.5)
        print("fake mps: exiting on its own", flush=True)
        sys.exit(0)
    while not (pipe / "quit").exists():
        time.sleep(0.05)
    print("fake mps: quit received", flush=True)


if __name__ == "__main__":
    main()
