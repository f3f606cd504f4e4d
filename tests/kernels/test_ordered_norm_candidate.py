"""The lossless tier's candidate norm denominator in aten's reduction order
(``benchmarks/ordered_norm.py``), by layer:

* the plain-torch model of the order against aten's own CUDA reduction (the claim everything
  else rests on; GPU only: a CPU's aten reduces in another order), and by hand on one pixel;
* the Triton op against that model, bit for bit, on both backends (under the interpreter a
  bf16 bias add is held to a tolerance: its fp32->bf16 cast truncates);
* the inputs it declines, where aten reduces in another order.
"""

from __future__ import annotations

import torch
from backends import Backend, grid, kernel_cases
from harness import lay, load_script

from vaed import kernels as K

N = load_script("benchmarks/ordered_norm.py")

CL = torch.channels_last_3d
HALVES = (torch.bfloat16, torch.float16)


def _activation(backend: Backend, channels: int, dtype: torch.dtype, *, frames: int = 3, seed: int = 0,
                view: bool = False) -> torch.Tensor:
    """A channels-last activation (times 3: a spread like a decoder's); ``view``: frames of a
    bigger tensor, as the decoder's chunks are."""
    h, w = (9, 13) if not backend.interpreter else (3, 5)
    g = backend.generator(seed)
    x = torch.randn(2 if not backend.interpreter else 1, channels, frames + int(view), h, w, device=backend.device,
                    generator=g) * 3
    return lay(x.to(dtype), "cl3d")[:, :, int(view):]


def _bias(backend: Backend, channels: int, dtype: torch.dtype, with_bias: bool) -> torch.Tensor | None:
    if not with_bias:
        return None
    return torch.randn(channels, device=backend.device, generator=backend.generator(7)).to(dtype)


def _interpreter_exact(backend: Backend, dtype: torch.dtype, with_bias: bool) -> bool:
    """The interpreter's fp32->bf16 cast truncates: a bf16 bias add rounds otherwise there."""
    return not (backend.interpreter and with_bias and dtype == torch.bfloat16)


# --- the model against aten ------------------------------------------------------------------


@kernel_cases("dtype, channels, with_bias", cuda=grid(HALVES, (132, 192, 256, 384, 512, 1024), (False, True)))
def test_the_model_is_aten_s_own_reduction(backend: Backend, dtype, channels, with_bias) -> None:
    """What aten computes for stock's ``F.normalize`` (``x.float().norm(2, dim=1)``), the biased
    activation included, equals the model at every pixel."""
    x = _activation(backend, channels, dtype, view=True)
    x_bias = _bias(backend, channels, dtype, with_bias)
    biased = x if x_bias is None else x + x_bias.view(1, -1, 1, 1, 1)
    want = K.norm_denominator_reference(biased)
    got = N.norm_denominator_ordered_reference(x, x_bias)
    assert torch.equal(got, want)
    # and the data tell orders apart: the correctly rounded norm differs at some pixels
    assert not torch.equal(got, torch.linalg.vector_norm(biased.double(), 2, dim=1, keepdim=True).float())


def test_the_model_sums_as_it_says() -> None:
    """One pixel, by hand: lane l's vectors l and l + 32, its accumulators in sequence, the
    tree from lane l + 16 down to l + 1."""
    torch.manual_seed(0)
    x = (torch.randn(256) * 3).to(torch.float16)
    v = x.float().view(2, 32, 4)
    acc = v[0] * v[0] + v[1] * v[1]
    lane = ((acc[:, 0] + acc[:, 1]) + acc[:, 2]) + acc[:, 3]
    for width in (16, 8, 4, 2, 1):
        lane = lane[:width] + lane[width : 2 * width]
    want = lane.double().sqrt().float()
    got = N.norm_denominator_ordered_reference(x.view(1, 256, 1, 1, 1))
    assert got.shape == (1, 1, 1, 1, 1) and torch.equal(got.view(1), want)


# --- the op against the model -----------------------------------------------------------------


@kernel_cases(
    "dtype, channels, with_bias, view",
    cuda=grid(HALVES, (132, 192, 256, 384, 1024), (False, True), (False, True)),
    interpreter=grid(HALVES, (132, 256, 384), (False, True), (True,)),
)
def test_the_op_sums_in_the_model_s_order(backend: Backend, dtype, channels, with_bias, view) -> None:
    x = _activation(backend, channels, dtype, view=view)
    x_bias = _bias(backend, channels, dtype, with_bias)
    got = N.norm_denominator_ordered(x, x_bias)
    assert got is not None and got.dtype == torch.float32
    want = N.norm_denominator_ordered_reference(x, x_bias)
    if _interpreter_exact(backend, dtype, with_bias):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@kernel_cases("case", interpreter=grid(
    ("taken", "128 channels", "130 channels", "fp32", "channels not innermost", "odd pixel stride", "bias dtype")
))
def test_inputs_outside_the_order_are_declined(backend: Backend, case: str) -> None:
    """aten reduces these another way (or the op cannot read them as it): None, for the caller's
    aten path; the same activation otherwise ("taken") is reduced."""
    channels = {"128 channels": 128, "130 channels": 130}.get(case, 256)
    dtype = torch.float32 if case == "fp32" else torch.float16
    x = torch.randn(1, channels, 2, 3, 4, dtype=dtype)
    if case == "odd pixel stride":
        x = torch.randn(1, 3, 4, 2 * channels + 2, dtype=dtype)[..., :channels]
        x = x.permute(0, 3, 1, 2).unsqueeze(2)  # channels innermost, pixels 2C + 2 apart
    elif case != "channels not innermost":  # that one stays contiguous NCDHW
        x = x.contiguous(memory_format=CL)
    x_bias = torch.randn(channels, dtype=torch.float32 if case == "bias dtype" else dtype)
    got = N.norm_denominator_ordered(x, x_bias)
    assert (got is not None) == (case == "taken")


@kernel_cases("", cuda=[()])
def test_the_benchmark_times_a_site_and_checks_its_bits(backend: Backend) -> None:
    add, reduce, ordered, exact = N.time_site(256, 2, 16, 24)
    assert exact and min(add, reduce, ordered) > 0
