"""Suite-wide: the per-test timeout (pytest-timeout, ``timeout`` in pyproject.toml) follows the machine's load,
so a loaded CI machine makes tests slower, not failed (`asyncgrpo_cli.testing.deadline_s`)."""

from __future__ import annotations

import pytest

from asyncgrpo_cli.testing import deadline_s


def pytest_collection_modifyitems(config, items):
    try:
        base = float(config.getini("timeout") or 0)
    except (ValueError, TypeError):  # pytest-timeout not installed
        return
    if base <= 0 or config.getoption("timeout", None):  # --timeout on the command line wins
        return
    scaled = deadline_s(base)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(scaled))
