"""The fast tier's candidate conv (``benchmarks/triton_conv.py``: Triton implicit GEMM on channels-last
activations) and ``benchmarks/bench_convs.py``'s ``--triton`` column that measures it against cuDNN.

The conv against an fp32 conv of the same bf16 values rounded once to bf16 (``conv_reference``):
conv2d and conv3d, channel counts that are no multiple of the blocks, padding 0 and 1, with and
without a bias, channels-last output strides; ``supports`` declines what the kernel does not do.
Interpreter cases (tests/backends.py) run tiny shapes with a small tile (several pixel and channel
blocks, a GROUP_M swizzle that does not divide them) and the real configs at the decoder's channel
counts; GPU cases the decoder's channels at a few spatial sizes, every config. The report
helpers of bench_convs.py run without a GPU; its Triton measurement under the interpreter.

Tolerance: within one bf16 ulp of the larger of the two values, plus the fp32 summation-order
bound n * 2^-24 * sum|x*w| (n = taps*C terms). Both sides accumulate the same exact products in
fp32 in different orders, then round once: round-to-nearest on the GPU, truncation under the
interpreter (its fp32->bf16 cast), against the reference's round-to-nearest, so two values on
the same bf16 grid end at most one ulp apart once the order difference is far below an ulp. A
wrong tap, channel or pixel offset moves a value by many ulps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from backends import Backend, kernel_cases
from harness import load_script

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    """A benchmarks/ script as a module, the one already imported under its name if any (as
    bench_convs imports triton_conv)."""
    return sys.modules.get(name) or load_script(f"benchmarks/{name}.py")


tc = _load("triton_conv")
bc = _load("bench_convs")

BF16 = torch.bfloat16
# several pixel blocks and two channel blocks where K > 16; GROUP_M 4 leaves a partial group
SMALL = tc.Config(16, 16, 16, 4, 1, group_m=4)


def _fmt(dims: int) -> torch.memory_format:
    return torch.channels_last_3d if dims == 5 else torch.channels_last


def _inputs(
    backend: Backend, n_and_spatial: tuple[int, ...], c: int, k: int, kernel: tuple[int, ...], bias: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = backend.generator(seed)
    dev = backend.device
    n, *spatial = n_and_spatial
    x = torch.randn(n, c, *spatial, device=dev, generator=g).to(BF16).contiguous(memory_format=_fmt(2 + len(spatial)))
    # the weight in conv's own (contiguous) layout: prepare_weight takes any
    w = (torch.randn(k, c, *kernel, device=dev, generator=g) * (c * math.prod(kernel)) ** -0.5).to(BF16)
    b = torch.randn(k, device=dev, generator=g).to(BF16) if bias else None
    return x, w, b


def assert_within_an_ulp(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, padding: Any,
                         bias: torch.Tensor | None) -> None:
    """``got`` against ``conv_reference`` (the module docstring's tolerance), its layout channels-last."""
    want = tc.conv_reference(x, w, padding, bias)
    assert got.shape == want.shape and got.dtype == BF16
    fmt = _fmt(x.dim())
    assert got.is_contiguous(memory_format=fmt)
    assert got.stride() == torch.empty(got.shape, memory_format=fmt).stride()
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    terms = math.prod(w.shape[1:])
    abs_sum = conv(x.float().abs(), w.float().abs(), None if bias is None else bias.float().abs(), 1, padding)
    g, r = got.float(), want.float()
    _, exp = torch.frexp(torch.maximum(g.abs(), r.abs()))
    ulp = torch.ldexp(torch.ones_like(g), exp - 8)  # bf16: 8 significant bits, |v| in [2^(e-1), 2^e)
    tol = ulp + terms * 2.0**-24 * abs_sum
    excess = ((g - r).abs() - tol).flatten()
    worst = int(excess.argmax())
    assert excess[worst] <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} values off by more than an ulp; worst: "
        f"{g.flatten()[worst].item()} vs {r.flatten()[worst].item()}")


