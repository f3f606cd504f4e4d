"""A candidate conv for the fast tier: Triton implicit-GEMM convolution on channels-last activations.

Why: Wan2.1's 96- and 192-channel 3x3(x3) convs are most of a steady fast chunk's GPU time,
and cuDNN runs them at 540-650 TFLOP/s of the H200's ~990 bf16 peak. This kernel is a
benchmark candidate only: it would move into ``vaed/`` if it beat cuDNN on the recorded
shapes. On an H200 (triton 3.6, cuDNN 9.19, a steady 480x832 chunk) it did not: the unfolded
288->96 conv took 1.692 ms (470 TFLOP/s) against torch's 1.461 ms and the best cuDNN plan's
1.367 ms, the 192->192 3x3x3 1.431 against 1.218 ms, the 384->384 0.615 against 0.601 / 0.492
ms; it won only on three latent-resolution convs of ~0.03 ms, 0.08 ms a chunk in all.
Compare it with torch and every cuDNN-frontend plan on the decoder's own conv signatures
(each config below timed and checked; needs a GPU)::

    python benchmarks/bench_convs.py --model wan2.1 --tier fast --triton

The conv as a GEMM: M = N*To*Ho*Wo output pixels, N_gemm = K output channels, K_gemm = taps*C.
A program computes a BLOCK_M x BLOCK_N output tile; its K loop runs over (tap, channel block)
pairs, flattened into one loop so Triton's software pipeliner overlaps loads across taps. The
A tile is loaded from the activation by pointer arithmetic (a pixel's base offset, computed
once per program, + the tap's offset + the channel), the B tile from the weight repacked once
to a [taps*C, K] matrix; ``tl.dot`` accumulates in fp32, the bias (optional) is added in fp32
and the tile rounded once to bf16 into a channels-last output. Lossy like the rest of the fast
tier: fp32 summation order differs from cuDNN's (and ``enable_fp_fusion`` stays on).

Supported: conv2d on channels_last / conv3d on channels_last_3d bf16 input, any weight layout,
stride 1, dilation 1, groups 1, zero or symmetric zero padding (masked loads; the decoder's
causal convs arrive pre-padded, so 0 is the main case).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vaed.kernels import _runtime as rt
from vaed.patches.conv_plans import per_dim

if TYPE_CHECKING:  # what the kernel's `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy (unused here)

DTYPE = torch.bfloat16
SMEM_BYTES = 227 * 1024  # an H100/H200 SM's shared memory a block may use


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One launch shape: the output tile (BLOCK_M pixels x BLOCK_N channels), the K step
    (BLOCK_K input channels of one tap), warps, pipeline stages and the program-id swizzle."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"

    def smem_bytes(self) -> int:
        """Shared memory of the pipelined A and B tiles (bf16), what bounds num_stages."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * 2


def _block_k(c: int) -> int:
    """The widest K step that divides C (no masked, wasted MMA work: 96 and 288 take 32,
    192 and 384 take 64), else one masked step over a small C."""
    for b in (64, 32, 16):
        if c % b == 0:
            return b
    return max(16, min(64, rt.pow2(c)))


def configs_for(c: int, k: int) -> list[Config]:
    """The configs the benchmark times for C input and K output channels, most likely first.

    K >= 32: the Hopper GEMM shapes (128x128 on 4 or 8 warps, 256x128 on 8, 128x64), tiles no
    wider than K rounded up to a power of two; K = 96 runs masked in a 128-wide tile (25 % of
    the MMA wasted) or in two 64-wide ones. Where C's K step is 32 (C = 96, 288) a masked
    64-wide step is tried too: fewer, fuller loop iterations against a third of a step wasted
    at C = 96. K < 32 (conv_out, 96 -> 3): memory-bound, narrow tiles over many pixels."""
    bk = _block_k(c)
    bn_cap = max(16, rt.pow2(k))
    if k < 32:
        cands = [Config(128, 16, bk, 4, 4), Config(256, 16, bk, 4, 3), Config(64, 16, bk, 2, 4)]
    else:
        cands = [
            Config(128, 128, bk, 8, 3),
            Config(128, 128, bk, 4, 4),
            Config(256, 128, bk, 8, 3),
            Config(128, 64, bk, 4, 4),
            Config(64, 128, bk, 4, 4),
            Config(128, 256, bk, 8, 3),
        ]
        if bk == 32 and c > 64:
            cands.append(Config(128, 128, 64, 8, 3))
    out: list[Config] = []
    for cfg in cands:
        cfg = Config(cfg.block_m, min(cfg.block_n, bn_cap), cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.group_m)
        if cfg not in out and cfg.smem_bytes() <= SMEM_BYTES:
            out.append(cfg)
    return out


