"""`vaed decode` and `vaed info`: the client CLI for people.

    vaed decode latents.pt --server localhost:50051 -o video.mp4
    vaed decode latents.npy --server localhost:50051 -o frames/   # PNG folder
    vaed info --server localhost:50051

Latents: `.pt` (a tensor, or a dict with key "latents"), `.safetensors` (key
"latents" or the only tensor) or `.npy`; `[B, z_dim, T, h, w]` or
`[z_dim, T, h, w]`. Frames are written as they arrive from `stream()`, so
encoding overlaps the remote decode. With B > 1 every batch item gets its own
output, named with a `_bN` suffix.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
import time
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_SERVER = "localhost:50051"
DEFAULT_INFO_TIMEOUT_S = 10.0
TOKEN_ENV = "VAED_AUTH_TOKEN"
# libx264 CRF 18 is visually lossless for 480p-720p content; mpeg4 (the
# fallback when FFmpeg lacks x264) gets a bit budget instead: 0.25 bit/pixel.
X264_CRF = "18"
MPEG4_BITS_PER_PIXEL = 0.25
# PNG level 1 writes ~3x faster than the default 6 for ~15 % larger files;
# these are intermediate frames, speed matters more.
PNG_COMPRESS_LEVEL = 1


class CommandError(Exception):
    """A problem the user can fix (bad file, bad flag); printed as one line."""


# -- reading latents -----------------------------------------------------------
def _pick_tensor(mapping: dict[str, Any], path: pathlib.Path) -> Any:
    if "latents" in mapping:
        return mapping["latents"]
    if len(mapping) == 1:
        return next(iter(mapping.values()))
    raise CommandError(f"{path}: found tensors {sorted(mapping)[:8]}; expected one named 'latents' or a single tensor")


def load_latents(path: str | os.PathLike[str]) -> Any:
    """Read latents from .pt, .safetensors or .npy as `[B, z_dim, T, h, w]`.

    .pt / .safetensors give torch tensors (bf16 kept), .npy numpy arrays.
    float64 is narrowed to float32 (the wire carries uint8/f16/bf16/f32).
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise CommandError(f"{p}: no such file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            latents: Any = np.load(p, allow_pickle=False)
        elif suffix == ".pt" or suffix == ".pth":
            import torch

            obj = torch.load(p, map_location="cpu", weights_only=True)
            latents = _pick_tensor(obj, p) if isinstance(obj, dict) else obj
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            latents = _pick_tensor(load_file(p, device="cpu"), p)
        else:
            raise CommandError(f"{p}: unknown latents format {suffix!r}; use .pt, .safetensors or .npy")
    except CommandError:
        raise
    except Exception as e:  # unpickling/format errors from three libraries
        raise CommandError(f"{p}: cannot read latents: {e}") from None
    return _normalize(latents, p)


def _normalize(latents: Any, path: pathlib.Path) -> Any:
    if isinstance(latents, np.ndarray):
        if latents.dtype == np.float64:
            latents = latents.astype(np.float32)
    else:
        import torch

        if not isinstance(latents, torch.Tensor):
            raise CommandError(f"{path}: expected a tensor or a dict with key 'latents', got {type(latents).__name__}")
        if latents.dtype == torch.float64:
            latents = latents.float()
    if latents.ndim == 4:
        latents = latents[None]  # one video: add the batch dimension
    if latents.ndim != 5:
        raise CommandError(
            f"{path}: latents must be [B, z_dim, T, h, w] or [z_dim, T, h, w], got shape {list(latents.shape)}"
        )
    return latents


# -- writing frames ------------------------------------------------------------
def output_paths(out: pathlib.Path, batch: int) -> list[pathlib.Path]:
    """`out` for one video; `<stem>_bN<suffix>` per item for a batch."""
    if batch == 1:
        return [out]
    return [out.with_name(f"{out.stem}_b{i}{out.suffix}") for i in range(batch)]


class FrameWriter(Protocol):
    def write(self, first_frame: int, frames: np.ndarray) -> None: ...
    def close(self) -> list[pathlib.Path]: ...


def _codec_name() -> str:
    import av

    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:  # FFmpeg builds without GPL x264
        return "mpeg4"


class Mp4Writer:
    """One .mp4 per batch item (PyAV, yuv420p). Frames must come in order;
    chunks that arrive early wait in a small reorder buffer."""

    def __init__(self, out: pathlib.Path, fps: int) -> None:
        self.out = out
        self.fps = fps
        self.codec = _codec_name()
        self._containers: list[Any] = []
        self._streams: list[Any] = []
        self._paths: list[pathlib.Path] = []
        self._pending: dict[int, np.ndarray] = {}
        self._next = 0
        self._crop: tuple[int, int] | None = None

    def _open(self, batch: int, height: int, width: int) -> None:
        import av

        # yuv420p subsamples chroma 2x2, so both sides must be even; Wan
        # frames are multiples of 8, other sizes lose their last row/column.
        even_h, even_w = height - height % 2, width - width % 2
        if (even_h, even_w) != (height, width):
            log.warning("cropping %dx%d frames to %dx%d for yuv420p", height, width, even_h, even_w)
        self._crop = (even_h, even_w)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._paths = output_paths(self.out, batch)
        for path in self._paths:
            container = av.open(str(path), mode="w")
            stream = container.add_stream(self.codec, rate=self.fps)
            stream.width, stream.height, stream.pix_fmt = even_w, even_h, "yuv420p"
            if self.codec == "libx264":
                stream.options = {"crf": X264_CRF}
            else:
                stream.bit_rate = int(even_w * even_h * self.fps * MPEG4_BITS_PER_PIXEL)
            self._containers.append(container)
            self._streams.append(stream)

    def write(self, first_frame: int, frames: np.ndarray) -> None:
        if not self._containers:
            self._open(frames.shape[0], frames.shape[2], frames.shape[3])
        self._pending[first_frame] = frames
        while self._next in self._pending:
            chunk = self._pending.pop(self._next)
            self._encode(chunk)
            self._next += chunk.shape[1]

    def _encode(self, frames: np.ndarray) -> None:
        import av

        assert self._crop is not None
        h, w = self._crop
        for b, (container, stream) in enumerate(zip(self._containers, self._streams)):
            for t in range(frames.shape[1]):
                image = np.ascontiguousarray(frames[b, t, :h, :w])
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)

    def close(self) -> list[pathlib.Path]:
        if self._pending:
            log.warning("%d chunks never became contiguous; frames from %d on are missing", len(self._pending), self._next)
        for container, stream in zip(self._containers, self._streams):
            for packet in stream.encode(None):  # flush the encoder
                container.mux(packet)
            container.close()
        return self._paths


