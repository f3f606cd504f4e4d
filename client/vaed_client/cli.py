"""`vaed-client`: the client commands `decode`, `encode` (`vaed_client.encode_cli`), `info` and `health`.

    vaed-client decode latents.pt --server localhost:50051 -o video.mp4
    vaed-client decode latents.npy -o video.mkv              # lossless (FFV1)
    vaed-client decode latents.npy -o video.mp4 --lossless   # lossless H.264 (rgb24)
    vaed-client decode latents.npy -o video.mp4 --client-side  # frames over the wire, encoded here
    vaed-client decode latents.npy -o frames/                # PNG folder
    vaed-client info --server localhost:50051
    vaed-client health --server localhost:50051              # exit 0 only if SERVING

They need only the client install (grpcio, protobuf, numpy; PyAV/Pillow for
video output, torch only to read .pt files). The server package's `vaed
decode|info|health` are these same functions: `add_decode_arguments` /
`run_decode`, `add_info_arguments` / `run_info`, `add_health_arguments` /
`run_health`. One connection helper (`add_connection_arguments`, `connect`)
gives every command the same target, TLS, server-name and token flags.

Latents: `.pt` (a tensor, or a dict with key "latents"), `.safetensors` (key
"latents" or the only tensor) or `.npy`; `[B, z_dim, T, h, w]` or
`[z_dim, T, h, w]` (B=1), float64 cast to float32 — the library's rule
(`vaed_client.core.normalize_latents`), in float32, float16 or bfloat16.
Frames are written as they arrive, so encoding overlaps the remote decode;
with B > 1 every batch item gets its own output, named with a `_bN` suffix.

Where an .mp4 is encoded: on the server (`--server-side`) when the output is
one .mp4 (batch 1) and the server offers MP4 (ModelInfo.video_formats), else
here (`--client-side`, and always for .mkv, PNG folders and B > 1). The
server is the default because it is lighter end to end: on an H200 a
480x832x81 video came as 4.58 MB of MP4 in 1.156 s against 97 MB of RGB8
frames in 1.135 s (21x fewer bytes in about the same time, before the
client's own encode), and the client's CPU encodes nothing. Both use H.264 yuv420p at `--crf` 18
(or `--lossless`), so the file's quality does not depend on where it was
encoded (x264's presets differ: the server's is veryfast).
An output that exists already (a file, or a folder holding frame PNGs) is
refused unless `--force` is given; missing folders of `-o` are made (a file in
the way is refused before the call). Sizes print as H x W. `--server` without a
port dials vaed's 50051 (an empty host or port is refused). Ctrl-C, SIGTERM and
SIGHUP end `decode` and `encode` alike: what was written of the output is
removed, one line says "interrupted", and the exit code is 128 + the signal's
(130, 143, 129). A stdout closed early (`| head`) ends a command quietly (141).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import __version__, wire
from .channel import read_token, with_default_port
from .core import normalize_latents
from .encode_cli import add_encode_arguments, run_encode
from .errors import LocalInputError, VaedError
from .export import (
    X264_CRF,
    ExportError,
    FrameWriter,
    check_output,
    existing_outputs,
    is_mp4_output,
    make_writer,
    remove_png_frames,
)
from .heap import keep_freed_memory
from .mp4 import Mp4Progress
from .resume import CallReport
from .tensors import widen_bf16_bits

log = logging.getLogger(__name__)

DEFAULT_SERVER = "localhost:50051"
DEFAULT_INFO_TIMEOUT_S = 10.0
# The server answers health from the event loop even while the GPU is busy;
# 5 s covers a loaded node without hanging a probe.
DEFAULT_HEALTH_TIMEOUT_S = 5.0
# The .mp4 quality of both encoders (vaed_client.export's): visually lossless.
DEFAULT_CRF = int(X264_CRF)
# The frame rate when the server does not say its model's (older servers): Wan2.1's.
FALLBACK_FPS = 16


class CommandError(Exception):
    """A problem the user can fix (bad file, bad flag); printed as one line."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a command: handled as Ctrl-C is (a KeyboardInterrupt, so every
    `except BaseException` clean-up on the way runs), and the exit code is 128 + the signal's."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# What a timeout, `kill`, a CI cancel (SIGTERM) or a closed terminal (SIGHUP) sends.
TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` in the main thread, as SIGINT raises
    KeyboardInterrupt, so an interrupted decode removes its partial output; their default action
    killed the process with the part of the video written so far. Only signals left at their
    default are taken (a host process's own handler, or nohup's ignored SIGHUP, stay), only in
    the main thread (where Python runs handlers), and the previous handlers come back after the
    block, or at the first signal: a second one then ends the process at once, mid clean-up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def restore() -> None:
        while previous:
            signum, handler = previous.popitem()
            signal.signal(signum, handler)

    def interrupt(signum: int, frame: Any) -> None:
        restore()
        raise Terminated(signum)

    for signum in TERMINATING_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, interrupt)
    try:
        yield
    finally:
        restore()


def interrupted_exit(command: str, exc: KeyboardInterrupt) -> int:
    """The one line and the shell's exit code (128 + signal) of an interrupted command."""
    signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
    name = signal.Signals(signum).name
    return _fail(command, "interrupted" + ("" if signum == signal.SIGINT else f" ({name})"), 128 + int(signum))


# -- reading latents -----------------------------------------------------------
def _pick_tensor(mapping: dict[str, Any], path: pathlib.Path) -> Any:
    if "latents" in mapping:
        return mapping["latents"]
    if len(mapping) == 1:
        return next(iter(mapping.values()))
    raise CommandError(f"{path}: found tensors {sorted(mapping)[:8]}; expected one named 'latents' or a single tensor")


def _load_safetensors(path: pathlib.Path) -> dict[str, Any]:
    try:
        from safetensors.torch import load_file
    except ImportError:  # client-only install: numpy arrays
        return _load_safetensors_numpy(path)
    return load_file(path, device="cpu")


def _load_safetensors_numpy(path: pathlib.Path) -> dict[str, Any]:
    """Without torch. numpy has no bfloat16 (what a bf16 pipeline's latents are):
    those tensors are read from the file's own layout (a JSON header, then
    little-endian data) and widened exactly to float32."""
    import json

    from safetensors import safe_open

    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes))
    out: dict[str, Any] = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            entry = header[name]
            if entry["dtype"] != "BF16":
                out[name] = f.get_tensor(name)
                continue
            start, end = entry["data_offsets"]
            bits = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=8 + header_bytes + start)
            out[name] = widen_bf16_bits(bits).reshape(entry["shape"])
    return out


def load_latents(path: str | os.PathLike[str]) -> Any:
    """Read latents from .pt, .safetensors or .npy as `[B, z_dim, T, h, w]`.

    .pt / .safetensors give torch tensors (bf16 kept), .npy numpy arrays.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise CommandError(f"{p}: no such file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            latents: Any = np.load(p, allow_pickle=False)
        elif suffix in (".pt", ".pth"):
            try:
                import torch
            except ImportError:
                raise CommandError(f"{p}: reading .pt needs torch; save latents as .npy or .safetensors") from None
            obj = torch.load(p, map_location="cpu", weights_only=True)
            latents = _pick_tensor(obj, p) if isinstance(obj, dict) else obj
        elif suffix == ".safetensors":
            latents = _pick_tensor(_load_safetensors(p), p)
        else:
            raise CommandError(f"{p}: unknown latents format {suffix!r}; use .pt, .safetensors or .npy")
    except CommandError:
        raise
    except Exception as e:  # unpickling/format errors from three libraries
        raise CommandError(f"{p}: cannot read latents: {e}") from None
    try:
        return normalize_latents(latents)
    except LocalInputError as e:
        raise CommandError(f"{p}: {e}") from None


# -- connecting ----------------------------------------------------------------
def server_target(text: str) -> str:
    """--server's type: HOST:PORT with vaed's port when none is given; an empty target or port is
    a usage error (gRPC dialled 443 for "host:", and "" failed with a traceback)."""
    try:
        return with_default_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_seconds(text: str) -> float:
    """--timeout's type: a finite number of seconds > 0 (0 ran out before the call could start,
    and was reported as a timeout while resuming it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_connection_arguments(parser: argparse.ArgumentParser, timeout: float | None, *, token: bool = True) -> None:
    # type= runs on the default too: every command sees HOST:PORT, with vaed's port when none was given.
    parser.add_argument("--server", default=DEFAULT_SERVER, type=server_target, metavar="HOST:PORT",
                        help="server address, or dns:///name:port for several replicas; a HOST without :PORT "
                             f"gets {wire.DEFAULT_PORT} (default {DEFAULT_SERVER})")
    if token:
        parser.add_argument("--token-file", metavar="PATH",
                            help=f"file holding the bearer token (default: ${wire.AUTH_TOKEN_ENV} when set, "
                                 "else no token)")
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS (system root certificates; default: plaintext)")
    parser.add_argument("--ca-cert", metavar="PATH",
                        help="PEM CA bundle to verify the server (implies --tls; default: system roots)")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="expected name in the server certificate when it differs from HOST "
                             "(e.g. checking localhost against a cert for vaed.<ns>.svc; default: HOST)")
    parser.add_argument("--tls-client-cert", metavar="PATH",
                        help="PEM client certificate chain for a server run with --tls-client-ca (mutual TLS; "
                             "needs --tls or --ca-cert, and --tls-client-key; default: none, no client certificate)")
    parser.add_argument("--tls-client-key", metavar="PATH", help="PEM private key of --tls-client-cert (default: none)")
    parser.add_argument("--timeout", type=positive_seconds, default=timeout, metavar="SECONDS",
                        help="deadline of the call" + (f" (default {timeout:g})" if timeout else " (default: none)"))


def connection_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`VaeClient` keyword arguments from the connection flags."""
    tls: Any = None
    if args.ca_cert:
        if not os.path.isfile(args.ca_cert):
            raise CommandError(f"--ca-cert {args.ca_cert}: no such file")
        tls = args.ca_cert
    elif args.tls:
        tls = True
    if args.tls_server_name and tls is None:
        raise CommandError("--tls-server-name needs --tls or --ca-cert")
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise CommandError("mutual TLS needs both --tls-client-cert and --tls-client-key")
    if args.tls_client_cert and tls is None:
        raise CommandError("--tls-client-cert needs --tls or --ca-cert")
    for flag, path in (("--tls-client-cert", args.tls_client_cert), ("--tls-client-key", args.tls_client_key)):
        if path and not os.path.isfile(path):
            raise CommandError(f"{flag} {path}: no such file")
    token = None
    if hasattr(args, "token_file"):
        try:
            token = read_token(args.token_file, wire.AUTH_TOKEN_ENV)
        except ValueError as e:
            raise CommandError(str(e)) from None
    return dict(timeout=args.timeout, tls=tls, token=token, tls_server_name=args.tls_server_name,
                tls_client_cert=args.tls_client_cert, tls_client_key=args.tls_client_key)


def connect(args: argparse.Namespace) -> Any:
    from .client import VaeClient

    return VaeClient(args.server, **connection_settings(args))


def _fail(command: str, message: str, code: int) -> int:
    print(f"{_prog()} {command}: error: {message}", file=sys.stderr)
    return code


def _prog() -> str:
    # Error lines name the command the user typed: `vaed-client` or the server package's `vaed`.
    return "vaed-client" if sys.argv and os.path.basename(sys.argv[0]) == "vaed-client" else "vaed"


def _print_rows(rows: list[tuple[str, str]]) -> int:
    width = max(len(key) for key, _ in rows)
    return print_lines([f"{key + ':':<{width + 1}} {value}" for key, value in rows])


def print_lines(lines: list[str]) -> int:
    """Print to stdout; 0, or 128 + SIGPIPE when the reader went away (`vaed-client info | head -3`):
    quietly, as Unix tools end then, not with a BrokenPipeError traceback."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null, or that flush fails too
        with contextlib.suppress(OSError, ValueError):  # a stdout with no file descriptor (io.StringIO)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 128 + signal.SIGPIPE
    return 0


# -- decode --------------------------------------------------------------------
def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("latents",
                        help="latents file: .pt, .safetensors or .npy, [B, z_dim, T, h, w] or [z_dim, T, h, w]")
    parser.add_argument("-o", "--output", required=True,
                        help="output .mp4, .mkv (lossless FFV1), or a folder for PNG frames (no suffix or a "
                             "trailing /); B > 1: one per item, suffix _bN")
    parser.add_argument("--force", action="store_true",
                        help="overwrite outputs that exist (default: refuse; a PNG folder's old frame_*.png are "
                             "removed first)")
    parser.add_argument("--lossless", action="store_true",
                        help="lossless video: .mp4 as H.264 rgb24 at CRF 0 (default: .mp4 is H.264 yuv420p CRF 18, "
                             "visually lossless; .mkv and PNG are always lossless)")
    parser.add_argument("--raw-latents", action="store_true",
                        help="latents are already in VAE space (default: the pipeline's normalized latents, "
                             "which the server de-normalizes with the model's latents_mean/std)")
    parser.add_argument("--fps", type=int, default=None,
                        help="frame rate of the video (default: the model's, 16 for Wan2.1 and 24 for Wan2.2, "
                             f"as the server says; {FALLBACK_FPS} from a server that does not)")
    parser.add_argument("--crf", type=int, default=None,
                        help=f"H.264 quality of a lossy .mp4, 0..51, lower is better (default {DEFAULT_CRF}, "
                             "visually lossless; refused with --lossless, .mkv and PNG folders, which are lossless)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server-side", dest="encode_on", action="store_const", const="server",
                       help="the server encodes the .mp4 and sends its bytes (batch 1; default when the server "
                            "offers MP4: faster end to end and ~20x fewer bytes than frames)")
    where.add_argument("--client-side", dest="encode_on", action="store_const", const="client",
                       help="the server sends frames and this machine encodes them (default for .mkv, PNG "
                            "folders, batch > 1 and servers without MP4)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (default: a bar on a terminal)")
    add_connection_arguments(parser, None)


def run_decode(args: argparse.Namespace) -> int:
    try:
        with terminate_as_interrupt():
            latents = load_latents(args.latents)
            check_output(args.output)
            if args.fps is not None and not 1 <= args.fps <= 240:
                raise CommandError(f"--fps must be in 1..240, got {args.fps}")
            args.crf = _checked_crf(args)
            batch = int(latents.shape[0])
            _check_outputs(args.output, batch, getattr(args, "force", False))
            with connect(args) as client:
                info = client.model_info()
                fps = args.fps or info.video_fps or FALLBACK_FPS
                if _server_side(args, info, batch):
                    stats = _decode_server_side(client, info, latents, fps, args)
                else:
                    writer = make_writer(args.output, fps, lossless=getattr(args, "lossless", False), crf=args.crf)
                    stats = _decode(client, info, latents, writer, args)
    except (CommandError, ExportError, LocalInputError) as e:
        return _fail("decode", str(e), 2)
    except VaedError as e:
        return _fail("decode", f"{args.server}: {e}", 1)
    except OSError as e:  # unwritable output and the like
        return _fail("decode", str(e), 1)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (`terminate_as_interrupt`)
        return interrupted_exit("decode", e)
    return _print_summary(stats)


def _checked_crf(args: argparse.Namespace) -> int:
    """--crf, or the default; refused where nothing lossy is encoded, as the library and the
    server refuse a crf with lossless=True (a silently dropped flag would look like a used one)."""
    if args.crf is None:
        return DEFAULT_CRF
    if not 0 <= args.crf <= 51:
        raise CommandError(f"--crf must be in 0..51, got {args.crf}")
    if getattr(args, "lossless", False):
        raise CommandError("--crf applies to lossy .mp4; --lossless is always CRF 0")
    if not is_mp4_output(args.output):
        raise CommandError(f"--crf applies to .mp4 output; {args.output} is written lossless (.mkv or PNG frames)")
    return int(args.crf)


def _check_outputs(output: str, batch: int, force: bool) -> None:
    """Refuse to overwrite earlier outputs unless --force; with it, clear a PNG
    folder's old frames (a shorter video would otherwise leave stale ones behind)."""
    existing = existing_outputs(output, batch)
    if not existing:
        return
    if not force:
        shown = ", ".join(str(p) for p in existing[:3]) + (", ..." if len(existing) > 3 else "")
        raise CommandError(f"{shown} exists already; pass --force to overwrite, or choose another -o")
    for path in existing:
        if path.is_dir():
            remove_png_frames(path)


def _progress(total: int, quiet: bool) -> Any:
    # No bar when stderr is not a terminal (logs, CI): \r-redrawn lines are noise there.
    try:
        from tqdm import tqdm
    except ImportError:
        quiet = True
    if quiet or not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit="frame", desc="decode", file=sys.stderr)


def _progress_to(bar: Any, done: int) -> None:
    if bar is not None and done != bar.n:
        bar.update(done - bar.n)  # backwards too: a resumed MP4 call starts its file over


def _server_side(args: argparse.Namespace, info: Any, batch: int) -> bool:
    """Where the .mp4 is encoded (see the module docstring); CommandError when --server-side
    cannot be honoured."""
    is_mp4 = is_mp4_output(args.output)
    can = is_mp4 and batch == 1 and "mp4" in info.video_formats
    if getattr(args, "encode_on", None) == "server" and not can:
        why = ("the output is not an .mp4" if not is_mp4 else f"the latents hold {batch} videos (batch > 1)"
               if batch != 1 else "the server offers no MP4 output (an older vaed)")
        raise CommandError(f"--server-side: {why}; leave it out to encode here")
    return can and getattr(args, "encode_on", None) != "client"


def _decode_server_side(client: Any, info: Any, latents: Any, fps: int, args: argparse.Namespace) -> dict[str, Any]:
    """The server's MP4, written to -o as its bytes arrive."""
    _, _, latent_frames, h, w = (int(d) for d in latents.shape)
    lossless = getattr(args, "lossless", False)
    start = time.perf_counter()
    report = CallReport()
    total = info.output_frames(latent_frames)
    bar = _progress(total, args.quiet)
    # the bar follows the frames the server has encoded, as its MP4 bytes arrive
    out = Mp4Progress(args.output, lambda done: _progress_to(bar, done)) if bar is not None else args.output
    try:
        path = client.decode(latents, output_type="mp4", raw_latents=args.raw_latents, fps=fps, lossless=lossless,
                             crf=None if lossless else args.crf, mp4_path=out, report=report)
        _progress_to(bar, total)
    finally:
        if bar is not None:
            bar.close()
    scale = info.scale_factor_spatial
    return {
        "batch": 1, "frames": total, "height": h * scale, "width": w * scale,
        "first_bytes_s": report.first_data_seconds or 0.0, "total_s": time.perf_counter() - start,
        "bytes": path.stat().st_size,
        "paths": [path], "encoded": "on the server, " + ("lossless" if lossless else f"CRF {args.crf}"),
    }


def _decode(client: Any, info: Any, latents: Any, writer: FrameWriter, args: argparse.Namespace) -> dict[str, Any]:
    batch, _, latent_frames = (int(d) for d in latents.shape[:3])
    total = info.output_frames(latent_frames)
    received = frames = 0
    height = width = 0
    first_frame_s: float | None = None
    start = time.perf_counter()
    bar = _progress(total, args.quiet)
    try:
        for chunk in client.stream(latents, raw_latents=args.raw_latents):
            if first_frame_s is None:
                first_frame_s = time.perf_counter() - start
            video = np.asarray(chunk.frames)  # torch CPU uint8 -> numpy without a copy
            height, width = video.shape[2], video.shape[3]
            writer.write(chunk.first_frame, video)
            received += chunk.nbytes
            frames += chunk.num_frames
            if bar is not None:
                bar.update(chunk.num_frames)
        paths = writer.close()
    except BaseException:  # a failed or interrupted decode leaves no part of a video behind
        writer.discard()
        raise
    finally:
        if bar is not None:
            bar.close()
    total_s = time.perf_counter() - start
    return {
        "batch": batch, "frames": frames, "height": height, "width": width,
        "first_frame_s": first_frame_s or 0.0, "total_s": total_s, "bytes": received, "paths": paths,
        "encoded": "here",
    }


def _print_summary(stats: dict[str, Any]) -> int:
    total_s = stats["total_s"]
    rows = [
        ("video", f"{stats['frames']} frames, batch {stats['batch']}, {stats['height']}x{stats['width']} (H x W)"),
        # the server's MP4 (`first bytes`): the init segment, then frame 0's fragment with group 1
        ("first bytes", f"{stats['first_bytes_s'] * 1000:.0f} ms") if "first_bytes_s" in stats
        else ("first frame", f"{stats['first_frame_s'] * 1000:.0f} ms"),
        ("total", f"{total_s:.2f} s ({stats['frames'] * stats['batch'] / max(total_s, 1e-9):.1f} frames/s)"),
        ("received", f"{stats['bytes'] / 1e6:.1f} MB ({stats['bytes'] / 1e6 / max(total_s, 1e-9):.1f} MB/s)"),
        ("encoded", stats["encoded"]),
        ("wrote", ", ".join(str(p) for p in stats["paths"])),
    ]
    return _print_rows(rows)


# -- info ----------------------------------------------------------------------
def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser, DEFAULT_INFO_TIMEOUT_S)


def _format_value(value: Any) -> str:
    """Lists of floats (latents_mean/std) to 4 decimals; lists of names
    (precisions, devices) as they are."""
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def run_info(args: argparse.Namespace) -> int:
    try:
        with connect(args) as client:
            info = client.model_info()
    except CommandError as e:
        return _fail("info", str(e), 2)
    except VaedError as e:
        return _fail("info", f"{args.server}: {e}", 1)
    rows = [("server", args.server)] + [(k, _format_value(v)) for k, v in info.to_dict().items()]
    return _print_rows(rows)


# -- health --------------------------------------------------------------------
def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", default="",
                        help='service name to check; "" (default) is the whole server, '
                             f'"{wire.SERVICE_NAME}" the decoder service')
    # Health is open without a token (probes call it), so no --token-file.
    add_connection_arguments(parser, DEFAULT_HEALTH_TIMEOUT_S, token=False)


def check_health(args: argparse.Namespace) -> tuple[bool, str]:
    """(serving, text to print) for the server and service in `args`:
    SERVING, NOT_SERVING, SERVICE_UNKNOWN, or the gRPC error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .channel import create_channel

    try:
        settings = connection_settings(args)
        channel, _ = create_channel(
            args.server, tls=settings["tls"], tls_server_name=settings["tls_server_name"],
            tls_client_cert=settings["tls_client_cert"], tls_client_key=settings["tls_client_key"],
        )
    except CommandError as e:
        return False, f"ERROR: {e}"
    except OSError as e:
        return False, f"ERROR: cannot read a TLS file: {e}"
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else None
            if code == grpc.StatusCode.NOT_FOUND:
                # The health servicer answers NOT_FOUND for a service it does not know.
                return False, "SERVICE_UNKNOWN"
            name = code.name if code is not None else "UNKNOWN"
            details = e.details() if callable(getattr(e, "details", None)) else ""
            return False, f"{name}: {details or ''}".rstrip(": ")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def run_health(args: argparse.Namespace) -> int:
    serving, text = check_health(args)
    return print_lines([text]) or (0 if serving else 1)


# -- entry point ---------------------------------------------------------------
COMMANDS: dict[str, tuple[Any, Any, str]] = {
    "decode": (add_decode_arguments, run_decode, "decode a latents file through a server to .mp4, .mkv or PNGs"),
    "encode": (add_encode_arguments, run_encode, "encode a video, PNG folder or .npy frames through a server "
               "to a latents file"),
    "info": (add_info_arguments, run_info, "print a server's model info"),
    "health": (add_health_arguments, run_health, "ask a server's grpc.health.v1 status (exit 0 if SERVING)"),
}


def build_parser(prog: str = "vaed-client") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Client commands for vaed, remote Wan VAE decoding.",
        epilog=f"Every command dials --server {DEFAULT_SERVER} unless told otherwise (a HOST without :PORT gets "
               f"{wire.DEFAULT_PORT}) and sends the token in ${wire.AUTH_TOKEN_ENV} when set. "
               f"`{prog} COMMAND --help` lists a command's flags with their defaults.")
    parser.add_argument("--version", action="version", version=f"vaed-client {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, run, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        add(sub_parser)
        sub_parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).debug("malloc: %s", keep_freed_memory())  # this process is ours (vaed_client.heap)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
