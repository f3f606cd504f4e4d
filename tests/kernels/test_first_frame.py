"""A first chunk's causal convs cut to their last time tap (``vaed.patches.first_frame``): judged
once per signature against the op set's own input build + conv3d over the zero-padded frame,
used only where the bits (and strides, and the next cache) match on the call's input and on
seeded random ones, never in a steady chunk or for another conv.

CPU cases run the plain-torch op set with the cut switched on, so the judging and the cut path
are the ones the lossless tier runs, over torch's own builders; the GPU case runs the lossless
tier on a real Wan2.1 first chunk, where cuDNN's kernels decide which forms match.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vaed import patches as P
from vaed.models import build_random_vae
from vaed.patches import bits, first_frame
from vaed.patches.ops import NormSilu

from harness import assert_same, assert_same_cache, chunked_decode, lay

PAD = (1, 1, 1, 1, 2, 0)
CUTTING = dataclasses.replace(P.REFERENCE_OPS, name="reference-cutting", cut_first_frame=frozenset({"cpu"}))
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> dict:
    verdicts: dict = {}
    monkeypatch.setattr(first_frame, "_VERDICTS", verdicts)
    return verdicts


def _conv(c_in: int = 6, c_out: int = 4, dtype: torch.dtype = torch.bfloat16, **kw: Any) -> torch.nn.Conv3d:
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(c_in, c_out, kw.pop("kernel_size", 3), **kw).to(dtype=dtype)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    return conv.eval().requires_grad_(False)


def _frame(c: int = 6, t: int = 1, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return lay(torch.randn(1, c, t, 5, 7, generator=g), "cl3d").to(dtype)


def _norm(c: int = 6, dtype: torch.dtype = torch.bfloat16) -> NormSilu:
    g = torch.Generator().manual_seed(2)
    return NormSilu((torch.rand(c, 1, 1, 1, generator=g) + 0.5).to(dtype), c**0.5, 0.0)


def _stock(conv: torch.nn.Conv3d, x: torch.Tensor, norm: NormSilu | None = None, bias: bool = True) -> Any:
    return P.REFERENCE_OPS.causal_conv(conv, x, None, PAD, norm=norm, bias=bias)


def _same_built(got: Any, want: Any) -> None:
    assert_same(got[0], want[0])
    assert bits.same_bits(got[0], want[0])
    assert_same(got[1], want[1])


def _spied(monkeypatch: pytest.MonkeyPatch, forms: dict[str, Any]) -> dict[str, int]:
    calls = dict.fromkeys(forms, 0)

    def spy(name: str, form: Any) -> Any:
        def run(conv: Any, frame: torch.Tensor, bias: bool) -> torch.Tensor:
            calls[name] += 1
            return form(conv, frame, bias)

        return run

    monkeypatch.setattr(first_frame, "CUT_FORMS", {n: spy(n, f) for n, f in forms.items()})
    return calls


def _repadded(conv: torch.nn.Conv3d, frame: torch.Tensor, bias: bool) -> torch.Tensor:
    """A cut form exact by construction: the frame padded back to stock's input, stock's conv."""
    padded = F.pad(frame, (0, 0, 0, 0, 2, 0)).contiguous(memory_format=torch.channels_last_3d)
    return F.conv3d(padded, conv.weight, conv.bias if bias else None)


def _first_tap(conv: torch.nn.Conv3d, frame: torch.Tensor, bias: bool) -> torch.Tensor:
    """A wrong cut: the first time tap, which in stock only ever meets a zero frame."""
    w = conv.weight[:, :, :1].contiguous(memory_format=torch.channels_last_3d)
    return F.conv3d(frame, w, conv.bias if bias else None)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_a_matching_form_is_judged_once_then_used(monkeypatch: pytest.MonkeyPatch, fresh_verdicts: dict,
                                                   with_norm: bool, bias: bool) -> None:
    """The judging call answers with stock's result and runs the form on the call's input and on
    seeded random ones (a small conv: the most there are); later calls run the form alone, with
    stock's bits, strides and next cache."""
    calls = _spied(monkeypatch, {"repadded": _repadded})
    conv, norm = _conv(), _norm() if with_norm else None
    x = _frame()
    with torch.no_grad():
        first = CUTTING.causal_conv(conv, x, None, PAD, norm=norm, bias=bias)
        judged = 1 + bits.MAX_RANDOM_INPUTS
        assert calls["repadded"] == judged and list(first_frame.verdicts().values()) == ["repadded"]
        _same_built(first, _stock(conv, x, norm, bias))
        other = _frame(seed=7)
        got = CUTTING.causal_conv(conv, other, None, PAD, norm=norm, bias=bias)
    assert calls["repadded"] == judged + 1 and len(fresh_verdicts) == 1
    _same_built(got, _stock(conv, other, norm, bias))


