"""The nearest-2x upsample kernel (``upsample_nearest2x``), with the upsample3d frame interleave:
bit-exact against its reference in every layout, and its channels-last output (the fast tier's)
equal to it. Pure data movement, so bit-exact on both backends (tests/backends.py)."""

from __future__ import annotations

import torch

from vaed import kernels as K

from backends import Backend, grid, kernel_cases
from harness import assert_same, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("cl3d", "contiguous", "ntchw")


@kernel_cases(
    "dtype, layout, interleave, batch, frames",
    cuda=grid(DTYPES, LAYOUTS, (False, True), (2,), (3,)),
    interpreter=grid(DTYPES, LAYOUTS, (False, True), (1, 2), (1, 2, 3)),
)
def test_upsample_exact(backend: Backend, dtype, layout, interleave, batch, frames) -> None:
    c, h, w = (32, 7, 9) if not backend.interpreter else (4, 3, 5)
    x = lay(torch.randn(batch, c, frames, h, w, device=backend.device, dtype=dtype, generator=backend.generator(frames)), layout)
    got = K.upsample_nearest2x(x, interleave)
    assert got is not None
    assert_same(got, K.upsample_nearest2x_reference(x, interleave))
    nhwc = K.upsample_nearest2x(x, interleave, channels_last=True)  # the fast tier's layout
    assert nhwc.is_contiguous(memory_format=torch.channels_last), nhwc.stride()
    assert torch.equal(nhwc, got)
