"""A whole video's buffer lives on pages that fault without huge-page compaction, and is
faulted in on a thread of its own once its first frames are in (`heap.video_buffer`,
`heap.prefault`, `VideoAssembler`).

What is checked is the kernel's own record of the mapping (`/proc/self/smaps`: VmFlags, where
"hg" marks a range advised for transparent huge pages, and Rss, the memory resident in it),
never a time: a stall happens only on a host whose memory is fragmented.
"""

from __future__ import annotations

import mmap
import os
import platform
import threading
import time

import numpy as np
import pytest

from vaed_client import wire
from vaed_client.heap import prefault, video_buffer
from vaed_client.video import VideoAssembler

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's mapping records")

H, W = 480, 832  # one frame: 1.2 MB; a video of 81 frames, 97 MB


def _mapping(array: np.ndarray) -> dict[str, list[str]]:
    """The smaps fields (name -> values) of the mapping that holds the middle of `array`'s memory."""
    address = array.ctypes.data + array.nbytes // 2
    fields: dict[str, list[str]] = {}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, *values = line.split()
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside:
                fields[head.rstrip(":")] = values
    assert fields, "no mapping holds the array"
    return fields


def _vm_flags(array: np.ndarray) -> list[str]:
    return _mapping(array)["VmFlags"]


def _resident_bytes(array: np.ndarray) -> int:
    return int(_mapping(array)["Rss"][0]) * 1024  # smaps counts kB


def _kernel_has_populate_write() -> bool:
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


@pytest.mark.skipif(not _kernel_has_populate_write(), reason="MADV_POPULATE_WRITE came with Linux 5.14")
def test_prefault_maps_every_page_in_and_keeps_what_was_written() -> None:
    video = np.frombuffer(mmap.mmap(-1, 40 * H * W * 3), dtype=np.uint8).reshape(40, H, W, 3)
    video[3] = 5  # one frame written before: 1.2 MB of the 48 MB resident
    assert _resident_bytes(video) < video.nbytes // 4
    thread = prefault(video)
    assert thread is not None
    thread.join(60)
    assert _resident_bytes(video) >= video.nbytes  # all of it, without a write from here
    assert video[3].min() == video[3].max() == 5 and video[4:].max() == 0  # no byte changed


def _chunks(frames: np.ndarray) -> list[wire.pb.FrameChunk]:
    """A video's replies as the server groups them: frame 0, then 4 frames each."""
    out = []
    for first, end in [(0, 1)] + [(f, f + 4) for f in range(1, frames.shape[1], 4)]:
        chunk = wire.pb.FrameChunk(first_frame=first)
        wire.to_message(frames[:, first:end], out=chunk.frames)
        out.append(chunk)
    return out


@pytest.mark.skipif(not _kernel_has_populate_write(), reason="MADV_POPULATE_WRITE came with Linux 5.14")
def test_the_assembler_prefaults_the_video_once_its_first_frames_are_in() -> None:
    """Frame 0 alone makes the whole video resident (its prefault), and frames copied while a
    prefault runs stay as written."""
    frames = np.random.default_rng(1).integers(0, 255, (1, 81, H, W, 3), dtype=np.uint8)
    chunks = _chunks(frames)
    waiting = VideoAssembler("rgb8", expected_frames=81)
    waiting.add(chunks[0])
    storage = waiting._storage
    assert storage is not None
    deadline = time.monotonic() + 60  # bounds a failure only: the pages come in tens of ms
    while _resident_bytes(storage) < storage.nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident_bytes(storage) >= storage.nbytes, "frame 0 in, the rest of the video not faulted in"
    racing = VideoAssembler("rgb8", expected_frames=81)
    for chunk in chunks:  # at once, while the prefault it starts with frame 0 runs
        racing.add(chunk)
    for thread in [t for t in threading.enumerate() if t.name == "vaed-prefault"]:
        thread.join(60)
    assert np.array_equal(racing.result(as_torch=False), frames)


def test_a_video_buffer_is_writable_zero_copy_and_not_advised_for_huge_pages() -> None:
    import torch

    buffer = video_buffer((1, 81, H, W, 3), np.dtype(np.uint8))
    buffer[0, 80] = 7
    shared = torch.from_numpy(buffer)
    shared[0, 0] = 3
    assert buffer[0, 0].min() == 3 and buffer[0, 80].max() == 7  # one memory, both ways
    assert "hg" not in _vm_flags(buffer)
    assert video_buffer((0, 3), np.dtype(">f4")).shape == (0, 3)


def test_the_assembled_video_is_on_plain_pages_and_holds_the_frames() -> None:
    """numpy's own np.empty of this size is advised ("hg") wherever it advises huge pages."""
    frames = np.random.default_rng(0).integers(0, 255, (1, 81, H, W, 3), dtype=np.uint8)
    assembler = VideoAssembler("rgb8", expected_frames=81)
    for first in range(0, 81, 4):
        chunk = wire.pb.FrameChunk(first_frame=first)
        wire.to_message(frames[:, first:first + 4], out=chunk.frames)
        assembler.add(chunk)
    video = assembler.result(as_torch=False)
    assert np.array_equal(video, frames)
    assert "hg" not in _vm_flags(video)
