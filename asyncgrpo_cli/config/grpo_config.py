"""`AsyncGRPOConfig`: `transformers.TrainingArguments` plus the async-GRPO fields (SPEC §16.2–16.4)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from transformers import TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from .rules import check_fields
from .validate import check_training_arguments, check_types

# Fields this class adds to TrainingArguments, in SPEC §16.2's signature order.
ASYNC_GRPO_FIELDS = (
    "model_init_kwargs", "dtype", "trust_remote_code", "router_aux_loss_coef",
    "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "chat_template_kwargs", "max_tool_calling_iterations",
    "vllm_server_base_url", "vllm_server_timeout",
    "epsilon", "epsilon_high", "score_centering", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max", "num_sampler_logprobs", "token_budget",
    "max_concurrent_rollouts", "max_staleness", "weight_sync_steps", "rollout_worker_timeout",
    "log_completions", "num_completions_to_print",
    # Extensions of this project (not in SPEC §16.2's signature):
    "tree_attention", "tool_call_timeout", "sampling_mask_fallback", "max_groups_without_signal",
    "weight_transfer_address", "weight_transfer_port", "max_groups_per_step", "vllm_server_hang_timeout",
    # The algorithm menu of TRL's GRPOConfig (issue #27; defaults = SPEC §3.2, §3.3):
    "loss_type", "importance_sampling_level", "vllm_importance_sampling_mode", "mask_truncated_completions",
    "reward_weights", "beta", "scale_rewards", "multi_objective_aggregation",
    # The worker's requests (issue #41):
    "group_requests", "request_seeds",
    # The staleness allowance's estimate of a rollout in flight (issue #41; README: Staleness and concurrency):
    "in_flight_estimate",
    # Deadline admission released after weight updates without a stale drop (issue #41, opt-in):
    "deadline_release_versions",
    # How deadline admission orders newer groups against a group in flight (issue #42, opt-in):
    "deadline_order",
    # The start-up check that a weight sync takes effect on the server (issue #44; README: GPUs, weight sync and LoRA):
    "check_weight_sync",
    # CUDA-IPC weight sync in packed chunks (issues #41, #42; README: GPUs, weight sync and LoRA):
    "weight_sync_packed",
    # The weight sync overlapped with the next step's forward and backward (README: GPUs, weight sync and LoRA):
    "weight_sync_overlap",
)


def _resolve_checkpointing_aliases(args: Any) -> None:
    """Resolve ``gradient_checkpointing(_kwargs)`` into ``activation_checkpointing(_kwargs)`` as transformers 5.2x
    does (the old name counts only where the new one is unset; then the old mirrors the new), whatever the installed
    transformers: before it, ``TrainingArguments`` had only the old names, and ``gradient_checkpointing=True`` left
    the new name unset (no checkpointing at all; the trainer reads the new names). Both unset: on (SPEC §16.4)."""
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if getattr(args, new) is None and getattr(args, old) is not None:
            setattr(args, new, getattr(args, old))
        setattr(args, old, getattr(args, new))
    if args.activation_checkpointing is None:
        args.activation_checkpointing = args.gradient_checkpointing = True  # SPEC §16.4


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Training arguments of the asynchronous GRPO trainer (SPEC §16.2; defaults of §16.4).

    Every `TrainingArguments` field is accepted. Changed defaults: ``logging_steps=1``,
    ``gradient_checkpointing=True`` (transformers 5 spells it ``activation_checkpointing``), ``bf16=True`` unless ``fp16`` (on a machine without CUDA: only with
    ``use_cpu=True``), ``learning_rate=1e-6``,
    ``lr_scheduler_type="constant"``, ``ignore_data_skip=True`` (forced), ``remove_unused_columns=False``
    (must stay so), optimizer ``adamw_torch_fused`` on CUDA and ``adamw_torch`` elsewhere (Appendix B.20).

    Raises:
        ConfigTypeError (a TypeError): a field of the wrong type (``num_generations="8"``); names it and the fix.
        ConfigError (a ValueError): when a value breaks a rule of SPEC §2/§3/§7 or a `TrainingArguments`
            range (message names the field and fix; `ConfigErrors` when several are broken).
    """

    # Changed TrainingArguments defaults (SPEC §16.4).
    logging_steps: float = 1
    # transformers before 5.2x has only gradient_checkpointing(_kwargs): all four names are declared here and
    # resolved in __post_init__ (`_resolve_checkpointing_aliases`), so either spelling works on every transformers.
    gradient_checkpointing: bool | None = field(default=None, metadata={
        "help": "Deprecated alias of activation_checkpointing (used only when that is unset)."})
    activation_checkpointing: bool | None = field(default=None, metadata={
        "help": "Recompute each checkpointed layer in the backward instead of keeping its activations (less memory, "
                "~20-30% more compute); unset (with gradient_checkpointing) = on (SPEC §16.4)."})
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Deprecated alias of activation_checkpointing_kwargs (used only when that is unset)."})
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Options of activation checkpointing: every_n_layers (checkpoint every Nth layer), offload, and "
                "torch.utils.checkpoint's own (use_reentrant); None = every layer, non-reentrant."})
    bf16: bool | None = None
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"
    ignore_data_skip: bool = True
    remove_unused_columns: bool = False
    # Evaluation (issue #27): TrainingArguments' fields, as this trainer implements them (README "Evaluation").
    eval_strategy: IntervalStrategy | str = field(default="no", metadata={
        "help": "no, or steps: an eval round on eval_dataset every eval_steps optimizer steps and after the last "
                "step (README: Evaluation); epoch is not supported."})
    eval_steps: float | None = field(default=None, metadata={
        "help": "Optimizer steps between eval rounds (a whole number >= 1) with eval_strategy=steps; None = "
                "logging_steps (README: Evaluation)."})

    # Model.
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for `from_pretrained` when the model is given by name."})
    dtype: str = field(default="float32", metadata={
        "help": "dtype the weights are loaded in: auto, bfloat16, float16 or float32 (README: Defaults)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models/tokenizers with custom code."})
    router_aux_loss_coef: float | None = field(default=None, metadata={
        "help": "MoE load-balancing loss coefficient; None = the model config's, 0.0 disables (README: Log-probabilities and the loss)."})
    # Generation.
    num_generations: int = field(default=8, metadata={"help": "Rollouts per prompt (G)."})
    max_completion_length: int = field(default=2048, metadata={"help": "Max generated tokens per vLLM request (turn)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; the trainer divides logits by it."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus threshold in (0, 1]; < 1 needs top_k (README: Sampling filters)."})
    top_k: int = field(default=0, metadata={"help": "Top-k filter; 0 disables it."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p filter in [0, 1]; > 0 needs top_k."})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "Passed to the sampler; != 1.0 warns that log-probs include a penalty the trainer ignores."})
    chat_template_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Extra keyword arguments for apply_chat_template, e.g. {'enable_thinking': False}."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={
        "help": "Max tool-calling turns per rollout; None = until a reply calls no tool."})
    tool_call_timeout: float | None = field(default=300.0, metadata={
        "help": "Seconds one tool call may run before the model is told it timed out; None = no limit (extension)."})
    # vLLM server.
    vllm_server_base_url: str = field(default="http://localhost:8000", metadata={"help": "Base URL of the sampler."})
    vllm_server_timeout: float = field(default=1800.0, metadata={
        "help": "Seconds: readiness wait, each generation request (then retried) and each weight-sync call."})
    vllm_server_hang_timeout: float = field(default=120.0, metadata={
        "help": "Seconds a server that has answered may leave GET /health unanswered (hung) before the run saves and "
                "stops; the lower of this and vllm_server_timeout applies (extension)."})
    # Extensions: where the vLLM server's workers reach the trainer for NCCL weight transfer (multi-node).
    weight_transfer_address: str | None = field(default=None, metadata={
        "help": "Address of the trainer's rank-0 process that the vLLM server's workers connect to for the NCCL "
                "weight-transfer group (vLLM's master_address); None = this host's address as the server sees it "
                "(the local address of a socket towards vllm_server_base_url's host)."})
    weight_transfer_port: int | None = field(default=None, metadata={
        "help": "TCP port of that NCCL rendezvous (vLLM's master_port), e.g. one open in a firewall; None = a free port."})
    # Training.
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping epsilon."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping epsilon; None = epsilon."})
    score_centering: bool = field(default=True, metadata={"help": "Score-centering objective (README: Log-probabilities and the loss)."})
    vllm_importance_sampling_clip_min: float | None = field(default=0.5, metadata={
        "help": "C_min of the IS correction (vllm_importance_sampling_mode); None = no lower bound (TRL's default) "
                "(README: Loss variants)."})
    vllm_importance_sampling_clip_max: float | None = field(default=5.0, metadata={
        "help": "C_max of the IS correction; None = no upper bound (TRL's default is 3.0); a *_truncate mode needs "
                "at least one bound (README: Loss variants)."})
    # Extensions with TRL GRPOConfig names (README: Loss variants); the defaults are SPEC §3.3 as written.
    loss_type: str = field(default="dapo", metadata={
        "help": "Loss normaliser / objective: dapo (trained tokens of the micro-batch over all ranks; the default), grpo "
                "(mean of per-sample token means), bnpo (this rank's tokens), dr_grpo (max_completion_length x "
                "samples) or cispo (clipped, stop-gradient IS weight x log-prob; needs epsilon_high) (README: Loss variants)."})
    importance_sampling_level: str = field(default="token", metadata={
        "help": "token: one ratio per token (the default); sequence: GSPO, the geometric mean of the sample's token "
                "ratios, clipped as one (needs score_centering=False) (README: Loss variants)."})
    vllm_importance_sampling_mode: str = field(default="token_mask", metadata={
        "help": "Sampler/trainer mismatch correction with [C_min, C_max]: token_mask (masked IS, the default), "
                "token_truncate (TIS), sequence_mask / sequence_truncate (TRL's: every token weighs the sample's "
                "ratio rho = product of its token ratios, times 1[rho within bounds], or clamp(rho)). TRL's default "
                "is sequence_mask with C_max 3.0 and no C_min (README: Loss variants)."})
    beta: float = field(default=0.0, metadata={
        "help": "KL coefficient: beta x k3(policy, reference) per trained token; the reference is the initial policy "
                "(LoRA: adapters disabled; full fine-tuning: a frozen copy, one more copy of the weights per "
                "process); 0 = none (README: Loss variants)."})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": "Completions cut at max_completion_length (no EOS) contribute no loss; they still count in "
                "their group's advantage and, as in TRL, as sequences in grpo's and dr_grpo's normaliser (README: "
                "Loss variants)."})
    reward_weights: list[float] | None = field(default=None, metadata={
        "help": "One weight per reward function, applied before the group advantage; None = all 1.0 (README: Loss variants)."})
    scale_rewards: str = field(default="group", metadata={
        "help": "group: advantage = (r - group mean) / (group population std + 1e-8) (the default; TRL divides by the "
                "Bessel-corrected std + 1e-4); none: r - group mean (Dr. GRPO, with loss_type=dr_grpo); batch is "
                "refused; True/False mean group/none, as in TRL (README: Loss variants)."})
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={
        "help": "sum_then_normalize: the weighted sum of the reward functions, then the group advantage (the only "
                "value; TRL's normalize_then_sum is refused) (README: Loss variants)."})
    num_sampler_logprobs: int = field(default=8, metadata={"help": "Top log-probs requested per generated token."})
    token_budget: int | None = field(default=None, metadata={
        "help": "Max forwarded (unique) tokens per row; None = the server's max_model_len (README: Packing and the token budget)."})
    max_groups_per_step: int | None = field(default=None, metadata={
        "help": "Max prompt groups per optimizer step, a multiple of gradient_accumulation_steps (each micro-batch "
                "holds its share); None = only token_budget bounds a step; at max_staleness=0 it sizes the on-policy "
                "round, which trains whole and can overshoot it (README: Packing and the token budget)."})
    # Async pipeline.
    max_concurrent_rollouts: int = field(default=512, metadata={"help": "Ceiling on rollouts in flight (README: Staleness and concurrency)."})
    max_staleness: int = field(default=4, metadata={"help": "Max weight updates a sample may lag (README: Staleness and concurrency)."})
    weight_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between weight syncs."})
    rollout_worker_timeout: float = field(default=300.0, metadata={"help": "Seconds without a worker heartbeat."})
    in_flight_estimate: str = field(default="mean", metadata={
        "help": "What one rollout in flight counts for against the staleness token allowance: mean (the default) "
                "the running mean of sample tokens per finished rollout; kept (opt-in) the running mean of sample "
                "tokens finished rollouts put into the rollout queue, groups dropped for zero reward std counting "
                "zero (between 0.1x and 1x the mean; the mean until 64 rollouts are decided), so a run that drops "
                "most groups keeps more in flight; the trainer still drops every sample more than max_staleness "
                "updates old (README: Staleness and concurrency)."})
    deadline_release_versions: int | None = field(default=None, metadata={
        "help": "None (the default): deadline admission, on from the first stale drop, stays on. N >= 1 (opt-in): it "
                "turns off again after N weight updates without a stale drop, 2N, 4N, ... each time a drop turns it "
                "on again; more generation in flight, more samples dropped stale where short groups overtake long "
                "ones; the trainer still drops every sample more than max_staleness updates old (README: Staleness "
                "and concurrency)."})
    deadline_order: str = field(default="pessimistic", metadata={
        "help": "How deadline admission orders what is committed against a group in flight: pessimistic (the "
                "default) all of it counts as pulled before that group; observed (opt-in) the groups started at a "
                "later version count at the largest share of such groups' tokens seen to finish first over the last "
                "64 groups "
                "(rollout/deadline_overtake_share; in full until 16 groups have finished); the trainer still drops "
                "every sample more than max_staleness updates old (README: Staleness and concurrency)."})
    # Logging.
    log_completions: bool = field(default=False, metadata={"help": "Print sample completions every logging step."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "How many; None = all."})
    # Extension: tree-attention backend of packed rows (CONFIG.md `packing.attention`).
    tree_attention: str = field(default="auto", metadata={
        "help": "Tree-attention backend: auto (flex on CUDA, sdpa elsewhere), sdpa, flex or flash (README: Packing and the token budget)."})
    # Extensions: start-up checks of issue #19.
    sampling_mask_fallback: bool = field(default=False, metadata={
        "help": "With top-k/top-p/min-p, accept a server that cannot return candidate sets and normalise over "
                "the full vocabulary (biased importance ratios, README: Sampling filters); False refuses such a server at start."})
    max_groups_without_signal: int = field(default=64, metadata={
        "help": "Stop after this many consecutive groups dropped for zero reward spread or no reward, with a "
                "diagnosis of the reward functions; 0 never stops."})

    group_requests: bool = field(default=True, metadata={
        "help": "One request with n = num_generations per group of single-turn rollouts (no tools, environment, "
                "sampling filters or overridden generate_one / generate_one_turn); False: one request per rollout."})
    request_seeds: bool = field(default=True, metadata={
        "help": "A unique seed with every request (SPEC §3.1); False lets the server draw them (one engine only)."})
    check_weight_sync: bool = field(default=False, metadata={
        "help": "At start, check that a weight sync takes effect on the server (perturb the weights, sync, compare "
                "the server's log-probs of a probe with the trainer's, restore, sync) and stop with the figures if "
                "not; then log weight_sync/probe_gap after every sync. Full-weight sync only (README: GPUs, weight sync and LoRA)."})

    weight_sync_packed: bool = field(default=False, metadata={
        "help": "CUDA-IPC weight sync (colocated vLLM 0.33) in packed chunks through one 1 GiB buffer, one IPC handle "
                "a chunk, instead of one handle per tensor; other sync backends ignore it (README: GPUs, weight sync and "
                "LoRA)."})
    weight_sync_overlap: bool = field(default=False, metadata={
        "help": "Run each weight sync on a background thread while the next step pulls its samples and runs its "
                "forward and backward; that step waits for the sync before its optimizer step "
                "(perf/weight_sync_wait_s). One trainer process only, not with check_weight_sync nor a LoRA model "
                "(README: GPUs, weight sync and LoRA)."})

    def __post_init__(self) -> None:
        import torch

        from .loss_rules import scale_rewards_name

        self.scale_rewards = scale_rewards_name(self.scale_rewards)  # TRL's spelling: True = group, False = none
        check_types(self)  # before any comparison: num_generations="8" must not reach a `<`
        if self.output_dir is not None and not str(self.output_dir).strip():
            from .rules import ConfigError

            raise ConfigError(f"output_dir={self.output_dir!r}: an empty folder name (transformers fails on it "
                              "with FileNotFoundError: ''). Fix: output_dir='outputs/run' (or leave it out for "
                              "transformers' default, trainer_output)", key="output_dir")
        from .errors import Collector

        found = Collector(first_per_key=True)  # both passes' problems come out in one try
        found.run(check_training_arguments, {f.name: getattr(self, f.name) for f in fields(self) if f.init})

        if self.bf16 is None:
            # SPEC §16.4: bf16 unless fp16. Without CUDA, TrainingArguments refuses bf16 unless use_cpu,
            # so a CPU machine resolves to fp32 unless the user asks for bf16 with use_cpu=True.
            self.bf16 = not self.fp16 and (torch.cuda.is_available() or self.use_cpu)
        _resolve_checkpointing_aliases(self)
        if self.optim == "adamw_torch_fused" and not torch.cuda.is_available():
            self.optim = "adamw_torch"
        self.ignore_data_skip = True  # SPEC §12: the live rollout queue cannot be skipped and replayed.
        try:
            found.run(check_fields, {f.name: getattr(self, f.name) for f in fields(self) if f.init})
        except Exception:  # a value the first pass refused broke a rule's arithmetic: its problem is the answer
            if not found.errors:
                raise
        found.raise_if_any()
        super().__post_init__()

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps (``training_args.bin`` in every checkpoint, the spawned rollout worker): every
        field but ``hub_token``, which is never written to disk (the Hub reads ``HF_TOKEN`` from the environment)."""
        state = dict(self.__dict__)
        if state.get("hub_token"):
            state["hub_token"] = None
        return state

    @property
    def effective_epsilon_high(self) -> float:
        """Upper clipping epsilon: ``epsilon_high`` or, when unset, ``epsilon`` (SPEC §3.3.3)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def uses_candidate_sets(self) -> bool:
        """True when top-k/top-p/min-p filtering is on and log-probs are renormalised over candidate sets (SPEC §7)."""
        return self.top_k > 0 or self.top_p < 1 or (self.min_p or 0) > 0
