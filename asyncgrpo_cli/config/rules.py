"""Value rules shared by `AsyncGRPOConfig` (Python API) and the composed Hydra config (CLI).

Each rule reads fields by their `AsyncGRPOConfig` name and reports them through ``path_of`` so the
same check says ``top_p`` to a Python user and ``rollout.top_p`` to a CLI user.
"""

from __future__ import annotations

import re

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .citations import cite_shipped
from .errors import ConfigError, ConfigErrors, ConfigTypeError, shown_value  # noqa: F401  (the errors' home; re-exported)

#: ``staleness.in_flight_estimate``'s values (`rollout.allowance.IN_FLIGHT_ESTIMATES`; config imports no rollout code).
IN_FLIGHT_ESTIMATES = ("mean", "kept")

#: ``staleness.deadline_order``'s values (`rollout.stale_schedule.DEADLINE_ORDERS`; config imports no rollout code).
DEADLINE_ORDERS = ("pessimistic", "observed")

# SPEC §9: the ranks vLLM accepts for --max-lora-rank.
ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def config_error(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    """A `ConfigError` ``KEY=VALUE: problem. Fix: fix`` (long string values shortened)."""
    shown = value
    if isinstance(shown, str) and len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"{key}={shown_value(key, shown)}: {problem}. Fix: {fix}", key=key)


def _one_of(g: Callable[..., Any], fail: Callable[..., None], p: Callable[[str], str], name: str,
            meanings: dict[str, str]) -> None:
    """Fail ``name`` unless its value (the first word of ``meanings`` by default) is one of ``meanings``' words: the
    problem says what each means, the fix names each (README: Staleness and concurrency)."""
    words = list(meanings)
    value = g(name, words[0])
    if value in meanings:
        return
    fail(p(name), value, "must be " + " or ".join(f"{w} ({m})" for w, m in meanings.items()),
         "set " + ", or ".join(f"{p(name)}={_word(w, p)}" for w in words) + " (README: Staleness and concurrency)")


def _word(value: str, p: Any) -> str:
    """A string value as the user writes it: ``kept`` on the command line, ``"kept"`` in Python (the API's keys
    have no dot)."""
    return value if "." in p("x") else f'"{value}"'


def _fail(key: str, value: Any, problem: str, fix: str) -> None:
    if "." not in key:  # the Python API's name (AsyncGRPOConfig): None, not the CLI's YAML null
        problem, fix = (re.sub(r"\bnull\b", "None", t) for t in (problem, fix))
    raise ConfigError(f"{key}={value!r}: {problem}. Fix: {fix}", key=key)


def check_fields(values: Mapping[str, Any], path_of: Callable[[str], str] = lambda n: n) -> None:
    """Check the async-GRPO fields of one config (SPEC §2, §3, §7, §16.3, Appendix B).

    Args:
        values: field name → value, by `AsyncGRPOConfig` names (``top_p``, ``max_staleness`` ...).
        path_of: maps a field name to the name the user typed (e.g. ``rollout.top_p``).

    Raises:
        ConfigError: the one invalid value, naming ``path_of(field)``, the value and the fix.
        ConfigErrors: several, each so (the first problem of each key; the loss fields' rules run once the others
            pass, since they read those fields as valid).
    """
    from .errors import Collector
    from .loss_rules import check_loss_fields

    found = Collector()
    try:
        found.run(_field_rules, values, path_of, found)
    except (TypeError, ValueError):  # a value of the wrong type behind a problem already found: report that one
        if not found.errors:
            raise
    if not found.errors:  # the loss rules read the fields above as valid
        found.run(check_loss_fields, values, path_of)
    found.raise_if_any()


