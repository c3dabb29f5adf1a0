"""The launch plan of `asyncgrpo train`: which GPUs go to the server and the trainer, and the trainer's
``accelerate launch`` command and config (DESIGN.md §2, §7; SPEC §8.4).

Everything here is pure (no process, no file write): `plan_gpus` takes the GPU count as an argument
(`visible_gpu_count` reads it), `accelerate_config` returns a dict the supervisor writes as YAML, and
`build_launch_plan` gathers the commands the supervisor prints and starts.

GPU rules (DESIGN.md §2):

- the server gets ``launch.server_gpus`` (default: GPU 0, or the first ``sampler.data_parallel_size``) when it runs on a GPU: always for vLLM, for
  the embedded sampler when ``sampler.device`` is ``cuda*`` (or ``auto`` with a GPU visible);
- the trainer gets ``launch.trainer_gpus`` (default: every visible GPU the server does not hold, whether
  the supervisor starts the server or it already runs there, e.g. from `asyncgrpo serve`; on every
  machine of a multi-node job alike, so all machines run the same number of processes), one process
  per GPU; no GPU → the trainer runs on CPU with ``launch.cpu_processes`` processes (gloo);
- vLLM and the trainer use different GPUs (NCCL weight transfer, SPEC §8.4) unless the layout is
  colocated (`colocate.decide_layout`: ``launch.colocate=true``, or automatically with one visible
  GPU): then vLLM and a single trainer process share that GPU, vLLM with its memory share, and
  weights go over CUDA IPC; the embedded sampler may always share: with one GPU it shares it with
  the trainer.

Accelerate config (accelerate 1.15 keys): ``distributed_type: FSDP`` with ``fsdp_config.fsdp_version: 2``,
transformer-layer auto wrap (the model's ``_no_split_modules``) and ``SHARDED_STATE_DICT`` when more
than one process runs in total; ``NO`` for a single process. ``mixed_precision`` follows the trainer's
compute dtype (``bf16`` / ``fp16`` / ``no``). CPU runs set ``use_cpu: true`` and the environment variable
``ACCELERATE_USE_CPU=true`` (accelerate's torchrun path does not pass ``use_cpu`` on to the ranks, and
without it 2 CPU ranks would each run alone instead of forming a gloo group).
"""

from __future__ import annotations

import copy
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ..config.compose import DEFAULT_OUTPUT_DIR, server_url  # noqa: F401  (DEFAULT_OUTPUT_DIR: re-exported)
from ..server.colocate import Layout, decide_layout, visible_gpu_count, visible_ids  # noqa: F401  (re-exported)
from .mps import PRIORITY_ENV, MpsPlan, plan_mps, plan_mps_auto
from ..server.command import ServerCommand, build_server_command, compute_dtype, data_parallel_size

TRAINER_MODULE = "asyncgrpo_cli.train.main"
CONFIG_NAME = "asyncgrpo_config.yaml"
ACCELERATE_CONFIG_NAME = "accelerate_config.yaml"

if TYPE_CHECKING:
    from ..config.schema import LaunchConfig, LossConfig, ModelConfig, PeftConfig, SamplerConfig, TrainerConfig


def _backend(sampler: SamplerConfig) -> str:
    b = sampler.backend
    return b.value if hasattr(b, "value") else str(b)


def server_uses_gpu(gpu_count: int, *, sampler: SamplerConfig) -> bool:
    """Whether a server started by `asyncgrpo train` runs on a GPU: vLLM always; the embedded sampler with
    ``sampler.device`` ``cuda*``, or ``auto`` when ``gpu_count`` > 0; an external server never (locally)."""
    backend = _backend(sampler)
    if backend == "vllm":
        return True
    if backend == "embedded":
        device = str(sampler.device)
        return device.startswith("cuda") or (device == "auto" and gpu_count > 0)
    return False


