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
from vaed.patches.derived import derived
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
    return resblock_steps(self, x, feat_cache, feat_idx)


def resblock_steps(
    self: Any, x: torch.Tensor, feat_cache: list, feat_idx: list, x_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``resblock_forward``'s body for ``x + x_bias``, where ``x_bias`` is the producing conv's
    bias left out of it (None: none pending). With deferred biases (``OpSet.defer_bias``)
    conv1's bias goes to norm2, and conv2's, the shortcut conv's and a pending one reaching the
    output through the shortcut all go to the residual add, as one fp32 vector."""
    ops = ops_for(self)
    defer = x_bias is not None or ops.defers_bias_for(x)
    h, h_bias = _shortcut(ops, self.conv_shortcut, x, x_bias, defer)
    act = self.nonlinearity
    x, b1 = norm_silu_cached_conv(ops, self.norm1, act, self.conv1, x, feat_cache, feat_idx, x_bias=x_bias, defer_bias=defer)
    x, b2 = norm_silu_cached_conv(ops, self.norm2, act, self.conv2, x, feat_cache, feat_idx, x_bias=b1, defer_bias=defer)
    bias = b2 if h_bias is None else h_bias if b2 is None else (  # one vector, summed once
        derived(self, "residual_bias", (b2, h_bias), lambda: _opmath(b2) + _opmath(h_bias))
    )
    return ops.residual_add(x, h) if bias is None else ops.residual_add(x, h, bias)


def _shortcut(
    ops: OpSet, sc: nn.Module, x: torch.Tensor, x_bias: torch.Tensor | None, defer: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual block's shortcut of ``x + x_bias``: (output, bias still to add or None).
    A 1x1x1 conv shortcut runs without its bias when deferring: sc(x + b) = sc_nobias(x) +
    (bias + W @ b), exactly in real arithmetic, since no padding mixes in zeros."""
    if isinstance(sc, nn.Identity):
        return x, x_bias
    pointwise = (
        defer
        and _runs(sc, causal_conv_forward)
        and sc.bias is not None
        and sc.weight.shape[2:] == (1, 1, 1)
        and not any(sc._padding)
        and sc.groups == 1
    )
    if not pointwise:
        return sc(_add_bias(x, x_bias)), None
    h = ops.conv3d(sc, x, bias=False)  # no padding: the conv input is x itself
    if x_bias is None:
        return h, sc.bias
    w, b = sc.weight, sc.bias
    return h, derived(sc, "shortcut_bias", (w, b, x_bias), lambda: _opmath(b) + _opmath(w.flatten(1)) @ _opmath(x_bias))


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the precision aten computes its elementwise ops in (fp32 for half dtypes)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` with a deferred per-channel bias added as the conv would have (aten, one rounding)."""
    return x if bias is None else x + bias.view(1, -1, *([1] * (x.dim() - 2)))


def _runs(module: nn.Module, forward: Any) -> bool:
    """Whether ``module`` runs this module's ``forward`` (the installer bound it on the instance),
    so its body may be called directly with a pending bias."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is forward


def decoder_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: bool = False  # noqa: B006
) -> torch.Tensor:
    """WanDecoder3d.forward with a cache: conv_in, mid block, up blocks, norm_out+SiLU -> conv_out."""
    if feat_cache is None or not _op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    ops = ops_for(self)
    x = cached_conv(ops, self.conv_in, x, feat_cache, feat_idx)
    x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    pending: torch.Tensor | None = None  # an upsampler's conv bias, left to the next block
    for up_block in self.up_blocks:
        if _runs(up_block, up_block_forward):
            x, pending = up_block_steps(up_block, x, feat_cache, feat_idx, pending)
        else:
            x = up_block(_add_bias(x, pending), feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
            pending = None
    x, _ = norm_silu_cached_conv(
        ops, self.norm_out, self.nonlinearity, self.conv_out, x, feat_cache, feat_idx, x_bias=pending
    )
    return x


def resample_forward(self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]) -> torch.Tensor:  # noqa: B006
    """WanResample.forward for upsample2d/upsample3d (time_conv with the "Rep" marker, frame interleave)."""
    if self.mode not in ("upsample2d", "upsample3d") or not _op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    y, _ = resample_steps(self, x, feat_cache, feat_idx, defer_bias=False)
    return y


def resample_steps(
    self: Any, x: torch.Tensor, feat_cache: list | None, feat_idx: list, *, defer_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``resample_forward``'s body: (output, the image conv's bias when ``defer_bias`` left it
    out for the caller's next op to add, else None)."""
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
    conv = self.resample[1]
    pending = conv.bias if defer_bias else None
    y = ops.conv2d(conv, images) if pending is None else ops.conv2d(conv, images, bias=False)
    t_out = t * 2 if interleave else t
    return y.view(b, t_out, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4), pending


def up_block_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: Any = None  # noqa: B006
) -> torch.Tensor:
    """WanUpBlock.forward (Wan2.1): resnets, then the upsampler. Run alone it defers nothing
    out of the block; ``decoder_forward`` calls ``up_block_steps`` to carry the upsampler's
    bias into the next block."""
    if not _op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    x, pending = up_block_steps(self, x, feat_cache, feat_idx, None)
    return _add_bias(x, pending)


def up_block_steps(
    self: Any, x: torch.Tensor, feat_cache: list | None, feat_idx: list, x_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``up_block_forward``'s body for ``x + x_bias``: (output, its pending bias or None). The
    first resnet takes ``x_bias`` into its norm and residual add; the upsampler leaves its image
    conv's bias pending when the op set defers biases and the next block can take it."""
    for resnet in self.resnets:
        if feat_cache is not None and x_bias is not None and _runs(resnet, resblock_forward) and _op_path_ok(x):
            x = resblock_steps(resnet, x, feat_cache, feat_idx, x_bias)
        elif feat_cache is not None:
            x = resnet(_add_bias(x, x_bias), feat_cache=feat_cache, feat_idx=feat_idx)
        else:
            x = resnet(_add_bias(x, x_bias))
        x_bias = None
    x = _add_bias(x, x_bias)  # no resnets (not in Wan2.1): nothing took it
    if self.upsamplers is None:
        return x, None
    up = self.upsamplers[0]
    if _runs(up, resample_forward) and _op_path_ok(x):
        return resample_steps(up, x, feat_cache, feat_idx, defer_bias=ops_for(up).defers_bias_for(x))
    return (up(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else up(x)), None


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
    pending = None  # the upsampler's image conv bias, left to the DupUp3D add
    up, sc = self.upsampler, self.avg_shortcut
    if up is not None and sc is not None and _runs(up, resample_forward) and ops.defers_bias_for(x):
        x, pending = resample_steps(up, x, feat_cache, feat_idx, defer_bias=True)
    elif up is not None:
        x = up(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else up(x)
    if sc is not None:
        first = bool(first_chunk)
        x = ops.dupup_add(x, x_copy, sc.factor_t, sc.factor_s, first) if pending is None else (
            ops.dupup_add(x, x_copy, sc.factor_t, sc.factor_s, first, bias=pending)
        )
    return x
