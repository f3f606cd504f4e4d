"""benchmarks/fp8_gate.py, the FP8 quality question: its e4m3 rounding, that its conv wrapping
leaves torch as it was, and its verdict on a tiny decode (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import load_script

G = load_script("benchmarks/fp8_gate.py")


@pytest.mark.parametrize("per_channel", [False, True])
def test_e4m3_rounds_to_an_8_bit_grid_within_half_a_step(per_channel: bool) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(8, 5, 3, 3, generator=g) * torch.logspace(-3, 2, 8).view(8, 1, 1, 1)
    q = G.e4m3(t, per_channel=per_channel)
    amax = t.abs().amax(dim=(1, 2, 3), keepdim=True) if per_channel else t.abs().amax()
    scale = amax / G.E4M3_MAX
    # one scale per slice: at most the 2^8 codes of float8_e4m3fn per slice
    slices = q.reshape(8, -1) if per_channel else q.reshape(1, -1)
    assert all(len(torch.unique(row)) <= 256 for row in slices)
    assert not torch.equal(q, t)
    # 3 mantissa bits: at most half a step, 2^-4 relative, where t / scale is in e4m3's normal range
    normal = t.abs() / scale >= 2**-6
    assert normal.any()
    assert ((q - t).abs() <= t.abs() * 2**-4 * (1 + 2**-20))[normal].all()


def test_the_conv_functions_are_restored() -> None:
    originals = (F.conv2d, F.conv3d)
    with G.fp8_convs(G.selector("fp8-all")):
        assert (F.conv2d, F.conv3d) != originals
    assert (F.conv2d, F.conv3d) == originals


def test_only_selected_convs_are_rounded() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 12, 5, 5, generator=g), torch.randn(4, 12, 3, 3, generator=g)
    want = F.conv2d(x, w)
    with G.fp8_convs(G.selector("fp8-c8")):  # no conv here has 8 input channels
        assert torch.equal(F.conv2d(x, w), want)
    with G.fp8_convs(G.selector("fp8-c12")):
        got = F.conv2d(x, w)
    assert not torch.equal(got, want)
    # each operand within 2^-4 of itself: the sum within ~2 x 2^-4 of the sum of |products|
    bound = F.conv2d(x.abs(), w.abs()) * (2 * 2**-4 + 2**-8)
    assert ((got - want).abs() <= bound).all()


def test_fp8_fails_the_gate_on_a_tiny_decode(capsys: pytest.CaptureFixture[str]) -> None:
    code = G.main(["--device", "cpu", "--model", "random:wan2.1-tiny", "--size", "32,48", "--frames", "5",
                   "--variants", "stock-bf16,fp8-all", "--latents", "white"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "fp8-all" in out and "gate FAILS" in out and "baseline" in out