@dataclass
class GpuPlan:
    """Who gets which GPU on this machine.

    Attributes:
        gpu_count: CUDA GPUs visible here.
        server_gpus: GPUs of the server started here ([] = no server here, or a CPU server).
        trainer_gpus: GPUs of the trainer, one process each ([] = the trainer runs on CPU).
        processes_per_machine: trainer processes on this machine.
        num_machines: machines of the trainer (``launch.num_machines``).
        machine_rank: this machine's rank (``launch.machine_rank``).
        notes: remarks printed with the plan.
        unused: settings the user chose that this plan leaves without effect, each a sentence naming the key
            (printed with the plan's notes, and by ``config --check``, which prints no plan).
        problems: reasons the plan cannot run here (each names the setting and the fix); empty = runnable.
        layout: the colocation decision and memory split (`colocate.Layout`).
    """

    gpu_count: int
    server_gpus: list[int]
    trainer_gpus: list[int]
    processes_per_machine: int
    num_machines: int = 1
    machine_rank: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    layout: Layout = field(default_factory=lambda: Layout(False, ""))

    @property
    def colocated(self) -> bool:
        """vLLM and the trainer share one GPU (CUDA-IPC weight sync)."""
        return self.layout.colocated

    @property
    def use_cpu(self) -> bool:
        """The trainer runs on CPU (no trainer GPU)."""
        return not self.trainer_gpus

    @property
    def num_processes(self) -> int:
        """Trainer processes over all machines (accelerate's ``num_processes``)."""
        return self.processes_per_machine * self.num_machines

    def describe(self) -> str:
        """One line: ``server: GPU 0 | trainer: GPUs 1,2 (2 processes, FSDP2)``."""
        def gpus(ids: list[int]) -> str:
            return ("GPU " if len(ids) == 1 else "GPUs ") + ",".join(map(str, ids))

        server = gpus(self.server_gpus) if self.server_gpus else "no GPU"
        if self.colocated:
            server += " (shared with the trainer, CUDA-IPC weight sync)"
        if self.use_cpu:
            trainer = f"CPU ({self.processes_per_machine} process{'es' if self.processes_per_machine > 1 else ''})"
        else:
            trainer = f"{gpus(self.trainer_gpus)} ({self.processes_per_machine} process" \
                      f"{'es' if self.processes_per_machine > 1 else ''})"
        if self.num_machines > 1:
            trainer += f" x {self.num_machines} machines (this is machine {self.machine_rank})"
        kind = "FSDP2" if self.num_processes > 1 else "single process"
        return f"{self.gpu_count} GPU(s) visible | server: {server} | trainer: {trainer}, {kind}"


def reference_notes(*, loss: LossConfig, peft: PeftConfig, model: ModelConfig) -> list[str]:
    """The plan's line on the KL reference (``loss.beta`` > 0, README: Loss variants): with full fine-tuning a
    frozen copy of the weights in every training process (its size when the model's config is readable)."""
    if not float(loss.get("beta", 0.0) or 0.0) > 0:
        return []
    if peft.enabled:
        return ["loss.beta > 0 with LoRA: the KL reference is the base model with the adapters disabled (no copy)"]
    from ..server.colocate import _model_shape_of, reference_copy_bytes

    shape = _model_shape_of(str(model.name) if model.name else None, model.get("gguf_file"))
    dtype = model.dtype.value if hasattr(model.dtype, "value") else str(model.dtype)
    size = f" (~{reference_copy_bytes(shape, dtype) / 2**30:.2f} GiB)" if shape is not None else ""
    return [f"loss.beta > 0: every training process holds a frozen reference copy of the weights{size} and runs one "
            "more forward pass per row"]