class PngWriter:
    """A folder of `frame_00000.png` files per batch item (order-free)."""

    def __init__(self, out: pathlib.Path) -> None:
        self.out = out
        self._dirs: list[pathlib.Path] = []

    def write(self, first_frame: int, frames: np.ndarray) -> None:
        from PIL import Image

        if not self._dirs:
            self._dirs = output_paths(self.out, frames.shape[0])
            for d in self._dirs:
                d.mkdir(parents=True, exist_ok=True)
        for b, folder in enumerate(self._dirs):
            for t in range(frames.shape[1]):
                image = Image.fromarray(np.ascontiguousarray(frames[b, t]))
                image.save(folder / f"frame_{first_frame + t:05d}.png", compress_level=PNG_COMPRESS_LEVEL)

    def close(self) -> list[pathlib.Path]:
        return self._dirs


def make_writer(out: str | os.PathLike[str], fps: int) -> FrameWriter:
    path = pathlib.Path(out)
    if path.suffix.lower() == ".mp4":
        return Mp4Writer(path, fps)
    if path.suffix:
        log.warning("%s has no .mp4 suffix: writing a folder of PNG frames there", path)
    return PngWriter(path)


# -- connecting ----------------------------------------------------------------
def _add_connection_arguments(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    parser.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT",
                        help=f"server address, or dns:///name:port for several replicas (default {DEFAULT_SERVER})")
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the bearer token (default: ${TOKEN_ENV} when set)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system root certificates)")
    parser.add_argument("--ca-cert", metavar="PATH", help="PEM CA bundle to verify the server (implies --tls)")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="expected name in the server certificate when it differs from HOST")
    parser.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                        help="deadline of the call" + (f" (default {timeout:g})" if timeout else " (default: none)"))


def _connect(args: argparse.Namespace) -> Any:
    from vaed_client import VaeClient

    from .auth import read_token

    try:
        token = read_token(args.token_file, TOKEN_ENV)
    except ValueError as e:
        raise CommandError(str(e)) from None
    tls: Any = None
    if args.ca_cert:
        if not os.path.isfile(args.ca_cert):
            raise CommandError(f"--ca-cert {args.ca_cert}: no such file")
        tls = args.ca_cert
    elif args.tls:
        tls = True
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else None
    return VaeClient(args.server, timeout=args.timeout, tls=tls, token=token, options=options)


