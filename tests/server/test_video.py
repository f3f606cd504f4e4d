"""vaed.video: decoded frames -> fragmented MP4, checked by decoding the bytes back with PyAV."""

from __future__ import annotations

import asyncio
import gc
import io
from collections.abc import Callable, Coroutine
from typing import Any

import av
import numpy as np
import pytest

from vaed.video import (
    Fmp4Packager,
    PackagingPool,
    VideoError,
    VideoOptions,
    avc1_profile,
)

H, W = 48, 64


def _smooth_video(frames: int, seed: int = 0) -> np.ndarray:
    """A moving colour gradient: content a codec compresses well (noise would measure only x264's
    bit budget)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:H, 0:W].astype(np.float32)
    phase = rng.uniform(0, 6.28, size=3)
    out = np.empty((frames, H, W, 3), np.uint8)
    for t in range(frames):
        for c in range(3):
            out[t, :, :, c] = (127.5 + 100 * np.sin((x + 2 * t) / 24 + (y / 30) + phase[c])).astype(np.uint8)
    return out


def _wan_groups(video: np.ndarray) -> list[np.ndarray]:
    """Frames in the groups a Wan decode yields them: 1, then 4 per latent frame."""
    return [video[:1]] + [video[i:i + 4] for i in range(1, video.shape[0], 4)]


def _decode(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _package(video: np.ndarray, options: VideoOptions) -> list[bytes]:
    packager = Fmp4Packager(options)
    return [packager.add(group) for group in _wan_groups(video)] + [packager.close()]


def test_lossless_video_decodes_back_to_the_exact_frames():
    video = _smooth_video(9)
    data = b"".join(_package(video, VideoOptions(lossless=True)))
    assert np.array_equal(_decode(data), video)


def test_h264_video_decodes_back_within_the_codecs_loss():
    video = _smooth_video(13)
    decoded = _decode(b"".join(_package(video, VideoOptions(crf=18))))
    assert decoded.shape == video.shape
    psnr = _psnr(decoded, video)
    print(f"H.264 CRF 18 PSNR on a smooth {H}x{W} video: {psnr:.1f} dB")
    assert psnr > 35.0, psnr  # CRF 18 on this content: ~40 dB; far below means frames misplaced
    # Each frame is closest to its own source frame: none dropped, duplicated or reordered.
    for t in range(video.shape[0]):
        assert int(np.argmax([_psnr(decoded[t], source) for source in video])) == t


def _top_boxes(data: bytes) -> list[bytes]:
    """The types of the top-level boxes of MP4 bytes, walked by their sizes."""
    kinds, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        assert size >= 8 and at + size <= len(data), f"box at {at} of size {size} overruns the bytes"
        kinds.append(data[at + 4:at + 8])
        at += size
    return kinds


def test_fragments_leave_as_frames_are_added():
    """Each add returns the init segment (first) and the fragment of every frame it was given:
    the bytes so far are a playable file of every frame added, the first group's frame
    included (it does not wait for the next packet, as FFmpeg's mov muxer would make it)."""
    video = _smooth_video(9)
    packager = Fmp4Packager(VideoOptions(lossless=True))
    sent = b""
    for group in _wan_groups(video):
        part = packager.add(group)
        init = [b"ftyp", b"moov"] if not sent else []
        assert _top_boxes(part) == init + [b"moof", b"mdat"] * group.shape[0]  # each frame's fragment
        sent += part
        assert np.array_equal(_decode(sent), video[:packager.frames_in])
    assert packager.close() == b""  # zerolatency: nothing is left in the encoder
    assert _top_boxes(sent).count(b"moof") == video.shape[0]


def test_mime_type_names_the_stream_profile():
    packager = Fmp4Packager(VideoOptions())
    assert packager.mime_type is None
    packager.add(_smooth_video(1))
    assert packager.mime_type is not None and packager.mime_type.startswith('video/mp4; codecs="avc1.64')  # High
    lossless = Fmp4Packager(VideoOptions(lossless=True))
    lossless.add(_smooth_video(1))
    assert lossless.mime_type is not None and 'avc1.f4' in lossless.mime_type  # High 4:4:4 Predictive


def test_avc1_profile_reads_annex_b_and_avcc():
    sps = b"\x67\x64\x00\x1f\xac"
    assert avc1_profile(b"\x00\x00\x00\x01" + sps) == "64001f"
    assert avc1_profile(b"\x00\x00\x01\x68\xee" + b"\x00\x00\x01" + sps) == "64001f"  # PPS first
    assert avc1_profile(b"\x01\x4d\x40\x1e\xff") == "4d401e"
    with pytest.raises(VideoError, match="sequence parameter set"):
        avc1_profile(b"\x00\x00\x01\x68\xee")


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (np.zeros((1, 47, 64, 3), np.uint8), "even sides"),
        (np.zeros((1, 48, 64, 3), np.float32), "uint8 frames"),
        (np.zeros((1, 48, 64), np.uint8), "uint8 frames"),
        (np.zeros((48, 64, 3), np.uint8), "uint8 frames"),
    ],
    ids=["odd-height", "float", "no-channels", "no-time-axis"],
)
def test_bad_frames_are_refused(frames, message):
    with pytest.raises(VideoError, match=message):
        Fmp4Packager(VideoOptions()).add(frames)


