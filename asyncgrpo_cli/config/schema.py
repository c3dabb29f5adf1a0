"""Structured config of the CLI: one dataclass per Hydra group (CONFIG.md maps each path to SPEC's names).

Hydra merges `conf/` and the recipes onto these dataclasses, so a wrong type or an unknown key fails
at compose time. The `trainer` group is generated from `AsyncGRPOConfig`'s `TrainingArguments` fields
so it accepts exactly the fields the installed transformers has, with SPEC §16.4's defaults.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class SamplerBackend(str, enum.Enum):
    """Which inference server the main job starts (CONFIG.md `sampler.backend`)."""

    vllm = "vllm"
    embedded = "embedded"
    external = "external"


class AttentionBackend(str, enum.Enum):
    """Tree-attention backend (`packing.attention`): auto = flex on CUDA, sdpa elsewhere."""

    auto = "auto"
    sdpa = "sdpa"
    flex = "flex"
    flash = "flash"


class Dashboard(str, enum.Enum):
    """Live display: auto = rich panels on a TTY, plain lines otherwise."""

    auto = "auto"
    rich = "rich"
    plain = "plain"
    off = "off"


class ModelDType(str, enum.Enum):
    """dtype the trainer loads the weights in (SPEC §16.3)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


@dataclass
class ModelConfig:
    """What is trained."""

    name: Optional[str] = None
    """Hub id or local directory of the model (`AsyncGRPOTrainer`'s ``model``); set by the recipe."""
    dtype: ModelDType = ModelDType.float32
    """dtype the weights are loaded in (SPEC §16.3: float32 by default)."""
    model_init_kwargs: Optional[dict[str, Any]] = None
    """Extra keyword arguments for ``from_pretrained``."""
    trust_remote_code: bool = False
    """Allow checkpoints that ship their own Python code."""
    router_aux_loss_coef: Optional[float] = None
    """MoE load-balancing loss coefficient (None = the model config's; 0.0 disables)."""
    gguf_file: Optional[str] = None
    """GGUF file inside ``name`` to load with ``gguf_file=`` (GGUF-only checkpoints)."""


@dataclass
class DataConfig:
    """Where prompts come from: a dataset (``name``) or a generator (``generator`` + ``task``)."""

    name: Optional[str] = None
    """Hub id or local path given to ``datasets.load_dataset``."""
    subset: Optional[str] = None
    """Dataset configuration name (``load_dataset``'s second argument)."""
    split: str = "train"
    """Dataset split."""
    streaming: bool = False
    """Load as an IterableDataset (cannot be repositioned on resume, SPEC §12)."""
    prompt_column: str = "prompt"
    """Column holding the conversational prompt; a plain-string column is wrapped as one user message."""
    system_prompt: Optional[str] = None
    """System message prepended to every prompt."""
    generator: Optional[str] = None
    """Procedural prompt source instead of a dataset: ``reasoning_gym``."""
    task: Optional[str] = None
    """Generator task name, e.g. ``basic_arithmetic`` or ``chain_sum``."""
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the generator task (e.g. operand ranges)."""
    size: int = 1000
    """Number of prompts a generator makes (one epoch)."""
    seed: int = 0
    """Generator seed."""
    eval_name: Optional[str] = None
    """Eval prompts (README "Evaluation"): Hub id or local path, as ``name``; evaluated with
    ``trainer.eval_strategy=steps trainer.eval_steps=N``, never trained. Same ``subset``, ``prompt_column`` and
    ``system_prompt`` as the training data."""
    eval_split: Optional[str] = None
    """Split of ``eval_name``; null = ``split``."""
    eval_generator: Optional[str] = None
    """Procedural eval prompts instead of ``eval_name``: ``reasoning_gym`` (the same ``task`` and ``task_kwargs``)."""
    eval_size: int = 64
    """Number of eval prompts the generator makes; with ``eval_name``, the first ``eval_size`` rows (0 = all)."""
    eval_seed: Optional[int] = None
    """Seed of the eval generator; null = ``seed`` + 1 (other prompts than the training ones)."""


@dataclass
class RewardFuncConfig:
    """One reward function by import path, with optional keyword arguments (bound with functools.partial)."""

    func: str = "asyncgrpo_cli.rewards:accuracy_reward"
    """``module:function`` or ``module.function``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the function."""
    probe: bool = True
    """Call the function once before the start (train, --dry-run, config --check) on the first prompt with a
    stand-in completion, and refuse the run when it raises or returns something that is not a number or None;
    false skips that call (a reward with side effects, e.g. a paid judge)."""


@dataclass
class EnvironmentConfig:
    """The ``environment_factory`` (SPEC §13.2): one import path (``module:Class``), or a dict of names to
    import paths routed by the dataset's ``environment`` column; null = no environment."""

    factory: Any = None
    """``module:Class`` (a zero-argument callable), or ``{name: module:Class, ...}``."""


