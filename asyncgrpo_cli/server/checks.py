"""`asyncgrpo doctor`: compare a running server with what the config needs (DESIGN.md §4, SPEC §7–§9).

`evaluate(facts, ...)` is pure: it turns what was read from the server (`ServerFacts`) into a list of
`Check`s, each pass / warn / fail with a message and a fix; `read_facts` reads them over HTTP, and
`restart_command` is the complete command from the one builder that `asyncgrpo serve` uses. The trainer
runs these checks at start (`train.server_checks`), the supervisor before it starts the trainer, and
`asyncgrpo doctor` prints them (`doctor.report.run_doctor`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from ..config.citations import cite_shipped
from ..config.rules import ALLOWED_LORA_RANKS
from ..sampler.protocol import vllm_config_of
from .sampling_mask import sampling_mask_verdict, scale_out_answer
from .command import (
    MIN_VLLM,
    compute_dtype,
    lora_limits,
    parse_version,
    server_command_here,
    uses_candidate_sets,
)

if TYPE_CHECKING:
    from ..config.schema import (LaunchConfig, ModelConfig, PeftConfig, RolloutConfig, SamplerConfig,
                                 StalenessConfig, TrainerConfig)

PASS, WARN, FAIL = "pass", "warn", "fail"
SKIP = "skip"  # the check does not apply here (its message says why)
NEWEST_TESTED_VLLM = (0, 33)
RAN_ON_GPU_VLLM = {(0, 26), (0, 33)}  # releases run on the lent H200s (scripts/gpu/results)
TOP_LOGPROBS_CHEAP_VLLM = (0, 32)  # SPEC §8.2's cheaper serialisation from 0.32 (measured on 0.33: 37% at 8 servers, 80% at 1)
MIN_TRANSFORMERS = (5, 2)


@dataclass
class Check:
    """One doctor check: ``status`` is pass / warn / fail / skip (does not apply here, the message says why);
    ``fix`` says what to change (empty on pass and skip)."""

    name: str
    status: str
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        self.message, self.fix = cite_shipped(self.message), cite_shipped(self.fix)


@dataclass
class ServerFacts:
    """What was read from the server. ``None`` means the route did not answer (or is absent)."""

    url: str
    reachable: bool
    error: str | None = None
    version: dict[str, Any] | None = None
    models: dict[str, Any] | None = None
    server_info: dict[str, Any] | None = None  # /server_info's engine config (vLLM's ``vllm_config``)
    server_env: dict[str, Any] | None = None   # /server_info's ``vllm_env`` (the server's VLLM_* variables)
    metrics_ok: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def embedded(self) -> bool:
        return (self.version or {}).get("server") == "asyncgrpo-embedded"

    @property
    def vllm_version(self) -> tuple[int, ...] | None:
        if self.embedded or not self.version or "version" not in self.version:
            return None
        return parse_version(str(self.version["version"]))


def _dig(data: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _precision_flags(dtype: str) -> str:
    """The trainer settings whose compute dtype (CONFIG.md) is ``dtype``."""
    if dtype == "bfloat16":
        return "trainer.bf16=true; Python API: AsyncGRPOConfig(bf16=True)"
    if dtype == "float16":
        return "trainer.bf16=false trainer.fp16=true; Python API: bf16=False, fp16=True"
    return (f"trainer.bf16=false trainer.fp16=false model.dtype={dtype}; Python API: bf16=False, fp16=False, "
            f"dtype={dtype!r}")


def evaluate(facts: ServerFacts, colocated: bool | None = None, gpu_count: int | None = None, *,
             model: ModelConfig, rollout: RolloutConfig, sampler: SamplerConfig, staleness: StalenessConfig,
             trainer: TrainerConfig, peft: PeftConfig, launch: LaunchConfig) -> list[Check]:
    """All checks of a config's groups against ``facts`` (no I/O but the installed versions). See the module
    docstring.

    Args:
        facts: what was read from the server (`read_facts`).
        colocated: whether the trainer shares the server's GPU (`server.colocate.decide_layout`): the
            server's weight transfer must then be ``ipc``, else ``nccl``; None = either is accepted.
        gpu_count: the GPUs this machine sees (None = ask torch); with none the GPU split is skipped.
        model: ``name``, ``dtype`` (served model, compute dtype).
        rollout: ``max_completion_length``, ``num_sampler_logprobs``, the filters and
            ``sampling_mask_fallback``.
        sampler: ``max_model_len``, ``backend``.
        staleness: ``max_concurrent_rollouts``, ``max_staleness`` (LoRA slots).
        trainer: ``bf16``, ``fp16`` (compute dtype).
        peft: ``enabled``, ``r``.
        launch: ``server_gpus``, ``trainer_gpus``, ``colocate`` (the GPU split).

    Returns:
        The checks, in order; nothing is raised (a failed check carries its fix).
    """
    checks: list[Check] = []
    add = checks.append
    if not facts.reachable:
        named = bool(model is not None and (model.get("name") if hasattr(model, "get") else getattr(model, "name", None)))
        start = ("start it with `asyncgrpo serve` (same overrides)" if named else  # bare `serve` refuses: no model
                 "start one with `asyncgrpo serve +recipe=NAME` (`asyncgrpo recipes` lists them; +recipe=smoke runs on "
                 "a CPU) and check it with `asyncgrpo doctor +recipe=NAME`")
        add(Check("server reachable", FAIL, f"no answer from {facts.url}: {facts.error}",
                  f"{start}, or set sampler.url to where it runs"))
        checks.extend(_local_checks(gpu_count, launch=launch, sampler=sampler))
        return checks
    kind = "asyncgrpo embedded sampler" if facts.embedded else f"vLLM {(facts.version or {}).get('version', '?')}"
    add(Check("server reachable", PASS, f"{kind} at {facts.url}"))

    # Model name and length limit (/v1/models).
    models = (facts.models or {}).get("data") or []
    names = {m.get("id") for m in models} | {m.get("root") for m in models}
    want = str(model.name) if model.name else None
    if want is None:
        add(Check("model", WARN, "model.name is not set; cannot compare", "add +recipe=NAME or model.name=..."))
    elif want in names:
        add(Check("model", PASS, f"serves {want}"))
    else:
        add(Check("model", FAIL, f"serves {sorted(n for n in names if n)} but the config trains {want}",
                  "restart the server with the config's model"))
    server_len = next((m.get("max_model_len") for m in models if m.get("id") in (want, None) or m.get("root") == want),
                      None) or _dig(facts.server_info, "model_config", "max_model_len")
    completion = rollout.max_completion_length
    if server_len is None:
        add(Check("max_model_len", WARN, "the server does not report max_model_len", ""))
    elif completion >= server_len:
        add(Check("max_model_len", FAIL, f"server max_model_len {server_len} leaves no room for a prompt with "
                  f"rollout.max_completion_length={completion}",
                  f"restart with a larger sampler.max_model_len (prompt + {completion}), or lower "
                  "rollout.max_completion_length"))
    elif sampler.max_model_len is not None and server_len != sampler.max_model_len:
        add(Check("max_model_len", FAIL, f"server max_model_len {server_len} != sampler.max_model_len "
                  f"{sampler.max_model_len} (it is also the default token budget and the cap's unit)",
                  "restart the server with the config's --max-model-len"))
    else:
        add(Check("max_model_len", PASS, f"{server_len} tokens: prompts up to {server_len - completion} tokens "
                  f"with rollout.max_completion_length={completion}"))

    info = facts.server_info
    if info is None:
        add(Check("dev mode", FAIL, "/server_info is not served: the weight-transfer routes are off",
                  "restart with VLLM_SERVER_DEV_MODE=1 (and --weight-transfer-config)"))
    else:
        add(Check("dev mode", PASS, "development routes are on (keep the server on a private address)"))
        _server_info_checks(facts, info, add, colocated, rollout=rollout, trainer=trainer, model=model, peft=peft,
                            staleness=staleness)
    if not facts.metrics_ok:
        add(Check("/metrics", WARN, "no Prometheus metrics: the adaptive concurrency cap falls back to "
                  f"staleness.max_concurrent_rollouts={staleness.max_concurrent_rollouts}", ""))
    else:
        add(Check("/metrics", PASS, "KV-cache usage and queue depth readable"))
    _engine_checks(facts, sampler, add)
    checks.extend(_version_checks(facts))
    checks.extend(_local_checks(gpu_count, launch=launch, sampler=sampler))
    return checks


def _engine_checks(facts: ServerFacts, sampler: SamplerConfig, add) -> None:
    """``sampler.engines``: the servers behind the router (`server.router`'s ``/router``) against the config."""
    router = facts.extra.get("router")
    want = int(sampler.get("engines", 1) if hasattr(sampler, "get") else getattr(sampler, "engines", 1))
    have = int(router.get("engines", 0)) if isinstance(router, dict) and "engines" in router else None
    if have is None and want <= 1:
        return
    if have is None:
        add(Check("engines", WARN, f"sampler.engines={want}, but {facts.url} is one server (no /router)",
                  f"restart it with `asyncgrpo serve` and sampler.engines={want}, or set sampler.engines=1"))
    elif have != want:
        add(Check("engines", WARN, f"{have} servers behind the router at {facts.url}, sampler.engines={want}",
                  f"restart it with `asyncgrpo serve` and sampler.engines={want}, or set sampler.engines={have}"))
    else:
        add(Check("engines", PASS, f"{have} servers behind the router (ports {router.get('ports')})"))


def _server_info_checks(facts: ServerFacts, info: dict[str, Any], add, colocated: bool | None = None, *,
                        rollout: RolloutConfig, trainer: TrainerConfig, model: ModelConfig, peft: PeftConfig,
                        staleness: StalenessConfig) -> None:
    mode = _dig(info, "model_config", "logprobs_mode")
    if mode == "processed_logprobs":
        add(Check("logprobs mode", PASS, "processed_logprobs (after temperature and filtering)"))
    else:
        add(Check("logprobs mode", FAIL, f"logprobs mode is {mode!r}: importance ratios would compare different "
                  "distributions (README: Log-probabilities and the loss)", "restart with --logprobs-mode processed_logprobs"))
    max_lp = _dig(info, "model_config", "max_logprobs")
    need = rollout.num_sampler_logprobs
    if max_lp is None:
        add(Check("max logprobs", WARN, "server does not report max_logprobs", ""))
    elif max_lp != -1 and max_lp < need:
        add(Check("max logprobs", FAIL, f"--max-logprobs {max_lp} < rollout.num_sampler_logprobs={need}: every "
                  "request would be refused", f"restart with --max-logprobs {need}"))
    else:
        add(Check("max logprobs", PASS, f"{max_lp} >= {need}"))
    backend = _dig(info, "weight_transfer_config", "backend")
    if facts.embedded:
        add(Check("weight transfer", PASS, "embedded safetensors-path updates"))
    elif backend == "ipc" or colocated:
        _ipc_checks(facts, backend, colocated, add)
    elif backend in ("nccl", "sparse_nccl"):
        add(Check("weight transfer", PASS, f"backend {backend}"))
    else:
        add(Check("weight transfer", FAIL, f"weight transfer backend is {backend!r}",
                  "restart with --weight-transfer-config '{\"backend\": \"nccl\"}'"))
    verdict = sampling_mask_verdict(uses_candidate_sets(rollout), info, facts.version,
                                    fallback=bool(rollout.get("sampling_mask_fallback", False)),
                                    scale_out=facts.extra.get("scale_out"))
    if verdict is not None:
        add(Check("sampling mask", verdict.status, verdict.message, verdict.fix))
    dtype, want = str(_dig(info, "model_config", "dtype") or ""), compute_dtype(trainer, model)
    dtype = dtype.replace("torch.", "")
    if not dtype:
        add(Check("dtype", WARN, "server does not report its dtype", ""))
    elif dtype != want:
        add(Check("dtype", WARN, f"server runs {dtype}, the trainer computes in {want}: a training/inference "
                  "mismatch shows in sampling/sampling_logp_difference (SPEC §8.1)",
                  f"restart the server with --dtype {want} (`asyncgrpo serve` with the trainer's settings passes it), "
                  f"or make the trainer compute in {dtype} ({_precision_flags(dtype)})"))
    else:
        add(Check("dtype", PASS, f"{dtype} on both sides"))
    count = _dig(info, "parallel_config", "_api_process_count") or info.get("api_server_count")
    if peft.enabled:
        _lora_checks(facts, info, count, add, peft=peft, staleness=staleness)
    elif need > 0 and not facts.embedded:
        version = facts.vllm_version
        old = version is not None and version < TOP_LOGPROBS_CHEAP_VLLM
        if old or (count is not None and count < 8):
            servers = f"{count} API server(s)" if count is not None else "API servers"
            add(Check("api servers", WARN, f"{servers} on vLLM {(facts.version or {}).get('version')}: "
                      f"top-{need} log-probs are serialised on the CPU of the API servers: on vLLM 0.33 (one H200, "
                      "Qwen3-0.6B shape, 256 requests in flight) top-8 cost 80% of generation throughput with 1 API "
                      "server and 37% with 8 (README: GPUs, weight sync and LoRA)",
                      "use --api-server-count 8 and vLLM >= 0.32 where you can"))
        elif count is not None:
            add(Check("api servers", PASS, f"{count} API servers"))


def _ipc_checks(facts: ServerFacts, backend: Any, colocated: bool | None, add) -> None:
    """The colocated layout (one GPU, CUDA-IPC weight sync): backend, insecure-serialization switch, loopback."""
    if backend != "ipc":
        add(Check("weight transfer", FAIL, f"the trainer shares the server's GPU (colocated) but the server's weight "
                  f"transfer backend is {backend!r}", "restart with --weight-transfer-config '{\"backend\": \"ipc\"}' "
                  "and VLLM_ALLOW_INSECURE_SERIALIZATION=1 (asyncgrpo serve does it on one GPU), or launch.colocate=false "
                  "with separate GPUs"))
        return
    if colocated is False:
        add(Check("weight transfer", FAIL, "the server uses the ipc backend (CUDA IPC: same GPU only) but the trainer "
                  "runs on other GPUs", "restart with --weight-transfer-config '{\"backend\": \"nccl\"}', or "
                  "launch.colocate=true to share the server's GPU"))
        return
    add(Check("weight transfer", PASS, "backend ipc (CUDA IPC: the trainer must run on the server's GPU)"))
    env = facts.server_env
    flag = None if env is None else str(env.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "")).lower()
    if flag is None:
        add(Check("ipc handles", WARN, "the server does not report VLLM_ALLOW_INSECURE_SERIALIZATION; without it "
                  "every /update_weights with pickled IPC handles is refused", ""))
    elif flag not in ("1", "true"):
        add(Check("ipc handles", FAIL, "VLLM_ALLOW_INSECURE_SERIALIZATION is off: the server refuses the pickled "
                  "CUDA-IPC handles of every weight sync", "restart with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (server "
                  "on 127.0.0.1 only)"))
    else:
        host = (facts.url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]).strip("[]")
        if host in ("127.0.0.1", "localhost", "::1"):
            add(Check("ipc handles", PASS, "pickled CUDA-IPC handles accepted, on loopback"))
        else:
            add(Check("ipc handles", WARN, f"the server unpickles requests (VLLM_ALLOW_INSECURE_SERIALIZATION=1) and is "
                      f"reached at {host}: whoever reaches it can run code there", "bind it to 127.0.0.1"))


