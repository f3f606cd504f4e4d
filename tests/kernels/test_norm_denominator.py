"""The RMS-norm denominator: the reference's bits always, its float copy skipped only where proven equal."""

from __future__ import annotations

import pytest
import torch

from vaed import kernels as K
from vaed.kernels import rms_silu

CL = torch.channels_last_3d


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rms_silu, "_CAST_ON_LOAD_EXACT", {})


def _key(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.stride(), x.dtype, x.device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("channels", [16, 96, 384])
def test_equals_the_reference_on_first_and_later_calls(dtype, channels_last, channels) -> None:
    x = torch.randn(1, channels, 2, 9, 13).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    want = K.norm_denominator_reference(x)
    assert want.dtype == torch.float32
    for _ in range(2):  # the first call verifies, the second takes the verdict
        got = K.norm_denominator(x)
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert _key(x) in rms_silu._CAST_ON_LOAD_EXACT


def test_a_differing_cast_on_load_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # stands in for an aten whose cast-on-load reduction sums in another order
    calls = []

    def off_by_one_ulp(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        r = torch.linalg.vector_norm(x, 2, dim=1, keepdim=True, dtype=torch.float32)
        return torch.nextafter(r, torch.full_like(r, float("inf")))

    monkeypatch.setattr(rms_silu, "_cast_on_load", off_by_one_ulp)
    x = torch.randn(1, 32, 2, 5, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    want = K.norm_denominator_reference(x)
    for _ in range(3):
        assert torch.equal(K.norm_denominator(x), want)
    assert rms_silu._CAST_ON_LOAD_EXACT[_key(x)] is False
    assert len(calls) == 1  # tried once, at the verification


def test_an_equal_cast_on_load_is_used_after_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1, 32, 2, 5, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    K.norm_denominator(x)
    assert rms_silu._CAST_ON_LOAD_EXACT[_key(x)] is True
    monkeypatch.setattr(rms_silu, "norm_denominator_reference", lambda x: pytest.fail("the float copy ran"))
    assert torch.equal(K.norm_denominator(x), torch.linalg.vector_norm(x.float(), 2, dim=1, keepdim=True))


def test_nan_activations_leave_the_verdict_open() -> None:
    """NaN != NaN: judged on them, the cheaper path would be refused for good at that shape."""
    x = torch.randn(1, 32, 2, 5, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    bad = x.clone()
    bad[0, 3, 1, 2, 4] = float("nan")
    assert torch.equal(K.norm_denominator(bad).isnan(), K.norm_denominator_reference(bad).isnan())
    assert _key(bad) not in rms_silu._CAST_ON_LOAD_EXACT
    K.norm_denominator(x)  # same signature, finite: now judged
    assert rms_silu._CAST_ON_LOAD_EXACT[_key(x)] is True


def test_fp32_is_the_reference_itself() -> None:
    x = torch.randn(1, 8, 1, 4, 4)
    assert torch.equal(K.norm_denominator(x), torch.linalg.vector_norm(x, 2, dim=1, keepdim=True))
    assert rms_silu._CAST_ON_LOAD_EXACT == {}


def test_verdicts_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rms_silu, "_MAX_SIGNATURES", 4)
    for w in range(1, 11):
        K.norm_denominator(torch.randn(1, 8, 1, 2, w, dtype=torch.bfloat16))
        assert len(rms_silu._CAST_ON_LOAD_EXACT) <= 4
