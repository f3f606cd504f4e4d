"""Fused Triton ops for the Wan causal decoder and encoder.

One op per module, each with a launcher that returns None for inputs it does
not handle (the caller then runs the stock aten chain) and a plain-torch
reference beside it. Triton is imported on first use only. Every op is
bit-exact against its reference except the fast tier's arithmetic:
``causal_pad_cl``'s ``norm_cl`` prologue, the one-pass RMS-norm+SiLU (see
causal_input_cl), and ``bias_residual_add``, one rounding for ``x + bias + h``
(its reference is its own arithmetic in plain torch, not stock's chain; with
``exact=True`` it rounds where stock does, the lossless tier's residual add).
"""

from vaed.kernels._runtime import interpreter_active, triton_available
from vaed.kernels.avgdown import avgdown_add, avgdown_add_ordered_reference, avgdown_add_reference
from vaed.kernels.causal_input import CACHE_T, causal_pad, causal_pad_reference, stock_layout_is_channels_last
from vaed.kernels.causal_input_cl import causal_pad_cl
from vaed.kernels.dupup import dupup_add, dupup_add_reference
from vaed.kernels.residual import bias_residual_add, bias_residual_add_reference
from vaed.kernels.rms_silu import NormSilu, norm_denominator, norm_denominator_reference, rms_silu_reference
from vaed.kernels.upsample import upsample_nearest2x, upsample_nearest2x_reference

__all__ = [
    "CACHE_T",
    "NormSilu",
    "avgdown_add",
    "avgdown_add_ordered_reference",
    "avgdown_add_reference",
    "bias_residual_add",
    "bias_residual_add_reference",
    "causal_pad",
    "causal_pad_cl",
    "causal_pad_reference",
    "dupup_add",
    "dupup_add_reference",
    "interpreter_active",
    "norm_denominator",
    "norm_denominator_reference",
    "rms_silu_reference",
    "stock_layout_is_channels_last",
    "triton_available",
    "upsample_nearest2x",
    "upsample_nearest2x_reference",
]
