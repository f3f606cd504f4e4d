"""The Wan decoder on one spatial shard: the one decoder tree with halo-exchanging ops.

`decoder_forward` walks `vaed.patches.tree` -- the same bodies a one-GPU
decode runs -- with `shard_ops(ctx)`: the precision's op set with halo
exchange at the sites that read across the split. It reads the module's
weights and never replaces a forward, so the same loaded model serves sharded
and one-GPU sessions side by side, and a one-GPU session stays bit-identical
to stock.

Per site, on a shard that owns rows [a, b) of the split axis (see plan.py):

- causal 3-D conv inputs (conv_in, both convs of every residual block,
  conv_out): the op set's builder makes [cache | frames] with the conv's own
  zero padding (1 row each side of the split axis too) in its one pass, then
  `fill_halo` writes the neighbours' boundary rows over the zero rows at
  interior edges, and the conv runs unpadded. The conv's cache holds the
  rank's own (unhaloed) frames, like one GPU's; the halo rows of the cached
  frames are sent again with the new ones (edge rows only, no extra pass over
  the feature map: a `cat` per conv cost a full copy of every conv input).
  Where WanRMS_norm + SiLU feeds the conv, the norm runs inside the builder
  and the normed rows are exchanged (it is per pixel, so they are the rows the
  neighbour would compute; zero rows stay zero because the Wan norms have no
  bias).
- the 3x3 Conv2d after each nearest upsample: runs on the shard with its zero
  padding, then its output rows at interior edges are recomputed from thin
  strips with the neighbours' rows (`conv2d`).
- the mid-block attention (full spatial attention per frame): computed on
  the all-gathered feature map, then sliced back to the shard (`attention`).
- the upsample time_conv (3x1x1) and the 1x1x1 shortcut convs (no spatial
  pad: their builders exchange nothing), the nearest 2x upsample, DupUp3D and
  the per-pixel RMS norms: local.

The cache list has the layout diffusers' own loop would give (same indices,
same "Rep" marker for the first upsample3d call): the tree writes it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vaed.patches import tree
from vaed.patches.ops import CausalPadOp, OpSet, PadTuple, unfused_norm_causal_conv
from vaed.patches.versions import diffusers_unverified_reason

from ..choices import SpatialAxis
from .comm import (
    all_gather_along,
    exchange_edges,
    exchange_halo,
    fill_halo,
    memory_format_of,
)
from .plan import ShardPlan


@dataclass(frozen=True)
class ShardContext:
    """What a sharded decode needs: the group, this rank, the plan and the one-device op set."""

    group: dist.ProcessGroup | None
    rank: int
    plan: ShardPlan
    ops: OpSet  # the precision's one-device op set; shard_ops adds the halo exchange

    @property
    def dim(self) -> int:
        return self.plan.dim

    def halo(self, x: torch.Tensor, halo: int) -> torch.Tensor:
        return exchange_halo(x, self.dim, self.group, halo)

    def level_sizes(self, x: torch.Tensor) -> tuple[int, ...]:
        """Every rank's extent at x's level (shards scale together: 2x per upsample)."""
        scale, rem = divmod(x.shape[self.dim], self.plan.sizes[self.rank])
        if rem:
            raise RuntimeError(f"shard extent {x.shape[self.dim]} is not a multiple of its latent extent")
        return self.plan.scaled(scale)


# --- ops with a halo -------------------------------------------------------------------


def _split_halo(ctx: ShardContext, pad: tuple[int, ...]) -> int:
    """The conv's padding along the split axis: the halo its neighbours fill ('same' convs, checked)."""
    pw0, _, ph0, _, _, _ = pad
    return ph0 if ctx.plan.axis == SpatialAxis.HEIGHT else pw0


