"""``main + DupUp3D(source)`` in one gather-and-add (Wan2.2 residual up-block shortcut).

Stock diffusers materializes the shortcut (repeat_interleave, an 8-D permute
and ``.contiguous()``, 2x..8x the source size) only to add it to the block
output. This op reads ``source`` through the same index map and adds it to
``main`` in fp32 (aten's opmath for bf16/fp16), writing the strides aten's
``main + shortcut`` would give.

With ``bias`` (the upsampler conv's bias, left out of the conv that wrote
``main``) either kernel adds it to ``main`` and rounds before the shortcut
add: the two roundings of stock's separate bias pass and add, so still exact.

Two kernels, one index map, the repeat count a compile-time constant in both:
a channels_last_3d output (the GPU decoder's layout) goes to a 2-D tile
kernel (pixels x channels, no per-element division by a runtime value); other
layouts (Wan2.2's lossless activations after an upsampler: NTCHW, the image
conv's NCHW output) to the flat kernel. On an H200 at Wan2.2 704x1280 (bf16, steady
chunk, 3 calls) the flat kernel took 10.2 ms, 8 % of the chunk; the tile
kernel takes 0.93 ms.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from vaed.kernels import _runtime as rt

_BLOCK = 1024
if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter

# output memory orders the kernel addresses (LAYOUT constexpr)
_LAYOUTS = (rt.ORDER_CONTIGUOUS, rt.ORDER_CL3D, rt.ORDER_NTCHW)


def dupup_reference(
    x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int, first_chunk: bool
) -> torch.Tensor:
    """diffusers' DupUp3D.forward, op for op."""
    repeats = out_channels * factor_t * factor_s * factor_s // x.shape[1]
    x = x.repeat_interleave(repeats, dim=1)
    x = x.view(x.size(0), out_channels, factor_t, factor_s, factor_s, x.size(2), x.size(3), x.size(4))
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
    x = x.view(x.size(0), out_channels, x.size(2) * factor_t, x.size(4) * factor_s, x.size(6) * factor_s)
    if first_chunk:
        x = x[:, :, factor_t - 1 :, :, :]
    return x