# (N and input dims, C, K, kernel, padding, bias, configs: "small" = SMALL, "all" = configs_for's)
INTERPRETER_CASES = [
    ((2, 5, 7), 12, 6, (3, 3), 0, True, "small"),
    ((2, 5, 7), 24, 3, (3, 3), 1, False, "small"),
    ((2, 9, 11), 24, 20, (1, 1), 0, True, "small"),  # 13 pixel blocks x 2 channel blocks
    ((1, 4, 5, 6), 12, 6, (3, 3, 3), 0, True, "small"),
    ((2, 3, 4, 5), 16, 20, (3, 3, 3), 1, True, "small"),  # channels a whole block, padded taps
    ((1, 3, 4, 5), 12, 6, (3, 3, 3), (0, 1, 1), False, "small"),  # pre-padded time, padded space
    ((1, 2, 3, 4), 32, 8, (1, 1, 1), 0, False, "small"),
    ((1, 4, 3, 5), 16, 24, (3, 1, 1), 0, False, "small"),  # the decoder's time_conv
    ((1, 4, 3, 5), 12, 20, (3, 1, 2), (1, 0, 1), True, "small"),  # no two kernel dims alike
    ((2, 3, 4), 96, 96, (3, 3), 0, False, "all"),  # K step 32 (and masked 64), 128-wide tile on 96
    ((1, 3, 4), 288, 96, (3, 3), 1, True, "all"),  # the unfolded 3x3x3 conv2d
    ((1, 3, 3, 4), 96, 3, (3, 3, 3), 0, True, "all"),  # conv_out
]
# the decoder's channel counts at a few steady-chunk sizes (a 480x832 chunk is much larger)
CUDA_CASES = [
    ((4, 62, 106), 288, 96, (3, 3), 0, True, "all"),
    ((1, 6, 34, 66), 96, 96, (3, 3, 3), 0, False, "all"),
    ((1, 6, 34, 66), 96, 3, (3, 3, 3), 0, True, "all"),
    ((1, 6, 18, 26), 192, 192, (3, 3, 3), 0, False, "all"),
    ((4, 16, 24), 384, 192, (3, 3), 1, False, "all"),
    ((1, 4, 10, 14), 384, 384, (3, 3, 3), 0, False, "all"),
    ((1, 3, 6, 8), 16, 384, (3, 3, 3), 0, True, "all"),
    ((1, 4, 30, 52), 192, 384, (1, 1, 1), 0, False, "all"),
]


@kernel_cases("dims, c, k, kernel, padding, bias, configs", cuda=CUDA_CASES, interpreter=INTERPRETER_CASES)
def test_conv_is_the_fp32_conv_within_an_ulp(
    backend: Backend, dims: tuple[int, ...], c: int, k: int, kernel: tuple[int, ...], padding: Any, bias: bool,
    configs: str,
) -> None:
    x, w, b = _inputs(backend, dims, c, k, kernel, bias, seed=c * 1000 + k)
    assert tc.supports(x.shape, x.stride(), w.shape, 1, padding, 1, 1, x.dtype)
    packed = tc.prepare_weight(w)
    for cfg in [SMALL] if configs == "small" else tc.configs_for(c, k):
        got = tc.conv_igemm(x, packed, w.shape, padding, b, cfg)
        assert_within_an_ulp(got, x, w, padding, b)
        if x.is_cuda:  # torch's own conv returns the same strides
            conv = F.conv3d if x.dim() == 5 else F.conv2d
            assert got.stride() == conv(x, w, b, 1, padding).stride(), cfg.name


@kernel_cases("", interpreter=[()])
def test_int64_offsets_give_the_same_bits(backend: Backend) -> None:
    """The int64 path (taken where a tensor spans 2^31 elements, 720p-sized and up) forced on a
    small conv: the same bits as the int32 path."""
    x, w, b = _inputs(backend, (2, 3, 4, 5), 12, 20, (3, 3, 3), True, seed=7)
    packed = tc.prepare_weight(w)
    narrow = tc.launcher(x, packed, w.shape, 1, b, SMALL, idx64=False)()
    wide = tc.launcher(x, packed, w.shape, 1, b, SMALL, idx64=True)()
    assert torch.equal(narrow, wide)
    assert_within_an_ulp(wide, x, w, 1, b)


