"""HTTP routes of the embedded sampler: the subset of vLLM 0.26's protocol the project uses (DESIGN §5).

Routes (JSON shapes as vLLM 0.26 answers them, see VLLM.md):

- reading: ``GET /health``, ``/version`` (``{"version", "server": "asyncgrpo-embedded"}``),
  ``/v1/models``, ``/metrics`` (Prometheus text, vLLM's names), ``/server_info?config_format=json``,
  ``/is_paused``, ``/get_world_size``, ``/weight_info``;
- generation: ``POST /v1/completions`` (token-id prompt; ``"token_id:N"`` top-log-prob keys with
  ``return_tokens_as_token_ids``) and ``POST /inference/v1/generate`` (tokens in/out; 0.26 log-prob
  shape plus 0.28's ``sampling_mask``);
- weight sync: ``POST /pause?mode=keep|abort|wait``, ``/resume``, ``/start_weight_update``,
  ``/update_weights`` (``update_info.path``: a safetensors file holding the tensors of ``names``, inside the
  server's weights folder: ``--weights-dir``, the run's ``<output_dir>/.weights``, else a private temporary
  folder; ``/server_info`` names it, and any other path is answered 400),
  ``/finish_weight_update``, ``/reset_prefix_cache``; ``/init_weight_transfer_engine`` answers 400
  (no NCCL here);
- LoRA: ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; a request picks an adapter with
  ``model=<lora_name>``.

Errors use vLLM's body ``{"error": {"message", "type", "param", "code"}}``. Like vLLM, the server has
no authentication: bind it to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from .engine import Engine, EngineError, EngineRequest, Scheduler
from .runner import AdapterError, ModelRunner, WeightUpdateError, dtype_name
from .requests import BadRequest, error_response, _integer, _token_ids, parse_sampling
from .sampling import finite_logprob

log = logging.getLogger(__name__)

SERVER_NAME = "asyncgrpo-embedded"
MAX_N = 64  # most completions per prompt of one /v1/completions request (``n``)


def package_version() -> str:
    """The installed asyncgrpo version, ``"0.0.0"`` when the package metadata is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncgrpo")
    except PackageNotFoundError:
        return "0.0.0"


@dataclass
class ServerConfig:
    """Settings of one embedded server (the command-line flags of ``python -m ...embedded``).

    Attributes:
        model: model folder (or hub id already cached) loaded with transformers.
        gguf_file: GGUF file inside ``model`` to load from, if any.
        served_model_name: the name requests use in ``model``; default ``model``.
        host / port: where to listen (port 0 = any free port).
        max_model_len: prompt + output limit in tokens; default the model's ``max_position_embeddings``.
        max_logprobs: most top log-probs a request may ask for.
        dtype / device: ``auto``, ``float32``, ``bfloat16``, ``float16`` / ``auto``, ``cpu``, ``cuda[:N]``.
        kv_cache_tokens: KV capacity in tokens; default ``16 × max_model_len``. Must be >= max_model_len.
        max_num_seqs: most requests running at once.
        block_size: KV block size in tokens (accounting unit of the usage metric).
        enable_lora / max_lora_rank / max_loras: runtime LoRA adapters.
        return_sampling_mask: answer ``sampling_mask`` on ``/inference/v1/generate`` (like vLLM's
            ``--return-sampling-mask``).
        seed: seeds requests that carry no ``seed``.
        weights_dir: the only folder ``/update_weights`` reads files from (the run's ``<output_dir>/.weights``);
            None = a private temporary folder, made at start and removed at stop.
    """

    model: str
    gguf_file: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None
    max_logprobs: int = 20
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64
    block_size: int = 16
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    return_sampling_mask: bool = True
    seed: int = 0
    weights_dir: str | None = None


