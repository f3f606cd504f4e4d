"""The fast tier on the GPU: exact tile kernel, the lossy norm prologue's accuracy, the PSNR gate,
and lossless and fast sessions side by side on one decoder."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vaed import kernels as K
from vaed import patches as P
from vaed.models import build_random_vae

from harness import assert_same, every_value, lay

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CL = torch.channels_last_3d
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl3d", "ntchw"])
@pytest.mark.parametrize("cache_frames", [0, 1, 2])
@pytest.mark.parametrize("pad", [(1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0), (0, 1, 1, 0, 2, 0), (2, 0, 0, 1, 2, 0)])
@pytest.mark.parametrize("frames", [1, 2, 4])
@pytest.mark.parametrize("channels", [24, 384, 1024])
def test_causal_pad_cl_exact(dtype, layout, cache_frames, pad, frames, channels) -> None:
    g = torch.Generator(device="cuda").manual_seed(cache_frames * 10 + frames)
    x = lay(torch.randn(2, channels, frames + 1, 9, 13, device="cuda", dtype=dtype, generator=g), layout)[:, :, 1:]
    cache = None
    if cache_frames:
        big = lay(torch.randn(2, channels, 3, 9, 13, device="cuda", dtype=dtype, generator=g), layout)
        cache = big[:, :, 3 - cache_frames :]
    want = K.causal_pad_reference(x, cache, pad)
    got = K.causal_pad_cl(x, cache, pad)
    if layout == "cl3d":
        assert got is not None
    if got is None:  # the aten chain's output is not channels-last here: the 1-D kernel's job
        assert not want[0].is_contiguous(memory_format=CL) or want[0].is_contiguous()
        return
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
    got = K.causal_pad_cl(x, cache, pad, emit_cache=False)
    assert got is not None and got[1] is None
    assert_same(got[0], want[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cl3d", "ntchw"])
@pytest.mark.parametrize("cache_frames", [0, 2])
@pytest.mark.parametrize("pad", [(1, 1, 1, 1, 2, 0), (0, 1, 1, 0, 2, 0)])
@pytest.mark.parametrize("frames", [1, 4])
@pytest.mark.parametrize("channels", [24, 384])
def test_causal_pad_cl_exact_norm(dtype, layout, cache_frames, pad, frames, channels) -> None:
    """The exact norm+SiLU prologue in the tile kernel equals the aten chain (and the 1-D kernel)."""
    g = torch.Generator(device="cuda").manual_seed(cache_frames * 10 + frames + channels)
    x = lay(torch.randn(2, channels, frames + 1, 9, 13, device="cuda", dtype=dtype, generator=g) * 2, layout)[:, :, 1:]
    cache = None
    if cache_frames:
        cache = lay(torch.randn(2, channels, 3, 9, 13, device="cuda", dtype=dtype, generator=g), layout)[:, :, 1:]
    gamma = (torch.rand(channels, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
    args = K.NormSilu(gamma, channels**0.5, 0.0, denom=K.norm_denominator(x))
    want = K.causal_pad_reference(x, cache, pad, norm=K.NormSilu(gamma, channels**0.5, 0.0))
    got = K.causal_pad_cl(x, cache, pad, norm=args)
    if layout == "cl3d":
        assert got is not None
    if got is None:
        return
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cl_silu_chain_exhaustive(dtype) -> None:
    """The tile kernel's exact norm+SiLU rounding over every bf16/fp16 bit pattern (fp32: 2^20 samples)."""
    x = every_value(dtype)
    gamma = torch.tensor([1.0, 0.5, -2.0, 1.25], device="cuda").to(dtype).reshape(4, 1, 1, 1)
    args = K.NormSilu(gamma, 2.0, 0.0, denom=K.norm_denominator(x))
    got = K.causal_pad_cl(x, None, (0, 0, 0, 0, 2, 0), norm=args)
    want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), norm=K.NormSilu(gamma, 2.0, 0.0))
    assert got is not None
    assert_same(got[0], want[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_pad_cl_rep_marker(dtype) -> None:
    for frames in (1, 2):
        x = lay(torch.randn(1, 16, frames, 5, 7, device="cuda", dtype=dtype), "cl3d")
        got = K.causal_pad_cl(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
        want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
        assert got is not None
        assert_same(got[0], want[0])
        assert_same(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [96, 384, 1024])
def test_fast_norm_no_less_accurate_than_stock(dtype, channels) -> None:
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_frames,frames", [(0, 1), (1, 2), (2, 4)])
def test_unfolded_conv_matches_the_fast_pair_and_is_no_less_accurate(dtype, cache_frames, frames) -> None:
    """The fused norm site (taps unfolded into channels, one conv2d) at the decoder's 96 channels:
    conv3d's output layout, the same next cache, values within a rounding of the fast pair (norm
    conv input, then cuDNN conv3d) and no further from a float64 conv than the pair is."""
    from vaed.patches.fast import unfolded_norm_causal_conv
    from vaed.patches.ops import NormSilu

    c = 96
    g = torch.Generator(device="cuda").manual_seed(frames)
    x = lay(torch.randn(1, c, frames, 30, 52, device="cuda", generator=g) * 3, "cl3d").to(dtype)
    cache = lay(torch.randn(1, c, cache_frames, 30, 52, device="cuda", generator=g), "cl3d").to(dtype) if cache_frames else None
    gamma = (torch.rand(c, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
    conv = torch.nn.Conv3d(c, c, 3).to(device="cuda", dtype=dtype)
    conv.weight.data = conv.weight.data.contiguous(memory_format=CL)
    norm, pad = NormSilu(gamma, c**0.5, 0.0), (1, 1, 1, 1, 2, 0)
    with torch.no_grad():
        got = unfolded_norm_causal_conv(conv, x, cache, pad, norm=norm)
        assert got is not None
        pair = P.FAST_OPS.without({"norm_causal_conv"}).causal_conv(conv, x, cache, pad, norm=norm)
        assert got[0].stride() == pair[0].stride() and got[0].shape == pair[0].shape
        assert torch.equal(got[1], pair[1])
        torch.testing.assert_close(got[0], pair[0], atol=3e-2, rtol=4e-2)
        padded, _ = K.causal_pad_cl(x, cache, pad, norm_cl=K.NormSilu(gamma, c**0.5, 0.0))
        truth = F.conv3d(padded.double(), conv.weight.double(), conv.bias.double())
    err_unfolded = (got[0].double() - truth).abs().mean()
    err_pair = (pair[0].double() - truth).abs().mean()
    assert err_unfolded <= err_pair * 1.05, (err_unfolded, err_pair)


def test_unfolded_conv_passes_its_start_up_check_on_the_gpu() -> None:
    from vaed.patches.checks import check_op

    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # fp32 has no case: half dtypes only
        assert check_op(P.FAST_OPS, "norm_causal_conv", torch.device("cuda"), dtype) is None, dtype
    with torch.inference_mode():  # the engine's start-up: the check's conv weights are inference tensors
        assert check_op(P.FAST_OPS, "norm_causal_conv", torch.device("cuda"), torch.bfloat16) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [96, 256, 1024])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_residual_add_exact_and_no_less_accurate(dtype, channels, with_bias) -> None:
    """x + bias + h: bit-exact against its fp32 reference on the GPU, aten's strides, and no
    further from a float64 sum than stock's two roundings ((x + bias) rounded, then + h)."""
    g = torch.Generator(device="cuda").manual_seed(channels)
    x = lay(torch.randn(1, channels, 4, 30, 52, device="cuda", generator=g) * 3, "cl3d").to(dtype)
    h = lay(torch.randn(1, channels, 4, 30, 52, device="cuda", generator=g) * 3, "cl3d").to(dtype)
    bias = torch.randn(channels, device="cuda", generator=g).to(dtype) if with_bias else None
    got = K.bias_residual_add(x, h, bias)
    assert got is not None
    assert_same(got, K.bias_residual_add_reference(x, h, bias))
    stock = P.REFERENCE_OPS.residual_add(x, h, bias)
    assert got.stride() == stock.stride()
    truth = x.double() + h.double() + (0 if bias is None else bias.double().view(1, -1, 1, 1, 1))
    assert (got.double() - truth).abs().mean() <= (stock.double() - truth).abs().mean() * 1.0001


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [96, 384])
def test_deferred_conv_bias_in_the_norm_prologue(dtype, channels) -> None:
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


def test_deferred_bias_ops_pass_their_start_up_checks_on_the_gpu() -> None:
    from vaed.patches.checks import check_op_set

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert check_op_set(P.FAST_OPS, torch.device("cuda"), dtype) == {}, dtype


# --- whole decodes --------------------------------------------------------------------------


def _vae(arch: str, dtype: torch.dtype) -> Any:
    return build_random_vae(arch).to(device="cuda", dtype=dtype).eval().requires_grad_(False)


def _chunked(vae: Any, z: torch.Tensor) -> tuple[torch.Tensor, list]:
    n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    cache: list = [None] * n
    x = vae.post_quant_conv(z)
    outs = [vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0)) for i in range(x.shape[2])]
    out = torch.cat(outs, 2)
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=vae.config.patch_size)
    return out.clamp(-1, 1), cache


