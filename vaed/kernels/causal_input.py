"""Causal conv input in one pass: [zero frames | cached frames | new frames] + spatial zero pad.

Stock diffusers (per cached WanCausalConv3d, per chunk) does
``x[:, :, -2:].clone()`` (+ ``cat`` with the previous cache's last frame),
``torch.cat([cache, x], 2)`` and ``F.pad`` -- three to four passes over the
activation. This op reads the strided inputs once, writes the padded conv input
in the layout aten's ``pad(cat(...))`` would give (channels_last_3d or
contiguous) and, in the same pass, the next chunk's compact cache (the last
``CACHE_T`` unpadded frames). Optionally it applies WanRMS_norm + SiLU to the
new frames on the way (see :mod:`vaed.kernels.rms_silu`).

Speed (H200, Wan2.1 480x832 bf16, benchmarks/bench_causal_pad.py): int32
offsets, the channel count as a compile-time constant and per-row branches
(zero rows store, cached rows copy, only new rows run the norm) took a first
chunk's 30 calls from 9.5 to 5.0 ms and a steady chunk's 32 from 15.2 to
9.3 ms (~1.3 TB/s; a plain copy of the output runs at ~4 TB/s).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vaed.kernels import _runtime as rt
from vaed.kernels.rms_silu import NormSilu, low_precision, rms_silu_exact_tile, rms_silu_reference

CACHE_T = 2
_BLOCK = 1024
if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy before the kernel is decorated
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter


def causal_pad_reference(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: tuple[int, ...],  # F.pad's six entries
    *,
    zero_history: bool = False,
    cache_t: int = CACHE_T,
    norm: NormSilu | None = None,
    emit_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stock aten chain: returns (conv input, next cache).

    ``zero_history`` is WanResample's "Rep" case (first chunk of an upsample
    time_conv): no cache, and the next cache is front-filled with zeros.
    ``norm`` applies WanRMS_norm + SiLU to ``x`` first (to ``x + norm.x_bias``
    when a conv's bias is pending: the add the conv would have made).
    ``pad`` is F.pad's order (w_left, w_right, h_top, h_bottom, t_front,
    t_back); left != right is allowed (a spatial shard's interior edge).
    ``emit_cache=False`` skips the next-cache snapshot (returns None for it),
    as ``WanCausalConv3d.forward`` called on its own does.
    """
    if norm is not None:
        x_bias = getattr(norm, "x_bias", None)  # a WanRMS_norm module serves as its own NormSilu too
        if x_bias is not None:
            x = x + x_bias.view(1, -1, 1, 1, 1)
        x = rms_silu_reference(x, norm.gamma, norm.scale, norm.bias)
    nxt = None
    if emit_cache:
        nxt = x[:, :, -cache_t:, :, :].clone()
        if nxt.shape[2] < cache_t:
            if zero_history:
                nxt = torch.cat([torch.zeros_like(nxt), nxt], dim=2)
            elif cache is not None:
                nxt = torch.cat([cache[:, :, -1, :, :].unsqueeze(2), nxt], dim=2)
    padding = list(pad)
    if cache is not None and pad[4] > 0:
        x = torch.cat([cache, x], dim=2)
        padding[4] -= cache.shape[2]
    return F.pad(x, padding), nxt


