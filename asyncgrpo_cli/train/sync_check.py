"""The weight-sync check (``sampler.check_weight_sync``; issue #44: a sync the server accepts but does not apply).

A server can answer every weight-transfer route with success and go on serving its old weights: a model class
its engine maps under other parameter names (vLLM falls back to its Transformers backend for classes it does not
know), a weight it skips, a dtype it casts differently. The routes' answers cannot show that; the server's
log-probs can. A probe asks the server for a short completion of a fixed prompt (temperature 1, no filters, a
fixed seed, end-of-sequence ignored) and compares the log-probs it reports for the tokens it sampled with the
trainer's own for the same tokens: `probe_gap`, the mean |server − trainer| in nats over those tokens.

At start, after the first sync, `check_at_start` takes four probes:

- ``synced``: the trainer's weights, just synced: the floor (bf16 against fp32, the two sides' kernels);
- ``apart``: every floating-point parameter perturbed by Gaussian noise of a scale × its own RMS, the server not
  synced yet: the probe must see the difference. The scales of `PERTURB_SCALES` are tried smallest first, and the
  first the probe sees clearly (`APART_MIN`, and `APART_FACTOR` floors) is used: a bf16 server and the trainer
  drift apart on a heavily perturbed model by themselves (SmolLM2-135M at 0.5x its RMS: 2.7-3.1 nats per token on
  the same weights, a bf16 copy against float32 under bf16 autocast on the CPU; the eleventh session's GPU job
  measured 3.92 after its sync and stopped), which a modest perturbation keeps near the floor (0.02-0.06 at
  0.05-0.1x, against 0.1-1.8 apart);
- ``follow``: after a sync of the perturbed weights: back near the floor;
- ``back``: the trainer's weights restored exactly (copied back from host memory) and synced again: near the floor.

`judge` turns them into a verdict: a sync that did not take effect stops the run at start with the four figures
(`WeightSyncCheckError`), a perturbation the probe cannot see is reported as inconclusive. Afterwards every sync
of training logs ``weight_sync/probe_gap`` (one probe each; it adds a short request to the step's sync).

Costs: three more syncs and four probes at start (and a probe for each smaller scale tried, three at most), and
host memory for one copy of this rank's shard of the weights. Only full-weight sync is checked; adapter (LoRA)
sync is left out with a note.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..sampler.protocol import SamplingParams

__all__ = ["PERTURB_SCALES", "STARTED", "SyncCheck", "SyncCheckResult", "WeightSyncCheckError", "judge", "perturbed",
           "probe_gap", "probe_prompt", "server_sample", "trainer_logprobs"]

#: Noise added to each parameter at start, as fractions of the parameter's RMS, tried smallest first.
PERTURB_SCALES = (0.05, 0.1, 0.2, 0.5)
#: A perturbation counts as seen clearly when it moves the probe this far (nats per token), and `APART_FACTOR` floors.
APART_MIN = 0.3
#: What numerics alone may add to the floor after a sync: a bf16 server against the trainer's autocast on a
#: perturbed model measured up to 0.06 (SmolLM2-135M, 0.05-0.1x, three probe seeds).
NOISE = 0.1
#: Tokens a probe samples.
PROBE_TOKENS = 16
#: The probe's fixed seed (the same tokens whenever the weights are the same).
PROBE_SEED = 1234
#: The floor below which two sides count as equal whatever ``synced`` measured (nats per token).
FLOOR_MIN = 0.02
#: A probe gap right after a sync above this says the two sides do not run the same model at all (a bf16 vLLM
#: against an fp32 trainer measured 0.20 on a random Qwen3-0.6B shape, `scripts/gpu/vllm033/README.md`; a
#: perturbed one 30.5).
SYNCED_MAX = 1.0
#: ``apart`` must exceed this many floors for the check to tell anything.
APART_FACTOR = 4.0
PROBE_TEXT = "What is 12 plus 30? Answer with one number."
#: The console's line as the check begins (the verdict follows it).
STARTED = ("weight sync check: probing the server, then perturbing the weights, syncing and probing again (before "
           "step 1; its verdict follows)")


class WeightSyncCheckError(RuntimeError):
    """The weight-sync check found a sync that did not take effect (the message holds the four probe gaps)."""


@dataclass
class SyncCheckResult:
    """The four probe gaps of `check_at_start` (nats per sampled token) and `judge`'s verdict.

    Attributes:
        synced, apart, follow, back: the probe gaps (module docstring).
        status: ``"pass"``, ``"fail"`` or ``"inconclusive"``.
        message: one line naming the figures and, on ``fail``, the fix.
        scale: the perturbation `check_at_start` used (a fraction of each parameter's RMS), None when not known.
    """

    synced: float
    apart: float
    follow: float
    back: float
    status: str = ""
    message: str = ""
    scale: float | None = None

    def metrics(self) -> dict[str, float]:
        """``weight_sync/check_{synced,apart,follow,back}_gap``, ``weight_sync/check_passed`` (1.0 or 0.0) and
        ``weight_sync/check_perturb_scale`` (the perturbation used; only when known)."""
        out = {"weight_sync/check_synced_gap": self.synced, "weight_sync/check_apart_gap": self.apart,
               "weight_sync/check_follow_gap": self.follow, "weight_sync/check_back_gap": self.back,
               "weight_sync/check_passed": 1.0 if self.status == "pass" else 0.0}
        if self.scale is not None:
            out["weight_sync/check_perturb_scale"] = self.scale
        return out


def judge(synced: float, apart: float, follow: float, back: float, scale: float | None = None) -> SyncCheckResult:
    """The verdict on four probe gaps (module docstring).

    ``floor = max(synced, FLOOR_MIN)`` and ``near = max(2 × floor, floor + NOISE)``:

    - ``fail`` when ``synced > SYNCED_MAX`` (the two sides differ right after a sync), or, the perturbation
      seen (``apart >= APART_FACTOR × floor``), when ``follow`` or ``back`` is above ``near`` or above
      ``apart / 2`` (a sync left the server where it was);
    - ``inconclusive`` when ``apart < APART_FACTOR × floor`` (the perturbation did not move the probe);
    - ``pass`` otherwise.

    Raises:
        ValueError: a gap that is negative or not finite.
    """
    for name, value in (("synced", synced), ("apart", apart), ("follow", follow), ("back", back)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"probe gap {name}={value!r}: must be a finite number of nats >= 0")
    result = SyncCheckResult(synced, apart, follow, back, scale=scale)
    how = f" ({scale:g}x each parameter's RMS)" if scale is not None else ""
    figures = f"probe gap after the first sync {synced:.4f}, perturbed{how} before a sync {apart:.4f}, after it " \
              f"{follow:.4f}, restored and synced {back:.4f} nats per token"
    floor = max(synced, FLOOR_MIN)
    near = max(2 * floor, floor + NOISE)
    fix = ("Fix: check what the server serves (`asyncgrpo doctor`; a model class vLLM does not know runs on its "
           "Transformers backend), use a model and server version whose weight names match, or set "
           "sampler.check_weight_sync=false to train anyway (sampling/importance_sampling_ratio will show the "
           "mismatch)")
    if synced > SYNCED_MAX:
        result.status = "fail"
        result.message = (f"weight sync check failed: right after a sync the server's log-probs differ from the "
                          f"trainer's by {synced:.4f} nats per token (over {SYNCED_MAX}): the two do not run the same "
                          f"model ({figures}). {fix}")
    elif apart < APART_FACTOR * floor:
        result.status = "inconclusive"
        result.message = (f"weight sync check inconclusive: perturbing the weights moved the probe only to "
                          f"{apart:.4f} (under {APART_FACTOR:g}x the floor {floor:.4f}), so it cannot tell a sync "
                          f"that took effect from one that did not ({figures})")
    elif max(follow, back) > min(near, apart / 2):
        which = "the perturbed weights" if follow > min(near, apart / 2) else "the restored weights"
        result.status = "fail"
        result.message = (f"weight sync check failed: the server did not take {which} (gap {max(follow, back):.4f}, "
                          f"{near:.4f} at most expected; {figures}). {fix}")
    else:
        result.status = "pass"
        result.message = f"weight sync check passed: every sync took effect ({figures})"
    return result


def trainer_logprobs(model: torch.nn.Module, prompt_ids: list[int], tokens: list[int],
                     autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list[float]:
    """The trainer's log-prob of each of ``tokens`` after ``prompt_ids`` (temperature 1), one plain forward.

    Args:
        model: the policy (every rank of a sharded model calls this with the same ids).
        prompt_ids, tokens: token ids; ``tokens`` non-empty.
        autocast: the trainer's autocast context (``accelerator.autocast``), so the probe computes as training does.

    Returns:
        ``len(tokens)`` floats (natural log), computed in float32 from the logits.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(tokens)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt_ids):, None])[:, 0].tolist()


