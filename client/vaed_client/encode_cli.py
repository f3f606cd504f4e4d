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


def read_frames(path: pathlib.Path) -> np.ndarray:
    """The input's frames: uint8 [T, H, W, 3] from a video or PNG folder, or the .npy as saved."""
    if path.is_dir():
        from PIL import Image

        files = sorted(path.glob("*.png"))
        if not files:
            raise LocalInputError(f"{path} holds no .png frames")
        return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    if path.suffix == ".npy":
        return np.load(path)
    if path.suffix in VIDEO_SUFFIXES:
        import av

        with av.open(str(path)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    raise LocalInputError(f"{path}: use a video ({', '.join(VIDEO_SUFFIXES)}), a PNG folder or .npy")


def write_output(path: pathlib.Path, key: str, result: Any) -> None:
    if path.suffix == ".safetensors":
        import torch
        from safetensors.torch import save_file

        save_file({key: torch.as_tensor(result).contiguous()}, str(path))
    elif path.suffix == ".npy":
        np.save(path, result)
    else:
        raise LocalInputError(f"{path}: write .safetensors or .npy")


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

    if args.output.exists() and not args.force:
        return _fail("encode", f"{args.output} exists (use --force to overwrite)", 2)
    try:
        frames = read_frames(args.input)
        with connect(args) as client:
            result = client.encode(frames, output_type=args.output_type)
        write_output(args.output, LATENTS if args.output_type == LATENTS else "moments", result)
    except LocalInputError as e:
        return _fail("encode", str(e), 2)
    except VaedError as e:
        return _fail("encode", f"{args.server}: {e}", 1)
    print(f"{args.input} ({frames.shape[-4] if frames.dtype == np.uint8 else frames.shape[-3]} frames) -> "
          f"{args.output} {args.output_type} {list(result.shape)}")
    return 0