def _lora_checks(facts: ServerFacts, info: dict[str, Any], count: Any, add, *, peft: PeftConfig,
                 staleness: StalenessConfig) -> None:
    rank_needed, loras_needed = lora_limits(peft, staleness)
    lora = info.get("lora_config")
    if not lora:
        add(Check("lora", FAIL, f"peft.enabled=true (r={peft.r}) but the server was started without LoRA",
                  f"restart with --enable-lora --max-lora-rank {rank_needed} --max-loras {loras_needed} and "
                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or use merged sync: peft stays on, the server serves merged "
                  "weights)"))
        return
    env = facts.server_env or {}
    runtime = str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() in ("1", "true")
    if not runtime and not facts.embedded:
        add(Check("lora runtime updating", FAIL, "VLLM_ALLOW_RUNTIME_LORA_UPDATING is off: adapters cannot be loaded",
                  "restart with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"))
    else:
        add(Check("lora runtime updating", PASS, "on"))
    rank = lora.get("max_lora_rank")
    if rank not in ALLOWED_LORA_RANKS or rank < peft.r:
        add(Check("lora rank", FAIL, f"--max-lora-rank {rank} cannot serve peft.r={peft.r}",
                  f"restart with --max-lora-rank {rank_needed}"))
    else:
        add(Check("lora rank", PASS, f"max {rank} >= r {peft.r}"))
    loras = lora.get("max_loras") or 0
    if loras < loras_needed:
        add(Check("lora slots", FAIL, f"--max-loras {loras} < staleness.max_staleness + 2 = {loras_needed} "
                  "(max_staleness + 1 versions stay loaded, and the next loads before the oldest unloads, README: GPUs, weight sync and LoRA)",
                  f"restart with --max-loras {loras_needed}"))
    else:
        add(Check("lora slots", PASS, f"{loras} >= {loras_needed}"))
    if count is not None and count != 1 and not facts.embedded:
        add(Check("lora api servers", FAIL, f"--api-server-count {count}: vLLM refuses runtime LoRA updates with "
                  "more than one API server", "restart with --api-server-count 1"))


