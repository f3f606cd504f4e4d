"""`vaed-client encode`: video frames through a server's encoder to a latents file.

    vaed-client encode video.mp4 -o moments.safetensors --server localhost:50051
    vaed-client encode frames/ -o latents.npy --output-type latents   # a PNG folder
    vaed-client encode frames.npy -o moments.safetensors              # uint8 [T, H, W, 3] or float [3, T, H, W]

Input: .mp4 / .mkv / .webm (PyAV, decoded to RGB), a folder of PNGs (Pillow,
sorted by name) or .npy (the library's frame rule, `vaed_client.encoding`).
Video files and PNGs travel as uint8, which the server maps to [-1, 1] as
diffusers' VideoProcessor does. The frame count must be 1 + 4k. Output: the
moments `[B, 2 * z_dim, T_lat, h, w]` (mean, then log-variance) or, with
`--output-type latents`, the normalised latents, as `.safetensors` (key
"moments" or "latents") or `.npy`. An existing output is refused unless
`--force`. Needs the client install; PyAV for video, Pillow for PNGs,
safetensors + torch for .safetensors.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import numpy as np

from .encoding import LATENTS, OUTPUT_TYPES
from .errors import LocalInputError, VaedError

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov")
OUTPUT_SUFFIXES = (".safetensors", ".npy")


def read_frames(path: pathlib.Path) -> np.ndarray:
    """The input's frames: uint8 [T, H, W, 3] from a video or PNG folder, or the .npy as saved;
    LocalInputError, naming the file, for one that is missing or cannot be read."""
    if path.is_dir():
        from PIL import Image

        files = sorted(path.glob("*.png"))
        if not files:
            raise LocalInputError(f"{path} holds no .png frames")
        return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    suffix = path.suffix.lower()
    if suffix not in (".npy", *VIDEO_SUFFIXES):
        raise LocalInputError(f"{path}: use a video ({', '.join(VIDEO_SUFFIXES)}), a PNG folder or .npy")
    if not path.exists():
        raise LocalInputError(f"{path}: no such file")
    try:
        if suffix == ".npy":
            return np.load(path)
        import av

        with av.open(str(path)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    except (ValueError, OSError) as exc:  # numpy's object arrays; PyAV's errors are ValueErrors or OSErrors
        raise LocalInputError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None


def check_output(path: pathlib.Path, force: bool) -> None:
    """LocalInputError before any call for an output that cannot be written: its suffix, its
    folder, or a file there already (without --force)."""
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise LocalInputError(f"{path}: write {' or '.join(OUTPUT_SUFFIXES)}")
    if not path.parent.is_dir():
        raise LocalInputError(f"{path}: no folder {path.parent}")
    if path.exists() and not force:
        raise LocalInputError(f"{path} exists (use --force to overwrite)")


def write_output(path: pathlib.Path, key: str, result: Any) -> None:
    if path.suffix.lower() == ".safetensors":
        import torch
        from safetensors.torch import save_file

        save_file({key: torch.as_tensor(result).contiguous()}, str(path))
    else:
        with open(path, "wb") as f:  # to a path np.save adds ".npy" unless it ends so (".NPY" does not)
            np.save(f, result)


def add_encode_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import add_connection_arguments

    parser.add_argument("input", type=pathlib.Path, help="video file, PNG folder or .npy frames")
    parser.add_argument("-o", "--output", type=pathlib.Path, required=True, help=".safetensors or .npy")
    parser.add_argument("--output-type", choices=OUTPUT_TYPES, default="moments",
                        help="moments (mean, log-variance) or the normalised latents (default moments)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output (default: refuse)")
    add_connection_arguments(parser, None)


def run_encode(args: argparse.Namespace) -> int:
    from .cli import _fail, connect

    try:
        check_output(args.output, args.force)
        frames = read_frames(args.input)
        with connect(args) as client:
            result = client.encode(frames, output_type=args.output_type)
        write_output(args.output, LATENTS if args.output_type == LATENTS else "moments", result)
    except LocalInputError as e:
        return _fail("encode", str(e), 2)
    except VaedError as e:
        return _fail("encode", f"{args.server}: {e}", 1)
    except OSError as e:  # the output could not be written after all
        return _fail("encode", str(e), 1)
    print(f"{args.input} ({frames.shape[-4] if frames.dtype == np.uint8 else frames.shape[-3]} frames) -> "
          f"{args.output} {args.output_type} {list(result.shape)}")
    return 0
