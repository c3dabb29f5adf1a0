"""The validation pass that runs before any process starts (CLI and Python API alike, issue #19).

Everything a user can get wrong is checked here, before a server, a trainer or a worker exists:

- `check_types`: the type of every scalar field of `AsyncGRPOConfig` (the CLI gets this from OmegaConf).
- `check_training_arguments`: ranges and cross-field rules of the `TrainingArguments` fields the async
  trainer reads (gradient accumulation, learning rate, steps, schedule, checkpoints).
- `check_lengths`: ``max_completion_length`` against the sampler's ``max_model_len`` (else HTTP 400 on the
  first request) and the token budget.
What a run reads is checked in `asyncgrpo_cli.config.sources` (re-exported here):

- `check_model_source`: a local folder that exists and holds a chat template, or a well-formed Hub id
  (looked up in the local cache only; nothing is downloaded).
- `check_prompt_rows` / `check_reward_funcs`: a non-empty dataset whose prompt column is chat or text, and
  reward functions that accept what the worker passes them and find the columns they ask for.
- `check_imports`: every ``module:function`` of the config, with the closest names on a typo.

The deep passes that use them are in `asyncgrpo_cli.config.run_checks`: `validate_run` over a composed
config (CLI) and `validate_trainer_inputs` (the Python API's, called by `AsyncGRPOTrainer.__init__`).
Each problem is one line naming the key, the value, why and the fix; several independent problems are
reported together (`ConfigErrors`). Warnings (B.11's ``repetition_penalty``, SPEC §7's biased fallback)
are returned, not raised.
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .citations import cite_shipped
from .rules import ConfigError, ConfigErrors, ConfigTypeError, config_error as _err
from .sources import (check_data_source, check_import, check_imports, check_model_source, check_prompt_rows,
                      check_reward_funcs, looks_like_local_data, model_max_len)

__all__ = ["ConfigErrors", "check_data_source", "check_groups", "check_import", "check_imports", "check_lengths",
           "check_model_source", "check_prompt_rows", "check_reward_funcs", "check_training_arguments",
           "check_types", "looks_like_local_data", "model_max_len", "start_warnings"]

CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")



# ------------------------------------------------------------------------------------------ types
def _scalar_types(tp: Any) -> tuple[tuple[type, ...], bool] | None:
    """(accepted scalar types, None allowed) of an annotation, or None when it is not a plain scalar."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = list(typing.get_args(tp))
        optional = type(None) in args
        args = [a for a in args if a is not type(None)]
        if len(args) != 1:
            return None
        tp = args[0]
    if tp in (bool, int, float, str):
        return (tp,), optional
    return None


def _type_ok(value: Any, accepted: tuple[type, ...]) -> bool:
    import numbers

    tp = accepted[0]
    if tp is bool:
        return isinstance(value, (bool, np_bool_types()))
    if tp is int:  # numpy integers count as ints
        return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np_bool_types()))
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, (bool, np_bool_types()))
    return isinstance(value, str)


