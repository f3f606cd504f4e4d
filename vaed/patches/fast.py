"""The fast tier's op set: lossy but near-identical, on the same forwards.

What differs from ``LOSSLESS_OPS`` (each piece to be kept only if
benchmarks/profile_fast.py shows it pays on the H200):

* ``norm_causal_pad``: WanRMS_norm + SiLU computed in one channels-last pass
  inside the causal-input kernel (the per-pixel channel norm reduced in fp32
  in the tile, one rounding at the end) instead of a float copy of the
  activation, an aten norm reduction and the exact fused prologue -- two
  fewer full passes per norm site (2 per residual block + the head). Not
  bit-exact: ~1 bf16 ulp from stock, and no further from an fp32 decode.
  Its output and next cache are channels_last_3d even where stock's chain
  writes NCDHW (after the mid block's attention, an up block's first two
  chunks), so every norm site's conv reads channels-last.
* ``causal_pad``: the same 2-D channels-last tile kernel without the norm --
  pure data movement, bit-exact.

``LOSSLESS_TILED_OPS`` is the lossless tier with the tile kernel at every
causal-input site, the exact norm prologue included (aten's denominator, the
1-D kernel's arithmetic): bit-exact, a candidate to replace the 1-D kernel
(26 % of a steady 480p chunk, ~350 us a call) once measured.

* ``defer_bias``: convs run without their bias where the next op reading
  the output adds it -- at every site (``ALL_BIAS_SITES``), where the
  lossless tier defers only to ops that round as the conv's own bias pass.
  A residual block's conv1 bias is added in norm2's prologue (in the tile
  kernel, before the norm); conv2's and a 1x1x1 shortcut conv's in
  ``residual_add``, one kernel for ``x + bias + h`` with one rounding
  (``bias_residual_add``); an upsampler's image conv bias in the next
  block's norm1 and residual add (Wan2.1) or in the DupUp3D add (Wan2.2);
  the time_conv's in the upsample gather. torch adds a cuDNN conv's bias in
  a pass of its own: 5.2 ms of a 40.1 ms steady 480p chunk, 10.3 of 126 ms
  at Wan2.2 704x1280 (H200, bf16); 0.2 / 0.3 ms were left before the
  time_conv's moved (attention, conv_in, conv_out).
* ``norm_causal_conv``: at norm sites whose conv is 3x3x3 with at most
  ``UNFOLD_MAX_CHANNELS`` channels in and out (Wan2.1's six full-resolution
  96-channel convs per chunk), the conv input kernel above writes the three
  time taps unfolded into channels and the conv runs as one conv2d over
  3*C channels. cuDNN serves that conv2d from a Hopper kernel where conv3d
  gets an sm80-family one. Another kernel, so other rounding: fast only.
  A first chunk's one frame (no cache: the causal padding is all zero frames) is the same op
  with only the last time tap, whose weight is the only one that meets a frame: one conv2d
  over C channels at any width, a third of the conv3d's work. Frame 0 is every video's first
  output (what a client waits for before it sees anything), and its convs spent two thirds of
  their time multiplying zeros.

* ``upsample`` / ``upsample_interleave``: the lossless gather, its images
  always NHWC (the interleave's reference layout is NCHW, which made every
  up block's first frames leave channels_last_3d).
* ``conv3d`` / ``conv2d`` (and the unfolded conv2d above): on the cuDNN plan
  tuned for the call's shape where the device has a planner with one
  (``vaed.patches.conv_plans``, ``vaed serve --conv-plans``); torch's pick
  otherwise, the lossless tier's conv.

Everything else (DupUp3D add, the encoder's AvgDown3D add) is the lossless
ops.
Each fast op falls back per call to the lossless op, then to the reference,
so a contiguous-layout or CPU decoder still runs (where no kernel can run,
the biases are not deferred either: ``OpSet.defers_bias_for``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vaed import kernels as K
from vaed.kernels.causal_input_cl import causal_pad_cl
from vaed.kernels.residual import bias_residual_add
from vaed.patches.conv_plans import conv_with_plan
from vaed.patches.derived import derived
from vaed.patches.first_frame import causal_time_taps, is_first_frame, last_tap_weight
from vaed.patches.ops import (
    ALL_BIAS_SITES,
    LOSSLESS_OPS,
    FusedOp,
    NormSilu,
    OpSet,
    PadTuple,
    conv_on_plan,
    reference_causal_pad,
    reference_residual_add,
    reference_upsample,
    reference_upsample_interleave,
    triton_causal_pad,
    unfused_norm_causal_conv,
)

# Widest conv (channels in = out) that runs as an unfolded conv2d. On an H200 (bf16,
# each conv of a steady 480x832 chunk timed alone) a 96-channel 3x3x3 conv took 3.135 ms as
# conv3d (254 TFLOP/s, sm80-family cuDNN kernel) and 1.96 ms as the conv2d over unfolded
# taps (406 TFLOP/s, sm90 kernel); 192 channels already reach 535 TFLOP/s as conv3d.
UNFOLD_MAX_CHANNELS = 96
# Half dtypes only: in fp32 cuDNN runs convs in TF32 by default, whose rounding follows the
# algorithm, so the conv2d would land far outside an fp32 tolerance of the conv3d.
UNFOLD_DTYPES = (torch.bfloat16, torch.float16)


def tiled_causal_pad(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: PadTuple,
    *,
    norm: NormSilu | None = None,
    zero_history: bool = False,
    emit_cache: bool = True,
    channels_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Exact: the channels-last tile kernel, else the lossless kernel (None: reference)."""
    return triton_causal_pad(x, cache, pad, norm=norm, zero_history=zero_history, emit_cache=emit_cache,
                             channels_last=channels_last, tiled=True)


