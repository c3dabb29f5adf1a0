"""Environments and tools shipped with asyncgrpo for the agent recipes (SPEC §13).

- `asyncgrpo_cli.envs.increment`: SPEC §13.2's `IncrementEnv` (environment-owned data and reward) and a
  tool-call reward for it (``+recipe=increment_env``).
- `asyncgrpo_cli.envs.calculator`: a ``calculate`` tool for arithmetic tasks (``+recipe=calculator``).
"""
