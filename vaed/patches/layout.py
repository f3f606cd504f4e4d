"""Decoder and encoder weight and activation layout (channels_last_3d or contiguous).

channels_last_3d changes cuDNN's algorithm, so "lossless" means
bit-identical to stock diffusers with the same weight layout; the layout is
chosen once per decoder and applied to weights here and to inputs by
:func:`to_decoder_layout`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from vaed.choices import Layout
from vaed.kernels._runtime import ORDER_CL3D, dense_strides


def resolve_layout(layout: str, device: torch.device) -> Layout:
    """CHANNELS_LAST or CONTIGUOUS (`auto` by device); a ValueError for an unknown name."""
    chosen = Layout.parse(layout, "layout")
    if chosen == Layout.AUTO:
        # channels_last_3d is where the fused kernels pay (1.20x vs 0.98x contiguous, H200)
        return Layout.CHANNELS_LAST if device.type == "cuda" else Layout.CONTIGUOUS
    return chosen


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` is dense in the row-major layout or its channels-last one (4-D or 5-D)."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return t.is_contiguous() or (fmt is not None and t.is_contiguous(memory_format=fmt))


@functools.lru_cache(maxsize=1024)
def clone_keeps_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``t.clone()`` of a tensor of this shape and strides keeps the strides (torch's
    preserve_format: ``t`` is dense in some order of its dims), asked of torch itself on a meta
    tensor; where it does, ``t`` holds the clone's bytes in the clone's layout."""
    return torch.empty_strided(shape, stride, device="meta").clone().stride() == stride


def to_decoder_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Make a 5-D activation channels_last_3d or contiguous ("auto": by device)."""
    if x.dim() != 5:
        raise ValueError(f"expected a 5-D tensor, got shape {tuple(x.shape)}")
    if resolve_layout(layout, x.device) == Layout.CHANNELS_LAST:
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x.contiguous()


def vae_parts(vae: nn.Module) -> list[nn.Module]:
    """The parts of a VAE that take the layout and the patch table: the decoder and
    post_quant_conv, and the encoder and quant_conv unless dropped (a decode-only load sets
    them to None)."""
    names = ("decoder", "post_quant_conv", "encoder", "quant_conv")
    return [m for m in (getattr(vae, n, None) for n in names) if m is not None]


def convert_conv3d_weights(vae: nn.Module, layout: str) -> int:
    """Put the Conv3d weights of the decoder, post_quant_conv and (when loaded) the encoder and
    quant_conv in ``layout``; returns how many."""
    fmt = torch.channels_last_3d if layout == Layout.CHANNELS_LAST else torch.contiguous_format
    n = 0
    for root in vae_parts(vae):
        for m in root.modules():
            if isinstance(m, nn.Conv3d):
                # in-place .data swap: same Parameter object, name and state_dict key
                m.weight.data = m.weight.data.contiguous(memory_format=fmt)
                n += 1
    return n


def conv_reads_channels_last(conv: nn.Module, x: torch.Tensor) -> bool:
    """Whether torch runs ``conv`` on ``x``'s device channels_last_3d whatever its input's
    layout: cuDNN does where the weight is channels_last_3d (torch copies any other input to
    that layout before the conv), so a conv input written channels-last gives the same call."""
    w = getattr(conv, "weight", None)
    return (
        x.is_cuda and isinstance(w, torch.Tensor) and w.dim() == 5
        and torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()
        and _channels_last_3d_strides(tuple(w.shape), tuple(w.stride()))
    )


@functools.lru_cache(maxsize=256)
def _channels_last_3d_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    # the exact dense strides, size-1 dims' too: a contiguous 1x1x1 weight is also
    # channels-last "contiguous" to is_contiguous, and torch's convs read it as NCDHW
    return stride == dense_strides(shape, ORDER_CL3D)
