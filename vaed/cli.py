"""`vaed` command line: serve, decode, info, health, bench."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys

from . import __version__
from .config import DEFAULT_MODEL, DEFAULT_PORT, ServerConfig

log = logging.getLogger("vaed")

# Subcommands implemented elsewhere: name -> (module, add-arguments fn, run fn, help)
_DELEGATED = {
    "decode": ("vaed.decode_command", "add_arguments", "run", "decode a latents file through a server to .mp4 or PNGs"),
    "info": ("vaed.decode_command", "add_info_arguments", "run_info", "print a server's model info"),
    "health": ("vaed.health_check", "add_arguments", "run", "ask a server's grpc.health.v1 status (exit 0 if SERVING)"),
    "bench": ("vaed.bench", "add_arguments", "run", "benchmark stock diffusers against vaed's decode path"),
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", type=int, metavar="N", help="serve on CUDA device N (default: 0 when CUDA is available)")
    where.add_argument("--device", choices=["cpu"], help="serve on the CPU (slow; for tests and development)")
    parser.add_argument("--host", default=defaults.host, help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind; 0 picks a free one (default %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="local diffusers folder (repo root or its vae/), hub id (subfolder vae), or "
                             "random:wan2.1 / random:wan2.2[?seed=N] (default %(default)s)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions,
                        help="concurrent decode calls; more get RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch, help="largest B of one call (default %(default)s)")
    parser.add_argument("--max-latent-frames", type=int, default=defaults.max_latent_frames,
                        help="largest T (latent frames) of one call or session; 0 = no limit (default %(default)s)")
    parser.add_argument("--max-pixels", type=int, default=defaults.max_pixels,
                        help="largest output H*W of one frame; 0 = no limit (default %(default)s = 1280x1280)")
    parser.add_argument("--queue-chunks", type=int, default=defaults.queue_chunks,
                        help="decoded chunks buffered per call before the decode waits for the client (default %(default)s)")
    parser.add_argument("--grace", type=float, default=defaults.grace,
                        help="seconds SIGTERM lets in-flight streams finish (default %(default)s)")
    parser.add_argument("--kernels", choices=["auto", "triton", "off"], default=defaults.kernels,
                        help="fused bit-exact Triton data movement: auto (when eligible), triton (required), off")
    parser.add_argument("--layout", choices=["auto", "channels_last", "contiguous"], default=defaults.layout,
                        help="decoder memory layout: auto = channels_last_3d on CUDA, contiguous on CPU")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="report SERVING without a warm-up decode")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    parser.add_argument("--tls-key", help="PEM private key for --tls-cert")
    parser.add_argument("--auth-token-file", help="require 'authorization: Bearer <token>' on every RPC but health; "
                        "without this flag the token is read from $VAED_AUTH_TOKEN when set")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    import torch

    if args.device == "cpu":
        device = "cpu"
    elif args.gpu is not None:
        device = f"cuda:{args.gpu}"
    else:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"vaed serve: {device} requested but CUDA is not available; use --device cpu")
    return ServerConfig(
        model=args.model, device=device, dtype=args.dtype, host=args.host, port=args.port,
        max_sessions=args.max_sessions, max_batch=args.max_batch, max_latent_frames=args.max_latent_frames,
        max_pixels=args.max_pixels, queue_chunks=args.queue_chunks, grace=args.grace, kernels=args.kernels,
        layout=args.layout, warmup=args.warmup, metrics_port=args.metrics_port, tls_cert=args.tls_cert,
        tls_key=args.tls_key, auth_token_file=args.auth_token_file,
    )


def run_serve(args: argparse.Namespace) -> int:
    from .server import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    return asyncio.run(serve(config))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; a delegated command's module is imported only when that
    command is the one asked for (or `command` is None), so `vaed serve` and
    `vaed health` never import PyAV or the benchmark code."""
    parser = argparse.ArgumentParser(prog="vaed", description="Remote Wan video VAE decoding over gRPC.")
    parser.add_argument("--version", action="version", version=f"vaed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a Wan VAE over gRPC")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    for name, (module_name, add_fn, run_fn, help_text) in _DELEGATED.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if command in (None, name):
            module = importlib.import_module(module_name)
            getattr(module, add_fn)(sub_parser)
            sub_parser.set_defaults(func=getattr(module, run_fn))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in _DELEGATED or command == "serve" else None).parse_args(argv)
    if args.command != "serve":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
