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

import torch
import torch.nn.functional as F

# F.normalize's default eps; clamp_min(eps) is applied to the fp32 norm.
NORM_EPS = 1e-12


@dataclass(frozen=True)
class RmsSiluArgs:
    """What the fused prologue needs from a WanRMS_norm module."""

    gamma: torch.Tensor  # (C, 1, 1, 1), the module's parameter as stored
    scale: float  # dim ** 0.5
    bias: float  # the module's bias when it is the python float 0.0
    denom: torch.Tensor  # (B, 1, T, H, W) fp32 L2 norm over channels (not yet clamped)


def low_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def norm_denominator(x: torch.Tensor) -> torch.Tensor:
    """``x.float().norm(2, dim=1, keepdim=True)`` as F.normalize computes it (fp32).

    Same call and same input as the stock chain, so the reduction order is
    aten's own; only this fp32 pass and the norm itself remain outside the
    fused kernel.
    """
    xf = x.float() if low_precision(x.dtype) else x
    return torch.linalg.vector_norm(xf, 2, dim=1, keepdim=True)


def rms_silu_reference(x: torch.Tensor, gamma: torch.Tensor, scale: float, bias: float) -> torch.Tensor:
    """WanRMS_norm(channel_first=True, images=False).forward(x) then SiLU, op for op."""
    xf = x.float() if low_precision(x.dtype) else x
    normalized = F.normalize(xf, dim=1).to(x.dtype)
    return F.silu(normalized * scale * gamma + bias)