class EmbeddedServer:
    """The embedded sampler: model runner + engine + aiohttp routes.

    Args:
        config: `ServerConfig`.
        runner: a ready `ModelRunner` (tests); default: load ``config.model``.
        tokenizer: a tokenizer for text fields (``text``, string prompts); default: load it from
            ``config.model`` (none if that fails: text fields are then empty).

    Raises:
        ValueError: ``max_model_len`` above the model's positions or above ``kv_cache_tokens``.
    """

    def __init__(self, config: ServerConfig, runner: ModelRunner | None = None, tokenizer: Any = None) -> None:
        self.config = config
        self.runner = runner or ModelRunner.load(
            config.model,
            gguf_file=config.gguf_file,
            dtype=config.dtype,
            device=config.device,
            seed=config.seed,
            enable_lora=config.enable_lora,
            max_lora_rank=config.max_lora_rank,
            max_loras=config.max_loras,
        )
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config)
        model_config = self.runner.base_model.config
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        positions = getattr(text_config, "max_position_embeddings", None)
        self.max_model_len = int(config.max_model_len or positions or 2048)
        if positions is not None and self.max_model_len > positions:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings {positions}; "
                "lower --max-model-len"
            )
        kv_tokens = int(config.kv_cache_tokens or 16 * self.max_model_len)
        num_blocks = kv_tokens // config.block_size
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"--kv-cache-tokens {kv_tokens} holds fewer tokens than --max-model-len {self.max_model_len}; "
                "raise --kv-cache-tokens or lower --max-model-len"
            )
        self.served_model_name = config.served_model_name or config.model
        self.scheduler = Scheduler(num_blocks, config.block_size, config.max_num_seqs)
        self.engine = Engine(self.runner, self.scheduler, self.runner.eos_token_ids(self.tokenizer))
        self.adapters: dict[str, str] = {}  # served LoRA names -> paths
        self._temporary_weights_dir = not config.weights_dir  # made by start(), removed by stop()
        self.weights_dir: Path | None = Path(config.weights_dir).expanduser().resolve() if config.weights_dir else None
        self.weight_version: str | None = None
        self.weight_updates = 0
        self._updating = False
        self._registry = _build_registry(self)
        self._app_runner: web.AppRunner | None = None
        self.port: int | None = None
        self.created = int(time.time())

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Start the engine and listen; returns the bound port."""
        if self.weights_dir is None:  # removed by stop(), or at exit for a server never stopped (a test's)
            self.weights_dir = Path(tempfile.mkdtemp(prefix="asyncgrpo-weights-")).resolve()
            self._remove_weights_dir = weakref.finalize(self, shutil.rmtree, str(self.weights_dir), True)
        await self.engine.start()
        app = self.build_app()
        self._app_runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._app_runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._app_runner, sock)
        await site.start()
        return self.port

    async def stop(self) -> None:
        """Stop listening, abort requests and stop the engine."""
        await self.engine.close()
        if self._app_runner is not None:
            await self._app_runner.cleanup()
        if self._temporary_weights_dir and self.weights_dir is not None:
            self._remove_weights_dir()
            self.weights_dir = None

    def build_app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(client_max_size=64 * 1024**2)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_get("/server_info", self.server_info)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/inference/v1/generate", self.generate)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_get("/get_world_size", self.get_world_size)
        r.add_post("/init_weight_transfer_engine", self.init_weight_transfer_engine)
        r.add_post("/start_weight_update", self.start_weight_update)
        r.add_post("/update_weights", self.update_weights)
        r.add_post("/finish_weight_update", self.finish_weight_update)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        return app

    # ------------------------------------------------------------------ helpers
    async def _json(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise BadRequest("Invalid JSON body") from None
        if not isinstance(body, dict):
            raise BadRequest("the JSON body must be an object")
        return body

    def _adapter_for(self, model: Any) -> str | None:
        if model is None or model == self.served_model_name:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise BadRequest(f"The model `{model}` does not exist.", status=404, param="model")

    def _token_str(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.convert_ids_to_tokens(int(token_id)) or ""

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _prompts(self, prompt: Any) -> list[list[int]]:
        vocab = self.runner.vocab_size
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if self.tokenizer is None:
                raise BadRequest("text prompts need a tokenizer; send token ids", param="prompt")
            return [_token_ids(self.tokenizer(p)["input_ids"], "prompt", vocab) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [_token_ids(p, "prompt", vocab) for p in prompt]
        return [_token_ids(prompt, "prompt", vocab)]

    async def _run_requests(self, requests: list[EngineRequest]) -> None:
        try:
            await asyncio.gather(*(self.engine.generate(r) for r in requests))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        except EngineError as exc:
            raise BadRequest(f"generation failed: {exc}", status=500) from None

    # ------------------------------------------------------------------ reading routes
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": package_version(), "server": SERVER_NAME})

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": self.served_model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "asyncgrpo",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [],
            }
        ]
        for name, path in self.adapters.items():
            data.append(
                {"id": name, "object": "model", "created": self.created, "owned_by": "asyncgrpo", "root": path,
                 "parent": self.served_model_name, "max_model_len": self.max_model_len, "permission": []}
            )
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.config
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and not _secret(k)}
        config = {  # vLLM's answer shape: {"vllm_config": {...}, "vllm_env": {...}, "system_env": {...}}
            "server": SERVER_NAME,
            "version": package_version(),
            "model_config": {
                "model": c.model,
                "served_model_name": self.served_model_name,
                "max_model_len": self.max_model_len,
                "max_logprobs": c.max_logprobs,
                "logprobs_mode": "processed_logprobs",
                "return_sampling_mask": c.return_sampling_mask,
                "dtype": dtype_name(self.runner.dtype),
                "gguf_file": c.gguf_file,
            },
            "lora_config": {"max_loras": c.max_loras, "max_lora_rank": c.max_lora_rank} if c.enable_lora else None,
            "cache_config": {
                "block_size": self.scheduler.block_size,
                "num_gpu_blocks": self.scheduler.num_blocks,
                "kv_cache_size_tokens": self.scheduler.capacity_tokens,
            },
            "scheduler_config": {"max_num_seqs": self.scheduler.max_num_seqs},
            "parallel_config": {
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "data_parallel_size": 1,
                "world_size": 1,
            },
            "device_config": {"device": self.runner.device},
            "weight_transfer_config": {"backend": "file", "weights_dir": str(self.weights_dir)},
            "api_server_count": 1,
            "embedded": {"batched": self.runner.batched, "config": asdict(c)},
        }
        return web.json_response({"vllm_config": config, "vllm_env": env, "system_env": {}})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused})

    async def get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if body.get("stream"):
                raise BadRequest("stream=true is not supported by the embedded sampler", param="stream")
            if body.get("echo"):
                raise BadRequest("echo=true is not supported by the embedded sampler", param="echo")
            n = _integer(body, "n", 1)
            if n is None or not 1 <= n <= MAX_N:
                raise BadRequest(f"n={n} must be between 1 and {MAX_N} completions per prompt", param="n")
            if "prompt" not in body:
                raise BadRequest("prompt is required", param="prompt")
            adapter = self._adapter_for(body.get("model"))
            prompts = self._prompts(body["prompt"])
            requests = []
            for prompt in prompts:
                opts = parse_sampling(
                    body,
                    prompt_len=len(prompt),
                    max_model_len=self.max_model_len,
                    max_logprobs=self.config.max_logprobs,
                    default_max_tokens=16,
                    strict_length=True,
                    want_mask=False,
                )
                for i in range(n):  # like vLLM's parallel sampling: completion i of a seeded request uses seed + i
                    child = opts if i == 0 or opts.seed is None else dataclasses.replace(opts, seed=opts.seed + i)
                    requests.append(EngineRequest(f"cmpl-{uuid.uuid4().hex}", prompt, child, adapter,
                                                  self.max_model_len))
            await self._run_requests(requests)
        except BadRequest as exc:
            return error_response(exc.message, exc.status, exc.param)
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        with_ids = bool(body.get("return_token_ids", False))
        choices = []
        for index, req in enumerate(requests):
            choice: dict[str, Any] = {
                "index": index,
                "text": self._decode(req.output_ids),
                "logprobs": self._completion_logprobs(req, as_ids) if req.options.logprobs is not None else None,
                "finish_reason": req.finish_reason,
                "stop_reason": req.stop_reason,
                "prompt_logprobs": None,
            }
            if with_ids:
                choice["token_ids"] = list(req.output_ids)
                choice["prompt_token_ids"] = list(req.prompt_ids)
            choices.append(choice)
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        completion_tokens = sum(len(r.output_ids) for r in requests)
        return web.json_response(
            {
                "id": requests[0].request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or self.served_model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    def _completion_logprobs(self, req: EngineRequest, as_ids: bool) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for i, tok in enumerate(req.output_ids):
            tokens.append(self._token_str(tok, as_ids))
            lp = finite_logprob(req.output_logprobs[i])
            token_logprobs.append(lp)
            entry = {self._token_str(t, as_ids): finite_logprob(v) for t, v in zip(req.top_ids[i], req.top_logprobs[i])}
            if tok not in req.top_ids[i]:  # like vLLM: the sampled token is always listed
                entry[self._token_str(tok, as_ids)] = lp
            top.append(entry)
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if body.get("stream"):
                raise BadRequest("stream=true is not supported by the embedded sampler", param="stream")
            prompt = _token_ids(body.get("token_ids"), "token_ids", self.runner.vocab_size)
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise BadRequest("sampling_params must be an object", param="sampling_params")
            n = _integer(params, "n", 1) or 1
            if not 1 <= n <= MAX_N:
                raise BadRequest(f"sampling_params.n={n} must be between 1 and {MAX_N}", param="n")
            adapter = self._adapter_for(body.get("model"))
            opts = parse_sampling(
                params,
                prompt_len=len(prompt),
                max_model_len=self.max_model_len,
                max_logprobs=self.config.max_logprobs,
                default_max_tokens=max(self.max_model_len - len(prompt), 1),
                strict_length=False,
                want_mask=self.config.return_sampling_mask,
            )
            rid = str(body.get("request_id") or uuid.uuid4().hex)
            reqs = [EngineRequest(f"generate-tokens-{rid}-{i}", prompt, opts if i == 0 or opts.seed is None else
                                  dataclasses.replace(opts, seed=opts.seed + i), adapter, self.max_model_len)
                    for i in range(n)]  # n completions, completion i seeded with seed + i (as vLLM)
            await self._run_requests(reqs)
        except BadRequest as exc:
            return error_response(exc.message, exc.status, exc.param)
        choices = [self._generate_choice(index, req, opts.logprobs is not None) for index, req in enumerate(reqs)]
        return web.json_response(
            {"request_id": reqs[0].request_id, "choices": choices, "prompt_logprobs": None, "kv_transfer_params": None}
        )

    def _generate_choice(self, index: int, req: EngineRequest, with_logprobs: bool) -> dict[str, Any]:
        logprobs = None
        if with_logprobs:
            content = []
            for i, tok in enumerate(req.output_ids):
                content.append(
                    {
                        "token": f"token_id:{tok}",
                        "logprob": finite_logprob(req.output_logprobs[i]),
                        "bytes": None,
                        "top_logprobs": [
                            {"token": f"token_id:{t}", "logprob": finite_logprob(v), "bytes": None}
                            for t, v in zip(req.top_ids[i], req.top_logprobs[i])
                        ],
                    }
                )
            logprobs = {"content": content}
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": req.finish_reason,
            "token_ids": list(req.output_ids),
        }
        if req.sampling_masks and all(m is not None for m in req.sampling_masks):
            choice["sampling_mask"] = [list(m) for m in req.sampling_masks]
        return choice

    # ------------------------------------------------------------------ weight sync
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("keep", "abort", "wait"):
            return error_response(f"mode={mode!r} is not one of keep, abort, wait", param="mode")
        await self.engine.pause(mode)
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"status": "resumed"})

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        return error_response(
            "the embedded sampler has no NCCL weight transfer; send update_info with a safetensors 'path' "
            "to /update_weights instead (weight_transfer_config.backend is 'file')"
        )

    async def start_weight_update(self, request: web.Request) -> web.Response:
        self._updating = True
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            info = body.get("update_info")
            if not isinstance(info, dict):
                raise BadRequest("Missing 'update_info' in request body", param="update_info")
            names = info.get("names")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise BadRequest("update_info.names must be a list of parameter names", param="names")
            path = info.get("path")
            if not isinstance(path, str) or not path:
                raise BadRequest(
                    "update_info.path is required by the embedded sampler: a safetensors file holding the tensors "
                    "named in update_info.names",
                    param="path",
                )
            self._check_weights_path(path)
            count = await self.engine.exclusive(
                self.runner.update_weights_from_file, path, names, info.get("dtype_names"), info.get("shapes")
            )
        except BadRequest as exc:
            return error_response(exc.message, exc.status, exc.param)
        except WeightUpdateError as exc:
            return error_response(str(exc))
        self.weight_updates += 1
        return web.json_response({"message": "Weights updated", "num_tensors": count})

    def _check_weights_path(self, path: str) -> None:
        """``path`` (symlinks followed) lies inside `weights_dir`: the server reads no other file.

        Raises:
            BadRequest: 400 naming the path, the folder and the fix.
        """
        resolved = Path(path).expanduser().resolve()
        if resolved == self.weights_dir or not resolved.is_relative_to(self.weights_dir):
            raise BadRequest(f"update_info.path={path!r} is outside this server's weights folder {self.weights_dir}: "
                             "it reads weight files from that folder only (--weights-dir, the run's "
                             f"<output_dir>/.weights). Fix: write the safetensors file inside {self.weights_dir}",
                             param="path")

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
        except BadRequest as exc:
            return error_response(exc.message, exc.status, exc.param)
        version = body.get("weight_version")
        if version is not None:
            self.weight_version = str(version)
        self._updating = False
        return web.json_response({"message": "Weight update finished"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        reset_running = request.query.get("reset_running_requests", "false").lower() in ("1", "true", "yes")
        if reset_running:
            await self.engine.preempt_running()
            return web.json_response({"success": True})
        # no prefix sharing here: the reset only fails, as in vLLM, while running requests hold KV blocks
        held = any(r.has_kv for r in self.scheduler.running)
        return web.json_response({"success": not held})

    # ------------------------------------------------------------------ LoRA
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.")
            if name == self.served_model_name:
                raise BadRequest(f"lora_name {name!r} is the base model's name; pick another", param="lora_name")
            replace = bool(body.get("load_inplace", False))
            if name in self.adapters and not replace:
                raise BadRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            if name not in self.adapters and self.engine.adapter_in_use(name):
                raise BadRequest(f"adapter '{name}' is still finishing requests after an unload; use a new name")
            await self.engine.exclusive(self.runner.load_adapter, name, path, replace)
        except BadRequest as exc:
            return error_response(exc.message, exc.status, exc.param)
        except AdapterError as exc:
            return error_response(str(exc))
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            name = body.get("lora_name")
            if not isinstance(name, str) or name not in self.adapters:
                raise BadRequest(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name")
        except BadRequest as exc:
            return error_response(exc.message, exc.status, exc.param)
        del self.adapters[name]
        await self.engine.release_adapter(name, self.runner.unload_adapter)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))


def _load_tokenizer(config: ServerConfig) -> Any:
    try:
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": config.gguf_file} if config.gguf_file else {}
        return AutoTokenizer.from_pretrained(config.model, **kwargs)
    except Exception as exc:  # text fields stay empty; token ids are all the project uses
        log.warning("embedded sampler: no tokenizer for %s (%s); text fields will be empty", config.model, exc)
        return None


# ---------------------------------------------------------------------------------------------- metrics
class _EngineCollector:
    """Prometheus collector reading the engine at scrape time (vLLM's metric names and labels)."""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.server
        st = s.engine.stats()
        labels = ["model_name", "engine"]
        values = [s.served_model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", st.num_requests_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission.", st.num_requests_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.", st.kv_cache_usage)
        counter = CounterMetricFamily("vllm:num_preemptions", "Preemptions since start.", labels=labels)
        counter.add_metric(values, st.num_preemptions)
        yield counter
        info_labels = ["block_size", "num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency"] + labels
        info = GaugeMetricFamily("vllm:cache_config_info", "Cache configuration.", labels=info_labels)
        info.add_metric(
            [
                str(st.block_size),
                str(st.num_gpu_blocks),
                str(st.kv_cache_size_tokens),
                str(st.kv_cache_size_tokens / s.max_model_len),
                *values,
            ],
            1.0,
        )
        yield info
        if s.config.enable_lora:
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running and waiting LoRA adapters.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [str(s.config.max_loras), ",".join(st.waiting_adapters), ",".join(st.running_adapters)], time.time()
            )
            yield lora


def _build_registry(server: EmbeddedServer):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(server))
    return registry