def _version_checks(facts: ServerFacts) -> list[Check]:
    version = facts.vllm_version
    if version is None:
        return []
    text = ".".join(map(str, version))
    if version < MIN_VLLM:
        return [Check("vLLM version", FAIL, f"vLLM {text} is older than the supported 0.26",
                      "pip install 'vllm>=0.26' on the server machine")]
    if version[:2] > NEWEST_TESTED_VLLM:
        return [Check("vLLM version", WARN, f"vLLM {text} is newer than the newest tested (0.33)", "")]
    if version[:2] not in RAN_ON_GPU_VLLM:
        ran = " and ".join(f"{a}.{b}" for a, b in sorted(RAN_ON_GPU_VLLM))
        return [Check("vLLM version", WARN, f"vLLM {text} is untested: only {ran} have run on a GPU with asyncgrpo "
                      "(README: GPUs, weight sync and LoRA)", "pip install 'vllm==0.33.0' (or 0.26.0) on the server machine")]
    return [Check("vLLM version", PASS, f"{text} (run on an H200: scripts/gpu/results)")]


def _local_checks(gpu_count: int | None = None, *, launch: LaunchConfig, sampler: SamplerConfig) -> list[Check]:
    checks = []
    try:
        tv = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        tv = "0"
    if parse_version(tv) < MIN_TRANSFORMERS:
        checks.append(Check("transformers", FAIL, f"transformers {tv} < 5.2", "pip install 'transformers>=5.2'"))
    else:
        checks.append(Check("transformers", PASS, tv))
    server, trainer = launch.server_gpus, launch.trainer_gpus
    if gpu_count is None:
        from .colocate import visible_gpu_count

        gpu_count = visible_gpu_count()
    if gpu_count == 0:
        checks.append(Check("GPU split", SKIP, "not applicable: no CUDA GPU visible here, nothing to split "
                            "(launch.server_gpus / launch.trainer_gpus apply on a GPU machine)"))
    elif server is not None and trainer is not None and set(server) & set(trainer) and not launch.get("colocate"):
        status = WARN if sampler.backend.value == "embedded" else FAIL
        checks.append(Check("GPU split", status, f"server GPUs {list(server)} and trainer GPUs {list(trainer)} overlap",
                            "give the server and the trainer different GPUs (launch.server_gpus / launch.trainer_gpus)"))
    else:
        checks.append(Check("GPU split", PASS, "server and trainer GPUs are disjoint (or unset: first GPU for the "
                            "server, the rest for the trainer)"))
    return checks


