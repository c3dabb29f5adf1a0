"""The ONE builder of the inference server's command line and environment (DESIGN.md §4, CONFIG.md).

`asyncgrpo serve` prints or execs it, `asyncgrpo train` launches it, and `asyncgrpo doctor` compares a
running server against it and prints it as the restart command.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.rules import max_lora_rank_for
from .colocate import Layout, visible_ids, vllm_ipc_problem
from .vllm_versions import (MIN_VLLM, NEWEST_SUPPORTED_VLLM, SAMPLING_MASK_MIN_VLLM,  # noqa: F401  (re-exported)
                            SCALE_OUT_MIN_VLLM, installed_vllm_version, parse_version, vllm_has_flag)

if TYPE_CHECKING:
    from ..config.schema import (LaunchConfig, ModelConfig, PeftConfig, RolloutConfig, SamplerConfig,
                                 StalenessConfig, TrainerConfig)


@dataclass
class ServerCommand:
    """A server command: ``argv``, the environment variables it needs on top of the caller's, and notes.

    ``notes`` are human remarks (printed as ``#`` comments by ``serve --dry-run``); ``problems`` are
    reasons the command cannot work here (each with a fix: ``serve`` and ``train`` refuse to start).
    """

    argv: list[str]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def shell_line(self) -> str:
        """A copy-pasteable shell line: ``VAR=value ... program args``."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{env} {cmd}".strip()

    def flag(self, name: str) -> str | None:
        """Value of ``--name`` in argv ("" for a bare flag), or None when absent."""
        if name not in self.argv:
            return None
        i = self.argv.index(name)
        nxt = self.argv[i + 1] if i + 1 < len(self.argv) else ""
        return "" if nxt.startswith("--") else nxt


def compute_dtype(trainer: Any, model: Any) -> str:
    """The trainer's compute dtype (CONFIG.md) from the ``trainer`` and ``model`` groups: bfloat16 with
    ``trainer.bf16`` (None = on unless fp16), float16 with ``trainer.fp16``, else ``model.dtype``."""
    fp16 = bool(trainer.fp16)
    bf16 = trainer.bf16
    if bf16 is None:
        bf16 = not fp16
    if bf16:
        return "bfloat16"
    if fp16:
        return "float16"
    dtype = model.dtype.value if hasattr(model.dtype, "value") else str(model.dtype)
    return dtype


def uses_candidate_sets(rollout: Any) -> bool:
    """top-k, top-p or min-p filtering is on in the ``rollout`` group (`RolloutConfig`, SPEC §7)."""
    return rollout.top_k > 0 or rollout.top_p < 1 or (rollout.min_p or 0) > 0


def lora_limits(peft: Any, staleness: Any) -> tuple[int, int]:
    """(``--max-lora-rank``, ``--max-loras``) for the ``peft`` and ``staleness`` groups (`PeftConfig`,
    `StalenessConfig`; SPEC §9): smallest allowed rank >= r, and ``max_staleness + 2`` adapters."""
    return max_lora_rank_for(peft.r), staleness.max_staleness + 2


def api_server_count(sampler: Any, peft: Any) -> int:
    """``--api-server-count``: ``sampler.api_server_count``, forced to 1 with runtime LoRA updating
    (``peft.enabled``; vLLM refuses both)."""
    return 1 if peft.enabled else sampler.api_server_count


def max_logprobs(sampler: Any, rollout: Any) -> int:
    """``--max-logprobs``: ``sampler.max_logprobs`` or ``rollout.num_sampler_logprobs``."""
    return sampler.max_logprobs if sampler.max_logprobs is not None else rollout.num_sampler_logprobs


def data_parallel_size(sampler: Any) -> int:
    """``--data-parallel-size``: the ``sampler`` group's ``data_parallel_size`` (vLLM engines behind the one URL)."""
    return int(sampler.get("data_parallel_size", 1))


def engine_count(sampler: Any) -> int:
    """``sampler.engines``: servers started behind one router (1 = a plain server, no router)."""
    return int(sampler.get("engines", 1) if hasattr(sampler, "get") else getattr(sampler, "engines", 1))


def engines_problems(sampler: Any, *, colocated: bool, vllm: bool) -> list[str]:
    """Why ``sampler.engines`` > 1 cannot run with this layout (empty when it can, or when it is 1): the weight
    sync must reach every server the same way, which the CUDA-IPC (colocated vLLM) and embedded syncs do, and
    NCCL's one rendezvous per server does not. (LoRA and data parallelism with several engines are config
    refusals: `config.compose.validate_config`.)"""
    n = engine_count(sampler)
    if n <= 1 or not vllm or colocated:
        return []
    return [f"sampler.engines={n} without the colocated layout: the NCCL weight transfer joins one server. Fix: "
            "sampler.engines=1, or run vLLM on the trainer's GPU (launch.colocate=true, CUDA-IPC sync)"]


def behind_router(command: ServerCommand, sampler: Any, memory_share: float | None) -> ServerCommand:
    """``command`` as is for ``sampler.engines`` = 1; else the router's command (`server.router`) at
    ``sampler.host:sampler.port`` starting that many copies of it on the next ports (each one's ``--port``
    is rewritten by the router), with a note saying so."""
    n = engine_count(sampler)
    if n <= 1:
        return command
    port = int(sampler.port)
    inner = list(command.argv)
    if "--port" in inner:
        inner[inner.index("--port") + 1] = str(port + 1)
    share = f", each with --gpu-memory-utilization {float(memory_share) / n:g} (1/{n} of {float(memory_share):g})" \
        if memory_share is not None else ""
    note = (f"sampler.engines={n}: {n} servers on ports {port + 1}-{port + n}{share}, started one after another "
            f"behind one router at {sampler.host}:{port} (generation to the least busy, weight syncs to all)")
    argv = [sys.executable, "-m", "asyncgrpo_cli.server.router", "--host", str(sampler.host), "--port", str(port),
            "--engines", str(n), "--", *inner]
    return ServerCommand(argv, dict(command.env), [*command.notes, note], list(command.problems))


def server_exec_argv(command: ServerCommand) -> list[str]:
    """The argv to start (`resolve_vllm_program`: ``vllm`` becomes ``python -m
    vllm.entrypoints.cli.main`` when the script is not on PATH; the router resolves its engines' the same way).

    Raises:
        ConfigError: vLLM is needed and not installed (the message says how to install it or avoid it).
    """
    if command.argv[:1] == ["vllm"]:
        return resolve_vllm_program(command.argv)
    if "asyncgrpo_cli.server.router" in command.argv[:3] and "--" in command.argv:
        cut = command.argv.index("--") + 1
        resolve_vllm_program(command.argv[cut:])  # refuse here, before the router starts, when vLLM is missing
    return list(command.argv)


def resolve_vllm_program(argv: list[str]) -> list[str]:
    """``argv`` with a leading ``vllm`` made ``python -m vllm.entrypoints.cli.main`` when the ``vllm`` script is
    not on PATH but the package is importable (a venv used without activating it).

    Raises:
        ConfigError: the ``vllm`` program is needed and vLLM is not installed (the message says how to install it
            or avoid it).
    """
    import importlib.util
    import shutil

    from ..config.rules import ConfigError

    argv = list(argv)
    if argv and argv[0] == "vllm" and shutil.which("vllm") is None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("sampler.backend=vllm: vLLM is not installed. Fix: pip install 'asyncgrpo[vllm]' on a "
                              "CUDA machine, or use sampler.backend=embedded (CPU or one GPU)")
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv[1:]]
    return argv


