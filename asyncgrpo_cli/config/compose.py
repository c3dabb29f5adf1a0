"""Compose `conf/` + a recipe + overrides into a validated config, and convert it for the trainer.

Where things are found: `conf/` and `recipes/` next to the package in a checkout, else the copies
packaged inside the wheel (`asyncgrpo_cli/_data/`). Recipes are registered as the Hydra group
``recipe`` (selected with ``+recipe=NAME``); ``extra_recipe_dirs`` adds a user's own folders.
"""

from __future__ import annotations

import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigErrors
from .override_checks import (MAX_OVERRIDE_ERRORS, _UNKNOWN_KEY, _loose_bools, _override_at_fault,
                              refuse_repeated_keys)
from .rules import ConfigError, check_fields, check_lora_rank

DEFAULT_OUTPUT_DIR = "outputs/run"
"""``trainer.output_dir`` when it is not set."""

_PKG_DIR = Path(__file__).resolve().parent.parent
_CHECKOUT_DIR = _PKG_DIR.parent

# AsyncGRPOConfig field -> Hydra path, for the fields that do not live under `trainer.` (CONFIG.md).
FIELD_PATHS: dict[str, str] = {
    "dtype": "model.dtype",
    "model_init_kwargs": "model.model_init_kwargs",
    "trust_remote_code": "model.trust_remote_code",
    "router_aux_loss_coef": "model.router_aux_loss_coef",
    **{n: f"rollout.{n}" for n in (
        "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
        "repetition_penalty", "num_sampler_logprobs", "chat_template_kwargs", "max_tool_calling_iterations",
        "tool_call_timeout", "sampling_mask_fallback", "max_groups_without_signal", "reward_weights",
        "scale_rewards", "multi_objective_aggregation", "group_requests", "request_seeds")},
    **{n: f"loss.{n}" for n in (
        "score_centering", "epsilon", "epsilon_high", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max", "loss_type", "importance_sampling_level",
        "vllm_importance_sampling_mode", "mask_truncated_completions", "beta")},
    **{n: f"staleness.{n}" for n in (
        "max_staleness", "weight_sync_steps", "max_concurrent_rollouts", "rollout_worker_timeout",
        "in_flight_estimate", "deadline_release_versions", "deadline_order")},
    "token_budget": "packing.token_budget",
    "max_groups_per_step": "packing.max_groups_per_step",
    "tree_attention": "packing.attention",
    "vllm_server_base_url": "sampler.url",
    "vllm_server_timeout": "sampler.timeout",
    "vllm_server_hang_timeout": "sampler.hang_timeout",
    "weight_transfer_address": "sampler.weight_transfer_address",
    "weight_transfer_port": "sampler.weight_transfer_port",
    "check_weight_sync": "sampler.check_weight_sync",
    "weight_sync_packed": "sampler.weight_sync_packed",
    "weight_sync_overlap": "sampler.weight_sync_overlap",
    "log_completions": "logging.log_completions",
    "num_completions_to_print": "logging.num_completions_to_print",
}


def hydra_path(field_name: str) -> str:
    """The Hydra path a user types for an `AsyncGRPOConfig` field (``top_p`` → ``rollout.top_p``)."""
    return FIELD_PATHS.get(field_name, f"trainer.{field_name}")


def _data_dir(name: str) -> Path:
    checkout = _CHECKOUT_DIR / name
    if checkout.is_dir() and (_CHECKOUT_DIR / "pyproject.toml").is_file():
        return checkout
    packaged = _PKG_DIR / "_data" / name
    if packaged.is_dir():
        return packaged
    raise FileNotFoundError(f"asyncgrpo: cannot find its {name}/ folder (looked in {checkout} and {packaged}); "
                            "reinstall the package: pip install --force-reinstall asyncgrpo")


def conf_dir() -> Path:
    """The folder holding the Hydra groups (checkout `conf/` or the packaged copy)."""
    return _data_dir("conf")


def recipes_dir() -> Path:
    """The folder of the built-in recipes (checkout `recipes/` or the packaged copy)."""
    return _data_dir("recipes")


@dataclass
class RecipeInfo:
    """One recipe file: its name (for ``+recipe=NAME``), path and one-line description."""

    name: str
    path: Path
    description: str


_DESCRIPTION = re.compile(r"^#\s*description:\s*(.*)$")


