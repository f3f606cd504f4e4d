"""The residual add with conv2's bias (``bias_residual_add``: ``(x + bias) + h`` in fp32, one
rounding; the fast tier's): bit-exact against its fp32 reference, aten's strides, no further
from a float64 sum than stock's two roundings, and declining what is not channels-last. With
``exact`` (the lossless tier's): stock's two roundings, bit for bit against stock's aten adds.

Both backends (tests/backends.py). The interpreter truncates the final fp32->bf16 cast, so its
bf16 results are held within a bf16 ulp; fp32 and fp16 are bit-exact on both.
"""

from __future__ import annotations

import torch

from vaed import kernels as K
from vaed import patches as P

from backends import Backend, grid, kernel_cases
from harness import assert_same, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@kernel_cases(
    "dtype, channels, with_bias, batch",
    cuda=grid(DTYPES, (96, 256, 1024), (True, False), (1,)),
    interpreter=grid(DTYPES, (7,), (True, False), (1, 2)),
)
def test_bias_residual_add_exact_and_no_less_accurate(backend: Backend, dtype, channels, with_bias, batch) -> None:
    """x + bias + h against its fp32 reference and against stock's REFERENCE_OPS.residual_add."""
    t, h, w = (4, 30, 52) if not backend.interpreter else (3, 4, 5)
    scale = 3 if not backend.interpreter else 1
    g = backend.generator(channels * batch)
    x = lay(torch.randn(batch, channels, t, h, w, device=backend.device, generator=g) * scale, "cl3d").to(dtype)
    hh = lay(torch.randn(batch, channels, t, h, w, device=backend.device, generator=g) * scale, "cl3d").to(dtype)
    bias = torch.randn(channels, device=backend.device, generator=g).to(dtype) if with_bias else None
    got = K.bias_residual_add(x, hh, bias)
    assert got is not None and got.dtype == dtype
    want = K.bias_residual_add_reference(x, hh, bias)
    if backend.exact(dtype, bf16_cast=True):
        assert_same(got, want)
    else:
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    stock = P.REFERENCE_OPS.residual_add(x, hh, bias)
    assert got.stride() == stock.stride() == (x + hh).stride()
    # stock rounds x + bias before adding h: up to a bf16 ulp of |x + bias| apart near a
    # cancellation (0.03125 for |x + bias| in [4, 8), met on the GPU at scale 3), so atol scales
    fast = P.FAST_OPS.residual_add(x, hh, bias).float()
    torch.testing.assert_close(fast, stock.float(), atol=3e-2 * scale, rtol=3e-2)
    if backend.exact(dtype, bf16_cast=True):
        truth = x.double() + hh.double() + (0 if bias is None else bias.double().view(1, -1, 1, 1, 1))
        assert (got.double() - truth).abs().mean() <= (stock.double() - truth).abs().mean() * 1.0001


@kernel_cases("", cuda=[()], interpreter=[()])
def test_bias_residual_add_layouts(backend: Backend) -> None:
    """Contiguous operands are the reference's aten add; one frame (T = 1) with different
    strides on its size-1 dim (producers leave either) is still one exact pass."""
    x = torch.randn(1, 7, 3, 4, 5, device=backend.device)
    assert K.bias_residual_add(x, x, None) is None  # contiguous: the reference's aten add
    assert K.bias_residual_add(lay(x, "cl3d"), x, None) is None  # one of them not channels-last
    x1 = lay(torch.randn(1, 7, 1, 4, 5, device=backend.device), "cl3d")
    h1 = lay(torch.randn(1, 7, 1, 4, 5, device=backend.device), "cl3d")
    h1 = h1.as_strided(h1.shape, (140, 1, 7, 35, 7))  # same bytes, another T stride
    assert x1.stride() != h1.stride()
    b7 = torch.randn(7, device=backend.device)
    got = K.bias_residual_add(x1, h1, b7)
    assert got is not None and got.stride() == (x1 + h1).stride()
    assert torch.equal(got, K.bias_residual_add_reference(x1, h1, b7))


@kernel_cases(
    "dtype, channels, bias_dtype, batch",
    cuda=grid(DTYPES, (96, 384), ("x", "fp32", None), (1,)),
    interpreter=grid(DTYPES, (7,), ("x", "fp32", None), (1, 2)),
)
def test_exact_residual_add_is_stocks_two_adds(backend: Backend, dtype, channels, bias_dtype, batch) -> None:
    """exact=True: ``x + bias`` rounded to x's dtype (the bias rounded to it first, as the conv's
    own bias pass), then ``+ h`` -- REFERENCE_OPS.residual_add's bytes and strides, and the
    lossless tier's op."""
    t, h, w = (4, 30, 52) if not backend.interpreter else (3, 4, 5)
    g = backend.generator(channels + batch)
    x = lay(torch.randn(batch, channels, t, h, w, device=backend.device, generator=g) * 3, "cl3d").to(dtype)
    hh = lay(torch.randn(batch, channels, t, h, w, device=backend.device, generator=g) * 3, "cl3d").to(dtype)
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(channels, device=backend.device, generator=g)
        bias = bias.to(dtype) if bias_dtype == "x" else bias
    got = K.bias_residual_add(x, hh, bias, exact=True)
    assert got is not None and got.dtype == dtype
    stock = P.REFERENCE_OPS.residual_add(x, hh, bias)
    reference = K.bias_residual_add_reference(x, hh, bias, exact=True)
    assert_same(reference, stock)  # the reference is stock's arithmetic, on any device
    if backend.exact(dtype, bf16_cast=True):
        assert_same(got, stock)
        lossless = P.LOSSLESS_OPS.residual_add(x, hh, bias)
        assert_same(lossless, stock)
    else:  # the interpreter truncates fp32 -> bf16
        assert got.stride() == stock.stride()
        torch.testing.assert_close(got.float(), stock.float(), atol=6e-2, rtol=2e-2)
    if bias is not None and backend.exact(dtype, bf16_cast=True) and dtype != torch.float32:
        # the one-rounding kernel is another sum: the exact one is not it by accident
        assert not torch.equal(K.bias_residual_add(x, hh, bias), stock)
