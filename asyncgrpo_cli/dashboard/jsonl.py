"""Reading JSON-lines files that another process is still appending to."""

from __future__ import annotations

import json
from typing import Any


def parse_json_lines(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of ``data`` (UTF-8 JSON lines); blank lines, non-objects and broken JSON are skipped."""
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
