"""A wheel install finds conf/ and recipes/ without the checkout (they are packaged under asyncgrpo_cli/_data)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_carries_conf_and_recipes_and_composes(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(ROOT)], check=True, timeout=300)
    wheel = next(wheel_dir.glob("asyncgrpo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "asyncgrpo_cli/_data/conf/config.yaml" in names
    assert "asyncgrpo_cli/_data/recipes/deepmath.yaml" in names and "asyncgrpo_cli/_data/recipes/smoke.yaml" in names
    assert "asyncgrpo_cli/config/trainer_fields.json" in names  # composing without importing transformers
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    code = ("import asyncgrpo_cli, sys; from asyncgrpo_cli.config.compose import compose, conf_dir; "
            "assert '_data' in str(conf_dir()), conf_dir(); "
            "c = compose(['+recipe=deepmath']); print(asyncgrpo_cli.__file__, c.sampler.max_model_len)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    installed, max_len = result.stdout.split()
    assert installed.startswith(str(site)) and max_len == "4096"
