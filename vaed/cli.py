"""`vaed` command line: serve, decode, info, health, bench."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys

from . import __version__
from .config import CUDA_GRAPH_CHOICES, DEFAULT_MODEL, DEFAULT_PORT, PRECISIONS, ServerConfig

log = logging.getLogger("vaed")

# Subcommands implemented elsewhere: name -> (module, add-arguments fn, run fn, help)
_DELEGATED = {
    # The client commands live in the client package (`vaed-client` has the same ones).
    "decode": ("vaed_client.cli", "add_decode_arguments", "run_decode",
               "decode a latents file through a server to .mp4, .mkv (lossless) or PNGs"),
    "info": ("vaed_client.cli", "add_info_arguments", "run_info", "print a server's model info"),
    "health": ("vaed_client.cli", "add_health_arguments", "run_health",
               "ask a server's grpc.health.v1 status (exit 0 if SERVING)"),
    "bench": ("vaed.bench", "add_arguments", "run", "benchmark stock diffusers against vaed's decode path"),
}


def _devices(text: str) -> tuple[str, ...]:
    """--gpu 0 | 0,1 | all -> ("cuda:0", ...)."""
    import torch

    if text == "all":
        count = torch.cuda.device_count()
        if count == 0:
            raise SystemExit("vaed serve: --gpu all requested but CUDA is not available; use --device cpu")
        return tuple(f"cuda:{i}" for i in range(count))
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"vaed serve: --gpu takes N, N,M,... or all; got {text!r}") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise SystemExit(f"vaed serve: --gpu needs distinct device numbers; got {text!r}")
    return tuple(f"cuda:{i}" for i in ids)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0 = no limit); got {text!r}")
    return value


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """--warmup-shapes 480x832,720x1280 | none -> ((480, 832), (720, 1280))."""
    if text.strip().lower() == "none":
        return ()
    shapes = []
    for part in text.split(","):
        h, sep, w = part.strip().lower().partition("x")
        if not sep or not h.isdigit() or not w.isdigit() or int(h) < 1 or int(w) < 1:
            raise argparse.ArgumentTypeError(f"warm-up shapes look like 480x832,720x1280 (H x W) or none; got {part!r}")
        shapes.append((int(h), int(w)))
    return tuple(shapes)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from .patches import OP_NAMES

    defaults = ServerConfig()
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", metavar="N[,M...]|all",
                       help="serve on these CUDA devices, one worker each behind one port (default: 0 when CUDA is available)")
    where.add_argument("--device", choices=["cpu"], help="serve on the CPU (slow; for tests and development)")
    parser.add_argument("--host", default=defaults.host, help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind; 0 picks a free one (default %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="local diffusers folder (repo root or its vae/), hub id (subfolder vae), or "
                             "random:wan2.1 / random:wan2.2[?seed=N] (real architectures, seeded random weights) or "
                             "random:wan2.1-tiny / random:wan2.2-tiny (a few channels, for CPU development) "
                             "(default %(default)s)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--precision", choices=PRECISIONS, default=defaults.precision,
                        help="tier of requests that do not ask for one; a request may always ask for lossless "
                             "(default %(default)s)")
    parser.add_argument("--parallel", choices=["off", "spatial"], default=defaults.parallel,
                        help="spatial: a large request is decoded by all --gpu devices together (default %(default)s)")
    parser.add_argument("--spatial-axis", choices=["auto", "height", "width"], default=defaults.spatial_axis,
                        help="axis split by --parallel spatial; auto = the longer one (default %(default)s)")
    parser.add_argument("--spatial-min-pixels", type=int, default=defaults.spatial_min_pixels,
                        help="--parallel spatial shards output frames of at least this many pixels; smaller "
                             "ones decode on the first GPU (default %(default)s = 480x832)")
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions,
                        help="concurrent decode calls; more get RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--max-concurrent-rpcs", type=int, default=None,
                        help="concurrent RPCs of any kind but health; more get RESOURCE_EXHAUSTED unread "
                             "(default 2 x --max-sessions + 8)")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch, help="largest B of one call (default %(default)s)")
    parser.add_argument("--max-latent-frames", type=int, default=defaults.max_latent_frames,
                        help="largest T (latent frames) of one call or session; 0 = no limit (default %(default)s)")
    parser.add_argument("--max-pixels", type=int, default=defaults.max_pixels,
                        help="largest output H*W of one frame; 0 = no limit (default %(default)s = 1280x1280)")
    parser.add_argument("--queue-chunks", type=int, default=defaults.queue_chunks,
                        help="decoded chunks buffered per call before its decode waits for the client (default %(default)s)")
    parser.add_argument("--max-backlog-frames", type=int, default=defaults.max_backlog_frames,
                        help="latent frames a DecodeStream session buffers before the server stops reading "
                             "its client (default %(default)s)")
    parser.add_argument("--session-first-message-timeout", type=_seconds, metavar="SECONDS",
                        default=defaults.session_first_message_timeout,
                        help="seconds a Decode or DecodeStream call may wait for its first message; then it ends "
                             "DEADLINE_EXCEEDED and frees its session slot; 0 = no limit (default %(default)s)")
    parser.add_argument("--session-idle-timeout", type=_seconds, metavar="SECONDS",
                        default=defaults.session_idle_timeout,
                        help="seconds a DecodeStream session may wait for its next message once everything it "
                             "sent is decoded and sent back; then it ends DEADLINE_EXCEEDED and frees its "
                             "slot; 0 = no limit (default %(default)s)")
    parser.add_argument("--grace", type=float, default=defaults.grace,
                        help="seconds SIGTERM lets in-flight streams finish; a second SIGTERM exits at once "
                             "(default %(default)s)")
    parser.add_argument("--kernels", choices=["auto", "triton", "off"], default=defaults.kernels,
                        help="fused bit-exact Triton data movement: auto (when eligible), triton (required), off "
                             "(default %(default)s)")
    parser.add_argument("--disable-op", dest="disabled_ops", action="append", default=[], choices=sorted(OP_NAMES),
                        help="switch one fused op off (repeatable); the stock aten chain runs in its place")
    parser.add_argument("--layout", choices=["auto", "channels_last", "contiguous"], default=defaults.layout,
                        help="decoder memory layout: auto = channels_last_3d on CUDA, contiguous on CPU "
                             "(default %(default)s)")
    parser.add_argument("--cuda-graphs", choices=list(CUDA_GRAPH_CHOICES), default=defaults.cuda_graphs,
                        help="replay each decoder call signature from a captured CUDA graph (bit-identical; "
                             "more GPU memory for the graphs' buffers) (default %(default)s)")
    parser.add_argument("--cpu-threads", type=_positive_int, default=defaults.cpu_threads, metavar="N",
                        help="threads of torch's CPU ops in this process (default: 1 with --gpu, whose CPU work "
                             "is small and was slowed by waking a pool per op; with --device cpu 1 for the -tiny "
                             "models, up to 10x faster on a busy machine, and torch's default, one per core, for "
                             "the full-size ones)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="report SERVING without warm-up decodes")
    parser.add_argument("--warmup-shapes", type=_shapes, default=None, metavar="HxW[,HxW...]|none",
                        help="output sizes decoded up to their steady chunk before SERVING "
                             "(default: 480x832,720x1280 for Wan2.1, 704x1280 for Wan2.2 on CUDA; a small one on CPU)")
    parser.add_argument("--keepalive-time", type=float, default=defaults.keepalive_time,
                        help="seconds between server pings on an idle connection (default %(default)s)")
    parser.add_argument("--keepalive-timeout", type=float, default=defaults.keepalive_timeout,
                        help="seconds a ping may go unanswered before the connection is dropped (default %(default)s)")
    parser.add_argument("--min-ping-interval", type=float, default=defaults.min_ping_interval,
                        help="shortest client ping interval allowed, in seconds (default %(default)s)")
    parser.add_argument("--max-connection-age", type=float, default=defaults.max_connection_age,
                        help="seconds after which a connection is closed so clients re-resolve DNS and reach "
                             "new replicas; 0 = never (default %(default)s)")
    parser.add_argument("--max-connection-age-grace", type=float, default=defaults.max_connection_age_grace,
                        help="seconds in-flight calls get after --max-connection-age (default %(default)s)")
    parser.add_argument("--handshake-timeout", type=float, default=defaults.handshake_timeout, metavar="SECONDS",
                        help="seconds a new connection may take to send the HTTP/2 preface (and TLS handshake) "
                             "before it is closed (default %(default)s)")
    parser.add_argument("--max-connections", type=_positive_int, default=defaults.max_connections, metavar="N",
                        help="concurrent connections from all peers; more are closed as they are accepted, and "
                             "it is lowered to leave 256 fds under RLIMIT_NOFILE (default %(default)s)")
    parser.add_argument("--max-streams-per-connection", type=_positive_int, default=None, metavar="N",
                        help="concurrent calls on one connection (HTTP/2 MAX_CONCURRENT_STREAMS); clients queue "
                             "past it, and a connection resetting streams faster gets REFUSED_STREAM "
                             "(default --max-sessions + 16)")
    parser.add_argument("--max-health-calls", type=_positive_int, default=defaults.max_health_calls, metavar="N",
                        help="health requests read at once (they need no token and are at most 4096 bytes); "
                             "more get RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at /metrics on this port")
    parser.add_argument("--metrics-host", help="address the metrics endpoint binds (default: --host)")
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    parser.add_argument("--tls-key", help="PEM private key for --tls-cert")
    parser.add_argument("--auth-token-file", help="require 'authorization: Bearer <token>' on every RPC but health; "
                        "without this flag the token is read from $VAED_AUTH_TOKEN when set")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records written to stderr (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    import torch

    if args.device == "cpu":
        devices: tuple[str, ...] = ("cpu",)
    elif args.gpu is not None:
        devices = _devices(args.gpu)
    else:
        devices = ("cuda:0",) if torch.cuda.is_available() else ("cpu",)
    if devices[0].startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"vaed serve: {devices[0]} requested but CUDA is not available; use --device cpu")
        missing = [d for d in devices if int(d.split(":")[1]) >= torch.cuda.device_count()]
        if missing:
            raise SystemExit(f"vaed serve: {', '.join(missing)} requested but this host has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    if args.parallel == "spatial" and len(devices) < 2:
        raise SystemExit("vaed serve: --parallel spatial needs two or more devices (--gpu 0,1 or --gpu all)")
    return ServerConfig(
        model=args.model, devices=devices, dtype=args.dtype, host=args.host, port=args.port,
        max_sessions=args.max_sessions, max_concurrent_rpcs=args.max_concurrent_rpcs, max_batch=args.max_batch,
        max_latent_frames=args.max_latent_frames, max_pixels=args.max_pixels, queue_chunks=args.queue_chunks,
        max_backlog_frames=args.max_backlog_frames,
        session_first_message_timeout=args.session_first_message_timeout,
        session_idle_timeout=args.session_idle_timeout, grace=args.grace, kernels=args.kernels,
        disabled_ops=tuple(args.disabled_ops), layout=args.layout, cuda_graphs=args.cuda_graphs,
        precision=args.precision, cpu_threads=args.cpu_threads,
        parallel=args.parallel, spatial_axis=args.spatial_axis, spatial_min_pixels=args.spatial_min_pixels, warmup=args.warmup, warmup_shapes=args.warmup_shapes,
        keepalive_time=args.keepalive_time, keepalive_timeout=args.keepalive_timeout,
        min_ping_interval=args.min_ping_interval, max_connection_age=args.max_connection_age,
        max_connection_age_grace=args.max_connection_age_grace, handshake_timeout=args.handshake_timeout,
        max_connections=args.max_connections, max_streams_per_connection=args.max_streams_per_connection,
        max_health_calls=args.max_health_calls, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, tls_cert=args.tls_cert, tls_key=args.tls_key,
        auth_token_file=args.auth_token_file,
    )


def run_serve(args: argparse.Namespace) -> int:
    from .logs import install
    from .server import serve

    # Never blocks the caller: a stalled reader of stderr must not stop the server (vaed.logs).
    handler = install(args.log_level)
    try:
        config = config_from_args(args)
        return asyncio.run(serve(config))
    finally:
        handler.close()


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
