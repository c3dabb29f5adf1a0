"""The trainer's start-up checks (SPEC §2, §7, §8.3, §13.2, §14, §16.1): what `AsyncGRPOTrainer` refuses
before it loads anything, and what rank 0 checks against the server before the rollout worker starts.

Each check raises with the field, the value and the fix, or warns (``UserWarning``) where the run can go
on; none of them starts or changes anything.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from ..config.rules import ConfigError
from ..config.multimodal import check_text_only


def check_trainer_inputs(model, reward_funcs, args, train_dataset, tools, environment_factory,
                         processing_class) -> tuple[list, Any]:
    """The constructor's checks of `AsyncGRPOTrainer` (its ``Raises`` section), before any model is loaded.

    Returns:
        (the reward functions as a list, the prompt source: ``train_dataset``, or an
        `EnvironmentOwnedPrompts` when the environment owns the data).

    Raises:
        ValueError: no prompts, no reward source, a dataset without a ``prompt`` column, a stream without
            ``max_steps``, images in the prompts, or a config combination `validate_trainer_inputs` refuses.
        TypeError: a tool or ``environment_factory`` that is not a callable of the supported kind.
    """
    from ..config.run_checks import validate_trainer_inputs
    from ..rollout.environments import EnvironmentOwnedPrompts, check_environment_factory
    from ..rollout.tools import check_tools

    check_tools(tools)
    if environment_factory is not None:
        check_environment_factory(environment_factory)
    from ..config.notes import is_note

    for warning in validate_trainer_inputs(model, reward_funcs, args, train_dataset, environment_factory,
                                           processing_class):
        if is_note(warning):  # informs (an opt-in's cost): no UserWarning, nothing to fix
            print(f"note: {warning}", file=sys.stderr, flush=True)
        else:
            warnings.warn(warning, UserWarning, stacklevel=3)
    if train_dataset is None:
        if environment_factory is None:
            raise ValueError("train_dataset=None: the async GRPO trainer needs prompts (a dataset with a 'prompt' "
                             "column), or an environment_factory whose reset() returns them. Fix: pass "
                             "train_dataset=...")
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(f"train_dataset=None with environment_factory: the environment owns the data, so "
                             f"there are no epochs to count and max_steps must be set (got max_steps="
                             f"{args.max_steps}). Fix: pass AsyncGRPOConfig(max_steps=N), on the command line "
                             "trainer.max_steps=N (SPEC §13.2)")
        train_dataset = EnvironmentOwnedPrompts()
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else ([reward_funcs] if reward_funcs else [])
    if not funcs and environment_factory is None:
        raise ValueError("reward_funcs is empty: rollouts could not be scored. Fix: pass reward_funcs=[...]")
    if not funcs and environment_factory is not None:
        factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
        unscored = [f.__name__ for f in factories
                    if isinstance(f, type) and not callable(getattr(f, "get_reward", None))]
        if unscored:
            raise ValueError(f"reward_funcs is empty and environment {unscored} has no get_reward(): its rollouts "
                             "could not be scored. Fix: pass reward_funcs=[...] or define get_reward (SPEC §13.2)")
    from ..config.loss_rules import check_reward_weights_count

    check_reward_weights_count(getattr(args, "reward_weights", None), len(funcs))
    check_environment_column(environment_factory, None if isinstance(train_dataset, EnvironmentOwnedPrompts)
                             else train_dataset)
    if (environment_factory is None and train_dataset.column_names is not None
            and "prompt" not in train_dataset.column_names):
        raise ValueError(f"train_dataset has columns {train_dataset.column_names} but no 'prompt' column of "
                         "conversational messages (README: Supported setups). Fix: add a 'prompt' column")
    if not hasattr(train_dataset, "__len__") and args.max_steps <= 0:
        raise ValueError(f"train_dataset is an IterableDataset (streaming) and max_steps={args.max_steps}: "
                         "epochs of a stream have no known length. Fix: set max_steps > 0")
    if hasattr(train_dataset, "__len__") and not isinstance(train_dataset, EnvironmentOwnedPrompts):
        check_text_only(train_dataset[: min(len(train_dataset), 1000)]["prompt"])  # images refused (SPEC §14)
    from ..config.run_checks import check_api_hub_model

    check_api_hub_model(model)  # last: the inputs' own mistakes are named first (no network needed for them)
    return list(funcs), train_dataset


def check_sync_overlap(args: Any, lora: bool, processes: int | None = None) -> None:
    """``weight_sync_overlap=True`` where it cannot apply (`config.rules.weight_sync_overlap_refusals`, README
    "Overlapped weight sync"; SPEC §3.1, §9, B.23): several trainer processes, ``check_weight_sync=True``, or LoRA.
    Nothing when it is off. Called by `AsyncGRPOTrainer.__init__` before anything loads.

    Args:
        args: the `AsyncGRPOConfig`.
        lora: the trainer got a ``peft_config`` or a PEFT model (adapter or merged LoRA sync).
        processes: trainer processes; None = the launcher's ``WORLD_SIZE`` (torchrun, accelerate), else 1.

    Raises:
        ConfigError / ConfigErrors (ValueErrors): naming ``weight_sync_overlap``, the value, why and the fix.
    """
    import os

    from ..config.rules import ConfigErrors, weight_sync_overlap_refusals

    if not getattr(args, "weight_sync_overlap", False):
        return
    if processes is None:
        world = os.environ.get("WORLD_SIZE", "1")
        processes = int(world) if world.isdigit() else 1
    found = weight_sync_overlap_refusals(check_weight_sync=bool(getattr(args, "check_weight_sync", False)), lora=lora,
                                         processes=processes, key=str, lora_key="a LoRA model (peft_config)",
                                         one_process="launch one process (no torchrun or accelerate launch with several)")
    if found:
        raise ConfigErrors(found) if len(found) > 1 else found[0]


def check_environment_column(environment_factory, train_dataset) -> None:
    """SPEC §16.1: with a dict of environments every example must carry an ``environment`` field naming its
    environment, so the dataset must exist and have that column.

    Raises:
        ValueError: ``environment_factory`` is a dict and ``train_dataset`` is None, or its columns are known
            and none is ``environment``.
    """
    from ..rollout.environments import ENVIRONMENT_COLUMN

    if not isinstance(environment_factory, dict):
        return
    names = sorted(environment_factory)
    if train_dataset is None:
        raise ValueError(f"environment_factory is a dict of environments ({names}) but train_dataset=None: every "
                         f"example must name its environment in an {ENVIRONMENT_COLUMN!r} field (SPEC §16.1). Fix: "
                         f"pass a train_dataset with an {ENVIRONMENT_COLUMN!r} column, e.g. "
                         f"Dataset.from_dict({{{ENVIRONMENT_COLUMN!r}: {names!r} * 100}}), or give one environment "
                         "class instead of a dict")
    columns = getattr(train_dataset, "column_names", None)
    if columns is not None and ENVIRONMENT_COLUMN not in columns:
        raise ValueError(f"environment_factory is a dict of environments ({names}) but train_dataset has columns "
                         f"{list(columns)} and no {ENVIRONMENT_COLUMN!r} column: every example must name its "
                         f"environment (SPEC §16.1). Fix: add an {ENVIRONMENT_COLUMN!r} column with one of {names} "
                         "per row, or give one environment class instead of a dict")


def check_peft_targets(peft_config) -> None:
    """SPEC §2.7: an adapter on ``lm_head`` is refused.

    Raises:
        ValueError: ``peft_config.target_modules`` names ``lm_head``.
    """
    targets = peft_config.target_modules
    if targets == "lm_head" or (isinstance(targets, (list, set, tuple)) and "lm_head" in targets):
        raise ValueError("peft_config targets lm_head, which is not supported (README: Supported setups)")


def check_server_lengths(args, server_len: int) -> None:
    """A completion must leave room for a prompt under the server's max_model_len (else HTTP 400 on the
    first request); a token budget below it drops the longest samples (a warning).

    Raises:
        ConfigError: ``max_completion_length`` leaves no room for a prompt (the message names both and the fix).
    """
    from ..config.validate import check_lengths

    for warning in check_lengths(args.max_completion_length, server_len, args.token_budget,
                                 completion_key="max_completion_length", len_key="the server's max_model_len",
                                 budget_key="token_budget"):
        warnings.warn(warning, UserWarning, stacklevel=3)


def server_token_budget(args, sampler) -> int:
    """The token budget of the run (SPEC §6.4): ``args.token_budget``, else the server's max_model_len; the
    lengths are checked against the server's (`check_server_lengths`) whenever the server reports one.

    Raises:
        ConfigError: as `check_server_lengths`.
    """
    if args.token_budget is None:
        budget = int(sampler.max_model_len())
        check_server_lengths(args, budget)
        return budget
    try:
        server_len = int(sampler.max_model_len())
    except Exception:  # noqa: BLE001 - a server that does not report it: nothing to compare
        return int(args.token_budget)
    check_server_lengths(args, server_len)
    return int(args.token_budget)


def check_sampling_mask(args, sampler) -> None:
    """SPEC §7's start-up check: with top-k/top-p/min-p the server must return candidate sets, unless
    ``sampling_mask_fallback`` accepts biased ratios (then a warning).

    Raises:
        ConfigError: the server returns no candidate sets (the message names the server flags to add).
    """
    from ..server.sampling_mask import probe_scale_out, require_sampling_mask

    if not args.uses_candidate_sets:
        return
    try:
        version = sampler.version()
    except Exception:  # noqa: BLE001 - a server without /version: judged from /server_info alone
        version = None
    embedded = isinstance(version, dict) and version.get("server") == "asyncgrpo-embedded"
    scale_out = None if embedded else probe_scale_out(args.vllm_server_base_url)
    warning = require_sampling_mask(True, sampler.server_info(), version, fallback=args.sampling_mask_fallback,
                                    url=args.vllm_server_base_url, scale_out=scale_out)
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=3)


def check_server_at_start(sampler, args, model_id: str, model=None) -> int:
    """Rank 0, before the rollout worker starts: wait for the server, run doctor's checks against it (a dtype
    mismatch is one warning line naming both dtypes and the fix, SPEC §8.1; `server_checks.check_server`),
    SPEC §7's candidate-set check and the length checks. Returns the token budget (`server_token_budget`).

    Raises:
        SamplerUnavailableError: the server did not come up within ``vllm_server_timeout``.
        ServerMismatchError: a doctor check failed (each with doctor's fix).
        ConfigError: no candidate sets where they are needed, or no room for a prompt.
    """
    from .server_checks import check_server

    check_server(sampler, args, model_id, model)
    check_sampling_mask(args, sampler)
    return server_token_budget(args, sampler)


__all__ = ["ConfigError", "check_environment_column", "check_peft_targets", "check_sampling_mask",
           "check_server_at_start", "check_server_lengths", "check_trainer_inputs", "server_token_budget"]
