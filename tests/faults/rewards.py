"""Rewards of the fault suite: first-token parity (spread inside groups for a random model), and a log of every
scored prompt index (``ASYNCGRPO_FAULT_LOG``: one JSON line per group) to check that a resumed run trains each
prompt once."""

from __future__ import annotations

import json
import os


def logged_parity(completion_ids, index=None, **kwargs):
    """1.0 when the first completion token is even; appends ``{"run": ..., "index": ...}`` to the log."""
    path = os.environ.get("ASYNCGRPO_FAULT_LOG")
    if path and index:
        with open(path, "a") as fh:
            fh.write(json.dumps({"run": os.environ.get("ASYNCGRPO_FAULT_RUN", ""), "index": int(index[0])}) + "\n")
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


def failing_at_prompt_40(completion_ids, index=None, **kwargs):
    """`logged_parity`, raising on the group of prompt index 40 (a reward that breaks mid-run; the staleness
    allowance keeps the worker a few steps ahead of training at most, so steps were trained by then)."""
    if index and int(index[0]) == 40:
        raise RuntimeError("reward exploded on prompt 40")
    return logged_parity(completion_ids, index=index, **kwargs)


# Each call is logged (the resume tests count them): not called once before the start (config.reward_probe).
logged_parity.probe_at_start = False
failing_at_prompt_40.probe_at_start = False
