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

`validate_run` is the CLI's deep pass over a composed config; `validate_trainer_inputs` is the Python
API's (called by `AsyncGRPOTrainer.__init__`). Each problem is one line naming the key, the value, why
and the fix; several independent problems are reported together (`ConfigErrors`). Warnings (B.11's
``repetition_penalty``, SPEC §7's biased fallback) are returned, not raised.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..citations import cite_shipped
from .rules import ConfigError, ConfigErrors, ConfigTypeError, config_error as _err
from .sources import (check_data_source, check_import, check_imports, check_model_source, check_prompt_rows,
                      check_reward_funcs, looks_like_local_data, model_max_len)

__all__ = ["ConfigErrors", "check_data_source", "check_groups", "check_import", "check_imports", "check_lengths",
           "check_model_source", "check_prompt_rows", "check_reward_funcs", "check_training_args_build",
           "check_training_arguments", "check_types", "looks_like_local_data", "model_max_len", "start_warnings",
           "validate_run", "validate_trainer_inputs"]

CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")



class _Collector:
    """Runs independent checks and keeps every `ConfigError` they raise."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []

    def run(self, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except ConfigErrors as exc:
            self.errors.extend(exc.errors)
        except ConfigError as exc:
            self.errors.append(exc)
        except ConfigTypeError as exc:
            self.errors.append(ConfigError(str(exc), key=exc.key))
        return None

    def raise_if_any(self) -> None:
        if self.errors:
            raise ConfigErrors(self.errors) if len(self.errors) > 1 else self.errors[0]


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


def _suggest_value(value: Any, tp: type) -> str:
    if isinstance(value, str):
        try:
            converted = tp(float(value)) if tp is int else tp(value) if tp is float else None
        except ValueError:
            converted = None
        if tp is bool and value.lower() in ("true", "false"):
            converted = value.lower() == "true"
        if converted is not None:
            return repr(converted)
    return f"a {tp.__name__}"


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
                                  f"Fix: pass {key}={_suggest_value(value, tp)}", key=key)


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
    rule(1 <= s.port <= 65535, "sampler.port", s.port, "a TCP port lies in 1..65535", "set sampler.port=8000")
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


# ------------------------------------------------------------------------------------------ the CLI pass
def validate_run(cfg: Any, command: str = "train") -> list[str]:
    """The CLI's deep pass over a composed (already type- and rule-checked) config, before anything starts.

    Args:
        cfg: the composed `DictConfig`.
        command: ``train`` (everything), ``serve`` (model and lengths) or ``doctor`` (model name only).

    Returns:
        Warnings and notes to print.

    Raises:
        ConfigErrors: every problem found (model, lengths, TrainingArguments, imports, dataset, rewards).
    """
    c = _Collector()
    trainer_values = {k: v for k, v in cfg.trainer.items()}
    if command == "train":
        c.run(check_training_arguments, trainer_values, lambda n: f"trainer.{n}")
    folder = None
    if cfg.model.name:
        result = c.run(_model_for_cli, cfg, command == "train")
        if result is not None:
            folder, notes = result
            c.warnings.extend(notes)
    max_len, src = cfg.sampler.max_model_len, ""
    if max_len is None and folder is not None:
        max_len, src = model_max_len(folder), "the model's max_position_embeddings"
    w = c.run(check_lengths, int(cfg.rollout.max_completion_length), max_len, cfg.packing.token_budget,
              len_source=src)
    c.warnings.extend(w or [])
    r = cfg.rollout
    uses_sets = r.top_k > 0 or r.top_p < 1 or (r.min_p or 0) > 0
    c.warnings.extend(start_warnings(float(r.repetition_penalty), uses_sets, bool(r.sampling_mask_fallback)))
    if command != "train":
        c.raise_if_any()
        return c.warnings
    if not c.errors:
        c.run(check_training_args_build, cfg)
    c.run(check_output_dir, cfg.trainer.get("output_dir"))
    imported = c.run(check_imports, cfg)
    c.run(check_data_source, cfg.data.name)
    local = bool(cfg.data.generator) or (bool(cfg.data.name) and looks_like_local_data(str(cfg.data.name)))
    if command == "train" and cfg.data.name and not local and not c.errors:
        c.run(_check_hub_dataset, str(cfg.data.name))
    if not c.errors and local:  # loaded only when local (a Hub dataset is never downloaded by a check) and sound
        from ..data import load_prompts

        ds = c.run(_load_for_check, load_prompts, cfg)
        if ds is not None:
            columns = c.run(check_prompt_rows, ds, "prompt", key="data.prompt_column",
                            dataset_key="data.name" if cfg.data.name else "data.task")
            if columns is not None and imported is not None:
                funcs, paths = imported
                c.run(check_reward_funcs, funcs, columns, lambda i: f"rewards[{i}].func", paths)
            if columns is not None and folder is not None and not c.errors:
                from .prompt_lengths import check_dataset_lengths

                c.run(check_dataset_lengths, ds, folder, cfg)
    c.raise_if_any()
    return c.warnings


_ENUM_KEYS = {"SchedulerType": "lr_scheduler_type", "OptimizerNames": "optim", "SaveStrategy": "save_strategy",
              "IntervalStrategy": "eval_strategy", "HubStrategy": "hub_strategy", "FSDPOption": "fsdp"}


def _listed_values(text: str) -> list[str]:
    """The values a transformers refusal lists (``... please select one of ['a', 'b']``)."""
    found = re.search(r"select one of \[([^\]]*)\]", text)
    return re.findall(r"'([^']*)'", found.group(1)) if found else []


def check_training_args_build(cfg: Any) -> None:
    """Build the `AsyncGRPOConfig` the trainer process will build, so transformers' own refusals (an unknown
    optimizer or schedule, bf16 without a GPU, ...) come now, with the key, instead of from the trainer;
    and check ``trainer.report_to``, which transformers checks only when the trainer is built.

    Raises:
        ConfigError: naming the ``trainer.`` key transformers refused (guessed from its message), its value
            and the fix (the closest accepted value where transformers lists them).
    """
    from .compose import to_training_args

    try:
        args = to_training_args(cfg)
    except (ConfigError, ConfigTypeError):
        raise
    except (ValueError, TypeError) as exc:
        text = str(exc)
        name = next((k for enum, k in _ENUM_KEYS.items() if f"valid {enum}" in text), None)
        if name is None:
            name = next((k for k, v in cfg.trainer.items() if isinstance(v, str) and v and v in text), None)
        if name is None:
            name = next((k for k in ("bf16", "fp16", "use_cpu", "torch_compile") if k in text.lower()), None)
        key = f"trainer.{name}" if name else "trainer"
        value = cfg.trainer.get(name) if name else None
        close = difflib.get_close_matches(str(value), _listed_values(text), n=1, cutoff=0.0) if name else []
        fix = ("set trainer.bf16=false (this machine has no CUDA GPU), or trainer.use_cpu=true"
               if name == "bf16" or "bf16" in text else f"{key}={close[0]}" if close
               else "see transformers.TrainingArguments for the field")
        listed = _listed_values(text) if name else []
        reason = (f"transformers accepts one of {', '.join(listed)}" if listed else
                  f"transformers refuses it: {text if len(text) <= 400 else text[:400].rsplit(' ', 1)[0] + ' ...'}")
        raise _err(key, value, reason, fix) from None
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    known = sorted(INTEGRATION_TO_CALLBACK)
    trackers = list(args.report_to or [])
    check_trackers_installed(t for t in trackers if t in INTEGRATION_TO_CALLBACK)
    for tracker in trackers:
        if tracker not in INTEGRATION_TO_CALLBACK:
            close = difflib.get_close_matches(tracker, known, n=1)
            fixed = [t for t in ((close[0] if close else "") if t == tracker else t for t in trackers)
                     if t in INTEGRATION_TO_CALLBACK]
            fix = "none" if not fixed else fixed[0] if len(fixed) == 1 else f"[{','.join(fixed)}]"
            raise _err("trainer.report_to", tracker, f"not a tracker transformers knows (one of {', '.join(known)}, "
                       "or none)", f"trainer.report_to={fix}")


TRACKER_PACKAGES = {"trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml",
                    "neptune": "neptune", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab",
                    "tensorboard": ("tensorboard", "tensorboardX")}
"""The package each ``report_to`` tracker needs (transformers looks for it only when the trainer is built)."""


def check_trackers_installed(trackers: Iterable[str]) -> None:
    """Every tracker of ``trainer.report_to`` is importable.

    Raises:
        ConfigError: naming the tracker, the missing package and the fix.
    """
    import importlib.util

    for tracker in trackers:
        packages = TRACKER_PACKAGES.get(tracker)
        if packages is None:
            continue
        packages = (packages,) if isinstance(packages, str) else packages
        if not any(importlib.util.find_spec(p) is not None for p in packages):
            raise _err("trainer.report_to", tracker, f"{packages[0]} is not installed, and transformers needs it to "
                       "report there", f"pip install {packages[0]}, or drop it from trainer.report_to (none to "
                       "report nowhere)")


def check_output_dir(output_dir: Any) -> None:
    """``trainer.output_dir`` can be created and written (checked without creating anything: the nearest
    existing folder on its path must be a writable folder).

    Raises:
        ConfigError: naming the folder, what is in the way and the fix.
    """
    import os

    out = Path(str(output_dir)).expanduser().resolve() if output_dir else Path.cwd()  # default: under it
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    problem = None
    if not probe.is_dir():
        problem = f"{probe} is a file, not a folder"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{probe} is not writable by this user"
    if problem:
        raise _err("trainer.output_dir", str(out), f"not writable ({problem})",
                   "choose a writable folder with trainer.output_dir=...")


def _model_for_cli(cfg: Any, probe_hub: bool = False) -> tuple[Path | None, list[str]]:
    from ..models import plan_model_path

    try:
        path, gguf = plan_model_path(str(cfg.model.name), cfg.model.gguf_file)
    except ConfigError:  # a missing GGUF package: serve and train report it themselves (a dry run as a note)
        if Path(str(cfg.model.name)).expanduser().is_dir():  # a folder without the recipe's GGUF: refused now
            raise
        return None, []
    if gguf is not None:  # exported on the first start; the GGUF carries the chat template
        return None, []
    return check_model_source(path, "model.name", probe_hub=probe_hub)


def _check_hub_dataset(name: str) -> None:
    """A Hub dataset needs the Hub unless ``datasets`` runs offline on its cache (``HF_DATASETS_OFFLINE``)."""
    import os

    from .sources import check_hub_reachable

    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        return  # datasets reads its cache (and says so itself when the dataset is not there)
    check_hub_reachable(name, "data.name", what="dataset")


def _load_for_check(load_prompts: Callable[[Any], Any], cfg: Any) -> Any:
    from datasets.utils import logging as ds_logging

    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()  # a check prints its verdict, not "Generating train split"
    try:
        return load_prompts(cfg)
    except ConfigError:
        raise
    except FileNotFoundError as exc:
        raise _err("data.name", cfg.data.name, f"datasets could not find it ({exc})",
                   "set data.name to an existing file or folder, or a Hub dataset id") from None
    except Exception as exc:  # noqa: BLE001 - datasets' errors are many; name the key and the cause
        key = "data.name" if cfg.data.name else "data.task"
        raise _err(key, cfg.data.name or cfg.data.task, f"loading the prompts failed ({type(exc).__name__}: "
                   f"{str(exc)[:300]})", "check the path, data.subset and data.split") from None
    finally:
        if bars:
            ds_logging.enable_progress_bar()


# ------------------------------------------------------------------------------------------ the API pass
def validate_trainer_inputs(model: Any, reward_funcs: Any, args: Any, train_dataset: Any,
                            environment_factory: Any = None, processing_class: Any = None) -> list[str]:
    """The Python API's pass (`AsyncGRPOTrainer.__init__`): model, dataset and reward functions.

    The config's own fields were checked when the `AsyncGRPOConfig` was built (`check_types`,
    `check_training_arguments` and the rules of SPEC §2/§3/§7).

    Returns:
        Warnings to log.

    Raises:
        ConfigErrors (a ValueError): every problem, each naming the argument, the value and the fix.
        ConfigTypeError: ``args`` is not an `AsyncGRPOConfig`.
    """
    from ..train.config import AsyncGRPOConfig

    if args is not None and not isinstance(args, AsyncGRPOConfig):
        raise ConfigTypeError(f"args={type(args).__name__}: must be an AsyncGRPOConfig. Fix: "
                              "args=AsyncGRPOConfig(output_dir=..., ...)", key="args")
    from ..rollout.worker import main_guard_message, unguarded_main_call

    c = _Collector()
    where = unguarded_main_call()
    if where is not None:
        c.errors.append(ConfigError(main_guard_message(*where), key="__main__"))
    if isinstance(model, str):
        c.run(check_model_source, model, "model", needs_chat_template=processing_class is None)
    if processing_class is not None and hasattr(processing_class, "apply_chat_template") and \
            not getattr(processing_class, "chat_template", None):
        c.errors.append(_err("processing_class", type(processing_class).__name__, "the tokenizer has no chat template, "
                             "and prompts are chat messages rendered with it (SPEC §2)",
                             "use an instruct/chat model's tokenizer, or set tokenizer.chat_template"))
    elif model is None:
        c.errors.append(_err("model", None, "no model", "pass a Hub id, a local folder or a PreTrainedModel"))
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else ([reward_funcs] if reward_funcs else [])
    if not funcs and environment_factory is None:
        c.errors.append(_err("reward_funcs", reward_funcs, "rollouts could not be scored",
                             "pass reward_funcs=[a function]"))
    columns = None
    if train_dataset is None:
        if environment_factory is None:  # environment-owned data needs no dataset (SPEC §13.2)
            c.errors.append(_err("train_dataset", None, "the async GRPO trainer needs prompts",
                                 "pass a datasets.Dataset with a 'prompt' column of chat messages, or an "
                                 "environment_factory whose reset() supplies them"))
    elif environment_factory is None:
        columns = c.run(check_prompt_rows, train_dataset, "prompt", key="train_dataset['prompt']",
                        dataset_key="train_dataset", allow_text=False)
    else:
        columns = list(getattr(train_dataset, "column_names", None) or [])
    if funcs:
        c.run(check_reward_funcs, funcs, columns,
              lambda i: f"reward_funcs[{i}]" if isinstance(reward_funcs, (list, tuple)) else "reward_funcs")
    c.raise_if_any()
    if args is not None:
        c.warnings.extend(start_warnings(float(args.repetition_penalty), args.uses_candidate_sets,
                                         bool(args.sampling_mask_fallback), penalty_key="repetition_penalty",
                                         fallback_key="sampling_mask_fallback"))
    return c.warnings
