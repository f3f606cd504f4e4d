"""Causal conv input for channels_last_3d as 2-D (pixels x channels) tiles; optional one-pass RMS-norm+SiLU.

Same job as :mod:`vaed.kernels.causal_input` ([zero frames | cache | new
frames] + spatial zero pad, and the next chunk's cache in the same pass), for
the layout the GPU decoder runs in (channels innermost). Each program owns
``BLOCK_W`` padded pixels of one (b, t, h) row with all their channels, so
there is no per-element div/mod and every load/store of a pixel's channels
is one contiguous run.

Without a norm: pure data movement, bit-exact against
``causal_pad_reference`` (checked like the other kernels). ``norm`` (an
``NormSilu`` with aten's fp32 denominator): the exact WanRMS_norm + SiLU
prologue, the same arithmetic as ``causal_input``'s, bit-exact too.

``norm_cl`` (a ``NormSilu``, its ``x_bias`` optional) is the *lossy* fast-tier prologue (the
SGLang channels-last RMSNorm+SiLU way): the per-pixel L2 norm over channels
is reduced in fp32 inside the tile, and normalize * scale * gamma + bias and
SiLU run in fp32 with one rounding at the end. Stock rounds to the activation
dtype after every op and reduces the norm in a separate fp32 pass over a
float copy; this drops those two passes and the intermediate roundings
(values differ from stock by about one bf16 ulp; accuracy against an fp32
decode is no worse). The exact lossless norm stays in ``causal_input``.
``x_bias`` (a [C] tensor) is the producing conv's bias, left out of that
conv and added here in fp32 before the norm: the conv's separate bias pass
over its output (torch adds a cuDNN conv's bias in its own kernel) is gone,
and with it one more rounding.

``unfold=KT`` writes the conv input with its KT time taps unfolded into
channels instead: an NHWC image batch ``[B*TO, KT*C, HP, WP]`` (TO = TP -
KT + 1 output frames) whose channel block k of image t is padded frame t + k,
so a KT x kh x kw conv3d runs as one conv2d over KT*C channels (see
``vaed.patches.fast``). Each padded frame is computed once and stored to
each slot it feeds; the next cache is the same as without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vaed.kernels import _runtime as rt
from vaed.kernels.causal_input import CACHE_T, stock_layouts
from vaed.kernels.causal_input import _eligible as _eligible_1d
from vaed.kernels.rms_silu import NormSilu, low_precision, rms_silu_exact_tile

if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter

_MAX_C = 4096
_TRANSPOSE_TILE = (64, 32, 4)  # (pixels, channels, warps) of a program reading x with channels not innermost
NORM_EPS = 1e-12  # F.normalize's eps


def _causal_pad_cl_kernel(
    x_ptr, c_ptr, p_ptr, n_ptr, g_ptr, d_ptr, xb_ptr,
    C, H, W, TP, HP, WP,
    Z, HIST, K, PH, PW,
    sxb, sxc, sxt, sxh, sxw,
    scb, scc, sct, sch, scw,
    snb, snc, snt, snh, snw,
    sdb, sdt, sdh, sdw,
    scale, bias, eps,
    NORM: tl.constexpr, XBIAS: tl.constexpr, LOWP: tl.constexpr, EMIT: tl.constexpr, IDX64: tl.constexpr,
    KT: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)  # (b, tp, hp) of the padded output
    wp = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # one block of all channels but for a transpose
    if IDX64:  # int32 offsets unless a tensor spans 2^31 elements
        row = row.to(tl.int64)
        wp = wp.to(tl.int64)
        c = c.to(tl.int64)
    wp = wp[:, None]
    c = c[None, :]
    hp = row % HP
    tp = (row // HP) % TP
    b = row // (HP * TP)
    cm = c < C
    live = (wp < WP) & cm
    h = hp - PH
    w = wp - PW
    inside = live & (h >= 0) & (h < H) & (w >= 0) & (w < W)
    f = tp - Z  # frame index in [cache..., x...]
    val = tl.zeros([BLOCK_W, BLOCK_C], dtype=p_ptr.dtype.element_ty)
    # a row of zero history or of h padding stores zeros only; a cached frame is a copy;
    # the norm's arithmetic runs on rows of new frames alone
    if (f >= 0) & (h >= 0) & (h < H):
        if f >= HIST:
            xt = f - HIST
            xv = tl.load(x_ptr + b * sxb + c * sxc + xt * sxt + h * sxh + w * sxw, mask=inside, other=0.0)
            if NORM == 1:
                # exact: the aten chain op for op, as in causal_input's prologue (denominator from aten)
                px = (wp < WP) & (w >= 0) & (w < W)  # [BLOCK_W, 1]
                d = tl.load(d_ptr + b * sdb + xt * sdt + h * sdh + w * sdw, mask=px, other=1.0)
                xv = rms_silu_exact_tile(xv, d, tl.broadcast_to(g_ptr + c, (BLOCK_W, BLOCK_C)), cm, scale, bias, LOWP)
            if NORM == 2:
                # lossy fast tier: channel norm reduced in the tile, fp32 throughout, one rounding
                v = xv.to(tl.float32)
                if XBIAS:  # the producing conv's bias (masked channels stay 0)
                    v = v + tl.load(tl.broadcast_to(xb_ptr + c, (BLOCK_W, BLOCK_C)), mask=cm, other=0.0).to(tl.float32)
                ss = tl.sum(v * v, axis=1)  # per pixel, over channels
                inv = 1.0 / tl.maximum(tl.sqrt(ss), eps)
                g = tl.load(tl.broadcast_to(g_ptr + c, (BLOCK_W, BLOCK_C)), mask=cm, other=0.0).to(tl.float32)
                v = v * (inv[:, None] * scale) * g + bias
                v = v / (1.0 + tl.exp(-v))
                xv = v.to(xv.dtype)
            val = tl.where(inside, xv, val)
        else:
            cv = tl.load(c_ptr + b * scb + c * scc + f * sct + h * sch + w * scw, mask=inside, other=0.0)
            val = tl.where(inside, cv, val)
    if KT == 0:
        tl.store(p_ptr + row * (WP * C) + wp * C + c, val, mask=live)
    else:
        # unfolded: padded frame tp is time tap k of output frame tp - k, channels k*C..k*C+C-1
        to = TP - KT + 1
        for k in tl.static_range(KT):
            t = tp - k
            if (t >= 0) & (t < to):
                img = (b * to + t) * HP + hp
                tl.store(p_ptr + img * (WP * KT * C) + wp * (KT * C) + k * C + c, val, mask=live)
    if EMIT:
        kk = tp - (TP - K)  # next-cache frame this row feeds, if >= 0
        if kk >= 0:
            tl.store(n_ptr + b * snb + c * snc + kk * snt + h * snh + w * snw, val, mask=inside)


_kernel = rt.jit_lazy(_causal_pad_cl_kernel, globals(), helpers=(rms_silu_exact_tile,))


def causal_pad_cl(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: tuple[int, int, int, int, int, int],
    *,
    zero_history: bool = False,
    cache_t: int = CACHE_T,
    norm: NormSilu | None = None,
    norm_cl: NormSilu | None = None,
    emit_cache: bool = True,
    unfold: int = 0,
    channels_last_out: bool = False,
    stock_cache: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Channels-last causal conv input; None when not handled (caller falls back).

    Handles what ``causal_input.causal_pad`` handles whose padded output is
    channels_last_3d in the aten chain, with ``C <= 4096``. Output layouts
    are aten's (the same oracle), so the conv sees what it would see on the
    lossless path. ``norm`` is the exact prologue (as in ``causal_pad``,
    aten's denominator passed in); ``norm_cl`` the lossy one-pass prologue
    (its ``x_bias`` added in fp32 first; ``denom`` unused). At most one of them. ``unfold=KT > 0`` returns the
    input with KT time taps unfolded into channels (module docstring) in place
    of the padded tensor. ``channels_last_out`` writes the padded input and the next cache
    channels_last_3d whatever aten's chain would give: other strides, so only where the conv
    reading them runs channels-last either way (a lossy set's, or torch's cuDNN conv with a
    channels_last_3d weight, which copies any other input to that layout first). That chain
    writes NCDHW for an NCDHW input (the mid block's attention output, Wan2.2's activations
    after an upsampler) and for one whose size-1 dims' strides it reads as ambiguous (an up
    block's one-frame first input); the cache it leaves carries that into the next chunk, and
    a cuDNN plan built for those strides runs NCDHW kernels. ``stock_cache`` keeps the next
    cache in the strides aten's chain gives even so (an exact set's session cache is stock's,
    strides too).
    """
    if zero_history and cache is not None:
        raise ValueError("zero_history (the 'Rep' marker) and a cache tensor are exclusive")
    if norm is not None and norm_cl is not None:
        raise ValueError("norm (exact) and norm_cl (fast) are exclusive")
    if len(pad) != 6:
        raise ValueError(f"pad must have 6 entries, got {pad!r}")
    if not _eligible(x, cache, pad, zero_history, cache_t, norm, norm_cl):
        return None
    use_cache = cache is not None and pad[4] > 0
    src_c = cache if cache is not None and use_cache else x  # the kernel's cache operand (x: unused)
    p_shape, p_stride, n_shape, n_stride = stock_layouts(
        x, cache, pad, zero_history, cache_t, norm is not None or norm_cl is not None
    )
    if channels_last_out:
        p_stride = rt.dense_strides(p_shape, rt.ORDER_CL3D)
        if not stock_cache:
            n_stride = rt.dense_strides(n_shape, rt.ORDER_CL3D)
    elif not rt.matches_order(p_shape, p_stride, rt.ORDER_CL3D):
        return None
    B, C, T, H, W = x.shape
    _, _, TP, HP, WP = p_shape
    if C > _MAX_C or B * TP * HP >= 2**31 or unfold < 0 or TP < unfold:
        return None
    if unfold:
        images = (B * (TP - unfold + 1), unfold * C, HP, WP)
        padded = torch.empty(images, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    else:
        padded = rt.empty_with_strides(p_shape, p_stride, x)
    nxt = rt.empty_with_strides(n_shape, n_stride, x) if emit_cache else None
    hist = src_c.shape[2] if use_cache else 0
    d, sd = x, (0, 0, 0, 0)
    x_bias = None
    if norm is not None:
        mode, g, scale, bias = 1, norm.gamma, float(norm.scale), float(norm.bias)
        assert norm.denom is not None  # _eligible refused a norm without aten's denominator
        d = norm.denom
        sd = (d.stride(0), d.stride(2), d.stride(3), d.stride(4))
    elif norm_cl is not None:
        mode, g, scale, bias = 2, norm_cl.gamma, float(norm_cl.scale), float(norm_cl.bias)
        x_bias = norm_cl.x_bias
    else:
        mode, g, scale, bias = 0, x, 1.0, 0.0
    if mode != 2 and x.stride(1) != 1 and C > 1:
        # x's channels are not innermost (NCDHW, NTCHW): the tile transposes, and a program
        # holding every channel of a few pixels (2 at 1024 channels) read 4-byte runs of each
        # channel row (3.2 ms a call for Wan2.2's 1024-channel conv input at 176x320, H200);
        # the exact prologue is per element, so the channels split into blocks
        block_w, block_c, num_warps = _TRANSPOSE_TILE
    else:
        block_w, block_c, num_warps = rt.channel_tile(C, WP)
    grid = (B * TP * HP, -(-WP // block_w), -(-C // block_c))
    _kernel()[grid](
        x, src_c, padded, padded if nxt is None else nxt, g, d, g if x_bias is None else x_bias,
        C, H, W, TP, HP, WP,
        pad[4] - hist, hist, n_shape[2] if emit_cache else 0, pad[2], pad[0],
        *x.stride(), *src_c.stride(), *(nxt.stride() if nxt is not None else (0,) * 5), *sd,
        scale, bias, NORM_EPS,
        NORM=mode, XBIAS=x_bias is not None, LOWP=low_precision(x.dtype), EMIT=nxt is not None,
        IDX64=not rt.offsets_fit_int32((x, src_c, padded, nxt, d), slack=block_w * C * max(unfold, 1)),
        KT=unfold, BLOCK_W=block_w, BLOCK_C=block_c,
        num_warps=num_warps, **rt.launch_opts(x),
    )
    return padded, nxt


def _eligible(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: tuple[int, ...],
    zero_history: bool,
    cache_t: int,
    norm: NormSilu | None,
    norm_cl: NormSilu | None,
) -> bool:
    """The 1-D kernel's input checks (same inputs, same contract), plus the lossy norm's."""
    if not _eligible_1d(x, cache, pad, zero_history, cache_t, norm):
        return False
    if norm_cl is not None:
        g = norm_cl.gamma
        if g.device != x.device or g.numel() != x.shape[1] or not g.is_contiguous():
            return False
        if not isinstance(norm_cl.bias, float):
            return False
        xb = norm_cl.x_bias
        if xb is not None and (xb.device != x.device or xb.numel() != x.shape[1] or not xb.is_contiguous()):
            return False
    return True