@dataclass
class RolloutConfig:
    """Generation settings (SPEC §16.3 'Generation')."""

    num_generations: int = 8
    """Rollouts per prompt (G)."""
    max_completion_length: int = 2048
    """Max generated tokens per vLLM request (turn)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1]; < 1 needs ``top_k`` > 0 and vLLM >= 0.28 (SPEC §7)."""
    top_k: int = 0
    """Top-k filter; 0 disables it."""
    min_p: Optional[float] = None
    """Min-p filter; > 0 needs ``top_k`` > 0."""
    repetition_penalty: float = 1.0
    """Passed to the sampler; != 1.0 warns at start: processed log-probs then include a penalty the trainer
    does not reproduce (Appendix B.11)."""
    num_sampler_logprobs: int = 8
    """Top log-probs asked per generated token (score centering); capped by the server's --max-logprobs."""
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """Extra keyword arguments for ``apply_chat_template``."""
    max_tool_calling_iterations: Optional[int] = None
    """Max tool-calling turns per rollout (None = no limit)."""
    tool_call_timeout: Optional[float] = 300.0
    """Seconds one tool call may run; past it the model reads a timeout error (None = no limit)."""
    loop_cls: Optional[str] = None
    """Import path of an ``AsyncRolloutLoop`` subclass (None = the default loop)."""
    sampling_mask_fallback: bool = False
    """SPEC §7's fallback: with top-k/top-p/min-p on, accept a server that cannot return candidate sets
    (vLLM < 0.28, or started without --return-sampling-mask). The trainer then normalises over the full
    vocabulary, so every importance ratio is biased (often far below 1, masking most tokens). False
    (default) refuses such a server at start with the command that fixes it; true warns at start."""
    max_groups_without_signal: int = 64
    """Stop the run when this many consecutive groups are dropped without a learning signal (every reward
    equal, or no reward at all), with a diagnosis naming the reward functions and their last values;
    groups where no reward scored anything (all None/NaN) stop it after a quarter of this (at least 4).
    0 never stops. Raise it for a task so hard that most groups score the same."""
    reward_weights: Optional[list[float]] = None
    """One weight per entry of ``rewards`` (same order), applied to each function's reward before the sum
    and the group advantage (TRL's ``reward_weights``); null = every weight 1.0. The environment's and
    ``Rollout.reward`` keep weight 1. ``rewards/<name>/mean`` stays the unweighted reward (README: Loss variants)."""
    scale_rewards: str = "group"
    """How the group advantage is scaled (TRL's ``scale_rewards``): ``group`` (default) ``(r - mean) / (std +
    1e-8)`` over the group's scored completions, population std, as TRL's asynchronous trainer (TRL's
    ``GRPOTrainer`` divides by the Bessel-corrected std + 1e-4: ratio sqrt((n-1)/n), 0.935 at n = 8); ``none``
    ``r - mean`` (Dr. GRPO, with ``loss.loss_type=dr_grpo``). ``batch`` is refused: advantages are computed per
    group when it finishes, not per generation batch (README: Loss variants)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """TRL's name: ``sum_then_normalize`` (the only value): weighted sum of the reward functions, then the group
    advantage. ``normalize_then_sum`` is refused (its final normalisation is over the generation batch)."""
    group_requests: bool = True
    """Send a group's ``num_generations`` single-turn rollouts as ONE request with ``n = num_generations``
    (vLLM's parallel sampling: one HTTP round trip and one response per group instead of one per rollout;
    README: Requests to the sampler). It applies without tools, environments, sampling filters (their route
    answers one completion per request) or a ``loop_cls`` that overrides ``generate_one`` / ``generate_one_turn``;
    false sends one request per rollout."""
    request_seeds: bool = True
    """Send a unique ``seed`` with every request, so data-parallel engines sharing a sampler seed never decode
    identical text (completion ``i`` of a group request gets ``seed + i``; README: Requests to the sampler).
    False sends none and the server draws one per request; refused with ``sampler.data_parallel_size`` > 1 or
    ``sampler.engines`` > 1."""


@dataclass
class LossConfig:
    """Objective (SPEC §3.3)."""

    score_centering: bool = True
    """Score-centering objective (default) instead of the clipped surrogate."""
    epsilon: float = 0.2
    """Lower clipping epsilon."""
    epsilon_high: Optional[float] = None
    """Upper clipping epsilon (None = ``epsilon``)."""
    vllm_importance_sampling_clip_min: Optional[float] = 0.5
    """C_min of the importance-sampling correction (``loss.vllm_importance_sampling_mode``); null = no lower
    bound (TRL's default; TRL's C_max default is 3.0, ours 5.0)."""
    vllm_importance_sampling_clip_max: Optional[float] = 5.0
    """C_max of the importance-sampling correction; null = no upper bound. A ``*_truncate`` mode needs at
    least one of the two (README: Loss variants)."""
    loss_type: str = "dapo"
    """How token losses become the loss (TRL names): ``dapo`` (default: trained tokens of the
    micro-batch over all ranks), ``grpo`` (mean over samples of each sample's token mean), ``bnpo`` (this
    rank's tokens), ``dr_grpo`` (``rollout.max_completion_length`` x samples), or ``cispo`` (the clipped,
    stop-gradient importance weight times the log-prob; needs ``loss.epsilon_high``, e.g. 5.0, and
    ``loss.score_centering=false``) (README: Loss variants)."""
    importance_sampling_level: str = "token"
    """``token`` (default): one ratio per token; ``sequence`` (GSPO): the geometric mean of a sample's token
    ratios, clipped as one; needs ``loss.score_centering=false`` (README: Loss variants)."""
    vllm_importance_sampling_mode: str = "token_mask"
    """Correction of the sampler/trainer mismatch with [C_min, C_max]: ``token_mask`` (default, masked
    IS: a token whose ratio r_t leaves the bounds is dropped), ``token_truncate`` (TIS: its weight is
    clamp(r_t)), ``sequence_mask`` / ``sequence_truncate`` (TRL's: every token of a sample weighs the sample's
    ratio rho = the product of its token ratios, times 1[rho within the bounds], or clamp(rho); need
    ``loss.score_centering=false``). TRL's defaults differ: ``sequence_mask`` with C_max = 3.0 and no C_min
    (ours: ``token_mask`` within [0.5, 5.0]); set all three to get TRL's (README: Loss variants)."""
    beta: float = 0.0
    """KL coefficient (TRL's ``beta``): ``beta × k3`` against the initial policy is added to each trained token's
    loss and logged as ``kl``. With LoRA the reference is the base model (adapters disabled, no copy); with
    full fine-tuning a frozen copy of the weights per training process (in the launch plan). 0 = none
    (README: Loss variants)."""
    mask_truncated_completions: bool = False
    """Completions cut at ``rollout.max_completion_length`` (ending without EOS) contribute no loss; they
    still count in their group's advantage and, as in TRL, as sequences in ``grpo``'s and ``dr_grpo``'s
    normaliser (each travels as an untrained stub: its context only, shared with its group when packed).
    Counted in ``completions/masked_truncated_frac`` (README: Loss variants)."""


