"""The sampler boundary (DESIGN §5): one HTTP client for vLLM and the embedded sampler.

- `SamplerClient` (async; the rollout worker) and `SyncSamplerClient` (CLI, doctor, weight sync);
- `SamplingParams` in, `TurnResult` out (``to_turn_record()`` gives the shared `TurnRecord`);
- `ServerLoad` from ``/metrics`` (SPEC §4.2);
- `retry`: the retry decisions and the outage clock of SPEC Appendix B.17 (`retry.ServerOutage`);
- ``asyncgrpo_cli.sampler.embedded``: the embedded vLLM-protocol server.
"""

from .client import (
    SamplerClient,
    SamplerConnectionLost,
    SamplerError,
    SamplerProtocolError,
    SamplerRequestError,
    SamplerRetryError,
    SamplerUnavailableError,
    SamplingParams,
    SeedSequence,
    SyncSamplerClient,
    TurnResult,
)
from .prometheus import ServerLoad, parse_server_load

__all__ = [
    "SamplerClient",
    "SamplerConnectionLost",
    "SamplerError",
    "SamplerProtocolError",
    "SamplerRequestError",
    "SamplerRetryError",
    "SamplerUnavailableError",
    "SamplingParams",
    "SeedSequence",
    "ServerLoad",
    "SyncSamplerClient",
    "TurnResult",
    "parse_server_load",
]