def plan_gpus(gpu_count: int | None = None, *, layout: Layout, start_server: bool = True, launch: LaunchConfig,
              sampler: SamplerConfig, trainer: TrainerConfig, loss: LossConfig, peft: PeftConfig,
              model: ModelConfig) -> GpuPlan:
    """Split this machine's GPUs between the server and the trainer (rules in the module docstring).

    Args:
        gpu_count: visible GPUs; None = `visible_gpu_count()`.
        layout: the colocation decision (`colocate.decide_layout`).
        start_server: whether `asyncgrpo train` starts a server on this machine (False for an external
            server, a server already running, or a machine of rank > 0).
        launch: ``server_gpus``, ``trainer_gpus``, ``cpu_processes``, ``num_machines``, ``machine_rank``,
            ``main_process_ip``.
        sampler: ``backend``, ``device``, ``data_parallel_size``.
        trainer: ``torch_compile``, ``torch_compile_backend`` (a note).
        loss, peft, model: the KL reference's note (`reference_notes`).

    Returns:
        A `GpuPlan`; problems are collected in ``plan.problems`` rather than raised, so that
        ``--dry-run`` can print them next to the plan.
    """
    n = visible_gpu_count() if gpu_count is None else int(gpu_count)
    if layout.colocated:
        return _colocated_plan(n, layout, start_server, loss=loss, peft=peft, model=model)
    backend = _backend(sampler)
    notes: list[str] = [layout.reason] if layout.reason.startswith("launch.colocate=true applies") else []
    problems: list[str] = []
    explicit_server = list(launch.server_gpus) if launch.server_gpus is not None else None
    explicit_trainer = list(launch.trainer_gpus) if launch.trainer_gpus is not None else None

    # GPUs the server holds on this machine, whether we start it or it already runs (started by
    # `asyncgrpo serve`, or on each machine of a multi-node job): the trainer's default split avoids them.
    server_on_gpu = server_uses_gpu(n, sampler=sampler)
    if n == 0:
        held: list[int] = []
    elif server_on_gpu:
        held = explicit_server or list(range(max(1, data_parallel_size(sampler))))  # one GPU per vLLM engine
    else:
        held = explicit_server or []
    server = held if start_server and server_on_gpu else []
    if start_server and server_on_gpu and n == 0:
        what = "sampler.backend=vllm" if backend == "vllm" else f"sampler.device={sampler.device}"
        problems.append(f"{what} needs a CUDA GPU but none is visible (torch.cuda.device_count() == 0). Fix: run "
                        "the sampler on CPU with sampler.backend=embedded sampler.device=cpu, or use a running "
                        "server with sampler.backend=external sampler.url=http://HOST:PORT")
    reserved = set(held)
    if held and not start_server and int(launch.num_machines) > 1:
        notes.append(f"multi-node: GPU(s) {held} stay out of the trainer here too, so that every machine runs the "
                     "same number of trainer processes (set launch.trainer_gpus to change it on every machine)")

    if explicit_trainer is not None:
        trainer_gpus = explicit_trainer
        if not trainer_gpus and n > 0:
            notes.append("launch.trainer_gpus=[]: the trainer runs on CPU although GPUs are visible")
    else:
        trainer_gpus = [g for g in range(n) if g not in reserved]
        if not trainer_gpus and held and n > 0:
            if backend != "vllm":
                trainer_gpus = list(held)
                notes.append(f"the sampler shares GPU(s) {','.join(map(str, held))} with the trainer")
            else:
                problems.append(f"vLLM and the trainer need different GPUs (NCCL weight transfer, README: GPUs, weight sync and LoRA) but "
                                f"all {n} visible GPU(s) go to the server (GPUs {held}). Fix: use a machine with "
                                f"at least {len(held) + 1} GPUs, share one GPU with vLLM through CUDA IPC "
                                f"(launch.colocate=true), or use sampler.backend=embedded")
    if backend == "vllm" and set(held) & set(trainer_gpus):
        problems.append(f"launch.trainer_gpus={trainer_gpus} overlaps the vLLM server's GPUs {held} (README: GPUs, weight sync and LoRA). Fix: "
                        f"launch.trainer_gpus={[g for g in trainer_gpus if g not in set(held)] or [max(held) + 1]}")
    if trainer_gpus and n == 0:
        problems.append(f"launch.trainer_gpus={trainer_gpus}: no CUDA GPU is visible here. Fix: leave launch.trainer_gpus "
                        "unset (the trainer then runs on CPU with launch.cpu_processes processes)")
    for key, ids in (("launch.server_gpus", held), ("launch.trainer_gpus", trainer_gpus if n else [])):
        missing = [g for g in ids if g >= n]
        if missing:
            problems.append(f"{key}={ids}: GPU(s) {missing} do not exist, {n} visible (CUDA_VISIBLE_DEVICES "
                            f"applies). Fix: use indices 0..{n - 1}, or leave {key} unset")

    if bool(trainer.get("torch_compile", False)) or trainer.get("torch_compile_backend"):
        notes.append("trainer.torch_compile=true: the decoder layers and the loss kernel's tiles compile during the "
                     "first step (a minute or two)" + ("" if trainer_gpus else "; on a CPU trainer the compiled step is "
                                                       "often no faster than eager, the gain is on GPUs"))
    notes.extend(reference_notes(loss=loss, peft=peft, model=model))
    if trainer_gpus:
        per_machine = len(trainer_gpus)
    else:
        per_machine = int(launch.cpu_processes)
        cores = usable_cores()
        if per_machine < 1:
            problems.append(f"launch.cpu_processes={per_machine}: must be >= 1. Fix: launch.cpu_processes=1")
            per_machine = 1
        elif per_machine > cores:
            problems.append(f"launch.cpu_processes={per_machine}: this machine lets the job use {cores} CPU core(s), "
                            f"and each trainer process holds a whole copy of the model and computes on its own "
                            f"cores: {per_machine} processes would crawl (or run out of memory). Fix: "
                            f"launch.cpu_processes={cores} or fewer")
    machines, rank = int(launch.num_machines), int(launch.machine_rank)
    if machines < 1:
        problems.append(f"launch.num_machines={machines}: must be >= 1. Fix: launch.num_machines=1")
        machines = 1
    if not 0 <= rank < machines:
        problems.append(f"launch.machine_rank={rank}: must be in 0..{machines - 1} for launch.num_machines="
                        f"{machines}. Fix: set it to this machine's index")
    if machines > 1 and not launch.main_process_ip:
        problems.append(f"launch.num_machines={machines} needs launch.main_process_ip (the address of machine 0). "
                        "Fix: add launch.main_process_ip=10.0.0.1 launch.main_process_port=29500")
    return GpuPlan(gpu_count=n, server_gpus=server, trainer_gpus=trainer_gpus, processes_per_machine=per_machine,
                   num_machines=machines, machine_rank=rank, notes=notes, problems=problems)