@dataclass
class StalenessConfig:
    """The async pipeline's limits (SPEC §4)."""

    max_staleness: int = 4
    """Max weight updates a sample may lag behind the trained policy."""
    weight_sync_steps: int = 1
    """Optimizer steps between weight syncs."""
    max_concurrent_rollouts: int = 512
    """Ceiling on rollouts in flight."""
    rollout_worker_timeout: float = 300.0
    """Seconds without a worker heartbeat before the trainer aborts."""
    in_flight_estimate: str = "mean"
    """What one rollout in flight counts for against the staleness token allowance. ``mean`` (the default, SPEC B.4):
    the running mean of sample tokens per finished rollout. ``kept`` (opt-in, not the specified rule): the running
    mean of sample tokens finished rollouts put into the rollout queue, groups dropped for zero reward std counting
    zero (kept between 0.1x and 1x the mean; the mean until 64 rollouts are decided), so a run that drops most
    groups keeps more in flight. The trainer still drops every sample more than max_staleness updates old (README:
    Staleness and concurrency)."""
    deadline_release_versions: int | None = None
    """``null`` (the default): deadline admission (a group starts only if every group in flight can still be
    trained), on from the first stale drop, stays on. N >= 1 (opt-in, issue #41): it turns off again after N weight
    updates without a stale drop, 2N, 4N, ... each time a drop turns it on again. More generation in flight, more
    samples dropped stale where short groups overtake long ones (README: Staleness and concurrency)."""
    deadline_order: str = "pessimistic"
    """How deadline admission orders what is committed against a group in flight. ``pessimistic`` (the default):
    all of it counts as pulled before that group, the groups started after it too. ``observed`` (opt-in, issue #42):
    the groups started at a later version count at the largest share of such groups' tokens seen to finish before a
    group over the last 64 groups (``rollout/deadline_overtake_share``; in full until 16 groups have finished), so where
    completions all run about as long more generation stays in flight; where short groups overtake long ones the
    share reaches 1 and it is as strict as ``pessimistic`` (README: Staleness and concurrency)."""


