"""A whole video's buffer lives on pages that fault without huge-page compaction (`heap.video_buffer`).

What is checked is the kernel's own record of the mapping (`/proc/self/smaps` VmFlags: "hg"
marks a range advised for transparent huge pages), never a time: a stall happens only on a
host whose memory is fragmented.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from vaed_client import wire
from vaed_client.heap import video_buffer
from vaed_client.video import VideoAssembler

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's mapping records")

H, W = 480, 832  # one frame: 1.2 MB; a video of 81 frames, 97 MB


def _vm_flags(array: np.ndarray) -> list[str]:
    """The VmFlags of the mapping that holds the middle of `array`'s memory."""
    address = array.ctypes.data + array.nbytes // 2
    flags: list[str] | None = None
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the array"
    return flags


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
