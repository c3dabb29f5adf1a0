"""``python -m asyncgrpo_cli.sampler.embedded --model DIR ...``: run the embedded sampler until SIGINT/SIGTERM.

Once listening it prints one line ``asyncgrpo-embedded: serving NAME at http://HOST:PORT`` on stdout
(useful with ``--port 0``). Flags mirror vLLM's where they exist.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .server import EmbeddedServer, ServerConfig


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (flag names follow ``vllm serve``)."""
    p = argparse.ArgumentParser(
        prog="python -m asyncgrpo_cli.sampler.embedded",
        description="Embedded sampler: a vLLM-protocol server over a transformers model (CPU or one GPU).",
        allow_abbrev=False,  # ``--ho 0.0.0.0`` must not stand for ``--host``
    )
    p.add_argument("--model", required=True, help="model folder (or a hub id already in the local cache)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model to load")
    p.add_argument("--served-model-name", default=None, help="name requests use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed on start)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit in tokens")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity in tokens (default 16 x max-model-len)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--return-sampling-mask", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--logprobs-mode", default="processed_logprobs", choices=["processed_logprobs"])
    p.add_argument("--seed", type=int, default=0, help="seeds requests sent without a seed")
    p.add_argument("--weights-dir", default=None, help="the only folder /update_weights reads files from (the run's "
                   "<output_dir>/.weights; default: a private temporary folder, named in /server_info)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed flags into a `ServerConfig`."""
    return ServerConfig(
        model=args.model,
        gguf_file=args.gguf_file,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        dtype=args.dtype,
        device=args.device,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        return_sampling_mask=args.return_sampling_mask,
        seed=args.seed,
        weights_dir=args.weights_dir,
    )


async def serve(config: ServerConfig) -> None:
    """Load, listen, announce the URL, and serve until SIGINT or SIGTERM."""
    server = EmbeddedServer(config)
    await server.start()
    print(f"asyncgrpo-embedded: serving {server.served_model_name} at {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a configuration error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ...config.models import quiet_progress_bars_without_terminal

    quiet_progress_bars_without_terminal()  # logs/server.log: no raw 'Loading weights' bars
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except (ValueError, OSError) as exc:
        print(f"asyncgrpo-embedded: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    from ...run.process_exit import exit_now

    exit_now(main())