def _fail(command: str, message: str, code: int) -> int:
    print(f"vaed {command}: error: {message}", file=sys.stderr)
    return code


# -- vaed decode ---------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("latents", help="latents file: .pt, .safetensors or .npy, [B, z_dim, T, h, w]")
    parser.add_argument("-o", "--output", required=True,
                        help="output .mp4, or a folder for PNG frames (B > 1: one per item, suffix _bN)")
    parser.add_argument("--raw-latents", action="store_true",
                        help="latents are already in VAE space (default: the pipeline's normalized latents, "
                             "which the server de-normalizes with the model's latents_mean/std)")
    parser.add_argument("--fps", type=int, default=16, help="frame rate of the .mp4 (default %(default)s, Wan's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_connection_arguments(parser, None)


def run(args: argparse.Namespace) -> int:
    from vaed_client import VaedError

    try:
        latents = load_latents(args.latents)
        writer = make_writer(args.output, args.fps)
        with _connect(args) as client:
            stats = _decode(client, latents, writer, args)
    except CommandError as e:
        return _fail("decode", str(e), 2)
    except VaedError as e:
        return _fail("decode", f"{args.server}: {e}", 1)
    except OSError as e:  # unwritable output and the like
        return _fail("decode", str(e), 1)
    except KeyboardInterrupt:
        return _fail("decode", "interrupted", 130)
    _print_summary(stats)
    return 0


def _decode(client: Any, latents: Any, writer: FrameWriter, args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    batch, _, latent_frames = (int(d) for d in latents.shape[:3])
    total = client.model_info().output_frames(latent_frames)
    received = frames = 0
    height = width = 0
    first_frame_s: float | None = None
    start = time.perf_counter()
    # No bar when stderr is not a terminal (logs, CI): \r-redrawn lines are noise there.
    quiet = args.quiet or not sys.stderr.isatty()
    with tqdm(total=total, unit="frame", desc="decode", disable=quiet, file=sys.stderr) as bar:
        for chunk in client.stream(latents, raw_latents=args.raw_latents):
            if first_frame_s is None:
                first_frame_s = time.perf_counter() - start
            video = np.asarray(chunk.frames)  # torch CPU uint8 -> numpy without a copy
            height, width = video.shape[2], video.shape[3]
            writer.write(chunk.first_frame, video)
            received += chunk.nbytes
            frames += chunk.num_frames
            bar.update(chunk.num_frames)
        paths = writer.close()
    total_s = time.perf_counter() - start
    return {
        "batch": batch, "frames": frames, "height": height, "width": width,
        "first_frame_s": first_frame_s or 0.0, "total_s": total_s, "bytes": received, "paths": paths,
    }


def _print_summary(stats: dict[str, Any]) -> None:
    total_s = stats["total_s"]
    rows = [
        ("frames", f"{stats['frames']} x {stats['batch']} at {stats['width']}x{stats['height']}"),
        ("first frame", f"{stats['first_frame_s'] * 1000:.0f} ms"),
        ("total", f"{total_s:.2f} s ({stats['frames'] * stats['batch'] / max(total_s, 1e-9):.1f} frames/s)"),
        ("received", f"{stats['bytes'] / 1e6:.1f} MB ({stats['bytes'] / 1e6 / max(total_s, 1e-9):.1f} MB/s)"),
        ("wrote", ", ".join(str(p) for p in stats["paths"])),
    ]
    _print_rows(rows)


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key + ':':<{width + 1}} {value}")


# -- vaed info -----------------------------------------------------------------
def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    _add_connection_arguments(parser, DEFAULT_INFO_TIMEOUT_S)


def _format_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.4f}" for v in value) + "]" if value else "[]"
    return str(value)


def run_info(args: argparse.Namespace) -> int:
    from vaed_client import VaedError

    try:
        with _connect(args) as client:
            info = client.model_info()
    except CommandError as e:
        return _fail("info", str(e), 2)
    except VaedError as e:
        return _fail("info", f"{args.server}: {e}", 1)
    rows = [("server", args.server)] + [(k, _format_value(v)) for k, v in info.to_dict().items()]
    _print_rows(rows)
    return 0