def _colocated_plan(n: int, layout: Layout, start_server: bool, *, loss: LossConfig, peft: PeftConfig,
                    model: ModelConfig) -> GpuPlan:
    """The colocated layout: vLLM (started here or already running) and one trainer process on ``layout.gpu``."""
    gpu = int(layout.gpu or 0)
    problems = list(layout.problems)
    if n and gpu >= n:
        problems.append(f"launch.server_gpus=[{gpu}]: GPU {gpu} does not exist, {n} visible (CUDA_VISIBLE_DEVICES "
                        f"applies). Fix: use an index in 0..{n - 1}, or leave it unset")
    notes = [f"colocated: {layout.reason}"]
    if layout.memory is not None:
        notes.append(f"memory split: {layout.memory.describe()}")
        notes.append(f"why: {layout.memory.reason}")
        notes.extend(layout.memory.notes)
    notes.extend(r for r in reference_notes(loss=loss, peft=peft, model=model) if layout.memory is None or peft.enabled)
    return GpuPlan(gpu_count=n, server_gpus=[gpu] if start_server and n else [], trainer_gpus=[gpu] if n else [],
                   processes_per_machine=1, notes=notes, problems=problems, layout=layout)


def mixed_precision(*, trainer: TrainerConfig, model: ModelConfig) -> str:
    """accelerate's ``mixed_precision`` from the trainer's compute dtype (`compute_dtype` of the ``trainer``
    and ``model`` groups): ``bf16``, ``fp16`` or ``no``."""
    return {"bfloat16": "bf16", "float16": "fp16"}.get(compute_dtype(trainer, model), "no")


def accelerate_config(gpus: GpuPlan, main_process_port: int | None = None, *, launch: LaunchConfig,
                      trainer: TrainerConfig, model: ModelConfig) -> dict[str, Any]:
    """The accelerate config file (as a dict) for the trainer.

    Args:
        gpus: the `GpuPlan` from `plan_gpus`.
        main_process_port: rendezvous port; None = ``launch.main_process_port`` (accelerate's default
            29500 when that is unset too).
        launch: ``main_process_port``, ``main_process_ip``.
        trainer, model: the compute dtype (`mixed_precision`: ``trainer.bf16``/``fp16``, ``model.dtype``).

    Returns:
        Keys of accelerate 1.15's ``ClusterConfig``; ``fsdp_config`` only when more than one process runs.
    """
    port = main_process_port if main_process_port is not None else launch.main_process_port
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "FSDP" if gpus.num_processes > 1 else "NO",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": "all",  # CUDA_VISIBLE_DEVICES already holds the trainer's GPUs
        "machine_rank": gpus.machine_rank,
        "main_training_function": "main",
        "mixed_precision": mixed_precision(trainer=trainer, model=model),
        "num_machines": gpus.num_machines,
        "num_processes": gpus.num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": gpus.use_cpu,
    }
    if launch.main_process_ip:
        out["main_process_ip"] = str(launch.main_process_ip)
    if port is not None:
        out["main_process_port"] = int(port)
    if gpus.num_processes > 1:
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # wraps the model's _no_split_modules layers
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": False,
            # Every rank loads the checkpoint itself: the trainer may read weights before `prepare`.
            "fsdp_cpu_ram_efficient_loading": False,
            # The `trainer.activation_checkpointing` argument does it; transformers refuses both at once.
            "fsdp_activation_checkpointing": False,
        }
    return out