def dupup_add_reference(
    main: torch.Tensor,
    source: torch.Tensor,
    factor_t: int,
    factor_s: int,
    first_chunk: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``main + DupUp3D(source)``; with ``bias`` (the conv bias left out of ``main``), added to
    ``main`` first as the conv's own bias pass would have."""
    if bias is not None:
        main = main + bias.view(1, -1, 1, 1, 1)
    return main + dupup_reference(source, main.shape[1], factor_t, factor_s, first_chunk)


@functools.lru_cache(maxsize=1024)
def _out_strides(shape: tuple[int, ...], main_stride: tuple[int, ...], full_t: int) -> tuple[int, ...]:
    b, c, t, h, w = shape
    # the shortcut is a contiguous (b, c, full_t, h, w) tensor, sliced in time on the first chunk
    sc_stride = (c * full_t * h * w, full_t * h * w, h * w, w, 1)
    return rt.add_strides(shape, main_stride, sc_stride)


def _dupup_add_kernel(
    m_ptr, s_ptr, b_ptr, o_ptr,
    C, T, H, W, INNER, DIV, D1, D2,
    smb, smc, smt, smh, smw,
    ssb, ssc, sst, ssh, ssw,
    T_OFF,
    REPEATS: tl.constexpr, LAYOUT: tl.constexpr, FT: tl.constexpr, FS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < INNER
    q = (i // DIV).to(tl.int64)
    r = (i % DIV).to(tl.int64)
    # a row covers the three outer dims in memory order (sizes ?, D1, D2); inner the last two
    r2 = row % D2
    r1 = (row // D2) % D1
    b = row // (D2 * D1)
    if LAYOUT == 0:  # B C T H W
        c = r1
        t = r2
        h = q
        w = r
    elif LAYOUT == 1:  # B T H W C
        t = r1
        h = r2
        w = q
        c = r
    else:  # B T C H W
        t = r1
        c = r2
        h = q
        w = r
    a = tl.load(m_ptr + b * smb + c * smc + t * smt + h * smh + w * smw, mask=live, other=0.0)
    if HAS_BIAS:  # as in the tile kernel: added and rounded first, the conv's own pass
        bias = tl.load(b_ptr + c + 0 * i, mask=live, other=0.0)  # c is one row's or per element
        a = (a.to(tl.float32) + bias.to(tl.float32)).to(a.dtype)
    tf = t + T_OFF
    k = ((c * FT + tf % FT) * FS + h % FS) * FS + w % FS  # channel in the repeat_interleave'd tensor
    src = b * ssb + (k // REPEATS) * ssc + (tf // FT) * sst + (h // FS) * ssh + (w // FS) * ssw
    s = tl.load(s_ptr + src, mask=live, other=0.0)
    o = (a.to(tl.float32) + s.to(tl.float32)).to(a.dtype)
    tl.store(o_ptr + row * INNER + i, o, mask=live)


_kernel = rt.jit_lazy(_dupup_add_kernel, globals())


def _dupup_add_cl_kernel(
    m_ptr, s_ptr, b_ptr, o_ptr,
    C, T, H, W,
    smb, smc, smt, smh, smw,
    ssb, ssc, sst, ssh, ssw,
    T_OFF,
    REPEATS: tl.constexpr, FT: tl.constexpr, FS: tl.constexpr, HAS_BIAS: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # channels_last_3d output: a program owns BLOCK_W pixels of one (b, t, h) row with all
    # their channels; every index below is per row or per tile column, never a per-element
    # division by a runtime value
    row = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c = tl.arange(0, BLOCK_C)
    if IDX64:
        row = row.to(tl.int64)
        w = w.to(tl.int64)
        c = c.to(tl.int64)
    w = w[:, None]
    c = c[None, :]
    h = row % H
    t = (row // H) % T
    b = row // (H * T)
    live = (w < W) & (c < C)
    a = tl.load(m_ptr + b * smb + c * smc + t * smt + h * smh + w * smw, mask=live, other=0.0)
    if HAS_BIAS:  # the conv's deferred bias, rounded as its own pass would have: exact
        bias = tl.load(tl.broadcast_to(b_ptr + c, (BLOCK_W, BLOCK_C)), mask=c < C, other=0.0)
        a = (a.to(tl.float32) + bias.to(tl.float32)).to(a.dtype)
    tf = t + T_OFF
    k = ((c * FT + tf % FT) * FS + h % FS) * FS + w % FS  # channel in the repeat_interleave'd tensor
    src = b * ssb + (k // REPEATS) * ssc + (tf // FT) * sst + (h // FS) * ssh + (w // FS) * ssw
    s = tl.load(s_ptr + src, mask=live, other=0.0)
    o = (a.to(tl.float32) + s.to(tl.float32)).to(a.dtype)
    tl.store(o_ptr + row * (W * C) + w * C + c, o, mask=live)


_cl_kernel = rt.jit_lazy(_dupup_add_cl_kernel, globals())
_CL_MAX_C = 4096


def dupup_add(
    main: torch.Tensor,
    source: torch.Tensor,
    factor_t: int,
    factor_s: int,
    first_chunk: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Fused ``dupup_add_reference``; None when not handled (caller falls back)."""
    if factor_t < 1 or factor_s < 1:
        raise ValueError(f"factors must be >= 1, got {factor_t}, {factor_s}")
    if not rt.shortcut_pair_ok(main, source):
        return None
    if bias is not None and (
        bias.shape != (main.shape[1],) or bias.dtype != main.dtype or bias.device != main.device
        or not bias.is_contiguous()
    ):
        return None
    b, c, t, h, w = main.shape
    sb, sc, st, sh, sw = source.shape
    full_t = st * factor_t
    if (c * factor_t * factor_s * factor_s) % sc != 0:
        return None
    t_off = factor_t - 1 if first_chunk else 0
    if (sb, full_t - t_off, sh * factor_s, sw * factor_s) != (b, t, h, w):
        return None
    shape = tuple(main.shape)
    o_stride = _out_strides(shape, tuple(main.stride()), full_t)
    layout = next((n for n, o in enumerate(_LAYOUTS) if rt.matches_order(shape, o_stride, o)), None)
    if layout is None:
        return None
    order = _LAYOUTS[layout]
    inner = shape[order[3]] * shape[order[4]]
    if inner + _BLOCK >= 2**31:
        return None
    out = rt.empty_with_strides(shape, o_stride, main)
    repeats = c * factor_t * factor_s * factor_s // sc
    if order == rt.ORDER_CL3D and c <= _CL_MAX_C:
        if not rt.matches_order(tuple(source.shape), source.stride(), rt.ORDER_CL3D):
            # the tile kernel reads each pixel's source channels as one run; from another
            # layout (Wan2.2's lossless activations after an upsampler are NTCHW) those loads
            # are strided, so the smaller source is copied channels-last first
            source = source.contiguous(memory_format=torch.channels_last_3d)
        block_w, block_c, num_warps = rt.channel_tile(c, w)
        _cl_kernel()[(b * t * h, -(-w // block_w))](
            main, source, main if bias is None else bias, out,
            c, t, h, w, *main.stride(), *source.stride(), t_off,
            REPEATS=repeats, FT=factor_t, FS=factor_s, HAS_BIAS=bias is not None,
            IDX64=not rt.offsets_fit_int32((main, source, out), slack=block_w * c),
            BLOCK_W=block_w, BLOCK_C=block_c,
            num_warps=num_warps, **rt.launch_opts(main),
        )
        return out
    rows = out.numel() // inner
    grid = (rows, -(-inner // _BLOCK))
    _kernel()[grid](
        main, source, main if bias is None else bias, out,
        c, t, h, w, inner, shape[order[4]], shape[order[1]], shape[order[2]],
        *main.stride(), *source.stride(),
        t_off,
        REPEATS=repeats, LAYOUT=layout, FT=factor_t, FS=factor_s, HAS_BIAS=bias is not None, BLOCK=_BLOCK,
        num_warps=4, **rt.launch_opts(main),
    )
    return out
