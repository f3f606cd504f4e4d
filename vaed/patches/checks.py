"""Start-up checks: every op of an op set against its plain-torch reference, on the device.

Each op that differs from ``REFERENCE_OPS`` runs a few tiny cases (both
layouts, cache / no cache, asymmetric padding, the "Rep" marker, the
interleave, first and later DupUp3D and AvgDown3D chunks, AvgDown3D's group
sizes 1, 2, 4 and 8, deferred conv biases) in the decoder's dtype. A
:class:`~vaed.patches.ops.FusedOp` is checked through its kernel alone, so a
kernel that silently declined would fail rather than pass on its fallback.
Exact op sets compare with ``torch.equal`` and equal strides; lossy ones (and
any op set on a CPU under the Triton interpreter, whose exp is numpy's and
whose bf16 cast truncates) with a dtype-scaled tolerance, and a lossy op may
return another dense layout than aten's. A failing op is
reported by name; the installer switches that op alone to its reference.

An exact set that defers conv biases rests on one more fact, checked by
:func:`check_bias_deferral`: that torch's conv with its bias gives the bytes
of the conv without it plus an aten add of the bias (torch adds a cuDNN
conv's bias in a pass of its own). Where it does not hold, the set keeps
every bias in its conv.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from vaed.patches.layout import is_dense
from vaed.patches.ops import OP_NAMES, REFERENCE_OPS, FusedOp, NormSilu, OpSet

log = logging.getLogger(__name__)

CL = torch.channels_last_3d
Case = tuple[tuple[Any, ...], dict[str, Any]]

# (atol, rtol) for lossy op sets and interpreter runs: a few roundings of the dtype
# (bf16 has 8 mantissa bits: 2^-8 = 0.4 % per rounding; stock rounds up to 4 times
# in the norm chain, the interpreter truncates) on activations of order 1
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (2e-2, 4e-2),
    torch.float16: (2e-3, 5e-3),
    torch.float32: (1e-5, 1e-4),
}


def _t(shape: tuple[int, ...], g: torch.Generator, device: torch.device, dtype: torch.dtype, cl: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    if x.dim() == 5:
        return x.contiguous(memory_format=CL) if cl else x.contiguous()
    return x


def _cases(name: str, device: torch.device, dtype: torch.dtype) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    cases: list[Case] = []
    if name in ("causal_pad", "norm_causal_pad"):
        norm = None
        if name == "norm_causal_pad":
            gamma = (torch.rand(6, 1, 1, 1, generator=g) + 0.5).to(device=device, dtype=dtype)
            norm = NormSilu(gamma, 6**0.5, 0.0)
        for cl in (True, False):
            x = _t((1, 6, 2, 3, 5), g, device, dtype, cl)
            one = _t((1, 6, 1, 3, 5), g, device, dtype, cl)
            cache = _t((1, 6, 2, 3, 5), g, device, dtype, cl)
            cases.append(((x, cache, (1, 1, 1, 1, 2, 0)), {"norm": norm}))
            cases.append(((one, cache[:, :, 1:], (0, 1, 1, 0, 2, 0)), {"norm": norm}))  # one-sided (shard edge)
            cases.append(((x, None, (1, 1, 1, 1, 2, 0)), {"norm": norm, "emit_cache": False}))
            if norm is None:
                cases.append(((one, None, (0, 0, 0, 0, 2, 0)), {"zero_history": True}))
            else:  # a deferred conv bias, added before the norm
                x_bias = torch.randn(6, generator=g).to(device=device, dtype=dtype)
                cases.append(((x, cache, (1, 1, 1, 1, 2, 0)), {"norm": NormSilu(gamma, 6**0.5, 0.0, x_bias)}))
    elif name in ("upsample", "upsample_interleave"):
        for cl in (True, False):
            cases.append(((_t((1, 4, 2, 3, 5), g, device, dtype, cl), name == "upsample_interleave"), {}))
        time_bias = torch.randn(4, generator=g).to(device=device, dtype=dtype)  # the time_conv's deferred bias
        cases.append(((_t((1, 4, 2, 3, 5), g, device, dtype, True), name == "upsample_interleave", time_bias), {}))
    elif name == "dupup_add":
        for first in (False, True):
            src = _t((1, 4, 2, 3, 4), g, device, dtype, True)
            for cl in (True, False):
                main = _t((1, 2, 3 if first else 4, 6, 8), g, device, dtype, cl)
                cases.append(((main, src, 2, 2, first), {}))
            up_bias = torch.randn(2, generator=g).to(device=device, dtype=dtype)  # an upsampler's deferred bias
            main = _t((1, 2, 3 if first else 4, 6, 8), g, device, dtype, True)
            cases.append(((main, src, 2, 2, first), {"bias": up_bias}))
    elif name == "avgdown_add":
        # Wan2.2's shortcuts: time and space (a first chunk's one frame is padded), space only,
        # at group sizes 4 and 2 (4 -> 8 channels), 8 (8 -> 8) and 1 (no downsampling)
        shortcuts = ((4, 2, 2, 1), (4, 2, 2, 4), (4, 2, 1, 2), (8, 2, 2, 1), (8, 2, 2, 4), (8, 1, 1, 2))
        for src_c, fs, ft, frames in shortcuts:  # (source channels, factor_s, factor_t, frames)
            for cl in (True, False):
                src = _t((1, src_c, frames, 4, 6), g, device, dtype, cl)
                main = _t((1, 8, (frames + ft - 1) // ft, 4 // fs, 6 // fs), g, device, dtype, cl)
                cases.append(((main, src, ft, fs, 8), {}))
    elif name == "conv3d":
        conv = nn.Conv3d(6, 4, 3).to(device=device, dtype=dtype)
        conv.weight.data = conv.weight.data.contiguous(memory_format=CL)
        cases.append(((conv, _t((1, 6, 4, 5, 7), g, device, dtype, True)), {}))
        cases.append(((conv, _t((1, 6, 4, 5, 7), g, device, dtype, True)), {"bias": False}))
    elif name == "conv2d":
        conv2 = nn.Conv2d(4, 4, 3, padding=1).to(device=device, dtype=dtype)
        cases.append(((conv2, _t((2, 4, 5, 7), g, device, dtype, False)), {}))
        cases.append(((conv2, _t((2, 4, 5, 7), g, device, dtype, False)), {"bias": False}))
    elif name == "norm_causal_conv":
        # channels_last_3d (the decoder's layout), cache and first chunk; CUDA and half dtypes
        # only: the fused conv declines elsewhere by design (vaed.patches.fast.UNFOLD_DTYPES)
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            return []
        gamma = (torch.rand(6, 1, 1, 1, generator=g) + 0.5).to(device=device, dtype=dtype)
        conv3 = nn.Conv3d(6, 6, 3).to(device=device, dtype=dtype)
        conv3.weight.data = conv3.weight.data.contiguous(memory_format=CL)
        norm = NormSilu(gamma, 6**0.5, 0.0)
        x = _t((1, 6, 2, 3, 5), g, device, dtype, True)
        cache = _t((1, 6, 2, 3, 5), g, device, dtype, True)
        cases.append(((conv3, x, cache, (1, 1, 1, 1, 2, 0)), {"norm": norm}))
        cases.append(((conv3, x[:, :, :1], None, (1, 1, 1, 1, 2, 0)), {"norm": norm}))
        x_bias = torch.randn(6, generator=g).to(device=device, dtype=dtype)
        deferred = NormSilu(gamma, 6**0.5, 0.0, x_bias)
        cases.append(((conv3, x, cache, (1, 1, 1, 1, 2, 0)), {"norm": deferred, "bias": False}))
    elif name == "residual_add":
        # no bias, conv2's (x's dtype), several summed (fp32)
        for bias_dtype in (None, dtype, torch.float32):
            bias = None if bias_dtype is None else torch.randn(4, generator=g).to(device=device, dtype=bias_dtype)
            x, h = _t((1, 4, 2, 3, 5), g, device, dtype, True), _t((1, 4, 2, 3, 5), g, device, dtype, True)
            cases.append(((x, h) if bias is None else (x, h, bias), {}))
    else:  # pragma: no cover - OP_NAMES and this function move together
        raise ValueError(f"no start-up check for op {name!r}")
    return cases


def _compare(got: Any, want: Any, exact: bool, same_layout: bool = True) -> str | None:
    """None when ``got`` matches ``want`` (structure, shape, dtype, strides, then values)."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return "returned a different structure than the reference"
        for a, b in zip(got, want, strict=True):  # lengths checked above
            why = _compare(a, b, exact, same_layout)
            if why:
                return why
        return None
    if want is None or got is None:
        return None if got is want else "returned None where the reference returns a tensor (or back)"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(want.shape)}/{want.dtype}"
    if got.stride() != want.stride() and (same_layout or not is_dense(got)):
        # a lossy op may hand out the same values in another dense layout (the fast tier's
        # channels-last upsample); an exact one keeps aten's strides
        return f"strides {got.stride()} != {want.stride()}"
    if exact:
        return None if torch.equal(got, want) else "values differ from the reference (torch.equal)"
    atol, rtol = TOLERANCE.get(want.dtype, (0.0, 0.0))
    try:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    except AssertionError as e:
        return "values outside tolerance: " + str(e).splitlines()[0]
    return None


