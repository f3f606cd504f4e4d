"""Each fused kernel bit-exact (torch.equal) against its aten reference on the GPU, strides included."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from vaed import kernels as K
from vaed.kernels.dupup import dupup_reference

from harness import assert_same, every_value, lay

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CL = torch.channels_last_3d


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl3d", "contiguous", "ntchw"])
@pytest.mark.parametrize("cache_frames", [0, 1, 2])
@pytest.mark.parametrize("pad", [(1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0), (0, 1, 1, 1, 2, 0), (1, 1, 0, 1, 2, 0), (1, 0, 1, 0, 2, 0)])
@pytest.mark.parametrize("frames", [1, 2, 4])
@pytest.mark.parametrize("norm", [False, True])
def test_causal_pad_exact(dtype, layout, cache_frames, pad, frames, norm) -> None:
    g = torch.Generator(device="cuda").manual_seed(cache_frames * 10 + frames)
    x = lay(torch.randn(2, 24, frames + 1, 9, 13, device="cuda", dtype=dtype, generator=g), layout)[:, :, 1:]
    cache = None
    if cache_frames:
        # a strided view: the last frames of a bigger tensor
        big = lay(torch.randn(2, 24, 3, 9, 13, device="cuda", dtype=dtype, generator=g), layout)
        cache = big[:, :, 3 - cache_frames :]
    kw = {}
    ref_norm = None
    if norm:
        gamma = (torch.rand(24, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
        ref_norm = K.NormSilu(gamma, 24**0.5, 0.0)
        kw["norm"] = K.NormSilu(gamma, 24**0.5, 0.0, denom=K.norm_denominator(x))
    got = K.causal_pad(x, cache, pad, **kw)
    want = K.causal_pad_reference(x, cache, pad, norm=ref_norm)
    assert got is not None
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@pytest.mark.parametrize("channels", [3, 16, 96, 192, 384, 1024])
@pytest.mark.parametrize("frames,cache_frames,zero_history", [(1, 0, False), (1, 0, True), (4, 2, False), (1, 2, False)])
@pytest.mark.parametrize("norm", [False, True])
def test_causal_pad_exact_at_decoder_channel_counts(channels, frames, cache_frames, zero_history, norm) -> None:
    """The channel count is a compile-time constant of the kernel (DIV): each one the Wan
    decoders use, at a width whose rows span many blocks, bit-exact with and without the norm."""
    g = torch.Generator(device="cuda").manual_seed(channels + frames)
    dtype = torch.bfloat16
    x = lay(torch.randn(1, channels, frames, 6, 70, device="cuda", dtype=dtype, generator=g), "cl3d")
    cache = lay(torch.randn(1, channels, 2, 6, 70, device="cuda", dtype=dtype, generator=g), "cl3d") if cache_frames else None
    pad = (0, 0, 0, 0, 2, 0) if zero_history else (1, 1, 1, 1, 2, 0)
    kw, ref_norm = {}, None
    if norm:
        gamma = (torch.rand(channels, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
        ref_norm = K.NormSilu(gamma, channels**0.5, 0.0)
        kw["norm"] = K.NormSilu(gamma, channels**0.5, 0.0, denom=K.norm_denominator(x))
    got = K.causal_pad(x, cache, pad, zero_history=zero_history, **kw)
    want = K.causal_pad_reference(x, cache, pad, zero_history=zero_history, norm=ref_norm)
    assert got is not None
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@pytest.mark.parametrize("channels", [96, 192, 256, 384, 512, 1024])
@pytest.mark.parametrize("layout", ["cl3d", "contiguous"])
def test_norm_denominator_skips_the_float_copy_at_decoder_shapes(channels, layout) -> None:
    """Wan2.1 (96-384) and Wan2.2 (256-1024) channel counts: the cast-on-load reduction gives
    the reference's bits, so the denominator runs without its fp32 copy (the speed-up holds)."""
    from vaed.kernels import rms_silu

    x = lay(torch.randn(1, channels, 2, 60, 104, device="cuda", dtype=torch.bfloat16), layout)
    assert torch.equal(K.norm_denominator(x), K.norm_denominator_reference(x))
    assert rms_silu._CAST_ON_LOAD_EXACT[(tuple(x.shape), x.stride(), x.dtype, x.device)] is True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl3d", "contiguous"])
@pytest.mark.parametrize("frames", [1, 2])
def test_causal_pad_rep_marker(dtype, layout, frames) -> None:
    x = lay(torch.randn(1, 16, frames, 5, 7, device="cuda", dtype=dtype), layout)
    pad = (0, 0, 0, 0, 2, 0)
    got = K.causal_pad(x, None, pad, zero_history=True)
    want = K.causal_pad_reference(x, None, pad, zero_history=True)
    assert got is not None
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


