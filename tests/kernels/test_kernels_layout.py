"""The layout oracle (aten chains run on meta tensors) gives the strides the real chains give."""

from __future__ import annotations

import itertools

import pytest
import torch

from vaed.kernels import (
    NormSilu,
    avgdown_add_reference,
    causal_pad_reference,
    dupup_add_reference,
    upsample_nearest2x_reference,
)
from vaed.kernels.avgdown import _out_strides as avgdown_out_strides
from vaed.kernels.causal_input import _stock_layouts
from vaed.kernels.dupup import _out_strides
from vaed.kernels.upsample import _out_layout

from harness import lay

CL = torch.channels_last_3d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["cl3d", "contiguous", "ntchw"])
def test_causal_layouts(dtype: torch.dtype, layout: str) -> None:
    for b, frames, cf, norm, pad in itertools.product(
        (1, 2), (1, 2, 3), (0, 1, 2), (False, True), ((1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0))
    ):
        x = lay(torch.randn(b, 4, frames + 1, 3, 5, dtype=dtype), layout)[:, :, 1:]
        c = lay(torch.randn(b, 4, 3, 3, 5, dtype=dtype), layout)[:, :, 3 - cf :] if cf else None
        g = NormSilu(torch.ones(4, 1, 1, 1, dtype=dtype), 2.0, 0.0) if norm else None
        p, n = causal_pad_reference(x, c, pad, norm=g)
        cm = (tuple(c.shape), tuple(c.stride())) if c is not None else (None, None)
        got = _stock_layouts(tuple(x.shape), tuple(x.stride()), *cm, pad, False, 2, norm, dtype)
        assert got == (tuple(p.shape), p.stride(), tuple(n.shape), n.stride())


@pytest.mark.parametrize("layout", ["cl3d", "contiguous", "ntchw"])
@pytest.mark.parametrize("interleave", [False, True])
def test_upsample_and_dupup_layouts(layout: str, interleave: bool) -> None:
    for frames in (1, 2):
        x = lay(torch.randn(1, 4, frames, 3, 5, dtype=torch.bfloat16), layout)
        y = upsample_nearest2x_reference(x, interleave)
        assert _out_layout(tuple(x.shape), tuple(x.stride()), interleave) == (tuple(y.shape), y.stride())
    for ft, first in ((1, False), (2, False), (2, True)):
        src = lay(torch.randn(1, 4, 2, 3, 4), "cl3d")
        m = lay(torch.randn(1, 2, 2 * ft - (ft - 1 if first else 0), 6, 8), layout)
        ref = dupup_add_reference(m, src, ft, 2, first)
        assert _out_strides(tuple(m.shape), tuple(m.stride()), 2 * ft) == ref.stride()


@pytest.mark.parametrize("main_layout", ["cl3d", "contiguous", "ntchw"])
@pytest.mark.parametrize("src_layout", ["cl3d", "contiguous"])
def test_avgdown_layouts(main_layout: str, src_layout: str) -> None:
    """main + the mean (a contiguous tensor, whatever the source's layout): the strides of
    stock's add, first chunks (one frame, padded) and B = 2 included."""
    for b, frames, ft in itertools.product((1, 2), (1, 4), (1, 2)):
        src = lay(torch.randn(b, 4, frames, 4, 6), src_layout)
        m = lay(torch.randn(b, 8, (frames + ft - 1) // ft, 2, 3), main_layout)
        ref = avgdown_add_reference(m, src, ft, 2, 8)
        assert avgdown_out_strides(tuple(m.shape), tuple(m.stride())) == ref.stride()


def test_channel_tile_holds_every_channel_of_a_run_of_pixels() -> None:
    """The tile kernels' launch shape: 2048 elements a program, all channels, 4 warps."""
    from vaed.kernels._runtime import channel_tile

    assert channel_tile(96, 834) == (16, 128, 4)  # Wan2.1 full resolution: 96 channels pad to 128
    assert channel_tile(1024) == (2, 1024, 4)
    assert channel_tile(4096, 100) == (1, 4096, 4)  # one pixel's channels exceed the tile
    assert channel_tile(16, 5) == (8, 16, 4)  # a narrow row caps the pixels: a smaller tile
    assert channel_tile(3000) == (1, 4096, 4)
    assert channel_tile(192, 2) == (2, 256, 4)
