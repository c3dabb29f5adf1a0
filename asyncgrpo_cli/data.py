"""Prompt datasets from the `data` group: a `datasets` dataset or a procedural generator (reasoning-gym).

Every row comes out conversational (SPEC §2): a ``prompt`` list of ``{"role", "content"}`` messages plus
the other columns, which reach the reward functions by name (SPEC §10.1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config.rules import ConfigError
from .config.multimodal import image_part


# A single local data file is loaded with the `datasets` builder of its format (its split is "train").
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
                  ".arrow": "arrow", ".txt": "text"}


def _as_messages(value: Any, system_prompt: str | None) -> list[dict[str, str]]:
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        found = image_part(value)
        if found is not None:
            raise ConfigError(f"data.prompt_column: a prompt contains image content ({found}); images are not "
                              "supported (SPEC §14). Fix: use a text-only dataset or drop the image parts")
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    else:
        raise ConfigError(f"data.prompt_column: a prompt must be a string or a list of {{role, content}} messages, "
                          f"got {type(value).__name__}. Fix: point data.prompt_column at the prompt column")
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def reasoning_gym_rows(task: str, size: int, seed: int, task_kwargs: dict[str, Any] | None = None,
                       system_prompt: str | None = None) -> list[dict[str, Any]]:
    """``size`` rows of a reasoning-gym task: ``prompt`` (messages), ``answer`` (str), ``task``.

    Raises:
        ConfigError: when the task name is unknown or its keyword arguments are refused.
    """
    try:
        import reasoning_gym
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ConfigError("data.generator=reasoning_gym needs the reasoning-gym package. "
                          "Fix: pip install reasoning-gym") from exc
    try:
        generated = reasoning_gym.create_dataset(task, size=size, seed=seed, **(task_kwargs or {}))
    except Exception as exc:
        raise ConfigError(f"data.task={task!r} with data.task_kwargs={task_kwargs}: reasoning-gym refused it "
                          f"({type(exc).__name__}: {exc}). Fix: use a registered task such as basic_arithmetic "
                          "or chain_sum, with that task's own keyword arguments") from exc
    return [{"prompt": _as_messages(item["question"], system_prompt), "answer": str(item["answer"]), "task": task}
            for item in generated]


def load_prompts(cfg: DictConfig):
    """The prompt dataset of a composed config, as a `datasets.Dataset` (or IterableDataset when streaming).

    Raises:
        ConfigError: when neither ``data.name`` nor ``data.generator`` is set, the generator is unknown,
            or the prompt column is missing.
    """
    import datasets

    data = cfg.data
    if data.generator:
        if int(data.size) < 1:
            raise ConfigError(f"data.size={data.size}: a generator must make at least one prompt. Fix: data.size=1000",
                              key="data.size")
        if data.generator != "reasoning_gym":
            raise ConfigError(f"data.generator={data.generator!r}: unknown generator. Fix: use reasoning_gym, "
                              "or set data.name to a dataset")
        kwargs = OmegaConf.to_container(data.task_kwargs, resolve=True) if data.task_kwargs else {}
        rows = reasoning_gym_rows(str(data.task), int(data.size), int(data.seed), kwargs, data.system_prompt)
        return datasets.Dataset.from_list(rows)
    if not data.name:
        raise ConfigError("data.name=None and data.generator=None: there are no prompts. Fix: add +recipe=NAME, "
                          "data.name=HUB_ID_OR_PATH, or data.generator=reasoning_gym data.task=basic_arithmetic")
    from .config.sources import check_data_source

    check_data_source(str(data.name))
    path = Path(str(data.name)).expanduser()
    builder = _FILE_BUILDERS.get(path.suffix.lower()) if path.is_file() else None
    try:
        if builder is not None:  # one data file: datasets loads it with the builder of its format
            ds = datasets.load_dataset(builder, data_files=str(path), split=str(data.split),
                                       streaming=bool(data.streaming))
        else:
            ds = datasets.load_dataset(str(data.name), data.subset, split=str(data.split),
                                       streaming=bool(data.streaming))
    except (StopIteration, ValueError) as exc:  # datasets' words for an empty file or folder
        if not isinstance(exc, StopIteration) and "corresponds to no data" not in str(exc):
            raise
        raise ConfigError(f"data.name={str(data.name)!r}: no rows (the file, or every data file of the folder, is "
                          "empty), so no prompt could ever be sampled. Fix: point data.name at a file or folder "
                          "with at least one prompt (json, jsonl, csv, parquet)", key="data.name") from None
    column = str(data.prompt_column)
    names = ds.column_names or []
    if not data.streaming and len(ds) == 0:
        raise ConfigError(f"data.name={str(data.name)!r}: split {data.split!r} has no rows, so no prompt could ever "
                          "be sampled. Fix: check the file and data.split; it needs at least one prompt",
                          key="data.name")
    if names and column not in names:
        raise ConfigError(f"data.prompt_column={column!r}: the dataset has columns {names}. "
                          "Fix: set data.prompt_column to the column that holds the prompt")

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        prompt = _as_messages(row[column], data.system_prompt)
        return {"prompt": prompt}

    if column != "prompt":
        ds = ds.map(convert, remove_columns=[column])
    elif data.system_prompt or (names and not isinstance(next(iter(ds), {}).get("prompt", []), list)):
        ds = ds.map(convert)
    return ds


#: ``data.*`` keys of the training source -> the eval source's keys, for the messages of `load_eval_prompts`.
_EVAL_KEYS = {"data.name": "data.eval_name", "data.split": "data.eval_split", "data.generator": "data.eval_generator",
              "data.size": "data.eval_size"}


def has_eval_prompts(cfg: DictConfig) -> bool:
    """Whether the composed config names eval prompts (``data.eval_name`` or ``data.eval_generator``)."""
    data = cfg.data
    return bool(data.get("eval_name") or data.get("eval_generator"))


def load_eval_prompts(cfg: DictConfig):
    """The eval prompts of a composed config (README "Evaluation"), as a `datasets.Dataset`, or None when
    neither ``data.eval_name`` nor ``data.eval_generator`` is set. Loaded like the training prompts
    (`load_prompts`: same ``subset``, ``prompt_column``, ``system_prompt``, ``task``, ``task_kwargs``), never
    streamed; ``data.eval_size`` > 0 keeps the first ``eval_size`` rows of a dataset.

    Raises:
        ConfigError: as `load_prompts`, naming the ``data.eval_*`` key.
    """
    if not has_eval_prompts(cfg):
        return None
    data = cfg.data
    seed = data.get("eval_seed")
    values = OmegaConf.to_container(data, resolve=True)
    values.update(name=data.get("eval_name"), generator=data.get("eval_generator"),
                  split=data.get("eval_split") or data.split, size=int(data.get("eval_size", 64)),
                  seed=int(seed) if seed is not None else int(data.seed) + 1, streaming=False)
    try:
        ds = load_prompts(OmegaConf.create({"data": values}))
    except ConfigError as exc:
        text, key = str(exc), exc.key
        for train_key, eval_key in _EVAL_KEYS.items():
            text = text.replace(train_key + "=", eval_key + "=").replace("Fix: " + train_key, "Fix: " + eval_key)
        raise ConfigError(text, key=_EVAL_KEYS.get(key, key)) from None
    size = int(data.get("eval_size", 64))
    if not data.get("eval_generator") and size > 0 and len(ds) > size:
        ds = ds.select(range(size))
    return ds
