"""The tiers as op sets: every op of FAST_OPS passes its start-up check against its reference;
whole decodes under each tier against stock diffusers with the same layout: the tiled lossless
set bit-identical, the fast set within its PSNR gate (GPU) or a tolerance (interpreter), and
lossless and fast sessions interleaved on one decoder.

Interpreter cases decode the tiny random VAEs with the exact norm prologue and the bf16
DupUp3D add switched off in the lossless-tiled set: they use exp and the bf16 cast, which the
interpreter does not reproduce (tests/backends.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vaed import patches as P
from vaed.models import build_random_vae
from vaed.patches.checks import check_op_set

from backends import Backend, kernel_cases
from harness import assert_same, assert_same_cache, chunked_decode


@kernel_cases("dtype", cuda=[(d,) for d in (torch.bfloat16, torch.float16, torch.float32)],
              interpreter=[(torch.float32,), (torch.bfloat16,)])
def test_fast_ops_pass_their_start_up_checks(backend: Backend, dtype) -> None:
    assert check_op_set(P.FAST_OPS, torch.device(backend.device), dtype) == {}, dtype


@kernel_cases("arch, dtype", interpreter=[("wan2.1-tiny", torch.float32), ("wan2.2-tiny", torch.bfloat16)])
def test_tiny_decodes_under_each_tier(backend: Backend, monkeypatch: Any, arch, dtype) -> None:
    """Fast within tolerance of stock (every residual block hands the residual kernel conv2's
    bias, counted); the tiled lossless ops exactly stock."""
    import vaed.patches.fast as fast_module

    residual_calls: list[bool] = []
    real_residual = fast_module.bias_residual_add

    def counted_residual(x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        residual_calls.append(bias is not None)
        return real_residual(x, h, bias)

    monkeypatch.setattr(fast_module, "bias_residual_add", counted_residual)
    torch.manual_seed(0)
    vae = build_random_vae(arch).to(dtype=dtype).eval().requires_grad_(False)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, 2, 3, dtype=dtype), "channels_last")
    with torch.no_grad():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        want = vae.decode(z, return_dict=False)[0]
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        assert set(rep.op_sets) == {"lossless", "fast"} and rep.ops == "lossless", rep
        assert rep.op_sets["fast"] == P.FAST_OPS, rep
        residual_calls.clear()  # prepare_decoder's start-up checks call it too
        with P.using(rep.ops_for("fast")):
            fast = vae.decode(z, return_dict=False)[0]
        assert residual_calls and all(residual_calls), (arch, residual_calls)
        # the ops that round to bf16 in a kernel (the interpreter truncates): held exact on the GPU
        with P.using(P.LOSSLESS_TILED_OPS.without({"norm_causal_pad", "dupup_add", "residual_add"})):
            tiled = vae.decode(z, return_dict=False)[0]
    assert fast.stride() == want.stride() and tiled.stride() == want.stride()
    assert torch.equal(tiled, want), (arch, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, want, atol=1e-4, rtol=1e-3)
    else:
        err = (fast.float() - want.float()).abs()
        assert err.max() < 0.1 and err.mean() < 0.01, (arch, err.max(), err.mean())



@kernel_cases("arch", cuda=[("wan2.1-tiny",), ("wan2.2-tiny",)], interpreter=[("wan2.1-tiny",)])
def test_fast_convs_read_channels_last(backend: Backend, monkeypatch: Any, arch) -> None:
    """Every conv of a fast decode reads a channels-last input, first chunk and steady ones: stock's
    chain turns NCDHW after the mid block's attention and at each up block's first conv (a
    one-frame input with ambiguous strides, then the cache it leaves), where cuDNN runs slower
    kernels (a 96-channel 3x3x3 conv at 480x832: 3.7 ms NCDHW, 1.4 ms channels-last on a plan)."""
    import vaed.patches.fast as fast_module
    import vaed.patches.ops as ops_module

    layouts: list[tuple[tuple[int, ...], bool]] = []
    real_conv = ops_module.conv_with_plan
    assert fast_module.conv_with_plan is real_conv

    def spied(x: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
        layouts.append((tuple(x.shape), x.is_contiguous(memory_format=fmt)))
        return real_conv(x, w, *args, **kwargs)

    monkeypatch.setattr(ops_module, "conv_with_plan", spied)  # the tier's conv3d and conv2d
    monkeypatch.setattr(fast_module, "conv_with_plan", spied)  # its unfolded and first-chunk convs
    torch.manual_seed(0)
    vae = build_random_vae(arch).to(device=backend.device, dtype=torch.bfloat16).eval().requires_grad_(False)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, 4, 6, device=backend.device,
                                        dtype=torch.bfloat16), "channels_last")
    with torch.no_grad():
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        assert rep.op_sets["fast"] == P.FAST_OPS, rep
        layouts.clear()  # the start-up checks' tiny convs
        with P.using(rep.ops_for("fast")):
            chunked_decode(vae, z)
    assert len(layouts) > 40, layouts  # the decoder's convs went through the tier's conv op
    assert [shape for shape, channels_last in layouts if not channels_last] == []


@kernel_cases("arch", cuda=[("wan2.1-tiny",), ("wan2.2-tiny",), ("wan2.2",)])
def test_lossless_padded_conv_inputs_are_channels_last(backend: Backend, monkeypatch: Any, arch) -> None:
    """Every padded conv input of a lossless decode is written channels-last, steady chunks too,
    where stock's chain gives NCDHW (after the mid block's attention; Wan2.2's NTCHW activations
    after each upsampler): cuDNN runs those convs channels-last either way (their weights are
    channels_last_3d), so the same decode without the copy it made of each such input; frames
    and session caches bit-identical to stock's, strides too."""
    import vaed.patches.ops as ops_module

    vae = _vae(arch, torch.bfloat16)
    torch.manual_seed(3)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 4, 4, 6, device="cuda", dtype=torch.bfloat16),
                            "channels_last")
    layouts: list[tuple[tuple[int, ...], bool]] = []
    real_conv = ops_module.conv_with_plan

    def spied(x: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() == 5 and w.shape[2:] != (1, 1, 1):  # a pointwise conv reads its input itself
            layouts.append((tuple(x.shape), x.is_contiguous(memory_format=torch.channels_last_3d)))
        return real_conv(x, w, *args, **kwargs)

    with torch.inference_mode():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        want, want_cache = _chunked(vae, z)
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless",))
        monkeypatch.setattr(ops_module, "conv_with_plan", spied)
        with P.using(rep.ops_for("lossless")):
            got, got_cache = _chunked(vae, z)
    assert len(layouts) > 40, layouts
    assert [shape for shape, channels_last in layouts if not channels_last] == []
    assert_same(got, want)
    assert_same_cache(got_cache, want_cache)


def _vae(arch: str, dtype: torch.dtype) -> Any:
    return build_random_vae(arch).to(device="cuda", dtype=dtype).eval().requires_grad_(False)


def _chunked(vae: Any, z: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The engine's loop, then diffusers' unpatchify (Wan2.2) and the clamp: decoded frames."""
    out, cache = chunked_decode(vae, z)
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=vae.config.patch_size)
    return out.clamp(-1, 1), cache


def _rgb8(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() * 0.5 + 0.5).clamp(0, 1) * 255).round()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (_rgb8(a) - _rgb8(b)).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0**2 / mse)).item()


@kernel_cases("arch, size, dtype", cuda=[(a, s, d) for d in (torch.bfloat16, torch.float32)
                                         for a, s in (("wan2.1-tiny", (3, 6, 8)), ("wan2.2-tiny", (3, 4, 6)), ("wan2.1", (3, 12, 16)))])
def test_tiled_lossless_bit_identical(backend: Backend, arch, size, dtype) -> None:
    vae = _vae(arch, dtype)
    torch.manual_seed(1)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, *size, device="cuda", dtype=dtype), "channels_last")
    with torch.inference_mode():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        want, want_cache = _chunked(vae, z)
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        assert set(rep.op_sets) == {"lossless", "fast"} and rep.disabled_ops == (), rep.skipped
        with P.using(P.LOSSLESS_TILED_OPS):
            got, got_cache = _chunked(vae, z)
    assert_same(got, want)
    assert_same_cache(got_cache, want_cache)


def _smooth(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Low-frequency latents: coarse noise, trilinearly upsampled."""
    b, c, t, h, w = shape
    coarse = torch.randn(b, c, max(t // 2, 1), max(h // 4, 1), max(w // 4, 1), generator=g, device="cuda")
    return F.interpolate(coarse, size=(t, h, w), mode="trilinear", align_corners=False) * 2


@kernel_cases("arch, size, kind", cuda=[(a, s, k) for k in ("white", "smooth")
                                        for a, s in (("wan2.1", (3, 16, 24)), ("wan2.2", (3, 16, 24)))])
def test_fast_psnr_gate(backend: Backend, arch, size, kind) -> None:
    """Fast keeps RGB8 PSNR against an fp32 decode within 0.5 dB of stock bf16's, and above 40 dB."""
    g = torch.Generator(device="cuda").manual_seed(3)
    vae32 = _vae(arch, torch.float32)
    shape = (1, vae32.config.z_dim, *size)
    z = torch.randn(shape, generator=g, device="cuda") if kind == "white" else _smooth(shape, g)
    with torch.inference_mode():
        P.prepare_decoder(vae32, kernels="off", layout="channels_last")
        ref, _ = _chunked(vae32, P.to_decoder_layout(z, "channels_last"))
        del vae32
        vae = _vae(arch, torch.bfloat16)
        zb = P.to_decoder_layout(z.to(torch.bfloat16), "channels_last")
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        stock, _ = _chunked(vae, zb)
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        with P.using(rep.ops_for("fast")):
            fast, _ = _chunked(vae, zb)
    p_stock, p_fast = _psnr(stock, ref), _psnr(fast, ref)
    assert p_fast >= p_stock - 0.5 and p_fast >= 40.0, (p_fast, p_stock)


@kernel_cases("", cuda=[()])
def test_lossless_and_fast_sessions_interleave(backend: Backend) -> None:
    """Two sessions on one decoder, chunks alternating between tiers: lossless stays bit-identical to stock."""
    vae = _vae("wan2.2-tiny", torch.bfloat16)
    z = P.to_decoder_layout(torch.randn(1, 6, 5, 4, 6, device="cuda", dtype=torch.bfloat16), "channels_last")
    n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    with torch.inference_mode():
        P.prepare_decoder(vae, kernels="off", layout="channels_last")
        x = vae.post_quant_conv(z)
        want = [vae.decoder(x[:, :, i : i + 1], feat_cache=c, feat_idx=[0], first_chunk=(i == 0))
                for c in [[None] * n] for i in range(x.shape[2])]  # fmt: skip
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        lossless, fast = rep.ops_for("lossless"), rep.ops_for("fast")
        c_l: list = [None] * n
        c_f: list = [None] * n
        for i in range(x.shape[2]):
            with P.using(fast):
                vae.decoder(x[:, :, i : i + 1], feat_cache=c_f, feat_idx=[0], first_chunk=(i == 0))
            with P.using(lossless):
                got = vae.decoder(x[:, :, i : i + 1], feat_cache=c_l, feat_idx=[0], first_chunk=(i == 0))
            assert_same(got, want[i])
