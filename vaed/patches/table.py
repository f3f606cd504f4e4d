"""The patch table: which diffusers module class gets which forward, and which ops it calls.

Declared once, as data. The installer walks a decoder and an encoder, matches each module
against these rows (class name + an optional predicate on the instance) and
binds the row's forward on that instance; the report counts rows, and the
start-up checks cover exactly the ops the table names. Adding a forward or an
op means adding a row here, not editing the installer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from vaed.patches import forwards as fw
from vaed.patches import tree


@dataclass(frozen=True)
class PatchRow:
    cls: str  # diffusers class name in diffusers.models.autoencoders.autoencoder_kl_wan
    forward: Callable[..., Any]
    ops: tuple[str, ...]  # OpSet fields the forward calls (see vaed.patches.ops)
    label: str  # what the report calls it
    applies: Callable[[nn.Module], bool] = lambda m: True


PATCH_TABLE: tuple[PatchRow, ...] = (
    PatchRow("WanCausalConv3d", fw.causal_conv_forward, ("causal_pad", "conv3d"), "causal conv forward"),
    PatchRow(
        "WanDecoder3d",
        fw.decoder_forward,
        ("causal_pad", "norm_causal_pad", "conv3d", "norm_causal_conv"),
        "decoder (conv_in, norm_out+SiLU -> conv_out)",
    ),
    PatchRow(
        "WanEncoder3d",
        fw.encoder_forward,
        ("causal_pad", "norm_causal_pad", "conv3d", "norm_causal_conv"),
        "encoder (conv_in, norm_out+SiLU -> conv_out)",
    ),
    PatchRow(
        "WanResidualBlock",
        fw.resblock_forward,
        ("norm_causal_pad", "conv3d", "residual_add", "norm_causal_conv"),
        "residual block (norm+SiLU fused into both conv inputs)",
    ),
    PatchRow(
        "WanResample",
        fw.resample_forward,
        ("causal_pad", "conv3d", "upsample", "upsample_interleave", "conv2d"),
        "resample (upsample: time_conv 'Rep' aware, nearest 2x gather; downsample: stride-2 convs, time cache)",
        tree.resample_ok,
    ),
    PatchRow(
        "WanUpBlock",
        fw.up_block_forward,
        ("conv2d",),
        "up block (carries its upsampler's deferred conv bias into the next block)",
    ),
    PatchRow(
        "WanResidualUpBlock",
        fw.res_up_block_forward,
        ("dupup_add", "conv2d"),
        "residual up-block (DupUp3D shortcut add)",
    ),
    PatchRow(
        "WanResidualDownBlock",
        fw.res_down_block_forward,
        ("avgdown_add",),
        "residual down-block (AvgDown3D shortcut add)",
    ),
)


def ops_used() -> tuple[str, ...]:
    """Every op name some row calls, in table order."""
    seen: dict[str, None] = {}
    for row in PATCH_TABLE:
        for op in row.ops:
            seen.setdefault(op, None)
    return tuple(seen)


def row_for(module: nn.Module) -> PatchRow | None:
    """The table row for a module instance, or None.

    The class must be exactly the diffusers class (a subclass may override
    the very forward the row replaces).
    """
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    for row in PATCH_TABLE:
        if type(module) is getattr(W, row.cls, None) and row.applies(module):
            return row
    return None
