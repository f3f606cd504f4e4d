"""`vaed` command line: serve, precompile, decode, info, health, bench."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import pathlib
import sys

from . import __version__, flags
from .choices import Parallel
from .config import ServerConfig

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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`vaed serve`'s flags: --gpu/--device (the devices), then one per ServerConfig flag field."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", metavar="N[,M...]|all",
                       help="serve on these CUDA devices, one worker each behind one port "
                            "(default: 0 when CUDA is available)")
    where.add_argument("--device", choices=["cpu"], help="serve on the CPU (slow; for tests and development)")
    flags.add_arguments(parser, ServerConfig)


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
    if args.parallel == Parallel.SPATIAL and len(devices) < 2:
        raise SystemExit("vaed serve: --parallel spatial needs two or more devices (--gpu 0,1 or --gpu all)")
    return ServerConfig(devices=devices, **flags.values(args, ServerConfig))


def run_serve(args: argparse.Namespace) -> int:
    from .logs import install
    from .server import serve
    from .startup import StartupTimes, process_started

    # Never blocks the caller: a stalled reader of stderr must not stop the server (vaed.logs).
    handler = install(args.log_level)
    try:
        config = config_from_args(args)  # imports torch
        # the start-up clock (vaed.startup) runs from the process's start: the imports are its first phase
        return asyncio.run(serve(config, StartupTimes(process_started())))
    finally:
        handler.close()


def add_precompile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=int, action="append", metavar="SM",
                        help="GPU architecture to compile for, repeatable (90: H100/H200, 80: A100, 89: L4/L40S, "
                             "100: B200); default: the visible GPUs'")
    parser.add_argument("--kernel-cache", metavar="DIR",
                        help="the cache to fill, as `vaed serve --kernel-cache` (default: $TRITON_CACHE_DIR, "
                             "else Triton's ~/.triton/cache)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="compiling processes (default: the cores but one, at most 16)")
    parser.add_argument("--manifest", metavar="FILE",
                        help="kernel records to compile (default: all the package's for each --arch, of "
                             "every kind of start; a server's start compiles its own share of them)")


def run_precompile(args: argparse.Namespace) -> int:
    """Compile the kernels a server's start-up launches into the kernel cache, without a GPU
    (an image build): its start then finds them there."""
    import torch

    from .kernels import precompile
    from .startup import kernel_cache_dir, use_kernel_cache

    try:
        use_kernel_cache(args.kernel_cache)
    except ValueError as exc:
        raise SystemExit(f"vaed precompile: {exc}") from None
    archs = args.arch or [precompile.arch_of(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    if not archs:
        raise SystemExit("vaed precompile: no GPU is visible; name the architecture (--arch 90 for H100/H200)")
    cache = kernel_cache_dir()
    if cache is None:
        raise SystemExit("vaed precompile: Triton is not installed")
    skipped = False
    for arch in sorted(set(archs)):
        manifest = pathlib.Path(args.manifest) if args.manifest else precompile.manifest_path(arch)
        if args.manifest and not manifest.is_file():
            raise SystemExit(f"vaed precompile: --manifest {manifest}: no such file")
        try:
            records = precompile.load_manifest(manifest)
        except (ValueError, KeyError, TypeError) as exc:  # not JSON, or JSON of another shape
            raise SystemExit(f"vaed precompile: {manifest} is no kernel manifest ({type(exc).__name__}: {exc})"
                             ) from None
        if not records:
            raise SystemExit(f"vaed precompile: no kernel records for sm_{arch} ({manifest} holds none)")
        report = precompile.ensure_compiled(arch, cache, args.workers or precompile.default_workers(), records)
        if report is None:
            print(f"{cache} already holds the kernels for sm_{arch}")
            continue
        print(f"compiled into {cache}: {report.summary()}")
        if report.failures:  # an image build should not pass with kernels left to compile at launch
            print(f"vaed precompile: {len(report.failures)} of {len(records)} kernel records for sm_{arch} were "
                  "not compiled (the warning above names them); those variants compile at their first launch",
                  file=sys.stderr)
            skipped = True
    return 1 if skipped else 0


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
    precompile = sub.add_parser("precompile", help="compile the Triton kernels ahead into the kernel cache "
                                                   "(no GPU needed: an image build)")
    add_precompile_arguments(precompile)
    precompile.set_defaults(func=run_precompile)
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
    known = command in _DELEGATED or command in ("serve", "precompile")
    args = build_parser(command if known else None).parse_args(argv)
    if args.command != "serve":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