def test_supports_takes_the_decoder_convs_and_declines_the_rest() -> None:
    cl3d = torch.empty(1, 96, 6, 34, 66).contiguous(memory_format=torch.channels_last_3d)
    cl = torch.empty(4, 288, 34, 66).contiguous(memory_format=torch.channels_last)
    w3, w2 = (96, 96, 3, 3, 3), (96, 288, 3, 3)
    bf16 = "torch.bfloat16"  # ConvSig's spelling; a torch.dtype works too
    assert tc.supports(cl3d.shape, cl3d.stride(), w3, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1, bf16)
    assert tc.supports(cl.shape, cl.stride(), w2, 1, 1, 1, 1, BF16)
    assert tc.supports(cl.shape, cl.stride(), w2, 1, "valid", 1, 1, BF16)
    declined = {
        "stride 2": (cl.shape, cl.stride(), w2, 2, 0, 1, 1, BF16),
        "stride 2 in one dim": (cl3d.shape, cl3d.stride(), w3, (1, 2, 1), 0, 1, 1, BF16),
        "groups 2": (cl.shape, cl.stride(), (96, 144, 3, 3), 1, 0, 1, 2, BF16),
        "dilation 2": (cl.shape, cl.stride(), w2, 1, 0, 2, 1, BF16),
        "contiguous input": (cl.shape, cl.contiguous().stride(), w2, 1, 0, 1, 1, BF16),
        "contiguous conv3d input": (cl3d.shape, cl3d.contiguous().stride(), w3, 1, 0, 1, 1, BF16),
        "fp16": (cl.shape, cl.stride(), w2, 1, 0, 1, 1, torch.float16),
        "fp32": (cl.shape, cl.stride(), w2, 1, 0, 1, 1, "torch.float32"),
        "asymmetric 'same'": (cl.shape, cl.stride(), (96, 288, 2, 2), 1, "same", 1, 1, BF16),
        "channel mismatch": (cl.shape, cl.stride(), (96, 96, 3, 3), 1, 0, 1, 1, BF16),
        "conv1d": ((1, 96, 10), (960, 1, 96), (96, 96, 3), 1, 0, 1, 1, BF16),
        "empty output": (cl.shape, cl.stride(), (96, 288, 35, 3), 1, 0, 1, 1, BF16),
    }
    for what, args in declined.items():
        assert not tc.supports(*args), what
        assert tc.why_unsupported(*args), what
    x = torch.zeros(1, 12, 5, 5).to(BF16)  # contiguous: refused before any launch, triton or not
    w = torch.zeros(6, 12, 3, 3).to(BF16)
    with pytest.raises(ValueError, match="channels-last"):
        tc.conv_igemm(x, tc.prepare_weight(w), w.shape, 0)


