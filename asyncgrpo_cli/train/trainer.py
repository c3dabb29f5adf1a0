"""`AsyncGRPOTrainer`: the training half of asynchronous GRPO (SPEC §1.1, §3, §6, §12, §15, §16.1).

Rank 0 owns the rollout worker. Each optimizer step it pulls prompt outcomes from the rollout queue, drops
stale samples, plans tree-packed rows for every rank with the token-budget batcher, and sends each rank its
rows; every rank forwards its rows (tree attention; the loss runs inside the forward, chunked over the
vocabulary), back-propagates, and steps. Every ``weight_sync_steps`` steps the weights go to the sampler and
the model version the worker stamps on new groups advances (``sampler.weight_sync_overlap``: the sync runs on a
background thread while the next step pulls, forwards and backwards; `sync_steps.py`). Checkpoints, callbacks,
``report_to`` and resumption come from `transformers.Trainer`; the rollout position is saved beside each checkpoint.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import TrainOutput

from ..rollout.metrics import MetricsWindow
from ..rollout.allowance import allowance_after_step, initial_allowance
from ..rollout.on_policy import step_capacity
from ..rollout.loop import AsyncRolloutLoop
from ..config.grpo_config import AsyncGRPOConfig
from ..config.rules import ConfigError
from .loss import LossConfig, finalize_metrics, merge_metric_contributions, read_pending
from .model_loading import eos_token_ids, freeze_outside_text_model, load_policy, load_tokenizer, prepare_tokenizer
from .moe_aux import MoeAuxLoss
from .packed_loss import Reference, install_loss_head, micro_batch_sequences, row_loss
from .batcher import TokenBudgetBatcher, batch_metrics, record_stale_verdict
from .checkpointing import enable_activation_checkpointing
from .compile import compile_decoder_layers
from .console_log import use_plain_lines
from .packing import pack_row
from .perf import PeakFlops, SpanClock, step_flops
from ..run.log_lines import stamped
from ..run.state import LiveFiles, TrainedPosition, mark_final_model
from .stopping import StopHandling
from .step_pull import StepPlan, StepPulling
from .sync_steps import WeightSyncing
from .startup import check_peft_targets, check_server_at_start, check_sync_overlap, check_trainer_inputs
from .trackers import log_completions
from .cuda_memory import MemoryWatch
from .host_time import ThreadTimes, host_time_metrics
from .host_load import HostLoadWatch
from .tree_attention import apply_tree_attention


class AsyncGRPOTrainer(StepPulling, WeightSyncing, StopHandling, Trainer):
    """Asynchronous GRPO trainer (SPEC §16.1). Generation runs on an external server (vLLM, or the embedded
    sampler) at ``args.vllm_server_base_url``, driven by a spawned rollout worker.

    Args:
        model: Hub id or local folder (loaded per SPEC §16.3), or a `PreTrainedModel`.
        reward_funcs: one reward callable or a list (sync or async; module-level, partial or callable instance).
        args: `AsyncGRPOConfig` (None = defaults with ``output_dir="outputs/asyncgrpo"``).
        train_dataset: `datasets.Dataset` with a conversational ``prompt`` column; other columns reach rewards
            (and ``reset()``). None only with ``environment_factory`` and ``max_steps > 0``: the environment
            owns the data and ``reset()`` returns each rollout's prompt (SPEC §13.2).
        processing_class: the tokenizer (None = loaded from ``model``); padding is set to the left.
        callbacks, optimizers: as in `transformers.Trainer`.
        peft_config: a `peft.PeftConfig` to wrap the model (merged weight sync).
        tools: sync or async module-level functions with type hints and a Google-style docstring (SPEC §13.1).
        environment_factory: a zero-argument callable (typically a class) or a dict name -> callable; one
            instance per in-flight rollout, its public methods become tools (SPEC §13.2).
        eval_dataset: eval prompts (``prompt`` column, the reward functions' columns), evaluated every
            ``eval_steps`` steps with ``eval_strategy="steps"`` and logged as ``eval/*`` (README "Evaluation").

    Class attribute ``loop_cls``: the `AsyncRolloutLoop` subclass the worker runs.

    Raises:
        ValueError: no dataset (or ``train_dataset=None`` without ``max_steps``), no reward source, a tool
            without schema, or a bad model/config combination (message names it).
        TypeError: a tool or ``environment_factory`` that is not a callable of the supported kind.
    """

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, eval_dataset=None) -> None:
        from ..rollout.environments import EnvironmentOwnedPrompts
        from .evaluation import TrainerEvaluation, check_eval_inputs

        args = args or AsyncGRPOConfig(output_dir="outputs/asyncgrpo")
        try:
            check_sync_overlap(args, lora=peft_config is not None or bool(getattr(model, "peft_config", None)))
            funcs, train_dataset = check_trainer_inputs(model, reward_funcs, args, train_dataset, tools,
                                                        environment_factory, processing_class)
        except ConfigError as exc:  # a user error: the message is the information, not the frames of the checks
            raise exc.with_traceback(None) from None
        check_eval_inputs(args, eval_dataset, funcs, environment_factory)
        self.evaluation = TrainerEvaluation(args, eval_dataset is not None)
        if isinstance(model, str):
            model_id = model
            model = load_policy(model_id, args)
        else:
            model_id = getattr(model.config, "_name_or_path", None) or type(model).__name__
            if getattr(model.config, "vision_config", None) is not None:
                freeze_outside_text_model(model)  # as load_policy does (SPEC §14)
        tokenizer = prepare_tokenizer(processing_class) if processing_class is not None else load_tokenizer(model_id, args)
        if peft_config is not None:
            from peft import get_peft_model

            check_peft_targets(peft_config)
            model = get_peft_model(model, peft_config)
        model.config.use_cache = False
        self.model_id = model_id
        self.reward_funcs = list(funcs)
        self.tools = tools
        self.environment_factory = environment_factory
        self.tree_backend = apply_tree_attention(model, args.tree_attention, model_id=model_id,  # not yet moved:
                                                 device=args.device, announce=True)  # args.device picks the kernels
        install_loss_head(model)
        self.moe_aux = MoeAuxLoss.for_model(model, args.router_aux_loss_coef)  # SPEC §3.3.5
        self.reference = Reference.for_policy(model, args.beta)  # beta > 0: KL to the initial policy
        if args.torch_compile:  # regional: the whole-model compile of Trainer/accelerate cannot trace packed rows
            compile_decoder_layers(model, args.torch_compile_backend, args.torch_compile_mode)
        super().__init__(model=model, args=args,
                         train_dataset=None if isinstance(train_dataset, EnvironmentOwnedPrompts) else train_dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=callbacks,
                         optimizers=optimizers, data_collator=lambda rows: rows)
        self.train_dataset = train_dataset
        use_plain_lines(self.callback_handler, terminal=sys.stdout.isatty())  # the plain line, not ~90 metrics
        if args.torch_compile:
            from accelerate.utils import DynamoBackend

            self.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        self.loss_config = LossConfig.from_args(args)
        self.worker = None
        self.model_version = 0
        self.window, self.memory_watch = MetricsWindow(), MemoryWatch()
        self.host_load = HostLoadWatch(lambda: getattr(getattr(self.worker, "process", None), "pid", None))  # cores
        self._stop_requested = False
        self._stop_reason = ""
        self._num_tokens = 0

    # ------------------------------------------------------------------------------------ entry point
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs: Any) -> TrainOutput:
        """Train until ``max_steps`` optimizer steps (when > 0) or ``num_train_epochs`` passes over the prompts.

        ``resume_from_checkpoint``: a checkpoint folder, or True for the newest complete one in ``output_dir``;
        model weights (checked against the saved checksum and pushed to the server before the first
        generation), optimizer, scheduler, RNG, ``num_tokens`` and the rollout position (``rollout_state.json``)
        are restored and the worker fast-forwards to the first prompt not yet trained (SPEC §12; an
        ``IterableDataset`` restarts from its first prompt). SIGINT or SIGTERM saves a checkpoint of the last
        completed step, then returns (a second signal stops without saving). A failure after step 1 saves the
        last completed step before it is raised. ``status.json`` ends as ``finished``, ``stopped`` or
        ``failed: <reason>``.

        Raises:
            RolloutWorkerError: the worker failed, died or hung (its traceback or exit signal in the message).
            CheckpointError: the checkpoint to resume from is incomplete or corrupt (the message names the
                newest complete one), its weights could not be restored, ``output_dir`` is not writable, or a
                save failed (disk full).
            RunLockedError: another job runs in ``output_dir``.
        """
        import os

        from .checkpoint import check_writable, remove_partials
        from ..run.state import LOCK_OWNER_ENV, RunLock

        args = self.args
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if resume_from_checkpoint is None and args.resume_from_checkpoint:
            resume_from_checkpoint = args.resume_from_checkpoint
        self.stop_reason, self._signal = None, None
        self.lock = None
        if self.is_world_process_zero():
            check_writable(args.output_dir)
            owner = os.environ.get(LOCK_OWNER_ENV)
            self.lock = RunLock(args.output_dir, shared_with=int(owner) if owner and owner.isdigit() else None)
            self.lock.acquire()
            remove_partials(args.output_dir)
        try:
            return self._train(resume_from_checkpoint, trial)
        finally:
            if self.lock is not None:
                self.lock.release()

    def _train(self, resume_from_checkpoint, trial) -> TrainOutput:
        from .checkpoint import CheckpointError, check_restored, load_checkpoint_weights, resolve_resume
        from ..run.state import read_rollout_state

        args = self.args
        checkpoint = resolve_resume(resume_from_checkpoint, args.output_dir)
        resume_from_checkpoint = str(checkpoint) if checkpoint is not None else None
        saved = read_rollout_state(checkpoint) if checkpoint is not None else {}
        start_position = int(saved.get("dataset_start_index", 0))
        if checkpoint is not None and self._is_iterable:
            start_position = 0  # SPEC §12: a streaming dataset cannot be repositioned; it restarts
        self._num_tokens = int(saved.get("num_tokens", 0))
        self.is_in_train = True
        if args.activation_checkpointing:  # with trainer.activation_checkpointing_kwargs, as transformers' Trainer
            on, of = enable_activation_checkpointing(self.model, args.activation_checkpointing_kwargs)
        if self.accelerator.is_main_process:  # the log says what runs (the plan says what was asked)
            print("asyncgrpo trainer: activation checkpointing " + (f"on {on} of {of} layers" if
                  args.activation_checkpointing else "off"), file=sys.stderr, flush=True)
        state_max_steps = args.max_steps if args.max_steps > 0 else 10**9
        self._init_training_state(state_max_steps, 1, max(1, math.ceil(args.num_train_epochs)),
                                  resume_from_checkpoint, trial)
        if not self._prompts_have_length:
            self.state.epoch = None  # not logged, the panel shows none (a stream, or the environment's own tasks)
        if checkpoint is not None:
            try:
                load_checkpoint_weights(self, checkpoint)
            except (OSError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"resuming from {checkpoint}: the model weights could not be loaded "
                                      f"({type(exc).__name__}: {exc}). Fix: resume from another checkpoint, with "
                                      "the model.name and peft.* of the run that saved it") from exc
        model, _ = self._prepare_for_training(state_max_steps, None, resume_from_checkpoint)
        # from_pretrained leaves the model in eval mode and transformers' Trainer sets train mode in its own loop,
        # which `_loop` replaces: without this, checkpointing layers skip their checkpoint (they check
        # self.training) and dropout (peft.lora_dropout) never applies. The first 1.7B job on a GPU ran out of
        # memory for it (NOTES, seventeenth session).
        model.train()
        if checkpoint is not None:
            self._load_rng_state(resume_from_checkpoint)
            note = check_restored(self, checkpoint)
            if self.is_world_process_zero():
                print(f"asyncgrpo: {note}; resuming at step {self.state.global_step}, prompt position "
                      f"{start_position}" + (" (IterableDataset: restarts from its first prompt, SPEC §12)"
                                             if self._is_iterable else ""), flush=True)
        self._last_saved_step = self.state.global_step
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self._update_progress_total()
        self.model_version = int(self.state.global_step // args.weight_sync_steps)
        self.live = LiveFiles(args.output_dir) if self.is_world_process_zero() else None
        self.position = None
        self._last_loss = 0.0
        if self.live is not None:
            self.live.mark_start(self.state.global_step, resume_from_checkpoint if checkpoint is not None else None)
        start = time.time()
        if args.max_steps > 0 and self.state.global_step >= args.max_steps:
            if self.live is not None:
                self.live.update(force=True, state="finished", step=self.state.global_step,
                                 note=f"nothing to train: step {self.state.global_step} >= max_steps={args.max_steps}")
            self.is_in_train = False
            return TrainOutput(self.state.global_step, 0.0, {"train_runtime": 0.0,
                                                              "total_steps": self.state.global_step,
                                                              "dataset_start_index": start_position})
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self._on_stop_signal)
        try:
            self._setup_rollouts(start_position, resumed=checkpoint is not None)
            self._loop(model, trial)
        except BaseException as exc:
            self._on_failure(model, trial, exc)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._teardown_rollouts()
        if not self._stop_requested:  # the final policy (or adapter) + tokenizer: from_pretrained(output_dir)
            if self.is_world_process_zero():
                mark_final_model(args.output_dir, None)  # the step it holds is recorded once it is written
            self.save_model(args.output_dir)
            if self.is_world_process_zero():
                mark_final_model(args.output_dir, self.state.global_step)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.live is not None:
            self.live.update(force=True, step=self.state.global_step, server_status=None,  # nothing retries now
                             stopping=None, **(self._stopped_status() if self._stop_requested
                                               else {"state": "finished", "resume_command": None}))  # nothing to resume
        self.is_in_train = False
        runtime = time.time() - start
        if self.is_world_process_zero() and not self._stop_requested:  # the log's closing line (a stop has its own)
            print(stamped(f"training finished: step {self.state.global_step} in {runtime:.0f} s; the final model "
                          f"is in {args.output_dir}"), flush=True)
        return TrainOutput(self.state.global_step, float(self._last_loss),
                           {"train_runtime": runtime, "total_steps": self.state.global_step,
                            "dataset_start_index": self.position.value if self.position else start_position})

    @property
    def _is_iterable(self) -> bool:
        return not hasattr(self.train_dataset, "__len__")

    @property
    def _prompts_have_length(self) -> bool:
        """False for a stream and for environment-owned data (`EnvironmentOwnedPrompts`): no epoch to count."""
        from ..rollout.environments import EnvironmentOwnedPrompts

        return not self._is_iterable and not isinstance(self.train_dataset, EnvironmentOwnedPrompts)

    # ------------------------------------------------------------------------------------ rollouts (rank 0)
    def _setup_rollouts(self, start_position: int, resumed: bool = False) -> None:
        from ..rollout.worker import RolloutWorker
        from ..sampler.client import SyncSamplerClient
        from .liveness import WorkerWatch
        from .server_watch import ServerWatch, hang_limit, server_pid_from_env

        args = self.args
        self.position = None
        self.watch = self.server_watch = None
        budget = args.token_budget
        if self.is_world_process_zero():
            self.sampler = SyncSamplerClient(args.vllm_server_base_url, timeout_s=args.vllm_server_timeout)
            self.sampler.outage.stop_under_way = self._stop_under_way  # its outage line promises no wait then
            budget = check_server_at_start(self.sampler, args, self.model_id, self.model)
            limit_s, limit_field = hang_limit(args)
            self.server_watch = ServerWatch(args.vllm_server_base_url, limit_s, on_problem=self.sampler.outage.abandon,
                                            server_pid=server_pid_from_env(), limit_field=limit_field).start()
            self.sampler.silence_budget = self.server_watch.budget  # a hung server costs the hang limit once
            self.live.update(force=True, state="starting", max_steps=args.max_steps if args.max_steps > 0 else None,
                             num_train_epochs=args.num_train_epochs if self._prompts_have_length else None,
                             num_processes=self.accelerator.num_processes,
                             max_concurrent_rollouts=args.max_concurrent_rollouts, model_version=self.model_version,
                             step=self.state.global_step)
        self.token_budget = int(self._broadcast(budget))
        self.weight_sync = self._make_weight_sync()
        adapter = self.weight_sync.mode == "adapter"
        if resumed and adapter and self.weight_sync.backend is not None:
            # A new name per resumed run: the server may still cache prefixes under the old run's names.
            self.weight_sync.backend.prefix = f"policy-r{int(time.time())}"
        if not (adapter and self.model_version == 0):
            # Before the first request, fresh run or resume: the server may hold another run's weights (an
            # external server, a restarted job) or the base model; push the trainer's own as this version.
            self.weight_sync.sync(self.model_version)
        self._check_weight_sync()
        if not self.is_world_process_zero():
            return
        per_micro_batch = (None if args.max_groups_per_step is None
                           else math.ceil(args.max_groups_per_step / args.gradient_accumulation_steps))
        self.batcher = TokenBudgetBatcher(self.token_budget, self.accelerator.num_processes, per_micro_batch)
        self.position = TrainedPosition(start_position)
        self.pulled = TrainedPosition(start_position)  # every position whose outcome has left the queue
        self.num_prompts = len(self.train_dataset) if self._prompts_have_length else None
        self.sample_position: dict[int, int] = {}
        prefix = getattr(self.weight_sync.backend, "prefix", "policy")
        self.worker = RolloutWorker(
            args, self.model_id, self.train_dataset, self.reward_funcs,
            self.processing_class, self.eos_token_ids, loop_cls=self.loop_cls, tools=self.tools,
            environment_factory=self.environment_factory, dataset_start_index=start_position,
            eval_dataset=self.eval_dataset if self.evaluation.schedule.enabled else None,
            lora_name=f"{prefix}-v{{version}}" if adapter else None,
            initial_allowance=initial_allowance(args.max_staleness, args.weight_sync_steps, self.token_budget,
                                                args.gradient_accumulation_steps, self.accelerator.num_processes),
            step_capacity_tokens=step_capacity(self.token_budget, args.gradient_accumulation_steps,
                                               self.accelerator.num_processes, args.weight_sync_steps))
        self._outcomes_taken = 0  # prompt outcomes pulled from the rollout queue (`_round_done`)
        self._round_flushed: tuple[int, int] | None = None
        self.worker.set_model_version(self.model_version)
        self.worker.start()
        self.watch = WorkerWatch(self.worker).start()
        self.watch.server = self.server_watch
        # one outage, one clock: a weight sync that meets the outage late gives up when the worker does
        self.sampler.outage.peer_deadline = lambda: float(self.worker.server_down_until.value) if self.worker else 0.0
        self.live.update(force=True, state="running")
        self.live.start_ticker(self._update_status)

    def _broadcast(self, obj: Any) -> Any:
        if self.accelerator.num_processes == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------------------------ the loop
    def _loop(self, model, trial) -> None:
        from .weight_sync import WeightSyncError

        args = self.args
        rank = self.accelerator.process_index
        nproc = self.accelerator.num_processes
        self._last_loss = 0.0
        peak = PeakFlops.detect(self.accelerator.device, args)
        while True:
            step_start = time.monotonic()
            plan = self._next_step_plan() if self.is_world_process_zero() else None
            plan = self._broadcast(plan)
            if plan.repush:
                self._settle_sync()
                try:
                    self._push_weights(self.model_version, again=True)  # logged (SPEC B.17)
                except WeightSyncError as exc:
                    if not self._sync_failed_while_stopping(exc):
                        raise
                    self._end_without_step(model, trial, StepPlan(stop=True, stop_reason="stopped"))
                    break
                continue
            if not plan.rows:
                self._end_without_step(model, trial, plan)
                break
            if self.worker is not None:  # what is pulled from now on trains after this step (issue #33)
                syncs = (self.state.global_step + 1) % args.weight_sync_steps == 0
                self.worker.set_pull_version(self.model_version + int(syncs))
            micro = len(plan.rows)  # ga, or fewer for a step trained before its rows filled (last step, round done)
            fwd_bwd_start, host_before = time.monotonic(), ThreadTimes.read()  # host_time.py: CPU and run-queue
            contributions, my_rows, losses = [], [], []
            forwards = SpanClock(self.accelerator.device)
            for m, rows in enumerate(plan.rows):
                row = pack_row(rows[rank] if rank < len(rows) else [])
                my_rows.append(row)
                forwards.start()
                loss, metrics = row_loss(model, row, self.loss_config, plan.global_trained[m], nproc, self.moe_aux,
                                         micro_batch_sequences(rows), self.reference, defer_metrics=True)
                forwards.stop()
                self.accelerator.backward(loss / micro)
                losses.append(loss.detach())
                contributions.append(metrics)
            # The step's one host sync of the micro-batch loop (NOTES_host_syncs.md): the losses and metrics of every
            # micro-batch, read after the last backward, so perf/fwd_bwd_s is the GPU's time, not launch time.
            loss_values, contributions = read_pending(losses, contributions)
            loss_sum = 0.0
            for value in loss_values:  # the same sum, in the same order, as a read per micro-batch gave
                loss_sum += value / micro
            fwd_bwd_s = time.monotonic() - fwd_bwd_start
            fwd_s, host_times = forwards.seconds(), host_time_metrics(host_before, ThreadTimes.read())
            self._settle_sync()  # an overlapped sync reads the parameters the optimizer step changes
            opt_start = time.monotonic()
            self._in_optimizer_step = True  # a failure in here leaves no step to save
            grad_norm = None
            if args.max_grad_norm and args.max_grad_norm > 0:
                grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            model.zero_grad(set_to_none=True)
            optimizer_s = time.monotonic() - opt_start
            self.state.global_step += 1
            self._in_optimizer_step = False
            trained_version = self.model_version
            ends = plan.stop or 0 < args.max_steps <= self.state.global_step or self._stop_requested
            sync, sync_error = self._sync_after_step(overlap=not ends)  # overlap: on a thread, settled later
            self._finish_step(plan, my_rows, contributions, loss_sum, grad_norm, time.monotonic() - step_start,
                              (fwd_bwd_s, fwd_s, host_times), optimizer_s, sync, peak, trained_version)
            if sync_error is not None:
                self._log_window()
                self._raise_sync_failure(sync_error)
            last = (plan.stop or 0 < args.max_steps <= self.state.global_step) and not self._stop_requested
            self.evaluation.after_step(self, self.state.global_step, final=last)  # README "Evaluation"
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.state.global_step % max(1, int(args.logging_steps)) == 0 or plan.stop or self._stop_requested:
                self._log_window()  # (a stop saves this step: its metrics line comes first)
            if plan.stop or (args.max_steps > 0 and self.state.global_step >= args.max_steps):
                self.control.should_save = args.save_strategy != "no"
                self.control.should_training_stop = True
            if self._broadcast(self._stop_requested):  # a signal during the step (rank 0 decides): save, stop
                self._stop_requested = True
                self.control.should_save = self.control.should_training_stop = True
            if self.control.should_save:
                self._save_checkpoint_with_position(model, trial)
                self.control.should_save = False
            if self.control.should_training_stop:
                break

    def _end_without_step(self, model, trial, plan: StepPlan) -> None:
        """A plan without rows: the epochs are done, a signal asked to stop, or the worker failed. A stop or a
        failure saves the last completed step first (every rank); a failure is then raised."""
        from ..rollout.worker import RolloutWorkerError

        self._settle_sync()  # sampler.weight_sync_overlap: the last step's sync first (abandoned by a stop: said)
        if plan.stop_reason in ("stopped", "failed"):
            if self.state.global_step > self._last_saved_step:
                self._save_checkpoint_with_position(model, trial)
        elif self.args.save_strategy != "no" and self.state.global_step > self._last_saved_step:
            self._save_checkpoint_with_position(model, trial)
        if plan.stop_reason == "stopped":
            self._stop_requested = True
        if plan.stop_reason == "failed":
            from .server_watch import ServerHungError

            saved = (f"checkpoint-{self._last_saved_step} holds the last completed step"
                     if self._last_saved_step > 0 else "no step was completed, no checkpoint was written")
            hung = getattr(self.watch, "problem_kind", None) == "server"
            raise (ServerHungError if hung else RolloutWorkerError)(f"{plan.error}\n({saved})")

    def _finish_step(self, plan: StepPlan, my_rows, contributions, loss_sum, grad_norm, step_s, fwd_times,
                     optimizer_s, sync, peak, trained_version: int) -> None:
        args = self.args
        fwd_bwd_s, fwd_s, host_times = fwd_times
        merged = merge_metric_contributions(contributions)
        stats = [r.stats() for r in my_rows]
        if self.accelerator.num_processes > 1:
            gathered = [None] * self.accelerator.num_processes
            torch.distributed.all_gather_object(gathered, (merged, stats, loss_sum))
            merged = merge_metric_contributions(g[0] for g in gathered)
            loss_sum = sum(g[2] for g in gathered)
            stats_by_rank = [g[1] for g in gathered]
            micro_batches = [[stats_by_rank[r][m] for r in range(len(stats_by_rank))] for m in range(len(my_rows))]
        else:
            micro_batches = [[s] for s in stats]
        self._last_loss = loss_sum
        w = self.window
        for name, value in finalize_metrics(merged).items():
            w.add(name, value)
        w.add("loss", loss_sum)
        if grad_norm is not None:
            w.add("grad_norm", float(grad_norm))
        w.add("learning_rate", self._get_learning_rate())
        if not self.is_world_process_zero():
            return
        bm = batch_metrics(micro_batches, token_budget=self.token_budget,
                           dropped_oversize_count=getattr(self, "_step_oversize", 0))
        for name, value in bm.items():
            w.add(name, value)
        forwarded = int(bm.get("batch/forwarded_tokens_per_step", 0))
        trained = int(bm.get("batch/trained_tokens_per_step", 0))
        self._num_tokens += forwarded  # logged as the running total at each log (`_log_window`), SPEC §15.2
        trained_samples = [s for rows in plan.rows for row in rows for s in row]
        for s in trained_samples:
            if not s.num_trained_tokens:  # a cut completion's stub (mask_truncated_completions): no sample metrics
                self._sample_finished(s)
                continue
            w.add("sample/forwarded_tokens_mean", s.num_tokens)
            w.add("sample/forwarded_tokens_max", s.num_tokens)
            w.add("sample/trained_tokens_mean", s.num_trained_tokens)
            if s.reward is not None:  # the trained groups' score, whenever scored (`reward`: this window's groups)
                w.add("reward_trained", s.reward)
            staleness = trained_version - s.model_version
            w.add("sample/staleness_mean", staleness)
            w.add("sample/staleness_max", staleness)
            record_stale_verdict(w, s.num_trained_tokens, args.max_completion_length, trained=True)
            self._sample_finished(s)
        w.add("perf/step_s", step_s)
        self._last_step_s = step_s
        watch = getattr(self, "server_watch", None)
        for name, value in (watch.step_metrics() if watch is not None else {}).items():
            w.add(name, value)  # its silence, its engine core's and front end's CPU (train/server_watch.py)
        w.add("perf/fwd_bwd_s", fwd_bwd_s)
        w.add("perf/fwd_s", fwd_s)
        for name, value in {**host_times, **self.memory_watch.step(self.accelerator.device),
                            **self.host_load.step()}.items():
            w.add(name, value)  # host_time.py, cuda_memory.py, host_load.py
        w.add("perf/optimizer_s", optimizer_s)
        w.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, fwd_bwd_s)
        w.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        w.add_rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        for name, value in sync.items():
            w.add(name, value)
        if peak is not None:
            flops = sum(step_flops(self.model, r) for mb in micro_batches for r in mb)
            w.add("perf/fwd_bwd_mfu", flops / fwd_bwd_s / peak.total(self.accelerator.num_processes))
            w.add("perf/wall_clock_mfu", flops / step_s / peak.total(self.accelerator.num_processes))
        sample_tokens = sum(s.num_tokens for s in trained_samples)
        self.worker.publish_allowance(allowance_after_step(args.max_staleness, args.weight_sync_steps, sample_tokens))
        self.worker.publish_capacity(step_capacity(self.token_budget, args.gradient_accumulation_steps,
                                                   self.accelerator.num_processes, args.weight_sync_steps,
                                                   sample_tokens, forwarded, args.max_groups_per_step,
                                                   len({s.group_id for s in trained_samples})))
        self._tell_worker_served()  # not ahead of the server (sampler.weight_sync_overlap)
        if self.num_prompts:  # a stream's length is unknown: its epoch is not reported
            self.state.epoch = self.position.value / self.num_prompts
        self._update_status(force=True)
        self._update_progress_total()

    def _update_progress_total(self) -> None:
        """Epoch-based runs (``max_steps=-1``): the number of steps is not known in advance (a step is a token
        budget of rows), so the progress bar shows no total, then the steps projected from the share of the
        epochs done (``state.max_steps`` stays a large bound for transformers' own stop rule)."""
        from transformers.trainer_callback import ProgressCallback

        if self.args.max_steps > 0:
            return
        bar = next((getattr(cb, "training_bar", None) for cb in self.callback_handler.callbacks
                    if isinstance(cb, ProgressCallback)), None)
        if bar is None:
            return
        epochs = float(self.args.num_train_epochs or 0)
        done = (self.state.epoch or 0.0) / epochs if epochs > 0 else 0.0
        total = max(self.state.global_step, math.ceil(self.state.global_step / done)) \
            if done > 0 and self.state.global_step > 0 else None
        if bar.total != total:
            bar.total = total
            bar.refresh()

    def _update_status(self, force: bool = False) -> None:
        if self.live is None or self.worker is None:
            return
        self.live.update(force=force, step=self.state.global_step, epoch=self.state.epoch,
                         model_version=self._served_version(), queue_size=self._queue_size(),
                         concurrency=int(self.worker.concurrency_value.value),
                         rollouts_finished=_shared_value(self.worker, "rollouts_done_value"),
                         concurrency_cap=int(self.worker.cap_value.value),
                         worker_heartbeat_age_s=round(self.worker.heartbeat_age_s(), 2),
                         worker_pid=getattr(self.worker.process, "pid", None),  # the console's silent-worker line
                         last_step_s=round(getattr(self, "_last_step_s", 0.0), 2) or None,
                         server_status=self._server_status(),
                         server_silent_s=getattr(getattr(self, "server_watch", None), "shown_silence_s", lambda: None)(),
                         groups_without_signal=int(self.worker.no_signal_value.value),
                         max_groups_without_signal=self.args.max_groups_without_signal,
                         dataset_start_index=self.position.value, **self._stopping_status())

    def _queue_size(self) -> int | None:
        try:
            return int(self.worker.rollout_buffer.qsize())
        except (NotImplementedError, AttributeError):
            return None

    def _log_window(self) -> None:
        """Log the window since the last log (``metrics.jsonl``, trackers, the plain line). In the window a stop
        signal ended, generation ended at the signal (`RolloutWorker.begin_stop`) while the step went on, so
        its generation rates would cover a span cut short: seconds, with no group finished in them (``gen 0
        tok/s 0 rollouts/s`` in a fault trial, SIGINT one second into a step) or the one that did; they are left
        out (the line shows ``gen — (no generation figures in this window)``)."""
        from ..rollout.loop import GENERATION_RATES

        self._logged_step = self.state.global_step
        if self.worker is not None:
            for snapshot in self.worker.drain_metrics():
                self.window.merge(snapshot)
            qs = self._queue_size()
            if qs is not None:
                self.window.add("rollout/queue_size", qs)
        self.window.add("sample/dropped_stale_count", 0)  # present (0) in windows without drops
        logs = {k: v for k, v in self.window.flush().items()
                if v is not None and not (self._stop_requested and k in GENERATION_RATES)}
        if not self.is_world_process_zero():
            return
        logs["num_tokens"] = self._num_tokens  # a running total (resumed from rollout_state.json), not a window mean
        kv = logs.get("rollout/vllm_kv_cache_usage_frac")
        self.live.update(kv_cache_usage_frac=kv, requests_running=logs.get("rollout/vllm_running_requests"),
                         requests_waiting=logs.get("rollout/vllm_queued_requests"))
        self.log(dict(logs))
        epoch = {} if self.state.epoch is None else {"epoch": self.state.epoch}
        self.live.append_metrics({"step": self.state.global_step, **epoch, "time": time.time(), **logs})
        if self.args.log_completions and self.worker is not None:  # SPEC §16.3: completions.jsonl, trackers
            log_completions(self.worker.take_completions(), self.state.global_step, self.args.num_completions_to_print,
                            self.live, self.callback_handler.callbacks)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """transformers' warnings of missing and unexpected keys after a checkpoint's weights are loaded, without
        the tied parameters the load restored (`checkpoint.without_tied_missing_keys`: a resume of a model with
        tied embeddings read ``missing keys ['lm_head.weight']``); a key that is really missing is still reported."""
        from .checkpoint import without_tied_missing_keys

        super()._issue_warnings_after_load(without_tied_missing_keys(self.model, load_result))

    def _save_checkpoint(self, model, trial) -> None:
        """`transformers.Trainer._save_checkpoint`, made atomic and carrying the rollout position
        (`checkpoint.save_checkpoint`)."""
        from .checkpoint import save_checkpoint

        rollout_state = None
        if self.is_world_process_zero() and getattr(self, "position", None) is not None:
            rollout_state = {"position": self.position.value, "num_prompts": self.num_prompts,
                             "num_tokens": self._num_tokens}
        self._last_checkpoint = save_checkpoint(self, trial, rollout_state)
        self._last_saved_step = self.state.global_step

    def _save_checkpoint_with_position(self, model, trial):
        """Save the checkpoint of the current step (every rank) and report it and its duration in
        ``status.json`` (``last_save_s``: the supervisor's stop grace derives from it). Returns the folder."""
        self._settle_sync()  # sampler.weight_sync_overlap: the saved step's sync is done (or failed) first
        if self.live is not None:
            self.live.update(force=True, state="saving")
        start = time.monotonic()
        self._save_checkpoint(model, trial)
        if self.live is not None:
            from ..run.folder import resume_command_from_env

            self.live.update(force=True, state="running", last_checkpoint=str(self._last_checkpoint),
                             resume_command=resume_command_from_env(self._last_checkpoint),
                             last_save_s=round(time.monotonic() - start, 2))
        return self._last_checkpoint


def _shared_value(worker: Any, name: str) -> int | None:
    """The worker's shared counter ``name`` as an int, None for a worker without it (a custom or test worker)."""
    value = getattr(worker, name, None)
    return None if value is None else int(value.value)
