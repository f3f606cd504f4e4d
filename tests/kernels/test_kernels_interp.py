"""Kernels on the CPU under TRITON_INTERPRET=1, in a subprocess (the interpreter is chosen
when a kernel is first decorated, so it must not leak into this process).

The interpreter copies bytes exactly, so layout/cache/padding logic is checked
bit-exactly for every dtype; its fp32->bf16 cast truncates and its exp is
numpy's, so arithmetic (DupUp add: fp32/fp16 only; norm+SiLU: tolerance) is
held to what it can reproduce. The GPU tests check all of it bit-exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # the interpreter runs every launch in numpy

SCRIPT = textwrap.dedent(
    """
    import itertools, torch
    from vaed import kernels as K
    assert K.interpreter_active()
    CL = torch.channels_last_3d
    def lay(t, l):
        if l == "cl3d": return t.contiguous(memory_format=CL)
        if l == "ntchw": return t.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
        return t.contiguous()
    def same(a, b):
        assert a.stride() == b.stride(), (a.stride(), b.stride())
        assert torch.equal(a, b)
    torch.manual_seed(0)
    n = 0
    for dt, l, cf, pad, fr in itertools.product(
        (torch.bfloat16, torch.float16, torch.float32), ("cl3d", "contiguous", "ntchw"),
        (0, 1, 2), ((1, 1, 1, 1, 2, 0), (0, 0, 0, 0, 2, 0)), (1, 3)):
        x = lay(torch.randn(1, 3, fr + 1, 4, 5, dtype=dt), l)[:, :, 1:]
        c = lay(torch.randn(1, 3, 3, 4, 5, dtype=dt), l)[:, :, 3 - cf:] if cf else None
        got = K.causal_pad(x, c, pad)
        want = K.causal_pad_reference(x, c, pad)
        same(got[0], want[0]); same(got[1], want[1]); n += 1
        if cf == 0:
            got = K.causal_pad(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
            want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
            same(got[0], want[0]); same(got[1], want[1]); n += 1
        for il in (False, True):
            xe = lay(torch.randn(1, 4, 2, 3, 5, dtype=dt), l)
            same(K.upsample_nearest2x(xe, il), K.upsample_nearest2x_reference(xe, il)); n += 1
            nhwc = K.upsample_nearest2x(xe, il, channels_last=True)  # the fast tier's layout
            assert nhwc.is_contiguous(memory_format=torch.channels_last), nhwc.stride()
            assert torch.equal(nhwc, K.upsample_nearest2x_reference(xe, il)); n += 1
        if dt != torch.bfloat16 and pad[:4] == (1, 1, 1, 1):
            for ft, first in ((1, False), (2, False), (2, True)):
                src = lay(torch.randn(1, 4, 2, 3, 4, dtype=dt), "cl3d")
                m = lay(torch.randn(1, 2, 2 * ft - (ft - 1 if first else 0), 6, 8, dtype=dt), l)
                same(K.dupup_add(m, src, ft, 2, first), K.dupup_add_reference(m, src, ft, 2, first)); n += 1
    # DupUp3D add into a channels_last_3d main: the 2-D tile kernel (launches counted), B = 2,
    # repeat counts 1..16 (source channels C/8 .. 4C), source in either layout
    from vaed.kernels import dupup as D
    tile_launches = [0]
    tile_kernel = D._cl_kernel
    def counted():
        tile_launches[0] += 1
        return tile_kernel()
    D._cl_kernel = counted
    n_tile = 0
    for dt, (cm, cs), ft, first, sl in itertools.product(
        (torch.float16, torch.float32), ((3, 6), (8, 8), (8, 32), (6, 3)), (1, 2), (False, True), ("cl3d", "contiguous")):
        if ft == 1 and first:
            continue
        src = lay(torch.randn(2, cs, 2, 3, 5, dtype=dt), sl)
        m = lay(torch.randn(2, cm, 2 * ft - (ft - 1 if first else 0), 6, 10, dtype=dt), "cl3d")
        same(K.dupup_add(m, src, ft, 2, first), K.dupup_add_reference(m, src, ft, 2, first)); n += 1; n_tile += 1
    # an upsampler's deferred conv bias: added to main and rounded first, as the conv's own
    # bias pass rounds, so still exact; the flat kernel declines it
    for dt, first in itertools.product((torch.float16, torch.float32), (False, True)):
        src = lay(torch.randn(2, 4, 2, 3, 5, dtype=dt), "cl3d")
        m = lay(torch.randn(2, 8, 4 - int(first), 6, 10, dtype=dt), "cl3d")
        bias = torch.randn(8, dtype=dt)
        got = K.dupup_add(m, src, 2, 2, first, bias)
        same(got, K.dupup_add_reference(m, src, 2, 2, first, bias)); n += 1; n_tile += 1
        assert not torch.equal(got, K.dupup_add_reference(m, src, 2, 2, first))
        assert K.dupup_add(m.contiguous(), src, 2, 2, first, bias) is None
    assert tile_launches[0] == n_tile, (tile_launches[0], n_tile)
    D._cl_kernel = tile_kernel
    # one-sided spatial padding (a shard's interior edge), with and without the next-cache write
    for dt, l, cf, pad in itertools.product(
        (torch.bfloat16, torch.float32), ("cl3d", "contiguous"), (0, 2), ((0, 1, 1, 0, 2, 0), (2, 0, 0, 1, 2, 0))):
        x = lay(torch.randn(1, 3, 2, 4, 5, dtype=dt), l)
        c = lay(torch.randn(1, 3, 2, 4, 5, dtype=dt), l) if cf else None
        want = K.causal_pad_reference(x, c, pad)
        got = K.causal_pad(x, c, pad)
        same(got[0], want[0]); same(got[1], want[1]); n += 1
        got = K.causal_pad(x, c, pad, emit_cache=False)
        assert got[1] is None
        same(got[0], want[0]); n += 1
    # norm + SiLU prologue: same layout, values within the interpreter's exp error
    for dt, l in itertools.product((torch.float32, torch.bfloat16), ("cl3d", "contiguous")):
        x = lay(torch.randn(1, 6, 2, 4, 5, dtype=dt), l)
        c = lay(torch.randn(1, 6, 2, 4, 5, dtype=dt), l)
        g = (torch.rand(6, 1, 1, 1) + 0.5).to(dt)
        got = K.causal_pad(x, c, (1, 1, 1, 1, 2, 0), norm=K.NormSilu(g, 6 ** 0.5, 0.0, denom=K.norm_denominator(x)))
        want = K.causal_pad_reference(x, c, (1, 1, 1, 1, 2, 0), norm=K.NormSilu(g, 6 ** 0.5, 0.0))
        for a, b in zip(got, want):
            assert a.stride() == b.stride()
            torch.testing.assert_close(a, b, atol=1e-5 if dt == torch.float32 else 1e-1, rtol=1e-2)
        n += 1
    print("checked", n)
    """
)


def test_kernels_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checked" in r.stdout
