"""A candidate for the lossless tier: WanRMS_norm's denominator in aten's own reduction order.

Why: ``F.normalize`` divides by ``x.norm(2, dim=1)``, an fp32 reduction over channels that the
exact chain runs in aten over the *biased* activation, so a residual block's conv1 has to add
its bias in a pass of its own (torch adds a cuDNN conv's bias after the conv) before norm2 reads
it. A reduction in aten's order that adds the bias on load, rounding as that pass would, lets
the conv leave its bias to the conv-input kernel: one pass over the activation fewer. This
module is that reduction, a benchmark candidate only: it would move into ``vaed/`` with a
whole-video gain, and it showed none.

The order. For activations whose channels are innermost (channels_last_3d, the GPU decoder's
layout), C > 128 and C a multiple of 4, aten's CUDA kernel (torch 2.11) reduces one pixel so:

* 32 lanes; lane ``l`` loads the 4-channel vectors ``l, l + 32, l + 64, ...`` (channels
  ``4v .. 4v + 3``) and keeps one fp32 accumulator per vector position, from 0:
  ``acc[j] += x[4v + j] ** 2``;
* each lane adds its accumulators in sequence, ``((acc0 + acc1) + acc2) + acc3``;
* a shuffle tree adds lane ``l + 16`` into lane ``l``, then ``l + 8``, ``l + 4``, ``l + 2``,
  ``l + 1``;
* ``sqrt``, correctly rounded.

At 128 channels and fewer aten loads single channels (another order); those are declined. A
bf16/fp16 value squared is exact in fp32, so whether the square and the add fuse into one FMA
changes nothing; fp32 activations are declined (there it would). ``norm_denominator_ordered_reference``
is the order in plain torch, ``norm_denominator_ordered`` the Triton op.

Measured on an H100 (torch 2.11, triton 3.6, bf16, random weights):

* The order holds: the op gave aten's bits at every one of a 17-frame decode's 24 (Wan2.1
  480x832) and 34 (Wan2.2 704x1280) norm-site signatures, each judged on the call's activation
  against aten's reduction of the biased one, and a Wan2.2 704x1280x121 decode taking it at its
  biased sites was stock's bits (``vaed bench``).
* Per call, at Wan2.2 704x1280's biased norm sites, the op and the tile kernel's exact prologue
  adding the bias took 1.01 / 0.48 / 0.17 / 0.14 ms (256, 512, 1024, 1024 channels at 4x352x640,
  4x176x320, 2x88x160, 1x44x80) against 1.63 / 0.77 / 0.24 / 0.12 ms for an out-of-place bias
  add, aten's reduction and the 1-D conv-input kernel; a steady chunk's GPU time, each op timed
  between CUDA events (``roofline.py``), went from 120.2 to 116.1 ms.
* Whole videos did not move: Wan2.2 704x1280x121 lossless, plans off, four processes
  interleaved, 3.578 / 3.590 s before against 3.576 / 3.600 s with it (the chain it replaces
  adds conv1's bias in place, cheaper than the per-call comparison's add, and the per-op events
  of the roofline inflate the spans they cut). Wan2.1's 192- and 384-channel sites were slower
  through the tile kernel (1.44 against 1.34 ms at 192 channels, 4x360x640).
* Reducing inside the tile kernel instead (its programs holding 2-16 pixels with all their
  channels) took 2-35 times as long as the aten chain.

Time it on a GPU (bits checked against aten's reduction of the biased activation)::

    python benchmarks/ordered_norm.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vaed import kernels as K
from vaed.patches.conv_plans import gpu_ms
from vaed.kernels import _runtime as rt

if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy
triton: Any = None  # filled in by rt.jit_lazy
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter

LANES = 32  # aten's lanes per pixel
VECTOR = 4  # channels a lane loads at once
SPAN = LANES * VECTOR  # channels one round of the 32 lanes covers
ORDERED_DTYPES = (torch.bfloat16, torch.float16)
_BLOCK_P = 16  # pixels a program reduces


def ordered_channels(channels: int) -> bool:
    """Whether aten reduces ``channels`` in the vectorized order above."""
    return channels > SPAN and channels % VECTOR == 0


def norm_denominator_ordered_reference(x: torch.Tensor, x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(x + x_bias).float().norm(2, dim=1, keepdim=True)`` summed in aten's order (module
    docstring), in plain torch: fp32, shape (B, 1, T, H, W). ``x_bias`` ([C]) is added in
    aten's add first and rounded to x's dtype, as the producing conv's own bias pass."""
    if x_bias is not None:
        x = x + x_bias.view(1, -1, 1, 1, 1)
    b, c, t, h, w = x.shape
    rounds = -(-c // SPAN)
    v = F.pad(x.float().permute(0, 2, 3, 4, 1), (0, rounds * SPAN - c))  # absent channels: 0
    v = v.reshape(b, t, h, w, rounds, LANES, VECTOR)
    acc = torch.zeros(b, t, h, w, LANES, VECTOR, dtype=torch.float32, device=x.device)
    for k in range(rounds):
        acc = acc + v[..., k, :, :] * v[..., k, :, :]
    lane = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    width = LANES
    while width > 1:
        width //= 2
        lane = lane[..., :width] + lane[..., width : 2 * width]
    # through float64: correctly rounded on every device (torch's fp32 sqrt on a CPU is not
    # always), and a float64 root rounded to fp32 is the fp32 root
    return lane[..., 0].double().sqrt().float().unsqueeze(1)


def _norm_denominator_kernel(
    x_ptr, xb_ptr, d_ptr, NPIX, C, W, H, T,
    sxb, sxt, sxh, sxw,
    ROUNDS: tl.constexpr, XBIAS: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # A program owns BLOCK_P pixels (b, t, h, w; w fastest) with all their channels. The lanes'
    # five bits are axes 1-5 (lane = b0 + 2 b1 + 4 b2 + 8 b3 + 16 b4) and the vector position
    # axis 6, so each step of aten's tree is a sum over one axis of size 2 -- one add, whatever
    # order Triton reduces in -- and a lane's accumulators are taken one at a time (a sum of one
    # value and three zeros is that value).
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = (p < NPIX)[:, None, None, None, None, None, None]
    w = p % W
    h = (p // W) % H
    t = (p // (W * H)) % T
    b = p // (W * H * T)
    base = (x_ptr + b * sxb + t * sxt + h * sxh + w * sxw)[:, None, None, None, None, None, None]
    one = tl.arange(0, 2)
    lane = (one[None, :, None, None, None, None, None] + 2 * one[None, None, :, None, None, None, None]
            + 4 * one[None, None, None, :, None, None, None] + 8 * one[None, None, None, None, :, None, None]
            + 16 * one[None, None, None, None, None, :, None])
    j = tl.arange(0, 4)[None, None, None, None, None, None, :]
    acc = tl.zeros([BLOCK_P, 2, 2, 2, 2, 2, 4], dtype=tl.float32)
    for k in tl.static_range(ROUNDS):
        ch = lane * 4 + j + k * 128  # lane l's vector l + 32k, position j
        m = live & (ch < C)
        v = tl.load(base + ch, mask=m, other=0.0)
        if XBIAS:  # the conv's deferred bias, added and rounded as its own pass would
            xb = tl.load(tl.broadcast_to(xb_ptr + ch, (BLOCK_P, 2, 2, 2, 2, 2, 4)), mask=m, other=0.0)
            v = (v.to(tl.float32) + xb.to(tl.float32)).to(v.dtype)
        v = v.to(tl.float32)
        acc = acc + v * v
    s = tl.sum(tl.where(j == 0, acc, 0.0), axis=6)
    s = s + tl.sum(tl.where(j == 1, acc, 0.0), axis=6)
    s = s + tl.sum(tl.where(j == 2, acc, 0.0), axis=6)
    s = s + tl.sum(tl.where(j == 3, acc, 0.0), axis=6)
    s = tl.sum(s, axis=5)  # lane l + 16 into l
    s = tl.sum(s, axis=4)  # + 8
    s = tl.sum(s, axis=3)  # + 4
    s = tl.sum(s, axis=2)  # + 2
    s = tl.sum(s, axis=1)  # + 1
    tl.store(d_ptr + p, tl.sqrt_rn(s), mask=p < NPIX)


_kernel = rt.jit_lazy(_norm_denominator_kernel, globals())


def ordered_eligible(x: torch.Tensor, x_bias: torch.Tensor | None = None) -> bool:
    """Whether ``x`` is reduced in the order above by aten (as far as its shape and layout
    say: channels innermost, aligned 4-vectors) and the kernels may run on it."""
    if not rt.triton_available() or x.dim() != 5 or x.dtype not in ORDERED_DTYPES or not rt.device_ok(x):
        return False
    if not ordered_channels(x.shape[1]) or x.stride(1) != 1 or x.numel() == 0:
        return False
    # every pixel's channels start on an 8-byte boundary, as aten's vector loads need
    pixel_strides = [s for i, (n, s) in enumerate(zip(x.shape, x.stride(), strict=True)) if i != 1 and n > 1]
    if x.data_ptr() % (VECTOR * x.element_size()) or any(s % VECTOR for s in pixel_strides):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if torch.compiler.is_compiling() or not rt.offsets_fit_int32((x,), slack=SPAN):
        return False
    if x_bias is None:
        return True
    return (x_bias.device == x.device and x_bias.dtype == x.dtype and x_bias.numel() == x.shape[1]
            and x_bias.is_contiguous())


def norm_denominator_ordered(x: torch.Tensor, x_bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``norm_denominator_ordered_reference(x, x_bias)`` in one Triton pass (contiguous
    (B, 1, T, H, W) fp32); None where ``ordered_eligible`` says no."""
    if not ordered_eligible(x, x_bias):
        return None
    b, c, t, h, w = x.shape
    d = torch.empty(b, 1, t, h, w, dtype=torch.float32, device=x.device)
    npix = b * t * h * w
    _kernel()[(-(-npix // _BLOCK_P),)](
        x, x if x_bias is None else x_bias, d, npix, c, w, h, t,
        x.stride(0), x.stride(2), x.stride(3), x.stride(4),
        ROUNDS=-(-c // SPAN), XBIAS=x_bias is not None, BLOCK_P=_BLOCK_P, num_warps=4, **rt.launch_opts(x),
    )
    return d


# (channels, frames, height, width, biased calls a steady chunk makes), per case
SITES: dict[str, list[tuple[int, int, int, int, int]]] = {
    "wan2.2-704p": [(256, 4, 352, 640, 3), (512, 4, 176, 320, 2), (1024, 2, 88, 160, 3), (1024, 1, 44, 80, 5)],
    "wan2.1-720p": [(192, 4, 360, 640, 3), (384, 2, 180, 320, 3), (384, 1, 90, 160, 5)],
}


def time_site(c: int, t: int, h: int, w: int) -> tuple[float, float, float, bool]:
    """(ms of conv1's in-place bias add, of aten's reduction of the biased activation, of the
    ordered op from the unbiased one; whether the op gave aten's bits) at one norm site."""
    x = (torch.randn(1, c, t, h, w, device="cuda") * 3).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    bias = torch.randn(c, device="cuda").to(torch.bfloat16)
    biased = x + bias.view(1, -1, 1, 1, 1)
    got = norm_denominator_ordered(x, bias)
    exact = got is not None and torch.equal(got, K.norm_denominator(biased))
    add = gpu_ms(lambda: biased.add_(bias.view(1, -1, 1, 1, 1)))
    reduce = gpu_ms(lambda: K.norm_denominator(biased))
    ordered = gpu_ms(lambda: norm_denominator_ordered(x, bias))
    return add, reduce, ordered, exact


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(SITES), choices=list(SITES))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for case in args.cases:
        print(f"--- {case}: ms a call; the chain = conv1's in-place bias add + aten's reduction")
        totals = {"chain": 0.0, "ordered": 0.0}
        for c, t, h, w, calls in SITES[case]:
            add, reduce, ordered, exact = time_site(c, t, h, w)
            totals["chain"] += (add + reduce) * calls
            totals["ordered"] += ordered * calls
            print(f"C{c} {t}x{h}x{w} (x{calls}): bias add {add:.3f} + reduction {reduce:.3f} | ordered {ordered:.3f}"
                  f"{'' if exact else '  DIFFERS from aten'}", flush=True)
            torch.cuda.empty_cache()
        print(f"steady chunk: chain {totals['chain']:.2f} ms, ordered {totals['ordered']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