# ---------------------------------------------------------------------------------------------
# What it runs
# ---------------------------------------------------------------------------------------------


def _pads(padding: Any, n: int) -> tuple[int, ...]:
    """Per-dim symmetric zero padding from F.conv's int / tuple / 'valid'."""
    return (0,) * n if padding == "valid" else per_dim(padding, n)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _channels_last(shape: Sequence[int], stride: Sequence[int]) -> bool:
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    probe = torch.empty_strided(tuple(shape), tuple(stride), device="meta")
    return probe.is_contiguous(memory_format=fmt)


def why_unsupported(
    x_shape: Sequence[int], x_stride: Sequence[int], w_shape: Sequence[int], stride: Any, padding: Any,
    dilation: Any, groups: int, dtype: torch.dtype | str,
) -> str | None:
    """Why the Triton conv does not take this call (None: it does); arguments as F.conv2d/3d's."""
    dims = len(x_shape)
    if dims not in (4, 5) or len(w_shape) != dims:
        return f"{dims}-D input (conv2d / conv3d only)"
    if str(dtype) != str(DTYPE):
        return f"dtype {dtype} (bf16 only)"
    if groups != 1:
        return f"groups={groups}"
    n = dims - 2
    if isinstance(padding, str) and padding != "valid":
        return f"padding={padding!r}"
    if any(s != 1 for s in per_dim(stride, n)):
        return f"stride={stride}"
    if any(d != 1 for d in per_dim(dilation, n)):
        return f"dilation={dilation}"
    pad = _pads(padding, n)
    if len(pad) != n or any(p < 0 for p in pad):
        return f"padding={padding}"
    if w_shape[1] != x_shape[1]:
        return f"weight takes {w_shape[1]} channels, input has {x_shape[1]}"
    if not _channels_last(x_shape, x_stride):
        return "input not channels-last"
    out = [x_shape[2 + i] + 2 * pad[i] - w_shape[2 + i] + 1 for i in range(n)]
    if min(out) <= 0 or math.prod(x_shape) == 0 or w_shape[0] == 0:
        return "empty output"
    return None


def supports(
    x_shape: Sequence[int], x_stride: Sequence[int], w_shape: Sequence[int], stride: Any, padding: Any,
    dilation: Any, groups: int, dtype: torch.dtype | str,
) -> bool:
    """Whether ``conv_igemm`` runs this F.conv2d/3d call (see ``why_unsupported``)."""
    return why_unsupported(x_shape, x_stride, w_shape, stride, padding, dilation, groups, dtype) is None


def available() -> bool:
    """Triton imports (the kernels then run on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    return rt.triton_available()


def prepare_weight(w: torch.Tensor) -> torch.Tensor:
    """[K, C, kt, kh, kw] (or [K, C, kh, kw]), any layout -> the GEMM's B: [taps*C, K] contiguous
    bf16, row (tap*C + c) for tap = (dt*kh + dh)*kw + dw. Done once, outside the timed call."""
    k = w.shape[0]
    order = (*range(2, w.dim()), 1, 0)
    return w.detach().permute(order).reshape(-1, k).to(DTYPE).contiguous()


def out_shape(x_shape: Sequence[int], w_shape: Sequence[int], padding: Any) -> tuple[int, ...]:
    n = len(x_shape) - 2
    pad = _pads(padding, n)
    return (x_shape[0], w_shape[0], *(x_shape[2 + i] + 2 * pad[i] - w_shape[2 + i] + 1 for i in range(n)))


def empty_out(x: torch.Tensor, w_shape: Sequence[int], padding: Any) -> torch.Tensor:
    """The conv's output, uninitialised: torch's conv strides for a channels-last input."""
    fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    return torch.empty(out_shape(x.shape, w_shape, padding), dtype=x.dtype, device=x.device, memory_format=fmt)


def conv_reference(
    x: torch.Tensor, w: torch.Tensor, padding: Any, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The naive reference: F.conv2d / F.conv3d of the same values in fp32 (bias in fp32), rounded
    once to x's dtype, channels-last like ``conv_igemm``'s output."""
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    y = conv(x.float(), w.float(), None if bias is None else bias.float(), 1, padding)
    return y.to(x.dtype).contiguous(memory_format=fmt)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