@dataclass
class PackingConfig:
    """Tree packing (SPEC §6)."""

    token_budget: Optional[int] = None
    """Max forwarded tokens per row (None = the server's max_model_len)."""
    max_groups_per_step: Optional[int] = None
    """Max prompt groups per optimizer step, a multiple of gradient_accumulation_steps (each micro-batch holds its
    share); None = only token_budget bounds a step. Late in a run completions shrink and identical ones share their
    tokens, so a token-bounded step grows to hundreds of groups and waits for thousands of rollouts; this bound
    keeps a step's size in rollouts steady. At max_staleness=0 it sizes the on-policy round, which trains whole
    and can overshoot it (README: Packing and the token budget)."""
    attention: AttentionBackend = AttentionBackend.auto
    """Tree-attention backend."""


@dataclass
class SamplerConfig:
    """The inference server: which one, where, and the flags it is started with (DESIGN.md §4)."""

    backend: SamplerBackend = SamplerBackend.vllm
    """vllm (start vLLM), embedded (start ours), external (start nothing; use ``url``)."""
    url: Optional[str] = None
    """Base URL the worker and trainer talk to; None = http://HOST:PORT of the started server."""
    timeout: float = 1800.0
    """``vllm_server_timeout`` in seconds: how long the job waits for the server to start, for one request (then
    retried) and for an outage of refused connections."""
    hang_timeout: float = 120.0
    """Seconds a server that has answered may leave ``GET /health`` unanswered (hung: stopped with SIGSTOP or
    Ctrl-Z, deadlocked, swapping) before the run saves its last step and stops; the lower of this and ``timeout``
    applies (it cannot be turned off: raise it to wait longer). A busy vLLM still answers ``/health``; a refused
    connection is an outage (``timeout``), not a hang."""
    host: str = "127.0.0.1"
    """Address a started server binds to (dev-mode routes take no API key: keep it private)."""
    allow_public: bool = False
    """Accept a non-loopback ``host`` (the unauthenticated weight-update routes become reachable from the network)."""
    port: int = 8000
    """Port a started server listens on."""
    max_model_len: Optional[int] = None
    """``--max-model-len``: the one source of the length limit (token_budget defaults to it)."""
    api_server_count: int = 8
    """``--api-server-count`` (forced to 1 with runtime LoRA updating)."""
    data_parallel_size: int = 1
    """``--data-parallel-size``: vLLM engines (one GPU each without tensor parallelism) behind the one URL;
    with ``launch.server_gpus`` unset the server takes the first that many GPUs (README: Several machines)."""
    engines: int = 1
    """Inference servers the job starts on the server's GPU, behind one local router at ``port`` (they listen on
    the ports after it; `asyncgrpo_cli.server.router`). A small model's vLLM engine core is CPU-bound: on one H200 a
    second engine nearly doubled the rollouts per second of SmolLM2-135M. Each gets 1/engines of the memory share.
    Colocated vLLM (CUDA-IPC weight sync) or the embedded sampler; not with LoRA or ``data_parallel_size`` > 1."""
    weight_transfer_address: Optional[str] = None
    """Address of this trainer's rank-0 process that the server's workers connect to for the NCCL weight
    transfer (vLLM's ``master_address``; ``weight_transfer_address``); None = this host's address as the
    server sees it (the local address of a socket towards the server's host). Set it when the trainer has
    several networks and the server must use a particular one."""
    weight_transfer_port: Optional[int] = None
    """Port of that NCCL rendezvous (vLLM's ``master_port``; ``weight_transfer_port``), e.g. one a firewall
    lets through; None = a free port picked at start."""
    check_weight_sync: bool = False
    """At start, after the first weight sync: perturb the trainer's weights, sync, and check with a probe (a short
    completion at temperature 1) that the server's log-probs follow the trainer's; restore the weights exactly,
    sync, check again; stop with the four figures when a sync did not take effect (a model class the server maps
    differently, a weight it skips). Then ``weight_sync/probe_gap`` after every sync. Costs three syncs at start, a
    short request per sync and host memory for one copy of the weights; full-weight sync only (README: GPUs,
    weight sync and LoRA)."""
    weight_sync_packed: bool = False
    """CUDA-IPC weight sync (colocated vLLM 0.33) in packed chunks: the weights are copied, chunk after chunk, into
    one 1 GiB buffer and the server opens one IPC handle per chunk, instead of one handle per tensor (about 300 for a
    135M or 1.7B model). Costs that buffer on the trainer's GPU during a sync. The NCCL sync, the embedded sampler
    and LoRA adapter sync ignore it (the start says so). Measured no faster (one H100, a 0.6B model: 0.166 s
    against 0.169 s plain, README "Packed CUDA-IPC sync"), hence off."""
    weight_sync_overlap: bool = False
    """Overlap each weight sync with the next step: after the optimizer step the sync runs on a background thread
    while the trainer pulls and forwards/backwards the next step, which waits for it only before its own optimizer
    step (and before an eval round, a checkpoint, a re-push or the run's end). The rollout worker stamps the new
    version only once the sync is done; ``perf/weight_sync_wait_s`` is the time the trainer still waited for it.
    One trainer process only, not with ``check_weight_sync`` nor LoRA (``peft.enabled``): the start refuses those.
    The copy of the weights that a sync sends stays in memory through the next step's forward and backward (3.1 GiB
    more at a 1.7B shape). Off by default: on one H100 at the 1.7B shape no step waited for a sync, and a step that
    did not wait for samples took 1.36 s against 1.57 s, but that job, bound by generation, trained 0.99x as fast
    (README "Overlapped weight sync")."""
    gpu_memory_utilization: Optional[float] = None
    """``--gpu-memory-utilization`` (None = vLLM's default; with ``launch.colocate`` sized from the model and
    the trainer's estimated need, printed in the plan)."""
    max_logprobs: Optional[int] = None
    """``--max-logprobs`` (None = ``rollout.num_sampler_logprobs``)."""
    kv_cache_tokens: Optional[int] = None
    """Embedded server only: KV budget in tokens (None = a size derived from max_model_len)."""
    device: str = "auto"
    """Embedded server only: cpu, cuda, cuda:N or auto."""
    extra_args: list[str] = field(default_factory=list)
    """Extra arguments appended to the server command."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server."""


