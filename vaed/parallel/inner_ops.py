"""The per-shard ("inner") ops the sharded forwards call after the halo exchange.

A sharded decode runs the same data movement as a one-GPU decode, only on a
haloed shard: build the causal conv input (cache + new frames + zero padding,
optionally with WanRMS_norm + SiLU fused in), the nearest 2x upsample, the
DupUp3D shortcut add and the padded 3-D conv. Those are exactly the fields of
the decoder's op bundle (`vaed.patches.ops.OpSet`: `causal_conv_input`,
`upsample2x`, `dupup_add`, `conv3d`, `residual_add`), so the fused Triton
kernels keep working on shards: `resolve_inner_ops("auto")` returns the
lossless (Triton) op set where the patches package provides it.

`AtenOps` is the plain-torch chain of the same five ops, op for op what stock
diffusers runs (the naive reference beside the fused set). It is used on CPU,
with `kernels="off"`, and when no op-set package is importable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

CACHE_T = 2  # diffusers' CACHE_T: frames a causal conv keeps for the next chunk
PadTuple = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class NormArgs:
    """WanRMS_norm(channel_first, python-float bias) + SiLU, fused into a conv input build."""

    gamma: torch.Tensor  # (C, 1, 1, 1)
    scale: float
    bias: float


class InnerOps(Protocol):
    def causal_conv_input(
        self,
        x: torch.Tensor,
        cache: torch.Tensor | None,
        pad: PadTuple,
        *,
        norm: Any = None,
        zero_history: bool = False,
        emit_cache: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def upsample2x(self, x: torch.Tensor, interleave: bool) -> torch.Tensor: ...

    def dupup_add(
        self, main: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, first_chunk: bool
    ) -> torch.Tensor: ...

    def conv3d(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def residual_add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor: ...


def _rms_silu(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """WanRMS_norm(channel_first=True).forward then SiLU, op for op."""
    low = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if low else x, dim=1).to(x.dtype)
    return F.silu(normalized * norm.scale * norm.gamma + norm.bias)


def frames_to_images(x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """WanResample.forward's reshapes before its upsample, op for op (interleave: upsample3d)."""
    b, c, t, h, w = x.shape
    if interleave:
        c //= 2
        x = x.reshape(b, 2, c, t, h, w)
        x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
        x = x.reshape(b, c, t * 2, h, w)
        t *= 2
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


class AtenOps:
    """The stock diffusers chains (no kernels)."""

    name = "aten"

    def causal_conv_input(
        self,
        x: torch.Tensor,
        cache: torch.Tensor | None,
        pad: PadTuple,
        *,
        norm: Any = None,
        zero_history: bool = False,
        emit_cache: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if norm is not None:
            x = _rms_silu(x, norm)
        nxt = None
        if emit_cache:
            nxt = x[:, :, -CACHE_T:, :, :].clone()
            if nxt.shape[2] < CACHE_T:
                if zero_history:
                    nxt = torch.cat([torch.zeros_like(nxt), nxt], dim=2)
                elif cache is not None:
                    nxt = torch.cat([cache[:, :, -1, :, :].unsqueeze(2), nxt], dim=2)
        padding = list(pad)
        if cache is not None and pad[4] > 0:
            x = torch.cat([cache, x], dim=2)
            padding[4] -= cache.shape[2]
        return F.pad(x, padding), nxt

    def upsample2x(self, x: torch.Tensor, interleave: bool) -> torch.Tensor:
        images = frames_to_images(x, interleave)
        # WanUpsample: nearest-exact 2x in fp32, back to the input dtype
        return F.interpolate(images.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(images)

    def dupup_add(
        self, main: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, first_chunk: bool
    ) -> torch.Tensor:
        out_c = main.shape[1]
        repeats = out_c * factor_t * factor_s * factor_s // source.shape[1]
        x = source.repeat_interleave(repeats, dim=1)
        x = x.view(x.size(0), out_c, factor_t, factor_s, factor_s, x.size(2), x.size(3), x.size(4))
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
        x = x.view(x.size(0), out_c, x.size(2) * factor_t, x.size(4) * factor_s, x.size(6) * factor_s)
        if first_chunk:
            x = x[:, :, factor_t - 1 :, :, :]
        return main + x

    def conv3d(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # WanCausalConv3d's own padding is (0, 0, 0) after its __init__: x is already padded
        return conv._conv_forward(x, conv.weight, conv.bias)  # type: ignore[operator]

    def residual_add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + h


ATEN_OPS = AtenOps()


def resolve_inner_ops(kernels: str = "auto") -> InnerOps:
    """The op bundle shards run with: "off" -> plain torch; "auto"/"triton" -> the lossless
    (Triton, per-call fallback to its reference) op set of `vaed.patches` when importable."""
    if kernels not in ("auto", "triton", "off"):
        raise ValueError(f"kernels must be auto, triton or off, got {kernels!r}")
    if kernels == "off":
        return ATEN_OPS
    try:
        from vaed.patches.ops import LOSSLESS_OPS
    except ImportError as exc:  # the op-set package is not there: stock chains on shards
        if kernels == "triton":
            raise RuntimeError(f"kernels='triton' but the fused op set cannot be imported: {exc}") from exc
        log.info("sharded decode runs the plain-torch ops (no fused op set importable: %s)", exc)
        return ATEN_OPS
    return LOSSLESS_OPS  # type: ignore[return-value]
