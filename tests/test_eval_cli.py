"""`asyncgrpo train` with evaluation on (issue #27 item 6, README "Evaluation"): a tiny model, 3 steps,
trainer.eval_strategy=steps trainer.eval_steps=2 and 4 generated eval prompts; eval/reward lands in
metrics.jsonl once per round, the plain log prints each round and training_curves.png is drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo_cli.testing import make_tiny_model
from tests.test_main_job import asyncgrpo, finish, tiny_args


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_train_cli_with_eval_rounds(tiny, tmp_path):
    out = tmp_path / "run"
    proc = asyncgrpo(*tiny_args(tiny, out, "trainer.max_steps=3", "trainer.save_strategy=no",
                                "trainer.eval_strategy=steps", "trainer.eval_steps=2",
                                "data.eval_generator=reasoning_gym", "data.eval_size=4"),
                     cwd=Path(__file__).resolve().parents[1])
    stdout, _ = finish(proc, idle_s=400)
    assert proc.returncode == 0, stdout
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [line for line in lines if line.get("event") == "eval"]
    assert [r["step"] for r in rounds] == [2, 3] and all(r["eval/num_completions"] == 4 for r in rounds)
    assert all("eval/reward" in r and "eval/pass_rate" in r and "eval/rewards/first_token_parity/mean" in r
               for r in rounds)
    assert [line["step"] for line in lines if "event" not in line] == [1, 2, 3]
    assert "eval @ step 2 | eval reward" in stdout and "eval @ step 3 | eval reward" in stdout
    assert (out / "training_curves.png").is_file()
    assert "final eval @ step 3" in stdout  # the end-of-run summary
