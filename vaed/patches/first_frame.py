"""A first chunk's causal convs on their last time tap, bit for bit (the lossless tier).

A video's first latent frame decodes with no cache: each WanCausalConv3d pads its one frame
with kt - 1 zero frames in front, so only the last time tap ever meets data. Stock runs the
whole conv3d over those zeros anyway, and frame 0 is what every client waits for first. Cut to
the last tap, the same conv is a conv2d over the frame (or a 1 x kh x kw conv3d), a third of
the work. On an H200 (``benchmarks/first_chunk_taps.py``, bf16, cuDNN 9.19) the 30 causal
convs of a Wan2.1 first chunk took 9.7 ms at 480x832 and 22.5 ms at 720x1280 as stock's
conv3d; one of the two cut forms gave stock's bits for every one of them, in 4.4 and 8.6 ms.

Adding zeros never changes a float sum, so a cut conv equals stock's exactly when cuDNN
sums the remaining products in the same order -- which depends on the kernel it picks for
each shape (at 480x832 the conv2d matched stock on 14 of 30 convs, the 1-tap conv3d on 23;
Wan2.2's 1024-channel convs at 90x162 match in neither form). So nothing is assumed: the
first call of each signature (shapes, strides, dtype, device, padding, bias) runs stock's
conv and each cut form, on the call's own input and on seeded random ones (2^20 outputs at
least: a form that sums in another order differs in a few outputs per 10^4), and keeps the
first form whose output has stock's bits (int views: -0 and +0 differ) and strides on both,
and whose conv input build hands on stock's next cache; a signature where none does keeps
stock's conv. That call answers with stock's result. As for the norm denominator's verdict,
a call inside a CUDA graph capture (no syncs allowed) or with NaN in stock's output runs
stock's path and leaves the verdict to a later call. An op set names the device types it cuts
on (``OpSet.cut_first_frame``: CUDA for the lossless tier).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from vaed.kernels.rms_silu import NormSilu
from vaed.patches.bits import random_inputs_for, same_bits, seeded_normal
from vaed.patches.derived import derived
from vaed.patches.layout import conv_reads_channels_last

if TYPE_CHECKING:  # the op sets call this module: types only from there
    from vaed.patches.ops import OpSet, PadTuple

Built = tuple[torch.Tensor, torch.Tensor | None]  # (conv output, next cache)
CutConv = Callable[[nn.Conv3d, torch.Tensor, bool], torch.Tensor]

# signature -> (the cut form that gives stock's bits, stock's output strides), or None: stock's conv
_VERDICTS: dict[tuple[Any, ...], tuple[str, tuple[int, ...]] | None] = {}
_MAX_SIGNATURES = 4096


def causal_time_taps(conv: nn.Module, pad: PadTuple) -> int:
    """The time taps of a WanCausalConv3d-style conv (all time padding in front, none in the
    module, stride and dilation 1, no groups), else 0."""
    w = getattr(conv, "weight", None)
    if not isinstance(conv, nn.Conv3d) or w is None or w.dim() != 5:
        return 0
    kt = w.shape[2]
    plain = (
        tuple(conv.stride) == (1, 1, 1) and tuple(conv.dilation) == (1, 1, 1)
        and tuple(conv.padding) == (0, 0, 0) and conv.groups == 1
    )
    return kt if plain and kt >= 2 and pad[4] == kt - 1 else 0


def is_first_frame(x: torch.Tensor, cache: torch.Tensor | None) -> bool:
    """A first chunk's call: one frame and no cache, so every time padding frame is zero."""
    return cache is None and x.dim() == 5 and x.shape[2] == 1


def last_tap_weight(conv: nn.Conv3d) -> torch.Tensor:
    """The conv3d weight's last time tap [C_out, C_in, kh, kw] as a channels-last conv2d weight:
    the only tap a first chunk's one frame meets behind its zero padding."""
    w = conv.weight

    def build() -> torch.Tensor:
        return w.detach()[:, :, -1].contiguous(memory_format=torch.channels_last)

    return derived(conv, "last_tap_weight", (w,), build)


def last_tap_weight_3d(conv: nn.Conv3d) -> torch.Tensor:
    """The same tap as a [C_out, C_in, 1, kh, kw] channels_last_3d conv3d weight."""
    w = conv.weight

    def build() -> torch.Tensor:
        return w.detach()[:, :, -1:].contiguous(memory_format=torch.channels_last_3d)

    return derived(conv, "last_tap_weight_3d", (w,), build)


def _bias(conv: nn.Conv3d, bias: bool) -> torch.Tensor | None:
    return conv.bias if bias else None


def cut_conv2d(conv: nn.Conv3d, frame: torch.Tensor, bias: bool) -> torch.Tensor:
    """The frame [B, C, 1, H, W] (spatially padded) through the last tap as a conv2d, returned as
    [B, C_out, 1, H', W'] over the conv2d's own memory."""
    y = F.conv2d(frame[:, :, 0], last_tap_weight(conv), _bias(conv, bias))
    return y.unsqueeze(2)