def server_gpus(launch: Any, sampler: Any) -> list[int]:
    """GPUs of the server: ``launch.server_gpus``, else the first ``sampler.data_parallel_size`` GPUs
    (the first GPU by default)."""
    if launch.server_gpus is not None:
        return list(launch.server_gpus)
    return list(range(max(1, data_parallel_size(sampler))))


def build_server_command(vllm_version: str | None = None, *, layout: Layout, model: ModelConfig,
                         sampler: SamplerConfig, launch: LaunchConfig, rollout: RolloutConfig,
                         trainer: TrainerConfig, peft: PeftConfig, staleness: StalenessConfig,
                         use_installed: bool = True) -> ServerCommand:
    """The server command for a config's groups: vLLM's ``vllm serve`` or the embedded sampler's.

    Args:
        vllm_version: vLLM version the flags are for; None = the installed one (when ``use_installed``),
            else the newest supported release (said in ``notes``).
        layout: the `colocate.Layout` (`colocate.decide_layout`). Colocated, vLLM gets the shared GPU,
            its memory share (``--gpu-memory-utilization``), ``--weight-transfer-config
            '{"backend": "ipc"}'`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; otherwise the NCCL
            backend on ``launch.server_gpus``. Unused by the embedded sampler.
        model: ``name``, ``dtype``, ``trust_remote_code``, ``gguf_file``.
        sampler: ``backend``, ``host``, ``port``, ``max_model_len``, ``api_server_count``,
            ``data_parallel_size``, ``gpu_memory_utilization``, ``max_logprobs``, ``kv_cache_tokens``,
            ``device``, ``extra_args``, ``env``.
        launch: ``server_gpus``.
        rollout: ``num_sampler_logprobs`` and the filters (``top_k``, ``top_p``, ``min_p``: sampling masks).
        trainer: ``bf16``, ``fp16`` (`compute_dtype`).
        peft: ``enabled``, ``r`` (LoRA flags).
        staleness: ``max_staleness`` (``--max-loras``).
        use_installed: look at the installed vLLM (its version, its CUDA-IPC engine).

    Raises:
        ConfigError: when the config lacks what the server needs (``model.name``) or a LoRA rank is invalid.
    """
    from ..config.rules import ConfigError

    if not model.name:
        raise ConfigError("model.name=None: the server needs a model. Fix: add +recipe=NAME or model.name=HUB_ID_OR_DIR")
    if sampler.backend.value == "embedded":
        return _embedded_command(model=model, sampler=sampler, launch=launch, rollout=rollout, trainer=trainer,
                                 peft=peft, staleness=staleness)
    notes: list[str] = []
    if vllm_version is None and use_installed:
        vllm_version = installed_vllm_version()
    if vllm_version is None:
        notes.append(f"vLLM is not installed here: flags for vLLM {NEWEST_SUPPORTED_VLLM} (newest supported)")
    elif parse_version(vllm_version) < MIN_VLLM:
        notes.append(f"vLLM {vllm_version} is older than the supported 0.26: upgrade with pip install 'vllm>=0.26'")
    version = vllm_version or NEWEST_SUPPORTED_VLLM

    problems: list[str] = []
    gpus = server_gpus(launch, sampler)
    transfer = "nccl"
    memory_share = sampler.gpu_memory_utilization
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if layout.colocated:
        gpus, transfer = [layout.gpu], "ipc"
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # pickled CUDA-IPC handles; loopback only
        notes.append(f"colocated on GPU {layout.gpu}: {layout.reason}")
        if layout.memory is not None:
            memory_share = layout.memory.gpu_memory_utilization
            notes.append(f"memory split: {layout.memory.describe()}; {layout.memory.reason}")
            notes.extend(layout.memory.notes)
        problems.extend(layout.problems)
        ipc = vllm_ipc_problem(version, installed_vllm_version()) if use_installed else None
        if ipc:
            problems.append(ipc)
    dp = data_parallel_size(sampler)
    if dp < 1:
        problems.append(f"sampler.data_parallel_size={dp}: must be >= 1 vLLM engine. Fix: sampler.data_parallel_size=1")
    elif dp > 1 and layout.colocated:
        problems.append(f"sampler.data_parallel_size={dp} with the colocated layout: vLLM shares one GPU with the "
                        "trainer there. Fix: launch.colocate=false with separate GPUs, or sampler.data_parallel_size=1")
    elif dp > len(gpus):
        problems.append(f"sampler.data_parallel_size={dp} needs {dp} GPUs (one per engine) but launch.server_gpus="
                        f"{gpus}. Fix: launch.server_gpus=[{','.join(str(g) for g in range(dp))}], or leave "
                        "launch.server_gpus unset (the server then takes the first sampler.data_parallel_size GPUs)")
    env = {"CUDA_VISIBLE_DEVICES": visible_ids(gpus), **env}
    argv = ["vllm", "serve", str(model.name), "--host", str(sampler.host), "--port", str(sampler.port),
            "--weight-transfer-config", json.dumps({"backend": transfer}),
            "--logprobs-mode", "processed_logprobs",
            "--api-server-count", str(api_server_count(sampler, peft))]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if sampler.max_model_len is not None:
        argv += ["--max-model-len", str(sampler.max_model_len)]
    argv += ["--max-logprobs", str(max_logprobs(sampler, rollout)),
             "--dtype", compute_dtype(trainer, model)]
    if memory_share is not None:
        argv += ["--gpu-memory-utilization", f"{float(memory_share) / engine_count(sampler):g}"]
    if model.trust_remote_code:
        argv += ["--trust-remote-code"]
    if uses_candidate_sets(rollout):
        if vllm_has_flag("--return-sampling-mask", version):
            argv += ["--return-sampling-mask"]
            if vllm_has_flag("--enable-scale-out", version):
                argv += ["--enable-scale-out"]
        else:
            notes.append(f"vLLM {version} cannot return sampling masks (needs >= 0.28): the trainer normalises over "
                         "the full vocabulary and its importance ratios are biased (README: Sampling filters)")
    if peft.enabled:
        rank, loras = lora_limits(peft, staleness)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(loras)]
        if sampler.api_server_count != 1:
            notes.append("runtime LoRA updating needs --api-server-count 1 (vLLM refuses more)")
    env.update({str(k): str(v) for k, v in sampler.env.items()})
    argv += [str(a) for a in sampler.extra_args]
    problems.extend(engines_problems(sampler, colocated=layout.colocated, vllm=True))
    return behind_router(ServerCommand(argv, env, notes, problems), sampler, memory_share)