def test_a_form_that_misses_stock_bits_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong cut (the first tap) is judged once and then never run: stock's conv answers."""
    calls = _spied(monkeypatch, {"first tap": _first_tap, "repadded": _repadded})
    conv, x = _conv(), _frame()
    with torch.no_grad():
        CUTTING.causal_conv(conv, x, None, PAD)
        assert list(first_frame.verdicts().values()) == ["repadded"]  # the second form, after the first failed
        assert calls["first tap"] == 1
        _spied(monkeypatch, {"first tap": _first_tap})
        first_frame._VERDICTS.clear()
        CUTTING.causal_conv(conv, x, None, PAD)
        assert list(first_frame.verdicts().values()) == [None]
        assert first_frame.cut_causal_conv(CUTTING, conv, x, PAD) is None
        got = CUTTING.causal_conv(conv, x, None, PAD)
    _same_built(got, _stock(conv, x))


@pytest.mark.parametrize("wrong_at", [1, 16])
def test_a_form_must_match_on_every_random_input(monkeypatch: pytest.MonkeyPatch, wrong_at: int) -> None:
    """A form right on the call's own input but wrong on one of the seeded random ones (the first
    or the last) is refused: the verdict is not left to one input's luck (a small conv has few
    outputs, and a constant frame sums the same in any order)."""
    seen: list[torch.Tensor] = []

    def wrong_once(conv: torch.nn.Conv3d, frame: torch.Tensor, bias: bool) -> torch.Tensor:
        seen.append(frame)
        y = _repadded(conv, frame, bias)
        return y * 2 if len(seen) == 1 + wrong_at else y

    assert bits.MAX_RANDOM_INPUTS == 16
    _spied(monkeypatch, {"wrong once": wrong_once})
    conv, x = _conv(), _frame()
    with torch.no_grad():
        got = CUTTING.causal_conv(conv, x, None, PAD)
    assert len(seen) == 1 + wrong_at and list(first_frame.verdicts().values()) == [None]
    _same_built(got, _stock(conv, x))


def test_a_large_conv_is_judged_on_fewer_random_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spied(monkeypatch, {"repadded": _repadded})
    monkeypatch.setattr(bits, "JUDGED_ELEMENTS", 4 * 5 * 7 * 3)  # three of this conv's outputs
    with torch.no_grad():
        CUTTING.causal_conv(_conv(), _frame(), None, PAD)
    assert calls["repadded"] == 1 + 3


def test_minus_zero_is_not_plus_zero() -> None:
    a, b = torch.zeros(3, dtype=torch.bfloat16), -torch.zeros(3, dtype=torch.bfloat16)
    assert torch.equal(a, b) and not bits.same_bits(a, b)
    assert bits.same_bits(a, a.clone()) and not bits.same_bits(a, a.float())