def test_frame_size_change_and_use_after_close_are_refused():
    packager = Fmp4Packager(VideoOptions())
    packager.add(np.zeros((1, 48, 64, 3), np.uint8))
    with pytest.raises(VideoError, match="frame size changed"):
        packager.add(np.zeros((1, 32, 64, 3), np.uint8))
    packager.close()
    assert packager.close() == b""
    with pytest.raises(VideoError, match="closed"):
        packager.add(np.zeros((1, 48, 64, 3), np.uint8))
    with pytest.raises(VideoError, match="no frames"):
        Fmp4Packager(VideoOptions()).close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"fps": 0}, "fps"), ({"crf": 52}, "crf"), ({"preset": "warp"}, "preset")],
    ids=["fps", "crf", "preset"],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(VideoError, match=message):
        VideoOptions(**kwargs)


def test_pool_packages_sessions_in_parallel_each_in_order():
    """Two videos interleaved on a two-thread pool give the bytes each gives alone (x264 is
    deterministic), so each video's steps ran in its own order."""
    videos = [_smooth_video(9, seed=1), _smooth_video(13, seed=2)]
    options = VideoOptions(crf=20)
    alone = [b"".join(_package(video, options)) for video in videos]
    pool = PackagingPool(threads=2)

    async def one(video: np.ndarray) -> bytes:
        packager = pool.packager(options)
        # every step submitted at once: the packager's own lock must keep them in order
        parts = await asyncio.gather(*(packager.add(group) for group in _wan_groups(video)))
        return b"".join(parts) + await packager.close()

    async def both() -> list[bytes]:
        return list(await asyncio.gather(*(one(video) for video in videos)))

    try:
        together = asyncio.run(both())
    finally:
        pool.shutdown()
    assert together == alone
    with pytest.raises(ValueError, match=">= 1"):
        PackagingPool(threads=0)


def test_an_encoder_opened_before_the_first_frame_gives_the_same_file():
    """`open` (what a call does from the latents' header, while frame 0 decodes) changes no byte
    of the file; a second open of the same size is nothing, another size or an odd side is refused."""
    video = _smooth_video(9)
    for options in (VideoOptions(crf=20), VideoOptions(lossless=True)):
        early = Fmp4Packager(options)
        early.open(H, W)
        early.open(H, W)
        parts = [early.add(group) for group in _wan_groups(video)] + [early.close()]
        assert parts == _package(video, options)
    with pytest.raises(VideoError, match="frame size changed"):
        early = Fmp4Packager(VideoOptions())
        early.open(H, W)
        early.open(H, W + 2)
    with pytest.raises(VideoError, match="even sides"):
        Fmp4Packager(VideoOptions()).open(H, W + 1)
    with pytest.raises(VideoError, match="no frames"):
        opened = Fmp4Packager(VideoOptions())
        opened.open(H, W)
        opened.close()