def server_command_here(cfg: Any, vllm_version: str | None = None, backend: str | None = None) -> ServerCommand:
    """The server command a composed config gets on this machine: `colocate.decide_layout` for the visible
    GPUs, then `build_server_command` with the groups each reads. It takes the whole composed config because it
    is the entry point of ``asyncgrpo serve`` and of doctor's restart line, which hold nothing else.

    ``sampler.backend=external`` starts nothing, so the server to start for it is ``backend`` when given (doctor:
    the kind that answers at the URL), else `server_for_external`'s; a note says which and why.

    Raises:
        ConfigError: from `build_server_command` (``model.name`` unset, an invalid LoRA rank).
    """
    from .colocate import decide_layout, visible_gpu_count

    n = visible_gpu_count()
    note = None
    if getattr(cfg.sampler.backend, "value", cfg.sampler.backend) == "external":
        cfg, note = server_for_external(cfg, backend, gpu_count=n)
    layout = decide_layout(n, launch=cfg.launch, sampler=cfg.sampler, model=cfg.model,
                           trainer=cfg.trainer, packing=cfg.packing, staleness=cfg.staleness, peft=cfg.peft,
                           loss=cfg.loss)
    command = build_server_command(vllm_version, layout=layout, model=cfg.model, sampler=cfg.sampler,
                                   launch=cfg.launch, rollout=cfg.rollout, trainer=cfg.trainer, peft=cfg.peft,
                                   staleness=cfg.staleness)
    if note:
        command.notes.insert(0, note)
    return command