def np_bool_types() -> tuple[type, ...]:
    """numpy's bool type when numpy is importable (it is a numbers.Integral look-alike that is not a count)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - a core dependency
        return ()
    return (np.bool_,)


def _suggest_value(value: Any, tp: type, default: Any = None) -> str:
    """A value of type ``tp`` to suggest for ``value`` (converted, else ``default``), as Python source; "" if none."""
    if tp is int and isinstance(value, float) and value.is_integer():
        return repr(int(value))
    if isinstance(value, str):
        try:
            converted = tp(float(value)) if tp is int else tp(value) if tp is float else None
        except ValueError:
            converted = None
        if tp is bool and value.lower() in ("true", "false"):
            converted = value.lower() == "true"
        if converted is not None:
            return repr(converted)
    if isinstance(default, tp) and not (tp is int and isinstance(default, bool)):
        return repr(default)
    return ""


def check_types(obj: Any, names: Iterable[str] | None = None,
                path_of: Callable[[str], str] = lambda n: n) -> None:
    """Check the type of every plain-scalar field of a dataclass instance (e.g. an `AsyncGRPOConfig`).

    Args:
        obj: the dataclass instance.
        names: the fields to check (default: every field whose annotation is bool/int/float/str, optional or not).
        path_of: maps a field name to the name the user typed.

    Raises:
        ConfigTypeError: on the first field of the wrong type, naming it, its value and the type wanted.
    """
    import dataclasses

    hints = typing.get_type_hints(type(obj))
    wanted = set(names) if names is not None else None
    for f in dataclasses.fields(obj):
        if not f.init or (wanted is not None and f.name not in wanted):
            continue
        spec = _scalar_types(hints.get(f.name))
        if spec is None:
            continue
        accepted, optional = spec
        value = getattr(obj, f.name)
        if value is None and optional:
            continue
        if value is None or not _type_ok(value, accepted):
            key = path_of(f.name)
            tp = accepted[0]
            raise ConfigTypeError(f"{key}={value!r}: must be {'an' if tp is int else 'a'} {tp.__name__}"
                                  f"{' or None' if optional else ''}, got {type(value).__name__}. "
                                  + (f"Fix: pass {key}={v}" if (v := _suggest_value(value, tp, f.default)) else
                                     f"Fix: pass {key} as {'an int' if tp is int else 'a ' + tp.__name__}"), key=key)


# ------------------------------------------------------------------------------------------ TrainingArguments
def check_training_arguments(values: Mapping[str, Any], path_of: Callable[[str], str] = lambda n: n) -> None:
    """Ranges and cross-field rules of the `TrainingArguments` fields the async trainer reads.

    Args:
        values: field name → value (`TrainingArguments` names, e.g. ``gradient_accumulation_steps``).
        path_of: maps a field name to the name the user typed (``trainer.learning_rate`` in the CLI).

    Raises:
        ConfigErrors: every rule broken, each naming the key, the value and the fix.
    """
    p, g = path_of, values.get
    errors: list[ConfigError] = []

    def bad(name: str, problem: str, fix: str) -> None:
        errors.append(_err(p(name), g(name), problem, fix))

    def number(name: str) -> float | None:
        v = g(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    ga = number("gradient_accumulation_steps")
    if ga is not None and ga < 1:
        bad("gradient_accumulation_steps", "a step needs at least one micro-batch (SPEC §6.3)",
            f"set {p('gradient_accumulation_steps')}=1 (or more micro-batches per optimizer step)")
    lr = number("learning_rate")
    if lr is not None and (not math.isfinite(lr) or lr < 0):
        bad("learning_rate", "must be a finite number >= 0", f"set {p('learning_rate')}=1e-6")
    max_steps = number("max_steps")
    epochs = number("num_train_epochs")
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        bad("max_steps", "trains nothing; -1 means: train num_train_epochs passes over the prompts",
            f"set {p('max_steps')} to the number of optimizer steps, or -1 with {p('num_train_epochs')}")
    if max_steps is not None and max_steps < 0 and epochs is not None and epochs <= 0:
        bad("num_train_epochs", f"with {p('max_steps')}=-1 the run length is num_train_epochs, which must be > 0",
            f"set {p('num_train_epochs')}=1, or {p('max_steps')} to a number of steps")
    schedule = g("lr_scheduler_type")
    schedule = getattr(schedule, "value", schedule)
    if max_steps is not None and max_steps < 0 and schedule is not None and str(schedule) not in CONSTANT_SCHEDULES:
        bad("lr_scheduler_type", f"a decaying schedule needs the number of steps in advance, and with "
            f"{p('max_steps')}=-1 it is unknown (a step is a token budget of rows, not a number of prompts)",
            f"set {p('max_steps')} to the number of steps, or {p('lr_scheduler_type')}=constant")
    warmup = number("warmup_steps")
    if warmup is not None and warmup < 0:
        bad("warmup_steps", "must be >= 0", f"set {p('warmup_steps')}=0")
    elif warmup is not None and 0 < warmup < 1 and max_steps is not None and max_steps < 0:
        bad("warmup_steps", f"a warmup below 1 is a fraction of the run, unknown with {p('max_steps')}=-1",
            f"give {p('warmup_steps')} as a number of steps (e.g. 10), or set {p('max_steps')}")
    for name, fix in (("weight_decay", "0.0"), ("max_grad_norm", "1.0")):
        v = number(name)
        if v is not None and (not math.isfinite(v) or v < 0):
            bad(name, "must be a finite number >= 0", f"set {p(name)}={fix}")
    for name, fix in (("adam_beta1", "0.9"), ("adam_beta2", "0.999")):
        v = number(name)
        if v is not None and not 0 <= v < 1:
            bad(name, "must lie in [0, 1)", f"set {p(name)}={fix}")
    eps = number("adam_epsilon")
    if eps is not None and eps <= 0:
        bad("adam_epsilon", "must be > 0", f"set {p('adam_epsilon')}=1e-8")
    logging_steps = number("logging_steps")
    if logging_steps is not None and logging_steps <= 0:
        bad("logging_steps", "must be > 0 (steps between metric windows)", f"set {p('logging_steps')}=1")
    save_strategy = g("save_strategy")
    save_strategy = getattr(save_strategy, "value", save_strategy)
    save_steps = number("save_steps")
    if save_steps is not None and save_steps <= 0 and str(save_strategy or "steps") == "steps":
        bad("save_steps", "must be > 0 with save_strategy=steps", f"set {p('save_steps')}=100, or "
            f"{p('save_strategy')}=no")
    limit = number("save_total_limit")
    if limit is not None and limit < 1:
        bad("save_total_limit", "must be >= 1 checkpoint kept (or null for all)",
            f"set {p('save_total_limit')}=1, or null to keep every checkpoint")
    seed = number("seed")
    if seed is not None and seed < 0:
        bad("seed", "must be >= 0", f"set {p('seed')}=42")
    checkpointing = g("activation_checkpointing_kwargs") or g("gradient_checkpointing_kwargs")
    if checkpointing:  # transformers' Trainer reads it; so does this one (`train.checkpointing`)
        from .checkpointing_rules import checkpoint_every, checkpointing_options

        try:
            checkpointing_options(checkpointing, p("activation_checkpointing_kwargs"))
            invalid = None
        except ConfigError as exc:
            invalid = exc
        if checkpoint_every(values) == 0:  # both problems at once: one round to fix them (fresh-user trial)
            off = (f"{p('activation_checkpointing')} is false in this config (a recipe may turn it off, as the CPU "
                   "smoke recipe does)")
            if invalid is None:
                bad("activation_checkpointing_kwargs", f"has no effect: {off}",
                    f"set {p('activation_checkpointing')}=true, or remove {p('activation_checkpointing_kwargs')}")
            else:
                errors.append(ConfigError(f"{str(invalid).rstrip('.')}. It would also have no effect: {off}; set "
                                          f"{p('activation_checkpointing')}=true as well, or remove "
                                          f"{p('activation_checkpointing_kwargs')}", key=invalid.key))
        elif invalid is not None:
            errors.append(invalid)
    bs = number("per_device_train_batch_size")
    if bs is not None and bs < 1:
        bad("per_device_train_batch_size", "must be >= 1 (it is unused: rows are filled by token budget)",
            f"remove {p('per_device_train_batch_size')}")
    if errors:
        raise ConfigErrors(errors)


# ------------------------------------------------------------------------------------------ other CLI groups
def check_groups(cfg: Any) -> None:
    """Ranges of the composed config's fields that `AsyncGRPOConfig` does not carry (sampler, peft, launch,
    data, logging, the tool-calling limit).

    Raises:
        ConfigErrors: every field out of range, each naming the Hydra path, the value and the fix.
    """
    errors: list[ConfigError] = []

    def rule(ok: bool, key: str, value: Any, problem: str, fix: str) -> None:
        if not ok:
            errors.append(_err(key, value, problem, fix))

    s, pe, la, lo, r = cfg.sampler, cfg.peft, cfg.launch, cfg.logging, cfg.rollout
    if not 1 <= s.port <= 65535:  # the fix names a port free here now (8000, the default, may be taken)
        rule(False, "sampler.port", s.port, "a TCP port lies in 1..65535", f"use a free port, e.g. "
             f"sampler.port={free_port(near=7999)}")
    rule(s.gpu_memory_utilization is None or 0 < s.gpu_memory_utilization <= 1, "sampler.gpu_memory_utilization",
         s.gpu_memory_utilization, "a share of the GPU memory lies in (0, 1]", "set it to 0.9, or null for vLLM's default")
    rule(s.kv_cache_tokens is None or s.kv_cache_tokens >= 1, "sampler.kv_cache_tokens", s.kv_cache_tokens,
         "must be >= 1 token", "set it to a few times sampler.max_model_len, or null")
    rule(str(s.device) == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", str(s.device)) is not None, "sampler.device",
         s.device, "must be cpu, cuda, cuda:N or auto", "set sampler.device=auto")
    rule(pe.lora_alpha > 0, "peft.lora_alpha", pe.lora_alpha, "must be > 0", "set peft.lora_alpha to 2 * peft.r")
    rule(0 <= pe.lora_dropout < 1, "peft.lora_dropout", pe.lora_dropout, "must lie in [0, 1)", "set peft.lora_dropout=0.0")
    rule(la.cpu_processes >= 1, "launch.cpu_processes", la.cpu_processes, "must be >= 1 process",
         "set launch.cpu_processes=1")
    rule(la.num_machines >= 1, "launch.num_machines", la.num_machines, "must be >= 1", "set launch.num_machines=1")
    rule(0 <= la.machine_rank < max(1, la.num_machines), "launch.machine_rank", la.machine_rank,
         f"must lie in 0..launch.num_machines-1 (= {la.num_machines - 1})", "set launch.machine_rank=0 on the first machine")
    rule(la.main_process_port is None or 1 <= la.main_process_port <= 65535, "launch.main_process_port",
         la.main_process_port, "a TCP port lies in 1..65535", "set launch.main_process_port=29500, or null")
    rule(lo.num_completions_to_print is None or lo.num_completions_to_print >= 0, "logging.num_completions_to_print",
         lo.num_completions_to_print, "must be >= 0", "set it to 4, or null for all")
    rule(r.max_tool_calling_iterations is None or r.max_tool_calling_iterations >= 0,
         "rollout.max_tool_calling_iterations", r.max_tool_calling_iterations, "must be >= 0 turns",
         "set it to 10, or null for no limit")
    rule(cfg.data.seed >= 0, "data.seed", cfg.data.seed, "must be >= 0", "set data.seed=0")
    factory = (cfg.get("environment") or {}).get("factory")
    if isinstance(factory, Mapping) and not cfg.data.name and not cfg.data.generator:
        rule(False, "environment.factory", dict(factory), "a dict of environments routes every example by its "
             f"{ENVIRONMENT_COLUMN!r} field (SPEC §16.1), and no dataset is given (data.name, data.generator)",
             f"set data.name to a dataset with an {ENVIRONMENT_COLUMN!r} column, or give one environment "
             "(environment.factory=module:Class)")
    priority = la.get("mps_trainer_priority", "normal")
    low = str(priority).lower()  # the fix: the spelling meant (BELOW_NORMAL, low, below), else the default
    cased = low if low in MPS_PRIORITIES else "below_normal" if "low" in low else "normal"
    rule(priority in MPS_PRIORITIES, "launch.mps_trainer_priority", priority,
         f"must be one of {', '.join(MPS_PRIORITIES)}", f"set launch.mps_trainer_priority={cased}")
    rule(priority not in MPS_PRIORITIES or priority == "normal" or la.mps is not False, "launch.mps_trainer_priority",
         priority, "a priority among the clients of an MPS daemon, and launch.mps=false starts none",
         "set launch.mps_trainer_priority=normal (or, where vLLM and the trainer share a GPU, launch.mps=null or true)")
    rule(la.stop_timeout is None or la.stop_timeout > 0, "launch.stop_timeout", la.stop_timeout,
         "the seconds the trainer gets to save after a stop must be > 0",
         "set launch.stop_timeout=300, or null to derive it from the measured step and save times")
    rule(s.url is None or re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?(/\S*)?", str(s.url)) is not None, "sampler.url",
         s.url, "not an http(s) URL", "set sampler.url=http://HOST:PORT (e.g. http://127.0.0.1:8000)")
    out = cfg.trainer.get("output_dir")
    rule(out is None or bool(str(out).strip()), "trainer.output_dir", out,
         "an empty folder name (it would become ./outputs/run silently)",
         "set trainer.output_dir=PATH, or leave it out for the default")
    if errors:
        raise ConfigErrors(errors)


#: ``launch.mps_trainer_priority``'s values, in ``CUDA_MPS_CLIENT_PRIORITY``'s order (0, 1).
MPS_PRIORITIES = ("normal", "below_normal")

#: The dataset column that routes an example to one of a dict of environments (SPEC §16.1).
ENVIRONMENT_COLUMN = "environment"


def check_environment_column(factory: Any, columns: Sequence[str]) -> None:
    """With a dict ``environment.factory``, the loaded dataset must have the ``environment`` column.

    Raises:
        ConfigError: the columns lack it (names the columns and the fix).
    """
    if isinstance(factory, Mapping) and ENVIRONMENT_COLUMN not in columns:
        raise _err("environment.factory", dict(factory), f"a dict of environments routes every example by its "
                   f"{ENVIRONMENT_COLUMN!r} field (SPEC §16.1), and the dataset's columns {list(columns)} have none",
                   f"add an {ENVIRONMENT_COLUMN!r} column naming one of {sorted(factory)} per row, or give one "
                   "environment (environment.factory=module:Class)")


# ------------------------------------------------------------------------------------------ lengths
def check_lengths(max_completion_length: int, max_model_len: int | None, token_budget: int | None = None, *,
                  completion_key: str = "rollout.max_completion_length", len_key: str = "sampler.max_model_len",
                  budget_key: str = "packing.token_budget", len_source: str = "") -> list[str]:
    """A completion must leave room for a prompt under ``max_model_len``; the token budget should hold a sample.

    Args:
        max_completion_length: max generated tokens per request.
        max_model_len: the server's length limit in tokens (None: unknown, nothing is checked).
        token_budget: forwarded tokens per row (None = ``max_model_len``).
        len_source: where ``max_model_len`` came from when it is not the config (e.g. the model's config.json).

    Returns:
        Warnings (a token budget below ``max_model_len`` drops the longest samples, SPEC §6.4).

    Raises:
        ConfigError: ``max_completion_length >= max_model_len`` (vLLM answers HTTP 400 to every request).
    """
    warnings: list[str] = []
    if max_model_len is None:
        return warnings
    if max_completion_length >= max_model_len:
        src = f" ({len_source})" if len_source else ""
        raise _err(completion_key, max_completion_length,
                   f"not below {len_key}={max_model_len}{src}: no prompt fits, and the server answers HTTP 400 "
                   "to every request", f"set {completion_key} <= {max_model_len} minus your longest prompt (e.g. "
                   f"{max(1, max_model_len // 2)}), or raise {len_key} to the longest prompt + {max_completion_length}")
    if token_budget is not None and token_budget < max_model_len:
        warnings.append(f"{budget_key}={token_budget} is below {len_key}={max_model_len}: samples longer than "
                        "the budget are dropped, not trained (batch/dropped_oversize_count)")
    return warnings


# ------------------------------------------------------------------------------------------ warnings
def start_warnings(repetition_penalty: float, uses_candidate_sets: bool, fallback: bool, *,
                   penalty_key: str = "rollout.repetition_penalty",
                   fallback_key: str = "rollout.sampling_mask_fallback") -> list[str]:
    """Warnings to print at start: B.11's repetition penalty and SPEC §7's biased fallback."""
    out = []
    if repetition_penalty != 1.0:
        out.append(f"{penalty_key}={repetition_penalty:g}: the sampler's processed log-probs include a repetition "
                   "penalty the trainer does not reproduce, so importance ratios are biased (SPEC B.11). Set it to "
                   "1.0 unless you accept that")
    if fallback and uses_candidate_sets:
        out.append(f"{fallback_key}=true: if the server cannot return candidate sets, the trainer normalises over "
                   "the full vocabulary and every importance ratio is biased (SPEC §7); watch the importance ratio "
                   "in the panels (sampling/importance_sampling_ratio/mean should stay near 1)")
    return [cite_shipped(w) for w in out]


def free_port(near: int | None = None) -> int:
    """A TCP port free on this machine right now (a fix's example, the single-machine rendezvous; 8000 when none can
    be bound here).

    Args:
        near: a port to stay close to (a user kept to a range of ports reads ``sampler.port=8172`` after a busy
            8171 better than a random high port): the first free one of the 100 after it, else any.
    """
    import socket

    def bound(port: int) -> int | None:  # the port bound (the kernel's pick for 0), None when taken
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))
                return int(sock.getsockname()[1])
        except OSError:
            return None

    near_ones = range(max(near + 1, 1024), min(near + 101, 65536)) if near is not None and 1 <= near <= 65535 else ()
    return next((got for port in (*near_ones, 0) if (got := bound(port)) is not None), 8000)