def list_recipes(extra_dirs: list[str | Path] | None = None) -> list[RecipeInfo]:
    """Recipes of the built-in folder then of ``extra_dirs`` (a later folder's recipe wins on a name clash).

    Raises:
        ConfigError: when an extra folder does not exist.
    """
    found: dict[str, RecipeInfo] = {}
    dirs = [recipes_dir(), *[Path(d) for d in extra_dirs or []]]
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"--recipes-dir={str(d)!r}: no such folder. Fix: pass a folder holding NAME.yaml recipes")
        for path in sorted(d.glob("*.yaml")):
            description = ""
            for line in path.read_text().splitlines()[:5]:
                m = _DESCRIPTION.match(line.strip())
                if m:
                    description = m.group(1).strip()
                    break
            found[path.stem] = RecipeInfo(path.stem, path, description)
    return list(found.values())


def _register(extra_recipe_dirs: list[str | Path] | None) -> dict[str, ConfigError]:
    """Store the schema and every readable recipe; returns the recipes that could not be read, by name
    (their error is raised only when one of them is selected)."""
    from hydra.core.config_store import ConfigStore

    from .schema import AppConfig

    cs = ConfigStore.instance()
    cs.store(name="asyncgrpo_schema", node=AppConfig)
    broken: dict[str, ConfigError] = {}
    for recipe in list_recipes(extra_recipe_dirs):
        try:
            cs.store(group="recipe", name=recipe.name, node=load_recipe(recipe.path), package="_global_")
        except ConfigError as exc:
            broken[recipe.name] = exc
    return broken


_RECIPE_OVERRIDE = re.compile(r"^\+{0,2}recipe=(.+)$")


def _selected_recipes(overrides: list[str]) -> list[str]:
    names = []
    for o in overrides:
        m = _RECIPE_OVERRIDE.match(o.strip())
        if m:
            names.extend(n.strip() for n in m.group(1).strip("[]").split(","))
    return names


def load_recipe(path: Path) -> DictConfig:
    """One recipe file as a config.

    Raises:
        ConfigError: a YAML syntax error (names the file, the line and column, and the parser's message),
            or a file whose top level is not a mapping.
    """
    import yaml

    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x) \
            or str(exc).splitlines()[0]
        line = ""
        if mark is not None:
            lines = path.read_text().splitlines()
            if 0 <= mark.line < len(lines):
                line = f" (the line reads: {lines[mark.line].strip()!r})"
        raise ConfigError(f"recipe {where}: YAML syntax error: {problem}{line}. Fix: correct that line (indent "
                          "with spaces, put a space after each ':', quote values holding ':' or '#')",
                          key=f"recipe:{path.stem}") from None
    except OSError as exc:
        raise ConfigError(f"recipe {path}: cannot be read ({exc}). Fix: check the file", key=f"recipe:{path.stem}") \
            from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"recipe {path}: its top level is a list, not a mapping of groups. Fix: write it as "
                          "'model:', 'data:', ... keys", key=f"recipe:{path.stem}")
    return node


def compose(overrides: list[str] | None = None, extra_recipe_dirs: list[str | Path] | None = None,
            validate: bool = True) -> DictConfig:
    """Compose the config: `conf/config.yaml` + ``overrides`` (e.g. ``["+recipe=smoke", "rollout.top_k=8"]``).

    Returns:
        A structured `DictConfig` of `AppConfig` (types checked, unknown keys refused).

    Raises:
        ConfigError: on an unknown key, a wrong type, a missing recipe, or a value that breaks a rule;
            the message names the key, the value and the fix.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    loose = _loose_bools(list(overrides or []))
    if loose:  # named with the rest's problems: compose what remains for them
        errors = [err for _, err in loose]
        try:
            compose([o for i, o in enumerate(overrides or []) if i not in dict(loose)], extra_recipe_dirs, validate)
        except ConfigError as exc:
            errors += exc.errors if isinstance(exc, ConfigErrors) else [exc]
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    overrides, lists = _list_overrides(list(overrides or []))
    overrides, maps = _map_overrides(overrides)
    broken = _register(extra_recipe_dirs)
    for name in _selected_recipes(overrides):
        if name in broken:
            raise broken[name]
    try:
        cfg = _hydra_compose(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _every_override_error(exc, overrides, extra_recipe_dirs) from exc
    except (TypeError, ValueError, KeyError) as exc:  # Hydra fails this way on some malformed group overrides
        raise ConfigError(f"the overrides {' '.join(overrides)} could not be composed ({type(exc).__name__}: {exc}). "
                          "Fix: a group (model, data, rewards, rollout, ...) is selected with group=option; to set "
                          "a list such as the reward functions, put it in a recipe (+recipe=NAME, --recipes-dir DIR)"
                          ) from exc
    if lists:
        _set_lists(cfg, lists)
    if maps:
        _set_maps(cfg, maps)
    if validate:
        try:
            validate_config(cfg)
        except ConfigError as exc:
            raise with_values_without(exc, overrides, extra_recipe_dirs) from None
    return cfg


def _hydra_compose(overrides: list[str]) -> DictConfig:
    """Hydra's compose of `conf/config.yaml` with ``overrides`` (its own exceptions pass through)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="asyncgrpo"):
        return hydra_compose(config_name="config", overrides=overrides)