def _field_rules(values: Mapping[str, Any], p: Callable[[str], str], found: Any) -> None:
    """`check_fields`' rules: each problem goes to ``found`` (an `errors.Collector`), the first of each key only."""

    def fail(key: str, value: Any, problem: str, fix: str) -> None:
        if all(err.key != key for err in found.errors):
            found.run(_fail, key, value, problem, fix)

    g = values.get
    if g("num_generations", 8) < 2:
        fail(p("num_generations"), g("num_generations"), "GRPO needs at least 2 rollouts per group to compute "
             "a group-relative advantage", f"set {p('num_generations')} to 2 or more (4-16 is usual)")
    if g("max_completion_length", 1) < 1:
        fail(p("max_completion_length"), g("max_completion_length"), "must be >= 1 token",
             f"set {p('max_completion_length')} to the longest reply you want, e.g. 2048")
    temperature = g("temperature", 1.0)
    if temperature is None or temperature <= 0:
        fail(p("temperature"), temperature, "must be > 0 (a greedy sampler makes every group identical and "
             "its log-probs are not a distribution)", f"set {p('temperature')}=1.0")
    top_p, top_k, min_p = g("top_p", 1.0), g("top_k", 0), g("min_p", None)
    if not 0 < top_p <= 1:
        fail(p("top_p"), top_p, "must lie in (0, 1]", f"set {p('top_p')}=1.0 to disable nucleus filtering")
    if top_k < 0:
        fail(p("top_k"), top_k, "must be >= 0 (0 disables top-k)", f"set {p('top_k')}=0")
    if min_p is not None and not 0 <= min_p <= 1:
        fail(p("min_p"), min_p, "must lie in [0, 1]", f"set {p('min_p')}=null to disable it")
    if top_p < 1 and top_k <= 0:
        fail(p("top_p"), top_p, f"nucleus filtering needs {p('top_k')} > 0: vLLM bounds the candidate set "
             "with top_k (README: Sampling filters)", f"also set {p('top_k')}=512, or set {p('top_p')}=1.0")
    if min_p is not None and min_p > 0 and top_k <= 0:
        fail(p("min_p"), min_p, f"min-p filtering needs {p('top_k')} > 0: vLLM bounds the candidate set with "
             "top_k (README: Sampling filters)", f"also set {p('top_k')}=512, or set {p('min_p')}=null")
    if g("repetition_penalty", 1.0) <= 0:
        fail(p("repetition_penalty"), g("repetition_penalty"), "must be > 0", f"set {p('repetition_penalty')}=1.0")
    nlp = g("num_sampler_logprobs", 8)
    if nlp < 0:
        fail(p("num_sampler_logprobs"), nlp, "must be >= 0", f"set {p('num_sampler_logprobs')}=8")
    if g("score_centering", True) and nlp < 1:
        fail(p("num_sampler_logprobs"), nlp, "score centering needs the sampler's top log-probs to take the "
             "expectation over (README: Log-probabilities and the loss)",
             f"set {p('num_sampler_logprobs')}=8, or {p('score_centering')}=false for the clipped objective")
    if g("epsilon", 0.2) < 0:
        fail(p("epsilon"), g("epsilon"), "must be >= 0", f"set {p('epsilon')}=0.2")
    eh = g("epsilon_high", None)
    if eh is not None and eh < 0:
        fail(p("epsilon_high"), eh, "must be >= 0", f"set {p('epsilon_high')}=0.28 or null")
    cmin, cmax = g("vllm_importance_sampling_clip_min", 0.5), g("vllm_importance_sampling_clip_max", 5.0)
    if cmin is not None and cmin < 0:
        fail(p("vllm_importance_sampling_clip_min"), cmin, "must be >= 0, or null for no lower bound",
             f"set {p('vllm_importance_sampling_clip_min')}=0.5 (the default) or null")
    if cmax is not None and cmax <= 0:
        fail(p("vllm_importance_sampling_clip_max"), cmax, "must be > 0, or null for no upper bound",
             f"set {p('vllm_importance_sampling_clip_max')}=5.0 (the default) or null")
    if cmin is not None and cmax is not None and not cmin < cmax:
        fail(p("vllm_importance_sampling_clip_min"), cmin,
             f"needs clip_min < {p('vllm_importance_sampling_clip_max')} (= {cmax})",
             "use the defaults 0.5 and 5.0, or leave one of them null for a one-sided bound")
    tb = g("token_budget", None)
    if tb is not None and tb < 1:
        fail(p("token_budget"), tb, "must be >= 1 token", f"set {p('token_budget')}=null to use the server's max_model_len")
    mgs = g("max_groups_per_step", None)
    if mgs is not None and (isinstance(mgs, bool) or not isinstance(mgs, int) or mgs < 1):
        fail(p("max_groups_per_step"), mgs, "must be >= 1 group, or null for no bound beyond the token budget",
             f"set {p('max_groups_per_step')}=null, or a count of groups such as 64")
    ga = g("gradient_accumulation_steps", 1)
    if mgs is not None and isinstance(ga, int) and ga > 1 and mgs % ga:
        fail(p("max_groups_per_step"), mgs, f"must be a multiple of {p('gradient_accumulation_steps')} (= {ga}): "
             f"each of a step's {ga} micro-batches holds {p('max_groups_per_step')} / {ga} groups",
             f"set {p('max_groups_per_step')}={max(ga, mgs // ga * ga)}")
    if g("max_concurrent_rollouts", 512) < 1:
        fail(p("max_concurrent_rollouts"), g("max_concurrent_rollouts"), "must be >= 1",
             f"set {p('max_concurrent_rollouts')}=512")
    if g("max_staleness", 4) < 0:
        fail(p("max_staleness"), g("max_staleness"), "must be >= 0 weight updates (0 = on-policy)",
             f"set {p('max_staleness')}=4")
    if g("weight_sync_steps", 1) < 1:
        fail(p("weight_sync_steps"), g("weight_sync_steps"), "must be >= 1 optimizer step",
             f"set {p('weight_sync_steps')}=1")
    _one_of(g, fail, p, "in_flight_estimate", dict(zip(IN_FLIGHT_ESTIMATES, (
        "a rollout in flight counts as the mean sample tokens per finished rollout, the default",
        "as the mean sample tokens finished rollouts put into the rollout queue, dropped groups counting zero"))))
    release = g("deadline_release_versions", None)
    if release is not None and (isinstance(release, bool) or not isinstance(release, int) or release < 1):
        fail(p("deadline_release_versions"), release, "must be null (deadline admission stays on from the first "
             "stale drop) or a whole number of weight updates >= 1",
             f"set {p('deadline_release_versions')}=4 to try it, or null (README: Staleness and concurrency)")
    _one_of(g, fail, p, "deadline_order", dict(zip(DEADLINE_ORDERS, (
        "deadline admission counts everything committed as pulled before a group in flight, the default",
        "the groups started at a later version count at the share of such groups' tokens seen to finish first"))))
    if g("rollout_worker_timeout", 300.0) <= 0:
        fail(p("rollout_worker_timeout"), g("rollout_worker_timeout"), "must be > 0 seconds",
             f"set {p('rollout_worker_timeout')}=300")
    if g("vllm_server_timeout", 1800.0) <= 0:
        fail(p("vllm_server_timeout"), g("vllm_server_timeout"), "must be > 0 seconds",
             f"set {p('vllm_server_timeout')}=1800")
    if g("vllm_server_hang_timeout", 120.0) <= 0:
        fail(p("vllm_server_hang_timeout"), g("vllm_server_hang_timeout"), "must be > 0 seconds",
             f"set {p('vllm_server_hang_timeout')}=120")
    url = g("vllm_server_base_url", None)
    if url is not None and not _is_http_url(url):
        fail(p("vllm_server_base_url"), url, "not an http(s) URL of the sampler",
             f"set {p('vllm_server_base_url')}=http://HOST:PORT (e.g. http://127.0.0.1:8000)")
    wtp = g("weight_transfer_port", None)
    if wtp is not None and not 0 < wtp < 65536:
        fail(p("weight_transfer_port"), wtp, "must be a TCP port in 1..65535",
             f"set {p('weight_transfer_port')}=null to pick a free port, or e.g. {p('weight_transfer_port')}=29600")
    dtype = g("dtype", "float32")
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        fail(p("dtype"), dtype, "must be one of auto, bfloat16, float16, float32", f"set {p('dtype')}=float32")
    mg = g("max_groups_without_signal", 64)
    if mg is not None and mg < 0:
        fail(p("max_groups_without_signal"), mg, "must be >= 0 groups (0 never stops)",
             f"set {p('max_groups_without_signal')}=64")
    if g("use_liger_kernel", False):
        fail(p("use_liger_kernel"), True, "the Liger kernel is not supported by the async GRPO trainer (README: Supported setups)",
             f"set {p('use_liger_kernel')}=false")
    if g("remove_unused_columns", False):
        fail(p("remove_unused_columns"), True, "every dataset column must reach the reward functions (README: Supported setups)",
             f"set {p('remove_unused_columns')}=false")
    if g("deepspeed", None):
        fail(p("deepspeed"), g("deepspeed"), "DeepSpeed is not supported; sharded training uses FSDP2 (README: Supported setups)",
             f"remove {p('deepspeed')}")


