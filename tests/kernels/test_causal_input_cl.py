"""The channels-last causal-input tile kernel (``causal_pad_cl``, the lossless-tiled and fast
tiers' conv input): pure data movement bit-exact against ``causal_pad_reference``; the exact
norm+SiLU prologue bit-exact on the GPU; the fast prologue (one fp32 pass, optionally with the
producing conv's deferred bias) within a rounding; the unfolded time taps (``unfold=3``) equal
to a naive unfolding.

Both backends (tests/backends.py); what uses ``exp`` is held to a tolerance under the
interpreter (numpy's exp, truncating bf16 cast) and bit-exact on the GPU.
"""

from __future__ import annotations

import torch

from vaed import kernels as K
from vaed import patches as P
from vaed.patches.ops import NormSilu

from backends import Backend, grid, kernel_cases
from harness import assert_same, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CL = torch.channels_last_3d
INTERP_PADS = ((1, 1, 1, 1, 2, 0), (0, 1, 1, 0, 2, 0))


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """The interpreter's norm+SiLU error: its exp is numpy's, its bf16 cast truncates."""
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _inputs(backend: Backend, dtype, layout, cache_frames, frames, channels, seed) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: a strided view (frames of a bigger tensor); the cache: the last frames of another."""
    b, h, w = (2, 9, 13) if not backend.interpreter else (1, 4, 6)
    g = backend.generator(seed)
    x = lay(torch.randn(b, channels, frames + 1, h, w, device=backend.device, dtype=dtype, generator=g), layout)[:, :, 1:]
    cache = None
    if cache_frames:
        big = lay(torch.randn(b, channels, 3, h, w, device=backend.device, dtype=dtype, generator=g), layout)
        cache = big[:, :, 3 - cache_frames :]
    return x, cache


@kernel_cases(
    "dtype, layout, cache_frames, pad, frames, channels",
    cuda=grid(DTYPES, ("cl3d", "ntchw"), (0, 1, 2),
              ((1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0), (0, 1, 1, 0, 2, 0), (2, 0, 0, 1, 2, 0)), (1, 2, 4), (24, 384, 1024)),
    interpreter=grid((torch.bfloat16, torch.float32), ("cl3d",), (0, 2), INTERP_PADS, (1, 3), (5,)),
)
def test_causal_pad_cl_exact(backend: Backend, dtype, layout, cache_frames, pad, frames, channels) -> None:
    x, cache = _inputs(backend, dtype, layout, cache_frames, frames, channels, cache_frames * 10 + frames)
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
    want = K.causal_pad_reference(x, cache, pad, emit_cache=False)
    assert want[1] is None
    assert_same(got[0], want[0])


@kernel_cases(
    "dtype, frames, view",
    cuda=grid(DTYPES, (1, 2), (False,)),
    interpreter=grid((torch.bfloat16, torch.float32), (1, 3), (False, True)),
)
def test_causal_pad_cl_rep_marker(backend: Backend, dtype, frames, view) -> None:
    """zero_history (the "Rep" cache marker), on a tensor of its own and on a strided view."""
    c, h, w = (16, 5, 7) if not backend.interpreter else (5, 4, 6)
    x = lay(torch.randn(1, c, frames + view, h, w, device=backend.device, dtype=dtype,
                        generator=backend.generator(frames)), "cl3d")[:, :, int(view):]
    got = K.causal_pad_cl(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
    want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
    assert got is not None
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@kernel_cases(
    "dtype, layout, cache_frames, pad, frames, channels",
    cuda=grid(DTYPES, ("cl3d", "ntchw"), (0, 2), ((1, 1, 1, 1, 2, 0), (0, 1, 1, 0, 2, 0)), (1, 4), (24, 384)),
    interpreter=grid((torch.bfloat16, torch.float32), ("cl3d",), (0, 2), INTERP_PADS, (1, 3), (5,)),
)
def test_causal_pad_cl_exact_norm(backend: Backend, dtype, layout, cache_frames, pad, frames, channels) -> None:
    """The exact norm+SiLU prologue in the tile kernel equals the aten chain (and the 1-D kernel)."""
    g = backend.generator(cache_frames * 10 + frames + channels)
    b, h, w = (2, 9, 13) if not backend.interpreter else (1, 4, 6)
    x = lay(torch.randn(b, channels, frames + 1, h, w, device=backend.device, dtype=dtype, generator=g) * 2, layout)[:, :, 1:]
    cache = None
    if cache_frames:
        cache = lay(torch.randn(b, channels, 3, h, w, device=backend.device, dtype=dtype, generator=g), layout)[:, :, 1:]
    gamma = (torch.rand(channels, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(dtype)
    args = K.NormSilu(gamma, channels**0.5, 0.0, denom=K.norm_denominator(x))
    want = K.causal_pad_reference(x, cache, pad, norm=K.NormSilu(gamma, channels**0.5, 0.0))
    got = K.causal_pad_cl(x, cache, pad, norm=args)
    if layout == "cl3d":
        assert got is not None
    if got is None:
        return
    for a, b_ in zip(got, want):
        if backend.exact(dtype, exp=True):
            assert_same(a, b_)
        else:
            assert a.stride() == b_.stride()
            torch.testing.assert_close(a, b_, **_tolerance(dtype))


@kernel_cases(
    "dtype, cache_frames, pad, frames",
    interpreter=grid((torch.bfloat16, torch.float32), (0, 2), INTERP_PADS, (1, 3)),
)
def test_causal_pad_cl_fast_norm_close(backend: Backend, dtype, cache_frames, pad, frames) -> None:
    """The fast prologue (``norm_cl``: one fp32 pass) within a rounding of the aten chain. The GPU's
    accuracy bar is test_norm.py's test_fast_norm_no_less_accurate_than_stock."""
    x, cache = _inputs(backend, dtype, "cl3d", cache_frames, frames, 5, cache_frames * 10 + frames)
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device, generator=backend.generator(5)) + 0.5).to(dtype)
    want = K.causal_pad_reference(x, cache, pad, norm=K.NormSilu(gamma, 5**0.5, 0.0))
    got = K.causal_pad_cl(x, cache, pad, norm_cl=K.NormSilu(gamma, 5**0.5, 0.0))
    assert got is not None
    for a, b in zip(got, want):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, **_tolerance(dtype))


