"""Server-side video packaging: decoded RGB8 frames -> fragmented MP4 (fMP4) bytes, as they decode.

A front that answers video instead of raw frames feeds each decoded group (1 frame, then 4 per
latent frame) to a `Fmp4Packager` and sends the bytes it returns at once: first the init segment
(`ftyp` + an empty `moov`), then one `moof` + `mdat` fragment per video frame. The concatenated
bytes are one valid MP4 file, and a player (Media Source Extensions) can start on the first
fragment while the decode goes on.

Choices, and why:
- H.264 yuv420p through PyAV's libx264: H100/H200 have no hardware video encoder, so this is CPU
  work, and x264 is the encoder every browser can play. CRF 23 by default (x264's own default).
  A server hands it yuv420p planes converted on its device (`vaed.yuv`), not RGB for swscale.
- `tune=zerolatency`: no B-frames and no lookahead, so each frame's packet leaves the encoder with
  the frame. x264's default lookahead holds ~40 frames back — half a Wan video — before the first
  packet, which would turn streaming into "everything at the end".
- One fragment per frame, written by `vaed.fmp4` as soon as x264 returns the frame's packet, so
  the bytes a call to `add` returns hold every frame given so far: the first frame (a group of
  its own) leaves with the first group. FFmpeg's mov muxer writes only the init segment: it
  would cut each fragment when the *next* packet arrives, and PyAV cannot flush it earlier
  (`vaed.fmp4` says why). ~108 bytes of boxes per frame, under 0.1 % of a 480p frame's H.264.
- The lossless choice is libx264rgb at CRF 0 in rgb24: exact RGB (yuv444p at CRF 0 is not — the
  RGB -> YUV conversion itself rounds). Browsers do not play it; it is for files.
- The encoder opens before the first frame (`Fmp4Packager.open`): a call knows its frame size
  from its latents, so x264 starts while frame 0 still decodes instead of after it; the call
  core waits for frame 0's kernels to be launched first (`AsyncPackager.open_early(after=)`),
  so x264's start (threads, buffers, Python around them) never competes with that launch.

PyAV releases the GIL while it encodes, so packagers of several sessions run in parallel on a
thread pool (`PackagingPool`, `vaed serve --video-threads`) beside the asyncio loop and the
device threads. Both fronts use it through the call core (`vaed.calls`): a gRPC Decode with
format MP4 and an HTTP `output_type=mp4` are the same code from the decoded group to the bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from . import fmp4
from .yuv import rgb8_to_yuv420p

T = TypeVar("T")

DEFAULT_CRF = 23
DEFAULT_PRESET = "veryfast"  # ~2x faster than x264's "medium" for ~10 % more bytes
# Wan's frame rates: Wan2.1 generates 16 fps, Wan2.2 (TI2V-5B) 24 fps.
DEFAULT_FPS = {"wan2.1": 16, "wan2.2": 24}
# Packaging threads per served device at most (see `default_threads`).
MAX_DEFAULT_THREADS = 8
# The init segment alone: an empty moov (the samples are in fragments) and fragments whose
# offsets count from their moof, as `vaed.fmp4` writes them; frag_custom: FFmpeg cuts none itself.
_MOVFLAGS = "frag_custom+empty_moov+default_base_moof"


class VideoError(ValueError):
    """Frames or options that cannot be packaged (the caller's input)."""


# x264 refuses a side past 16384 pixels: asked for 8x16400 frames, its open failed (an
# FFmpeg error, not the caller's reason) after the decode had started.
MAX_H264_SIDE = 16384


def check_frame_size(height: int, width: int) -> None:
    """Raise VideoError for frames H.264 cannot hold: odd sides (4:2:0 halves them) or a side
    past x264's limit. Calls check it from the latents' header, before the session opens."""
    if height % 2 or width % 2:
        raise VideoError(f"H.264 video needs even sides, got {height}x{width} (H x W)")
    if max(height, width) > MAX_H264_SIDE:
        raise VideoError(f"H.264 video is at most {MAX_H264_SIDE} pixels a side, and these latents decode to "
                         f"{height}x{width} (H x W) frames; ask for frames instead (gRPC: RGB8; HTTP: "
                         "output_type=pt&partial_postprocess=true)")


def default_fps(patch_size: int | None) -> int:
    """Wan2.2's VAE patchifies its output (patch_size 2) and generates 24 fps; Wan2.1's does
    neither and generates 16 fps."""
    return DEFAULT_FPS["wan2.2" if patch_size else "wan2.1"]


def default_threads(cpu_count: int | None, devices: int) -> int:
    """`--video-threads`' default: half the host's cores per served device, 1 to 8. The other
    half is left to the event loop and the device threads. A session takes one thread at a time
    (its steps run in order), so threads beyond the sessions that ask for video at once buy
    nothing. The pool bounds encodes at once, not cores: x264 keeps its automatic thread count
    (PyAV's thread_count 0), slicing each frame over several of the host's cores
    (benchmarks/bench_http.py reports the server's cores in use)."""
    per_device = (cpu_count or 2) // max(1, devices)
    return max(1, min(MAX_DEFAULT_THREADS, per_device // 2))


@dataclasses.dataclass(frozen=True)
class VideoOptions:
    fps: int = 16                   # a front fills in the model's (`default_fps`) when none is asked
    crf: int = DEFAULT_CRF          # 0..51, lower is better; ignored when lossless
    preset: str = DEFAULT_PRESET    # an x264 preset name
    lossless: bool = False          # libx264rgb CRF 0 (exact RGB, not browser-playable)

    def __post_init__(self) -> None:
        if not 1 <= self.fps <= 240:
            raise VideoError(f"fps must be in 1..240, got {self.fps}")
        if not 0 <= self.crf <= 51:
            raise VideoError(f"crf must be in 0..51, got {self.crf}")
        if self.preset not in _X264_PRESETS:
            raise VideoError(f"preset must be one of {', '.join(_X264_PRESETS)}, got {self.preset!r}")


_X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


class Fmp4Packager:
    """One video's fMP4 stream. Not thread-safe: one packager is fed by one caller at a time, in
    frame order (`PackagingPool.packager` keeps that order across threads)."""

    def __init__(self, options: VideoOptions) -> None:
        self.options = options
        self._sink = _Sink()
        self._container: Any = None
        self._stream: Any = None
        self._shape: tuple[int, int] | None = None
        self._track: tuple[int, int] | None = None  # (track_ID, timescale) from the init segment
        self._fragments = 0
        self.frames_in = 0
        self.closed = False

    def open(self, height: int, width: int) -> None:
        """Open the encoder for `height` x `width` frames; the first `add` does it otherwise. A
        call knows its frame size from the latents' header, so it opens the encoder while frame 0
        still decodes: x264's start (its threads, its buffers) is ~7 ms at 720p on 2 cores, and on
        an H200 host a first add took 12-14 ms against 9-11 ms for later frames; opened early,
        720p first fragments came 5-8 ms sooner there."""
        if self._shape is not None:
            if (height, width) != self._shape:
                raise VideoError(f"frame size changed from {self._shape} to {(height, width)}")
            return
        import av  # imported when a call first asks for video: most servers never do

        check_frame_size(height, width)
        container = av.open(self._sink, mode="w", format="mp4", options={"movflags": _MOVFLAGS})
        if self.options.lossless:
            stream = container.add_stream("libx264rgb", rate=self.options.fps)
            stream.pix_fmt = "rgb24"
            stream.options = {"crf": "0", "preset": self.options.preset, "tune": "zerolatency"}
        else:
            stream = container.add_stream("libx264", rate=self.options.fps)
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(self.options.crf), "preset": self.options.preset, "tune": "zerolatency"}
        stream.width, stream.height = width, height
        stream.codec_context.open()  # x264 starts here, not at the first frame
        self._container, self._stream, self._shape = container, stream, (height, width)

    @property
    def mime_type(self) -> str | None:
        """The type a browser's MediaSource needs (`video/mp4; codecs="avc1.PPCCLL"`), read from
        the encoder's sequence parameter set; None before the first frame."""
        if self._stream is None:
            return None
        return f'video/mp4; codecs="avc1.{avc1_profile(bytes(self._stream.codec_context.extradata or b""))}"'

    def add(self, frames: np.ndarray, *, yuv420p: bool = False) -> bytes:
        """Encode uint8 frames, RGB `[t, H, W, 3]` or (`yuv420p`, H.264 only) their planes
        `[t, 3H/2, W]` as `vaed.yuv.rgb8_to_yuv420p` makes them; returns the bytes that became
        final (may be b""). RGB frames for H.264 are converted here with that same function, so
        both forms of the same frames give the same bytes."""
        if self.closed:
            raise VideoError("the video is already closed")
        if yuv420p:
            if self.options.lossless:
                raise VideoError("lossless video is encoded from RGB frames, not yuv420p")
            if frames.dtype != np.uint8 or frames.ndim != 3 or frames.shape[1] % 3:
                raise VideoError(f"expected uint8 yuv420p frames [t, 3H/2, W], got {frames.dtype} {list(frames.shape)}")
            self.open(frames.shape[1] * 2 // 3, frames.shape[2])
        else:
            if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
                raise VideoError(f"expected uint8 frames [t, H, W, 3], got {frames.dtype} {list(frames.shape)}")
            self.open(frames.shape[1], frames.shape[2])
            if not self.options.lossless:
                frames = rgb8_to_yuv420p(torch.from_numpy(np.ascontiguousarray(frames))).numpy()
        import av

        pix_fmt = self._stream.pix_fmt
        out = []
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format=pix_fmt)
            out += [self._fragment(packet) for packet in self._stream.encode(frame)]
            self.frames_in += 1
        return b"".join(out)

    def close(self) -> bytes:
        """Flush the encoder; returns the last bytes of the file (none with zerolatency)."""
        if self.closed:
            return b""
        if not self.frames_in:
            self.abandon()  # an encoder opened early goes too
            raise VideoError("no frames were packaged")
        self.closed = True
        out = b"".join(self._fragment(packet) for packet in self._stream.encode())
        self._container.close()  # FFmpeg's fragment of the first packet and its index: not ours to send
        self._sink.take()
        return out

    def abandon(self) -> None:
        """The call ended without its video (cut or failed): free the encoder now. x264's threads
        and buffers otherwise lived until a cyclic garbage collection: on a 2-core machine 20
        cut 480x832 calls held 60 more threads and ~250 MB."""
        if self.closed:
            return
        self.closed = True
        if self._container is not None:
            # the encoder goes with the last reference to its container and stream, once closed
            # (the bytes closing writes go nowhere)
            self._container.close()
            self._container = self._stream = None

    def _fragment(self, packet: Any) -> bytes:
        """The packet's fragment, after the init segment for the first one. FFmpeg writes the
        init segment once it has the first packet (it needs the encoder's headers), and is
        given no other: every fragment is `vaed.fmp4`'s."""
        init = b""
        if self._track is None:
            self._container.mux(packet)
            init = self._sink.take()
            self._track = fmp4.track_facts(init)
        track_id, timescale = self._track
        ticks = timescale * packet.time_base  # track ticks per packet tick
        frame_ticks = timescale / self.options.fps
        if ticks.denominator != 1 or frame_ticks != int(frame_ticks):
            raise VideoError(f"timescale {timescale} does not hold {self.options.fps} fps in whole ticks")
        self._fragments += 1
        return init + fmp4.fragment(self._fragments, track_id, packet.dts * int(ticks), int(frame_ticks),
                                    fmp4.length_prefixed(bytes(packet)), packet.is_keyframe)


def avc1_profile(extradata: bytes) -> str:
    """`PPCCLL` (profile_idc, constraint flags, level_idc in hex) from H.264 headers in Annex B
    form (x264's extradata) or avcC form (what MP4 stores)."""
    if extradata[:1] == b"\x01" and len(extradata) >= 4:  # avcC: version 1, then the three bytes
        return extradata[1:4].hex()
    for start in (b"\x00\x00\x00\x01", b"\x00\x00\x01"):
        at = extradata.find(start)
        while at >= 0:
            nal = extradata[at + len(start):]
            if nal and nal[0] & 0x1F == 7 and len(nal) >= 4:  # NAL type 7: sequence parameter set
                return nal[1:4].hex()
            at = extradata.find(start, at + 1)
    raise VideoError("the encoder produced no H.264 sequence parameter set")


class _Sink:
    """A write-only, non-seekable file for PyAV: the muxer then writes fragments strictly in
    order (never seeking back to patch a header), and bytes handed out are not kept."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class PackagingPool:
    """A bounded pool of CPU threads that encode video for every session (`--video-threads`).

    Each session's packager runs its steps in order (one step at a time per session); sessions
    run in parallel up to the pool's size. A session waiting for its encoder holds back only its
    own frames: the device worker keeps decoding up to the session's credit window.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"encode threads must be >= 1, got {threads}")
        self.threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vaed-video")

    def packager(self, options: VideoOptions) -> AsyncPackager:
        return AsyncPackager(Fmp4Packager(options), self._executor)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class AsyncPackager:
    """A packager whose steps run on the pool; `add`/`close` are awaited in frame order."""

    def __init__(self, packager: Fmp4Packager, executor: concurrent.futures.Executor) -> None:
        self._packager = packager
        self._executor = executor
        self._lock = asyncio.Lock()  # one step of this video at a time, in call order
        self._opening: asyncio.Future[None] | None = None
        self._step: concurrent.futures.Future[Any] | None = None  # the last one on the pool

    def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """One step on the pool, remembered so that `discard` frees the encoder after it."""
        self._step = self._executor.submit(fn, *args, **kwargs)
        return asyncio.wrap_future(self._step)

    @property
    def frames_in(self) -> int:
        return self._packager.frames_in

    def open_early(self, height: int, width: int, *, after: asyncio.Event) -> None:
        """Open the encoder on the pool once `after` is set, without waiting (`Fmp4Packager.open`):
        a session's `launched`, so x264's start runs while the GPU decodes frame 0, not beside
        the Python that launches its kernels. The next step waits for it, and a failure (an odd
        frame side) is raised there."""
        if self._opening is not None:
            return
        async def open_after() -> None:
            await after.wait()
            await self._run(self._packager.open, height, width)

        self._opening = asyncio.ensure_future(open_after())

    async def add(self, frames: np.ndarray, *, yuv420p: bool = False) -> bytes:
        async with self._lock:
            await self._opened()
            return await self._run(self._packager.add, frames, yuv420p=yuv420p)

    async def close(self) -> bytes:
        async with self._lock:
            await self._opened()
            return await self._run(self._packager.close)

    async def _opened(self) -> None:
        if self._opening is not None:
            opening, self._opening = self._opening, None
            await opening

    def discard(self) -> None:
        """The call is over: free the encoder of a video that did not close (a cut or failed
        call), on the pool, after the step still running there if there is one (a packager is
        fed by one thread at a time). Also drop an early open the call never waited for: one still
        waiting for its event never starts, and a failed one is not reported as never retrieved
        (asyncio's cancel() clears that report on a future already done, and cancels a pending
        one)."""
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
        step = self._step
        if step is not None and not step.done():
            step.add_done_callback(lambda _: self._packager.abandon())  # on the pool, after the step
            return
        # on the pool too: closing an opened encoder flushes x264 and joins its threads, which
        # the event loop (discard's caller, at a call's end) must not wait for
        try:
            self._executor.submit(self._packager.abandon)
        except RuntimeError:  # the pool was shut down (the server stopping): free it here
            self._packager.abandon()
