"""The encoder in the one tree, on the CPU: WanEncoder3d's installed forwards over REFERENCE_OPS
equal stock diffusers (moments and every cache slot), the tree walked directly on a stock encoder
equals stock, the downsamplers' whole-call fallbacks, and the avgdown_add op and its check."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
from harness import assert_same

from vaed import patches as P
from vaed.models import build_random_vae
from vaed.patches.checks import check_op
from vaed.patches.ops import reference_avgdown_add

ARCHS = ["wan2.1-tiny", "wan2.2-tiny"]


def _vae(arch: str, dtype: torch.dtype = torch.float32) -> Any:
    return build_random_vae(arch).to(dtype=dtype).eval().requires_grad_(False)


def _counting(ops: P.OpSet) -> tuple[P.OpSet, collections.Counter]:
    calls: collections.Counter = collections.Counter()

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            calls[name] += 1
            return fn(*a, **k)

        return counted

    fields = {n: wrap(n, getattr(ops, n)) for n in P.OP_NAMES}
    return dataclasses.replace(ops, name="counting", uses_triton=False, **fields), calls


def _video(vae: Any, t: int, dtype: torch.dtype, layout: str = "contiguous", b: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(t * 10 + b)
    x = (torch.rand(b, 3, t, 32, 48, generator=g) * 2 - 1).to(dtype)
    return P.to_decoder_layout(x, layout)


def _encoder_loop(vae: Any, x: torch.Tensor, calls: list[int]) -> tuple[torch.Tensor, list]:
    """AutoencoderKLWan._encode's loop with its cache list kept (frames per call in ``calls``)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    if vae.config.patch_size is not None:
        x = patchify(x, patch_size=vae.config.patch_size)
    cache: list = [None] * vae._cached_conv_counts["encoder"]
    outs, start = [], 0
    for n in calls:
        outs.append(vae.encoder(x[:, :, start : start + n], feat_cache=cache, feat_idx=[0]))
        start += n
    return vae.quant_conv(torch.cat(outs, 2)), cache