def _conv_igemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, K,
    TO, HO, WO, T, H, W,
    sxn, sxt, sxh, sxw,
    C: tl.constexpr, CB: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    PT: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    PAD: tl.constexpr, EVEN_C: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, IDX64: tl.constexpr,
    F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # GROUP_M swizzle: consecutive programs take GROUP_M pixel blocks x every channel block, so
    # the activation rows they share (and their taps' halos) are read from L2, not HBM
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(K, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if IDX64:  # int32 offsets unless the activation or the output spans 2^31 elements
        rm = rm.to(tl.int64)
    live = rm < M
    # each output pixel's (n, to, ho, wo) and the input offset of its window's first tap,
    # once per program; rows past M read pixel 0's window (in bounds: no mask needed)
    wo = rm % WO
    r = rm // WO
    ho = r % HO
    r = r // HO
    to = r % TO
    nb = r // TO
    ti0 = to - PT
    hi0 = ho - PH
    wi0 = wo - PW
    base = tl.where(live, nb * sxn + ti0 * sxt + hi0 * sxh + wi0 * sxw, 0)
    n_ok = rn < K
    # the tiles' pointers at tap 0, channel 0: each step only adds a scalar offset to them
    a_ptrs0 = x_ptr + base[:, None] + rk[None, :]
    b_ptrs0 = w_ptr + rk[:, None] * K + rn[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one flat loop over (tap, channel block): the pipeliner overlaps loads across taps too
    for kk in range(0, KT * KH * KW * CB):
        tap = kk // CB
        c0 = (kk - tap * CB) * BLOCK_K
        dt = tap // (KH * KW)
        dh = (tap // KW) % KH
        dw = tap % KW
        a_ptrs = a_ptrs0 + (dt * sxt + dh * sxh + dw * sxw + c0)
        b_ptrs = b_ptrs0 + (tap * C + c0) * K
        c_ok = rk < C - c0
        if PAD:  # taps that fall into the zero padding (or rows past M) read zeros
            ti = ti0 + dt
            hi = hi0 + dh
            wi = wi0 + dw
            row_ok = live & (ti >= 0) & (ti < T) & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
            if EVEN_C:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        elif EVEN_C:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=c_ok[None, :], other=0.0)
        # channels past C would read the next tap's rows (past the last tap's: out of bounds)
        if EVEN_C and EVEN_N:
            b = tl.load(b_ptrs)
        elif EVEN_C:
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=c_ok[:, None] & n_ok[None, :], other=0.0)
        if F32_DOT:  # the interpreter multiplies bf16 tiles as their raw 16-bit integers
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    if HAS_BIAS:  # in fp32, before the one rounding
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # channels-last output: pixel m's K channels at m*K
    y_ptrs = y_ptr + rm[:, None] * K + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


_kernel = rt.jit_lazy(_conv_igemm_kernel, globals())


def _check(x: torch.Tensor, w_packed: torch.Tensor, w_shape: Sequence[int], padding: Any,
           bias: torch.Tensor | None) -> None:
    reason = why_unsupported(x.shape, x.stride(), w_shape, 1, padding, 1, 1, x.dtype)
    if reason is not None:
        raise ValueError(f"conv_igemm does not take this conv: {reason}")
    taps_c, k = math.prod(w_shape[1:]), w_shape[0]
    if tuple(w_packed.shape) != (taps_c, k) or w_packed.dtype != DTYPE or not w_packed.is_contiguous():
        raise ValueError(f"w_packed must be prepare_weight's [{taps_c}, {k}] contiguous bf16, "
                         f"got {tuple(w_packed.shape)} {w_packed.dtype}")
    if bias is not None and (bias.numel() != k or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{k}] tensor")
    if not available():
        raise RuntimeError("triton is not importable")
    if not rt.device_ok(x):
        raise RuntimeError("the Triton conv runs on CUDA, or on the CPU under TRITON_INTERPRET=1")


def launcher(
    x: torch.Tensor, w_packed: torch.Tensor, w_shape: Sequence[int], padding: Any,
    bias: torch.Tensor | None = None, config: Config | None = None, *, idx64: bool | None = None,
) -> Callable[..., torch.Tensor]:
    """``conv_igemm`` with its checks and launch arguments settled once: each call launches the
    kernel into a new output (as torch's conv allocates one; or into ``out``, an ``empty_like``
    of one), what the benchmark times. ``idx64`` forces the int64 offsets (None: only where a
    tensor spans 2^31 elements)."""
    _check(x, w_packed, w_shape, padding, bias)
    spatial = x.dim() - 2
    c, k = x.shape[1], w_shape[0]
    cfg = config or configs_for(c, k)[0]
    pad = (0,) * (3 - spatial) + _pads(padding, spatial)
    y_shape = out_shape(x.shape, w_shape, padding)
    # conv2d as a conv3d with one frame and one time tap (its time stride never multiplies)
    dims = (1,) * (3 - spatial) + tuple(x.shape[2:])
    kdims = (1,) * (3 - spatial) + tuple(w_shape[2:])
    odims = (1,) * (3 - spatial) + tuple(y_shape[2:])
    sx = x.stride()
    strides = (sx[0], 0, *sx[2:]) if spatial == 2 else (sx[0], *sx[2:])
    m = y_shape[0] * math.prod(odims)
    grid = (_cdiv(m, cfg.block_m) * _cdiv(k, cfg.block_n),)
    if idx64 is None:  # masked rows and channels overhang the output by up to a tile
        m_k = torch.empty((m, k), device="meta")
        idx64 = not rt.offsets_fit_int32((x, m_k), slack=cfg.block_m * max(k, c) + cfg.block_n)
    args = (x, w_packed, x if bias is None else bias)
    consts = dict(
        C=c, CB=_cdiv(c, cfg.block_k), KT=kdims[0], KH=kdims[1], KW=kdims[2],
        PT=pad[0], PH=pad[1], PW=pad[2], PAD=any(pad), EVEN_C=c % cfg.block_k == 0, EVEN_N=k % cfg.block_n == 0,
        HAS_BIAS=bias is not None, IDX64=idx64,
        # bf16 -> fp32 is exact and so are bf16 x bf16 products in fp32: the same sums as the MMA
        F32_DOT=not x.is_cuda,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    kernel = _kernel()

    def run(out: torch.Tensor | None = None) -> torch.Tensor:
        y = empty_out(x, w_shape, padding) if out is None else out
        kernel[grid](*args, y, m, k, *odims, *dims, *strides, **consts)
        return y

    return run


def conv_igemm(
    x: torch.Tensor, w_packed: torch.Tensor, w_shape: Sequence[int], padding: Any,
    bias: torch.Tensor | None = None, config: Config | None = None,
) -> torch.Tensor:
    """The conv (stride 1, dilation 1, groups 1) of channels-last bf16 ``x`` with the weight of
    shape ``w_shape`` repacked by ``prepare_weight``: bf16, channels-last, the strides torch's conv
    returns; ``config`` None takes ``configs_for``'s first."""
    return launcher(x, w_packed, w_shape, padding, bias, config)()


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class ConfigRun:
    """One config's first launch checked (``err``: the caller's measure of its output) and timed."""

    config: Config
    ms: float | None = None
    err: float | None = None
    error: str | None = None  # why it did not run (compile error, out of resources, ...)


def time_configs(
    x: torch.Tensor, w_packed: torch.Tensor, w_shape: Sequence[int], padding: Any, *,
    check: Callable[[torch.Tensor], float], iters: int = 20, configs: Sequence[Config] | None = None,
    timer: Callable[[Callable[[], Any], int], float] | None = None,
) -> list[ConfigRun]:
    """Each config (default ``configs_for``'s) launched once, its output measured by ``check``, then
    timed by ``timer(fn, iters)``: by default the planner's clock (``vaed.patches.conv_plans.
    gpu_ms``, median of single launches behind a GPU sleep), the one bench_convs times torch and
    the cuDNN plans by. A config that fails is reported, not raised."""
    if timer is None:
        from vaed.patches.conv_plans import gpu_ms

        timer = gpu_ms
    runs = []
    for cfg in configs if configs is not None else configs_for(x.shape[1], w_shape[0]):
        res = ConfigRun(cfg)
        try:
            fn = launcher(x, w_packed, w_shape, padding, None, cfg)
            # checked in a NaN-filled output: a launch that writes nothing must not pass on what
            # the allocator's reused block still holds from the previous config
            out = fn(empty_out(x, w_shape, padding).fill_(math.nan))
            if out.is_cuda:
                torch.cuda.synchronize()
            res.err = check(out)
            res.ms = timer(fn, iters)
        except Exception as exc:  # noqa: BLE001 - Triton's compile and resource errors have their own types
            res.error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        runs.append(res)
    return runs