def fast_norm_causal_pad(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: PadTuple,
    *,
    norm: NormSilu | None = None,
    zero_history: bool = False,
    emit_cache: bool = True,
    channels_last: bool = False,  # written channels-last at every site anyway
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Lossy: norm+SiLU reduced and applied in one channels-last pass, written channels_last_3d
    whatever aten's chain would give (the conv after it reads channels-last), else the exact
    kernels."""
    if norm is not None:
        r = causal_pad_cl(
            x, cache, pad, zero_history=zero_history, emit_cache=emit_cache,
            norm_cl=norm, channels_last_out=True,
        )
        if r is not None:
            return r
    return tiled_causal_pad(x, cache, pad, norm=norm, zero_history=zero_history, emit_cache=emit_cache,
                            channels_last=channels_last)


def unfolded_weight(conv: nn.Conv3d) -> torch.Tensor:
    """The conv3d weight [C_out, C_in, KT, kh, kw] as a conv2d weight whose input channel
    k*C_in + c is time tap k of channel c (the unfolded input's order); rebuilt when the
    weight is replaced or changed in place."""
    w = conv.weight

    def build() -> torch.Tensor:
        c_out, c_in, kt, kh, kw = w.shape
        w2d = w.detach().permute(0, 2, 1, 3, 4).reshape(c_out, kt * c_in, kh, kw)
        return w2d.contiguous(memory_format=torch.channels_last)

    return derived(conv, "unfolded_weight", (w,), build)


def unfolded_norm_causal_conv(
    conv: nn.Conv3d,
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: PadTuple,
    *,
    norm: NormSilu,
    bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Lossy: the fast norm+SiLU conv input with the time taps unfolded into channels (only the
    last tap for a first chunk's one frame), then one conv2d; None (the op set's own input
    build and conv3d run) unless the conv qualifies.

    CUDA only: cuDNN's conv3d returns channels_last_3d for the decoder's channels_last_3d
    input, the layout this returns; a CPU conv3d picks its output layout by size."""
    if not x.is_cuda:
        return None
    return unfolded_causal_conv(conv, x, cache, pad, norm, bias=bias)


def unfolded_causal_conv(
    conv: nn.Conv3d,
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: PadTuple,
    norm: NormSilu,
    *,
    bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``unfolded_norm_causal_conv`` on any device (the interpreter tests run it on the CPU):
    (conv output in channels_last_3d, next cache), or None when the conv does not qualify."""
    w = conv.weight
    if w.dim() != 5 or x.dtype not in UNFOLD_DTYPES:
        return None
    kt = causal_time_taps(conv, pad)
    if not kt:
        return None
    if is_first_frame(x, cache):
        # a first chunk: padded frames [0, .., 0, x0], so the one output frame is the last tap
        # on x0; the next cache is x0's either way (diffusers caches the unpadded frames)
        pad, taps, weight = (*pad[:4], 0, 0), 1, last_tap_weight(conv)
    elif w.shape[0] == w.shape[1] <= UNFOLD_MAX_CHANNELS:
        taps, weight = kt, unfolded_weight(conv)
    else:
        return None
    r = causal_pad_cl(x, cache, pad, norm_cl=norm, unfold=taps, channels_last_out=True)
    if r is None:
        return None
    images, nxt = r
    y = conv_with_plan(images, weight, conv.bias if bias else None)
    if not y.is_contiguous(memory_format=torch.channels_last):
        y = y.contiguous(memory_format=torch.channels_last)
    # [B*TO, C, H, W] channels-last is [B, TO, H, W, C] in memory: channels_last_3d [B, C, TO, H, W]
    # (with conv3d's strides on size-1 dims too)
    n, c, h, w_ = y.shape
    shape = (x.shape[0], c, n // x.shape[0], h, w_)
    return y.as_strided(shape, (shape[2] * h * w_ * c, 1, h * w_ * c, w_ * c, c)), nxt


def planned_conv3d(conv: nn.Module, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
    """Lossy: a Conv3d's convolution of its (pre-padded) input on the tuned plan, if any."""
    return conv_on_plan(conv, x, bias=bias, exact=False)


def planned_conv2d(conv: nn.Module, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
    """Lossy: WanResample's image conv on the tuned plan, if any."""
    return conv_on_plan(conv, x, bias=bias, exact=False)


def channels_last_upsample(
    x: torch.Tensor, interleave: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Layout only: the upsample's images in NHWC whatever aten's chain would give (the
    upsample3d interleave gives NCHW), so the resample conv2d writes channels-last and the
    frames after it stay channels_last_3d; NCHW there cost the next block its tile kernels and
    cuDNN its layout conversions. Other strides, another conv2d algorithm: fast tier only."""
    return K.upsample_nearest2x(x, interleave, bias, channels_last=True)


def channels_last_upsample_interleave(
    x: torch.Tensor, interleave: bool = True, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    return K.upsample_nearest2x(x, interleave, bias, channels_last=True)


def fused_residual_add(x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """Lossy: ``x + bias + h`` in one pass, one rounding (None: the reference's two adds)."""
    return bias_residual_add(x, h, bias)


LOSSLESS_TILED_OPS: OpSet = dataclasses.replace(
    LOSSLESS_OPS,
    name="lossless-tiled",
    causal_pad=FusedOp("causal_pad", tiled_causal_pad, reference_causal_pad),
    norm_causal_pad=FusedOp("norm_causal_pad", tiled_causal_pad, reference_causal_pad),
)

FAST_OPS: OpSet = dataclasses.replace(
    LOSSLESS_TILED_OPS,
    name="fast",
    exact=False,
    norm_causal_pad=FusedOp("norm_causal_pad", fast_norm_causal_pad, reference_causal_pad),
    norm_causal_conv=FusedOp("norm_causal_conv", unfolded_norm_causal_conv, unfused_norm_causal_conv),
    residual_add=FusedOp("residual_add", fused_residual_add, reference_residual_add),
    conv3d=planned_conv3d,
    conv2d=planned_conv2d,
    upsample=FusedOp("upsample", channels_last_upsample, reference_upsample),
    upsample_interleave=FusedOp(
        "upsample_interleave", channels_last_upsample_interleave, reference_upsample_interleave
    ),
    defer_bias=ALL_BIAS_SITES,
    # its norm sites cut a first chunk's taps inside the unfolded conv above; the one conv left
    # (conv_in, 0.03 ms of frame 0) keeps the tier's planned conv3d
    cut_first_frame=frozenset(),
)
