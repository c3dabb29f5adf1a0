"""The embedded sampler: a small vLLM-0.26-protocol server over a transformers causal LM (DESIGN §5).

Start it with ``python -m asyncgrpo_cli.sampler.embedded --model DIR --port 8000`` or, in-process,
``ServerThread(ServerConfig(model=DIR, port=0)).start()``. Modules: `sampling` (the math),
`engine` (scheduler + async engine loop), `runner` (model, KV, weights, LoRA), `server` (routes).
"""

from .engine import Engine, EngineRequest, Scheduler, SchedulePlan
from .sampling import SamplingOptions
from .server import EmbeddedServer, ServerConfig, ServerThread

__all__ = [
    "EmbeddedServer",
    "Engine",
    "EngineRequest",
    "SamplingOptions",
    "SchedulePlan",
    "Scheduler",
    "ServerConfig",
    "ServerThread",
]
