"""Checkpoint folders of a run, as the launcher, the dashboard and the trainer all read them (SPEC §12).

A checkpoint is written into ``<output_dir>/.checkpoint-N.partial/`` and renamed to ``checkpoint-N/`` once
complete (`asyncgrpo_cli.train.checkpoint` writes it). It is *complete* when it holds ``trainer_state.json``, a
readable ``rollout_state.json`` and model weights. This module lists and judges them, and resolves what
``resume_from_checkpoint`` names; it reads files only (no torch).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .state import ROLLOUT_STATE_NAME, RolloutStateError, read_rollout_state

__all__ = ["CHECKPOINT_RE", "CHECKSUM_NAME", "FSDP_MODEL_PREFIX", "PARTIAL_SUFFIX", "TRAINER_STATE_NAME",
           "WEIGHT_MARKERS", "CheckpointError", "checkpoint_problem", "checkpoint_step", "final_dir",
           "list_checkpoints", "newest_complete_checkpoint", "partial_dir", "resolve_resume"]

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
PARTIAL_SUFFIX = ".partial"
TRAINER_STATE_NAME = "trainer_state.json"
CHECKSUM_NAME = "weights_checksum.json"
# Files or folders of which one holds the model weights (HF full / sharded / adapter / FSDP sharded saves).
WEIGHT_MARKERS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                  "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
FSDP_MODEL_PREFIX = "pytorch_model_fsdp"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message names the folder, the problem and the fix."""


# ------------------------------------------------------------------------------------------ layout
def checkpoint_step(folder: str | Path) -> int | None:
    """N of a ``checkpoint-N`` folder name, None for any other name."""
    match = CHECKPOINT_RE.match(Path(folder).name)
    return int(match.group(1)) if match else None


def partial_dir(run_dir: str | Path, step: int) -> Path:
    """The temporary folder a checkpoint of ``step`` is written into (same directory: the rename is atomic)."""
    return Path(run_dir) / f".checkpoint-{int(step)}{PARTIAL_SUFFIX}"


def final_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoint-<step>``."""
    return Path(run_dir) / f"checkpoint-{int(step)}"


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when it is (no file is modified)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "it does not exist or is not a folder"
    if not (folder / TRAINER_STATE_NAME).is_file():
        return f"{TRAINER_STATE_NAME} is missing (the save was interrupted)"
    try:
        json.loads((folder / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError) as exc:
        return f"{TRAINER_STATE_NAME} is unreadable ({exc})"
    if not (folder / ROLLOUT_STATE_NAME).is_file():
        return f"{ROLLOUT_STATE_NAME} is missing (the save was interrupted before the rollout position was written)"
    try:
        read_rollout_state(folder)
    except RolloutStateError as exc:
        return str(exc)
    names = set(os.listdir(folder))
    if not (names & set(WEIGHT_MARKERS) or any(n.startswith(FSDP_MODEL_PREFIX) for n in names)):
        return "it holds no model weights (model.safetensors, adapter_model.safetensors or pytorch_model_fsdp_0/)"
    return None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every ``checkpoint-N`` folder of ``run_dir``, complete or not, by N."""
    run = Path(run_dir)
    if not run.is_dir():
        return []
    found = [p for p in run.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p))


def newest_complete_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the largest N in ``run_dir``, None when there is none."""
    for folder in reversed(list_checkpoints(run_dir)):
        if checkpoint_problem(folder) is None:
            return folder
    return None


def resolve_resume(resume: str | bool | None, output_dir: str | Path) -> Path | None:
    """The checkpoint folder to resume from.

    Args:
        resume: None/False (start fresh), True (the newest complete checkpoint of ``output_dir``) or a folder.

    Raises:
        CheckpointError: True and no complete checkpoint exists, or the folder is incomplete or corrupt
            (the message names the problem and the newest complete checkpoint, or says there is none).
    """
    if resume is None or resume is False:
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "last")):
        newest = newest_complete_checkpoint(output_dir)
        if newest is None:
            incomplete = [p.name for p in list_checkpoints(output_dir)]
            extra = f" (incomplete: {', '.join(incomplete)})" if incomplete else ""
            raise CheckpointError(f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint-N "
                                  f"folder{extra}. Fix: start without resume_from_checkpoint, or point it at a "
                                  "checkpoint folder")
        return newest
    folder = Path(str(resume))
    problem = checkpoint_problem(folder)
    if problem is None:
        return folder
    newest = newest_complete_checkpoint(folder.parent if folder.parent.is_dir() else output_dir)
    fix = (f"resume_from_checkpoint={newest} (the newest complete checkpoint)" if newest is not None else
           "start without resume_from_checkpoint (no complete checkpoint exists next to it)")
    raise CheckpointError(f"resume_from_checkpoint={resume}: not a complete checkpoint: {problem}. Fix: {fix}")