@dataclass
class PeftConfig:
    """LoRA (SPEC §9)."""

    enabled: bool = False
    """Train a LoRA adapter instead of the full model."""
    r: int = 16
    """LoRA rank (<= 512)."""
    lora_alpha: int = 32
    """LoRA alpha."""
    lora_dropout: float = 0.0
    """LoRA dropout."""
    target_modules: Any = "all-linear"
    """Modules to adapt (a name, or a list of names); ``lm_head`` is not supported."""


@dataclass
class LaunchConfig:
    """Processes and GPUs (DESIGN.md §2, §7)."""

    server_gpus: Optional[list[int]] = None
    """CUDA devices of the server (None = the first GPU)."""
    trainer_gpus: Optional[list[int]] = None
    """CUDA devices of the trainer, one process each (None = the GPUs after the server's)."""
    colocate: Optional[bool] = None
    """vLLM and the trainer share one GPU (vLLM takes ``sampler.gpu_memory_utilization`` of it, the
    trainer the rest; weights go over CUDA IPC). None = automatically when one GPU is visible and
    ``sampler.backend=vllm``; false = separate GPUs (NCCL weight transfer)."""
    cpu_processes: int = 1
    """Trainer processes when no GPU is used (gloo)."""
    num_machines: int = 1
    """Machines of a multi-node trainer."""
    machine_rank: int = 0
    """This machine's rank."""
    main_process_ip: Optional[str] = None
    """Address of machine 0 (multi-node)."""
    main_process_port: Optional[int] = None
    """Rendezvous port (multi-node)."""
    mps: Optional[bool] = None
    """Run vLLM and the trainer under CUDA MPS (Multi-Process Service) when they share one GPU: the supervisor
    starts ``nvidia-cuda-mps-control -f`` for this run before the server and quits it at the end, so that the two
    processes' kernels run at the same time instead of taking turns. null (the default) = automatically: on for an
    asynchronous job (``staleness.max_staleness > 0``) whose vLLM server the job starts on the trainer's GPU, with
    ``nvidia-cuda-mps-control`` and ``nvidia-smi`` on PATH. When the two share a GPU but one of these does not
    hold, the plan prints why MPS is off; a daemon that cannot start, or cannot serve a probe's CUDA context, is
    skipped with a line. true = the same conditions are required, and the job is refused before anything starts
    when one fails (an on-policy job is allowed); false = never. On one H100 at the 1.7B shape (README "How fast,
    against what"): 1.24x the asynchronous job's trained tok/s without MPS (one session), and 1.48x the on-policy
    job's (another session, one machine). On-policy training takes turns on the GPU anyway and trained 3.7% fewer
    tok/s under MPS, so the automatic choice leaves it off. The daemon runs under a keeper that, if the job is
    killed, keeps it until the trainer's last save is done."""
    mps_trainer_priority: str = "normal"
    """The trainer's scheduling priority as a client of this run's MPS daemon (with ``launch.mps`` on): ``normal``
    (the default: vLLM's and the trainer's kernels are scheduled alike) or ``below_normal``
    (``CUDA_MPS_CLIENT_PRIORITY=1`` in the trainer's environment only: the GPU schedules vLLM's pending kernels
    before the trainer's, so generation, which the asynchronous trainer waits on, is slowed less by training).
    Without MPS it has nothing to act on: with ``launch.mps=false`` the setting is refused, and when the automatic
    choice leaves MPS off the plan says it is unused. Measured once, back to back on one H100 at the 1.7B shape
    (README "How fast, against what", s28): 1.07x trained tok/s over steps 2-20 and the trainer 79% busy against
    65%, but the first step (compiling) took 46 s against 27 s, so a 20-step run ended 15 s later; it pays back
    after about a hundred steps, and one pair is not yet a verdict, so the default stays ``normal``."""
    stop_timeout: Optional[float] = None
    """Seconds the supervisor waits after SIGINT/SIGTERM for the trainer to save a checkpoint and exit, before
    SIGTERM then SIGKILL; None = the last step time + 3 × the last measured save time + 30 s (120 s before
    the first save)."""