def check_op(ops: OpSet, name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``ops.<name>`` matches the reference on every case, else the reason."""
    op: Callable[..., Any] = getattr(ops, name)
    ref: Callable[..., Any] = getattr(REFERENCE_OPS, name)
    run = op.kernel if isinstance(op, FusedOp) else op
    if name == "norm_causal_conv":
        # unfused (None) by design in the reference: compare the whole norm site, fused when it is
        ref = REFERENCE_OPS.causal_conv
        run = op.kernel if isinstance(op, FusedOp) else ops.causal_conv
    exact = ops.exact and device.type == "cuda"
    try:
        with torch.no_grad():
            for i, (args, kwargs) in enumerate(_cases(name, device, dtype)):
                got = run(*args, **kwargs)
                if got is None:
                    return f"kernel declined start-up case {i}"
                why = _compare(got, ref(*args, **kwargs), exact, same_layout=ops.exact)
                if why:
                    return f"case {i}: {why}"
    except Exception as e:  # compile errors, driver issues, launch failures: the op is reported
        return f"{type(e).__name__}: {e}"
    return None


def check_bias_deferral(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when a Conv3d and a Conv2d with their biases equal (torch.equal) the convs without
    them followed by the bias add that the deferring readers reproduce."""
    g = torch.Generator().manual_seed(1)
    conv3 = nn.Conv3d(6, 4, 3).to(device=device, dtype=dtype)
    conv3.weight.data = conv3.weight.data.contiguous(memory_format=CL)
    conv2 = nn.Conv2d(4, 4, 3, padding=1).to(device=device, dtype=dtype)
    conv2.weight.data = conv2.weight.data.contiguous(memory_format=torch.channels_last)
    image = torch.randn(2, 4, 5, 7, generator=g).to(device=device, dtype=dtype)
    cases: tuple[tuple[nn.Conv3d | nn.Conv2d, torch.Tensor], ...] = (
        (conv3, _t((1, 6, 4, 5, 7), g, device, dtype, True)),
        (conv2, image.contiguous(memory_format=torch.channels_last)),
    )
    try:
        with torch.no_grad():
            for i, (conv, x) in enumerate(cases):
                want = conv(x)
                raw = conv._conv_forward(x, conv.weight, None)
                bias = cast(torch.Tensor, conv.bias)  # nn.Conv*d's default: bias=True
                got = raw + bias.view(1, -1, *([1] * (raw.dim() - 2)))
                if not torch.equal(got, want):  # values: the readers write their own layouts
                    return f"case {i}: a conv's bias added after it differs from the conv's own (torch.equal)"
    except Exception as e:  # as in check_op: a failure is reported, not raised
        return f"{type(e).__name__}: {e}"
    return None


def check_op_set(
    ops: OpSet, device: torch.device, dtype: torch.dtype, names: tuple[str, ...] = OP_NAMES
) -> dict[str, str]:
    """{op name: reason} for every op in ``names`` that differs from its reference and fails."""
    failed: dict[str, str] = {}
    for name in names:
        if getattr(ops, name) is getattr(REFERENCE_OPS, name):
            continue
        why = check_op(ops, name, device, dtype)
        if why is not None:
            log.warning("op set %s: %s failed its start-up check: %s", ops.name, name, why)
            failed[name] = why
    return failed
