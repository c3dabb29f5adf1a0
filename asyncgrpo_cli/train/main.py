"""Trainer process entry point, one per rank under ``accelerate launch``:

    accelerate launch --config_file OUT/accelerate_config.yaml -m asyncgrpo_cli.train.main --config OUT/asyncgrpo_config.yaml

The YAML is the composed config written by ``asyncgrpo train`` (model path already resolved).
"""

from __future__ import annotations

import argparse
import sys


def build_trainer(cfg):
    """An `AsyncGRPOTrainer` for a composed config (also used by tests and scripts)."""
    from omegaconf import OmegaConf

    from ..config.compose import to_training_args
    from ..data import load_eval_prompts, load_prompts
    from ..imports import import_object, reward_functions
    from ..config.models import resolve_model_path
    from .trainer import AsyncGRPOTrainer

    args = to_training_args(cfg)
    peft_config = None
    if cfg.peft.enabled:
        from peft import LoraConfig

        targets = OmegaConf.to_container(cfg.peft.target_modules) if not isinstance(cfg.peft.target_modules, str) \
            else cfg.peft.target_modules
        peft_config = LoraConfig(r=cfg.peft.r, lora_alpha=cfg.peft.lora_alpha, lora_dropout=cfg.peft.lora_dropout,
                                 target_modules=targets, task_type="CAUSAL_LM")
    trainer_cls = AsyncGRPOTrainer
    if cfg.rollout.loop_cls:
        loop_cls = import_object(str(cfg.rollout.loop_cls), "rollout.loop_cls")
        trainer_cls = type("ConfiguredAsyncGRPOTrainer", (AsyncGRPOTrainer,), {"loop_cls": loop_cls})
    model = resolve_model_path(str(cfg.model.name), cfg.model.gguf_file)
    tools, environment_factory = agent_objects(cfg)
    # An environment without data source owns the data (SPEC §13.2): no train_dataset, max_steps bounds training.
    owns_data = environment_factory is not None and not cfg.data.name and not cfg.data.generator
    return trainer_cls(model=model, reward_funcs=reward_functions(list(cfg.rewards)), args=args,
                       train_dataset=None if owns_data else load_prompts(cfg), peft_config=peft_config,
                       tools=tools or None, environment_factory=environment_factory,
                       eval_dataset=load_eval_prompts(cfg))


def agent_objects(cfg):
    """``(tools, environment_factory)`` of the ``tools`` and ``environment`` groups, imported (SPEC §13)."""
    from omegaconf import DictConfig

    from ..imports import import_object

    tools = [import_object(str(path), f"tools[{i}]") for i, path in enumerate(cfg.get("tools") or [])]
    factory = (cfg.get("environment") or {}).get("factory")
    if isinstance(factory, DictConfig):
        factory = {str(name): import_object(str(path), f"environment.factory.{name}") for name, path in factory.items()}
    elif factory is not None:
        factory = import_object(str(factory), "environment.factory")
    return tools, factory


def load_config(path: str):
    """The structured config saved at ``path`` (types checked again on load)."""
    from omegaconf import OmegaConf

    from ..config.compose import validate_config
    from ..config.schema import AppConfig

    cfg = OmegaConf.merge(OmegaConf.structured(AppConfig), OmegaConf.load(path))
    validate_config(cfg)
    return cfg


def _output_dir_of(config_path: str) -> str:
    """``trainer.output_dir`` of the composed config at ``config_path`` (the supervisor writes it there: its
    folder when the file cannot be read)."""
    import os

    try:
        from omegaconf import OmegaConf

        return str(OmegaConf.load(config_path).trainer.output_dir)
    except Exception:  # noqa: BLE001 - the folder the supervisor wrote it into
        return os.path.dirname(os.path.abspath(config_path))


