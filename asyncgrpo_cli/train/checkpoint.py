"""Checkpoints that are complete or absent (SPEC §12; DEVELOPERS.md "nothing lost").

A checkpoint is written into ``<output_dir>/.checkpoint-N.partial/`` and renamed to ``checkpoint-N/`` only
once every file is there: model (full, sharded or adapter), optimizer, scheduler, RNG, ``trainer_state.json``,
``weights_checksum.json`` and, last, ``rollout_state.json`` (the rollout position, SPEC §12). Older
checkpoints are rotated (``save_total_limit``) only after that rename, so a kill or a full disk at any point
leaves the last complete checkpoint untouched; a left-over ``.partial`` folder is deleted by the next save.

A checkpoint is *complete* when it holds ``trainer_state.json``, a readable ``rollout_state.json`` and model
weights. Resume refuses anything else, naming the newest complete checkpoint.

The weights checksum: for every trainable parameter, the sum (mod 2**64) of its elements' bit patterns read
as integers, summed over the FSDP shards (exact, any sharding). After resuming, the loaded model's checksum
must equal the saved one, bit for bit: a resume that silently kept the base model cannot pass.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

# The listing (layout, completeness, resume) lives in run/checkpoints.py, shared with the launcher; re-exported.
from ..run.checkpoints import (CHECKPOINT_RE, CHECKSUM_NAME, FSDP_MODEL_PREFIX, PARTIAL_SUFFIX,  # noqa: F401
                               TRAINER_STATE_NAME, WEIGHT_MARKERS, CheckpointError, checkpoint_problem,
                               checkpoint_step, final_dir, list_checkpoints, newest_complete_checkpoint,
                               partial_dir, resolve_resume)
from ..run.state import write_json_atomic


# ------------------------------------------------------------------------------------------ writing
def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_partials(run_dir: str | Path) -> list[Path]:
    """Delete left-over ``.checkpoint-N.partial`` folders of interrupted saves; returns what was removed."""
    run = Path(run_dir)
    if not run.is_dir():
        return []
    gone = []
    for p in run.iterdir():
        if p.name.startswith(".checkpoint-") and (p.name.endswith(PARTIAL_SUFFIX) or p.name.endswith(".replaced")):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def publish(partial: Path, final: Path) -> Path:
    """Make the complete ``partial`` folder the checkpoint ``final`` (fsync, then rename; an existing
    ``final`` of an earlier run is moved aside first and deleted after)."""
    _fsync_tree(partial)
    replaced = None
    if final.exists():
        replaced = final.with_name(f".{final.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def save_error(step: int, run_dir: str | Path, exc: BaseException) -> CheckpointError:
    """The `CheckpointError` for a save of ``step`` that failed with ``exc`` (ENOSPC, permissions, ...)."""
    import errno

    newest = newest_complete_checkpoint(run_dir)
    kept = (f"the last complete checkpoint {newest} is untouched" if newest is not None else
            "no complete checkpoint exists yet")
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC:
        fix = (f"free disk space on {run_dir} (or lower trainer.save_total_limit), then resume from "
               f"{newest}" if newest is not None else f"free disk space on {run_dir}")
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {run_dir} writable, or choose another trainer.output_dir"
    else:
        fix = "see the error above"
    return CheckpointError(f"saving checkpoint-{step} into {run_dir} failed: {type(exc).__name__}: {exc}; {kept}. "
                           f"Fix: {fix}")


def check_writable(output_dir: str | Path) -> None:
    """Raise a clear error when ``output_dir`` cannot be created or written.

    Raises:
        CheckpointError: names ``output_dir``, the OS error and the fix.
    """
    out = Path(output_dir)
    probe = out / f".write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"output_dir={out} is not writable ({type(exc).__name__}: {exc}). Fix: choose a "
                              "writable folder (trainer.output_dir=... on the CLI)") from None


# ------------------------------------------------------------------------------------------ checksum
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum (int64, wrapping) of the elements' bit patterns; 0-d int64 on the tensor's device."""
    t = tensor.detach().contiguous()
    if t.is_floating_point():
        t = t.view(_INT_VIEW[t.element_size()])
    return t.to(torch.int64).sum()


