"""The engine's encode on the CPU: moments bit-identical to stock AutoencoderKLWan.encode (Wan2.1
and Wan2.2, fp32 and bf16, batch 2), frames fed in any pieces equal one-shot, the normalised
latents the Wan pipelines compute, a frame count that is not 1 + 4k refused, weights loaded from
a save_pretrained folder, and a decode-only engine that says it does not encode."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch

from vaed import patches as P
from vaed.engine import DecodeEngine
from vaed.engine_protocol import EncodeSpec
from vaed.models import build_random_vae

ARCHS = ["wan2.1-tiny", "wan2.2-tiny"]


def _video(t: int, dtype: torch.dtype, b: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, 3, t, 32, 48, generator=g) * 2 - 1).to(dtype)


@torch.no_grad()
def _stock_moments(vae: Any, x: torch.Tensor) -> torch.Tensor:
    return vae.encode(x.to(vae.dtype)).latent_dist.parameters


def _pipeline_latents(vae: Any, moments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """WanImageToVideoPipeline.prepare_latents's lines: the distribution's mode, cast, normalised."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    z = vae.config.z_dim
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to("cpu", dtype)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to("cpu", dtype)
    latent_condition = DiagonalGaussianDistribution(moments).mode().to(device="cpu", dtype=dtype)
    return (latent_condition - latents_mean) * latents_std


@pytest.fixture(scope="module", params=[(a, d) for a in ARCHS for d in ("float32", "bfloat16")],
                ids=lambda p: "-".join(p))
def engine_and_stock(request: pytest.FixtureRequest) -> tuple[DecodeEngine, Any]:
    arch, dtype = request.param
    engine = DecodeEngine.load(f"random:{arch}", device="cpu", dtype=dtype, encoder=True)
    stock = build_random_vae(arch).to(dtype=engine.dtype).eval().requires_grad_(False)
    return engine, stock


