"""Stand-in for ``nvidia-cuda-mps-control`` in supervisor and keeper tests (`mps_control` makes a program of it).

``python fake_mps.py -f`` (or ``daemon``) is the foreground daemon: it writes its pid to ``fake-daemon.pid`` and
makes ``control`` in ``$CUDA_MPS_PIPE_DIRECTORY``, prints two ``NEW CLIENT <pid>`` lines for each of
``$FAKE_MPS_CLIENTS`` (default 2) pids on its stdout (the real foreground daemon logs there), and waits for a
``quit`` file there. ``$FAKE_MPS_MODE`` (or the argument after ``-f``): ``die`` exits 4 at once, making nothing;
``leave`` exits 0 as soon as it is ready (so that any later look finds it gone, however fast the job runs);
``stubborn`` never acts on ``quit`` (SIGKILL ends it). SIGTERM ends it (the default action).

``python fake_mps.py`` (or ``quit``) is the control client: it reads one command on stdin and answers like the
real one, exiting 1 ("Cannot find MPS control daemon process") when the daemon does not run:

- ``quit``: writes the ``quit`` file;
- ``get_server_list``: the daemon's pid (its one pretend MPS server);
- ``get_client_list <pid>``: those of the pids in the file ``$FAKE_MPS_CLIENT_PIDS`` names that run (none when
  it is missing);
- any command exits 1 with ``$FAKE_MPS_CONTROL_FAILS`` set (a daemon that does not answer).
"""

import os
import sys
import time
from pathlib import Path


def runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def daemon_alive(pipe: Path) -> bool:
    """Whether the daemon whose pid is in the pipe folder runs."""
    try:
        return runs(int((pipe / "fake-daemon.pid").read_text()))
    except (OSError, ValueError):
        return False


def control(pipe: Path) -> int:
    words = sys.stdin.read().split()
    if not daemon_alive(pipe) or os.environ.get("FAKE_MPS_CONTROL_FAILS"):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    if words == ["quit"]:
        (pipe / "quit").write_text("quit")
    elif words == ["get_server_list"]:
        print((pipe / "fake-daemon.pid").read_text().strip())
    elif words[:1] == ["get_client_list"] and len(words) == 2:
        listed = Path(os.environ.get("FAKE_MPS_CLIENT_PIDS", os.devnull))
        pids = [int(w) for w in listed.read_text().split()] if listed.is_file() else []
        print("\n".join(str(pid) for pid in pids if runs(pid)))  # a client that exited is not connected
    else:
        print(f"unknown command {' '.join(words)}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    if sys.argv[1:2] in ([], ["quit"]):
        return control(pipe)
    mode = (sys.argv[2:3] or [os.environ.get("FAKE_MPS_MODE", "ok")])[0]
    print(f"fake mps: pid {os.getpid()} log dir {os.environ.get('CUDA_MPS_LOG_DIRECTORY')}", flush=True)
    if mode == "die":
        print("fake mps: cannot start (pretend)", flush=True)
        return 4
    (pipe / "fake-daemon.pid").write_text(str(os.getpid()))
    for n in range(int(os.environ.get("FAKE_MPS_CLIENTS", "2"))):  # on stdout, as the real -f daemon logs;
        for _ in range(2):  # each client connects twice (a process opens more than one context)
            print(f"[fake] NEW CLIENT {100 + n} from user 0: Server already exists", flush=True)
    (pipe / "control").write_text("")
    if mode == "leave":  # gone during the run
        print("fake mps: exiting on its own", flush=True)
        return 0
    while mode == "stubborn" or not (pipe / "quit").exists():
        time.sleep(0.05)
    print("fake mps: quit received", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