def _is_http_url(url: Any) -> bool:
    """``http(s)://HOST[:PORT][/PATH]`` with a host, a valid port and no space."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or any(c.isspace() for c in url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is no number or out of range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc) and bool(parts.hostname or "[" in parts.netloc)


def check_lora_rank(r: int, key: str = "peft.r") -> None:
    """Reject LoRA ranks vLLM cannot serve (SPEC §9: the largest allowed ``--max-lora-rank`` is 512).

    Raises:
        ConfigError: when ``r`` < 1 or ``r`` > 512.
    """
    if r < 1 or r > ALLOWED_LORA_RANKS[-1]:
        _fail(key, r, f"vLLM serves LoRA ranks up to {ALLOWED_LORA_RANKS[-1]} "
              f"(--max-lora-rank is one of {', '.join(map(str, ALLOWED_LORA_RANKS))})",
              f"set {key} to a value in 1..512, e.g. 32")


def max_lora_rank_for(r: int) -> int:
    """Smallest allowed ``--max-lora-rank`` >= ``r`` (SPEC §9). Raises ConfigError above 512."""
    check_lora_rank(r)
    return next(a for a in ALLOWED_LORA_RANKS if a >= r)


def weight_sync_overlap_refusals(*, check_weight_sync: bool, lora: bool, processes: int | None,
                                 key: Callable[[str], str], lora_key: str,
                                 one_process: str = "run one trainer process") -> list[ConfigError]:
    """Why ``weight_sync_overlap`` (on) cannot apply to a run, one `ConfigError` per reason (README "Overlapped
    weight sync"; SPEC §3.1, B.23: the worker stamps a version only once the server serves it). Empty: it applies.

    The sync then runs on a background thread while the next step's forward and backward run (the trainer's
    `sync_overlap.PendingSync`), which excludes: several trainer processes (FSDP gathers a sync's weights with
    collectives that every rank's main thread joins in step), ``check_weight_sync`` (its probe runs a trainer forward
    and a server request right after each sync, that is before the overlapped sync is done) and LoRA (its adapter or
    merged sync is not built for it; adapter sync sends a small adapter without pausing generation).

    Args:
        check_weight_sync: the run's ``check_weight_sync``.
        lora: the run syncs a LoRA adapter (``peft.enabled=true``, a ``peft_config`` or a PEFT model).
        processes: trainer processes over all machines; None when not known here (the launch plan checks it).
        key: spells a field's name (``sampler.weight_sync_overlap`` on the command line, the bare name in Python).
        lora_key: how the run asked for LoRA (``peft.enabled=true``, ``peft_config``), for the message.
        one_process: the fix's way to one trainer process (e.g. ``launch.trainer_gpus=[1]``).

    Returns:
        The refusals, each naming ``key("weight_sync_overlap")``, its value, why and the fix (raised by the caller,
        with its other problems).
    """
    name = key("weight_sync_overlap")
    cli = "." in name
    on, off = ("true", "false") if cli else ("True", "False")
    fix_off = f"{name}={off}"
    found = []
    if processes is not None and processes > 1:
        found.append(ConfigError(
            f"{name}={on} with {processes} trainer processes: FSDP gathers the weights of a sync with collectives that "
            "every process's main thread joins in step, so the sync cannot run on a background thread. Fix: "
            f"{fix_off}, or {one_process}", key=name))
    if check_weight_sync:
        found.append(ConfigError(
            f"{name}={on} with {key('check_weight_sync')}={on}: the check probes the server with a trainer forward "
            "right after each sync, before an overlapped sync is done. Fix: "
            f"{fix_off}, or {key('check_weight_sync')}={off}", key=key("check_weight_sync")))
    if lora:
        found.append(ConfigError(
            f"{name}={on} with {lora_key}: a LoRA run's weight sync (adapter or merged) is not built to run on a "
            "background thread (adapter sync sends a small adapter without pausing generation: little to overlap). "
            f"Fix: {fix_off}, or full-weight training", key=name))
    return found