@pytest.mark.parametrize("t", [1, 5, 13])
def test_encode_video_bit_identical_to_stock(engine_and_stock: tuple[DecodeEngine, Any], t: int) -> None:
    engine, stock = engine_and_stock
    x = _video(t, engine.dtype, seed=t)
    want = _stock_moments(stock, x)
    moments, latents = engine.encode_video(x, EncodeSpec())
    assert latents is None
    assert moments.dtype == want.dtype
    assert moments.shape == want.shape == (2, 2 * engine.z_dim, 1 + (t - 1) // 4, *want.shape[3:])
    assert torch.equal(moments, want)


def test_frames_fed_in_pieces_equal_one_shot(engine_and_stock: tuple[DecodeEngine, Any]) -> None:
    """Pieces that split encoder calls anywhere (and empty ones): the same latent frames, each
    returned as soon as its call is full."""
    engine, stock = engine_and_stock
    x = _video(13, engine.dtype, seed=7)
    want = _stock_moments(stock, x)
    state = engine.new_encode_state()
    ready = []
    for a, b in [(0, 0), (0, 3), (3, 4), (4, 4), (4, 11), (11, 13)]:
        groups = engine.encode_frames(state, x[:, :, a:b], EncodeSpec())
        ready.append([g.latent_frame for g in groups])
        for g in groups:
            assert torch.equal(g.moments, want[:, :, g.latent_frame : g.latent_frame + 1])
    engine.end_encode(state)
    engine.free_encode(state)
    # frame 0 completes call 0; frames 1-4 call 1 (at frame 4); 5-8 call 2; 9-12 call 3
    assert ready == [[], [0], [], [], [1, 2], [3]]


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_normalised_latents_are_the_pipelines(engine_and_stock: tuple[DecodeEngine, Any], out: str) -> None:
    engine, stock = engine_and_stock
    dtype = getattr(torch, out)
    x = _video(5, engine.dtype, seed=3)
    moments, latents = engine.encode_video(x, EncodeSpec(latents=True, out_dtype=dtype))
    want = _stock_moments(stock, x)
    assert torch.equal(moments, want.to(dtype))
    assert latents is not None and latents.dtype == dtype
    assert torch.equal(latents, _pipeline_latents(stock, want, dtype))


@pytest.mark.parametrize("t", [0, 2, 4, 6, 8])
def test_frame_count_must_be_1_plus_4k(engine_and_stock: tuple[DecodeEngine, Any], t: int) -> None:
    engine, _ = engine_and_stock
    x = _video(t, engine.dtype)
    with pytest.raises(ValueError, match=rf"1 \+ 4k frames .* got {t}"):
        engine.encode_video(x, EncodeSpec())
    state = engine.new_encode_state()
    engine.encode_frames(state, x, EncodeSpec())
    with pytest.raises(ValueError, match=f"got {t}"):
        engine.end_encode(state)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_loop_runs_the_tree(arch: str) -> None:
    """With the tree's forwards installed over counted plain-torch ops (on the CPU the engine
    otherwise serves stock), the engine's calls walk the tree and still equal stock."""
    engine = DecodeEngine.load(f"random:{arch}", device="cpu", dtype="float32", encoder=True)
    calls: collections.Counter = collections.Counter()

    def wrap(name: str, fn: Any) -> Any:
        return lambda *a, **k: (calls.update([name]), fn(*a, **k))[1]

    counted = dataclasses.replace(P.REFERENCE_OPS, name="counting",
                                  **{n: wrap(n, getattr(P.REFERENCE_OPS, n)) for n in P.OP_NAMES})
    P.prepare_decoder(engine.vae, layout="contiguous", ops=counted)
    calls.clear()
    x = _video(9, torch.float32, seed=11)
    moments, _ = engine.encode_video(x, EncodeSpec())
    stock = build_random_vae(arch).eval().requires_grad_(False)
    assert torch.equal(moments, _stock_moments(stock, x))
    assert calls["norm_causal_pad"] > 0 and calls["conv2d"] > 0
    assert (calls["avgdown_add"] > 0) == arch.startswith("wan2.2")


def test_weights_from_a_saved_folder(tmp_path: Any) -> None:
    """A save_pretrained folder (seed 5, not the engine's default 0) loads with its encoder and
    encodes as diffusers' own from_pretrained model does."""
    from diffusers import AutoencoderKLWan

    build_random_vae("wan2.2-tiny", seed=5).save_pretrained(tmp_path / "vae")
    engine = DecodeEngine.load(str(tmp_path), device="cpu", dtype="float32", encoder=True)
    stock = AutoencoderKLWan.from_pretrained(str(tmp_path / "vae")).eval().requires_grad_(False)
    other = build_random_vae("wan2.2-tiny").eval()
    x = _video(5, torch.float32, seed=2)
    moments, _ = engine.encode_video(x, EncodeSpec())
    assert torch.equal(moments, _stock_moments(stock, x))
    assert not torch.equal(moments, _stock_moments(other, x))


def test_a_decode_only_engine_does_not_encode() -> None:
    engine = DecodeEngine.load("random:wan2.1-tiny", device="cpu", dtype="float32")
    assert not engine.encodes and engine.facts.encoder_convs == 0
    with pytest.raises(NotImplementedError, match="decoder-only"):
        engine.encode_video(_video(1, torch.float32), EncodeSpec())
    assert DecodeEngine.load("random:wan2.1-tiny", device="cpu", dtype="float32", encoder=True).encodes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_uint8_frames_convert_to_the_reference_bits_on_every_device(device: str) -> None:
    """The server converts uint8 frames where it encodes them (on the GPU, after a 1-byte copy):
    a lookup in 256 CPU-computed values, bit for bit the CPU formula diffusers' VideoProcessor
    uses, for every value and in a permuted (wire-layout) view; the formula itself run on CUDA
    can round differently (a scalar division there is a reciprocal multiplication), which is why
    the table exists."""
    from vaed.engine_protocol import rgb8_to_video, rgb8_to_video_reference

    wire = (torch.arange(2 * 5 * 8 * 8 * 3) % 256).to(torch.uint8).reshape(2, 5, 8, 8, 3)
    video = wire.permute(0, 4, 1, 2, 3)  # [B, 3, t, H, W], as EncodeSession views the wire's frames
    expected = rgb8_to_video_reference(video)
    got = rgb8_to_video(video.to(device))
    assert got.dtype == torch.float32 and got.device.type == device
    assert torch.equal(got.cpu().view(torch.int32), expected.view(torch.int32))
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(rgb8_to_video(every).view(torch.int32), rgb8_to_video_reference(every).view(torch.int32))
