"""The deep checks of a whole run, before any process starts (CLI and Python API alike, issue #19).

`validate_run` is the CLI's pass over a composed config (`asyncgrpo train/serve/doctor`, ``--dry-run`` and
``config --check``): model, lengths, the `AsyncGRPOConfig` transformers will build, imports, dataset and
rewards. `validate_trainer_inputs` is the Python API's (called by `AsyncGRPOTrainer.__init__`). Both use
the value checks of `asyncgrpo_cli.config.validate` and report every independent problem together
(`ConfigErrors`), each naming the key, the value, why and the fix; warnings are returned, not raised.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .errors import Collector as _Collector
from .rules import ConfigError, ConfigErrors, ConfigTypeError, config_error as _err, weight_sync_overlap_refusals
from .sources import (check_data_source, check_imports, check_model_source, check_prompt_rows, check_reward_funcs,
                      looks_like_local_data, model_max_len)
from .loss_rules import loss_warnings
from .notes import Note
from .reward_probe import probe_reward_funcs
from .start_checks import check_agent_imports, check_external_sampler, check_flash_kernel, check_peft_targets
from .validate import check_environment_column, check_lengths, check_training_arguments, start_warnings

__all__ = ["check_training_args_build", "validate_run", "validate_trainer_inputs"]


# ------------------------------------------------------------------------------------------ the CLI pass
def validate_run(cfg: Any, command: str = "train", *, probe: bool = False) -> list[str]:
    """The CLI's deep pass over a composed (already type- and rule-checked) config, before anything starts.

    Args:
        cfg: the composed `DictConfig`.
        command: ``train`` (everything), ``serve`` (model and lengths) or ``doctor`` (model name only).
        probe: also ask the network what the run will need of it (``train`` only): an external sampler
            answers at ``sampler.url`` (`start_checks.check_external_sampler`).

    Returns:
        Warnings and notes to print.

    Raises:
        ConfigErrors: every problem found (model, lengths, TrainingArguments, imports, dataset, rewards).
    """
    c = _Collector(first_per_key=True)  # a key two checks refuse is named once, by the first
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
    c.warnings.extend(loss_warnings(dict(cfg.loss), lambda n: f"loss.{n}"))
    if command == "train":
        st = cfg.staleness
        c.warnings.extend(in_flight_estimate_notes(str(st.in_flight_estimate), int(st.max_staleness),
                                                   lambda n: f"staleness.{n}"))
        c.warnings.extend(deadline_order_notes(str(st.deadline_order), int(st.max_staleness),
                                               lambda n: f"staleness.{n}"))
        c.warnings.extend(check_weight_sync_notes(bool(cfg.sampler.check_weight_sync), bool(cfg.peft.enabled),
                                                  lambda n: f"sampler.{n}"))
        backend = str(getattr(cfg.sampler.backend, "value", cfg.sampler.backend))
        if cfg.sampler.weight_sync_packed and (backend != "vllm" or cfg.peft.enabled):
            c.warnings.append(f"sampler.weight_sync_packed=true has no effect here (sampler.backend={backend}"
                              f"{', LoRA adapter sync' if cfg.peft.enabled else ''}): only the CUDA-IPC full-weight "
                              "sync of a colocated vLLM sends packed chunks")
        if cfg.sampler.weight_sync_overlap:  # several trainer processes: the launch plan refuses them
            for refusal in weight_sync_overlap_refusals(check_weight_sync=bool(cfg.sampler.check_weight_sync),
                                                        lora=bool(cfg.peft.enabled), processes=None,
                                                        key=lambda n: f"sampler.{n}", lora_key="peft.enabled=true"):
                c.add(refusal)
            if int(st.max_staleness) == 0:
                c.warnings.append("sampler.weight_sync_overlap=true overlaps nothing at staleness.max_staleness=0: the "
                                  "next step trains samples of the new weights only, so it waits for the sync anyway")
    if command != "train":
        c.raise_if_any()
        return c.warnings
    if not c.errors:
        c.run(check_training_args_build, cfg)
    else:  # the build would stop at those problems: its enum-valued fields are checked all the same
        for error in _enum_refusals(cfg):
            c.add(error)
    c.run(check_output_dir, cfg.trainer.get("output_dir"))
    c.run(check_flash_kernel, cfg.packing.attention)
    if probe:
        c.run(check_external_sampler, cfg)
    imported = c.run(check_imports, cfg)
    c.run(check_agent_imports, cfg)
    if cfg.peft.enabled and not c.errors:
        c.run(check_peft_targets, cfg, folder)
    c.run(check_data_source, cfg.data.name)
    local = bool(cfg.data.generator) or (bool(cfg.data.name) and looks_like_local_data(str(cfg.data.name)))
    if command == "train" and cfg.data.name and not local and not c.errors:
        c.run(_check_hub_dataset, str(cfg.data.name), cfg.data.subset)
    if not c.errors and local:  # loaded only when local (a Hub dataset is never downloaded by a check) and sound
        from ..data import load_prompts

        ds = c.run(_load_for_check, load_prompts, cfg)
        if ds is not None:
            columns = c.run(check_prompt_rows, ds, "prompt", key="data.prompt_column",
                            dataset_key="data.name" if cfg.data.name else "data.task")
            if columns is not None:
                c.run(check_environment_column, (cfg.get("environment") or {}).get("factory"), columns)
            if columns is not None and imported is not None:
                funcs, paths = imported
                before = len(c.errors)
                c.run(check_reward_funcs, funcs, columns, lambda i: f"rewards[{i}].func", paths)
                row = _first_row(ds) if len(c.errors) == before else None
                if row is not None:  # each reward called once (issue #45)
                    c.warnings.extend(c.run(probe_reward_funcs, funcs, row, lambda i: f"rewards[{i}].func",
                                            paths, skip=[not spec.get("probe", True) for spec in cfg.rewards],
                                            skip_hint=lambda i: f"add probe: false to rewards[{i}] (in a recipe; on "
                                            f"the command line 'rewards=[{{func: {paths[i]}, probe: false}}]' with "
                                            "the other entries as they are)") or [])
            if columns is not None and folder is not None and not c.errors:
                from .prompt_lengths import check_dataset_lengths

                c.run(check_dataset_lengths, ds, folder, cfg)
    c.run(check_cli_eval, cfg, imported if not c.errors else None)
    c.raise_if_any()
    return c.warnings


def check_cli_eval(cfg: Any, imported: Any = None) -> None:
    """``trainer.eval_strategy`` / ``trainer.eval_steps`` against ``data.eval_*`` (README "Evaluation"); local
    eval prompts are loaded and checked like the training ones (prompt column, reward columns, ground truth).

    Raises:
        ConfigError / ConfigErrors: naming the ``trainer.eval_*`` or ``data.eval_*`` key, its value and the fix.
    """
    from ..data import has_eval_prompts, load_eval_prompts
    from .eval_rules import check_eval_dataset, check_eval_setup

    t, data = cfg.trainer, cfg.data
    steps = t.get("eval_steps") if t.get("eval_steps") is not None else t.get("logging_steps")  # transformers' fallback
    key = "data.eval_generator" if data.get("eval_generator") else "data.eval_name"
    has = has_eval_prompts(cfg)
    check_eval_setup(t.get("eval_strategy"), steps, has, eval_on_start=bool(t.get("eval_on_start")),
                     strategy_key="trainer.eval_strategy", steps_key="trainer.eval_steps", data_key=key,
                     data_fix="set data.eval_name=PATH_OR_HUB_ID (or data.eval_generator=reasoning_gym "
                     "data.eval_size=64)", environment=has and bool((cfg.get("environment") or {}).get("factory")),
                     on_start_key="trainer.eval_on_start")
    if not has:
        return
    if data.get("eval_name"):
        check_data_source(data.eval_name, key="data.eval_name")
        if not looks_like_local_data(str(data.eval_name)):
            return  # a Hub dataset is never downloaded by a check
    from datasets.utils import logging as ds_logging

    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()  # a check prints its verdict, not "Generating train split"
    try:
        ds = load_eval_prompts(cfg)
    finally:
        if bars:
            ds_logging.enable_progress_bar()
    funcs, paths = imported if imported is not None else ([], None)
    check_eval_dataset(ds, funcs, key, lambda i: f"rewards[{i}].func (on {key})", paths)


#: How many of the values a transformers refusal lists are shown (the closest to the value given).
LISTED_SHOWN = 8


def _listed_values(text: str) -> list[str]:
    """The values a transformers refusal lists (``... please select one of ['a', 'b']``)."""
    found = re.search(r"select one of \[([^\]]*)\]", text)
    return re.findall(r"'([^']*)'", found.group(1)) if found else []


_ENUM_FIELDS = {"lr_scheduler_type": "SchedulerType", "optim": "OptimizerNames", "save_strategy": "SaveStrategy",
                "eval_strategy": "IntervalStrategy", "logging_strategy": "IntervalStrategy",
                "hub_strategy": "HubStrategy"}
"""`TrainingArguments` fields whose value must be one of a transformers enum's (checked all at once, before the build
stops at the first)."""

_ENUM_KEYS = {**{enum: name for name, enum in reversed(_ENUM_FIELDS.items())}, "FSDPOption": "fsdp"}
"""The field a transformers refusal ("... is not a valid <enum>") names, by its enum: `_ENUM_FIELDS` turned round
(the first field of a shared enum: ``eval_strategy`` for ``IntervalStrategy``), and ``fsdp`` (a list of options,
not one value, so not checked by `_enum_refusals`)."""


def _enum_refusals(cfg: Any) -> list[ConfigError]:
    """One `ConfigError` per ``trainer.`` field of `_ENUM_FIELDS` whose value its transformers enum does not hold
    (transformers' own check stops at the first: two such typos took two tries)."""
    import transformers.trainer_utils as trainer_utils
    import transformers.training_args as training_args

    found = []
    for name, enum_name in _ENUM_FIELDS.items():
        enum = getattr(trainer_utils, enum_name, None) or getattr(training_args, enum_name, None)
        value = cfg.trainer.get(name)
        if enum is None or not isinstance(value, str):
            continue
        accepted = [str(e.value) for e in enum]
        if value in accepted:
            continue
        close = difflib.get_close_matches(value, accepted, n=LISTED_SHOWN, cutoff=0.0)
        more = f" (the {LISTED_SHOWN} closest of {len(accepted)})" if len(accepted) > LISTED_SHOWN else ""
        found.append(_err(f"trainer.{name}", value, f"transformers accepts one of {', '.join(close)}{more}",
                          f"trainer.{name}={close[0]}"))
    return found


def check_training_args_build(cfg: Any) -> None:
    """Build the `AsyncGRPOConfig` the trainer process will build, so transformers' own refusals (an unknown
    optimizer or schedule, bf16 without a GPU, ...) come now, with the key, instead of from the trainer;
    and check ``trainer.report_to``, which transformers checks only when the trainer is built. The enum-valued
    fields (`_ENUM_FIELDS`) are checked first, each of them, and named with the build's own problems.

    Raises:
        ConfigError: naming the ``trainer.`` key transformers refused (guessed from its message), its value
            and the fix (the closest accepted value where transformers lists them).
        ConfigErrors: several such problems.
    """
    from .compose import to_training_args

    enums = _enum_refusals(cfg)
    try:
        args = to_training_args(cfg, open_no_device=True)  # no CUDA context in this process
    except (ConfigError, ConfigTypeError) as exc:
        if not enums:
            raise
        named = {e.key for e in enums}
        rest = [e for e in (exc.errors if isinstance(exc, ConfigErrors) else [ConfigError(str(exc), key=exc.key)])
                if e.key not in named and f"trainer.{e.key}" not in named]
        raise ConfigErrors([*rest, *enums]) if len(rest) + len(enums) > 1 else enums[0] from None
    except (ValueError, TypeError) as exc:
        if enums:  # transformers refused one of them (its first)
            raise (ConfigErrors(enums) if len(enums) > 1 else enums[0]) from None
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
        more = ""
        if len(listed) > LISTED_SHOWN:  # transformers lists 41 optimizers: the closest few, and how many in all
            more = f" (the {LISTED_SHOWN} closest of {len(listed)})"
            listed = difflib.get_close_matches(str(value), listed, n=LISTED_SHOWN, cutoff=0.0)
        text = text.rstrip().rstrip(".")  # the error's own full stop: ours follows
        reason = (f"transformers accepts one of {', '.join(listed)}{more}" if listed else
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
    """``trainer.output_dir`` can be created and written: the nearest existing folder on its path must be a
    folder where this process can create one (tried for real, with a temporary folder removed at once: a
    permission check says yes to root under ``/sys`` or on a read-only mount, where mkdir still fails).

    Raises:
        ConfigError: naming the folder, what is in the way and the fix.
    """
    import tempfile

    out = Path(str(output_dir)).expanduser().resolve() if output_dir else Path.cwd()  # default: under it
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    problem = None
    if not probe.is_dir():
        problem = f"{probe} is a file, not a folder"
    else:
        try:
            Path(tempfile.mkdtemp(dir=probe, prefix=".asyncgrpo-write-check-")).rmdir()
        except OSError as exc:
            problem = f"a folder cannot be created in {probe}: {exc.strerror or exc}"
    if problem:
        raise _err("trainer.output_dir", str(out), f"not writable ({problem})",
                   "choose a writable folder with trainer.output_dir=...")


def _model_for_cli(cfg: Any, train: bool = False) -> tuple[Path | None, list[str]]:
    from .models import plan_model_path

    try:
        path, gguf = plan_model_path(str(cfg.model.name), cfg.model.gguf_file)
    except ConfigError:  # a GGUF file that is not there: train (and its dry run) refuses it now
        if train or Path(str(cfg.model.name)).expanduser().is_dir():
            raise
        return None, []  # serve reports a missing GGUF package itself (its dry run as a note)
    if gguf is not None:  # exported on the first start; the GGUF carries the chat template
        return None, []
    return check_model_source(path, "model.name", probe_hub=train)


def _check_hub_dataset(name: str, subset: Any = None) -> None:
    """A Hub dataset needs the Hub, or, offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), its cached copy."""
    from .sources import check_hub_reachable
    from .start_checks import _offline, check_offline_hub_dataset

    if _offline():
        check_offline_hub_dataset(name, subset)  # resolved from the cache, as the trainer will
        return
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
    from .grpo_config import AsyncGRPOConfig

    if args is not None and not isinstance(args, AsyncGRPOConfig):
        raise ConfigTypeError(f"args={type(args).__name__}: must be an AsyncGRPOConfig. Fix: "
                              "args=AsyncGRPOConfig(output_dir=..., ...)", key="args")
    from ..rollout.worker import main_guard_message, unguarded_main_call

    c = _Collector()
    where = unguarded_main_call()
    if where is not None:
        c.errors.append(ConfigError(main_guard_message(*where), key="__main__"))
    folder = None
    if isinstance(model, str):
        found = c.run(check_model_source, model, "model", needs_chat_template=processing_class is None)
        folder = found[0] if found else None
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
        key_of = (lambda i: f"reward_funcs[{i}]") if isinstance(reward_funcs, (list, tuple)) else \
            (lambda i: "reward_funcs")
        before = len(c.errors)
        c.run(check_reward_funcs, funcs, columns, key_of)
        row = _first_row(train_dataset) if environment_factory is None and len(c.errors) == before else None
        if row is not None:  # each reward called once (issue #45)
            c.warnings.extend(c.run(probe_reward_funcs, funcs, row, key_of) or [])
    if args is not None and not c.errors:
        c.run(check_api_lengths, model, folder, args, train_dataset, processing_class)
    c.raise_if_any()
    if args is not None:
        c.warnings.extend(start_warnings(float(args.repetition_penalty), args.uses_candidate_sets,
                                         bool(args.sampling_mask_fallback), penalty_key="repetition_penalty",
                                         fallback_key="sampling_mask_fallback"))
        c.warnings.extend(loss_warnings({"loss_type": args.loss_type,
                                         "importance_sampling_level": args.importance_sampling_level}))
        c.warnings.extend(in_flight_estimate_notes(str(args.in_flight_estimate), int(args.max_staleness), str))
        c.warnings.extend(deadline_order_notes(str(args.deadline_order), int(args.max_staleness), str))
        # (a LoRA model of the API is seen by the trainer, which says at start that adapter sync is not checked)
        c.warnings.extend(check_weight_sync_notes(bool(args.check_weight_sync), False, str))
    return c.warnings


def check_weight_sync_notes(on: bool, lora: bool, key: Callable[[str], str]) -> list[str]:
    """What to print at start for ``check_weight_sync`` (README: GPUs, weight sync and LoRA): what it does and
    costs (a `Note`), or, with LoRA, that adapter sync is not checked (a warning)."""
    if not on:
        return []
    if lora:
        return [f"{key('check_weight_sync')}=true checks full-weight sync only: with LoRA (adapter sync) nothing is "
                "checked"]
    return [Note(f"{key('check_weight_sync')}=true: at start the trainer perturbs its weights, syncs and probes the "
                 "server (three more syncs, host memory for a copy of the weights) and stops if a sync did not take "
                 "effect; then one short probe request after every sync (weight_sync/probe_gap)")]


def in_flight_estimate_notes(estimate: str, max_staleness: int, key: Callable[[str], str]) -> list[str]:
    """What to print at start for the opt-in ``in_flight_estimate=kept`` (README: Staleness and concurrency): that
    it is on (it departs from the design's rule and is not yet measured on a GPU), or that it does nothing at
    ``max_staleness=0``. ``key`` spells a field's name (``staleness.in_flight_estimate`` or the API's)."""
    if estimate != "kept":
        return []
    if max_staleness == 0:
        return [f"{key('in_flight_estimate')}=kept has no effect at {key('max_staleness')}=0 (the on-policy round "
                f"sizes generation there); remove it, or set {key('max_staleness')} >= 1"]
    return [f"{key('in_flight_estimate')}=kept (opt-in): a rollout in flight counts as the sample tokens it is expected "
            "to add to the queue, so more rollouts run when many groups are dropped; on the one-GPU recipe it was no "
            "faster to a reward than mean (README: One GPU): watch sample/dropped_stale_count"]


def deadline_order_notes(order: str, max_staleness: int, key: Callable[[str], str]) -> list[str]:
    """What to print at start for the opt-in ``deadline_order=observed`` (README: Staleness and concurrency): that it
    is on and what to watch, or that it does nothing at ``max_staleness=0``. ``key`` spells a field's name."""
    if order != "observed":
        return []
    if max_staleness == 0:
        return [f"{key('deadline_order')}=observed has no effect at {key('max_staleness')}=0 (no deadline admission "
                f"on-policy); remove it, or set {key('max_staleness')} >= 1"]
    return [Note(f"{key('deadline_order')}=observed (opt-in): deadline admission counts the groups started at a "
                 "later version than a group in flight at the share of such groups' tokens seen to finish first "
                 "(rollout/deadline_overtake_share), not in full: more generation in flight where completions run "
                 "about as long; its one GPU run counted a burst's own order as overtaking and gained 3% (fixed "
                 "since, not re-run): watch sample/dropped_stale_count")]


def _first_row(dataset: Any) -> dict[str, Any] | None:
    """Row 0 of a map-style dataset with a ``prompt`` column, as a dict; None for a stream or an empty one."""
    try:
        if not hasattr(dataset, "__len__") or len(dataset) == 0:
            return None
        row = dataset[0]
    except Exception:  # noqa: BLE001 - the dataset checks above report what is wrong with it
        return None
    return dict(row) if isinstance(row, dict) and "prompt" in row else None


API_ROWS_SCANNED = 1000
"""Prompts rendered at most by `check_api_lengths` (the trainer's constructor should stay quick)."""


def check_api_lengths(model: Any, folder: Path | None, args: Any, train_dataset: Any,
                      processing_class: Any = None) -> None:
    """The API's length limits against the model, before anything starts: ``max_completion_length`` within the
    model's context (``max_position_embeddings``, times its RoPE scaling factor: what vLLM serves at most), and
    a ``token_budget`` that some prompt fits (rendered with the tokenizer, as the worker does), else every
    sample is dropped as oversize.

    Raises:
        ConfigError: naming ``max_completion_length`` or ``token_budget``, the limit and the fix.
    """
    import json

    from .prompt_lengths import check_prompt_lengths, prompt_token_lengths

    config: Any = None
    if folder is not None:
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            config = None
    elif hasattr(model, "config"):
        config = model.config.to_dict() if hasattr(model.config, "to_dict") else None
        where = getattr(model, "name_or_path", None)
        folder = Path(where) if isinstance(where, str) and where and Path(where).is_dir() else None
    context = _context_length(config)
    if context is not None and int(args.max_completion_length) > context:
        raise _err("max_completion_length", int(args.max_completion_length), f"above the model's context of "
                   f"{context} tokens (max_position_embeddings in its config): no server generates that many tokens "
                   "after a prompt", f"set max_completion_length to {context} minus your longest prompt, or less "
                   f"(e.g. {max(1, context // 2)})")
    if args.token_budget is None or train_dataset is None or not hasattr(train_dataset, "__iter__"):
        return
    tokenizer = processing_class
    if tokenizer is None and folder is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except Exception:  # noqa: BLE001 - an unreadable tokenizer is the model check's to report
            return
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        return
    prompts = []
    for i, row in enumerate(train_dataset):
        if i >= API_ROWS_SCANNED:
            break
        if isinstance(row, dict) and "prompt" in row:
            prompts.append(row["prompt"])
    try:
        lengths = prompt_token_lengths(prompts, tokenizer, getattr(args, "chat_template_kwargs", None) or None)
    except Exception:  # noqa: BLE001 - a template problem is the chat-template check's to report
        return
    total = len(train_dataset) if hasattr(train_dataset, "__len__") else None
    check_prompt_lengths(lengths, int(args.max_completion_length), None, int(args.token_budget),
                         scanned_all=total is not None and total <= len(lengths),
                         completion_key="max_completion_length", len_key="the server's max_model_len",
                         budget_key="token_budget")


def _context_length(config: Any) -> int | None:
    """``max_position_embeddings`` of a model config dict (its text config for a multimodal one), times the
    RoPE scaling factor when it has one (vLLM's default max_model_len); None when it does not say."""
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("max_position_embeddings")
    if not isinstance(value, int) or value <= 0:
        return None
    scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(value * factor) if isinstance(factor, (int, float)) and factor > 1 else value


def check_api_hub_model(model: Any) -> None:
    """The Python API's last check before anything loads: a Hub id that is not in the local cache must be
    reachable on the Hub (one line now, instead of transformers' retries and traceback when it loads). Run after
    every cheaper check of the inputs, so that a mistake in them is named first.

    Raises:
        ConfigError: the Hub id is not cached and the Hub does not answer (names ``model``, the id and the fix).
    """
    if isinstance(model, str):
        check_model_source(model, "model", needs_chat_template=False, probe_hub=True)
