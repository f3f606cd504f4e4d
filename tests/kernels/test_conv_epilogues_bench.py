"""benchmarks/bench_conv_epilogues.py on the CPU: which convs it picks as conv2 (exactly, from a
real tiny decode's residual adds, and by the --select square rule), the views between a conv
output and the residual add's x, the per-chunk arithmetic, and that it refuses to run without
CUDA (exit 2). The measurements themselves need the H200 and the cuDNN frontend."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import load_script

from vaed import patches as P
from vaed.kernels import _runtime as rt
from vaed.models import build_random_vae

CL3D = torch.channels_last_3d


E = load_script("benchmarks/bench_conv_epilogues.py")
ConvSig = E.bc.ConvSig


def _sig(kind: str, c_in: int, c_out: int, k: tuple[int, ...], dims: tuple[int, ...], **over: Any) -> Any:
    n = len(k)
    fields: dict[str, Any] = dict(
        kind=kind, x_shape=(1, c_in, *dims), x_stride=(0,) * (n + 2), w_shape=(c_out, c_in, *k),
        w_stride=(0,) * (n + 2), bias=False, stride=(1,) * n, padding=(0,) * n, dilation=(1,) * n, groups=1,
        dtype="torch.bfloat16")
    fields.update(over)
    return ConvSig(**fields)


# --- which convs ----------------------------------------------------------------------------


def test_square_rule_takes_3x3x3_in_eq_out_and_the_unfolded_conv2d_only() -> None:
    conv2 = _sig("conv3d", 384, 384, (3, 3, 3), (3, 62, 106))
    unfolded = _sig("conv2d", 288, 96, (3, 3), (4, 482, 834), x_shape=(4, 288, 482, 834))
    others = [
        _sig("conv3d", 192, 384, (3, 3, 3), (3, 62, 106)),  # a conv1 that widens
        _sig("conv3d", 384, 384, (1, 1, 1), (1, 60, 104)),  # a 1x1x1 shortcut
        _sig("conv2d", 384, 192, (3, 3), (122, 210), x_shape=(2, 384, 122, 210)),  # an upsampler's image conv
        _sig("conv2d", 96, 96, (3, 3), (482, 834)),  # square conv2d: not a conv2 (a first chunk's last tap)
        _sig("conv3d", 384, 384, (3, 3, 3), (3, 62, 106), stride=(1, 2, 2)),
        _sig("conv3d", 384, 384, (3, 3, 3), (3, 62, 106), groups=2, w_shape=(384, 192, 3, 3, 3)),
        _sig("conv3d", 384, 384, (3, 3, 3), (3, 62, 106), dilation=(1, 2, 2)),
        _sig("conv3d", 3, 3, (3, 1, 1), (3, 62, 106)),  # a time conv
    ]
    counts = {conv2: 6, unfolded: 2, **{s: 1 for s in others}}
    sites = E.square_sites(counts)
    assert {s.sig: c for s, c in sites.items()} == {conv2: 6, unfolded: 2}
    by_sig = {s.sig: s for s in sites}
    # the add's x: the conv output itself (conv3d), the conv2d's 4 frames as one batch's T
    assert by_sig[conv2].add_shape == (1, 384, 1, 60, 104)
    assert by_sig[unfolded].add_shape == (1, 96, 4, 480, 832)
    for s in sites:
        assert rt.matches_order(s.add_shape, s.add_stride, rt.ORDER_CL3D)
        assert s.bias_dtype == "torch.bfloat16"


def _tiny_fast_decoder() -> tuple[Any, torch.Tensor]:
    vae = build_random_vae("wan2.1-tiny").eval().requires_grad_(False)
    P.prepare_decoder(vae, layout="contiguous", ops=P.REFERENCE_OPS)  # the ported forwards; the ops come per call
    torch.manual_seed(0)
    return vae, torch.randn(1, vae.config.z_dim, 3, 4, 4)


def test_conv2_sites_of_a_tiny_fast_decode_are_exactly_its_residual_blocks_conv2() -> None:
    """On the CPU the fast tier's kernels decline and its references run; every residual add still
    meets the conv2 that produced its x."""
    vae, z = _tiny_fast_decoder()
    sites, unmatched = E.record_conv2_sites(vae, z, P.FAST_OPS)
    blocks = [m for m in vae.decoder.modules() if type(m).__name__ == "WanResidualBlock"]
    assert unmatched == 0
    assert sum(sites.values()) == len(blocks)
    conv2_weights = {tuple(b.conv2.weight.shape) for b in blocks}
    assert {s.sig.w_shape for s in sites} == conv2_weights
    conv1_only = {tuple(b.conv1.weight.shape) for b in blocks} - conv2_weights
    assert conv1_only  # the tiny model widens in a conv1: the exact selection must leave it out
    for s in sites:
        assert s.sig.kind == "conv3d" and s.sig.w_shape[2:] == (3, 3, 3)
        assert s.add_shape == (1, s.sig.w_shape[0], *s.sig.out_spatial())
        assert s.bias_dtype is None  # no deferred bias on the CPU: conv2 added its own
    # the steady chunk only: as many adds per chunk as blocks, not frames x blocks
    assert max(sites.values()) <= len(blocks)


def test_a_residual_add_not_fed_by_the_last_conv_is_unmatched() -> None:
    tracker = E.Conv2Tracker()
    add = tracker.wrap_residual_add(lambda x, h, bias=None: x + h)
    x, w = torch.randn(1, 4, 3, 5, 5), torch.randn(4, 4, 3, 3, 3)
    with tracker.watching_convs():
        tracker.active = True
        y = torch.nn.functional.conv3d(x, w)
        add(y, torch.randn_like(y), torch.zeros(4))
        add(y, torch.randn_like(y))  # the conv's output was taken by the first add
        y2 = torch.nn.functional.conv3d(x, w)
        add(y2.clone(), torch.randn_like(y2))  # a copy: another storage
        tracker.active = False
        y3 = torch.nn.functional.conv3d(x, w)
        add(y3, y3)  # not counted at all
    assert tracker.unmatched == 2
    (site, calls), = tracker.sites.items()
    assert calls == 1 and site.bias_dtype == "torch.float32" and site.sig.w_shape == (4, 4, 3, 3, 3)
    assert torch.nn.functional.conv3d is not None and "wrap" not in torch.nn.functional.conv3d.__qualname__


# --- views ------------------------------------------------------------------------------------


def test_add_view_of_a_conv2d_output_is_fast_pys_view_and_round_trips() -> None:
    t, c, h, w = 3, 8, 5, 7
    y = torch.randn(t, c, h, w).contiguous(memory_format=torch.channels_last)
    shape = (1, c, t, h, w)
    v = E.to_add_view(y, shape)
    fast_py = y.as_strided(shape, (t * h * w * c, 1, h * w * c, w * c, c))  # vaed.patches.fast's view
    assert v.shape == shape and torch.equal(v, fast_py) and v.data_ptr() == y.data_ptr()
    assert rt.matches_order(shape, v.stride(), rt.ORDER_CL3D)  # what bias_residual_add accepts
    assert torch.equal(E.to_conv_view(v, tuple(y.shape)), y)
    y5 = torch.randn(shape).contiguous(memory_format=CL3D)
    assert E.to_add_view(y5, shape) is y5 and E.to_conv_view(y5, shape) is y5


def test_broadcast_bias_is_channels_last_and_shares_storage() -> None:
    b = torch.arange(6.0)
    b5 = E.broadcast_bias(b, 5)
    assert b5.shape == (1, 6, 1, 1, 1) and b5.stride() == (6, 1, 6, 6, 6) and b5.data_ptr() == b.data_ptr()
    assert torch.equal(b5.flatten(), b)
    assert E.broadcast_bias(b, 4).stride() == (6, 1, 6, 6)


# --- arithmetic -------------------------------------------------------------------------------


def _plan(ms: float, err: float = 0.001) -> Any:
    return E.bc.PlanResult(0, "p", 0, ms, err)


def _result(calls: int, conv: float, resid: float, seq: float, *, plan_seq: float | None = None,
            fused: float | None = None, bias_seq: float | None = None) -> Any:
    site = next(iter(E.square_sites({_sig("conv3d", 8, 8, (3, 3, 3), (3, 6, 6)): 1})))
    r = E.SiteResult(site, calls, conv_ms=conv, resid_ms=resid, seq_ms=seq)
    if plan_seq is not None:
        r.plain = E.VariantResult(plans=[_plan(conv - 0.1)], best=0, seq_ms=plan_seq)
    if fused is not None:
        r.fused = E.VariantResult(plans=[_plan(fused)], best=0)
    else:
        r.fused = E.VariantResult(graph_error="validate: not supported")
    r.fused_bias = E.VariantResult(seq_ms=bias_seq)
    return r


def test_chunk_totals_and_savings() -> None:
    wins = _result(4, 1.0, 0.3, 1.25, plan_seq=1.1, fused=1.05, bias_seq=1.2)
    fails = _result(2, 2.0, 0.5, 2.4, fused=None)  # no fused graph: counted at c
    loses = _result(1, 1.0, 0.2, 1.1, fused=1.3, bias_seq=1.0)  # conv+bias then x + h is its best
    broken = E.SiteResult(wins.site, 9, error="torch conv: OOM")  # left out
    results = [wins, fails, loses, broken]
    tot = E.chunk_totals(results)
    assert tot["calls"] == 7
    assert tot["conv"] == pytest.approx(4 * 1.0 + 2 * 2.0 + 1.0)
    assert tot["plan"] == pytest.approx(4 * 0.9 + 2 * 2.0 + 1.0)  # no plain plans: the conv's ms
    assert tot["residual"] == pytest.approx(4 * 0.3 + 2 * 0.5 + 0.2)
    assert tot["c"] == pytest.approx(4 * 1.25 + 2 * 2.4 + 1.1)
    assert tot["c_plan"] == pytest.approx(4 * 1.1 + 2 * 2.4 + 1.1)
    assert tot["baseline"] == pytest.approx(4 * 1.1 + 2 * 2.4 + 1.1)
    assert tot["fused"] == pytest.approx(4 * 1.05 + 2 * 2.4 + 1.3)
    assert tot["fused_bias_then_add"] == pytest.approx(4 * 1.2 + 2 * 2.4 + 1.0)
    assert tot["best"] == pytest.approx(4 * 1.05 + 2 * 2.4 + 1.0)
    save = E.savings(results)
    assert save["vs_c"] == pytest.approx(4 * 0.2)
    assert save["vs_baseline"] == pytest.approx(4 * 0.05)
    assert save["best_vs_baseline"] == pytest.approx(tot["baseline"] - tot["best"])
    assert [r.beats() for r in results] == ["YES", "-", "no", "-"]
    assert E.print_summary(results, 21)["saving_per_video_ms"]["vs_c"] == pytest.approx(21 * 0.8)


def test_beats_against_c_only_when_c_prime_is_faster() -> None:
    r = _result(1, 1.0, 0.3, 1.3, plan_seq=1.0, fused=1.2)
    assert r.base_ms() == 1.0 and r.beats() == "yes"


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_main_exits_2_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert E.main(["--model", "wan2.1"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_help_lists_the_options_and_the_columns(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        E.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("--model", "--latent", "--iters", "--max-err", "--json", "--select", "cb+r", "conv + bias + add"):
        assert text in out


def test_frames_below_two_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        E.main(["--frames", "1"])
    assert exc.value.code == 2