def _follow_supervisor(config_path: str | None = None) -> None:
    """Started by `asyncgrpo train`: once the supervisor is gone (even killed by SIGKILL), stop as on SIGTERM,
    which saves the last completed step, writes the final status and takes the rollout worker down. Rank 0
    first starts the status guard (`run.status_guard`): if this process dies before its final status (killed
    during that save), the guard writes that the save was cut and names the newest complete checkpoint."""
    import os
    import signal

    from ..run.orphans import watch_process
    from ..run.state import LOCK_OWNER_ENV

    owner = os.environ.get(LOCK_OWNER_ENV, "")
    if not owner.isdigit() or int(owner) == os.getpid():
        return

    def gone() -> None:
        from .stopping import own_reason

        own_reason.append(f"the supervisor (pid {owner}) is gone")
        if config_path is not None and os.environ.get("RANK", "0") == "0":
            from ..run.status_guard import start_guard

            start_guard(_output_dir_of(config_path), f"the supervisor (pid {owner}) was gone")
        print(f"asyncgrpo trainer: the supervisor (pid {owner}) is gone: saving the last completed step and "
              "stopping, as on SIGTERM", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    watch_process(int(owner), gone, name="supervisor-watchdog")


def main(argv: list[str] | None = None) -> int:
    """Parse ``--config``, build the trainer and train. Exit status: 0 on success, 130 / 143 when SIGINT /
    SIGTERM stopped it (after saving; 0 when its supervisor was gone: nobody reads it, status.json says stopped),
    2 for a user error (printed as one message, no traceback: an
    incomplete checkpoint to resume from, an unwritable ``output_dir``, another job in the folder), 1 when
    training failed. A stop signal before training took the signals over (while the model and data load), or a
    second one (stop now, without saving), ends with one line of ours, not a traceback (`_stopped_at_once`)."""
    built: list = []  # the trainer once it is built (its second signal's name)
    try:
        return _main(argv, built)
    except KeyboardInterrupt:
        return _stopped_at_once(built[0] if built else None)


def _stopped_at_once(trainer) -> int:
    """After a stop signal's `KeyboardInterrupt` left `main`: one line saying so, and the exit status of a stop
    (130, or 143 for a second SIGTERM), which the supervisor reads as a stop it asked for
    (`launch.log_tail.note_requested_stop`: it then removes accelerate's report of that status from the log).
    Before, the log ended with the frames of whatever was loading (95 lines inside transformers' import for a
    Ctrl-C at the start of the smoke run) and accelerate's traceback (a fresh-user trial)."""
    import signal
    import time

    second = getattr(trainer, "_second_signal", None)
    name = signal.Signals(second).name if second is not None else "SIGINT"  # Python's own handler: SIGINT only
    if second is not None:
        what = f"a second {name}: stopped at once, without saving the step in progress"
    elif trainer is None:
        what = "SIGINT while starting (loading the model and the data): stopped before training began"
    else:
        what = "SIGINT outside the training loop's stop handling: stopped at once, without saving"
    print(f"{time.strftime('%H:%M:%S')} asyncgrpo trainer: {what}", file=sys.stderr, flush=True)
    return 143 if name == "SIGTERM" else 130


def _main(argv: list[str] | None, built: list) -> int:
    from ..config.rules import ConfigError
    from .checkpoint import CheckpointError
    from ..run.state import RolloutStateError, RunLockedError

    parser = argparse.ArgumentParser(prog="asyncgrpo-trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="composed config YAML written by `asyncgrpo train`")
    parser.add_argument("--resume", default=None, help="checkpoint folder, or 'last'")
    ns = parser.parse_args(argv)
    from ..config.rules import ConfigError, ConfigTypeError
    from ..config.models import quiet_progress_bars_without_terminal

    quiet_progress_bars_without_terminal()  # logs/trainer.log: no raw 'Loading weights' / 'Writing model shards' bars
    from ..run.log_lines import stamp_package_logs

    stamp_package_logs()  # logs/trainer.log: the package's warnings after their time, as the step lines
    from ..rollout.worker import RolloutWorkerError
    from .server_watch import ServerHungError
    from .sync_check import WeightSyncCheckError

    _follow_supervisor(ns.config)
    try:
        cfg = load_config(ns.config)
        trainer = build_trainer(cfg)
        built.append(trainer)
        resume = True if ns.resume == "last" else ns.resume
        trainer.train(resume_from_checkpoint=resume)
    except (ConfigError, ConfigTypeError) as exc:  # a user error found late (e.g. the server's answers): no traceback
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (CheckpointError, RolloutStateError, RunLockedError) as exc:
        print(f"asyncgrpo trainer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except RolloutWorkerError as exc:
        if "Traceback (most recent call last)" in str(exc):
            raise  # a bug or a failing reward function: the traceback is the information
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except ServerHungError as exc:  # the sampler server stopped answering: the message is the information
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except WeightSyncCheckError as exc:  # sampler.check_weight_sync: the four probe gaps are the information
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    code = trainer.exit_code
    if code and _supervisor_gone():
        # Nobody is left to read the status, and accelerate's launcher would end trainer.log with a traceback (and a
        # copy of the log) reporting a 143 that is no crash: the stop is in status.json, the exit status is 0.
        step = trainer.state.global_step
        print("asyncgrpo trainer: stopped because the supervisor was gone, " + (
            f"after saving the last completed step (step {step}); the run's state and the command that resumes it "
            "are in status.json (state, resume_command)" if step else
            "before step 1 ended: nothing was trained, so no checkpoint was possible; start the run again with the "
            "same command"), file=sys.stderr, flush=True)
        return 0
    return code


def _supervisor_gone() -> bool:
    """Whether this trainer stopped because `_follow_supervisor` found the supervisor gone."""
    from ..run.stop_reason import own_reason

    return any("the supervisor" in reason and "is gone" in reason for reason in own_reason)


if __name__ == "__main__":
    from ..run.process_exit import exit_now

    exit_now(main())