def conv2d(ctx: ShardContext, conv: nn.Conv2d, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
    """A 3x3 stride-1 Conv2d on images [N, C, H, W] of the shard.

    The conv runs on the shard itself with its own zero padding; only the `halo`
    output rows at each interior edge read a neighbour's rows, so those are
    recomputed from thin strips [neighbour rows | own rows]. Building the whole
    haloed image instead (a `cat` per conv) took 26 % of a sharded 720x1280x81
    decode on two H200s: these images are the decoder's largest tensors.
    """
    assert not isinstance(conv.padding, str)  # check_shardable admits numeric 'same' paddings only
    ph, pw = conv.padding
    dim = ctx.dim
    halo, strip_padding = (ph, (0, pw)) if ctx.plan.axis == SpatialAxis.HEIGHT else (pw, (ph, 0))
    n = x.shape[dim]

    def run(inp: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
        return F.conv2d(inp, conv.weight, conv.bias if bias else None, conv.stride, padding, conv.dilation, conv.groups)

    if halo and n < 2 * halo:  # a strip would need rows beyond this shard: build the haloed image
        return run(ctx.halo(x, halo), strip_padding)
    y = run(x, (ph, pw))
    if not halo:
        return y
    lo, hi = exchange_edges(x, dim, ctx.group, halo)
    if lo is not None:  # output rows [0, halo) read rows [-halo, 2 * halo)
        y.narrow(dim, 0, halo).copy_(run(torch.cat([lo, x.narrow(dim, 0, 2 * halo)], dim), strip_padding))
    if hi is not None:  # output rows [n - halo, n) read rows [n - 2 * halo, n + halo)
        strip = torch.cat([x.narrow(dim, n - 2 * halo, 2 * halo), hi], dim)
        y.narrow(dim, n - halo, halo).copy_(run(strip, strip_padding))
    return y


def attention(ctx: ShardContext, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """WanAttentionBlock over the whole frame: gather, attend (same bytes on every rank), slice."""
    sizes = ctx.level_sizes(x)
    full = all_gather_along(x, ctx.dim, sizes, ctx.group)
    y = attn(full)
    start = sum(sizes[: ctx.rank])
    # dense again in x's layout: a narrowed channels_last tensor is neither layout, and the
    # convs after it would fall back to contiguous (latent-level size: a cheap copy)
    return y.narrow(ctx.dim, start, sizes[ctx.rank]).contiguous(memory_format=memory_format_of(x))


# --- the sharded op set and the one decoder tree ----------------------------------------


def _halo_filled(ctx: ShardContext, build: CausalPadOp) -> CausalPadOp:
    """A conv-input builder whose zero rows at interior edges then carry the neighbours' rows."""

    def op(
        x: torch.Tensor, cache: torch.Tensor | None, pad: PadTuple, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        padded, nxt = build(x, cache, pad, **kw)
        fill_halo(padded, ctx.dim, ctx.group, _split_halo(ctx, pad))  # no-op for convs without a spatial pad
        return padded, nxt

    return op


def shard_ops(ctx: ShardContext) -> OpSet:
    """The shard's op set: ctx.ops with halo exchange at the sites that read across the split.
    The fused norm conv is off (its input must be halo-filled before the conv), biases stay
    in their convs (the sharded path never deferred them) and a first chunk keeps its whole
    conv3d (the cut form is judged per signature on one device, never measured sharded)."""
    inner = ctx.ops
    return dataclasses.replace(
        inner,
        name=f"{inner.name}-sharded",
        causal_pad=_halo_filled(ctx, inner.causal_pad),
        norm_causal_pad=_halo_filled(ctx, inner.norm_causal_pad),
        norm_causal_conv=unfused_norm_causal_conv,
        conv2d=functools.partial(conv2d, ctx),
        attention=functools.partial(attention, ctx),
        defer_bias=frozenset(),
        cut_first_frame=frozenset(),
    )


def decoder_forward(
    ctx: ShardContext, decoder: Any, x: torch.Tensor, cache: list[Any], first_chunk: bool
) -> torch.Tensor:
    """One latent frame [B, z, 1, h_shard, w] (post_quant_conv'd) -> decoder output of the shard.
    Strict: a module the tree does not port would run without its halo, so it raises."""
    return tree.decode(shard_ops(ctx), decoder, x, cache, first_chunk, strict=True)


# --- eligibility (once per model) ----------------------------------------------------------


def check_shardable(decoder: nn.Module) -> None:
    """Raise TypeError/ValueError unless every module of `decoder` is one the tree ports exactly,
    with a diffusers whose forwards the tree was verified against."""
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    if not isinstance(decoder, W.WanDecoder3d):
        raise TypeError(f"spatial sharding needs a WanDecoder3d, got {type(decoder).__name__}")
    reason = diffusers_unverified_reason()
    if reason is not None:
        raise ValueError(f"spatial sharding runs the ported forwards only: {reason}")
    if not isinstance(decoder.nonlinearity, nn.SiLU):
        raise TypeError("spatial sharding needs SiLU activations")
    for name, m in decoder.named_modules():
        if isinstance(m, W.WanCausalConv3d):
            pw0, pw1, ph0, ph1, _, _ = m._padding
            _, kh, kw = m.kernel_size
            if (pw0, pw1) != ((kw - 1) // 2,) * 2 or (ph0, ph1) != ((kh - 1) // 2,) * 2 or m.stride[1:] != (1, 1):
                raise ValueError(
                    f"{name}: causal conv {m.kernel_size} with padding {m._padding} is not 'same' spatially"
                )
        elif isinstance(m, W.WanResample):
            if m.mode not in ("upsample2d", "upsample3d"):
                raise ValueError(f"{name}: resample mode {m.mode!r} is not supported on shards")
            resample: Any = m.resample  # (Upsample, Conv2d); diffusers' modules carry no type hints
            c2 = resample[1]
            k = c2.kernel_size
            if c2.stride != (1, 1) or c2.padding != ((k[0] - 1) // 2, (k[1] - 1) // 2) or c2.padding_mode != "zeros":
                raise ValueError(f"{name}: image conv {k} stride {c2.stride} padding {c2.padding} is not 'same'")
            up = resample[0]
            if getattr(up, "mode", None) != "nearest-exact" or tuple(up.scale_factor) != (2.0, 2.0):
                raise ValueError(f"{name}: only the nearest-exact 2x upsample is supported")
            if not tree.resample_ok(m):
                raise ValueError(f"{name}: the upsample is not one the decoder tree ports")
        elif isinstance(m, W.WanRMS_norm):
            if not m.channel_first or not isinstance(m.bias, float) or m.bias != 0.0:
                raise ValueError(f"{name}: RMS norm must be channel-first without bias (zero halo rows stay zero)")
        elif isinstance(m, W.WanResidualBlock) and m.dropout.training and m.dropout.p > 0:
            raise ValueError(f"{name}: dropout is active; put the model in eval mode")