@kernel_cases("dtype", interpreter=grid((torch.float32, torch.bfloat16)))
def test_deferred_bias_in_the_fast_prologue(backend: Backend, dtype) -> None:
    """A deferred conv bias (NormSilu.x_bias): the fast prologue adds it before the norm, as the
    reference does with x + bias first, in the kernel and through FAST_OPS.norm_causal_pad. The
    GPU's accuracy bar is test_norm.py's test_deferred_conv_bias_in_the_norm_prologue."""
    tol = _tolerance(dtype)
    g = backend.generator(7)
    pad = (1, 1, 1, 1, 2, 0)
    x = lay(torch.randn(2, 5, 2, 4, 6, device=backend.device, dtype=dtype, generator=g), "cl3d")
    c = lay(torch.randn(2, 5, 2, 4, 6, device=backend.device, dtype=dtype, generator=g), "cl3d")
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(dtype)
    xb = (torch.randn(5, device=backend.device, generator=g) * 3).to(dtype)
    want = K.causal_pad_reference(x + xb.view(1, -1, 1, 1, 1), c, pad, norm=K.NormSilu(gamma, 5**0.5, 0.0))
    got = K.causal_pad_cl(x, c, pad, norm_cl=K.NormSilu(gamma, 5**0.5, 0.0, xb))
    without = K.causal_pad_cl(x, c, pad, norm_cl=K.NormSilu(gamma, 5**0.5, 0.0))
    for a, b in zip(got, want):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, **tol)
    assert not torch.allclose(got[0].float(), without[0].float(), **tol)  # the bias is not ignored
    got = P.FAST_OPS.norm_causal_pad(x, c, pad, norm=NormSilu(gamma, 5**0.5, 0.0, xb))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def _unfolded(p: torch.Tensor, kt: int) -> torch.Tensor:
    """Each output frame's kt input frames side by side in channels; B and T flattened (b*TO+t)."""
    frames = [torch.cat([p[:, :, t + k] for k in range(kt)], 1) for t in range(p.shape[2] - kt + 1)]
    return torch.stack(frames, 1).flatten(0, 1)


