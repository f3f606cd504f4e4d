"""The fast tier's fused norm site (``vaed.patches.fast``): the conv input's time taps unfolded
into channels by the tile kernel and one conv2d, against the fast pair (norm conv input, then
conv3d): conv3d's output layout, the same next cache, values within a rounding, no further from
float64; a deferred bias left out on request; only the measured conv shape taken.

GPU cases run cuDNN's conv at the decoder's 96 channels; interpreter cases run the kernel's
unfold on the CPU (``unfolded_norm_causal_conv``, the whole fused site, is CUDA only) with
torch's CPU conv2d (tests/backends.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vaed import kernels as K
from vaed import patches as P
from vaed.patches.fast import unfolded_causal_conv, unfolded_norm_causal_conv
from vaed.patches.ops import NormSilu

from backends import Backend, kernel_cases
from harness import lay

CL = torch.channels_last_3d
PAD = (1, 1, 1, 1, 2, 0)


def _conv(backend: Backend, c_in: int, c_out: int, dtype: torch.dtype, **kw) -> torch.nn.Conv3d:
    conv = torch.nn.Conv3d(c_in, c_out, kw.pop("kernel_size", 3), **kw).to(device=backend.device, dtype=dtype)
    conv.weight.data = conv.weight.data.contiguous(memory_format=CL)
    return conv


@kernel_cases("dtype, cache_frames, frames",
              cuda=[(d, c, f) for d in (torch.bfloat16, torch.float16) for c, f in ((0, 1), (1, 2), (2, 4))])
def test_unfolded_conv_matches_the_fast_pair_and_is_no_less_accurate(backend: Backend, dtype, cache_frames, frames) -> None:
    """The fused norm site (taps unfolded into channels, one conv2d) at the decoder's 96 channels:
    conv3d's output layout, the same next cache, values within a rounding of the fast pair (norm
    conv input, then cuDNN conv3d) and no further from a float64 conv than the pair is."""
    c = 96
    g = torch.Generator(device="cuda").manual_seed(frames)
    x = lay(torch.randn(1, c, frames, 30, 52, device="cuda", generator=g) * 3, "cl3d").to(dtype)
    cache = lay(torch.randn(1, c, cache_frames, 30, 52, device="cuda", generator=g), "cl3d").to(dtype) if cache_frames else None
    gamma = (torch.rand(c, 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
    conv = _conv(backend, c, c, dtype)
    norm = NormSilu(gamma, c**0.5, 0.0)
    with torch.no_grad():
        got = unfolded_norm_causal_conv(conv, x, cache, PAD, norm=norm)
        assert got is not None
        _assert_like_the_fast_pair(got, conv, x, cache, norm)


def _assert_like_the_fast_pair(
    got: tuple[torch.Tensor, torch.Tensor | None], conv: torch.nn.Conv3d, x: torch.Tensor,
    cache: torch.Tensor | None, norm: NormSilu,
) -> None:
    """``got`` (conv output, next cache) against the fast pair (norm conv input, then conv3d):
    conv3d's shape (and on the GPU its strides), the same next cache, values within a rounding,
    and no further from a float64 conv3d of the same conv input than the pair."""
    pair = P.FAST_OPS.without({"norm_causal_conv"}).causal_conv(conv, x, cache, PAD, norm=norm)
    assert got[0].shape == pair[0].shape and got[0].is_contiguous(memory_format=CL)
    if x.is_cuda:
        assert got[0].stride() == pair[0].stride()
    assert got[1] is not None and pair[1] is not None and torch.equal(got[1], pair[1])
    torch.testing.assert_close(got[0], pair[0], atol=3e-2, rtol=4e-2)
    padded, _ = K.causal_pad_cl(x, cache, PAD, norm_cl=norm)
    truth = F.conv3d(padded.double(), conv.weight.double(), conv.bias.double())
    err_got = (got[0].double() - truth).abs().mean()
    err_pair = (pair[0].double() - truth).abs().mean()
    assert err_got <= err_pair * 1.05, (err_got, err_pair)


@kernel_cases("", cuda=[()])
def test_unfolded_conv_passes_its_start_up_check_on_the_gpu(backend: Backend) -> None:
    from vaed.patches.checks import check_op

    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # fp32 has no case: half dtypes only
        assert check_op(P.FAST_OPS, "norm_causal_conv", torch.device("cuda"), dtype) is None, dtype
    with torch.inference_mode():  # the engine's start-up: the check's conv weights are inference tensors
        assert check_op(P.FAST_OPS, "norm_causal_conv", torch.device("cuda"), torch.bfloat16) is None


@kernel_cases(
    "dtype, cache_frames, frames",
    interpreter=[(torch.bfloat16, 2, 3), (torch.bfloat16, 0, 1), (torch.float16, 1, 2)],
)
def test_unfolded_conv_matches_the_fast_pair(backend: Backend, dtype, cache_frames, frames) -> None:
    """The unfolded conv (kernel unfold + conv2d) against the fast pair, B = 2: conv3d's layout,
    the same next cache, values within a rounding; the whole fused site declines off CUDA, and
    fp32 is not taken (half dtypes only)."""
    g = backend.generator(frames)
    x = lay(torch.randn(2, 5, frames, 4, 6, device=backend.device, dtype=dtype, generator=g), "cl3d")
    c = lay(torch.randn(2, 5, cache_frames, 4, 6, device=backend.device, dtype=dtype, generator=g), "cl3d") if cache_frames else None
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(dtype)
    conv = _conv(backend, 5, 5, dtype)
    ns = NormSilu(gamma, 5**0.5, 0.0)
    assert unfolded_norm_causal_conv(conv, x, c, PAD, norm=ns) is None  # CUDA only
    got = unfolded_causal_conv(conv, x, c, PAD, ns)
    want = P.FAST_OPS.without({"norm_causal_conv"}).causal_conv(conv, x, c, PAD, norm=ns)
    assert got[0].is_contiguous(memory_format=CL) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    c32 = None if c is None else c.float()
    assert unfolded_causal_conv(conv.float(), x.float(), c32, PAD, NormSilu(gamma.float(), 5**0.5, 0.0)) is None


@kernel_cases("", interpreter=[()])
def test_unfolded_conv_leaves_a_deferred_bias_out_on_request(backend: Backend) -> None:
    """bias=False: the conv's own bias is left for the next op; the norm's deferred x_bias is
    still added before the norm."""
    g = backend.generator(11)
    x = lay(torch.randn(2, 5, 3, 4, 6, device=backend.device, dtype=torch.bfloat16, generator=g), "cl3d")
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(torch.bfloat16)
    xb = torch.randn(5, device=backend.device, generator=g).to(torch.bfloat16)
    conv = _conv(backend, 5, 5, torch.bfloat16)
    deferred = NormSilu(gamma, 5**0.5, 0.0, xb)
    got, _ = unfolded_causal_conv(conv, x, None, PAD, deferred, bias=False)
    padded, _ = P.REFERENCE_OPS.causal_conv_input(x, None, PAD, norm=deferred)
    want = F.conv3d(padded.float(), conv.weight.float())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    with_bias, _ = unfolded_causal_conv(conv, x, None, PAD, deferred)
    torch.testing.assert_close(with_bias.float(), want + conv.bias.float().view(1, -1, 1, 1, 1), atol=3e-2, rtol=3e-2)


@kernel_cases("", cuda=[()], interpreter=[()])
def test_unfolded_conv_takes_only_the_measured_shape(backend: Backend) -> None:
    """Channels in = out <= UNFOLD_MAX_CHANNELS, stride 1, a 3x3x3 kernel; anything else declines
    in a steady chunk (cached frames). A first chunk's one frame takes any channel counts, and
    still declines another stride or kernel."""
    g = backend.generator(5)
    x = lay(torch.randn(1, 5, 2, 4, 6, device=backend.device, dtype=torch.bfloat16, generator=g), "cl3d")
    cache = lay(torch.randn(1, 5, 2, 4, 6, device=backend.device, dtype=torch.bfloat16, generator=g), "cl3d")
    first = x[:, :, :1]
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device) + 0.5).to(torch.bfloat16)
    ns = NormSilu(gamma, 5**0.5, 0.0)
    for kw in ({"c_out": 4}, {"stride": (1, 2, 2)}, {"kernel_size": (1, 3, 3)}):
        conv = _conv(backend, 5, kw.pop("c_out", 5), torch.bfloat16, **kw)
        assert unfolded_causal_conv(conv, x, cache, PAD, ns) is None, conv
        taken = unfolded_causal_conv(conv, first, None, PAD, ns) is not None
        assert taken == (conv.out_channels == 4), conv
    wide = lay(torch.randn(1, 128, 2, 2, 2, device=backend.device, dtype=torch.bfloat16), "cl3d")
    g128 = torch.ones(128, 1, 1, 1, device=backend.device, dtype=torch.bfloat16)
    conv = _conv(backend, 128, 128, torch.bfloat16)
    assert unfolded_causal_conv(conv, wide[:, :, 1:], wide[:, :, :1], PAD, NormSilu(g128, 128**0.5, 0.0)) is None
    assert unfolded_causal_conv(conv, wide[:, :, :1], None, PAD, NormSilu(g128, 128**0.5, 0.0)) is not None


@kernel_cases("dtype, channels", cuda=[(torch.bfloat16, (96, 96)), (torch.bfloat16, (384, 192)), (torch.float16, (192, 3))],
              interpreter=[(torch.bfloat16, (5, 4)), (torch.float16, (6, 6))])
def test_first_frame_conv_runs_only_the_last_tap_and_matches_the_fast_pair(
    backend: Backend, dtype, channels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first chunk's one frame (no cache, B = 2): the last time tap's conv2d against the fast
    pair (zero-padded norm conv input, then conv3d): conv3d's output layout, the same next
    cache, values within a rounding and no further from float64 than the pair; the conv2d sees
    C_in channels, not the unfolded KT * C_in."""
    c_in, c_out = channels
    g = backend.generator(c_in)
    h, w = (30, 52) if backend.name == "cuda" else (4, 6)
    x = lay(torch.randn(2, c_in, 1, h, w, device=backend.device, generator=g) * 3, "cl3d").to(dtype)
    gamma = (torch.rand(c_in, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(dtype)
    conv = _conv(backend, c_in, c_out, dtype)
    ns = NormSilu(gamma, c_in**0.5, 0.0)
    seen: list[int] = []  # the input channels of each conv2d the op runs
    conv2d = F.conv2d

    def spy(inp: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append(weight.shape[1])
        return conv2d(inp, weight, *args, **kwargs)

    with torch.no_grad():
        monkeypatch.setattr(F, "conv2d", spy)
        got = unfolded_causal_conv(conv, x, None, PAD, ns)
        monkeypatch.undo()
        assert got is not None and seen == [c_in]
        _assert_like_the_fast_pair(got, conv, x, None, ns)
