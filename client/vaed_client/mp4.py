"""Server-side MP4: `decode(latents, output_type="mp4")` asks the server for the video file.

The server encodes each decoded group as it comes (H.264 on its CPU threads, beside the GPU) and
sends fragmented-MP4 bytes (an init segment, then fragments) in `FrameChunk.video`; their
concatenation is one MP4 file. On an H200, a 480x832x81 video arrived as 4.58 MB of MP4 in
1.156 s against 97 MB of RGB8 frames in 1.135 s: a file 21x smaller in about the same time, and no
encoder on the caller's machine. Options: `fps` (the model's by default: 16 Wan2.1, 24 Wan2.2), `crf` (0..51,
x264's 23 by default), `preset` (x264's, "veryfast" by default), `lossless=True` (H.264 RGB at
CRF 0: exactly the RGB8 frames, for files; browsers do not play it).

`mp4_path=` writes the bytes to that file as they arrive (and returns the path) instead of
holding the whole file in memory; its folder is made when missing, as `export_video` makes
its own (a file in the way is refused before the call). An `Mp4Progress` path also reports
how many frames the server has encoded as the bytes arrive (the progress bar of
`vaed-client decode`).

Resuming (`vaed_client.resume`): a frame call resumes where it stopped (`skip_frames`), but MP4
bytes cannot be spliced: x264's output depends on the host's thread count, so a second server's
fragments do not continue the first one's file. An MP4 call whose server fails therefore asks
the next server for the whole video again and drops what had arrived (the file at `mp4_path` is
emptied first), under the same `ResumePolicy` as frame calls. A failed call leaves no file at
`mp4_path`: a file there is always a whole video.
"""

from __future__ import annotations

import numbers
import os
import pathlib
from collections.abc import Callable
from typing import Any, BinaryIO

from . import wire
from .errors import LocalInputError
from .outputs import MP4

pb = wire.pb
# What the server accepts (vaed.video.VideoOptions); checked here so a typo fails before the call.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


def video_fields(
    options: Any, *, lossless: bool, fps: int | None, crf: int | None, preset: str | None,
) -> None:
    """Set DecodeOptions' video fields (format MP4 / MP4_LOSSLESS, fps, crf, preset) in place."""
    options.format = pb.MP4_LOSSLESS if lossless else pb.MP4
    if fps is not None:
        if not 1 <= _whole(fps, "fps") <= 240:
            raise LocalInputError(f"fps must be in 1..240, got {fps}")
        options.fps = int(fps)
    if crf is not None:
        if lossless:
            raise LocalInputError("crf applies to lossy MP4; lossless=True is always CRF 0")
        if not 0 <= _whole(crf, "crf") <= 51:
            raise LocalInputError(f"crf must be in 0..51, got {crf}")
        options.crf = int(crf)
    if preset is not None:
        if preset not in X264_PRESETS:
            raise LocalInputError(f"preset must be one of {', '.join(X264_PRESETS)}, got {preset!r}")
        options.preset = preset


def _whole(value: Any, name: str) -> int:
    """`value` as an int; a fraction or a bool is refused, not truncated (fps=23.976 made a
    23 fps video, whose timing drifts from the source's)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LocalInputError(f"{name} must be a whole number, got {value!r}"
                              + (" (the server's MP4 frame rates are whole numbers of frames a second)"
                                 if name == "fps" else ""))
    return int(value)


def check_no_video_options(output_type: str, **given: Any) -> None:
    """Video options asked of a frame output type are a mistake, not something to ignore."""
    named = [name for name, value in given.items() if value not in (None, False)]
    if named:
        raise LocalInputError(f"{', '.join(named)}: options of output_type='mp4', not of {output_type!r}")


def mp4_output(output_type: str, mp4_path: str | os.PathLike[str] | None) -> Mp4Output | None:
    """The container of an "mp4" call's bytes; None for a frame call (mp4_path is then a mistake)."""
    if output_type == MP4:
        if mp4_path is not None and pathlib.Path(mp4_path).is_dir():  # before the call, not after its first bytes
            raise LocalInputError(f"mp4_path {os.fspath(mp4_path)} is a directory; name the .mp4 file to write")
        if mp4_path is not None:
            from .export import folder_problem

            problem = folder_problem(pathlib.Path(mp4_path))
            if problem:
                raise LocalInputError(f"mp4_path {os.fspath(mp4_path)}: {problem}")
        on_frames = mp4_path.on_frames if isinstance(mp4_path, Mp4Progress) else None
        return Mp4Output(mp4_path, on_frames)
    if mp4_path is not None:
        raise LocalInputError("mp4_path is for output_type='mp4'")
    return None


class Mp4Progress(os.PathLike[str]):
    """An `mp4_path` that also reports progress: `on_frames(n)` as bytes arrive, n being the
    frames the server had encoded when it sent them (0 again when a resumed call starts over)."""

    def __init__(self, path: str | os.PathLike[str], on_frames: Callable[[int], None]) -> None:
        self.path = os.fspath(path)
        self.on_frames = on_frames

    def __fspath__(self) -> str:
        return self.path


class Mp4Output:
    """One MP4 call's bytes: held in memory, or written to `path` as they arrive."""

    def __init__(self, path: str | os.PathLike[str] | None,
                 on_frames: Callable[[int], None] | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self._parts: list[bytes] = []
        self._file: BinaryIO | None = None
        self._on_frames = on_frames
        self.bytes = 0

    def restart(self) -> None:
        """A new attempt sends the whole file again: forget what arrived."""
        self._parts.clear()
        self.bytes = 0
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
        if self._on_frames is not None:
            self._on_frames(0)

    def add(self, reply: Any) -> None:
        data = reply.video
        if not data:
            return
        self.bytes += len(data)
        if self.path is None:
            self._parts.append(data)
        else:
            if self._file is None:
                self._file = self._open()
            self._file.write(data)
        if self._on_frames is not None:
            # the bytes came from encoding the piece that starts at first_frame: frames before it are in
            self._on_frames(int(reply.first_frame))

    def _open(self) -> BinaryIO:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)  # as export's writers do
        return open(self.path, "wb")  # closed by result or discard

    def result(self) -> bytes | pathlib.Path:
        if self.path is None:
            data = b"".join(self._parts)
            self._parts.clear()
            return data
        if self._file is None:
            self._file = self._open()  # an empty file: a video with no bytes yet
        self._file.close()
        return self.path

    def discard(self) -> None:
        """The call failed: no half file stays at `path`."""
        self._parts.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)


__all__ = ["MP4", "X264_PRESETS", "Mp4Output", "Mp4Progress", "mp4_output", "video_fields", "check_no_video_options"]
