"""The installed forwards: diffusers' Wan decoder and encoder forwards entering the one tree.

Each function replaces one private diffusers forward on a module instance
(:mod:`vaed.patches.table` says which) and does two things only: decide
whether the op-set path applies, and enter the tree (:mod:`vaed.patches.tree`)
with the op set of the current call (:mod:`vaed.patches.context`). With
``REFERENCE_OPS`` every forward computes exactly the stock aten chain, which
the CPU tests check against an unpatched decoder with ``torch.equal``.

A forward runs the stock class forward instead (its whole-call fallback) when
the op set path does not apply: autograd on (stock keeps its exact graph),
torch.compile tracing, no causal cache (``feat_cache=None``) for the cached
blocks, or a module configuration the port does not cover (active dropout, a
non-default norm).

What leaves an entry is a plain tensor: a bias still pending at the output is
added first (:meth:`~vaed.patches.tree.Act.settled`). A resample entered on
its own runs without deferring, as its image conv is its last op.
"""

from __future__ import annotations

from typing import Any

import torch

from vaed.patches import tree
from vaed.patches.context import ops_for
from vaed.patches.tree import Act, Walk, op_path_ok


def _walk(self: Any, x: torch.Tensor, feat_cache: list | None, feat_idx: list, first_chunk: Any = None) -> Walk:
    ops = ops_for(self)
    return Walk(ops, feat_cache, feat_idx, first_chunk, defer=ops.deferred_bias_sites(x))


def causal_conv_forward(self: Any, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """WanCausalConv3d.forward: [cache | x] + zero padding, then the conv."""
    if not op_path_ok(x):
        return type(self).forward(self, x, cache_x)
    return tree.causal_conv(ops_for(self), self, x, cache_x)


def resblock_forward(self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]) -> torch.Tensor:
    """WanResidualBlock.forward with a cache."""
    if feat_cache is None or not op_path_ok(x) or not tree.dropout_off(self):
        return type(self).forward(self, x, feat_cache, feat_idx)
    return tree.residual_block(_walk(self, x, feat_cache, feat_idx), self, Act(x)).settled()


def decoder_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: bool = False
) -> torch.Tensor:
    """WanDecoder3d.forward with a cache."""
    if feat_cache is None or not op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    return tree.decoder(_walk(self, x, feat_cache, feat_idx, first_chunk), self, x)


def encoder_forward(self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]) -> torch.Tensor:
    """WanEncoder3d.forward with a cache."""
    if feat_cache is None or not op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    return tree.encoder(_walk(self, x, feat_cache, feat_idx), self, x)


def resample_forward(self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]) -> torch.Tensor:
    """WanResample.forward for upsample2d/upsample3d and downsample2d/downsample3d."""
    if not tree.resample_ok(self) or not op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    w = Walk(ops_for(self), feat_cache, feat_idx, None, defer=frozenset())
    return tree.resample(w, self, Act(x)).settled()


def up_block_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: Any = None
) -> torch.Tensor:
    """WanUpBlock.forward (Wan2.1). The decoder walks its up blocks itself, carrying each
    upsampler's bias into the next block; entered alone, the bias is added before it leaves."""
    if not op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    return tree.up_block(_walk(self, x, feat_cache, feat_idx, first_chunk), self, Act(x)).settled()


def res_up_block_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0], first_chunk: bool = False
) -> torch.Tensor:
    """WanResidualUpBlock.forward (Wan2.2)."""
    if not op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    return tree.residual_up_block(_walk(self, x, feat_cache, feat_idx, first_chunk), self, Act(x)).settled()


def res_down_block_forward(
    self: Any, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list = [0]
) -> torch.Tensor:
    """WanResidualDownBlock.forward (Wan2.2)."""
    if not op_path_ok(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    return tree.residual_down_block(_walk(self, x, feat_cache, feat_idx), self, Act(x)).settled()