def _same_cache(got: list, want: list) -> None:
    assert len(got) == len(want)
    assert any(b is not None for b in want)
    for a, b in zip(got, want, strict=True):
        if b is None:  # the list has a slot per causal conv; 1x1x1 shortcuts keep none
            assert a is None
        else:
            assert_same(a, b)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_installed_encoder_bit_identical_to_stock(arch: str, layout: str, dtype: torch.dtype) -> None:
    """vae.encode with the table's forwards over (counted) REFERENCE_OPS: the same moments as the
    unpatched VAE with the same layout, every cache slot too, and the ops were called."""
    vae = _vae(arch, dtype)
    x = _video(vae, 9, dtype, layout, b=2)
    ops, calls = _counting(P.REFERENCE_OPS)
    with torch.no_grad():
        P.prepare_decoder(vae, kernels="off", layout=layout)
        want = vae.encode(x).latent_dist.parameters
        want_loop, want_cache = _encoder_loop(vae, x, [1, 4, 4])
        P.prepare_decoder(vae, layout=layout, ops=ops)
        calls.clear()
        got = vae.encode(x).latent_dist.parameters
        got_loop, got_cache = _encoder_loop(vae, x, [1, 4, 4])
    s = vae.config.scale_factor_spatial
    assert want.shape == (2, 2 * vae.config.z_dim, 3, 32 // s, 48 // s)
    assert_same(got, want)
    assert_same(got_loop, want_loop)
    assert torch.equal(want_loop, want)  # the loop above is the one diffusers runs
    _same_cache(got_cache, want_cache)
    used = {"causal_pad", "norm_causal_pad", "conv3d", "conv2d", "residual_add", "norm_causal_conv"}
    if arch.startswith("wan2.2"):
        used.add("avgdown_add")
    assert {n for n, c in calls.items() if c} == used
    # the time downsamples ran their cached conv (calls 2 and 3 x 2 downsample3d) and conv_in/conv_out
    assert calls["causal_pad"] >= 2 * 2 * 2


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tree_walked_on_a_stock_encoder_equals_stock(arch: str) -> None:
    """tree.encode (strict, as a shard would walk it) on an unpatched encoder: every call equals
    stock's and writes the same cache list."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    from vaed.patches import tree

    vae = _vae(arch)
    x = _video(vae, 5, torch.float32)
    with torch.no_grad():
        want, want_cache = _encoder_loop(vae, x, [1, 4])
        xp = patchify(x, patch_size=vae.config.patch_size) if vae.config.patch_size else x
        cache: list = [None] * len(want_cache)
        outs = [tree.encode(P.REFERENCE_OPS, vae.encoder, xp[:, :, :1], cache, strict=True),
                tree.encode(P.REFERENCE_OPS, vae.encoder, xp[:, :, 1:5], cache, strict=True)]
        got = vae.quant_conv(torch.cat(outs, 2))
    assert_same(got, want)
    _same_cache(cache, want_cache)


def _act(m: Any, seed: int) -> torch.Tensor:
    return torch.randn(1, m.dim, 3, 4, 6, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_encoder_whole_call_fallbacks_run_stock(arch: str) -> None:
    """No cache (the encoder, or a downsampler called alone) and autograd: stock results; the
    downsamplers called without a cache take the op path (no time conv, as stock)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample, patchify

    vae = _vae(arch)
    x = _video(vae, 5, torch.float32)
    xp = patchify(x, patch_size=vae.config.patch_size) if vae.config.patch_size else x
    downs = [m for m in vae.encoder.modules() if isinstance(m, WanResample)]
    assert {m.mode for m in downs} == {"downsample2d", "downsample3d"}
    with torch.no_grad():
        want_nocache = vae.encoder(xp[:, :, :1])  # Wan2.2 without a cache takes one frame only
        want_down = [m(_act(m, i)) for i, m in enumerate(downs)]
    with torch.enable_grad():
        want_grad = vae.encode(x).latent_dist.parameters
    ops, calls = _counting(P.REFERENCE_OPS)
    P.prepare_decoder(vae, layout="contiguous", ops=ops)
    calls.clear()
    with torch.enable_grad():
        got_grad = vae.encode(x).latent_dist.parameters
    assert sum(calls.values()) == 0
    with torch.no_grad():
        got_nocache = vae.encoder(xp[:, :, :1])
        got_down = [m(_act(m, i)) for i, m in enumerate(downs)]
    assert calls["conv2d"] > 0 and calls["norm_causal_pad"] == 0
    assert_same(got_grad, want_grad)
    assert_same(got_nocache, want_nocache)
    for a, b in zip(got_down, want_down, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("factor_t,frames", [(2, 1), (2, 4), (1, 3)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_avgdown_add_reference_is_the_module_chain(factor_t: int, frames: int, layout: str) -> None:
    """main + AvgDown3D(source): the first chunk's single frame is front-padded in time, as stock."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AvgDown3D

    g = torch.Generator().manual_seed(frames)
    src = P.to_decoder_layout(torch.randn(1, 4, frames, 4, 6, generator=g), layout)
    sc = AvgDown3D(4, 8, factor_t=factor_t, factor_s=2)
    main = P.to_decoder_layout(torch.randn(1, 8, (frames + factor_t - 1) // factor_t, 2, 3, generator=g), layout)
    assert_same(reference_avgdown_add(main, src, factor_t, 2, 8), main + sc(src))


def test_avgdown_add_start_up_check() -> None:
    """The op's start-up cases run: a copy of the reference passes, an off-by-a-bit one fails."""
    cpu, f32 = torch.device("cpu"), torch.float32
    same = dataclasses.replace(P.REFERENCE_OPS, avgdown_add=lambda *a: reference_avgdown_add(*a))
    assert check_op(same, "avgdown_add", cpu, f32) is None
    off = dataclasses.replace(P.REFERENCE_OPS, avgdown_add=lambda m, *a: reference_avgdown_add(m * 1.001, *a))
    assert "values" in (check_op(off, "avgdown_add", cpu, f32) or "")