def cut_conv3d(conv: nn.Conv3d, frame: torch.Tensor, bias: bool) -> torch.Tensor:
    """The frame through the last tap as a 1 x kh x kw conv3d."""
    return F.conv3d(frame, last_tap_weight_3d(conv), _bias(conv, bias))


# tried in this order (the conv2d was the faster form wherever both matched stock)
CUT_FORMS: dict[str, CutConv] = {"conv2d": cut_conv2d, "conv3d-1tap": cut_conv3d}


def _in_layout(y: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor | None:
    """``y`` viewed with stock's output strides where its memory holds the elements in that
    order (a channels-last conv2d output is channels_last_3d's memory with T = 1), else None."""
    if y.stride() == stride:
        return y
    probe = torch.empty_strided(y.shape, stride, device="meta")
    if not (probe.is_contiguous(memory_format=torch.channels_last_3d)
            and y.squeeze(2).is_contiguous(memory_format=torch.channels_last)):
        return None
    return y.as_strided(y.shape, stride)


def _signature(ops: OpSet, conv: nn.Conv3d, x: torch.Tensor, pad: PadTuple, norm: NormSilu | None,
               bias: bool) -> tuple:
    w = conv.weight
    return (
        ops, tuple(x.shape), x.stride(), x.dtype, x.device, tuple(w.shape), w.stride(), w.dtype, pad,
        bias and conv.bias is not None, norm is not None, norm is not None and norm.x_bias is not None,
    )


def _stock(ops: OpSet, conv: nn.Conv3d, x: torch.Tensor, pad: PadTuple, norm: NormSilu | None,
           bias: bool) -> Built:
    """Stock's conv of the zero-padded frame: the op set's input build, then its conv3d."""
    padded, nxt = ops.causal_conv_input(x, None, pad, norm=norm, channels_last=conv_reads_channels_last(conv, x))
    return ops.conv3d(conv, padded, bias=bias), nxt


def _cut(
    ops: OpSet, conv: nn.Conv3d, x: torch.Tensor, pad: PadTuple, norm: NormSilu | None, bias: bool,
    form: CutConv, stride: tuple[int, ...],
) -> Built | None:
    """The frame built without its zero frames, then the cut conv, its output in stock's strides."""
    frame, nxt = ops.causal_conv_input(x, None, (*pad[:4], 0, 0), norm=norm)
    y = _in_layout(form(conv, frame, bias), stride)
    return None if y is None else (y, nxt)


def _matches(ops: OpSet, conv: nn.Conv3d, x: torch.Tensor, pad: PadTuple, norm: NormSilu | None, bias: bool,
             form: CutConv, stock: Built) -> bool:
    got = _cut(ops, conv, x, pad, norm, bias, form, stock[0].stride())
    return got is not None and same_bits(got[0], stock[0]) and same_bits(got[1], stock[1])


def _judge(ops: OpSet, conv: nn.Conv3d, x: torch.Tensor, pad: PadTuple, norm: NormSilu | None, bias: bool,
           stock: Built) -> str | None:
    """The first cut form with stock's bits on this call's input and on seeded random ones
    (``bits.random_inputs_for`` its outputs), or None."""
    cases = [(x, stock)]
    for seed in range(random_inputs_for(stock[0].numel())):
        random_x = seeded_normal(tuple(x.shape), x.stride(), x.dtype, x.device, seed)
        cases.append((random_x, _stock(ops, conv, random_x, pad, norm, bias)))
    for name, form in CUT_FORMS.items():
        if all(_matches(ops, conv, xi, pad, norm, bias, form, want) for xi, want in cases):
            return name
    return None


def cut_causal_conv(
    ops: OpSet,
    conv: nn.Module,
    x: torch.Tensor,
    pad: PadTuple,
    *,
    norm: NormSilu | None = None,
    bias: bool = True,
) -> Built | None:
    """A first chunk's causal conv (``x`` one frame, no cache) through its last time tap, with
    ``ops``' own input build, where that is checked to give the bits of ``ops``' input build
    and conv3d over the zero-padded frame (module docstring); stock's result on the call that
    judges. None where the conv is not a plain causal one or no cut form matched: the caller
    runs its input build and conv3d."""
    if not causal_time_taps(conv, pad) or not is_first_frame(x, None):
        return None
    assert isinstance(conv, nn.Conv3d)
    key = _signature(ops, conv, x, pad, norm, bias)
    if key in _VERDICTS:
        verdict = _VERDICTS[key]
        return None if verdict is None else _cut(ops, conv, x, pad, norm, bias, CUT_FORMS[verdict[0]], verdict[1])
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    stock = _stock(ops, conv, x, pad, norm, bias)
    if bool(torch.isnan(stock[0]).any()):
        return stock  # NaN never equals itself: judge on finite activations, not these
    if len(_VERDICTS) >= _MAX_SIGNATURES:
        _VERDICTS.clear()
    form = _judge(ops, conv, x, pad, norm, bias, stock)
    _VERDICTS[key] = None if form is None else (form, stock[0].stride())
    return stock


def verdicts() -> dict[tuple[Any, ...], str | None]:
    """The verdicts so far (signature -> the cut form that gives stock's bits, or None)."""
    return {k: (None if v is None else v[0]) for k, v in _VERDICTS.items()}
