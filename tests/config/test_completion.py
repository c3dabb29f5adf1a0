"""Shell completion of overrides: ``+recipe=`` names, config keys and the values of choices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncgrpo_cli.config.completion import complete_override, config_keys, key_values

ROOT = Path(__file__).resolve().parents[2]


def test_recipes_keys_and_values_complete():
    assert complete_override("+rec") == ["+recipe="]
    assert "+recipe=smoke" in complete_override("+recipe=") and complete_override("+recipe=sm") == ["+recipe=smoke"]
    assert complete_override("rollout.te") == ["rollout.temperature="]
    assert "rollout." in complete_override("roll") and "+recipe=" in complete_override("")
    assert complete_override("trainer.learning") == ["trainer.learning_rate="]  # the generated trainer group
    assert complete_override("sampler.backend=e") == ["sampler.backend=embedded", "sampler.backend=external"]
    assert complete_override("peft.enabled=") == ["peft.enabled=true", "peft.enabled=false"]
    assert complete_override("+peft.nope") == [] and complete_override("model.name=") == []  # free text
    assert {"model.name", "staleness.max_staleness", "launch.server_gpus", "rewards"} <= set(config_keys())
    assert key_values("logging.dashboard") == ["auto", "rich", "plain", "off"]


def test_a_recipes_dir_adds_its_recipes(tmp_path):
    (tmp_path / "mine.yaml").write_text("# description: mine\n")
    assert complete_override("+recipe=mi", [tmp_path]) == ["+recipe=mine"]
    assert complete_override("+recipe=sm", [tmp_path / "missing"]) == ["+recipe=smoke"]  # built-in ones still


def _complete(words: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "_ASYNCGRPO_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))}
    code = "import sys; sys.argv[0] = 'asyncgrpo'; from asyncgrpo_cli.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return proc.stdout.split()


def test_the_shell_gets_them_through_the_cli():
    """What bash asks ``asyncgrpo`` (``--install-completion`` installs the asking side); bash splits a word at
    ``=``, so ``+recipe=sm`` arrives as ``+recipe`` ``=`` ``sm`` and only ``smoke`` goes back."""
    assert _complete("asyncgrpo train +recipe=sm") == ["+recipe=smoke"]
    assert _complete("asyncgrpo train +recipe = sm") == ["smoke"]
    assert _complete("asyncgrpo doctor +recipe=smoke sampler.backend = ext") == ["external"]
    assert "rollout.temperature=" in _complete("asyncgrpo config rollout.te")