def _run_then_shut_down(pool: PackagingPool, run: Callable[[], Coroutine[Any, Any, list[bytes]]]) -> list[bytes]:
    try:
        return asyncio.run(run())
    finally:
        pool.shutdown()


def test_an_early_open_on_the_pool_runs_before_the_first_step_and_reports_there():
    """`AsyncPackager.open_early` starts the open on the pool without waiting (its event already
    set): the first add sees the encoder open and gives the plain bytes; an odd side fails that
    add (not the open_early call); a failed open discarded after it failed, or while it ran,
    leaves no unretrieved exception behind."""
    video = _smooth_video(5)
    options = VideoOptions(crf=20)
    pool = PackagingPool(threads=1)
    unhandled: list[dict] = []

    async def run() -> list[bytes]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        ready = asyncio.Event()
        ready.set()
        packager = pool.packager(options)
        packager.open_early(H, W, after=ready)
        parts = [await packager.add(group) for group in _wan_groups(video)] + [await packager.close()]
        odd = pool.packager(options)
        odd.open_early(H, W + 1, after=ready)
        with pytest.raises(VideoError, match="even sides"):
            await odd.add(video[:1, :, :W])
        dropped = pool.packager(options)
        dropped.open_early(H + 1, W, after=ready)
        opening = dropped._opening
        assert opening is not None
        await asyncio.wait([opening])  # the open failed; asyncio.wait does not retrieve its exception
        assert opening.done() and not opening.cancelled()
        dropped.discard()
        await asyncio.sleep(0)  # its done callbacks run
        del opening  # collected on the running loop: an exception never retrieved is reported now
        in_flight = pool.packager(options)
        in_flight.open_early(H + 1, W, after=ready)
        await asyncio.sleep(0)  # the open is on the pool
        in_flight.discard()
        await asyncio.get_running_loop().run_in_executor(pool._executor, lambda: None)  # and has failed
        await asyncio.sleep(0)
        gc.collect()
        return parts

    assert _run_then_shut_down(pool, run) == _package(video, options)
    gc.collect()  # an exception never retrieved is reported when its future is collected
    assert not unhandled, unhandled


def test_an_open_after_an_event_starts_only_once_it_is_set(monkeypatch: pytest.MonkeyPatch):
    """`open_early(after=event)` submits nothing to the pool until the event is set (a session's
    `launched`); set, the first add waits for the open and gives the plain bytes. An open
    discarded before its event never runs."""
    video = _smooth_video(5)
    options = VideoOptions(crf=20)
    pool = PackagingPool(threads=1)
    opens: list[tuple[int, int]] = []
    real_open = Fmp4Packager.open

    def recorded_open(self: Fmp4Packager, height: int, width: int) -> None:
        opens.append((height, width))
        real_open(self, height, width)

    monkeypatch.setattr(Fmp4Packager, "open", recorded_open)

    async def drained() -> None:  # the pool's one thread ran everything submitted before this
        await asyncio.get_running_loop().run_in_executor(pool._executor, lambda: None)

    async def run() -> list[bytes]:
        late = asyncio.Event()
        dropped = pool.packager(options)
        dropped.open_early(H + 2, W, after=late)
        await drained()
        assert opens == []  # not before its event
        dropped.discard()
        late.set()
        await asyncio.sleep(0)
        await drained()
        assert opens == []  # nor once its event came after the discard
        launched = asyncio.Event()
        packager = pool.packager(options)
        packager.open_early(H, W, after=launched)
        await drained()
        assert opens == []
        launched.set()
        parts = [await packager.add(group) for group in _wan_groups(video)] + [await packager.close()]
        assert opens[0] == (H, W)
        return parts

    assert _run_then_shut_down(pool, run) == _package(video, options)