@kernel_cases(
    "dtype, cache_frames, frames, fast_norm",
    interpreter=[(d, c, f, n) for d, c, f in ((torch.bfloat16, 2, 3), (torch.bfloat16, 0, 1), (torch.float16, 1, 2))
                 for n in (False, True)],
)
def test_causal_pad_cl_unfold(backend: Backend, dtype, cache_frames, frames, fast_norm) -> None:
    """unfold=3: the padded tensor's values, each frame stored in every slot it feeds (B = 2),
    bit-exact against a naive unfolding; the next cache as without it; in fp32 too."""
    g = backend.generator(frames)
    pad = (1, 1, 1, 1, 2, 0)
    x = lay(torch.randn(2, 5, frames, 4, 6, device=backend.device, dtype=dtype, generator=g), "cl3d")
    c = lay(torch.randn(2, 5, cache_frames, 4, 6, device=backend.device, dtype=dtype, generator=g), "cl3d") if cache_frames else None
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(dtype)
    kw = {"norm_cl": K.NormSilu(gamma, 5**0.5, 0.0)} if fast_norm else {}
    p, nx = K.causal_pad_cl(x, c, pad, **kw)
    u, nu = K.causal_pad_cl(x, c, pad, unfold=3, **kw)
    assert u.shape == (2 * frames, 15, 6, 8) and u.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(u, _unfolded(p, 3)) and torch.equal(nu, nx)
    if fast_norm:
        return
    c32 = None if c is None else c.float()
    p, nx = K.causal_pad_cl(x.float(), c32, pad)  # the kernel's unfold in fp32
    u, nu = K.causal_pad_cl(x.float(), c32, pad, unfold=3)
    assert torch.equal(u, _unfolded(p, 3)) and torch.equal(nu, nx)


@kernel_cases("", cuda=[()], interpreter=[()])
def test_causal_pad_cl_declines_contiguous(backend: Backend) -> None:
    """Layouts the aten chain writes contiguous are left to the 1-D kernel."""
    xc = torch.randn(1, 5, 2, 4, 6, device=backend.device)
    assert K.causal_pad_cl(xc, None, (1, 1, 1, 1, 2, 0)) is None


