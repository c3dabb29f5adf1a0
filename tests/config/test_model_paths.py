"""Where model.name / model.gguf_file point (`asyncgrpo_cli.config.models.plan_model_path`): a folder in the
working directory that shares an installed package's name must not hide the package's GGUF behind "one of []"."""

from __future__ import annotations

import sys

import pytest

from asyncgrpo_cli.config.errors import ConfigError
from asyncgrpo_cli.config.models import plan_model_path


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    site = tmp_path / "site"
    pkg = site / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(site))
    yield pkg
    sys.modules.pop("fake_gguf_pkg", None)


def test_a_folder_in_the_working_directory_shadowing_the_package_is_named(fake_package, tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "fake_gguf_pkg").mkdir(parents=True)  # e.g. where the package's wheel was unpacked
    monkeypatch.chdir(work)
    with pytest.raises(ConfigError) as info:
        plan_model_path("fake_gguf_pkg", "tiny.gguf")
    text = str(info.value)
    assert "shadows the installed package fake_gguf_pkg" in text and "run from another directory" in text
    assert str(fake_package) in text and "one of []" not in text


def test_a_folder_without_any_gguf_says_so(tmp_path):
    with pytest.raises(ConfigError, match="holds no GGUF file"):
        plan_model_path(str(tmp_path), "missing.gguf")
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"one of \['other.gguf'\]"):
        plan_model_path(str(tmp_path), "missing.gguf")
