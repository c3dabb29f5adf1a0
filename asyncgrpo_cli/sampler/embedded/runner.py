"""The model side of the embedded sampler: a transformers causal LM, its KV, weights and LoRA adapters.

`ModelRunner.step(plan)` computes one token for each request of a `SchedulePlan`:

- **Batched mode** (every cache layer a plain full-attention ``DynamicLayer``, e.g. Llama, Qwen3):
  the KV of all decoding requests lives in ONE ``DynamicCache`` whose rows are left-padded to a
  common length, with a ``[B, L]`` attention mask marking real tokens and per-row position ids.
  A decode step feeds every row's last token in one forward. New (or preempted) requests are
  prefilled one by one, then merged into the batch by left-padding; finished rows are dropped with
  ``index_select`` and all-padding columns trimmed.
- **Sequential mode** (sliding-window, linear-attention or other cache layers): each request keeps
  its own cache and is stepped alone. Slower, same results.

Sampling math is in `sampling`; one ``torch.Generator`` per request (seeded by the request's
``seed`` or by the server) makes a seeded request reproducible whatever else runs beside it.
Everything here runs on the engine's single model thread.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .engine import EngineRequest, SchedulePlan, TokenOutput
from .sampling import (
    apply_repetition_penalty,
    candidate_set,
    process_logits,
    sample_tokens,
    top_logprobs,
)
from .weight_names import expert_weight_slots

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class WeightUpdateError(ValueError):
    """An ``/update_weights`` request does not match the model or the file (HTTP 400)."""


class AdapterError(ValueError):
    """A LoRA adapter cannot be loaded or unloaded (HTTP 400)."""


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Map ``--dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16`` and aliases) to a torch dtype.

    ``auto`` is float32 on CPU and bfloat16 on CUDA.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(sorted(set(_DTYPES)))}") from None


def resolve_device(name: str) -> str:
    """Map ``--device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) to a torch device string.

    Raises:
        ValueError: CUDA requested but not available.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's name of a torch dtype (``float32``, ``bfloat16``, ``float16``)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class ModelRunner:
    """A transformers causal LM that steps many requests at once (see the module docstring).

    Args:
        model: a loaded ``PreTrainedModel`` with a causal-LM head, in eval mode, on ``device``.
        device: torch device string.
        seed: seeds the generators of requests that carry no ``seed``.
        enable_lora: allow `load_adapter`.
        max_lora_rank: largest adapter rank accepted.
        max_loras: most adapters loaded at once.
    """

    def __init__(
        self,
        model: Any,
        device: str,
        *,
        seed: int = 0,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 1,
    ) -> None:
        self.model = model
        self.base_model = model
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.adapters: dict[str, str] = {}  # name -> path
        self._seed_rng = random.Random(seed)
        self._params: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self._params[name] = param
        for name, buf in model.named_buffers(remove_duplicate=False):
            self._params.setdefault(name, buf)
        self._expert_slots = expert_weight_slots(model, self._params)  # checkpoint names of fused MoE experts
        forward_params = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in forward_params
        # transformers >= 5.2x names the KV argument ``cache`` (``past_key_values`` is deprecated)
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # batched-mode state
        self._rows: list[EngineRequest] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self.peak_decode_rows = 0  # largest batched decode so far (diagnostics, tests)
        # sequential-mode state
        self._caches: dict[int, Any] = {}
        self.batched = self._probe_batched()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        gguf_file: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 1,
    ) -> "ModelRunner":
        """Load ``model_path`` (a local folder or hub id already in the cache) with transformers.

        Args:
            gguf_file: a GGUF file inside ``model_path`` to load with ``gguf_file=``.
            dtype / device: see `resolve_dtype` / `resolve_device`.
        """
        from transformers import AutoModelForCausalLM

        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device)
        kwargs: dict[str, Any] = {"dtype": torch_dtype}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        model = None
        if not gguf_file:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path)
            if getattr(config, "vision_config", None) is not None:
                # a vision-language checkpoint is served whole, as vLLM does: the trainer syncs its HF names
                from transformers import AutoModelForImageTextToText

                model = AutoModelForImageTextToText.from_pretrained(model_path, **kwargs)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        model.to(device)
        model.eval()
        model.requires_grad_(False)
        return cls(
            model, device, seed=seed, enable_lora=enable_lora, max_lora_rank=max_lora_rank, max_loras=max_loras
        )

    def eos_token_ids(self, tokenizer: Any = None) -> frozenset[int]:
        """EOS ids from the model's generation config and config, plus the tokenizer's EOS."""
        ids: set[int] = set()
        for source in (getattr(self.base_model, "generation_config", None), self.base_model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        return frozenset(ids)

    def _probe_batched(self) -> bool:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = DynamicCache(config=self.base_model.config)
        with torch.no_grad():
            self.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
        layers = getattr(cache, "layers", None)
        ok = bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)
        if not ok:
            log.info("embedded sampler: cache layers are not all full-attention; stepping requests one by one")
        return ok

    # ------------------------------------------------------------------ stepping
    def reset(self) -> None:
        """Forget all KV (every request will be prefilled again)."""
        self._rows = []
        self._cache = None
        self._mask = None
        self._caches.clear()

    @torch.no_grad()
    def step(self, plan: SchedulePlan) -> list[TokenOutput]:
        """Compute one token for each request of ``plan.rows`` (decode rows, then prefill rows).

        Returns:
            one `TokenOutput` per row, in ``plan.rows`` order.
        """
        logits_parts: list[torch.Tensor] = []
        if self.batched:
            self._select_rows(plan.decode)
            if plan.decode:
                logits_parts.append(self._decode_batched())
            for request in plan.prefill:
                logits, cache = self._prefill(request)
                self._merge(request, cache)
                logits_parts.append(logits)
        else:
            keep = {id(r) for r in plan.decode}
            for key in [k for k in self._caches if k not in keep]:
                del self._caches[key]
            for request in plan.decode:
                logits_parts.append(self._decode_one(request))
            for request in plan.prefill:
                logits, cache = self._prefill(request)
                self._caches[id(request)] = cache
                logits_parts.append(logits)
        logits = torch.cat(logits_parts, dim=0).float()
        return self._sample(plan.rows, logits)

    def _forward(self, rows: list[EngineRequest], cache: Any, **kwargs: Any) -> torch.Tensor:
        kwargs[self._cache_kwarg] = cache
        if self.adapters:
            kwargs["adapter_names"] = [r.adapter or "__base__" for r in rows]
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(use_cache=True, **kwargs)
        return out.logits[:, -1, :]

    def _prefill(self, request: EngineRequest) -> tuple[torch.Tensor, Any]:
        from transformers.cache_utils import DynamicCache

        ids = request.prompt_ids + request.output_ids
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.base_model.config)
        logits = self._forward(
            [request],
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            position_ids=torch.arange(len(ids), device=self.device)[None, :],
            cache=cache,
        )
        return logits, cache

    def _decode_one(self, request: EngineRequest) -> torch.Tensor:
        cache = self._caches[id(request)]
        pos = request.num_tokens - 1
        return self._forward(
            [request],
            input_ids=torch.tensor([[request.output_ids[-1]]], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([[pos]], device=self.device),
            cache=cache,
        )

    def _decode_batched(self) -> torch.Tensor:
        rows = self._rows
        self.peak_decode_rows = max(self.peak_decode_rows, len(rows))
        input_ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=self._mask.dtype, device=self.device)], 1)
        position_ids = (self._mask.sum(dim=1, keepdim=True) - 1).long()
        return self._forward(
            rows,
            input_ids=input_ids,
            attention_mask=self._mask,
            position_ids=position_ids,
            cache=self._cache,
        )

    def _select_rows(self, keep: list[EngineRequest]) -> None:
        """Reduce/reorder the batch cache to exactly the rows of ``keep`` (all already in it)."""
        if not keep:
            self.reset()
            return
        position = {id(r): i for i, r in enumerate(self._rows)}
        try:
            index = [position[id(r)] for r in keep]
        except KeyError:
            raise RuntimeError("embedded runner: a decode request has no KV in the batch") from None
        if index != list(range(len(self._rows))):
            idx = torch.tensor(index, dtype=torch.long, device=self.device)
            for layer in self._cache.layers:
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
            self._mask = self._mask.index_select(0, idx)
            self._rows = list(keep)
        # trim columns that are padding in every row
        real = self._mask.any(dim=0).nonzero()
        first = int(real[0]) if real.numel() else 0
        if first > 0:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]
            self._mask = self._mask[:, first:]

    def _merge(self, request: EngineRequest, cache: Any) -> None:
        """Append a freshly prefilled request to the batch cache (left-padding to a common length)."""
        length = request.num_tokens
        new_mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if self._cache is None:
            self._cache, self._mask, self._rows = cache, new_mask, [request]
            return
        old_len = self._mask.shape[1]
        total = max(old_len, length)
        pad_old, pad_new = total - old_len, total - length
        for layer, new_layer in zip(self._cache.layers, cache.layers):
            layer.keys = torch.cat([F.pad(layer.keys, (0, 0, pad_old, 0)), F.pad(new_layer.keys, (0, 0, pad_new, 0))], 0)
            layer.values = torch.cat(
                [F.pad(layer.values, (0, 0, pad_old, 0)), F.pad(new_layer.values, (0, 0, pad_new, 0))], 0
            )
        self._mask = torch.cat([F.pad(self._mask, (pad_old, 0)), F.pad(new_mask, (pad_new, 0))], 0)
        self._rows.append(request)

    def _generator(self, request: EngineRequest) -> torch.Generator:
        if request.generator is None:
            seed = request.options.seed
            if seed is None:
                seed = self._seed_rng.getrandbits(63)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed) % (2**64))
            request.generator = gen
        return request.generator

    def _sample(self, rows: list[EngineRequest], logits: torch.Tensor) -> list[TokenOutput]:
        opts = [r.options for r in rows]
        if any(o.repetition_penalty != 1.0 for o in opts):
            seen = [
                torch.tensor(r.prompt_ids + r.output_ids, dtype=torch.long) if o.repetition_penalty != 1.0 else None
                for r, o in zip(rows, opts)
            ]
            logits = apply_repetition_penalty(logits, seen, [o.repetition_penalty for o in opts])
        logprobs = process_logits(
            logits,
            temperature=torch.tensor([o.temperature for o in opts]),
            top_k=torch.tensor([o.top_k for o in opts]),
            top_p=torch.tensor([o.top_p for o in opts]),
            min_p=torch.tensor([o.min_p for o in opts]),
        )
        greedy = [o.greedy for o in opts]
        generators = [None if g else self._generator(r) for r, g in zip(rows, greedy)]
        tokens = sample_tokens(logprobs, greedy, generators)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        n_max = max((o.logprobs or 0) for o in opts)
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if n_max > 0:
            vals, ids = top_logprobs(logprobs, n_max)
            vals_l, ids_l = vals.tolist(), ids.tolist()
            for i, o in enumerate(opts):
                n = o.logprobs or 0
                top_vals[i], top_ids[i] = vals_l[i][:n], ids_l[i][:n]
        token_list = tokens.tolist()
        outputs = []
        for i, o in enumerate(opts):
            mask = None
            if o.return_sampling_mask and o.filters_active and not o.greedy:
                mask = candidate_set(logprobs[i])
            outputs.append(TokenOutput(token_list[i], float(chosen[i]), top_ids[i], top_vals[i], mask))
        return outputs

    # ------------------------------------------------------------------ weights
    def update_weights_from_file(
        self, path: str, names: list[str], dtype_names: list[str] | None = None, shapes: list[list[int]] | None = None
    ) -> int:
        """Copy the tensors ``names`` from the safetensors file ``path`` into the model, in place.

        Args:
            path: a ``.safetensors`` file holding at least the tensors in ``names`` (HF names).
            names: parameter (or buffer) names of the model, as in its HF checkpoint; a fused MoE expert
                parameter is written one checkpoint expert weight at a time (`weight_names.expert_weight_slots`).
            dtype_names: optional, one per name: the dtype the trainer wrote (checked against the file).
            shapes: optional, one per name: the shape the trainer wrote (checked against the model).

        Returns:
            number of tensors copied.

        Raises:
            WeightUpdateError: missing file, name unknown to the model or absent from the file, or a
                shape/dtype that does not match. Nothing is copied then.
        """
        from safetensors import safe_open

        if not Path(path).is_file():
            raise WeightUpdateError(f"update_info.path={path!r} is not a file; write the safetensors file first")
        if dtype_names is not None and len(dtype_names) != len(names):
            raise WeightUpdateError(f"update_info.dtype_names has {len(dtype_names)} entries, names has {len(names)}")
        if shapes is not None and len(shapes) != len(names):
            raise WeightUpdateError(f"update_info.shapes has {len(shapes)} entries, names has {len(names)}")
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            opened = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type: not a safetensors file
            raise WeightUpdateError(f"update_info.path={path!r} is not a safetensors file ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})") from None
        with opened as f:
            available = set(f.keys())
            for i, name in enumerate(names):
                if name not in self._params and name not in self._expert_slots:
                    close = [n for n in self._params if n.endswith(name.split(".")[-1])][:3]
                    raise WeightUpdateError(
                        f"update_info.names[{i}]={name!r} is not a parameter of the served model "
                        f"(HF checkpoint names expected, e.g. {close})"
                    )
                if name not in available:
                    raise WeightUpdateError(f"update_info.names[{i}]={name!r} is not in the file {path}")
                tensor = f.get_tensor(name)
                target = self._params[name] if name in self._params else self._expert_slots[name]()
                if tuple(tensor.shape) != tuple(target.shape):
                    raise WeightUpdateError(
                        f"{name}: the file holds shape {list(tensor.shape)}, the model expects {list(target.shape)}"
                    )
                if shapes is not None and list(shapes[i]) != list(tensor.shape):
                    raise WeightUpdateError(
                        f"update_info.shapes[{i}]={shapes[i]} for {name!r} but the file holds {list(tensor.shape)}"
                    )
                if dtype_names is not None and dtype_names[i] != dtype_name(tensor.dtype):
                    raise WeightUpdateError(
                        f"update_info.dtype_names[{i}]={dtype_names[i]!r} for {name!r} but the file holds "
                        f"{dtype_name(tensor.dtype)}"
                    )
                staged.append((target, tensor))
        with torch.no_grad():
            for target, tensor in staged:
                target.data.copy_(tensor.to(dtype=target.dtype, device=target.device))
        return len(staged)

    # ------------------------------------------------------------------ LoRA
    def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Load the PEFT LoRA adapter in folder ``path`` under ``name``.

        Raises:
            AdapterError: LoRA disabled, name taken (unless ``replace``), too many adapters, rank
                above ``max_lora_rank``, or an unreadable adapter.
        """
        if not self.enable_lora:
            raise AdapterError("LoRA is not enabled on this server; start it with --enable-lora")
        if name in self.adapters and not replace:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        if name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise AdapterError(
                f"cannot load adapter '{name}': {len(self.adapters)} adapters are loaded and --max-loras is "
                f"{self.max_loras}; unload one or raise --max-loras"
            )
        config_file = Path(path) / "adapter_config.json"
        if not config_file.is_file():
            raise AdapterError(f"lora_path={path!r} has no adapter_config.json")
        config = json.loads(config_file.read_text())
        rank = int(config.get("r", 0))
        if rank > self.max_lora_rank:
            raise AdapterError(
                f"adapter '{name}' has rank {rank} above --max-lora-rank {self.max_lora_rank}; restart with a larger rank"
            )
        from peft import PeftModel

        if name in self.adapters:
            self._drop_adapter(name)
        try:
            if not isinstance(self.model, PeftModel):
                self.model = PeftModel.from_pretrained(self.base_model, path, adapter_name=name, is_trainable=False)
            else:
                self.model.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # peft/safetensors errors carry the reason
            raise AdapterError(f"cannot load adapter '{name}' from {path}: {exc}") from exc
        self.model.eval()
        self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        """Remove adapter ``name``; the last removal restores the plain base model.

        Raises:
            AdapterError: no adapter of that name.
        """
        if name not in self.adapters:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.")
        self._drop_adapter(name)

    def _drop_adapter(self, name: str) -> None:
        del self.adapters[name]
        if self.adapters:
            self.model.delete_adapter(name)
        else:
            self.model = self.model.unload()
            self.model.eval()
