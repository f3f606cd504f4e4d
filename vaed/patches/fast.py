"""The fast tier's op set: lossy but near-identical, on the same forwards.

What differs from ``LOSSLESS_OPS`` (each piece to be kept only if
scripts/profile_fast.py shows it pays on the H200):

* ``norm_causal_pad``: WanRMS_norm + SiLU computed in one channels-last pass
  inside the causal-input kernel (the per-pixel channel norm reduced in fp32
  in the tile, one rounding at the end) instead of a float copy of the
  activation, an aten norm reduction and the exact fused prologue -- two
  fewer full passes per norm site (2 per residual block + the head). Not
  bit-exact: ~1 bf16 ulp from stock, and no further from an fp32 decode.
* ``causal_pad``: the same 2-D channels-last tile kernel without the norm --
  pure data movement, bit-exact.

``LOSSLESS_TILED_OPS`` is the lossless tier with the tile kernel at every
causal-input site, the exact norm prologue included (aten's denominator, the
1-D kernel's arithmetic): bit-exact, a candidate to replace the 1-D kernel
(26 % of a steady 480p chunk, ~350 us a call) once measured.

Everything else (upsample gathers, DupUp3D add, cuDNN convs) is the lossless
ops. Each fast op falls back per call to the lossless op, then to the
reference, so a contiguous-layout or CPU decoder still runs.
"""

from __future__ import annotations

import dataclasses

import torch

from vaed.kernels.causal_input_cl import causal_pad_cl
from vaed.patches.ops import (
    LOSSLESS_OPS,
    FusedOp,
    NormSilu,
    OpSet,
    PadTuple,
    reference_causal_pad,
    triton_causal_pad,
)


def tiled_causal_pad(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: PadTuple,
    *,
    norm: NormSilu | None = None,
    zero_history: bool = False,
    emit_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Exact: the channels-last tile kernel, else the lossless kernel (None: reference)."""
    return triton_causal_pad(x, cache, pad, norm=norm, zero_history=zero_history, emit_cache=emit_cache, tiled=True)


def fast_norm_causal_pad(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    pad: PadTuple,
    *,
    norm: NormSilu | None = None,
    zero_history: bool = False,
    emit_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Lossy: norm+SiLU reduced and applied in one channels-last pass, else the exact kernels."""
    if norm is not None:
        r = causal_pad_cl(
            x, cache, pad, zero_history=zero_history, emit_cache=emit_cache,
            norm_cl=(norm.gamma, norm.scale, norm.bias),
        )
        if r is not None:
            return r
    return tiled_causal_pad(x, cache, pad, norm=norm, zero_history=zero_history, emit_cache=emit_cache)


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
)