def test_prepare_weight_is_the_gemm_matrix() -> None:
    """Row tap*C + c, column k holds w[k, c, dt, dh, dw] for tap = (dt*kh + dh)*kw + dw, from any layout."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, 3, 2, 4, generator=g).contiguous(memory_format=torch.channels_last_3d)
    packed = tc.prepare_weight(w)
    assert packed.shape == (3 * 2 * 4 * 7, 5) and packed.dtype == BF16 and packed.is_contiguous()
    for dt, dh, dw, c, k in ((0, 0, 0, 0, 0), (2, 1, 3, 6, 4), (1, 0, 2, 3, 1)):
        assert packed[((dt * 2 + dh) * 4 + dw) * 7 + c, k] == w[k, c, dt, dh, dw].to(BF16)
    w2 = torch.randn(5, 7, 3, 3, generator=g)
    assert torch.equal(tc.prepare_weight(w2)[(1 * 3 + 2) * 7 + 4], w2[:, 4, 1, 2].to(BF16))


@pytest.mark.parametrize("c, k", [(c, k) for c in (16, 96, 192, 288, 384) for k in (3, 96, 192, 384)])
def test_configs_are_valid_launch_shapes(c: int, k: int) -> None:
    configs = tc.configs_for(c, k)
    assert configs and len(set(configs)) == len(configs)
    for cfg in configs:
        for block in (cfg.block_m, cfg.block_n, cfg.block_k):
            assert block >= 16 and block & (block - 1) == 0, cfg  # tl.dot's and tl.arange's rules
        assert cfg.block_n <= max(16, 1 << (k - 1).bit_length()), cfg  # no tile wider than K needs
        assert cfg.smem_bytes() <= tc.SMEM_BYTES, cfg
    assert c % configs[0].block_k == 0  # the first config wastes no MMA work on channel padding


# ------------------------------------------------------------------------------------------------
# bench_convs.py --triton
# ------------------------------------------------------------------------------------------------


def test_bench_convs_help_names_the_triton_flag() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # vaed from this checkout, as the tests import it
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_convs.py"), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--triton" in out.stdout and "triton_conv.py" in out.stdout


def _sig(kind: str = "conv3d", c: int = 96, k: int = 96, stride: int = 1) -> Any:
    x = torch.empty(1, c, 6, 34, 66) if kind == "conv3d" else torch.empty(4, c, 34, 66)
    x = x.contiguous(memory_format=_fmt(x.dim()))
    w = torch.empty(k, c, *(3,) * (x.dim() - 2))
    return bc.signature_of(kind, (x.to(BF16), w.to(BF16)), {"stride": stride})


def _results() -> list[Any]:
    """Three shapes: Triton beats torch and the plan; Triton does not take it (stride 2); Triton's
    only config is off by more than --max-err (and one failed to compile)."""
    P = bc.PlanResult
    win = bc.ShapeResult(_sig(), 5, 0.1, torch_ms=2.0, torch_backend="CudnnNHWC",
                         plans=[P(0, "eng0", ms=2.0, rel_err=0.0), P(1, "eng1", ms=1.5, rel_err=0.001)], best=1,
                         triton=[P(0, "128x128x32 w8 s3", ms=1.0, rel_err=0.002),
                                 P(1, "256x128x32 w8 s3", ms=1.2, rel_err=0.002)], triton_best=0)
    skip = bc.ShapeResult(_sig(stride=2), 1, 0.01, torch_ms=0.5, plans=[P(0, "eng0", ms=0.4, rel_err=0.0)], best=0,
                          triton_skip="stride=(2, 2, 2)")
    off = bc.ShapeResult(_sig("conv2d", 288), 5, 0.05, torch_ms=1.0, plans=[P(0, "eng0", ms=1.0, rel_err=0.0)], best=0,
                         triton=[P(0, "128x128x32 w8 s3", ms=0.5, rel_err=0.5),
                                 P(1, "128x256x32 w8 s3", error="OutOfResources: shared memory")])
    return [win, skip, off]


def test_bench_convs_report_without_triton_is_the_old_one(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --triton: the old header, lines, totals and JSON keys (no Triton field anywhere)."""
    results = _results()
    for r in results:  # a run without --triton never fills them
        r.triton, r.triton_best, r.triton_skip = [], None, None
    assert bc.header() == bc.HEADER and bc.HEADER.endswith("err  best plan")
    line = bc.shape_line(0, results[0], 0.02)
    assert line.endswith("0.0010  eng1") and "x32" not in line
    assert len(line.split(" | ")) == len(bc.HEADER.split(" | "))
    assert not any("triton" in n for r in results for n in bc.shape_notes(r, 0.02))
    assert set(bc.chunk_totals(results)) == {"torch", "plan0", "best_plan", "best_of_both"}
    summary = bc.print_summary(results, 21, 0.02)
    assert "triton" not in capsys.readouterr().out.lower()
    assert not any("triton" in key for key in summary)
    assert not any("triton" in key for key in bc.result_json(results[0]))


