"""Epoch-based runs (max_steps=-1) show no made-up total: no total at first, then the steps projected from the
share of the epochs done, so the bar's ETA is sane (issue #19)."""

from __future__ import annotations

import io
import types

from tqdm.auto import tqdm
from transformers.trainer_callback import ProgressCallback

from asyncgrpo_cli.train.trainer import AsyncGRPOTrainer


def _fake(max_steps, epochs=2.0):
    bar = tqdm(total=10**9, file=io.StringIO())
    callback = ProgressCallback()
    callback.training_bar = bar
    return types.SimpleNamespace(args=types.SimpleNamespace(max_steps=max_steps, num_train_epochs=epochs),
                                 state=types.SimpleNamespace(epoch=0.0, global_step=0),
                                 callback_handler=types.SimpleNamespace(callbacks=[callback])), bar


def test_epoch_run_bar_has_no_total_then_the_projected_steps():
    fake, bar = _fake(-1)
    AsyncGRPOTrainer._update_progress_total(fake)
    assert bar.total is None
    fake.state.epoch, fake.state.global_step = 0.5, 10  # a quarter of 2 epochs after 10 steps
    AsyncGRPOTrainer._update_progress_total(fake)
    assert bar.total == 40
    fake.state.epoch, fake.state.global_step = 2.0, 41
    AsyncGRPOTrainer._update_progress_total(fake)
    assert bar.total == 41


def test_step_based_run_keeps_its_total():
    fake, bar = _fake(8)
    bar.total = 8
    AsyncGRPOTrainer._update_progress_total(fake)
    assert bar.total == 8
