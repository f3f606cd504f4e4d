"""Writing decoded frames to files: `export_video` and the streaming writers
`vaed-client decode` uses.

Containers (PyAV, the `video` extra; Pillow for PNG):
- `.mp4`: H.264 yuv420p CRF 18 (visually lossless at 480p-720p, not exact:
  ~26 dB on random-weights noise); even sides (an odd last row/column is
  cropped). With `lossless=True`: `libx264rgb` at CRF 0 in rgb24, bit-exact
  RGB (yuv444p at CRF 0 is not: the RGB->YUV conversion itself rounds).
- `.mkv`: FFV1 in bgr0, always lossless, any size.
- a folder (no suffix, or a trailing `/`): one PNG per frame, lossless;
  `export_video` removes the folder's earlier frame_NNNNN.png first (it
  overwrites, as for a file), and nothing else there.
Missing folders are made.

Scaling rule: uint8 frames are written as they are, never multiplied by 255
again (the bug of feeding vaed's uint8 frames to diffusers' `export_to_video`);
float frames must be in [0, 1] and are rounded `x * 255` like diffusers' PIL
path; float frames whose values look like 0..255 raise instead of clipping.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from typing import Any, Protocol

import numpy as np

from .dtypes import is_torch

log = logging.getLogger(__name__)

# libx264 CRF 18 is visually lossless for 480p-720p content; mpeg4 (the
# fallback when FFmpeg lacks x264) gets a bit budget instead: 0.25 bit/pixel.
X264_CRF = "18"
MPEG4_BITS_PER_PIXEL = 0.25
# PNG level 1 writes ~3x faster than the default 6 for ~15 % larger files;
# these are intermediate frames, speed matters more.
PNG_COMPRESS_LEVEL = 1
SUPPORTED_OUTPUTS = (
    ".mp4 (H.264; lossless with lossless=True, or --lossless), .mkv (FFV1, lossless), or a folder of PNG frames "
    "(no suffix)"
)


class ExportError(ValueError):
    """An output path or frames this module cannot write."""


# -- frames --------------------------------------------------------------------
def to_uint8_video(frames: Any) -> np.ndarray:
    """One video in any client / diffusers form -> uint8 `[T, H, W, 3]`.

    Accepts uint8 `[T, H, W, 3]`, float np `[T, H, W, 3]` in [0, 1], torch
    `[T, 3, H, W]` float in [0, 1] (diffusers "pt") or uint8 `[T, H, W, 3]`,
    a list of PIL images or of `[H, W, 3]` arrays, and any of these with a
    leading batch axis of 1.
    """
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise ExportError("no frames to write")
        if len(frames) == 1 and isinstance(frames[0], (list, tuple)):
            frames = frames[0]  # [[PIL, ...]] of one batch item
        frames = np.stack([np.asarray(f) for f in frames])
    elif is_torch(frames):
        tensor = frames.detach().cpu()
        if tensor.ndim == 5 and tensor.shape[0] == 1:
            tensor = tensor[0]
        if tensor.is_floating_point() and tensor.ndim == 4 and tensor.shape[1] == 3 and tensor.shape[-1] != 3:
            tensor = tensor.permute(0, 2, 3, 1)  # diffusers pt [T, 3, H, W] -> [T, H, W, 3]
        frames = tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
    array = np.asarray(frames)
    if array.ndim == 5 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 5:
        raise ExportError(f"frames hold {array.shape[0]} videos; pass one (e.g. frames[0])")
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ExportError(
            f"expected frames [T, H, W, 3] (or diffusers' [T, 3, H, W] tensor), got shape {list(array.shape)}"
        )
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if not np.issubdtype(array.dtype, np.floating):
        raise ExportError(f"frames must be uint8 or float in [0, 1], got {array.dtype}")
    low, high = float(array.min(initial=0.0)), float(array.max(initial=0.0))
    if high > 1.5 or low < -0.5:
        raise ExportError(
            f"float frames must be in [0, 1], got values in [{low:.3g}, {high:.3g}]: these look like uint8 "
            "(0..255) or raw [-1, 1] values; pass uint8 frames as uint8, or output_type='np'"
        )
    return (np.clip(array.astype(np.float32), 0, 1) * 255).round().astype(np.uint8)


# -- writers -------------------------------------------------------------------
class FrameWriter(Protocol):
    def write(self, first_frame: int, frames: np.ndarray) -> None: ...
    def close(self) -> list[pathlib.Path]: ...
    def discard(self) -> None:
        """The video failed: remove what this writer wrote (a part of a video looks whole)."""


def output_paths(out: pathlib.Path, batch: int) -> list[pathlib.Path]:
    """`out` for one video; `<stem>_bN<suffix>` per item for a batch."""
    if batch == 1:
        return [out]
    return [out.with_name(f"{out.stem}_b{i}{out.suffix}") for i in range(batch)]


def _x264_available() -> bool:
    import av

    try:
        av.codec.Codec("libx264", "w")
        return True
    except Exception:  # FFmpeg builds without GPL x264
        return False


class AvWriter:
    """One video file per batch item (PyAV). Takes `[B, t, H, W, 3]` uint8
    groups; groups may arrive out of order (they wait in a reorder buffer)."""

    def __init__(self, out: pathlib.Path, fps: int, *, lossless: bool = False, crf: int = int(X264_CRF)) -> None:
        import importlib.util

        if importlib.util.find_spec("av") is None:
            raise ExportError("writing video needs PyAV: pip install 'vaed-client[video]'")
        self.out = out
        self.fps = fps
        self.crf = crf
        self.mkv = out.suffix.lower() == ".mkv"
        self.lossless = lossless or self.mkv
        self._containers: list[Any] = []
        self._streams: list[Any] = []
        self._paths: list[pathlib.Path] = []
        self._pending: dict[int, np.ndarray] = {}
        self._next = 0
        self._crop: tuple[int, int] | None = None

    def _open(self, batch: int, height: int, width: int) -> None:
        import av
        from av.video.stream import VideoStream

        options: dict[str, object]  # the codec's private options (PyAV's Stream.options)
        if self.mkv:
            codec, pix_fmt, options = "ffv1", "bgr0", {}
        elif self.lossless:
            if not _x264_available():
                raise ExportError("lossless .mp4 needs FFmpeg with libx264; write .mkv (FFV1) instead")
            codec, pix_fmt, options = "libx264rgb", "rgb24", {"crf": "0"}
        else:
            codec = "libx264" if _x264_available() else "mpeg4"
            pix_fmt, options = "yuv420p", ({"crf": str(self.crf)} if codec == "libx264" else {})
        crop_h, crop_w = height, width
        if pix_fmt == "yuv420p":
            # yuv420p subsamples chroma 2x2, so both sides must be even; Wan
            # frames are multiples of 8, other sizes lose their last row/column.
            crop_h, crop_w = height - height % 2, width - width % 2
            if (crop_h, crop_w) != (height, width):
                log.warning("cropping %dx%d (H x W) frames to %dx%d for yuv420p", height, width, crop_h, crop_w)
        self._crop = (crop_h, crop_w)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._paths = output_paths(self.out, batch)
        for path in self._paths:
            container = av.open(str(path), mode="w")
            stream = container.add_stream(codec, rate=self.fps)
            assert isinstance(stream, VideoStream)  # every codec above is a video codec
            stream.width, stream.height, stream.pix_fmt = crop_w, crop_h, pix_fmt
            if options:
                stream.options = options
            elif codec == "mpeg4":
                stream.bit_rate = int(crop_w * crop_h * self.fps * MPEG4_BITS_PER_PIXEL)
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
        for b, (container, stream) in enumerate(zip(self._containers, self._streams, strict=True)):
            for t in range(frames.shape[1]):
                image = np.ascontiguousarray(frames[b, t, :h, :w])
                for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                    container.mux(packet)

    def close(self) -> list[pathlib.Path]:
        if self._pending:
            log.warning("%d chunks never became contiguous; frames from %d on are missing",
                        len(self._pending), self._next)
        for container, stream in zip(self._containers, self._streams, strict=True):  # appended in pairs
            for packet in stream.encode():  # flush
                container.mux(packet)
            container.close()
        return self._paths

    def discard(self) -> None:
        for container in self._containers:
            container.close()
        self._containers, self._streams = [], []
        for path in self._paths:
            path.unlink(missing_ok=True)


class PngWriter:
    """One folder of PNG frames per batch item (lossless)."""

    def __init__(self, out: pathlib.Path) -> None:
        self.out = out
        self._dirs: list[pathlib.Path] = []

    def write(self, first_frame: int, frames: np.ndarray) -> None:
        try:
            from PIL import Image
        except ImportError:
            raise ExportError("writing PNG frames needs Pillow: pip install 'vaed-client[video]'") from None
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

    def discard(self) -> None:
        # an existing folder held no frames (or --force cleared them): only this run's are there
        for folder in self._dirs:
            remove_png_frames(folder)


PNG_FRAME_GLOB = "frame_[0-9][0-9][0-9][0-9][0-9]*.png"
# The names PngWriter gives (frame_{i:05d}.png: 5 digits, more from frame 100000 on); the glob
# above only finds candidates, this decides, so no other file in the folder is ever touched.
_PNG_FRAME_NAME = re.compile(r"frame_[0-9]{5,}\.png")


def _is_png_folder(text: str) -> bool:
    return text.endswith(("/", os.sep)) or not pathlib.Path(text).suffix


def is_mp4_output(out: str | os.PathLike[str]) -> bool:
    """Whether `out` names an .mp4 file (not a PNG folder, whatever its name)."""
    text = os.fspath(out)
    return not _is_png_folder(text) and pathlib.Path(text).suffix.lower() == ".mp4"


def existing_outputs(out: str | os.PathLike[str], batch: int) -> list[pathlib.Path]:
    """What writing `out` for `batch` videos would overwrite: the video files
    that exist, or the PNG folders that already hold frames (an empty folder
    counts as free)."""
    text = os.fspath(out)
    paths = output_paths(pathlib.Path(text), batch)
    if _is_png_folder(text):
        return [p for p in paths if p.is_dir() and any(png_frames(p))]
    return [p for p in paths if p.exists()]


def png_frames(folder: pathlib.Path) -> list[pathlib.Path]:
    """The frame_NNNNN.png files a PngWriter writes in `folder` (nothing else)."""
    return [p for p in folder.glob(PNG_FRAME_GLOB) if _PNG_FRAME_NAME.fullmatch(p.name)]


def remove_png_frames(folder: pathlib.Path) -> None:
    """Delete the frame_NNNNN.png files a PngWriter writes (nothing else)."""
    for frame in png_frames(folder):
        frame.unlink(missing_ok=True)


def folder_problem(path: pathlib.Path) -> str | None:
    """Why the folder of `path` can neither be used nor made (its nearest existing ancestor is a
    file, or not writable), else None: the writers make missing folders, and this lets a command
    refuse before its call instead of after the server's work."""
    folder = path.parent.absolute()
    while not folder.exists():
        if folder.parent == folder:
            return None
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {folder}"
    return None