def _rgb8(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() * 0.5 + 0.5).clamp(0, 1) * 255).round()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (_rgb8(a) - _rgb8(b)).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0**2 / mse)).item()


@pytest.mark.parametrize("arch,size", [("wan2.1-tiny", (3, 6, 8)), ("wan2.2-tiny", (3, 4, 6)), ("wan2.1", (3, 12, 16))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_lossless_bit_identical(arch, size, dtype) -> None:
    vae = _vae(arch, dtype)
    torch.manual_seed(1)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, *size, device="cuda", dtype=dtype), "channels_last")
    with torch.inference_mode():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        want, want_cache = _chunked(vae, z)
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        assert set(rep.op_sets) == {"lossless", "fast"} and rep.disabled_ops == (), rep.skipped
        with P.using(P.LOSSLESS_TILED_OPS):
            got, got_cache = _chunked(vae, z)
    assert_same(got, want)
    for a, b in zip(got_cache, want_cache):
        if isinstance(b, torch.Tensor):
            assert_same(a, b)
        else:
            assert a == b


def _smooth(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Low-frequency latents: coarse noise, trilinearly upsampled."""
    b, c, t, h, w = shape
    coarse = torch.randn(b, c, max(t // 2, 1), max(h // 4, 1), max(w // 4, 1), generator=g, device="cuda")
    return F.interpolate(coarse, size=(t, h, w), mode="trilinear", align_corners=False) * 2


@pytest.mark.parametrize("arch,size", [("wan2.1", (3, 16, 24)), ("wan2.2", (3, 16, 24))])
@pytest.mark.parametrize("kind", ["white", "smooth"])
def test_fast_psnr_gate(arch, size, kind) -> None:
    """Fast keeps RGB8 PSNR against an fp32 decode within 0.5 dB of stock bf16's, and above 40 dB."""
    g = torch.Generator(device="cuda").manual_seed(3)
    vae32 = _vae(arch, torch.float32)
    shape = (1, vae32.config.z_dim, *size)
    z = torch.randn(shape, generator=g, device="cuda") if kind == "white" else _smooth(shape, g)
    with torch.inference_mode():
        P.prepare_decoder(vae32, kernels="off", layout="channels_last")
        ref, _ = _chunked(vae32, P.to_decoder_layout(z, "channels_last"))
        del vae32
        vae = _vae(arch, torch.bfloat16)
        zb = P.to_decoder_layout(z.to(torch.bfloat16), "channels_last")
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        stock, _ = _chunked(vae, zb)
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        with P.using(rep.ops_for("fast")):
            fast, _ = _chunked(vae, zb)
    p_stock, p_fast = _psnr(stock, ref), _psnr(fast, ref)
    assert p_fast >= p_stock - 0.5 and p_fast >= 40.0, (p_fast, p_stock)


def test_lossless_and_fast_sessions_interleave() -> None:
    """Two sessions on one decoder, chunks alternating between tiers: lossless stays bit-identical to stock."""
    vae = _vae("wan2.2-tiny", torch.bfloat16)
    z = P.to_decoder_layout(torch.randn(1, 6, 5, 4, 6, device="cuda", dtype=torch.bfloat16), "channels_last")
    n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    with torch.inference_mode():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        x = vae.post_quant_conv(z)
        want = [vae.decoder(x[:, :, i : i + 1], feat_cache=c, feat_idx=[0], first_chunk=(i == 0))
                for c in [[None] * n] for i in range(x.shape[2])]  # fmt: skip
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        lossless, fast = rep.ops_for("lossless"), rep.ops_for("fast")
        c_l: list = [None] * n
        c_f: list = [None] * n
        for i in range(x.shape[2]):
            with P.using(fast):
                vae.decoder(x[:, :, i : i + 1], feat_cache=c_f, feat_idx=[0], first_chunk=(i == 0))
            with P.using(lossless):
                got = vae.decoder(x[:, :, i : i + 1], feat_cache=c_l, feat_idx=[0], first_chunk=(i == 0))
            assert_same(got, want[i])
