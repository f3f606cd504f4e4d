"""The causal-input kernel (``causal_pad``, the 1-D kernel): the padded conv input and the next
cache, bit-exact (torch.equal, strides included) against ``causal_pad_reference``.

Every test runs on both backends (tests/backends.py): the GPU at the decoder's sizes, the
Triton interpreter on the CPU on small ones. The norm+SiLU prologue uses ``exp``, which the
interpreter computes with numpy, so it is held to a tolerance there and bit-exact on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vaed import kernels as K

from backends import Backend, grid, kernel_cases
from harness import assert_same, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("cl3d", "contiguous", "ntchw")
CL = torch.channels_last_3d


def assert_kernel_result(backend: Backend, got: tuple, want: tuple, *, exact: bool, dtype: torch.dtype) -> None:
    """Bit-exact where the backend reproduces the arithmetic; else same strides and values within
    the interpreter's exp error (atol 1e-5 fp32 / 1e-1 half, rtol 1e-2)."""
    for a, b in zip(got, want):
        if exact:
            assert_same(a, b)
        else:
            assert a.stride() == b.stride(), (a.stride(), b.stride())
            torch.testing.assert_close(a, b, atol=1e-5 if dtype == torch.float32 else 1e-1, rtol=1e-2)


@kernel_cases(
    "dtype, layout, cache_frames, pad, frames, norm",
    cuda=grid(DTYPES, LAYOUTS, (0, 1, 2),
              ((1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0), (0, 1, 1, 1, 2, 0), (1, 1, 0, 1, 2, 0), (1, 0, 1, 0, 2, 0)),
              (1, 2, 4), (False, True)),
    interpreter=grid(DTYPES, LAYOUTS, (0, 1, 2), ((1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0)), (1, 3), (False,))
    + grid((torch.float32, torch.bfloat16), ("cl3d", "contiguous"), (2,), ((1, 1, 1, 1, 2, 0),), (2,), (True,)),
)
def test_causal_pad_exact(backend: Backend, dtype, layout, cache_frames, pad, frames, norm) -> None:
    """Frames, a strided cache view of the last frames, every padding the decoder uses, with and
    without the exact norm+SiLU prologue."""
    c, h, w = (24, 9, 13) if not backend.interpreter else ((6, 4, 5) if norm else (3, 4, 5))
    b = 2 if not backend.interpreter else 1
    g = backend.generator(cache_frames * 10 + frames)
    x = lay(torch.randn(b, c, frames + 1, h, w, device=backend.device, dtype=dtype, generator=g), layout)[:, :, 1:]
    cache = None
    if cache_frames:
        # a strided view: the last frames of a bigger tensor
        big = lay(torch.randn(b, c, 3, h, w, device=backend.device, dtype=dtype, generator=g), layout)
        cache = big[:, :, 3 - cache_frames :]
    kw = {}
    ref_norm = None
    if norm:
        gamma = (torch.rand(c, 1, 1, 1, device=backend.device, generator=g) + 0.5).to(dtype)
        ref_norm = K.NormSilu(gamma, c**0.5, 0.0)
        kw["norm"] = K.NormSilu(gamma, c**0.5, 0.0, denom=K.norm_denominator(x))
    got = K.causal_pad(x, cache, pad, **kw)
    want = K.causal_pad_reference(x, cache, pad, norm=ref_norm)
    assert got is not None
    assert_kernel_result(backend, got, want, exact=backend.exact(dtype, exp=norm), dtype=dtype)


@kernel_cases(
    "dtype, layout, frames, view",
    cuda=grid(DTYPES, ("cl3d", "contiguous"), (1, 2), (False, True)),
    interpreter=grid(DTYPES, LAYOUTS, (1, 3), (False, True)),
)
def test_causal_pad_rep_marker(backend: Backend, dtype, layout, frames, view) -> None:
    """zero_history (diffusers' "Rep" cache marker: the history frames are zeros), on a tensor
    of its own and on a strided view of the last frames."""
    c, h, w = (16, 5, 7) if not backend.interpreter else (3, 4, 5)
    x = lay(torch.randn(1, c, frames + view, h, w, device=backend.device, dtype=dtype,
                        generator=backend.generator(frames)), layout)[:, :, int(view):]
    pad = (0, 0, 0, 0, 2, 0)
    got = K.causal_pad(x, None, pad, zero_history=True)
    want = K.causal_pad_reference(x, None, pad, zero_history=True)
    assert got is not None
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@kernel_cases(
    "dtype, layout, cache_frames, pad",
    cuda=grid(DTYPES, ("cl3d", "contiguous"), (0, 2),
              ((0, 1, 1, 0, 2, 0), (2, 0, 0, 1, 2, 0), (1, 0, 1, 1, 2, 0), (0, 1, 0, 1, 2, 0), (2, 0, 0, 3, 2, 0))),
    interpreter=grid((torch.bfloat16, torch.float32), ("cl3d", "contiguous"), (0, 2),
                     ((0, 1, 1, 0, 2, 0), (2, 0, 0, 1, 2, 0))),
)
def test_causal_pad_one_sided_spatial_padding(backend: Backend, dtype, layout, cache_frames, pad) -> None:
    """A shard's interior edge pads one side only: exact, with and without the next-cache write."""
    g = backend.generator(cache_frames + sum(pad))
    x = lay(torch.randn(1, 3, 2, 4, 5, device=backend.device, dtype=dtype, generator=g), layout)
    c = lay(torch.randn(1, 3, 2, 4, 5, device=backend.device, dtype=dtype, generator=g), layout) if cache_frames else None
    want = K.causal_pad_reference(x, c, pad)
    got = K.causal_pad(x, c, pad)
    assert got is not None
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
    got = K.causal_pad(x, c, pad, emit_cache=False)
    assert got is not None and got[1] is None
    assert_same(got[0], want[0])


@kernel_cases(
    "channels, frames, cache_frames, zero_history, norm",
    cuda=[(c, *f, n) for c in (3, 16, 96, 192, 384, 1024)
          for f in ((1, 0, False), (1, 0, True), (4, 2, False), (1, 2, False)) for n in (False, True)],
)
def test_causal_pad_exact_at_decoder_channel_counts(backend: Backend, channels, frames, cache_frames, zero_history, norm) -> None:
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


@kernel_cases("", cuda=[()])
def test_causal_pad_declines_and_rejects(backend: Backend) -> None:
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


@kernel_cases("", cuda=[()])
def test_int64_indexing_past_2_31(backend: Backend) -> None:
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
