"""``main + AvgDown3D(source)`` in one gather-reduce-add (Wan2.2 residual down-block shortcut).

Stock diffusers front-pads ``source`` in time, folds each factor_t x factor_s x
factor_s patch into channels with an 8-D permute and ``.contiguous()`` (a copy
the size of the source), averages groups of G channels down to
``out_channels`` with ``mean(dim=2)`` (another tensor) and adds it to the block
output. This op reads ``source`` once through the same index map (the padded
frames read as +0.0, as F.pad writes them) and adds the mean to ``main``,
writing the strides aten's ``main + mean`` would give (the mean is a
contiguous (B, out, T', H', W') tensor).

Why this order is exact: aten's CUDA ``mean(dim=2)`` of the contiguous
(B, out, G, T', H', W') view reduces in fp32 (also for bf16/fp16) into four
accumulators starting at 0, ``acc[g % 4] += x_g``, combines them in sequence,
``((acc0 + acc1) + acc2) + acc3``, multiplies by the fp32 factor 1/G and rounds
to the input dtype; the add then runs in fp32 and rounds once. Measured on an
H200 (torch 2.11) for G = 1, 2, 4, 8 at 8 to 640 channels (Wan2.2's shortcuts
have G = 4 and 1; ``avgdown_add_ordered_reference`` is that order in plain
torch); other orders (sequential for G = 8, pairwise trees) differ. Other G
are declined: their reduction order was not measured.

One kernel for every output layout: a program owns a tile of pixels of one
(b, t', h') row by channels, so every index is per row or per tile column
with G and the factors compile-time constants (no per-element division by a
runtime value, which made the flat DupUp3D kernel 10x slower than its tile
kernel). A channels_last_3d output (the GPU encoder's layout) takes all its
channels in a tile; other layouts a run of pixels by a few channels.
Speed on an H200 (``benchmarks/bench_avgdown.py``, Wan2.2 704x1280 bf16): a steady chunk's four
calls 0.47 ms against stock's chain's 4.96 ms (its pad, permute and copy of the block input are
most of that); the whole Wan2.2 encode 1.195 -> 1.078 s.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vaed.kernels import _runtime as rt

if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter

# output memory orders the kernel is launched for (any strides would do; these are aten's)
_LAYOUTS = (rt.ORDER_CONTIGUOUS, rt.ORDER_CL3D, rt.ORDER_NTCHW)
# group sizes whose aten reduction order was measured (module docstring)
_GROUPS = (1, 2, 4, 8)
_CL_MAX_C = 4096  # widest channels_last_3d output whose channels fit one tile
_W_TILE = 128  # pixels a program takes along W in the other layouts


def avgdown_reference(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """diffusers' AvgDown3D.forward, op for op."""
    pad_t = (factor_t - x.shape[2] % factor_t) % factor_t
    x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    factor = factor_t * factor_s * factor_s
    x = x.view(b, c * factor, t // factor_t, h // factor_s, w // factor_s)
    x = x.view(b, out_channels, c * factor // out_channels, t // factor_t, h // factor_s, w // factor_s)
    return x.mean(dim=2)


def avgdown_add_reference(
    main: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, out_channels: int
) -> torch.Tensor:
    """``main + AvgDown3D(source)``: stock's chain, line for line."""
    return main + avgdown_reference(source, out_channels, factor_t, factor_s)


def avgdown_add_ordered_reference(
    main: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, out_channels: int
) -> torch.Tensor:
    """The kernel's arithmetic in plain torch: each group's fp32 slices summed into four
    accumulators from 0 (``acc[g % 4]``), combined in sequence, times 1/G, rounded to the
    dtype, added to ``main`` in fp32 and rounded. Equals the stock chain on CUDA (module
    docstring); on a CPU, whose aten may reduce in another order, the kernel's own reference."""
    pad_t = (factor_t - source.shape[2] % factor_t) % factor_t
    x = F.pad(source, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    groups = c * factor_t * factor_s * factor_s // out_channels
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, out_channels, groups, t // factor_t, h // factor_s, w // factor_s)
    acc = [torch.zeros(x[:, :, 0].shape, dtype=torch.float32, device=x.device) for _ in range(4)]
    for g in range(groups):
        acc[g % 4] = acc[g % 4] + x[:, :, g].float()
    mean = ((((acc[0] + acc[1]) + acc[2]) + acc[3]) * (1.0 / groups)).to(source.dtype)
    return (main.float() + mean.float()).to(main.dtype)


@functools.lru_cache(maxsize=1024)
def _out_strides(shape: tuple[int, ...], main_stride: tuple[int, ...]) -> tuple[int, ...]:
    b, c, t, h, w = shape
    return rt.add_strides(shape, main_stride, (c * t * h * w, t * h * w, h * w, w, 1))


def _avgdown_add_kernel(
    m_ptr, s_ptr, o_ptr,
    C, T, H, W,
    smb, smc, smt, smh, smw,
    ssb, ssc, sst, ssh, ssw,
    sob, soc, sot, soh, sow,
    PAD_T,
    G: tl.constexpr, FT: tl.constexpr, FS: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # a program owns BLOCK_W pixels x BLOCK_C channels of one (b, t', h') output row; the
    # patch offsets of a channel's G source elements are compile-time functions of it
    row = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
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
    # aten's reduction (module docstring): four fp32 accumulators from 0, acc[g % 4] += x_g
    acc0 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    for g in tl.static_range(G):
        k = c * G + g  # channel of the permuted (B, C_src * FT * FS * FS, T', H', W') tensor
        rem = k % (FT * FS * FS)
        ts = t * FT + rem // (FS * FS) - PAD_T  # < 0: a padded frame, +0.0 as F.pad writes
        src = (b * ssb + (k // (FT * FS * FS)) * ssc + ts * sst
               + (h * FS + (rem // FS) % FS) * ssh + (w * FS + rem % FS) * ssw)
        x = tl.load(s_ptr + src, mask=live & (ts >= 0), other=0.0).to(tl.float32)
        if g % 4 == 0:
            acc0 = acc0 + x
        elif g % 4 == 1:
            acc1 = acc1 + x
        elif g % 4 == 2:
            acc2 = acc2 + x
        else:
            acc3 = acc3 + x
    mean = ((((acc0 + acc1) + acc2) + acc3) * (1.0 / G)).to(a.dtype)  # 1/G: exact for G = 2^k
    o = (a.to(tl.float32) + mean.to(tl.float32)).to(a.dtype)
    tl.store(o_ptr + b * sob + c * soc + t * sot + h * soh + w * sow, o, mask=live)


_kernel = rt.jit_lazy(_avgdown_add_kernel, globals())


def avgdown_add(
    main: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, out_channels: int
) -> torch.Tensor | None:
    """Fused ``avgdown_add_reference``; None when not handled (caller falls back)."""
    if factor_t < 1 or factor_s < 1:
        raise ValueError(f"factors must be >= 1, got {factor_t}, {factor_s}")
    if not rt.shortcut_pair_ok(main, source):
        return None
    b, c, t, h, w = main.shape
    sb, sc, st, sh, sw = source.shape
    folded = sc * factor_t * factor_s * factor_s
    if out_channels != c or folded % c != 0 or folded // c not in _GROUPS:
        return None
    pad_t = (factor_t - st % factor_t) % factor_t
    if sh % factor_s or sw % factor_s or ((st + pad_t) // factor_t, sh // factor_s, sw // factor_s, sb) != (t, h, w, b):
        return None
    shape = tuple(main.shape)
    o_stride = _out_strides(shape, tuple(main.stride()))
    layout = next((n for n, o in enumerate(_LAYOUTS) if rt.matches_order(shape, o_stride, o)), None)
    if layout is None:
        return None
    out = rt.empty_with_strides(shape, o_stride, main)
    if _LAYOUTS[layout] == rt.ORDER_CL3D and c <= _CL_MAX_C:
        block_w, block_c, num_warps = rt.channel_tile(c, w)
    else:  # W innermost: a run of pixels by as many channels as fill the tile
        block_w = min(rt.pow2(w), _W_TILE)
        block_c = min(rt.pow2(c), max(1, rt.CHANNEL_TILE // block_w))
        num_warps = rt.CHANNEL_TILE_WARPS
    grid = (b * t * h, -(-w // block_w), -(-c // block_c))
    if max(grid[1], grid[2]) > 65535 or grid[0] >= 2**31:
        return None
    _kernel()[grid](
        main, source, out,
        c, t, h, w,
        *main.stride(), *source.stride(), *out.stride(),
        pad_t,
        G=folded // c, FT=factor_t, FS=factor_s,
        IDX64=not rt.offsets_fit_int32((main, source, out), slack=block_w * block_c),
        BLOCK_W=block_w, BLOCK_C=block_c,
        num_warps=num_warps, **rt.launch_opts(main),
    )
    return out