def test_causal_pad_declines_and_rejects() -> None:
    x = torch.randn(1, 4, 2, 5, 5, device="cuda", dtype=torch.bfloat16)
    # asymmetric spatial padding (a shard's interior edge) is handled, exactly
    for pad in ((1, 0, 1, 1, 2, 0), (0, 1, 0, 1, 2, 0), (2, 0, 0, 3, 2, 0)):
        got = K.causal_pad(x, None, pad)
        assert got is not None
        want = K.causal_pad_reference(x, None, pad)
        assert_same(got[0], want[0])
        assert_same(got[1], want[1])
    assert K.causal_pad(x, None, (1, 1, -1, 1, 2, 0)) is None  # negative (cropping) padding
    assert K.causal_pad(x, None, (1, 1, 1, 1, 2, 1)) is None  # back padding in time
    assert K.causal_pad(x.double(), None, (1, 1, 1, 1, 2, 0)) is None  # dtype
    assert K.causal_pad(x, x.float(), (1, 1, 1, 1, 2, 0)) is None  # cache dtype mismatch
    assert K.causal_pad(x.cpu(), None, (1, 1, 1, 1, 2, 0)) is None  # CPU
    xg = x.float().requires_grad_(True)
    with torch.enable_grad():
        assert K.causal_pad(xg, None, (1, 1, 1, 1, 2, 0)) is None  # autograd
    with pytest.raises(ValueError):
        K.causal_pad(x, x, (1, 1, 1, 1, 2, 0), zero_history=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_chain_exhaustive(dtype) -> None:
    """The fused norm+SiLU rounding over every bf16/fp16 bit pattern (fp32: 2^20 samples)."""
    x = every_value(dtype)
    gamma = torch.tensor([1.0, 0.5, -2.0, 1.25], device="cuda").to(dtype).reshape(4, 1, 1, 1)
    args = K.NormSilu(gamma, 2.0, 0.0, denom=K.norm_denominator(x))
    got = K.causal_pad(x, None, (0, 0, 0, 0, 2, 0), norm=args)
    want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), norm=K.NormSilu(gamma, 2.0, 0.0))
    assert got is not None
    assert_same(got[0], want[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl3d", "contiguous", "ntchw"])
@pytest.mark.parametrize("interleave", [False, True])
def test_upsample_exact(dtype, layout, interleave) -> None:
    x = lay(torch.randn(2, 32, 3, 7, 9, device="cuda", dtype=dtype), layout)
    got = K.upsample_nearest2x(x, interleave)
    assert got is not None
    assert_same(got, K.upsample_nearest2x_reference(x, interleave))
    nhwc = K.upsample_nearest2x(x, interleave, channels_last=True)
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(nhwc, got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl3d", "contiguous", "ntchw"])
@pytest.mark.parametrize("ft,first", [(1, False), (2, False), (2, True)])
def test_dupup_add_exact(dtype, layout, ft, first) -> None:
    src = lay(torch.randn(1, 16, 3, 5, 6, device="cuda", dtype=dtype), "cl3d")
    t = 3 * ft - (ft - 1 if first else 0)
    main = lay(torch.randn(1, 8, t, 10, 12, device="cuda", dtype=dtype), layout)
    got = K.dupup_add(main, src, ft, 2, first)
    assert got is not None
    assert_same(got, K.dupup_add_reference(main, src, ft, 2, first))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("main_c,src_c", [(96, 192), (256, 512), (512, 1024), (1024, 1024), (24, 6)])
@pytest.mark.parametrize("ft,first", [(1, False), (2, False), (2, True)])
def test_dupup_add_tile_kernel_exact_at_decoder_widths(dtype, main_c, src_c, ft, first) -> None:
    """The channels_last_3d tile kernel at Wan2.2's up-block widths (repeat counts 2..32), B = 2."""
    g = torch.Generator(device="cuda").manual_seed(main_c + ft)
    src = lay(torch.randn(2, src_c, 2, 5, 7, device="cuda", dtype=dtype, generator=g), "cl3d")
    t = 2 * ft - (ft - 1 if first else 0)
    main = lay(torch.randn(2, main_c, t, 10, 14, device="cuda", dtype=dtype, generator=g), "cl3d")
    got = K.dupup_add(main, src, ft, 2, first)
    assert got is not None
    assert_same(got, K.dupup_add_reference(main, src, ft, 2, first))
    # with the upsampler conv's deferred bias: added and rounded first, still bit-exact
    bias = torch.randn(main_c, device="cuda", dtype=dtype, generator=g)
    got = K.dupup_add(main, src, ft, 2, first, bias)
    assert got is not None
    assert_same(got, K.dupup_add_reference(main, src, ft, 2, first, bias))
    assert_same(got, (main + bias.view(1, -1, 1, 1, 1)) + dupup_reference(src, main_c, ft, 2, first))


def test_int64_indexing_past_2_31() -> None:
    """Padded output of 2.3e9 elements (> 2^31): offsets must not wrap."""
    x = torch.zeros(1, 16, 1, 4096, 16384, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)
    x[:, :, :, ::509, ::1021] = 1.0
    x[:, :, :, -1, -1] = 3.0
    got = K.causal_pad(x, None, (1, 1, 1, 1, 2, 0), emit_cache=False)
    assert got is not None
    p = got[0]
    assert p.numel() > 2**31
    want = F.pad(x, (1, 1, 1, 1, 2, 0))
    assert p.stride() == want.stride()
    assert torch.equal(p, want)
