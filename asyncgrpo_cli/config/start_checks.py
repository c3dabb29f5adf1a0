"""Checks of a composed config that used to pass ``--dry-run`` and ``config --check`` and then fail once the
server and the trainer had started (issue #36): an external sampler that cannot be reached, a Hub dataset
that is not cached while the Hub is off, tools and environments that do not import, a run without any reward,
a generator with a dataset key, LoRA targets the model does not have, ``packing.attention=flash`` with no
flash-attention kernel installed (reward keyword arguments nothing reads: `sources.check_reward_kwargs`).

Each raises a `ConfigError` naming the key, the value and the fix; `run_checks.validate_run` runs them.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from .rules import ConfigError, ConfigErrors, config_error as _err

SAMPLER_PROBE_S = 10.0
"""Seconds the probe of an external sampler waits for an answer (the whole sampler.timeout, 30 minutes by
default, is for a server that loads, not for an address that drops packets)."""


# ------------------------------------------------------------------------------------------ the sampler
def sampler_problem(url: str, timeout_s: float = SAMPLER_PROBE_S) -> str | None:
    """Why no sampler answers at ``url`` (one ``GET /health`` of at most ``timeout_s`` s), as a clause ("none
    answers there (...)", or "a server answers there but it is not an inference server (...)"); None when one does.

    A refused connection, a name that does not resolve, an address that drops packets (no answer in
    ``timeout_s``) and an HTTP server without a ``/health`` route are problems; a 5xx answer is not (a server
    that is starting or recovering: the run waits for it).
    """
    answer = _health_answer(url, timeout_s)
    if isinstance(answer, str):
        return f"none answers there ({answer})"
    if answer.status_code == 200 or answer.status_code >= 500:
        return None
    return (f"a server answers there but it is not an inference server (GET /health answered HTTP "
            f"{answer.status_code}; vLLM and the embedded sampler answer 200 there)")


def _health_answer(url: str, timeout_s: float) -> Any:
    """The answer to ``GET {url}/health`` (an ``httpx.Response``), or why there is none (a str)."""
    import httpx

    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.TimeoutException:
        return (f"no answer within {timeout_s:g} s: the address drops packets (a firewall, or no machine with that "
                "address on this network)")
    except httpx.ConnectError as exc:
        text = str(exc)
        if "refused" in text.lower() or isinstance(exc.__cause__, ConnectionRefusedError):
            return "connection refused: no server listens there"
        if "name or service not known" in text.lower() or "nodename nor servname" in text.lower() \
                or "temporary failure in name resolution" in text.lower():
            return f"its host name does not resolve ({text[:120]})"
        return f"the connection failed ({text[:160]})"
    except httpx.HTTPError as exc:
        return f"the request failed ({type(exc).__name__}: {str(exc)[:160]})"


def _training_owner(url: str) -> Any:
    """The `run.port_owner.PortOwner` of an ``asyncgrpo train`` job whose server listens at ``url`` on this
    machine, else None."""
    from urllib.parse import urlsplit

    from ..run.port_owner import training_owner

    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return training_owner(parts.hostname or "", port)


def check_external_sampler(cfg: Any, timeout_s: float | None = None) -> None:
    """``sampler.backend=external``: a sampler answers at ``sampler.url`` now (the run starts none).

    Raises:
        ConfigError: naming ``sampler.url``, what went wrong and the fix (start it with ``asyncgrpo serve``):
            nothing answers there, what answers is not an inference server, or the server there belongs to
            another ``asyncgrpo train`` job on this machine (`run.port_owner`; its trainer changes its weights).
    """
    backend = getattr(cfg.sampler.backend, "value", cfg.sampler.backend)
    if backend != "external" or not cfg.sampler.url:
        return
    wait = min(float(cfg.sampler.timeout), SAMPLER_PROBE_S if timeout_s is None else timeout_s)
    owner = _training_owner(str(cfg.sampler.url))
    if owner is not None:
        raise _err("sampler.url", str(cfg.sampler.url), f"that server belongs to {owner.describe()}, whose trainer "
                   "changes its weights at every sync: this run would score and train on another policy's completions",
                   "start a server for this run in another shell with `asyncgrpo serve` and the same "
                   "model/sampler/rollout overrides, and point sampler.url at it; or drop sampler.backend=external")
    problem = sampler_problem(str(cfg.sampler.url), wait)
    if problem:
        raise _err("sampler.url", str(cfg.sampler.url), f"sampler.backend=external starts no server; {problem}",
                   "start it in another shell with `asyncgrpo serve` and the same "
                   "model/sampler/rollout overrides (it prints the command it runs), then run this again; or fix "
                   "sampler.url")


# ------------------------------------------------------------------------------------------ packing
def installed_flash_providers() -> list[str]:
    """The distributions that can provide the ``flash`` tree-attention kernel and are installed here, in the order
    the trainer tries them (``asyncgrpo_cli.train.flash_varlen``): ``flash-attn-4`` (a ``flash_attn/cute`` folder),
    ``flash-attn`` (a ``flash_attn`` package with its own ``__init__``) and ``kernels`` (Hub kernels). Looked up
    without importing them (flash-attn's import loads CUDA libraries)."""
    import importlib.util

    found = []
    spec = importlib.util.find_spec("flash_attn")
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        if any((Path(loc) / "cute").is_dir() for loc in locations):
            found.append("flash-attn-4")
        if spec.origin and spec.origin.endswith("__init__.py"):
            found.append("flash-attn")
    if importlib.util.find_spec("kernels") is not None:
        found.append("kernels")
    return found


def check_flash_kernel(attention: Any) -> None:
    """``packing.attention=flash`` needs a varlen flash-attention kernel: at least one provider is installed
    (whether it loads on the GPU, e.g. flash-attn-4 below compute capability 9.0 or a Hub kernel without network,
    is known at trainer start, where the reason is given).

    Raises:
        ConfigError: naming ``packing.attention``, what is missing and the fix.
    """
    if str(getattr(attention, "value", attention)) != "flash" or installed_flash_providers():
        return
    raise _err("packing.attention", "flash", "this backend calls a varlen flash-attention kernel, and none is installed "
               "(flash-attn-4, flash-attn or kernels)", "pip install flash-attn-4 (Hopper or newer GPUs), or "
               "packing.attention=flex (the GPU default) or sdpa")


# ------------------------------------------------------------------------------------------ data
def _offline() -> str | None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def check_offline_hub_dataset(name: str, subset: Any = None, key: str = "data.name") -> None:
    """With ``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE``) set, a Hub dataset must be in the local cache:
    ``datasets`` resolves it offline (no download, no network), as the trainer will.

    Raises:
        ConfigError: the dataset is not cached (names the variable and the fix).
    """
    variable = _offline()
    if variable is None:
        return
    import datasets

    try:
        datasets.load_dataset_builder(name, subset)
    except (ConnectionError, FileNotFoundError) as exc:
        raise _err(key, name, f"this Hub dataset is not in the local cache, and {variable} is set, so it cannot be "
                   f"downloaded ({type(exc).__name__}: {str(exc)[:160]})",
                   f"set {key} to a local data file or folder, or download it once where the Hub is reachable "
                   f"(the cached copy is then used with {variable}=1)") from None
    except Exception:  # noqa: BLE001 - anything else is the dataset's own problem: the loader reports it
        return


def check_generator_keys(data: Any) -> None:
    """A generator (``data.generator``) makes its own prompts: ``data.name`` and ``data.prompt_column`` are not read.

    Raises:
        ConfigError: ``data.name`` or ``data.prompt_column`` is set with a generator (a recipe's generator would
            otherwise silently win over a dataset named on the command line).
    """
    if data.generator and data.name:
        raise _err("data.name", str(data.name), f"data.generator={data.generator} makes the prompts itself (task "
                   f"{data.get('task')}), so this dataset would be ignored",
                   f"train on the dataset with data.generator=null data.name={data.name} (and its columns: "
                   "data.prompt_column), or remove data.name to keep the generator")
    if data.generator and str(data.prompt_column) != "prompt":
        raise _err("data.prompt_column", str(data.prompt_column), f"data.generator={data.generator} makes the "
                   "prompts itself (its rows have a 'prompt' column), so this key would be ignored",
                   "remove data.prompt_column, or read a dataset with that column: data.generator=null "
                   "data.name=PATH_OR_HUB_ID")


# ------------------------------------------------------------------------------------------ tools, rewards
def check_agent_imports(cfg: Any) -> None:
    """``tools`` and ``environment.factory`` import and have the form the worker needs (SPEC §13), and the
    run has a reward: ``rewards`` is not empty, or the environment scores rollouts itself (``get_reward``).

    Raises:
        ConfigErrors: every problem, each naming ``tools[i]``, ``environment.factory`` or ``rewards``.
    """
    from omegaconf import DictConfig

    from ..rollout.environments import check_environment_factory
    from ..rollout.tools import check_tools
    from .sources import check_import

    errors: list[ConfigError] = []
    for i, path in enumerate(cfg.get("tools") or []):
        try:
            tool = check_import(str(path), f"tools[{i}]")
            check_tools([tool], what=f"tools[{i}]")
        except ConfigError as exc:
            errors.append(exc)
        except (TypeError, ValueError) as exc:
            errors.append(_err(f"tools[{i}]", str(path), str(exc), "name a module-level function with type hints "
                               "and a Google-style docstring (README: Agent training: tools and environments)"))
    factory = (cfg.get("environment") or {}).get("factory")
    env = None
    if factory is not None:
        try:
            if isinstance(factory, DictConfig):
                env = {str(n): check_import(str(p), f"environment.factory.{n}") for n, p in factory.items()}
            else:
                env = check_import(str(factory), "environment.factory")
            check_environment_factory(env)
        except ConfigError as exc:
            errors.append(exc)
            env = None
        except (TypeError, ValueError) as exc:
            errors.append(_err("environment.factory", str(factory), str(exc), "name a class with reset(self, "
                               "**kwargs) (README: Agent training: tools and environments)"))
            env = None
    if not cfg.rewards:
        classes = list(env.values()) if isinstance(env, dict) else [env] if env is not None else []
        unscored = [c.__name__ for c in classes if isinstance(c, type) and not callable(getattr(c, "get_reward", None))]
        if factory is None or unscored:
            why = (f"and the environment {', '.join(unscored)} has no get_reward()" if unscored else
                   "and no environment scores them")
            errors.append(_err("rewards", [], f"no reward function, {why}: no rollout could be scored, so the run "
                               "would never train a step", "rewards=[asyncgrpo_cli.rewards:accuracy_reward] (or your "
                               "own module:function)"))
    if errors:
        raise ConfigErrors(errors)


# ------------------------------------------------------------------------------------------ LoRA
def check_peft_targets(cfg: Any, folder: Path | None) -> None:
    """``peft.target_modules`` names modules the model has (checked on the model's structure, built on the
    meta device: no weight is read), when the model's config is here (a local folder, a cached Hub id, or
    a GGUF file's metadata).

    Raises:
        ConfigError: a name (or pattern) matches no module, with the model's module names and the closest one.
    """
    import re

    pe = cfg.peft
    targets = pe.target_modules
    if not pe.enabled or targets is None or (isinstance(targets, str) and targets == "all-linear"):
        return
    if cfg.model.trust_remote_code:
        return  # building the model would run its own code
    config = _model_config(cfg, folder)
    if config is None:
        return
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build here: the trainer says so
        return
    names = [n for n, _ in model.named_modules() if n]
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if n and isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")})
    if isinstance(targets, str):  # peft: a string is a regular expression matched against whole names
        if not any(re.fullmatch(targets, n) for n in names):
            raise _err("peft.target_modules", targets, f"the pattern matches no module of the model (its linear "
                       f"layers: {', '.join(leaves)})", "peft.target_modules=all-linear, or a list of those names")
        return
    wanted = [str(t) for t in targets]
    for target in wanted:
        if not any(n == target or n.endswith("." + target) for n in names):
            close = difflib.get_close_matches(target, leaves, n=1, cutoff=0.7)
            fixed = [close[0] if t == target else t for t in wanted] if close else None
            fix = (f"peft.target_modules=[{','.join(fixed)}] (the closest name), or peft.target_modules=all-linear"
                   if fixed else "name modules from that list, or peft.target_modules=all-linear")
            raise _err("peft.target_modules", wanted, f"the model has no module named {target!r} (its linear "
                       f"layers: {', '.join(leaves)})", fix)


def _model_config(cfg: Any, folder: Path | None) -> Any:
    """The model's transformers config from ``folder``, else from its GGUF file's metadata; None if neither."""
    from transformers import AutoConfig

    try:
        if folder is not None:
            return AutoConfig.from_pretrained(str(folder))
        from .models import package_dir

        name, gguf = str(cfg.model.name), cfg.model.gguf_file
        base = Path(name).expanduser()
        where = base if base.is_dir() else package_dir(name)
        if gguf and where is not None and (where / gguf).is_file():
            return AutoConfig.from_pretrained(str(where), gguf_file=str(gguf))
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the model check
        return None
    return None
