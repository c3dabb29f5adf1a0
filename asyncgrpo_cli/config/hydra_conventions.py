"""Hydra's command-line conventions for `asyncgrpo` (which composes with Hydra's compose API rather than
``@hydra.main``): ``-m`` sweeps, ``hydra.run.dir`` / ``hydra.sweep.dir``, ``--cfg hydra`` and ``--info``.

- ``hydra.run.dir=DIR`` is ``trainer.output_dir=DIR`` (the run's output folder); ``hydra.sweep.dir=DIR``
  is the parent folder of a ``-m`` sweep's jobs. Every other ``hydra.*`` key is refused with the reason,
  since nothing would read it.
- A sweep (``key=a,b``, ``key=range(1,4)``, ``key=choice(...)``, ``group=a,b``) is expanded by Hydra's
  own `BasicSweeper` into the cartesian product of its values; the jobs run one after another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .rules import ConfigError

OUTPUT_KEY = "trainer.output_dir"
RUN_DIR_KEY = "hydra.run.dir"
SWEEP_DIR_KEY = "hydra.sweep.dir"


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from .compose import _explain_hydra_error

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        text = _explain_hydra_error(exc, overrides)
        if any(text.startswith(f"{o}: ") for o in overrides):  # it names the override at fault itself
            raise ConfigError(text) from exc
        raise ConfigError(f"could not parse the overrides {' '.join(overrides)}: {text}") from exc


def _key(override) -> str:
    return str(override.key_or_group)


@dataclass
class HydraArgs:
    """Overrides with the ``hydra.*`` keys taken out.

    Attributes:
        overrides: what is composed (``hydra.run.dir=X`` became ``trainer.output_dir=X``).
        sweep_dir: ``hydra.sweep.dir`` (parent of a sweep's job folders), or None.
        notes: one line per translated key, for the user.
    """

    overrides: list[str]
    sweep_dir: str | None = None
    notes: list[str] = field(default_factory=list)


def take_hydra_keys(overrides: list[str] | None, *, multirun: bool = False) -> HydraArgs:
    """Translate ``hydra.run.dir`` / ``hydra.sweep.dir`` and refuse the other ``hydra.*`` keys.

    Raises:
        ConfigError: an unused ``hydra.*`` key or group (named, with what to use instead);
            ``hydra.run.dir`` together with ``trainer.output_dir``; ``hydra.sweep.dir`` without ``-m``.
    """
    overrides = list(overrides or [])
    parsed = _parse(overrides)
    kept: list[str] = []
    out = HydraArgs(kept)
    explicit_output = any(_key(o) == OUTPUT_KEY for o in parsed)
    for text, o in zip(overrides, parsed):
        key = _key(o)
        if not (key == "hydra" or key.startswith("hydra.") or key.startswith("hydra/")):
            kept.append(text)
            continue
        if key == RUN_DIR_KEY and not o.is_delete():
            if explicit_output:
                raise ConfigError(f"{text} and {OUTPUT_KEY} are both given: they name the same folder. "
                                  f"Fix: keep only {OUTPUT_KEY}=DIR")
            if o.is_sweep_override():
                raise ConfigError(f"{text}: a sweep of the run folder. Fix: -m gives each job its own folder "
                                  f"under {SWEEP_DIR_KEY}=DIR (or {OUTPUT_KEY}=DIR)")
            raw = text.split("=", 1)[1]
            kept.append(f"{OUTPUT_KEY}={raw}")
            out.notes.append(f"{RUN_DIR_KEY}={raw} is the run's output folder: {OUTPUT_KEY}={raw}")
        elif key == SWEEP_DIR_KEY and not o.is_delete():
            if not multirun:
                raise ConfigError(f"{text}: hydra.sweep.dir is the parent folder of a -m sweep's jobs, and this is "
                                  f"not a sweep. Fix: set {OUTPUT_KEY}=DIR, or add -m with a swept key")
            out.sweep_dir = text.split("=", 1)[1]
        else:
            raise ConfigError(f"{text}: asyncgrpo does not read this Hydra setting (it composes configs with "
                              f"Hydra's compose API and runs its own launcher, so no other hydra.* key has an "
                              f"effect). Fix: drop it; the output folder is {OUTPUT_KEY}=DIR (or {RUN_DIR_KEY}=DIR), "
                              f"a sweep's parent folder {SWEEP_DIR_KEY}=DIR with -m")
    return out


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys (or groups) of ``overrides`` that are sweeps (``a,b``, ``range(...)``, ``choice(...)``)."""
    return [_key(o) for o in _parse(overrides) if o.is_sweep_override()]


def refuse_sweeps(overrides: list[str] | None, command: str) -> None:
    """For a command that makes one thing (one server, one check): a sweep override is refused.

    Raises:
        ConfigError: naming the swept override and the ways to write a list or a string instead.
    """
    overrides = list(overrides or [])
    for text, o in zip(overrides, _parse(overrides)):
        if o.is_sweep_override():
            sweep = (f"to run one job per value, add -m (--multirun): asyncgrpo {command} -m ..."
                     if command in ("train", "config") else
                     f"`asyncgrpo {command}` takes one value (sweeps run with `asyncgrpo train -m`)")
            raise ConfigError(f"{text} is a sweep (several values): {sweep}. For a list write {_key(o)}=[a,b]; for "
                              f"a string with commas quote it: {_key(o)}='a,b'")


@dataclass
class SweepJob:
    """One job of a ``-m`` sweep: its number, the overrides it composes, and its swept values."""

    num: int
    overrides: list[str]
    swept: list[str]


def expand_sweep(overrides: list[str]) -> list[SweepJob]:
    """The jobs of a sweep, in Hydra's `BasicSweeper` order (cartesian product, last key varies fastest).

    Without any swept key there is one job.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = _parse(overrides)
    swept = {_key(o) for o in parsed if o.is_sweep_override()}
    batches = BasicSweeper.split_arguments(parsed, None)
    jobs: list[SweepJob] = []
    for batch in batches:
        for job in batch:
            values = [ov for ov in job if ov.lstrip("+~").split("=", 1)[0] in swept]
            jobs.append(SweepJob(len(jobs), list(job), values))
    return jobs


def job_output_dir(base: str | Path, job: SweepJob) -> Path:
    """The folder of one sweep job: ``<base>/<job number>`` (Hydra's ``hydra.sweep.subdir`` default)."""
    return Path(base) / str(job.num)


def hydra_config_yaml(overrides: list[str], extra_recipe_dirs: list | None = None, *,
                      sweep_dir: str | None = None) -> str:
    """Hydra's own config for these overrides (what ``--cfg hydra`` prints), with a header saying which
    keys asyncgrpo reads; those two show the folders this run uses, not Hydra's unused dated defaults:
    ``hydra.run.dir`` = ``trainer.output_dir``, ``hydra.sweep.dir`` = ``sweep_dir`` (the user's
    ``hydra.sweep.dir``) or else ``trainer.output_dir`` (a sweep's jobs go to ``<dir>/<job number>``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .compose import _register, conf_dir

    _register(extra_recipe_dirs)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="asyncgrpo"):
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(str(exc)) from exc
    header = (f"# Hydra's own config. asyncgrpo reads only {RUN_DIR_KEY} (= {OUTPUT_KEY}) and {SWEEP_DIR_KEY} "
              "(parent of a -m sweep's job folders <dir>/<job number>), shown with the folders this run uses\n")
    hydra = OmegaConf.to_container(cfg.hydra, resolve=False)
    out = str(OmegaConf.select(cfg, OUTPUT_KEY) or "outputs/run")
    hydra["run"]["dir"] = out
    hydra["sweep"]["dir"] = sweep_dir or out
    return header + OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra}))


def search_path() -> list[tuple[str, str]]:
    """(what, folder) of each place configs are read from."""
    from .compose import conf_dir, recipes_dir

    return [("config groups (conf/)", str(conf_dir())), ("recipes (+recipe=NAME)", str(recipes_dir()))]


def config_groups() -> dict[str, list[str]]:
    """Group name -> its option names (``conf/<group>/<option>.yaml``), plus ``recipe``."""
    from .compose import conf_dir, list_recipes

    root = conf_dir()
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(root.iterdir()) if d.is_dir()}
    try:
        groups["recipe"] = [r.name for r in list_recipes()]
    except ConfigError:
        groups["recipe"] = []
    return groups
