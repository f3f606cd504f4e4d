"""Diffusers' Wan decoder forwards, rewritten over an op set.

Each function mirrors one private diffusers forward (verified against the
versions in :mod:`vaed.patches.versions`) line for line, except that the
data movement it does around each conv goes through the active
:class:`~vaed.patches.ops.OpSet` (see :mod:`vaed.patches.context`). With
``REFERENCE_OPS`` every forward computes exactly the stock aten chain, which
the CPU tests check against an unpatched decoder with ``torch.equal``.

A forward runs the stock class forward instead (its whole-call fallback) when
the op set path does not apply: autograd on (stock keeps its exact graph),
torch.compile tracing, no causal cache (``feat_cache=None``), or a module
configuration the port does not cover (active dropout, a non-default norm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from vaed.patches.context import ops_for
from vaed.patches.layout import is_dense
from vaed.patches.ops import NormSilu, OpSet

# dtypes the op-set path takes; others (e.g. float8 activations, where diffusers'
# norm has its own rule) go through the stock forward
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _op_path_ok(x: torch.Tensor) -> bool:
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    return x.dtype in _DTYPES


def norm_silu_spec(norm: Any, act: Any, x: torch.Tensor) -> NormSilu | None:
    """A NormSilu for ``act(norm(x))`` when it is WanRMS_norm(channel_first, no bias) + SiLU."""
    g = getattr(norm, "gamma", None)
    ok = (
        isinstance(act, nn.SiLU)
        and not act.inplace
        and getattr(norm, "channel_first", False)
        and isinstance(getattr(norm, "bias", None), float)
        and isinstance(g, torch.Tensor)
        and g.dim() == 4
        and g.numel() == x.shape[1]
    )
    return NormSilu(g, float(norm.scale), float(norm.bias)) if ok else None


# --- call-site helpers (diffusers' cached-conv blocks) -------------------------


def cached_conv(
    ops: OpSet,
    conv: Any,
    x: torch.Tensor,
    feat_cache: list,
    feat_idx: list,
    norm: NormSilu | None = None,
    *,
    bias: bool = True,
) -> torch.Tensor:
    """One diffusers call site: snapshot the cache, run the conv with the old one, store the new one."""
    idx = feat_idx[0]
    out, nxt = ops.causal_conv(conv, x, feat_cache[idx], tuple(conv._padding), norm=norm, bias=bias)
    feat_cache[idx] = nxt
    feat_idx[0] += 1
    return out


def norm_silu_cached_conv(
    ops: OpSet,
    norm: Any,
    act: Any,
    conv: Any,
    x: torch.Tensor,
    feat_cache: list,
    feat_idx: list,
    *,
    x_bias: torch.Tensor | None = None,
    defer_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """conv(SiLU(norm(x + x_bias))) at a call site: (output, the conv's bias when it was left
    out for the caller to add, else None). The norm goes into the op when it is the standard
    one, and ``x_bias`` (a previous conv's deferred bias) with it."""
    pending = conv.bias if defer_bias and conv.bias is not None else None
    spec = norm_silu_spec(norm, act, x)
    if spec is None:
        if x_bias is not None:
            x = x + x_bias.view(1, -1, 1, 1, 1)
        out = cached_conv(ops, conv, act(norm(x)), feat_cache, feat_idx, bias=pending is None)
    else:
        spec = dataclasses.replace(spec, x_bias=x_bias) if x_bias is not None else spec
        out = cached_conv(ops, conv, x, feat_cache, feat_idx, norm=spec, bias=pending is None)
    return out, pending


# --- the forwards ------------------------------------------------------------------


def causal_conv_forward(self: Any, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """WanCausalConv3d.forward: [cache | x] + zero padding, then the conv."""
    if not _op_path_ok(x):
        return type(self).forward(self, x, cache_x)
    ops = ops_for(self)
    pad = tuple(self._padding)
    if cache_x is not None and pad[4] > 0:
        cache_x = cache_x.to(x.device)
    padded, _ = ops.causal_pad(x, cache_x, pad, emit_cache=False)
    return ops.conv3d(self, padded)


def resblock_forward(self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]) -> torch.Tensor:  # noqa: B006 (diffusers' signature)
    """WanResidualBlock.forward with a cache (norm1+SiLU -> conv1, norm2+SiLU -> conv2, + shortcut)."""
    if feat_cache is None or not _op_path_ok(x) or (self.dropout.training and self.dropout.p != 0.0):
        return type(self).forward(self, x, feat_cache, feat_idx)
    ops = ops_for(self)
    h = self.conv_shortcut(x)
    act, defer = self.nonlinearity, ops.defers_bias_for(x)
    x, b1 = norm_silu_cached_conv(ops, self.norm1, act, self.conv1, x, feat_cache, feat_idx, defer_bias=defer)
    x, b2 = norm_silu_cached_conv(ops, self.norm2, act, self.conv2, x, feat_cache, feat_idx, x_bias=b1, defer_bias=defer)
    return ops.residual_add(x, h) if b2 is None else ops.residual_add(x, h, b2)


def decoder_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: bool = False  # noqa: B006
) -> torch.Tensor:
    """WanDecoder3d.forward with a cache: conv_in, mid block, up blocks, norm_out+SiLU -> conv_out."""
    if feat_cache is None or not _op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    ops = ops_for(self)
    x = cached_conv(ops, self.conv_in, x, feat_cache, feat_idx)
    x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    for up_block in self.up_blocks:
        x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    x, _ = norm_silu_cached_conv(ops, self.norm_out, self.nonlinearity, self.conv_out, x, feat_cache, feat_idx)
    return x


def resample_forward(self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]) -> torch.Tensor:  # noqa: B006
    """WanResample.forward for upsample2d/upsample3d (time_conv with the "Rep" marker, frame interleave)."""
    if self.mode not in ("upsample2d", "upsample3d") or not _op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    ops = ops_for(self)
    b, c, t, h, w = x.size()
    interleave = False
    if self.mode == "upsample3d" and feat_cache is not None:
        idx = feat_idx[0]
        prev = feat_cache[idx]
        if prev is None:
            feat_cache[idx] = "Rep"
            feat_idx[0] += 1
        else:
            rep = isinstance(prev, str)
            padded, nxt = ops.causal_conv_input(
                x, None if rep else prev.to(x.device), tuple(self.time_conv._padding), zero_history=rep
            )
            x = ops.conv3d(self.time_conv, padded)
            feat_cache[idx] = nxt
            feat_idx[0] += 1
            interleave = True
    images = ops.upsample2x(x, interleave)
    y = ops.conv2d(self.resample[1], images)
    t_out = t * 2 if interleave else t
    return y.view(b, t_out, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4)


def res_up_block_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: bool = False  # noqa: B006
) -> torch.Tensor:
    """WanResidualUpBlock.forward: resnets, upsampler, + DupUp3D(x) shortcut."""
    if not _op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    ops = ops_for(self)
    # the blocks below never write into x, so a dense x can serve as the shortcut
    # source directly (a clone would keep its strides, hence the same bytes)
    x_copy = x if is_dense(x) else x.clone()
    for resnet in self.resnets:
        x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else resnet(x)
    if self.upsampler is not None:
        x = self.upsampler(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else self.upsampler(x)
    sc = self.avg_shortcut
    if sc is not None:
        x = ops.dupup_add(x, x_copy, sc.factor_t, sc.factor_s, bool(first_chunk))
    return x