# ---------------------------------------------------------------------------------------------- threads
class ServerThread:
    """An `EmbeddedServer` on its own event loop in a background thread (tests, notebooks).

    Example::

        handle = ServerThread(ServerConfig(model=path, port=0, device="cpu")).start()
        ... handle.url ...
        handle.stop()
    """

    def __init__(self, config: ServerConfig, runner: ModelRunner | None = None, tokenizer: Any = None) -> None:
        self.config = config
        self._runner = runner
        self._tokenizer = tokenizer
        self.server: EmbeddedServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        assert self.server is not None
        return self.server.url

    def start(self, timeout_s: float = 120.0) -> "ServerThread":
        """Load the model, start serving, and return once it listens.

        Raises:
            RuntimeError: it failed to start (the cause is chained) or took longer than ``timeout_s``.
        """
        self._thread = threading.Thread(target=self._main, name="embedded-sampler", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"embedded sampler did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"embedded sampler failed to start: {self._error}") from self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self.server = EmbeddedServer(self.config, self._runner, self._tokenizer)
            loop.run_until_complete(self.server.start())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self.server.stop())
            loop.close()

    def call(self, coro_fn, *args, timeout_s: float = 60.0):
        """Run ``await coro_fn(*args)`` on the server's loop from another thread; returns its result."""
        fut = asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop)
        return fut.result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving and join the thread."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout_s)
