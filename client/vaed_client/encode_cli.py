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
`--force`; the output is written to a temporary name beside it and renamed,
so an interrupted or failed write leaves no partial file. Needs the client
install (safetensors writes from numpy; no torch); PyAV for video, Pillow for
PNGs. Errors are one line (exit 2 for what the user can fix, 1 from the
server); Ctrl-C, SIGTERM and SIGHUP print "interrupted" (exit 128 + signal).
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import numpy as np

from .dtypes import is_torch
from .encoding import LATENTS, OUTPUT_TYPES
from .errors import LocalInputError, VaedError
from .export import folder_problem

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov")
OUTPUT_SUFFIXES = (".safetensors", ".npy")


def read_frames(path: pathlib.Path) -> np.ndarray:
    """The input's frames: uint8 [T, H, W, 3] from a video or PNG folder, or the .npy as saved;
    LocalInputError, naming the file, for one that is missing or cannot be read."""
    if path.is_dir():
        return _read_png_folder(path)
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
            if not container.streams.video:  # decode(video=0) raised IndexError
                raise LocalInputError(f"{path} holds no video stream")
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (ValueError, OSError) as exc:  # numpy's object arrays; PyAV's errors are ValueErrors or OSErrors
        if isinstance(exc, LocalInputError):
            raise
        raise LocalInputError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise LocalInputError(f"{path}: its video stream holds no frames")
    return np.stack(frames)


def _read_png_folder(path: pathlib.Path) -> np.ndarray:
    from PIL import Image

    files = sorted(path.glob("*.png"))
    if not files:
        raise LocalInputError(f"{path} holds no .png frames")
    frames = []
    for file in files:
        try:
            with Image.open(file) as image:
                frames.append(np.asarray(image.convert("RGB")))
        except (ValueError, OSError) as exc:  # PIL.UnidentifiedImageError is an OSError
            raise LocalInputError(f"{file}: cannot read it ({type(exc).__name__}: {exc})") from None
        if frames[-1].shape != frames[0].shape:  # np.stack raised a ValueError that named no file
            h, w = frames[0].shape[:2]
            raise LocalInputError(f"{path}: the frames differ in size: {files[0].name} is {h}x{w} (H x W), "
                                  f"{file.name} {frames[-1].shape[0]}x{frames[-1].shape[1]}")
    return np.stack(frames)


def check_output(path: pathlib.Path, force: bool) -> None:
    """LocalInputError before any call for an output that cannot be written: its suffix, its
    folder, or a file there already (without --force)."""
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise LocalInputError(f"{path}: write {' or '.join(OUTPUT_SUFFIXES)}")
    if not path.parent.is_dir():
        raise LocalInputError(f"{path}: no folder {path.parent}")
    if path.is_dir():
        raise LocalInputError(f"{path} is a folder; name the file to write")
    if path.exists() and not force:
        raise LocalInputError(f"{path} exists (use --force to overwrite)")
    # checked now: the output is written after the server's work (as root this always passes)
    if (problem := folder_problem(path)) is not None:
        raise LocalInputError(f"{path}: {problem}")


def write_output(path: pathlib.Path, key: str, result: Any) -> None:
    """`result` under `key` in `path`, through a temporary file beside it that is renamed at the
    end: an interrupted or failed write leaves no partial output (and --force's old one stays)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        if path.suffix.lower() == ".safetensors":
            _save_safetensors(temporary, key, result)
        else:
            with open(temporary, "wb") as f:  # to a path np.save adds ".npy" unless it ends so (".NPY" does not)
                np.save(f, result)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _save_safetensors(path: pathlib.Path, key: str, result: Any) -> None:
    # numpy frames give numpy results, bf16 widened to float32 (numpy has no bfloat16), which
    # safetensors.numpy writes without torch (a client-only install has none); a torch result
    # (bf16 kept) comes only where torch is installed.
    if is_torch(result):
        from safetensors.torch import save_file as save_torch

        save_torch({key: result.detach().cpu().contiguous()}, str(path))
        return
    from safetensors.numpy import save_file

    save_file({key: np.ascontiguousarray(result)}, str(path))


def add_encode_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import add_connection_arguments

    parser.add_argument("input", type=pathlib.Path, help="video file, PNG folder or .npy frames")
    parser.add_argument("-o", "--output", type=pathlib.Path, required=True, help=".safetensors or .npy")
    parser.add_argument("--output-type", choices=OUTPUT_TYPES, default="moments",
                        help="moments (mean, log-variance) or the normalised latents (default moments)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output (default: refuse)")
    add_connection_arguments(parser, None)


def run_encode(args: argparse.Namespace) -> int:
    from .cli import CommandError, _fail, connect, interrupted_exit, print_lines, terminate_as_interrupt

    try:
        with terminate_as_interrupt():
            check_output(args.output, args.force)
            frames = read_frames(args.input)
            with connect(args) as client:
                result = client.encode(frames, output_type=args.output_type)
            write_output(args.output, LATENTS if args.output_type == LATENTS else "moments", result)
    except (CommandError, LocalInputError) as e:  # CommandError: the connection flags (cli.connection_settings)
        return _fail("encode", str(e), 2)
    except VaedError as e:
        return _fail("encode", f"{args.server}: {e}", 1)
    except OSError as e:  # the output could not be written after all
        return _fail("encode", str(e), 1)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (`cli.terminate_as_interrupt`)
        return interrupted_exit("encode", e)
    return print_lines([f"{args.input} ({frames.shape[-4] if frames.dtype == np.uint8 else frames.shape[-3]} "
                        f"frames) -> {args.output} {args.output_type} {list(result.shape)}"])