@functools.lru_cache(maxsize=4096)
def _stock_layouts(
    x_shape: tuple[int, ...],
    x_stride: tuple[int, ...],
    c_shape: tuple[int, ...] | None,
    c_stride: tuple[int, ...] | None,
    pad: tuple[int, ...],
    zero_history: bool,
    cache_t: int,
    with_norm: bool,
    dtype: torch.dtype,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(padded shape, padded strides, next-cache shape, next-cache strides) of the aten chain.

    The norm chain is part of it: its TensorIterator ops can re-order the
    strides of size-1 dims (e.g. a one-frame permuted activation).
    """
    # dtype matters: the norm chain copies bf16/fp16 to fp32 first, fp32 runs in place
    x = torch.empty_strided(x_shape, x_stride, device="meta", dtype=dtype)
    c = None
    if c_shape is not None and c_stride is not None:
        c = torch.empty_strided(c_shape, c_stride, device="meta", dtype=dtype)
    norm = NormSilu(torch.empty(x_shape[1], 1, 1, 1, device="meta", dtype=dtype), 1.0, 0.0) if with_norm else None
    p, n = causal_pad_reference(x, c, pad, zero_history=zero_history, cache_t=cache_t, norm=norm)
    assert n is not None
    return tuple(p.shape), tuple(p.stride()), tuple(n.shape), tuple(n.stride())


def stock_layout_is_channels_last(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: tuple[int, ...],
    *,
    zero_history: bool = False,
    cache_t: int = CACHE_T,
    with_norm: bool = False,
) -> bool:
    """Whether the aten chain (``causal_pad_reference``) writes the conv input channels_last_3d."""
    p_shape, p_stride, _, _ = stock_layouts(x, cache, pad, zero_history, cache_t, with_norm)
    return rt.matches_order(p_shape, p_stride, rt.ORDER_CL3D)


def stock_layouts(
    x: torch.Tensor, cache: torch.Tensor | None, pad: tuple[int, ...], zero_history: bool, cache_t: int,
    with_norm: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``_stock_layouts`` of these tensors (the cache counts only where the conv input takes it)."""
    use_cache = cache is not None and pad[4] > 0
    c_meta = (tuple(cache.shape), tuple(cache.stride())) if cache is not None and use_cache else (None, None)
    return _stock_layouts(
        tuple(x.shape), tuple(x.stride()), *c_meta, tuple(pad), zero_history, cache_t, with_norm, x.dtype
    )


def _causal_pad_kernel(
    x_ptr, c_ptr, p_ptr, n_ptr, d_ptr, g_ptr,
    C, T, H, W, TP, HP, WP, INNER,
    Z, HIST, K, PH, PW,
    sxb, sxc, sxt, sxh, sxw,
    scb, scc, sct, sch, scw,
    snb, snc, snt, snh, snw,
    sdb, sdt, sdh, sdw,
    scale, bias,
    DIV: tl.constexpr, CL: tl.constexpr, NORM: tl.constexpr, LOWP: tl.constexpr, IDX64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # DIV (the channel count, or the padded width) is a compile-time constant: the per-element
    # div/mod become multiply-shifts and the compiler can prove runs of channels contiguous
    # (vector loads). Offsets stay int32 unless a tensor spans 2^31 elements (IDX64).
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < INNER
    q = i // DIV
    r = i % DIV
    if IDX64:
        row = row.to(tl.int64)
        q = q.to(tl.int64)
        r = r.to(tl.int64)
    if CL:
        # memory order B T H W C: a row is (b, tp, hp); inner is (wp, c)
        hp = row % HP
        tp = (row // HP) % TP
        b = row // (HP * TP)
        wp = q
        c = r
        has_data = (tp >= Z) & (hp >= PH) & (hp < PH + H)
    else:
        # memory order B C T H W: a row is (b, c, tp); inner is (hp, wp)
        tp = row % TP
        c = (row // TP) % C
        b = row // (TP * C)
        hp = q
        wp = r
        has_data = tp >= Z
    h = hp - PH
    w = wp - PW
    inside = live & (h >= 0) & (h < H) & (w >= 0) & (w < W)
    f = tp - Z  # frame index in [cache..., x...]
    val = tl.zeros([BLOCK], dtype=p_ptr.dtype.element_ty)
    # Every row is one padded frame: zero history or h padding (stores of zeros only), a
    # cached frame (a copy), or a new frame (the norm's arithmetic runs on these rows alone).
    if has_data:
        if f >= HIST:
            xt = f - HIST
            xv = tl.load(x_ptr + b * sxb + c * sxc + xt * sxt + h * sxh + w * sxw, mask=inside, other=0.0)
            if NORM:
                d = tl.load(d_ptr + b * sdb + xt * sdt + h * sdh + w * sdw, mask=inside, other=1.0)
                # c may be a row scalar: gamma's pointers at the tile's shape
                xv = rms_silu_exact_tile(xv, d, g_ptr + (c + q * 0), inside, scale, bias, LOWP)
            val = tl.where(inside, xv, val)
        else:
            cv = tl.load(c_ptr + b * scb + c * scc + f * sct + h * sch + w * scw, mask=inside, other=0.0)
            val = tl.where(inside, cv, val)
    tl.store(p_ptr + row * INNER + i, val, mask=live)
    kk = tp - (TP - K)  # next-cache frame this row feeds, if >= 0
    if kk >= 0:
        tl.store(n_ptr + b * snb + c * snc + kk * snt + h * snh + w * snw, val, mask=inside)


_kernel = rt.jit_lazy(_causal_pad_kernel, globals(), helpers=(rms_silu_exact_tile,))


def causal_pad(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: tuple[int, ...],  # F.pad's six entries
    *,
    zero_history: bool = False,
    cache_t: int = CACHE_T,
    norm: NormSilu | None = None,
    emit_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Fused ``causal_pad_reference``; None when the input is not handled (caller falls back).

    ``pad`` is WanCausalConv3d's ``_padding``, (w, w, h, h, 2*pt, 0), or an
    asymmetric variant of it (w_left != w_right, h_top != h_bottom: the
    kernel writes the zero border at offsets, so one-sided padding costs
    nothing extra).
    With ``norm``, ``x`` is the raw activation and ``norm.denom`` its channel
    L2 norm (see ``rms_silu.norm_denominator``). ``emit_cache=False`` skips
    the next-cache write and returns (conv input, None).
    """
    if zero_history and cache is not None:
        raise ValueError("zero_history (the 'Rep' marker) and a cache tensor are exclusive")
    if len(pad) != 6:
        raise ValueError(f"pad must have 6 entries, got {pad!r}")
    if not _eligible(x, cache, pad, zero_history, cache_t, norm):
        return None
    use_cache = cache is not None and pad[4] > 0
    src_c = cache if cache is not None and use_cache else x  # the kernel's cache operand (x: unused)
    p_shape, p_stride, n_shape, n_stride = stock_layouts(x, cache, pad, zero_history, cache_t, norm is not None)
    if rt.matches_order(p_shape, p_stride, rt.ORDER_CL3D) and not rt.matches_order(
        p_shape, p_stride, rt.ORDER_CONTIGUOUS
    ):
        cl = True
    elif rt.matches_order(p_shape, p_stride, rt.ORDER_CONTIGUOUS):
        cl = False
    else:
        return None
    B, C, T, H, W = x.shape
    hist = src_c.shape[2] if use_cache else 0
    _, _, TP, HP, WP = p_shape
    K = n_shape[2] if emit_cache else 0
    inner = WP * C if cl else HP * WP
    if inner + _BLOCK >= 2**31:
        return None
    padded = rt.empty_with_strides(p_shape, p_stride, x)
    nxt = rt.empty_with_strides(n_shape, n_stride, x) if emit_cache else None
    if padded.numel() == 0:
        return None
    if norm is not None:
        assert norm.denom is not None  # _eligible refused a norm without aten's denominator
        d, g, scale, bias = norm.denom, norm.gamma, float(norm.scale), float(norm.bias)
        sd = (d.stride(0), d.stride(2), d.stride(3), d.stride(4))
    else:
        d, g, scale, bias, sd = x, x, 1.0, 0.0, (0, 0, 0, 0)
    rows = padded.numel() // inner
    grid = (rows, -(-inner // _BLOCK))
    idx64 = not rt.offsets_fit_int32((x, src_c, padded, nxt, d), slack=_BLOCK)
    _kernel()[grid](
        x, src_c, padded, padded if nxt is None else nxt, d, g,
        C, T, H, W, TP, HP, WP, inner,
        pad[4] - hist, hist, K, pad[2], pad[0],
        *x.stride(), *src_c.stride(), *(nxt.stride() if nxt is not None else (0,) * 5), *sd,
        scale, bias,
        DIV=C if cl else WP, CL=cl, NORM=norm is not None, LOWP=low_precision(x.dtype), IDX64=idx64,
        BLOCK=_BLOCK, num_warps=4, **rt.launch_opts(x),
    )
    return padded, nxt


def _eligible(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: tuple[int, ...],
    zero_history: bool,
    cache_t: int,
    norm: NormSilu | None,
) -> bool:
    if not rt.triton_available() or x.dim() != 5 or x.dtype not in rt.SUPPORTED_DTYPES:
        return False
    if not rt.device_ok(x) or x.numel() == 0 or cache_t < 1:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if torch.compiler.is_compiling():
        return False
    # any non-negative spatial padding (left/right may differ), causal (front-only) temporal padding
    if pad[5] != 0 or min(pad) < 0:
        return False
    B, C, T, H, W = x.shape
    if cache is not None:
        if pad[4] == 0:
            return False  # stock ignores the cache for the input but still reads it for the next cache
        if cache.dim() != 5 or cache.device != x.device or cache.dtype != x.dtype:
            return False
        cb, cc, ct, ch, cw = cache.shape
        if (cb, cc, ch, cw) != (B, C, H, W) or ct < 1 or ct > pad[4]:
            return False
        if torch.is_grad_enabled() and cache.requires_grad:
            return False
    if zero_history and pad[4] + T < cache_t:
        return False
    if norm is not None:
        d, g = norm.denom, norm.gamma
        if d is None or norm.x_bias is not None:  # the exact prologue: aten's denominator, no pending bias
            return False
        if d.dtype != torch.float32 or d.device != x.device or tuple(d.shape) != (B, 1, T, H, W):
            return False
        if g.device != x.device or g.numel() != C or g.dtype != x.dtype or not g.is_contiguous():
            return False
        if not isinstance(norm.bias, float) or (torch.is_grad_enabled() and g.requires_grad):
            return False
    return True
