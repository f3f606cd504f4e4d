"""WanResample's frame flattening + WanUpsample (nearest-exact 2x) in one gather.

Stock: ``x.permute(0, 2, 1, 3, 4).reshape(b*t, c, h, w)`` (a copy unless it is
a view), then ``x.float()``, ``interpolate(scale_factor=2, mode="nearest-exact")``
and ``.type_as(x)`` -- fp32 round trips over a 4x larger tensor. For scale 2
nearest-exact picks source pixel ``dst // 2`` exactly and the fp32 round trip
is lossless, so one bf16 gather gives identical bytes. With ``interleave`` the
input is the time_conv output (b, 2c, t, h, w) and the op also does the
reshape/stack that doubles the frame count.

``bias`` is the time_conv's bias, left out of that conv: each source value
gets it added and rounded to x's dtype before the gather, exactly what the
conv's own bias pass (torch adds a cuDNN conv's bias in an aten pass of its
own) would have stored -- one read and one write of the time_conv output
fewer, for stock's bytes.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vaed.kernels import _runtime as rt

_BLOCK = 1024
if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter

_ORDER4_NCHW = (0, 1, 2, 3)
_ORDER4_NHWC = (0, 2, 3, 1)


def frames_to_images(x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """WanResample.forward's reshapes before ``self.resample``, op for op."""
    b, c, t, h, w = x.shape
    if interleave:
        c //= 2
        x = x.reshape(b, 2, c, t, h, w)
        x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
        x = x.reshape(b, c, t * 2, h, w)
        t *= 2
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


def upsample_nearest2x_reference(
    x: torch.Tensor, interleave: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Flatten frames (see ``frames_to_images``) then WanUpsample(scale 2, nearest-exact); a
    ``bias`` ([C] of x) is added first, as the producing conv's own bias pass (aten, one rounding)."""
    if bias is not None:
        x = x + bias.view(1, -1, 1, 1, 1)
    x4 = frames_to_images(x, interleave)
    return F.interpolate(x4.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x4)


@functools.lru_cache(maxsize=1024)
def _out_layout(
    shape: tuple[int, ...], stride: tuple[int, ...], interleave: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    x = torch.empty_strided(shape, stride, device="meta", dtype=torch.bfloat16)
    y = upsample_nearest2x_reference(x, interleave)
    return tuple(y.shape), tuple(y.stride())


def _upsample_kernel(
    x_ptr, b_ptr, o_ptr,
    C, H, W, N1, N2, INNER, DIV, ROWDIV,
    s0, s1, s2, sc, sh, sw,
    CL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < INNER
    q = (i // DIV).to(tl.int64)
    r = (i % DIV).to(tl.int64)
    n = row // ROWDIV
    if CL:  # N H W C: a row is (n, y); inner is (x, c)
        y = row % ROWDIV
        xo = q
        c = r
    else:  # N C H W: a row is (n, c); inner is (y, x)
        c = row % ROWDIV
        y = q
        xo = r
    n2 = n % N2
    n1 = (n // N2) % N1
    n0 = n // (N2 * N1)
    src = n0 * s0 + n1 * s1 + n2 * s2 + c * sc + (y // 2) * sh + (xo // 2) * sw
    v = tl.load(x_ptr + src, mask=live, other=0.0)
    if HAS_BIAS:  # source channel n2 * C + c (the interleave's channel block n2)
        # a scalar in the NCHW case (c is the row's): broadcast to the block for the mask
        b = tl.load(b_ptr + (n2 * C + c + q * 0), mask=live, other=0.0)
        v = (v.to(tl.float32) + b.to(tl.float32)).to(v.dtype)
    tl.store(o_ptr + row * INNER + i, v, mask=live)


_kernel = rt.jit_lazy(_upsample_kernel, globals())


def upsample_nearest2x(
    x: torch.Tensor, interleave: bool = False, bias: torch.Tensor | None = None, *, channels_last: bool = False
) -> torch.Tensor | None:
    """Fused ``upsample_nearest2x_reference``: returns (b*t', c, 2h, 2w) or None (caller falls back).

    The output has the reference's strides, or with ``channels_last`` the same values in NHWC
    whatever the reference's layout: the interleave's stack makes the reference's images NCHW,
    so the next conv2d would write NCHW and the frames after it would leave channels_last_3d."""
    if not rt.triton_available() or x.dim() != 5 or x.dtype not in rt.SUPPORTED_DTYPES:
        return None
    if not rt.device_ok(x) or x.numel() == 0:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    if torch.compiler.is_compiling():
        return None
    b, c, t, h, w = x.shape
    if interleave and c % 2:
        return None
    if bias is not None and (
        bias.shape != (c,) or bias.dtype != x.dtype or bias.device != x.device or not bias.is_contiguous()
    ):
        return None
    shape, stride = _out_layout(tuple(x.shape), tuple(x.stride()), interleave)
    if channels_last:
        stride = rt.dense_strides(shape, _ORDER4_NHWC)
    if rt.matches_order(shape, stride, _ORDER4_NHWC) and not rt.matches_order(shape, stride, _ORDER4_NCHW):
        cl = True
    elif rt.matches_order(shape, stride, _ORDER4_NCHW):
        cl = False
    else:
        return None
    n, co, ho, wo = shape
    sxb, sxc, sxt, sxh, sxw = x.stride()
    if interleave:
        # output image (bi*t + ti)*2 + j is channel block j of input frame ti
        n1, n2, s2 = t, 2, co * sxc
    else:
        n1, n2, s2 = t, 1, 0
    inner = wo * co if cl else ho * wo
    if inner + _BLOCK >= 2**31:
        return None
    out = rt.empty_with_strides(shape, stride, x)
    rows = out.numel() // inner
    grid = (rows, -(-inner // _BLOCK))
    _kernel()[grid](
        x, x if bias is None else bias, out,
        co, h, w, n1, n2, inner, co if cl else wo, ho if cl else co,
        sxb, sxt, s2, sxc, sxh, sxw,
        CL=cl, HAS_BIAS=bias is not None, BLOCK=_BLOCK, num_warps=4,
    )
    return out