def _threads() -> int:
    """This process's threads, native ones included (x264's are not Python threads)."""
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_an_abandoned_packager_frees_its_encoder_at_once():
    """A call cut before its video closed: `abandon` frees x264 (its threads) now, not at a later
    cyclic garbage collection (off here, so only abandon can free it); opened but never fed, or
    never opened, too, and a close with no frames; a closed packager's abandon is a no-op."""
    first = Fmp4Packager(VideoOptions())  # the first encode's one-time threads come here
    first.add(_smooth_video(1))
    first.close()
    gc.disable()
    try:
        for feed in (True, False):
            before = _threads()
            packager = Fmp4Packager(VideoOptions())
            packager.open(480, 832)
            if feed:
                packager.add(_smooth_video(1).repeat(10, axis=1).repeat(13, axis=2))
            assert _threads() > before  # x264's own threads
            packager.abandon()
            assert _threads() <= before
            with pytest.raises(VideoError, match="already closed"):
                packager.add(_smooth_video(1))
        before = _threads()
        empty = Fmp4Packager(VideoOptions())
        empty.open(480, 832)
        with pytest.raises(VideoError, match="no frames were packaged"):
            empty.close()  # a call that ends with no frames: its early-opened encoder goes too
        assert _threads() <= before
        Fmp4Packager(VideoOptions()).abandon()
        done = Fmp4Packager(VideoOptions())
        data = done.add(_smooth_video(2)) + done.close()
        done.abandon()
        assert _decode(data).shape[0] == 2
    finally:
        gc.enable()


def test_discard_frees_an_idle_encoder_on_the_pool_not_on_the_event_loop(monkeypatch: pytest.MonkeyPatch):
    """A call cut between its steps: closing its opened encoder flushes x264 and joins its
    threads; `discard` (on the event loop, at the call's end) ran that inline, and now leaves it
    to the pool."""
    import threading

    where: list[str] = []
    original = Fmp4Packager.abandon

    def abandon(self: Fmp4Packager) -> None:
        where.append(threading.current_thread().name)
        original(self)

    monkeypatch.setattr(Fmp4Packager, "abandon", abandon)
    pool = PackagingPool(threads=2)

    async def run() -> None:
        packager = pool.packager(VideoOptions())
        await packager.add(_smooth_video(1))  # opened and fed; no step running now
        packager.discard()
        for _ in range(6000):
            if where:
                break
            await asyncio.sleep(0.01)

    _run_then_shut_down(pool, run)
    assert len(where) == 1 and where[0] != threading.main_thread().name, where


def test_discard_frees_the_encoder_after_the_step_still_on_the_pool(monkeypatch: pytest.MonkeyPatch):
    """A call cut while its frames encode: `discard` (from the call's end, on the event loop)
    leaves the encoder to the step running on the pool and frees it right after that step (a
    packager is fed by one thread at a time)."""
    events: list[str] = []
    release = __import__("threading").Event()
    original_add = Fmp4Packager.add

    def slow_add(self: Fmp4Packager, frames: np.ndarray, **kwargs: Any) -> bytes:
        events.append("add started")
        release.wait(60)
        out = original_add(self, frames, **kwargs)
        events.append("add ended")
        return out

    def abandon(self: Fmp4Packager) -> None:
        events.append("abandon")

    monkeypatch.setattr(Fmp4Packager, "add", slow_add)
    monkeypatch.setattr(Fmp4Packager, "abandon", abandon)
    pool = PackagingPool(threads=2)

    async def run() -> None:
        packager = pool.packager(VideoOptions())
        adding = asyncio.ensure_future(packager.add(_smooth_video(1)))
        while not events:
            await asyncio.sleep(0.01)
        adding.cancel()  # the call is cut; its step keeps running on the pool
        packager.discard()
        assert events == ["add started"]
        release.set()
        await asyncio.get_running_loop().run_in_executor(None, lambda: __import__("time").sleep(0))
        for _ in range(6000):
            if len(events) == 3:
                break
            await asyncio.sleep(0.01)

    _run_then_shut_down(pool, run)
    assert events == ["add started", "add ended", "abandon"]
