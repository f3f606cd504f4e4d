"""A residual block's output ``x + bias + h`` in one pass, lossy (the fast tier's) or exact.

torch adds a cuDNN conv's bias in a pass of its own over the conv output
(``aten::add_`` after the conv kernel), and the block then reads that output
again for ``x + h``. With conv2's bias left out of the conv, this kernel adds
the bias and the shortcut in the same read: per 480x832 steady chunk of
Wan2.1 the bias passes took 5.2 ms of 40 ms on an H200 (fast tier, bf16).

The fast tier's sum is taken in fp32 with one rounding at the end, where
stock rounds after the bias add and again after the shortcut add: not
bit-exact, and no less accurate. With ``exact`` the kernel rounds where stock
does: ``x + bias`` to x's dtype first (the conv's own bias pass, the bias
itself rounded to x's dtype as aten's in-place add would), then ``+ h`` --
stock's bytes in one pass instead of three (the lossless tier's). Layout: ``x`` and ``h`` dense
channels_last_3d (the decoder's layout; strides of size-1 dims may differ),
viewed as [pixels, channels] tiles; anything else is declined (None) and the
caller runs the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vaed.kernels import _runtime as rt

if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter

_MAX_C = 4096


def bias_residual_add_reference(
    x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None, *, exact: bool = False
) -> torch.Tensor:
    """The kernel's arithmetic in plain torch: (x + bias) + h in fp32, one rounding; with
    ``exact``, rounded to x's dtype after the bias add as well (stock's two aten adds)."""
    acc = x.float()
    if bias is not None:
        b = bias.to(x.dtype) if exact else bias
        acc = acc + b.float().view(1, -1, 1, 1, 1)
        if exact:
            acc = acc.to(x.dtype).float()
    return (acc + h.float()).to(x.dtype)


def _bias_residual_add_kernel(
    x_ptr, h_ptr, b_ptr, o_ptr,
    P, C,
    HAS_BIAS: tl.constexpr, ROUND_BIAS: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    if IDX64:
        p = p.to(tl.int64)
        c = c.to(tl.int64)
    live = (p[:, None] < P) & (c[None, :] < C)
    offs = p[:, None] * C + c[None, :]
    v = tl.load(x_ptr + offs, mask=live, other=0.0)
    acc = v.to(tl.float32)
    if HAS_BIAS:
        # loaded at the tile's shape: a [BLOCK_C] load gets a layout of its own, and the
        # conversion between the two goes through shared memory
        bias = tl.load(tl.broadcast_to(b_ptr + c[None, :], (BLOCK_P, BLOCK_C)), mask=c[None, :] < C, other=0.0)
        if ROUND_BIAS:  # the conv's own bias pass: the bias in x's dtype, the sum rounded to it
            acc = (acc + bias.to(v.dtype).to(tl.float32)).to(v.dtype).to(tl.float32)
        else:
            acc = acc + bias.to(tl.float32)
    acc = acc + tl.load(h_ptr + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(o_ptr + offs, acc.to(v.dtype), mask=live)


_kernel = rt.jit_lazy(_bias_residual_add_kernel, globals())


def bias_residual_add(
    x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None, *, exact: bool = False
) -> torch.Tensor | None:
    """``bias_residual_add_reference`` in one kernel; None when not handled (caller falls back)."""
    if not rt.triton_available() or x.dim() != 5 or h.shape != x.shape or x.numel() == 0:
        return None
    if x.dtype not in rt.SUPPORTED_DTYPES or h.dtype != x.dtype or h.device != x.device or not rt.device_ok(x):
        return None
    shape = tuple(x.shape)
    # dense channels_last_3d, size-1 dims' strides aside (they differ between producers at T = 1)
    if not (rt.matches_order(shape, x.stride(), rt.ORDER_CL3D) and rt.matches_order(shape, h.stride(), rt.ORDER_CL3D)):
        return None
    out_stride = rt.add_strides(shape, x.stride(), h.stride())  # aten's x + h strides
    if not rt.matches_order(shape, out_stride, rt.ORDER_CL3D):
        return None
    c = shape[1]
    if c > _MAX_C:
        return None
    if bias is not None and (  # x's dtype, or fp32 when the forwards summed several biases
        bias.numel() != c or bias.dtype not in (x.dtype, torch.float32) or bias.device != x.device
        or not bias.is_contiguous()
    ):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or h.requires_grad):
        return None
    out = rt.empty_with_strides(shape, out_stride, x)
    block_p, block_c, num_warps = rt.channel_tile(c)
    pixels = x.numel() // c
    _kernel()[(-(-pixels // block_p),)](
        x, h, x if bias is None else bias, out, pixels, c,
        HAS_BIAS=bias is not None, ROUND_BIAS=exact, IDX64=not rt.offsets_fit_int32((x,), slack=block_p * c),
        BLOCK_P=block_p, BLOCK_C=block_c, num_warps=num_warps,
        **rt.launch_opts(x),
    )
    return out
