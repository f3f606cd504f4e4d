"""The RMS-norm+SiLU prologue of the causal-input kernels: the exact prologue's rounding over
every bf16/fp16 bit pattern (both kernels), the norm denominator without its fp32 copy at the
decoders' shapes, and the fast prologue's accuracy (no further from float64 than stock).

GPU cases only: these hold ``exp`` and the bf16 cast to the GPU's bits, which the interpreter
does not reproduce (its cases of the prologues are in test_causal_input.py and
test_causal_input_cl.py, within a tolerance; the denominator's CPU logic is in
test_norm_denominator.py).
"""

from __future__ import annotations

import torch

from vaed import kernels as K

from backends import Backend, grid, kernel_cases
from harness import assert_same, every_value, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@kernel_cases("dtype, kernel", cuda=grid(DTYPES, ("causal_pad", "causal_pad_cl")))
def test_silu_chain_exhaustive(backend: Backend, dtype, kernel) -> None:
    """The exact norm+SiLU rounding over every bf16/fp16 bit pattern (fp32: 2^20 samples), in the
    1-D kernel and in the tile kernel."""
    x = every_value(dtype)
    gamma = torch.tensor([1.0, 0.5, -2.0, 1.25], device="cuda").to(dtype).reshape(4, 1, 1, 1)
    args = K.NormSilu(gamma, 2.0, 0.0, denom=K.norm_denominator(x))
    got = getattr(K, kernel)(x, None, (0, 0, 0, 0, 2, 0), norm=args)
    want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), norm=K.NormSilu(gamma, 2.0, 0.0))
    assert got is not None
    assert_same(got[0], want[0])


@kernel_cases("channels, layout", cuda=grid((96, 192, 256, 384, 512, 1024), ("cl3d", "contiguous")))
def test_norm_denominator_skips_the_float_copy_at_decoder_shapes(backend: Backend, channels, layout) -> None:
    """Wan2.1 (96-384) and Wan2.2 (256-1024) channel counts: the cast-on-load reduction gives
    the reference's bits, so the denominator runs without its fp32 copy (the speed-up holds)."""
    from vaed.kernels import rms_silu

    x = lay(torch.randn(1, channels, 2, 60, 104, device="cuda", dtype=torch.bfloat16), layout)
    assert torch.equal(K.norm_denominator(x), K.norm_denominator_reference(x))
    assert rms_silu._CAST_ON_LOAD_EXACT[(tuple(x.shape), x.stride(), x.dtype, x.device)] is True


@kernel_cases("dtype, channels", cuda=grid((torch.bfloat16, torch.float16), (96, 384, 1024)))
def test_fast_norm_no_less_accurate_than_stock(backend: Backend, dtype, channels) -> None:
    """The one-rounding norm+SiLU is within a few ulps of stock and no further from float64 than stock is."""
    g = torch.Generator(device="cuda").manual_seed(channels)
    x = lay(torch.randn(1, channels, 2, 30, 52, device="cuda", generator=g) * 3, "cl3d").to(dtype)
    gamma = (torch.rand(channels, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
    pad = (1, 1, 1, 1, 2, 0)
    norm = K.NormSilu(gamma, channels**0.5, 0.0)
    got = K.causal_pad_cl(x, None, pad, norm_cl=norm)
    assert got is not None
    stock = K.causal_pad_reference(x, None, pad, norm=norm)
    truth = K.causal_pad_reference(x.double(), None, pad, norm=K.NormSilu(gamma.double(), channels**0.5, 0.0))
    for a, b in zip(got, stock):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, atol=2e-2, rtol=4e-2)
    err_fast = (got[0].double() - truth[0]).abs().mean()
    err_stock = (stock[0].double() - truth[0]).abs().mean()
    assert err_fast <= err_stock * 1.05, (err_fast, err_stock)


@kernel_cases("dtype, channels", cuda=grid((torch.bfloat16, torch.float16), (96, 384)))
def test_deferred_conv_bias_in_the_norm_prologue(backend: Backend, dtype, channels) -> None:
    """The fast prologue with the producing conv's bias (NormSilu.x_bias): within a rounding of
    stock's chain (bias added and rounded, then the norm) and no further from float64."""
    g = torch.Generator(device="cuda").manual_seed(channels)
    x = lay(torch.randn(1, channels, 2, 30, 52, device="cuda", generator=g) * 3, "cl3d").to(dtype)
    gamma = (torch.rand(channels, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
    xb = torch.randn(channels, device="cuda", generator=g).to(dtype)
    pad = (1, 1, 1, 1, 2, 0)
    got = K.causal_pad_cl(x, None, pad, norm_cl=K.NormSilu(gamma, channels**0.5, 0.0, xb))
    assert got is not None
    stock = K.causal_pad_reference(x + xb.view(1, -1, 1, 1, 1), None, pad, norm=K.NormSilu(gamma, channels**0.5, 0.0))
    truth = K.causal_pad_reference(
        x.double() + xb.double().view(1, -1, 1, 1, 1), None, pad, norm=K.NormSilu(gamma.double(), channels**0.5, 0.0)
    )
    for a, b in zip(got, stock):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, atol=2e-2, rtol=4e-2)
    assert (got[0].double() - truth[0]).abs().mean() <= (stock[0].double() - truth[0]).abs().mean() * 1.05
