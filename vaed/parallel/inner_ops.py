"""The per-shard ("inner") ops the sharded forwards call around the halo exchange.

A sharded decode runs the same data movement as a one-GPU decode, only on a
shard: build the causal conv input (cache + new frames + zero padding, whose
rows at interior edges the halo exchange then fills,
optionally with WanRMS_norm + SiLU fused in), the nearest 2x upsample, the
DupUp3D shortcut add and the padded 3-D conv. Those are exactly the fields of
the decoder's op bundle (`vaed.patches.ops.OpSet`: `causal_conv_input`,
`upsample2x`, `dupup_add`, `conv3d`, `residual_add`), so the fused Triton
kernels keep working on shards: `resolve_inner_ops("auto")` returns the
lossless (Triton) op set where the patches package provides it.

`ATEN_OPS` is the patches' plain-torch op set (`REFERENCE_OPS`), op for op
what stock diffusers runs (the naive reference beside the fused set). It is
used on CPU, with `kernels="off"`, and when no fused op set is importable.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import nn

from vaed.patches.ops import REFERENCE_OPS

log = logging.getLogger(__name__)

CACHE_T = 2  # diffusers' CACHE_T: frames a causal conv keeps for the next chunk
PadTuple = tuple[int, int, int, int, int, int]


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


# The stock diffusers chains (no kernels): the patches' plain-torch op set, one copy.
ATEN_OPS = REFERENCE_OPS


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
