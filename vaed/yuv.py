"""RGB8 frames -> yuv420p planes, the form H.264 video is encoded from.

Served H.264 video converts on the device, before the frames' copy to the host: swscale's
rgb24 -> yuv420p conversion inside PyAV took 4-6 ms of CPU per 720x1280 frame, on the first
fragment's path and ~0.4 s of CPU per 81-frame video, while the GPU does it in a few
elementwise kernels; the host copy halves too (1.5 bytes a pixel instead of 3).

BT.601 limited range (swscale's default for this conversion, and what players assume when an
H.264 stream names no colour space), in 8-bit integer coefficients with each result rounded
once; chroma is the mean of each 2x2 block. Integer arithmetic gives the same planes on every
device, so a packager that converts RGB frames on the CPU writes the bytes a server that
converted them on its GPU writes.
"""

from __future__ import annotations

import torch


def rgb8_to_yuv420p(frames: torch.Tensor) -> torch.Tensor:
    """uint8 RGB frames `[..., H, W, 3]` (even H and W; any device) -> uint8 `[..., 3H/2, W]`: each
    frame's Y plane (H rows), then its U and V planes ((H/2) x (W/2) each, two of their rows per
    row), the layout of PyAV's yuv420p arrays."""
    *lead, h, w, channels = frames.shape
    if frames.dtype != torch.uint8 or channels != 3 or h % 2 or w % 2:
        raise ValueError(f"expected uint8 [..., H, W, 3] frames with even H and W, got {frames.dtype} "
                         f"{list(frames.shape)}")
    x = frames.to(torch.int32)
    r, g, b = x.unbind(-1)
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    # The 2x2 sums carry 4x the values: >> 10 divides by 4 * 256, +512 rounds (an arithmetic
    # shift floors the negative sums too, on every device).
    blocks = x.unflatten(-3, (h // 2, 2)).unflatten(-2, (w // 2, 2)).sum(dim=(-4, -2))
    rs, gs, bs = blocks.unbind(-1)
    u = ((-38 * rs - 74 * gs + 112 * bs + 512) >> 10) + 128
    v = ((112 * rs - 94 * gs - 18 * bs + 512) >> 10) + 128
    planes = torch.cat([y.flatten(-2), u.flatten(-2), v.flatten(-2)], dim=-1)
    return planes.to(torch.uint8).unflatten(-1, (h * 3 // 2, w))
