"""WanRMS_norm (channel-first, bias-free) followed by SiLU: the exact aten chain.

The Triton side of this op lives inside :mod:`vaed.kernels.causal_pad` as an
optional prologue (normalize + scale + gamma + bias + SiLU on the new frames
while they are copied into the conv input), so the normalized activation is
never written to memory on its own. This module holds the reference and the
one reduction that stays in aten: the per-pixel L2 norm over channels, whose
summation order only aten's reduction kernel reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

# F.normalize's default eps; clamp_min(eps) is applied to the fp32 norm.
NORM_EPS = 1e-12

if TYPE_CHECKING:  # what the kernels' `tl.constexpr` annotations name (triton has no hints: Any)
    import triton.language as tl
else:
    tl = None  # filled in by rt.jit_lazy (for rms_silu_exact_tile, a device helper)
libdevice: Any = None  # filled in by rt.jit_lazy: libdevice, or tl.math under the interpreter


@dataclass(frozen=True)
class NormSilu:
    """A WanRMS_norm(channel_first, bias-free) + SiLU pair, as every op that fuses it takes it:
    the references, the exact prologue (which needs ``denom``) and the fast one."""

    gamma: torch.Tensor  # (C, 1, 1, 1), the module's parameter as stored
    scale: float  # dim ** 0.5
    bias: float  # the module's bias when it is the python float 0.0
    # the producing conv's bias ([C]), left out of that conv: added to x before the norm
    x_bias: torch.Tensor | None = None
    # (B, 1, T, H, W) fp32 L2 norm over channels (not yet clamped): aten's, for the exact prologue
    denom: torch.Tensor | None = None


def low_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def norm_denominator_reference(x: torch.Tensor) -> torch.Tensor:
    """``x.float().norm(2, dim=1, keepdim=True)`` as F.normalize computes it (fp32).

    Same call and same input as the stock chain, so the reduction order is
    aten's own; only this fp32 pass and the norm itself remain outside the
    fused kernel.
    """
    xf = x.float() if low_precision(x.dtype) else x
    return torch.linalg.vector_norm(xf, 2, dim=1, keepdim=True)


# (shape, strides, dtype, device) -> whether the cast-on-load reduction gave the reference's bits;
# a decoder has ~20 signatures per resolution, the bound only stops unbounded growth
_CAST_ON_LOAD_EXACT: dict[tuple[Any, ...], bool] = {}
_MAX_SIGNATURES = 4096


def norm_denominator(x: torch.Tensor) -> torch.Tensor:
    """``norm_denominator_reference(x)``'s exact bits, without its float copy where that is proven.

    For bf16/fp16, aten can reduce ``x`` itself with fp32 accumulation
    (``vector_norm(x, dtype=float32)``): the same reduction without writing
    and re-reading an fp32 copy (9.0 -> 4.0 ms of a steady 480p Wan2.1 chunk's
    denominators on an H200, bit-equal at every call site). That the
    summation order matches is aten's implementation detail, so it is
    checked, not assumed: the first call of each (shape, strides, dtype,
    device) computes both and keeps the cheaper one only if torch.equal; a
    call inside a CUDA graph capture (no syncs allowed) or on activations with
    NaN (an ``allow_non_finite`` session) takes the reference and leaves the
    verdict to a later call, so such input cannot slow the path for others.
    """
    if not low_precision(x.dtype):
        return norm_denominator_reference(x)
    key = (tuple(x.shape), x.stride(), x.dtype, x.device)
    exact = _CAST_ON_LOAD_EXACT.get(key)
    if exact is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return norm_denominator_reference(x)
        want = norm_denominator_reference(x)
        if bool(torch.isnan(want).any()):
            return want  # NaN never equals itself: judge on finite activations, not these
        got = _cast_on_load(x)
        if len(_CAST_ON_LOAD_EXACT) >= _MAX_SIGNATURES:
            _CAST_ON_LOAD_EXACT.clear()
        exact = _CAST_ON_LOAD_EXACT[key] = bool(torch.equal(got, want) and got.stride() == want.stride())
        return want
    return _cast_on_load(x) if exact else norm_denominator_reference(x)


def _cast_on_load(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, 2, dim=1, keepdim=True, dtype=torch.float32)


def rms_silu_reference(x: torch.Tensor, gamma: torch.Tensor, scale: float, bias: float) -> torch.Tensor:
    """WanRMS_norm(channel_first=True, images=False).forward(x) then SiLU, op for op."""
    xf = x.float() if low_precision(x.dtype) else x
    normalized = F.normalize(xf, dim=1).to(x.dtype)
    return F.silu(normalized * scale * gamma + bias)


def rms_silu_exact_tile(xv, d, g_ptrs, g_mask, scale, bias, LOWP: tl.constexpr):
    """Device helper of the causal-input kernels' exact prologue (jitted by ``rt.jit_lazy``):
    ``rms_silu_reference`` on a tile of raw activations ``xv``, op for op. ``d`` is aten's
    fp32 L2 norm of each pixel (not yet clamped); ``g_ptrs`` / ``g_mask`` address gamma at
    the tile's shape (loaded here, where the arithmetic needs it: both kernels compile to the
    PTX they had with this written out inline). Rounds to xv's dtype after every op when
    ``LOWP`` (aten's opmath); SiLU with CUDA's expf."""
    d = tl.where(d != d, d, tl.maximum(d, 1e-12))  # clamp_min(NORM_EPS), NaN kept
    v = tl.math.div_rn(xv.to(tl.float32), d)
    if LOWP:
        v = v.to(xv.dtype).to(tl.float32)
    v = v * scale
    if LOWP:
        v = v.to(xv.dtype).to(tl.float32)
    v = v * tl.load(g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
    if LOWP:
        v = v.to(xv.dtype).to(tl.float32)
    v = v + bias
    if LOWP:
        v = v.to(xv.dtype).to(tl.float32)
    v = tl.math.div_rn(v, 1.0 + libdevice.exp(-v))
    return v.to(xv.dtype)