@pytest.mark.parametrize("case", ["cache", "two frames", "1x1x1 kernel", "stride 2", "padding in the module"])
def test_only_a_first_chunks_plain_causal_conv_is_cut(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Steady chunks, several frames and convs that are not a plain causal 3-tap one keep stock's
    path, unjudged."""
    calls = _spied(monkeypatch, {"repadded": _repadded})
    conv, x, cache, pad = _conv(), _frame(), None, PAD
    if case == "cache":
        cache = _frame(t=2, seed=3)
    elif case == "two frames":
        x = _frame(t=2)
    elif case == "1x1x1 kernel":
        conv, pad = _conv(kernel_size=1), (0, 0, 0, 0, 0, 0)
    elif case == "stride 2":
        conv = _conv(stride=2)
    else:
        conv = _conv(padding=1)
    with torch.no_grad():
        if cache is None:  # with a cache the op set never asks
            assert first_frame.cut_causal_conv(CUTTING, conv, x, pad) is None
        got = CUTTING.causal_conv(conv, x, cache, pad)
        want = P.REFERENCE_OPS.causal_conv(conv, x, cache, pad)
    assert calls["repadded"] == 0 and not first_frame.verdicts()
    _same_built(got, want)


def test_nan_activations_leave_the_verdict_open(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spied(monkeypatch, {"repadded": _repadded})
    conv, x = _conv(), _frame()
    x[0, 0, 0, 2, 3] = float("nan")
    with torch.no_grad():
        got = CUTTING.causal_conv(conv, x, None, PAD)
    assert calls["repadded"] == 0 and not first_frame.verdicts()
    assert torch.equal(torch.isnan(got[0]), torch.isnan(_stock(conv, x)[0]))


def test_the_lossless_tier_cuts_on_cuda_only_and_the_fast_and_sharded_sets_do_not() -> None:
    from vaed.parallel.forward import shard_ops

    assert P.LOSSLESS_OPS.cut_first_frame == {"cuda"} and P.LOSSLESS_TILED_OPS.cut_first_frame == {"cuda"}
    assert not P.FAST_OPS.cut_first_frame and not P.REFERENCE_OPS.cut_first_frame
    ctx = type("Ctx", (), {"ops": P.LOSSLESS_OPS})()
    assert not shard_ops(ctx).cut_first_frame  # type: ignore[arg-type]


def test_a_cpu_decode_in_the_lossless_tier_is_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spied(monkeypatch, {"repadded": _repadded})
    with torch.no_grad():
        got = P.LOSSLESS_OPS.causal_conv(_conv(), _frame(), None, PAD)
    assert calls["repadded"] == 0 and not first_frame.verdicts()
    _same_built(got, _stock(_conv(), _frame()))


@pytest.mark.parametrize("arch", ["wan2.1-tiny", "wan2.2-tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_decoders_with_cut_first_frames_keep_stock_bits(monkeypatch: pytest.MonkeyPatch, arch: str,
                                                            dtype: torch.dtype) -> None:
    """Whole chunked decodes (first chunk cut wherever a form is judged to match, by torch's own
    CPU convs or, failing that, the repadded form) give stock's frames and caches bit for bit."""
    calls = _spied(monkeypatch, {**first_frame.CUT_FORMS, "repadded": _repadded})
    vae = build_random_vae(arch).to(dtype=dtype).eval().requires_grad_(False)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, 4, 4).to(dtype), "channels_last")
    with torch.no_grad():
        P.prepare_decoder(vae, layout="channels_last", ops=P.REFERENCE_OPS)
        want, want_cache = chunked_decode(vae, z)
        with P.using(CUTTING):
            got, got_cache = chunked_decode(vae, z)
            again, _ = chunked_decode(vae, z)  # every signature judged: the cut forms alone
    convs = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    verdicts = first_frame.verdicts()
    assert verdicts and all(v is not None for v in verdicts.values()), verdicts
    assert sum(calls.values()) >= convs  # the judging runs and the cut calls of the second decode
    for out in (got, again):
        assert_same(out, want)
    assert_same_cache(got_cache, want_cache)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200)")
def test_lossless_first_chunk_at_480p_is_cut_and_keeps_stock_bits() -> None:
    """Wan2.1's first chunk at 480x832 through the lossless tier: stock's bits, and cuDNN's kernels
    give a matching cut form for most of its 30 causal convs (all 30 on an H200 with cuDNN 9.19)."""
    vae = build_random_vae("wan2.1").to("cuda", torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    z = P.to_decoder_layout(torch.randn(1, 16, 2, 60, 104, device="cuda", generator=g, dtype=torch.bfloat16),
                            "channels_last")
    with torch.inference_mode():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        want, want_cache = chunked_decode(vae, z)
        P.prepare_decoder(vae, kernels="triton", layout="channels_last")
        got, got_cache = chunked_decode(vae, z)      # judges each first-chunk signature
        again, _ = chunked_decode(vae, z)            # runs the cut forms
    verdicts = [v for k, v in first_frame.verdicts().items() if k[0].name == "lossless"]
    assert len(verdicts) >= 10 and sum(v is not None for v in verdicts) >= len(verdicts) * 2 // 3, verdicts
    for out in (got, again):
        assert_same(out, want)
    assert_same_cache(got_cache, want_cache)


def test_a_cut_output_takes_stock_strides_only_over_the_same_memory_order() -> None:
    """A channels-last conv2d output is channels_last_3d memory with T = 1: viewed with stock's
    strides (a size-1 dim's stride is free, and cuDNN's conv3d picks its own); an NCHW one is not."""
    y = torch.arange(140.0).reshape(1, 5, 7, 4).permute(0, 3, 1, 2).unsqueeze(2)  # NHWC memory
    assert y.squeeze(2).is_contiguous(memory_format=torch.channels_last)
    stock_stride = (140, 1, 1, 28, 4)
    viewed = first_frame._in_layout(y, stock_stride)
    assert viewed is not None and viewed.stride() == stock_stride and torch.equal(viewed, y)
    assert viewed.data_ptr() == y.data_ptr()
    assert first_frame._in_layout(y.contiguous(), stock_stride) is None
