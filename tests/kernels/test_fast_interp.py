"""The fast tier on the CPU under TRITON_INTERPRET=1 (in a subprocess, like test_kernels_interp).

The channels-last tile kernel is pure data movement without the norm, so it is
held bit-exact; the fast norm+SiLU prologue and whole FAST_OPS decodes are held
within a tolerance of the reference (the interpreter's exp is numpy's and its
bf16 cast truncates, so the GPU tests set the real quality bar).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # ~70 s of CPU under the interpreter

SCRIPT = textwrap.dedent(
    """
    import itertools, torch
    from vaed import kernels as K
    from vaed import patches as P
    from vaed.models import build_random_vae
    from vaed.patches.checks import check_op_set
    assert K.interpreter_active()
    CL = torch.channels_last_3d
    def lay(t, l):
        if l == "cl3d": return t.contiguous(memory_format=CL)
        if l == "ntchw": return t.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
        return t.contiguous()
    torch.manual_seed(0)
    n = 0
    # cache frames 0 and 2 (1 is the same code path as 2 with one frame fewer), the full and the
    # one-sided pad, 1 and 3 new frames: every branch of the kernel, in half the interpreter time
    for dt, cf, pad, fr in itertools.product(
        (torch.bfloat16, torch.float32), (0, 2),
        ((1, 1, 1, 1, 2, 0), (0, 1, 1, 0, 2, 0)), (1, 3)):
        x = lay(torch.randn(1, 5, fr + 1, 4, 6, dtype=dt), "cl3d")[:, :, 1:]
        c = lay(torch.randn(1, 5, 3, 4, 6, dtype=dt), "cl3d")[:, :, 3 - cf:] if cf else None
        for emit in (True, False):
            got = K.causal_pad_cl(x, c, pad, emit_cache=emit)
            want = K.causal_pad_reference(x, c, pad, emit_cache=emit)
            assert got is not None
            for a, b in zip(got, want):
                if b is None:
                    assert a is None
                    continue
                assert a.stride() == b.stride(), (a.stride(), b.stride())
                assert torch.equal(a, b), (dt, cf, pad, fr, emit)
            n += 1
        if cf == 0:
            got = K.causal_pad_cl(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
            want = K.causal_pad_reference(x, None, (0, 0, 0, 0, 2, 0), zero_history=True)
            assert all(a.stride() == b.stride() and torch.equal(a, b) for a, b in zip(got, want))
            n += 1
        g = (torch.rand(5, 1, 1, 1) + 0.5).to(dt)
        want = K.causal_pad_reference(x, c, pad, norm=K.NormSilu(g, 5 ** 0.5, 0.0))
        exact = K.NormSilu(g, 5 ** 0.5, 0.0, denom=K.norm_denominator(x))
        for kw in ({"norm_cl": K.NormSilu(g, 5 ** 0.5, 0.0)}, {"norm": exact}):
            got = K.causal_pad_cl(x, c, pad, **kw)
            for a, b in zip(got, want):
                assert a.stride() == b.stride()
                torch.testing.assert_close(a, b, atol=1e-5 if dt == torch.float32 else 2e-2, rtol=1e-4 if dt == torch.float32 else 2e-2)
            n += 1
    # unfold=3: the padded tensor's values, each frame stored in every slot it feeds (B=2: image
    # index b*TO+t), bit-exact against a naive unfolding; the next cache as without it
    def unfolded(p, kt):
        frames = [torch.cat([p[:, :, t + k] for k in range(kt)], 1) for t in range(p.shape[2] - kt + 1)]
        return torch.stack(frames, 1).flatten(0, 1)
    from vaed.patches.fast import unfolded_causal_conv, unfolded_norm_causal_conv
    from vaed.patches.ops import NormSilu
    pad = (1, 1, 1, 1, 2, 0)
    for dt, cf, fr in ((torch.bfloat16, 2, 3), (torch.bfloat16, 0, 1), (torch.float16, 1, 2)):
        x = lay(torch.randn(2, 5, fr, 4, 6, dtype=dt), "cl3d")
        c = lay(torch.randn(2, 5, cf, 4, 6, dtype=dt), "cl3d") if cf else None
        g = (torch.rand(5, 1, 1, 1) + 0.5).to(dt)
        for kw in ({}, {"norm_cl": K.NormSilu(g, 5 ** 0.5, 0.0)}):
            p, nx = K.causal_pad_cl(x, c, pad, **kw)
            u, nu = K.causal_pad_cl(x, c, pad, unfold=3, **kw)
            assert u.shape == (2 * fr, 15, 6, 8) and u.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(u, unfolded(p, 3)) and torch.equal(nu, nx), (dt, cf, fr, kw.keys())
            n += 1
        # the fused norm site (unfolded conv2d) against the fast pair (norm conv input, then conv3d)
        conv = torch.nn.Conv3d(5, 5, 3).to(dt)
        conv.weight.data = conv.weight.data.contiguous(memory_format=CL)
        ns = NormSilu(g, 5 ** 0.5, 0.0)
        assert unfolded_norm_causal_conv(conv, x, c, pad, norm=ns) is None  # CUDA only
        got = unfolded_causal_conv(conv, x, c, pad, ns)
        want = P.FAST_OPS.without({"norm_causal_conv"}).causal_conv(conv, x, c, pad, norm=ns)
        assert got[0].is_contiguous(memory_format=CL) and torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
        n += 1
        p, nx = K.causal_pad_cl(x.float(), None if c is None else c.float(), pad)  # the kernel's unfold in fp32
        u, nu = K.causal_pad_cl(x.float(), None if c is None else c.float(), pad, unfold=3)
        assert torch.equal(u, unfolded(p, 3)) and torch.equal(nu, nx)
        assert unfolded_causal_conv(conv.float(), x.float(), None if c is None else c.float(), pad,
                                    NormSilu(g.float(), 5 ** 0.5, 0.0)) is None  # half dtypes only
    # a deferred conv bias (NormSilu.x_bias): the fast prologue adds it before the norm, as the
    # reference does with x + bias first; the unfolded conv leaves its own bias out on request
    for dt in (torch.float32, torch.bfloat16):
        tol = {"atol": 1e-5, "rtol": 1e-4} if dt == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        x = lay(torch.randn(2, 5, 2, 4, 6, dtype=dt), "cl3d")
        c = lay(torch.randn(2, 5, 2, 4, 6, dtype=dt), "cl3d")
        g = (torch.rand(5, 1, 1, 1) + 0.5).to(dt)
        xb = (torch.randn(5) * 3).to(dt)
        want = K.causal_pad_reference(x + xb.view(1, -1, 1, 1, 1), c, pad, norm=K.NormSilu(g, 5 ** 0.5, 0.0))
        got = K.causal_pad_cl(x, c, pad, norm_cl=K.NormSilu(g, 5 ** 0.5, 0.0, xb))
        without = K.causal_pad_cl(x, c, pad, norm_cl=K.NormSilu(g, 5 ** 0.5, 0.0))
        for a, b in zip(got, want):
            assert a.stride() == b.stride()
            torch.testing.assert_close(a, b, **tol)
        assert not torch.allclose(got[0].float(), without[0].float(), **tol)  # the bias is not ignored
        n += 1
        got = P.FAST_OPS.norm_causal_pad(x, c, pad, norm=NormSilu(g, 5 ** 0.5, 0.0, xb))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)
        n += 1
    x = lay(torch.randn(2, 5, 3, 4, 6, dtype=torch.bfloat16), "cl3d")
    g = (torch.rand(5, 1, 1, 1) + 0.5).to(torch.bfloat16)
    xb = torch.randn(5, dtype=torch.bfloat16)
    conv = torch.nn.Conv3d(5, 5, 3).to(torch.bfloat16)
    conv.weight.data = conv.weight.data.contiguous(memory_format=CL)
    deferred = NormSilu(g, 5 ** 0.5, 0.0, xb)
    got, _ = unfolded_causal_conv(conv, x, None, pad, deferred, bias=False)
    padded, _ = P.REFERENCE_OPS.causal_conv_input(x, None, pad, norm=deferred)
    want = torch.nn.functional.conv3d(padded.float(), conv.weight.float())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    with_bias, _ = unfolded_causal_conv(conv, x, None, pad, deferred)
    torch.testing.assert_close(with_bias.float(), want + conv.bias.float().view(1, -1, 1, 1, 1), atol=3e-2, rtol=3e-2)
    n += 1
    # the residual add with conv2's bias: (x + bias) + h in fp32, one rounding; exact against its
    # reference where the interpreter's cast rounds (fp32, fp16), within a bf16 ulp otherwise
    for dt, with_bias, b in itertools.product((torch.float32, torch.float16, torch.bfloat16), (True, False), (1, 2)):
        x = lay(torch.randn(b, 7, 3, 4, 5, dtype=dt), "cl3d")
        h = lay(torch.randn(b, 7, 3, 4, 5, dtype=dt), "cl3d")
        bias = torch.randn(7, dtype=dt) if with_bias else None
        got = K.bias_residual_add(x, h, bias)
        want = K.bias_residual_add_reference(x, h, bias)
        assert got.stride() == (x + h).stride() and got.dtype == dt
        if dt == torch.bfloat16:
            torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
        else:
            assert torch.equal(got, want), (dt, with_bias, b)
        torch.testing.assert_close(P.FAST_OPS.residual_add(x, h, bias).float(),
                                   P.REFERENCE_OPS.residual_add(x, h, bias).float(), atol=3e-2, rtol=3e-2)
        n += 1
    x = torch.randn(1, 7, 3, 4, 5)
    assert K.bias_residual_add(x, x, None) is None  # contiguous: the reference's aten add
    assert K.bias_residual_add(lay(x, "cl3d"), x, None) is None  # one of them not channels-last
    # one frame (T = 1): producers leave different strides on the size-1 dim; still one pass
    x1 = lay(torch.randn(1, 7, 1, 4, 5), "cl3d")
    h1 = lay(torch.randn(1, 7, 1, 4, 5), "cl3d")
    h1 = h1.as_strided(h1.shape, (140, 1, 7, 35, 7))  # same bytes, another T stride
    assert x1.stride() != h1.stride()
    b7 = torch.randn(7)
    got = K.bias_residual_add(x1, h1, b7)
    assert got is not None and got.stride() == (x1 + h1).stride()
    assert torch.equal(got, K.bias_residual_add_reference(x1, h1, b7))
    # only the measured shape of conv: channels in = out <= UNFOLD_MAX_CHANNELS, stride 1
    x = lay(torch.randn(1, 5, 1, 4, 6, dtype=torch.bfloat16), "cl3d")
    g = (torch.rand(5, 1, 1, 1) + 0.5).to(torch.bfloat16)
    for conv in (torch.nn.Conv3d(5, 4, 3), torch.nn.Conv3d(5, 5, 3, stride=(1, 2, 2)), torch.nn.Conv3d(5, 5, (1, 3, 3))):
        conv = conv.to(torch.bfloat16)
        assert unfolded_causal_conv(conv, x, None, pad, NormSilu(g, 5 ** 0.5, 0.0)) is None, conv
    wide = lay(torch.randn(1, 128, 1, 2, 2, dtype=torch.bfloat16), "cl3d")
    g128 = torch.ones(128, 1, 1, 1, dtype=torch.bfloat16)
    conv = torch.nn.Conv3d(128, 128, 3).to(torch.bfloat16)
    assert unfolded_causal_conv(conv, wide, None, pad, NormSilu(g128, 128 ** 0.5, 0.0)) is None
    # layouts the aten chain writes contiguous are left to the 1-D kernel
    xc = torch.randn(1, 5, 2, 4, 6)
    assert K.causal_pad_cl(xc, None, (1, 1, 1, 1, 2, 0)) is None
    for dt in (torch.float32, torch.bfloat16):
        assert check_op_set(P.FAST_OPS, torch.device("cpu"), dt) == {}, dt
    # whole tiny decodes (the residual kernel counted: every residual block hands it conv2's
    # bias under the fast tier): fast within tolerance of stock; the tiled lossless ops exactly stock (with
    # the norm prologue and the bf16 DupUp3D add off: the interpreter's exp and bf16 cast are not CUDA's)
    import vaed.patches.fast as fast_module
    residual_calls = []
    real_residual = fast_module.bias_residual_add
    def counted_residual(x, h, bias=None):
        residual_calls.append(bias is not None)
        return real_residual(x, h, bias)
    fast_module.bias_residual_add = counted_residual
    for arch, dt in (("wan2.1-tiny", torch.float32), ("wan2.2-tiny", torch.bfloat16)):
        if True:
            vae = build_random_vae(arch).to(dtype=dt).eval().requires_grad_(False)
            z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, 2, 3, dtype=dt), "channels_last")
            with torch.no_grad():
                P.prepare_decoder(vae, kernels="off", layout="channels_last")
                want = vae.decode(z, return_dict=False)[0]
                rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
                assert set(rep.op_sets) == {"lossless", "fast"} and rep.ops == "lossless", rep
                assert rep.op_sets["fast"] == P.FAST_OPS, rep
                residual_calls.clear()
                with P.using(rep.ops_for("fast")):
                    fast = vae.decode(z, return_dict=False)[0]
                assert residual_calls and all(residual_calls), (arch, residual_calls)
                with P.using(P.LOSSLESS_TILED_OPS.without({"norm_causal_pad", "dupup_add"})):
                    tiled = vae.decode(z, return_dict=False)[0]
            assert fast.stride() == want.stride() and tiled.stride() == want.stride()
            assert torch.equal(tiled, want), (arch, dt)
            if dt == torch.float32:
                torch.testing.assert_close(fast, want, atol=1e-4, rtol=1e-3)
            else:
                err = (fast.float() - want.float()).abs()
                assert err.max() < 0.1 and err.mean() < 0.01, (arch, err.max(), err.mean())
            n += 1
    print("checked", n)
    """
)


def test_fast_tier_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checked" in r.stdout