def probe_gap(server_logprobs: list[float], mine: list[float]) -> float:
    """Mean |server − trainer| log-prob over the probe's tokens (nats per token).

    Raises:
        ValueError: no tokens, or the two lists differ in length.
    """
    if not server_logprobs or len(server_logprobs) != len(mine):
        raise ValueError(f"probe: {len(server_logprobs)} server log-probs against {len(mine)} of the trainer's")
    return sum(abs(a - b) for a, b in zip(server_logprobs, mine)) / len(mine)


def probe_prompt(tokenizer) -> list[int]:
    """`PROBE_TEXT` as a user message through ``tokenizer``'s chat template (a processor's tokenizer for a
    vision-language model), or plainly encoded when it has no template.

    Raises:
        ValueError: the text encodes to no token.
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": PROBE_TEXT}], add_generation_prompt=True,
                                      tokenize=True)
    except (ValueError, AttributeError, TypeError):  # no chat template
        ids = tok(PROBE_TEXT)["input_ids"]
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    if not len(ids):
        raise ValueError(f"the weight-sync probe's text {PROBE_TEXT!r} encodes to no token")
    return [int(i) for i in ids]


def server_sample(client, model: str | None) -> Callable[[list[int], SamplingParams], tuple[list[int], list[float]]] | None:
    """``(prompt_ids, sampling) -> (tokens, log-probs)`` from ``client`` (`SyncSamplerClient.complete`, naming
    ``model`` as the rollouts do); None when ``client`` is None (the ranks other than 0)."""
    if client is None:
        return None

    def sample(prompt_ids: list[int], sampling: SamplingParams) -> tuple[list[int], list[float]]:
        turn = client.complete(prompt_ids, sampling, model=model)
        return list(turn.output_ids), list(turn.output_log_probs)

    return sample


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a parameter (the local shard of an FSDP2 ``DTensor``, else the tensor itself)."""
    return p.to_local() if hasattr(p, "to_local") else p