def _counts_here(param: Any) -> bool:
    """Whether this rank's shard of a DTensor adds to the checksum (replicated dims: coordinate 0 only)."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return True
    coordinate = param.device_mesh.get_coordinate() or []
    return all(not p.is_replicate() or coordinate[d] == 0 for d, p in enumerate(placements))


def weights_checksum(model: torch.nn.Module) -> dict[str, int]:
    """``{parameter name: checksum}`` of the trainable parameters (module docstring). A collective under
    FSDP2 (every rank calls it, same order); wrapper segments are removed from the names."""
    from .weight_sync.names import strip_wrappers

    named = [(strip_wrappers(n, peft=False), p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return {}
    sums = []
    with torch.no_grad():
        for _name, p in named:
            local = p.to_local() if hasattr(p, "to_local") else p
            sums.append(_bit_sum(local) if _counts_here(p) else torch.zeros((), dtype=torch.int64, device=local.device))
    total = torch.stack(sums)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return {name: int(v) for (name, _p), v in zip(named, total.cpu().tolist())}


def save_checksum(folder: str | Path, checksum: dict[str, int]) -> None:
    """Write ``weights_checksum.json`` into a checkpoint folder."""
    write_json_atomic(Path(folder) / CHECKSUM_NAME, {"params": checksum})


def verify_checksum(folder: str | Path, checksum: dict[str, int]) -> str:
    """Compare the loaded model's ``checksum`` with the one saved in ``folder``.

    Returns:
        a short line for the log (how many tensors matched, or that the checkpoint predates checksums).

    Raises:
        CheckpointError: a parameter differs or is missing: the weights were not restored.
    """
    path = Path(folder) / CHECKSUM_NAME
    if not path.is_file():
        return f"{folder} has no {CHECKSUM_NAME} (saved by an older version): weights loaded but not verified"
    try:
        saved = {k: int(v) for k, v in json.loads(path.read_text())["params"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}). Fix: resume from another checkpoint") from None
    missing = sorted(set(saved) - set(checksum))
    differ = sorted(n for n in saved if n in checksum and saved[n] != checksum[n])
    if missing or differ:
        names = ", ".join((differ + missing)[:5])
        raise CheckpointError(f"resuming from {folder}: the loaded weights do not equal the checkpoint's "
                              f"({len(differ)} tensor(s) differ, {len(missing)} missing, e.g. {names}); the model "
                              "would silently train from other weights. Fix: check that model.name and peft.* are "
                              "those of the run that saved it")
    return f"weights restored from {folder}: {len(saved)} tensors match the saved checksum"


# ------------------------------------------------------------------------------------------ the save
def save_checkpoint(trainer: Any, trial: Any, rollout_state: dict[str, Any] | None) -> Path:
    """Write the checkpoint of ``trainer.state.global_step`` atomically (module docstring); every rank calls it.

    Args:
        trainer: the `AsyncGRPOTrainer` (its `transformers.Trainer` save helpers write the files).
        rollout_state: rank 0's `save_rollout_state` keyword arguments (position, num_prompts, num_tokens).

    Returns:
        the ``checkpoint-N`` folder.

    Raises:
        CheckpointError: the save failed (disk full, permissions, ...); the partial folder is removed and
            every older checkpoint is left as it was.
    """
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import rotate_checkpoints

    from ..run.state import save_rollout_state

    args = trainer.args
    run_dir = Path(trainer._get_output_dir(trial=trial))
    step = int(trainer.state.global_step)
    partial, final = partial_dir(run_dir, step), final_dir(run_dir, step)
    zero = trainer.is_world_process_zero()
    error: BaseException | None = None
    try:
        if zero:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
    except OSError as exc:
        error = exc
    trainer.accelerator.wait_for_everyone()
    try:
        if error is None:
            if trainer.hp_search_backend is None and trial is None:
                trainer.store_flos()
            trainer.save_model(str(partial), _internal_call=True)
            if not args.save_only_model:
                trainer._save_optimizer_and_scheduler(str(partial))
                trainer._save_scaler(str(partial))
                trainer._save_rng_state(str(partial))
    except OSError as exc:
        error = exc
    checksum = weights_checksum(trainer.model)  # a collective: every rank, even after a failed write
    trainer.accelerator.wait_for_everyone()
    if error is None and zero:
        try:
            for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                       if isinstance(c, ExportableState)]:
                name, state = cb.__class__.__name__, cb.state()
                if isinstance(trainer.state.stateful_callbacks.get(name), list):
                    trainer.state.stateful_callbacks[name].append(state)
                else:
                    trainer.state.stateful_callbacks[name] = state
            trainer.state.save_to_json(str(partial / TRAINER_STATE_NAME))
            save_checksum(partial, checksum)
            save_rollout_state(partial, global_step=step, **(rollout_state or {}))  # last: marks it complete
            publish(partial, final)
        except OSError as exc:
            error = exc
    if error is not None:
        if zero:
            shutil.rmtree(partial, ignore_errors=True)
        raise save_error(step, run_dir, error) from error
    trainer.accelerator.wait_for_everyone()
    if zero:
        if args.push_to_hub:
            trainer._push_from_checkpoint(str(final))
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    return final


def load_checkpoint_weights(trainer: Any, folder: Path) -> None:
    """Load a checkpoint's model weights into a trainer that is not FSDP-wrapped (full or adapter; under
    FSDP `transformers.Trainer._prepare_for_training` loads them), and its RNG state."""
    if not trainer.is_fsdp_enabled:
        trainer._load_from_checkpoint(str(folder))


def without_tied_missing_keys(model: torch.nn.Module, load_result: Any) -> Any:
    """``load_result`` (``nn.Module.load_state_dict``'s ``missing_keys`` and ``unexpected_keys``) without the
    missing keys of tied parameters whose tie partner was loaded: those are restored by that load.

    A model with tied input and output embeddings (SmolLM2, ``tie_word_embeddings``) saves the shared tensor once
    (``model.embed_tokens.weight``); loading the checkpoint then lists ``lm_head.weight`` as missing although
    it is the same `Parameter` object as ``embed_tokens.weight``, which the load filled. transformers (5.24)
    warns ``There were missing keys in the checkpoint model loaded: ['lm_head.weight']`` for it, which reads as
    a broken checkpoint. Only a key whose parameter (or buffer) is the very object of a key that was loaded is
    removed; any other missing key is kept and still reported.

    Returns:
        an object of ``load_result``'s type (a ``(missing_keys, unexpected_keys)`` named tuple), or
        ``load_result`` itself when no key was removed.
    """
    missing = list(load_result.missing_keys)
    if not missing:
        return load_result
    names_of: dict[int, list[str]] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        names_of.setdefault(id(tensor), []).append(name)
    lost = set(missing)
    restored = {name for names in names_of.values() if any(n not in lost for n in names) for name in names}
    kept = [key for key in missing if key not in restored]
    if len(kept) == len(missing):
        return load_result
    return type(load_result)(kept, list(load_result.unexpected_keys))


def check_restored(trainer: Any, folder: Path) -> str:
    """After loading: compare the model's checksum with the checkpoint's (every rank; a collective).

    Raises:
        CheckpointError: the weights differ (see `verify_checksum`).
    """
    return verify_checksum(folder, weights_checksum(trainer.model))
