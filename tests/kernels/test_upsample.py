"""The nearest-2x upsample kernel (``upsample_nearest2x``), with the upsample3d frame interleave:
bit-exact against its reference in every layout, and its channels-last output (the fast tier's)
equal to it. Pure data movement, so bit-exact on both backends (tests/backends.py). With the
time_conv's deferred bias, added and rounded per value before the gather: exact on the GPU."""

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


@kernel_cases(
    "dtype, layout, interleave",
    cuda=grid(DTYPES, LAYOUTS, (False, True)),
    interpreter=grid(DTYPES, ("cl3d", "contiguous"), (False, True)),
)
def test_upsample_with_the_time_convs_bias(backend: Backend, dtype, layout, interleave) -> None:
    """``bias`` ([C] of x): x + bias rounded (the conv's own bias pass) then the gather --
    stock's bytes in both output layouts; each channel block of the interleave gets its own."""
    c, h, w = (32, 7, 9) if not backend.interpreter else (4, 3, 5)
    g = backend.generator(c)
    x = lay(torch.randn(1, c, 2, h, w, device=backend.device, generator=g).to(dtype), layout)
    bias = (torch.randn(c, device=backend.device, generator=g) * 4).to(dtype)
    want = K.upsample_nearest2x_reference(x + bias.view(1, -1, 1, 1, 1), interleave)
    assert_same(K.upsample_nearest2x_reference(x, interleave, bias), want)
    got = K.upsample_nearest2x(x, interleave, bias)
    nhwc = K.upsample_nearest2x(x, interleave, bias, channels_last=True)
    assert got is not None and nhwc is not None
    if backend.exact(dtype, bf16_cast=True):
        assert_same(got, want)
        assert torch.equal(nhwc, want)
    else:  # the interpreter truncates fp32 -> bf16
        assert got.stride() == want.stride()
        torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=1e-2)
    assert not torch.equal(got, K.upsample_nearest2x(x, interleave))  # the bias was added
    assert K.upsample_nearest2x(x, interleave, bias.float() if dtype != torch.float32 else bias.half()) is None