def accelerate_config_yaml(config: dict[str, Any]) -> str:
    """The accelerate config dict as YAML (the file ``accelerate launch --config_file`` reads)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config))


def trainer_argv(accelerate_config_path: str | Path, config_path: str | Path,
                 python: str | None = None) -> list[str]:
    """``python -m accelerate.commands.launch --config_file A -m asyncgrpo_cli.train.main --config C``."""
    return [python or sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config_path),
            "-m", TRAINER_MODULE, "--config", str(config_path)]


def trainer_env(gpus: GpuPlan) -> dict[str, str]:
    """Environment of the trainer on top of the caller's: its GPUs (``""`` on CPU; `colocate.visible_ids`: the
    caller's own ``CUDA_VISIBLE_DEVICES`` entries), the CPU flag, and unbuffered output so its log streams."""
    env = {"CUDA_VISIBLE_DEVICES": visible_ids(gpus.trainer_gpus), "PYTHONUNBUFFERED": "1"}
    if gpus.use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def usable_cores() -> int:
    """The CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_thread_split(gpus: GpuPlan, server: Any, cores: int | None = None, *, sampler: SamplerConfig
                     ) -> tuple[int, int, int] | None:
    """``(sampler threads, trainer threads per process, cores)`` when the embedded sampler and the trainer
    both compute on this machine's CPU; None otherwise, or when ``OMP_NUM_THREADS`` is already set (in the
    environment or ``sampler.env``: the user chose).

    Generation and training overlap (asynchronous GRPO), so with torch's default (every core for each
    process) they oversubscribe the cores; half the cores for the sampler and the rest shared by the
    trainer's processes made the smoke recipe 1.4-1.5x faster on 2 cores (151 s against 215-231 s).
    ``cores``: the CPUs this process may run on (None = ``os.sched_getaffinity``); ``sampler``: the
    ``sampler`` group (``backend``, ``env``).
    """
    backend = getattr(sampler.backend, "value", sampler.backend)
    if server is None or backend != "embedded" or not gpus.use_cpu or gpus.server_gpus:
        return None
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in (sampler.env or {}):
        return None
    if cores is None:
        cores = usable_cores()
    sampler_threads = max(1, cores // 2)
    trainer_threads = max(1, (cores - sampler_threads) // max(1, gpus.processes_per_machine))
    engines = max(1, int(sampler.get("engines", 1) if hasattr(sampler, "get") else getattr(sampler, "engines", 1)))
    return max(1, sampler_threads // engines), trainer_threads, cores


def run_size(cfg: DictConfig) -> str:
    """The plan's ``run`` row: how long and how large the run is and what it credits, from the composed config:
    ``8 steps | 4 completions a prompt, up to 48 tokens | reward accuracy_reward | learning rate 3e-05 |
    max_staleness 4 | activation checkpointing off`` (``3 epochs`` when ``trainer.max_steps`` is -1; checkpointing
    ``on``, or ``on every 2nd layer`` with ``activation_checkpointing_kwargs.every_n_layers``)."""
    from ..config.checkpointing_rules import checkpoint_every

    t, r = cfg.trainer, cfg.rollout
    steps = int(t.max_steps)
    length = f"{steps} steps" if steps >= 0 else f"{float(t.num_train_epochs):g} epochs over the prompts"
    length += _resumed_from(t)
    names = [str(f.func).replace(":", ".").rsplit(".", 1)[-1] for f in cfg.rewards]
    reward = f"reward{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else "no reward function"
    every = checkpoint_every(t)
    checkpointing = "off" if every == 0 else "on" if every == 1 else f"on every {_ordinal(every)} layer"
    return (f"{length} | {r.num_generations} completions a prompt, up to {r.max_completion_length} tokens | "
            f"{reward} | learning rate {float(t.learning_rate):g} | max_staleness {cfg.staleness.max_staleness} | "
            f"activation checkpointing {checkpointing}")


def _resumed_from(trainer: Any) -> str:
    """``, resumed from checkpoint-2 (step 2)`` for a run that resumes (``trainer.resume_from_checkpoint``; a dry run
    of a resume command said nothing of it: second trial of 2026-12-05), else ``""``. A checkpoint that cannot be
    resolved is named as given: the start refuses it with the reason."""
    from ..run.checkpoints import CheckpointError, checkpoint_step, resolve_resume

    resume = trainer.get("resume_from_checkpoint") if hasattr(trainer, "get") else None
    if not resume:
        return ""
    try:
        folder = resolve_resume(True if str(resume).lower() == "true" else str(resume), output_dir_of(trainer))
    except (CheckpointError, OSError, ValueError):
        return f", resumed from {resume}"
    step = checkpoint_step(folder)
    return f", resumed from {folder.name}" + (f" (step {step})" if step is not None else "")


def _ordinal(n: int) -> str:
    """``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def output_dir_of(trainer: TrainerConfig) -> Path:
    """The run's output folder from the ``trainer`` group (``output_dir``, default ``outputs/run``), absolute."""
    return Path(str(trainer.output_dir or DEFAULT_OUTPUT_DIR)).expanduser().resolve()