def restart_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``sampler.host``/``sampler.port`` taken from ``sampler.url`` when it is set, so a restart
    line brings the server back where the config looks for it, and without ``--no-return-sampling-mask``
    when the config filters (a copy; ``cfg`` is not changed)."""
    from urllib.parse import urlsplit

    from omegaconf import OmegaConf

    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    if uses_candidate_sets(cfg.rollout) and "--no-return-sampling-mask" in list(out.sampler.extra_args):
        out.sampler.extra_args = [a for a in out.sampler.extra_args if a != "--no-return-sampling-mask"]
    elif not cfg.sampler.url:
        return cfg
    parts = urlsplit(str(cfg.sampler.url or ""))
    if parts.hostname:
        out.sampler.host = parts.hostname
    if parts.port:
        out.sampler.port = parts.port
    elif parts.scheme in ("http", "https"):
        out.sampler.port = 443 if parts.scheme == "https" else 80
    from ..config.schema import AppConfig

    return OmegaConf.merge(OmegaConf.structured(AppConfig), out)


def restart_command(cfg: DictConfig, facts: ServerFacts):
    """The `ServerCommand` that starts a server matching ``cfg`` at the address the config uses
    (`restart_config`), for the vLLM version ``facts`` reports, on this machine's layout. It takes the
    whole config because `restart_config` rebuilds it (sampler address, flags) before the groups go to
    `command.server_command_here`.

    Raises:
        ConfigError: from `command.server_command_here` (``model.name`` unset, an invalid LoRA rank).
    """
    version = (facts.version or {}).get("version") if not facts.embedded else None
    kind = "embedded" if facts.embedded else "vllm" if facts.reachable else None  # sampler.backend=external
    return server_command_here(restart_config(cfg), version, backend=kind)


def read_facts(url: str, timeout: float) -> ServerFacts:
    """Read health, version, models, server info and metrics from ``url`` (each route once, ``timeout`` s)."""
    import httpx

    from ..sampler.prometheus import parse_server_load

    facts = ServerFacts(url=url, reachable=False)
    try:
        with httpx.Client(base_url=url, timeout=timeout) as http:
            health = http.get("/health")
            health.raise_for_status()
            facts.reachable = True

            def get_json(route: str) -> dict[str, Any] | None:
                resp = http.get(route)
                if resp.status_code >= 400:
                    return None
                try:
                    return resp.json()
                except ValueError:
                    return None

            facts.version = get_json("/version")
            facts.models = get_json("/v1/models")
            answer = get_json("/server_info?config_format=json")
            facts.server_info = vllm_config_of(answer)
            facts.server_env = answer.get("vllm_env") if isinstance(answer, dict) else None
            metrics = http.get("/metrics")
            facts.metrics_ok = metrics.status_code == 200 and parse_server_load(metrics.text) is not None
            facts.extra["router"] = get_json("/router")  # sampler.engines > 1: the router in front of them
            if not facts.embedded:
                facts.extra["scale_out"] = scale_out_answer(http.post("/inference/v1/generate", json={}).status_code)
    except httpx.HTTPError as exc:
        facts.error = f"{type(exc).__name__}: {exc}"
    return facts


def _expected_colocation(*, launch: LaunchConfig, sampler: SamplerConfig) -> bool | None:
    """`server.colocate.expected_colocation` on this machine (its visible GPUs)."""
    from .colocate import expected_colocation
    from .colocate import visible_gpu_count

    return expected_colocation(visible_gpu_count(), launch=launch, sampler=sampler)