def test_bench_convs_report_with_triton(capsys: pytest.CaptureFixture[str]) -> None:
    win, skip, off = results = _results()
    head = bc.header(True)
    assert head == bc.HEADER.removesuffix("  best plan") + bc.TRITON_HEADER + "  best plan"
    line = bc.shape_line(0, win, 0.02, True)
    assert len(bc.triton_columns(win, 0.02)) == len(bc.TRITON_HEADER)
    assert line.endswith("128x128x32 w8 s3  eng1") and "2/2" in line and "2.00x" in line
    assert " | " + "-".rjust(8) in bc.shape_line(1, skip, 0.02, True)
    assert "triton: not run (stride=(2, 2, 2))" in bc.shape_notes(skip, 0.02)
    notes = bc.shape_notes(off, 0.02)
    assert any("triton 128x128x32 w8 s3: rel err 0.5 > --max-err" in n for n in notes)
    assert any("triton 128x256x32 w8 s3: OutOfResources" in n for n in notes)

    for r in results:  # what measure_shape does with the configs
        r.triton_best = bc.pick_best(r.triton, 0.02)
    assert (win.triton_best, skip.triton_best, off.triton_best) == (0, None, None)
    tot = bc.chunk_totals(results, triton=True)
    # torch 2*5 + 0.5 + 1*5; plans 1.5*5 + 0.4 + 1*5; Triton 1*5 + torch's 0.5 + torch's 1*5
    assert tot["torch"] == pytest.approx(15.5) and tot["best_of_both"] == pytest.approx(12.9)
    assert tot["best_triton"] == pytest.approx(10.5) and tot["best_of_all"] == pytest.approx(10.4)
    summary = bc.print_summary(results, 21, 0.02, triton=True)
    out = capsys.readouterr().out
    assert "best of torch, plans and triton 10.400" in out
    assert "faster than torch and every plan: 1" in out and "1.500 -> 1.000 ms (128x128x32 w8 s3)" in out
    assert "does not take (counted at torch's ms): 1" in out and "no Triton config ran within --max-err" in out
    assert summary["saving_with_triton_per_chunk_ms"] == pytest.approx(5.1)
    assert summary["triton_saving_over_best_of_both_per_chunk_ms"] == pytest.approx(2.5)
    assert summary["triton_faster_shapes"] == 1
    d = bc.result_json(win, triton=True)
    assert d["triton_best_config"] == "128x128x32 w8 s3" and d["triton_best_ms"] == 1.0
    assert d["triton_best_tflops"] == pytest.approx(100.0)
    json.dumps([bc.result_json(r, True) for r in results], default=str)


@kernel_cases("", interpreter=[()])
def test_bench_convs_measures_triton_configs(backend: Backend) -> None:
    """measure_triton on a recorded signature: each config launched, checked against torch's
    output by the script's rel_err and timed; a config that cannot launch and a signature the
    conv does not take are reported, not raised."""
    x, w, _ = _inputs(backend, (1, 3, 4, 5), 12, 6, (3, 3, 3), False, seed=3)
    sig = bc.signature_of("conv3d", (x, w), {})
    ref = tc.conv_reference(x, w, 0)
    timed: list[int] = []

    def timer(fn: Any, iters: int) -> float:
        fn()
        timed.append(iters)
        return 0.25

    bad = tc.Config(24, 16, 16, 4, 1)  # not a power of two: tl.arange refuses it
    runs, skip = bc.measure_triton(sig, x, w, ref, 3, timer=timer, configs=[SMALL, bad])
    assert skip is None and timed == [3]
    assert [r.name for r in runs] == [SMALL.name, bad.name]
    assert runs[0].ms == 0.25 and runs[0].rel_err is not None and runs[0].rel_err < 0.01 and runs[0].ok(0.02)
    assert runs[1].ms is None and runs[1].error and not runs[1].ok(0.02)
    assert bc.pick_best(runs, 0.02) == 0
    strided = bc.signature_of("conv3d", (x, w), {"stride": 2})
    assert bc.measure_triton(strided, x, w, ref, 3, timer=timer) == ([], "stride=(2, 2, 2)")