def check_output(out: str | os.PathLike[str]) -> None:
    """ExportError, listing what is supported, unless `out` is .mp4, .mkv or a PNG folder, and
    ExportError when its folder cannot be made (`folder_problem`)."""
    text = os.fspath(out)
    if not _is_png_folder(text) and pathlib.Path(text).suffix.lower() not in (".mp4", ".mkv"):
        raise ExportError(f"{text}: unsupported output {pathlib.Path(text).suffix!r}; use {SUPPORTED_OUTPUTS}")
    # a PNG folder is made itself (its own name may be new), a video file in its parent
    target = pathlib.Path(text, "frame") if _is_png_folder(text) else pathlib.Path(text)
    problem = folder_problem(target)
    if problem:
        raise ExportError(f"cannot write {text}: {problem}")


def make_writer(out: str | os.PathLike[str], fps: int, *, lossless: bool = False,
                crf: int = int(X264_CRF)) -> FrameWriter:
    """.mp4 / .mkv -> video writer; no suffix or a trailing '/' -> PNG folder;
    any other suffix -> ExportError listing what is supported."""
    text = os.fspath(out)
    if fps < 1:
        raise ExportError(f"fps must be >= 1, got {fps}")
    check_output(text)
    if _is_png_folder(text):
        return PngWriter(pathlib.Path(text))
    if not 0 <= crf <= 51:
        raise ExportError(f"crf must be in 0..51, got {crf}")
    return AvWriter(pathlib.Path(text), fps, lossless=lossless, crf=crf)


def export_video(frames: Any, path: str | os.PathLike[str], fps: int = 16, lossless: bool = False) -> pathlib.Path:
    """Write one video (uint8 `[T, H, W, 3]`, float np/pt in [0, 1], PIL list;
    see `to_uint8_video`) to `.mp4`, lossless `.mkv`, or a PNG folder. Returns the path."""
    video = to_uint8_video(frames)
    writer = make_writer(path, fps, lossless=lossless)
    if isinstance(writer, PngWriter):  # overwrite: a shorter video must not keep an older one's last frames
        remove_png_frames(pathlib.Path(path))
    writer.write(0, video[None])
    (written,) = writer.close()
    return written