@dataclass
class LoggingConfig:
    """What the user sees."""

    dashboard: Dashboard = Dashboard.auto
    """auto (rich on a TTY, plain lines otherwise), rich, plain, off."""
    log_completions: bool = False
    """Print sample completions every logging step."""
    num_completions_to_print: Optional[int] = None
    """How many completions to print (None = all)."""


# ---------------------------------------------------------------------------------------------------
# The trainer group: every TrainingArguments field of AsyncGRPOConfig, typed for OmegaConf. The field list
# comes from `trainer_fields` (a stamped snapshot, so composing a config does not import transformers).


def _make_trainer_config() -> type:
    from .trainer_fields import resolve_type, trainer_field_specs

    specs = []
    for name, type_name, default in trainer_field_specs():
        if isinstance(default, dict) and default.get("default_factory") == "list":
            spec = field(default_factory=list)
        else:
            spec = field(default=default)
        specs.append((name, resolve_type(type_name), spec))
    cls = dataclasses.make_dataclass("TrainerConfig", specs)
    cls.__doc__ = ("Every other TrainingArguments field, by name, with changed defaults (README: Defaults) "
                   "(see `transformers.TrainingArguments` for each field's meaning).")
    return cls


TrainerConfig = _make_trainer_config()


@dataclass
class AppConfig:
    """The whole composed config: one field per Hydra group (CONFIG.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardFuncConfig] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    """Tools the model may call, by import path (``module:function``; sync or async functions with type hints
    and a Google-style docstring, SPEC §13.1); empty = no tools."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