def _aten_not_channels_last(backend: Backend, dtype, case: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inputs whose aten chain writes the padded input NCDHW: an up block's one-frame first input
    (a permuted conv2d output of batch 1, its size-1 dims' strides not channels_last_3d's), the
    cache that chunk leaves (NCDHW, as aten wrote it) beside a channels-last chunk, and an NCDHW
    activation (the mid block's attention output)."""
    g = backend.generator(11)
    c, h, w = 5, 4, 6
    if case == "one-frame view":
        base = torch.randn(1, c, h, w, device=backend.device, dtype=dtype, generator=g)
        base = base.contiguous(memory_format=torch.channels_last)
        return base.as_strided((1, c, 1, h, w), (c, 1, c, w * c, c)), None
    if case == "ncdhw cache":
        x = lay(torch.randn(1, c, 2, h, w, device=backend.device, dtype=dtype, generator=g), "cl3d")
        return x, torch.randn(1, c, 2, h, w, device=backend.device, dtype=dtype, generator=g)
    return torch.randn(1, c, 2, h, w, device=backend.device, dtype=dtype, generator=g), None


@kernel_cases("dtype, case", cuda=grid((torch.bfloat16, torch.float32), ("one-frame view", "ncdhw cache", "ncdhw")),
              interpreter=grid((torch.bfloat16,), ("one-frame view", "ncdhw cache", "ncdhw")))
def test_causal_pad_cl_channels_last_out(backend: Backend, dtype, case: str) -> None:
    """channels_last_out: where aten's chain writes NCDHW (which the default leaves to the 1-D
    kernel), the padded input and next cache come out channels_last_3d with the reference's
    values: bit-exact without a norm, within a rounding with the fast prologue (also unfolded)."""
    x, cache = _aten_not_channels_last(backend, dtype, case)
    pad = (1, 1, 1, 1, 2, 0)
    want = K.causal_pad_reference(x, cache, pad)
    assert not want[0].is_contiguous(memory_format=CL)  # the case is one where aten leaves channels-last
    assert K.causal_pad_cl(x, cache, pad) is None
    got = K.causal_pad_cl(x, cache, pad, channels_last_out=True)
    assert got is not None
    for a, b in zip(got, want):
        assert a.is_contiguous(memory_format=CL) and a.shape == b.shape
        assert torch.equal(a, b)
    gamma = (torch.rand(5, 1, 1, 1, device=backend.device, generator=backend.generator(5)) + 0.5).to(dtype)
    norm = K.NormSilu(gamma, 5**0.5, 0.0)
    want = K.causal_pad_reference(x, cache, pad, norm=norm)
    got = K.causal_pad_cl(x, cache, pad, norm_cl=norm, channels_last_out=True)
    assert got is not None
    for a, b in zip(got, want):
        assert a.is_contiguous(memory_format=CL)
        torch.testing.assert_close(a, b, **_tolerance(dtype))
    u, nu = K.causal_pad_cl(x, cache, pad, norm_cl=norm, unfold=3, channels_last_out=True)
    assert torch.equal(u, _unfolded(got[0], 3)) and torch.equal(nu, got[1])


@kernel_cases("dtype, case, with_norm",
              cuda=grid((torch.bfloat16, torch.float32), ("one-frame view", "ncdhw cache", "ncdhw", "ntchw"), (False, True)),
              interpreter=grid((torch.bfloat16, torch.float32), ("one-frame view", "ncdhw cache", "ncdhw", "ntchw"), (False, True)))
def test_exact_conv_input_for_a_channels_last_conv(backend: Backend, dtype, case: str, with_norm: bool) -> None:
    """The lossless conv input for a conv that runs channels-last whatever its input's layout
    (``channels_last=True``: cuDNN with a channels_last_3d weight copies any other input to that
    layout first): where aten's chain writes another layout, the padded input comes out
    channels_last_3d with the reference's values (the exact norm prologue's too), and the next
    cache keeps the reference's strides; without the flag, the reference's layout."""
    if case == "ntchw":  # Wan2.2's activations after an upsampler: the image conv's NCHW output;
        # 72 channels: three of the transposing tile's channel blocks, the last one partial
        shape = (1, 72, 2, 4, 6)
        x = lay(torch.randn(shape, device=backend.device, dtype=dtype, generator=backend.generator(3)), "ntchw")
        cache = lay(torch.randn(shape, device=backend.device, dtype=dtype, generator=backend.generator(4)), "ntchw")
    else:
        x, cache = _aten_not_channels_last(backend, dtype, case)
    pad = (1, 1, 1, 1, 2, 0)
    c = x.shape[1]
    gamma = (torch.rand(c, 1, 1, 1, device=backend.device, generator=backend.generator(5)) + 0.5).to(dtype)
    norm = K.NormSilu(gamma, c**0.5, 0.0) if with_norm else None
    want = K.causal_pad_reference(x, cache, pad, norm=norm)
    assert not want[0].is_contiguous(memory_format=CL)  # the case is one where aten leaves channels-last
    stock = P.LOSSLESS_OPS.causal_conv_input(x, cache, pad, norm=norm)
    got = P.LOSSLESS_OPS.causal_conv_input(x, cache, pad, norm=norm, channels_last=True)
    exact = not with_norm or backend.exact(dtype, exp=True)
    for padded, nxt in (stock, got):
        if exact:
            assert torch.equal(padded, want[0])
            assert_same(nxt, want[1])
        else:
            torch.testing.assert_close(padded, want[0], **_tolerance(dtype))
            torch.testing.assert_close(nxt, want[1], **_tolerance(dtype))
            assert nxt.stride() == want[1].stride()
    assert stock[0].stride() == want[0].stride()
    assert got[0].is_contiguous(memory_format=CL) and got[0].shape == want[0].shape
    assert torch.equal(got[0], stock[0]) and torch.equal(got[1], stock[1])