def server_for_external(cfg: Any, backend: str | None = None, *, gpu_count: int | None = None,
                        at_url: bool = False) -> tuple[Any, str]:
    """A copy of a ``sampler.backend=external`` config that starts the server it expects, and a note saying so.

    The kind is ``backend`` when given, else the embedded sampler where vLLM cannot run (``sampler.device=cpu``,
    or no CUDA GPU here) and vLLM elsewhere. With ``at_url`` (``asyncgrpo serve``), it listens on
    ``sampler.url``'s port, and on its host when that is a loopback address (never a public one: that stays
    ``sampler.host`` and ``sampler.allow_public``'s decision).
    """
    import copy
    from urllib.parse import urlsplit

    from ..config.compose import is_loopback
    from .colocate import visible_gpu_count

    n = visible_gpu_count() if gpu_count is None else gpu_count
    if backend is None:
        cpu = str(cfg.sampler.device) == "cpu"
        backend = "embedded" if cpu or n == 0 else "vllm"
        why = "sampler.device=cpu" if cpu else "no CUDA GPU here" if n == 0 else "a CUDA GPU is here"
    else:
        why = "the kind of server that answers at sampler.url"
    out = copy.deepcopy(cfg)
    out.sampler.backend = backend
    where = ""
    if at_url and cfg.sampler.url:
        parts = urlsplit(str(cfg.sampler.url))
        if parts.port:
            out.sampler.port = parts.port
        if parts.hostname and is_loopback(parts.hostname):
            out.sampler.host = parts.hostname
            where = f", listening where sampler.url points ({out.sampler.host}:{out.sampler.port})"
        else:
            where = (f", listening on sampler.url's port at sampler.host={out.sampler.host} (a public address "
                     "needs sampler.host and sampler.allow_public=true)")
    kind = "the embedded sampler" if backend == "embedded" else "vLLM"
    return out, f"sampler.backend=external starts no server; the one to start for this config is {kind} ({why}){where}"