def _every_override_error(first: Exception, overrides: list[str],
                          recipe_dirs: list[str | Path] | None) -> ConfigError:
    """Hydra stops at the first unknown key or wrong type; a command line with three typos would take three tries.
    So: explain ``first``, drop the override it names, compose again, and so on until the rest composes or an
    error names no override of the command line (a recipe's own key, a malformed group). Returns one
    `ConfigError`, or a `ConfigErrors` naming each override at fault, in command-line order."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    found: list[tuple[int, ConfigError]] = []
    remaining = list(enumerate(overrides))
    exc: Exception = first
    while True:
        rest = [o for _, o in remaining]
        at = _override_at_fault(exc, rest)
        key = rest[at].split("=", 1)[0].lstrip("+~") if at is not None else None
        found.append((remaining[at][0] if at is not None else len(overrides),
                      ConfigError(_explain_hydra_error(exc, rest, recipe_dirs), key=key)))
        if at is None or len(found) >= MAX_OVERRIDE_ERRORS:
            break
        del remaining[at]
        try:
            _hydra_compose([o for _, o in remaining])
            break
        except (HydraException, OmegaConfBaseException) as again:
            exc = again
        except Exception:  # noqa: BLE001 - the rest fails otherwise: the problems found so far are the answer
            break
    errors = [e for _, e in sorted(found, key=lambda pair: pair[0])]
    return errors[0] if len(errors) == 1 else ConfigErrors(errors)


def with_values_without(exc: ConfigError, overrides: list[str],
                         recipe_dirs: list[str | Path] | None) -> ConfigError:
    """``exc`` with, for each of its problems whose key an override set, that key's value without the override
    (the recipe's) as a fix beside the rule's when that names another value: a rule's fix is a generic default
    (``trainer.learning_rate=1e-6``), which would silently change a recipe's own value (3e-5). A number's comes first
    (``Fix: trainer.learning_rate=3e-05 (its value without this override), or set ...``: a trial took the generic
    one); any other value's second, after the rule's (for a misspelt name the closest accepted one)."""
    from .override_errors import _MISSING

    parts = list(exc.errors) if isinstance(exc, ConfigErrors) else [exc]
    changed = []
    for err in parts:
        value = _value_without(err.key, overrides, recipe_dirs) if err.key else _MISSING
        if value is _MISSING or value is None or isinstance(value, (DictConfig, ListConfig)):
            changed.append(err)
            continue
        shown = str(value).lower() if isinstance(value, bool) else value
        text = str(err)
        if "Fix:" in text and f"{err.key}={shown}" not in text:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                text = text.replace("Fix: ", f"Fix: {err.key}={shown} (its value without this override), or ", 1)
            else:
                text += f"; or {err.key}={shown}, its value without this override"
        changed.append(ConfigError(text, key=err.key))
    if all(a is b for a, b in zip(parts, changed)):
        return exc
    return ConfigErrors(changed) if isinstance(exc, ConfigErrors) else changed[0]


LIST_GROUPS = ("rewards", "tools")
"""Groups whose config is a list: ``rewards=[...]`` / ``tools=[...]`` on the command line set the list itself."""


def _list_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``(the overrides for Hydra, the list overrides of `LIST_GROUPS`)``. Hydra reads ``tools=X`` as the option
    X of the group, so ``tools=[pkg.mod:fn]`` would look for a file ``conf/tools/[pkg.mod:fn].yaml``."""
    rest, lists, listed = [], [], []
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and any(key.lstrip("+~").startswith(g + ".") for g in listed):
            lists.append(o)  # an entry set after the whole list (rewards.0.probe=false): applied after it, in order
        elif sep and key in LIST_GROUPS and value.lstrip().startswith("["):
            lists.append(o)
            listed.append(key)
        else:
            rest.append(o)
    return rest, lists


def _set_lists(cfg: DictConfig, lists: list[str]) -> None:
    """Set each list override (Hydra's own override grammar parses the value); a reward given as a plain
    ``module:function`` string becomes ``{func: ...}``.

    Raises:
        ConfigError: the value does not parse, or has the wrong form (naming the key and how to write it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    example = {"rewards": "'rewards=[asyncgrpo_cli.rewards:accuracy_reward,{func:my_pkg.mod:fn,kwargs:{scale:0.5}}]'",
               "tools": "'tools=[my_pkg.tools:add,my_pkg.tools:multiply]'"}
    from omegaconf.errors import ValidationError

    from .override_errors import describe_type
    from .schema import RewardFuncConfig

    parser = OverridesParser.create()
    for override in lists:
        key = override.partition("=")[0]
        if key.lstrip("+~") not in LIST_GROUPS:  # one entry after the whole list: rewards.0.probe=false
            _set_list_entry(cfg, override, parser)
            continue
        try:
            value = parser.parse_override(override).value()
            if key == "rewards":
                items = []
                hints = typing.get_type_hints(RewardFuncConfig)
                for i, v in enumerate(value):
                    for name, given in (v.items() if isinstance(v, dict) else ()):
                        if hints.get(name) is bool and not isinstance(given, bool):  # OmegaConf reads 2, on as true
                            raise ConfigError(f"rewards[{i}].{name}: {given!r} is not true or false. Fix: write "
                                              f"{name}: true or {name}: false", key=f"rewards.{i}.{name}")
                    try:
                        items.append(OmegaConf.merge(OmegaConf.structured(RewardFuncConfig),
                                                     {"func": v} if isinstance(v, str) else v))
                    except ValidationError as exc:  # one field of one entry has the wrong type
                        name = str(getattr(exc, "key", "") or "")
                        tp = typing.get_type_hints(RewardFuncConfig).get(name)
                        if tp is None:
                            raise
                        raise ConfigError(f"rewards[{i}].{name}: {getattr(exc, 'value', '?')!r} is not "
                                          f"{describe_type(tp)}. Fix: write {name}: true or {name}: false"
                                          if tp is bool else
                                          f"rewards[{i}].{name}: {getattr(exc, 'value', '?')!r} is not "
                                          f"{describe_type(tp)}. Fix: give {name} {describe_type(tp)} in the list",
                                          key=f"rewards.{i}.{name}") from None
                value = items
            cfg[key] = value
        except ConfigError:
            raise
        except (HydraException, OmegaConfBaseException, TypeError, ValueError) as exc:
            raise ConfigError(f"{override}: not a list of the form {key} takes ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}). Fix: quote the whole override for the shell, "
                              f"e.g. {example[key]}", key=key) from None


def _set_list_entry(cfg: DictConfig, override: str, parser) -> None:
    """Apply one ``rewards.N.field=value`` (or ``tools.N=...``) given after the whole list was set.

    Raises:
        ConfigError: no such entry, or a value the field does not take (naming the key and the fix).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    key = override.partition("=")[0].lstrip("+~")
    group, _, rest = key.partition(".")
    index = rest.partition(".")[0]
    if not index.isdigit() or int(index) >= len(cfg[group]):
        raise ConfigError(f"{override}: {group} has {len(cfg[group])} entries (0-based) after {group}=[...]. Fix: "
                          f"name an entry from 0 to {len(cfg[group]) - 1}, or set it inside the list", key=key)
    try:
        OmegaConf.update(cfg, key, parser.parse_override(override).value(), merge=False)
    except (HydraException, OmegaConfBaseException, TypeError, ValueError) as exc:
        raise ConfigError(f"{override}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}. Fix: give {key} a "
                          f"value of its type (`asyncgrpo config --doc {group}` describes it)", key=key) from None


def _map_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``(the overrides for Hydra, the mapping overrides)``: ``key={...}`` for a free-form mapping field
    (``sampler.env``, ``data.task_kwargs``, ``rewards.0.kwargs``, ...). Hydra merges such a value into the node,
    and the composed config's struct mode refuses each new key ("unknown key 'sampler.env.MY_VAR'"); the value
    replaces the mapping instead (`_set_maps`), as ``+sampler.env.MY_VAR=1`` adds one entry."""
    import typing

    from .override_errors import _unwrap, field_at

    rest, maps, mapped = [], [], []
    for o in overrides:
        key, sep, value = o.partition("=")
        if any(key.lstrip("+~").startswith(m + ".") for m in mapped):
            maps.append(o)  # an entry set after the whole mapping: applied after it, in order
            continue
        found = field_at(key) if sep and value.lstrip().startswith("{") and key[:1] not in "+~" else None
        if found is not None and typing.get_origin(_unwrap(found[0])[0]) is dict:
            maps.append(o)
            mapped.append(key)
        else:
            rest.append(o)
    return rest, maps


def _set_maps(cfg: DictConfig, maps: list[str]) -> None:
    """Set each mapping override (parsed by Hydra's override grammar), replacing the mapping.

    Raises:
        ConfigError: the value does not parse or does not fit the field (naming the key and how to write it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from .override_errors import field_at

    parser = OverridesParser.create()
    for override in maps:
        key = override.partition("=")[0].lstrip("+~")
        try:
            parsed = parser.parse_override(override)
            if parsed.is_delete():  # ~sampler.env.NAME after the mapping was set
                parent, _, name = key.rpartition(".")
                with open_dict(cfg):
                    OmegaConf.select(cfg, parent).pop(name, None)
                continue
            value = parsed.value()
            if field_at(key) is not None and not isinstance(value, dict):  # the mapping itself, not an entry
                raise ValueError(f"{value!r} is not a mapping")
            with open_dict(cfg):
                OmegaConf.update(cfg, key, value, merge=False)
        except (HydraException, OmegaConfBaseException, TypeError, ValueError) as exc:
            raise ConfigError(f"{key}={{...}}: not a mapping {key} takes ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}). Fix: quote the whole override for the shell, e.g. "
                              f"'{key}={{NAME: value}}', or set one entry with +{key}.NAME=value", key=key) from None


def _value_without(key: str, overrides: list[str], recipe_dirs: list[str | Path] | None) -> Any:
    """``key``'s value in the config composed without the overrides that set it (e.g. the recipe's value);
    `override_errors._MISSING` when that cannot be composed either or does not hold the key."""
    from .override_errors import _MISSING

    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    if len(rest) == len(overrides):
        return _MISSING
    try:
        return OmegaConf.select(compose(rest, recipe_dirs, validate=False), key, default=_MISSING)
    except ConfigError:
        return _MISSING


def _explain_hydra_error(exc: Exception, overrides: list[str],
                         recipe_dirs: list[str | Path] | None = None) -> str:
    msg = str(exc).strip()
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg = f"{msg}\n{str(cause).strip()}"
    missing = re.search(r"Could not find '(?:recipe/)?([^']+)'", msg)
    if "recipe" in msg and missing:  # Hydra's own text adds its search path, which says nothing to the user
        import difflib

        known = sorted({r.name for r in list_recipes(recipe_dirs)})
        name = missing.group(1)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean +recipe={close[0]}? Or use" if close else "use"
        return (f"+recipe={name}: there is no such recipe. Fix: {hint} one of the recipes ({', '.join(known)}), "
                f"or add your folder with --recipes-dir DIR")
    option = re.search(r"Could not (?:find|load) '([a-z_]+)/([^']+)'", msg)
    if option and option.group(1) != "recipe":  # one line with the known options, not Hydra's search path
        import difflib

        group, name = option.groups()
        known = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        close = difflib.get_close_matches(name, known, n=1)
        pick = f"{group}={close[0] if close else known[0]}" if known else f"{group}=..."
        return (f"{group}={name}: the {group} group has no option {name!r} (its options: {', '.join(known) or 'none'})"
                f". Fix: {pick}, or set one key with {group}.KEY=VALUE (`asyncgrpo config` lists the keys)")
    if "Key" in msg and "not in" in msg:
        from .override_errors import unknown_key_message

        key = getattr(cause, "full_key", None) or (_UNKNOWN_KEY.search(msg) or [None, ""])[1]
        given = re.search(r"Could not (?:override|append to) '([^']+)'", msg)  # the key as the user wrote it
        user_key = given.group(1) if given and given.group(1).startswith(str(key)) else str(key)
        value = next((o.split("=", 1)[1] for o in overrides or () if o.lstrip("+~").split("=", 1)[0] == user_key
                      and "=" in o), None)
        return unknown_key_message(user_key, value) if user_key else _unknown_key_message(msg)
    if any(t in msg for t in ("could not be converted to", "is not a valid", "Cannot convert", "Invalid value",
                              "is not Optional")):  # the last: key=null for a key that takes a value
        from .override_errors import type_error_message

        key = getattr(cause, "full_key", None) or (_UNKNOWN_KEY.search(msg) or [None, None])[1]
        listed = re.sub(r"\[\d+\]$", "", str(key)) if key else None  # an item's list: its value without the override
        text = type_error_message(str(key), getattr(cause, "value", None),
                                  _value_without(listed, overrides, recipe_dirs)) if key else None
        if text:
            return text
    if "could not be converted to" in msg:
        key = _UNKNOWN_KEY.search(msg)
        kind = re.search(r"could not be converted to (\w+)", msg)
        return (f"{msg}\nFix: set {key.group(1) if key else 'the key'} to "
                f"{'an' if kind and kind.group(1)[0] in 'AEIOU' else 'a'} {kind.group(1).lower() if kind else 'value of its type'}"
                " (`asyncgrpo config` shows every key with its current value)")
    unclosed = _unclosed_override(overrides) if ("no viable alternative" in msg or "LexerNoViableAlt" in msg
                                                 or "token recognition error" in msg or "mismatched input" in msg
                                                 or "extraneous input" in msg) else None
    if unclosed:
        return unclosed
    if "LexerNoViableAltException" in msg or "token recognition error" in msg or "mismatched input" in msg:
        return (f"{msg}\nFix: quote a value holding spaces or special characters, e.g. "
                "'model.name=\"my model\"' (see https://hydra.cc/docs/advanced/override_grammar/basic)")
    if "Invalid value" in msg and "expected one of" in msg:
        key = _UNKNOWN_KEY.search(msg)
        return f"{msg}\nFix: set {key.group(1) if key else 'the key'} to one of the values listed above"
    if "Could not override" in msg or "Could not append" in msg:
        return f"{msg}\nFix: an existing key is changed with key=value; a new group option is added with +group=option"
    return f"{msg}\n(overrides: {' '.join(overrides) or 'none'})"


_CLOSERS = {"[": "]", "{": "}", "(": ")"}


def _unclosed_override(overrides: list[str]) -> str | None:
    """The message for the first override Hydra cannot parse because a bracket or a quote is left open
    (``rollout.reward_weights=[1.0``), with the override closed as the fix; None when that is not the cause."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
            continue
        except Exception:  # noqa: BLE001 - Hydra's grammar errors are of several types
            pass
        key, _, value = override.partition("=")
        open_, quote = [], None
        for ch in value:
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch in _CLOSERS:
                open_.append(_CLOSERS[ch])
            elif open_ and ch == open_[-1]:
                open_.pop()
        if not open_ and quote is None:
            return None
        what = f"a {quote} quote" if quote else {"]": "a list [", "}": "a mapping {", ")": "a ("}[open_[-1]]
        closed = f"{key}={value}{quote or ''}{''.join(reversed(open_))}"
        return (f"{override}: {what} is not closed, so the override cannot be read. Fix: close it, "
                f"{shlex.quote(closed)} (quoted whole, so the shell passes the brackets and quotes on)")
    return None


def _unknown_key_message(msg: str) -> str:
    """An unknown key: name it and suggest the closest valid keys of its group (difflib)."""
    import dataclasses
    import difflib

    from .schema import AppConfig

    match = _UNKNOWN_KEY.search(msg)
    full_key = match.group(1) if match else ""
    group, _, key = full_key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(AppConfig)}
    if group and not key:
        close = difflib.get_close_matches(group, list(fields), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"the groups are {', '.join(fields)}"
        return f"unknown group {group!r}. Fix: {hint}"
    if group in fields and key:
        node = fields[group].default_factory()
        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        close = difflib.get_close_matches(key.split(".")[0], names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(f'{group}.{c}' for c in close)}?" if close else \
            f"`asyncgrpo config` lists every key of the {group} group"
        return f"unknown key {full_key!r}: the {group} group has no such field. Fix: {hint}"
    return f"{msg}\nFix: check the spelling against `asyncgrpo config` (every key is listed there)"


def _flat_fields(cfg: DictConfig) -> dict[str, Any]:
    """AsyncGRPOConfig field name -> value, read from the composed config."""
    out: dict[str, Any] = {}
    for name, path in FIELD_PATHS.items():
        group, key = path.split(".")
        if name == "vllm_server_base_url":  # checked as typed; one built from sampler.host/port is not a user's
            out[name] = str(cfg.sampler.url) if cfg.sampler.url else None
            continue
        value = cfg[group][key]
        out[name] = value.value if hasattr(value, "value") and not isinstance(value, (int, float)) else value
    for key, value in cfg.trainer.items():
        out[key] = value
    return out


PUBLIC_HOST_RISK = ("the server's dev routes (/update_weights, /pause, LoRA loading) take no API key, so anyone "
                    "who can reach the port can pause the server and replace its weights")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def public_host_warning(cfg: DictConfig) -> str | None:
    """The warning to print when a started server listens beyond loopback (``sampler.allow_public=true``)."""
    if cfg.sampler.backend.value == "external" or is_loopback(str(cfg.sampler.host)):
        return None
    return (f"warning: sampler.host={cfg.sampler.host} (sampler.allow_public=true): {PUBLIC_HOST_RISK}. Keep the "
            "port firewalled")


def server_url(cfg: DictConfig) -> str:
    """Base URL of the sampler: ``sampler.url`` when set, else the address of the server the CLI starts."""
    return sampler_url(cfg.sampler)


def sampler_url(sampler: Any) -> str:
    """`server_url` from the ``sampler`` group alone (`SamplerConfig`: ``url``, ``host``, ``port``)."""
    if sampler.url:
        return str(sampler.url).rstrip("/")
    host = str(sampler.host)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:  # an IPv6 address goes in brackets (http://[::1]:8000)
        host = f"[{host}]"
    return f"http://{host}:{sampler.port}"


def validate_config(cfg: DictConfig) -> None:
    """Check the composed config across groups (SPEC §2, §7, §9, §8.4; CONFIG.md).

    Raises:
        ConfigError: naming the Hydra path, the value and the fix.
        ConfigErrors: several independent problems, each so (all of them, so that one try names every one).
    """
    from .errors import Collector
    from .loss_rules import check_reward_weights_count
    from .override_errors import added_unknown_keys, unknown_key_message
    from .secrets import check_no_secrets
    from .start_checks import check_generator_keys
    from .validate import check_groups

    for key in added_unknown_keys(cfg):  # `+group.key=V` adds a key nothing reads: refuse it like a typo
        value = OmegaConf.select(cfg, key, default=None)
        shown = str(value) if isinstance(value, (str, int, float, bool)) else None
        raise ConfigError(unknown_key_message(key, shown).replace("Fix:", "Nothing reads it. Fix:", 1), key=key)
    check_no_secrets(cfg)  # before anything could print or save them
    found = Collector()  # independent rules: every problem is named at once
    found.run(check_fields, _flat_fields(cfg), hydra_path)
    found.run(check_reward_weights_count, cfg.rollout.reward_weights, len(cfg.rewards), "rollout.reward_weights",
              "rewards")
    found.run(check_groups, cfg)
    found.run(check_generator_keys, cfg.data)
    found.run(_cross_group_rules, cfg)
    found.raise_if_any()


def _cross_group_rules(cfg: DictConfig) -> None:
    """`validate_config`'s rules across groups (LoRA, the sampler's limits and seeds, GPUs).

    Raises:
        ConfigError: the first rule broken, naming the keys, the values and the fix.
    """
    if cfg.peft.enabled:
        check_lora_rank(cfg.peft.r, "peft.r")
        tm = cfg.peft.target_modules
        names = [tm] if isinstance(tm, str) else list(tm or [])
        if "lm_head" in names:
            raise ConfigError("peft.target_modules includes 'lm_head': adapters on lm_head are not supported (README: Supported setups). "
                              "Fix: drop lm_head, e.g. peft.target_modules=all-linear")
    if cfg.sampler.max_model_len is not None and cfg.sampler.max_model_len < 1:
        raise ConfigError(f"sampler.max_model_len={cfg.sampler.max_model_len}: must be >= 1 token. "
                          "Fix: set it to the longest prompt + rollout.max_completion_length")
    if cfg.sampler.api_server_count < 1:
        raise ConfigError(f"sampler.api_server_count={cfg.sampler.api_server_count}: must be >= 1. "
                          "Fix: set sampler.api_server_count=8")
    if cfg.sampler.max_logprobs is not None and cfg.sampler.max_logprobs != -1 \
            and cfg.sampler.max_logprobs < cfg.rollout.num_sampler_logprobs:
        raise ConfigError(f"sampler.max_logprobs={cfg.sampler.max_logprobs}: below rollout.num_sampler_logprobs="
                          f"{cfg.rollout.num_sampler_logprobs}, the server would refuse every request. Fix: set "
                          f"sampler.max_logprobs={cfg.rollout.num_sampler_logprobs} (or leave it null)")
    if cfg.sampler.engines < 1:
        raise ConfigError(f"sampler.engines={cfg.sampler.engines}: must be >= 1 server. Fix: set sampler.engines=1")
    if cfg.sampler.engines > 1 and cfg.peft.enabled:
        raise ConfigError(f"sampler.engines={cfg.sampler.engines} with peft.enabled=true: LoRA adapter sync to several "
                          "servers is not supported. Fix: sampler.engines=1")
    if cfg.sampler.engines > 1 and cfg.sampler.data_parallel_size > 1:
        raise ConfigError(f"sampler.engines={cfg.sampler.engines} with sampler.data_parallel_size="
                          f"{cfg.sampler.data_parallel_size}: choose one. Fix: sampler.engines=1, or "
                          "sampler.data_parallel_size=1")
    if not cfg.rollout.request_seeds and cfg.sampler.engines > 1:
        raise ConfigError(f"rollout.request_seeds=false with sampler.engines={cfg.sampler.engines}: the servers would "
                          "draw their seeds from the same --seed and could decode identical text for the same prompt "
                          "(README: Requests to the sampler). Fix: rollout.request_seeds=true (the default)")
    if not cfg.rollout.request_seeds and cfg.sampler.data_parallel_size > 1:
        raise ConfigError(f"rollout.request_seeds=false with sampler.data_parallel_size={cfg.sampler.data_parallel_size}: "
                          "the engines would draw their seeds from the same --seed and could decode identical text "
                          "for the same prompt (README: Requests to the sampler). Fix: rollout.request_seeds=true "
                          "(the default)")
    if not is_loopback(str(cfg.sampler.host)) and not cfg.sampler.allow_public:
        raise ConfigError(f"sampler.host={cfg.sampler.host} is not a loopback address: {PUBLIC_HOST_RISK}. Fix: keep "
                          "sampler.host=127.0.0.1 (reach it through an SSH tunnel), or set sampler.allow_public=true "
                          "on a trusted network")
    from .server_flags import check_extra_args

    check_extra_args(list(cfg.sampler.extra_args), host=str(cfg.sampler.host), public_risk=PUBLIC_HOST_RISK,
                     is_loopback=is_loopback)
    if cfg.sampler.backend.value == "external" and not cfg.sampler.url:
        raise ConfigError("sampler.backend=external needs sampler.url. Fix: add sampler.url=http://HOST:PORT")
    server, trainer = cfg.launch.server_gpus, cfg.launch.trainer_gpus
    if server is not None and trainer is not None and cfg.sampler.backend.value == "vllm" \
            and not cfg.launch.get("colocate"):
        both = sorted(set(server) & set(trainer))
        if both:
            raise ConfigError(
                f"launch.server_gpus={list(server)} and launch.trainer_gpus={list(trainer)} share GPU(s) {both}: "
                "vLLM and the trainer must use different GPUs for NCCL weight transfer (README: GPUs, weight sync and LoRA). "
                "Fix: launch.colocate=true to share one GPU (CUDA-IPC weight sync), or separate GPUs, e.g. "
                f"launch.server_gpus=[{server[0]}] launch.trainer_gpus="
                f"[{','.join(str(g) for g in trainer if g not in set(server)) or server[0] + 1}]")
    for key in ("server_gpus", "trainer_gpus"):
        gpus = cfg.launch[key]
        if gpus is not None and (len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus)):
            raise ConfigError(f"launch.{key}={list(gpus)}: GPU indices must be distinct and >= 0. "
                              f"Fix: e.g. launch.{key}=[0]")


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain Python containers (enums as their string values)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def to_yaml(cfg: DictConfig) -> str:
    """The composed config as YAML (what ``asyncgrpo config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_plain(cfg)))


def training_args_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Keyword arguments of `AsyncGRPOConfig` from the composed config (enums as strings)."""
    plain = to_plain(cfg)
    kwargs = dict(plain["trainer"])
    for name, path in FIELD_PATHS.items():
        group, key = path.split(".")
        kwargs[name] = plain[group][key]
    kwargs["vllm_server_base_url"] = server_url(cfg)
    if kwargs.get("output_dir") is None:
        kwargs["output_dir"] = DEFAULT_OUTPUT_DIR
    return kwargs


def to_training_args(cfg: DictConfig, *, open_no_device: bool = False):
    """Build the `AsyncGRPOConfig` (a `transformers.TrainingArguments`) of a composed config.

    ``open_no_device``: for the checks of a process that does not train (the supervisor, ``serve``, ``doctor``):
    on a CUDA machine the arguments are built with ``use_cpu=True``, because ``TrainingArguments`` otherwise sets
    up its device (``torch.cuda.set_device``) and checks bf16 on it, which opens a CUDA context: the supervisor
    then held 518 MiB of the GPU it shares with vLLM and the trainer for the whole run (seventeenth session). Only
    the GPU's own bf16 support goes unchecked; the trainer's build checks it."""
    from .grpo_config import AsyncGRPOConfig

    kwargs = training_args_kwargs(cfg)
    if open_no_device and not kwargs.get("use_cpu"):
        import torch

        if torch.cuda.is_available():  # a device count, no context
            kwargs["use_cpu"] = True
    return AsyncGRPOConfig(**kwargs)