@dataclass
class LaunchPlan:
    """Everything `asyncgrpo train` prints before it starts and then runs.

    Attributes:
        gpus: the GPU split.
        url: base URL of the sampler the trainer uses.
        server: the server command to start, or None when nothing is started (reason in ``server_reason``).
        server_reason: why no server is started ('' when one is).
        accelerate: the accelerate config (dict, written to ``accelerate_config_path``).
        trainer_argv: the trainer's command.
        trainer_env: environment added for the trainer.
        output_dir, config_path, accelerate_config_path, logs_dir: where things go.
        mps: the CUDA MPS daemon to start first (``launch.mps`` true, or null where `plan_mps_auto` chose it), or None.
    """

    gpus: GpuPlan
    url: str
    server: ServerCommand | None
    server_reason: str
    accelerate: dict[str, Any]
    trainer_argv: list[str]
    trainer_env: dict[str, str]
    output_dir: Path
    config_path: Path
    accelerate_config_path: Path
    logs_dir: Path
    mps: MpsPlan | None = None

    @property
    def problems(self) -> list[str]:
        """Reasons the plan cannot run on this machine (empty = runnable)."""
        return self.gpus.problems

    def trainer_shell_line(self) -> str:
        """The trainer command as a copy-pasteable shell line with its environment."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.trainer_env.items() if k != "PYTHONUNBUFFERED")
        return f"{env} {' '.join(shlex.quote(a) for a in self.trainer_argv)}".strip()


def build_launch_plan(cfg: DictConfig, gpu_count: int | None = None, *, server_running: bool = False,
                      main_process_port: int | None = None, gpu_memory: int | None = None) -> LaunchPlan:
    """The whole launch plan for a composed config.

    It takes the whole composed config because it is the top of ``asyncgrpo train``'s launch: the plan
    reads nearly every group (the layout, the server command, the GPU split, the accelerate config, the
    output folder) and hands each part only the groups it reads.

    Args:
        cfg: composed config; ``model.name`` as it will be served (the supervisor passes the resolved path).
        gpu_count: visible GPUs (None = `visible_gpu_count()`).
        server_running: a server already answers at the configured URL (nothing is started then).
        main_process_port: rendezvous port for the accelerate config (see `accelerate_config`).
        gpu_memory: the shared GPU's memory for the colocated split (None = read with nvidia-smi).

    Raises:
        ConfigError: from the server command builder (e.g. ``model.name`` unset).
    """
    from ..config.compose import sampler_url
    from ..run.port_owner import training_owner

    backend = _backend(cfg.sampler)
    url = sampler_url(cfg.sampler)
    if backend == "external":
        reason = f"sampler.backend=external: using the server at {url}"
    elif server_running and (owner := training_owner(str(cfg.sampler.host), int(cfg.sampler.port))) is not None:
        reason = (f"{url} is the server of {owner.describe()}, whose trainer changes its weights: the run refuses it "
                  f"(a free sampler.port)")
    elif server_running:
        reason = (f"a server this job did not start already answers at {url}/health: the run refuses it (a free "
                  f"sampler.port, or sampler.backend=external sampler.url={url} to train against it)")
    elif int(cfg.launch.machine_rank) > 0:
        reason = f"launch.machine_rank={cfg.launch.machine_rank}: the server runs with machine 0 at {url}"
    else:
        reason = ""
    n = visible_gpu_count() if gpu_count is None else int(gpu_count)
    layout = decide_layout(n, gpu_memory, launch=cfg.launch, sampler=cfg.sampler, model=cfg.model,
                           trainer=cfg.trainer, packing=cfg.packing, staleness=cfg.staleness, peft=cfg.peft,
                           loss=cfg.loss)
    gpus = plan_gpus(n, layout=layout, start_server=not reason, launch=cfg.launch, sampler=cfg.sampler,
                     trainer=cfg.trainer, loss=cfg.loss, peft=cfg.peft, model=cfg.model)
    server = None if reason else build_server_command(
        layout=layout, model=cfg.model, sampler=cfg.sampler, launch=cfg.launch, rollout=cfg.rollout,
        trainer=cfg.trainer, peft=cfg.peft, staleness=cfg.staleness)
    if server is not None:
        gpus.problems.extend(p for p in server.problems if p not in gpus.problems)
    if cfg.sampler.get("weight_sync_overlap") and gpus.num_processes > 1:
        gpus.problems.extend(str(e) for e in overlap_refusals(gpus))
    elif cfg.sampler.get("weight_sync_overlap") and int(cfg.staleness.max_staleness) > 0:  # README "Overlapped ..."
        gpus.notes.append("sampler.weight_sync_overlap=true: each step's weight sync runs on a background thread "
                          "while the next step trains (perf/weight_sync_wait_s: what a step still waits for it)")
    attention = str(getattr(cfg.packing.attention, "value", cfg.packing.attention))
    if attention == "flash" and not gpus.trainer_gpus:
        gpus.problems.append("packing.attention=flash: the flash-attention kernels run on CUDA GPUs only, and the "
                             "trainer runs on the CPU here. Fix: packing.attention=auto (sdpa on a CPU)")
    out = output_dir_of(cfg.trainer)
    acc_path, cfg_path = out / ACCELERATE_CONFIG_NAME, out / CONFIG_NAME
    env = trainer_env(gpus)
    split = cpu_thread_split(gpus, server, sampler=cfg.sampler)
    if split is not None and server is not None:
        sampler_threads, trainer_threads, cores = split
        server.env["OMP_NUM_THREADS"] = str(sampler_threads)
        env["OMP_NUM_THREADS"] = str(trainer_threads)
        engines = int(cfg.sampler.get("engines", 1))
        each = f" per server ({engines} servers)" if engines > 1 else ""
        if engines * sampler_threads + trainer_threads > cores:  # too few cores to split: say so, not "split"
            why = (f"{engines} servers and the trainer need more threads than the {cores} cores, so they share "
                   "them and contend")
        else:
            why = "both run at once, so they split the cores instead of contending for all of them"
        gpus.notes.append(f"CPU threads: sampler {sampler_threads}{each}, trainer {trainer_threads} per process, of "
                          f"{cores} cores (OMP_NUM_THREADS; {why}; export OMP_NUM_THREADS to choose yourself)")
    mps, choice, auto_why = None, cfg.launch.get("mps"), None
    priority = cfg.launch.get("mps_trainer_priority", "normal")
    if choice is not False:
        where = dict(colocated=gpus.colocated, starts_server=server is not None,
                     device=visible_ids(gpus.trainer_gpus[:1]), on_cpu=gpus.use_cpu)
        if choice is None:  # automatic: a reason not to is a note, not a problem
            mps, auto_note, auto_why = plan_mps_auto(out, asynchronous=int(cfg.staleness.max_staleness) > 0, **where)
            gpus.notes.extend([auto_note] if auto_note else [])
        else:
            mps, problem = plan_mps(out, **where)
            if problem and priority == "below_normal":
                problem += " (and launch.mps_trainer_priority=normal: its below_normal needs MPS too)"
            gpus.problems.extend([problem] if problem else [])
        if mps is not None:
            server.env.update(mps.client_env)
            env.update(mps.client_env)
            gpus.notes.append(mps.note())
    if priority == "below_normal":
        if mps is not None:
            env[PRIORITY_ENV] = "1"
            server.env.pop(PRIORITY_ENV, None)  # one the user exported would lower vLLM's too
            gpus.notes.append(f"the trainer is an MPS client of priority below normal (launch.mps_trainer_priority="
                              f"below_normal, {PRIORITY_ENV}=1): the GPU runs vLLM's pending kernels first")
        elif choice is None:  # launch.mps=false with it is refused by the config's checks, true by the plan's
            why = ("the trainer runs on the CPU" if gpus.use_cpu else auto_why  # config --check prints this alone
                   or "vLLM and the trainer share no GPU here")
            gpus.unused.append(f"launch.mps_trainer_priority=below_normal is unused: this job runs without MPS ({why})")
    return LaunchPlan(gpus=gpus, url=url, server=server, server_reason=reason, mps=mps,
                      accelerate=accelerate_config(gpus, main_process_port, launch=cfg.launch,
                                                   trainer=cfg.trainer, model=cfg.model),
                      trainer_argv=trainer_argv(acc_path, cfg_path), trainer_env=env,
                      output_dir=out, config_path=cfg_path, accelerate_config_path=acc_path, logs_dir=out / "logs")


def overlap_refusals(gpus: GpuPlan) -> list[Any]:
    """``sampler.weight_sync_overlap=true`` with this plan's trainer processes (`config.rules.weight_sync_overlap_refusals`:
    one process only; SPEC §8.4, B.23), as `ConfigError` s whose fix names the launch keys that give one process;
    empty with one. `build_launch_plan` adds them to the plan's problems (``train``, its ``--dry-run`` and
    ``config --check`` refuse them)."""
    from ..config.rules import weight_sync_overlap_refusals

    fixes = []
    if gpus.processes_per_machine > 1:
        fixes.append(f"launch.trainer_gpus=[{gpus.trainer_gpus[0]}]" if gpus.trainer_gpus else "launch.cpu_processes=1")
    if gpus.num_machines > 1:
        fixes.append("launch.num_machines=1")
    return weight_sync_overlap_refusals(check_weight_sync=False, lora=False, processes=gpus.num_processes,
                                        key=lambda n: f"sampler.{n}", lora_key="", one_process=" ".join(fixes))


def resolved_config(cfg: DictConfig, model_path: str, output_dir: Path) -> DictConfig:
    """The config the trainer gets: ``model.name`` = the resolved path (``model.gguf_file`` cleared),
    ``sampler.url`` = the server URL, ``trainer.output_dir`` = the absolute output folder."""
    out = copy.deepcopy(cfg)
    out.model.name = model_path
    out.model.gguf_file = None
    out.sampler.url = server_url(cfg)
    out.trainer.output_dir = str(output_dir)
    return out


def dry_run_resolved(cfg: DictConfig, plan: LaunchPlan, running: bool) -> tuple[DictConfig, LaunchPlan, bool]:
    """The dry run's plan with the commands the real start runs: ``model.name`` resolved as the start resolves
    it, without exporting anything (`config.models.plan_model_path`: a packaged GGUF's folder, with a note when
    the first start still has to export it). ``(cfg, plan, False)`` unchanged when that cannot be planned (the
    check that fails is already in the plan's problems or the real start names it). Problems found outside the
    plan (a used folder, a busy port) stay: a plan that cannot run shows the commands a start would run too."""
    from ..config.models import plan_model_path
    from ..config.rules import ConfigError

    try:
        path, gguf = plan_model_path(str(cfg.model.name), cfg.model.gguf_file)
        rcfg = resolved_config(cfg, str(path), plan.output_dir)
        shown = build_launch_plan(rcfg, plan.gpus.gpu_count, server_running=running)
    except ConfigError:
        return cfg, plan, False
    if gguf is not None:
        shown.gpus.notes.append(f"{path} does not exist yet: the first start exports {gguf} there (once)")
    shown.gpus.problems.extend(p for p in plan.problems if p not in shown.problems)
    return rcfg, shown, True