def weights_dir_of(trainer: Any) -> Path:
    """The run's weights folder, ``<trainer.output_dir>/.weights`` (absolute): the only folder the embedded
    sampler reads weight files from (``--weights-dir``), where the trainer writes each sync's files."""
    from ..config.compose import DEFAULT_OUTPUT_DIR

    return Path(str(trainer.output_dir or DEFAULT_OUTPUT_DIR)).expanduser().resolve() / ".weights"


def _embedded_command(*, model: ModelConfig, sampler: SamplerConfig, launch: LaunchConfig, rollout: RolloutConfig,
                      trainer: TrainerConfig, peft: PeftConfig, staleness: StalenessConfig) -> ServerCommand:
    """The embedded sampler's command line: the same settings as vLLM's, under our own module."""
    device = sampler.device
    env: dict[str, str] = {}
    if device.startswith("cuda") or device == "auto":
        env["CUDA_VISIBLE_DEVICES"] = visible_ids(server_gpus(launch, sampler))
    argv = [sys.executable, "-m", "asyncgrpo_cli.sampler.embedded", "--model", str(model.name),
            "--host", str(sampler.host), "--port", str(sampler.port),
            "--max-logprobs", str(max_logprobs(sampler, rollout)),
            "--dtype", compute_dtype(trainer, model),
            "--device", "cuda" if device.startswith("cuda") else device]
    if model.gguf_file:
        argv += ["--gguf-file", str(model.gguf_file)]
    if sampler.max_model_len is not None:
        argv += ["--max-model-len", str(sampler.max_model_len)]
    if sampler.kv_cache_tokens is not None:
        argv += ["--kv-cache-tokens", str(sampler.kv_cache_tokens)]
    argv += ["--weights-dir", str(weights_dir_of(trainer))]
    if peft.enabled:
        rank, loras = lora_limits(peft, staleness)
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(loras)]
    env.update({str(k): str(v) for k, v in sampler.env.items()})
    argv += [str(a) for a in sampler.extra_args]
    problems = engines_problems(sampler, colocated=True, vllm=False)
    return behind_router(ServerCommand(argv, env, [], problems), sampler, None)
