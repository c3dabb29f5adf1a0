"""One CUDA context through the job's MPS daemon, before vLLM and the trainer join it (`mps.probe_daemon`).

    python -m asyncgrpo_cli.launch.mps_probe     # with CUDA_MPS_PIPE_DIRECTORY and CUDA_VISIBLE_DEVICES set

A control daemon can be ready (its socket is there) while its MPS server cannot start for a client: another
user's MPS server on the GPU, a GPU in the Prohibited compute mode, no shared memory. A client then fails at its
first context, so vLLM would fail at its start. This program creates and destroys one context on device 0 through
the driver API (``libcuda.so.1`` by ctypes: no torch import, well under a second) and says how it went.

Exit status: 0 = the context was created (the MPS server runs); 1 = the driver refused it (its error's name and
text on stdout); 3 = no CUDA driver library here, nothing was probed.
"""

from __future__ import annotations

import ctypes
import sys

NOT_PROBED = 3


def _error(lib, code: int) -> str:
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    return f"{(name.value or b'CUDA error').decode()} ({code}): {(text.value or b'').decode()}"


def main() -> int:
    """Create and destroy one context (module docstring). Returns the exit status."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        print(f"mps probe: no CUDA driver library ({exc}); not probed")
        return NOT_PROBED
    device, context = ctypes.c_int(), ctypes.c_void_p()
    for step, call in (("cuInit", lambda: lib.cuInit(0)),
                       ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(device), 0)),
                       ("cuCtxCreate", lambda: lib.cuCtxCreate_v2(ctypes.byref(context), 0, device))):
        code = call()
        if code != 0:
            print(f"mps probe: {step} failed: {_error(lib, code)}")
            return 1
    lib.cuCtxDestroy_v2(context)
    print("mps probe: a CUDA context was created through the MPS daemon")
    return 0


if __name__ == "__main__":
    sys.exit(main())