@contextlib.contextmanager
def perturbed(model: torch.nn.Module, scale: float = PERTURB_SCALES[-1], seed: int = 0) -> Iterator[None]:
    """Inside: every floating-point parameter of ``model`` plus Gaussian noise of ``scale`` × its RMS (of this
    rank's shard); on exit, every parameter copied back exactly from a host copy taken on entry."""
    params = [_local(p) for p in model.parameters() if p.is_floating_point()]
    saved = [p.detach().to("cpu", copy=True) for p in params]
    try:
        with torch.no_grad():
            for i, p in enumerate(params):
                gen = torch.Generator(device=p.device).manual_seed(seed + i)
                noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
                rms = p.detach().float().pow(2).mean().sqrt() if p.numel() else torch.zeros((), device=p.device)
                p.add_((noise * (scale * rms)).to(p.dtype))
        yield
    finally:
        with torch.no_grad():
            for p, copy in zip(params, saved):
                p.copy_(copy.to(p.device))


class SyncCheck:
    """The probe and the start-up check of one run (module docstring).

    Args:
        model: the policy.
        sync: ``(version) -> None``, the run's weight sync (every rank calls it).
        sample: rank 0: ``(prompt_ids, SamplingParams) -> (tokens, server log-probs)`` (the server's completion);
            other ranks: None.
        broadcast: ``(obj) -> obj`` from rank 0 to every rank (identity on one process).
        prompt_ids: the probe's prompt.
        autocast: the trainer's autocast context.
    """

    def __init__(self, model: torch.nn.Module, sync: Callable[[int], object],
                 sample: Callable[[list[int], SamplingParams], tuple[list[int], list[float]]] | None,
                 broadcast: Callable[[object], object], prompt_ids: list[int],
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        if not prompt_ids:
            raise ValueError("the weight-sync probe needs a non-empty prompt")
        self.model, self.sync, self.sample, self.broadcast = model, sync, sample, broadcast
        self.prompt_ids = list(prompt_ids)
        self.autocast = autocast
        self.sampling = SamplingParams(max_tokens=PROBE_TOKENS, temperature=1.0, logprobs=0, seed=PROBE_SEED,
                                       ignore_eos=True)

    def probe(self) -> float:
        """One probe against the weights the server serves now (every rank calls it; module docstring).

        Raises:
            WeightSyncCheckError: on every rank, when rank 0's request failed (its error named; the ranks learn
                it through the broadcast, so none waits for the others).
        """
        drawn, error = None, None
        if self.sample is not None:
            try:
                drawn = self.sample(self.prompt_ids, self.sampling)
            except Exception as exc:  # noqa: BLE001 - any failure of the request: every rank must hear of it
                error = f"{type(exc).__name__}: {exc}"
        drawn, error = self.broadcast((drawn, error))
        if error is not None:
            raise WeightSyncCheckError(f"the weight-sync probe could not sample from the server: {error}")
        tokens, server = drawn
        return probe_gap(list(server), trainer_logprobs(self.model, self.prompt_ids, list(tokens), self.autocast))

    def probe_metrics(self, version: int, say: bool) -> dict[str, float]:
        """``{"weight_sync/probe_gap": gap}`` after the sync of model ``version`` (every rank calls it); a failed
        probe request gives ``{}`` and, when ``say`` (rank 0), a line naming it: the step goes on without the gap."""
        try:
            return {"weight_sync/probe_gap": self.probe()}
        except WeightSyncCheckError as exc:
            if say:
                print(f"asyncgrpo: no weight_sync/probe_gap for model version {version}: {exc}", flush=True)
            return {}

    def check_at_start(self, version: int) -> SyncCheckResult:
        """The probes around a perturbed sync, as model ``version`` each time (the worker has not started: no
        request sees the perturbed weights but the probe's), and `judge`'s verdict. The perturbation is the
        smallest of `PERTURB_SCALES` whose ``apart`` probe reaches `APART_MIN` and `APART_FACTOR` floors (the
        largest when none does): one probe per scale tried, and the two syncs only at the one used. The trainer's
        weights are exactly what they were on entry when this returns or raises.

        Raises:
            WeightSyncCheckError: the verdict is ``fail`` (its message).
        """
        synced = self.probe()
        clear = max(APART_FACTOR * max(synced, FLOOR_MIN), APART_MIN)
        for scale in PERTURB_SCALES:  # the smallest perturbation the probe sees clearly (module docstring)
            with perturbed(self.model, scale):
                apart = self.probe()
                # Rank 0's decision for every rank: a rank that computed its gap a hair apart must not skip a sync
                # the others enter (the syncs are collectives).
                if not self.broadcast(apart >= clear or scale == PERTURB_SCALES[-1]):
                    continue  # restored on leaving the block; the server still serves the synced weights
                self.sync(version)
                follow = self.probe()
            break
        self.sync(version)
        back = self.probe()
        result = judge(synced, apart, follow, back, scale)
        if result.status == "fail":
            raise WeightSyncCheckError(result.message)
        return result
