"""The engine's encode on a GPU (H200): the lossless op set's Triton kernels run on the encoder, and
its moments are bit-identical to stock AutoencoderKLWan.encode with the same weight layout (Wan2.1
and Wan2.2, bf16 and fp32, tiny and full-size), one-shot and fed in pieces."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vaed import kernels as K
from vaed import patches as P
from vaed.engine import DecodeEngine
from vaed.engine_protocol import EncodeSpec
from vaed.models import build_random_vae

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=[
    ("wan2.1-tiny", "bfloat16"), ("wan2.1-tiny", "float32"),
    ("wan2.2-tiny", "bfloat16"), ("wan2.2-tiny", "float32"),
    ("wan2.1", "bfloat16"), ("wan2.2", "bfloat16"),
], ids=lambda p: "-".join(p))
def engine_and_stock(request: pytest.FixtureRequest) -> tuple[DecodeEngine, Any]:
    arch, dtype = request.param
    engine = DecodeEngine.load(f"random:{arch}", device="cuda:0", dtype=dtype, encoder=True)
    assert engine.fast_paths.kernels == "triton" and engine.fast_paths.ops == "lossless"
    stock = build_random_vae(arch).to("cuda:0", engine.dtype).eval().requires_grad_(False)
    P.prepare_decoder(stock, kernels="off", layout=engine.fast_paths.layout)  # the same weight layout
    return engine, stock


@pytest.mark.parametrize("b,t,h,w", [(1, 1, 64, 64), (2, 9, 64, 96), (1, 13, 128, 160)])
def test_encode_bit_identical_to_stock_same_layout(
    engine_and_stock: tuple[DecodeEngine, Any], b: int, t: int, h: int, w: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, stock = engine_and_stock
    launches = []
    real = K.causal_pad
    monkeypatch.setattr(K, "causal_pad", lambda *a, **k: launches.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(b * 100 + t)
    x = (torch.rand(b, 3, t, h, w, generator=g) * 2 - 1).to("cuda:0", engine.dtype)
    with torch.no_grad():
        want = stock.encode(P.to_decoder_layout(x, engine.fast_paths.layout)).latent_dist.parameters
    moments, _ = engine.encode_video(x, EncodeSpec())
    assert launches  # the exact causal-input kernel ran on the encoder's convs
    assert moments.dtype == want.dtype and torch.equal(moments, want)
    state = engine.new_encode_state()
    pieces = [g.moments for a, e in [(0, 2), (2, 3), (3, t)]
              for g in engine.encode_frames(state, x[:, :, a:e], EncodeSpec())]
    engine.end_encode(state)
    assert torch.equal(torch.cat(pieces, 2), want)


def test_encode_480p_bit_identical_to_stock(engine_and_stock: tuple[DecodeEngine, Any]) -> None:
    """A real frame size (480x832, 9 frames: the first call and two steady ones)."""
    engine, stock = engine_and_stock
    x = (torch.rand(1, 3, 9, 480, 832, generator=torch.Generator().manual_seed(1)) * 2 - 1).to("cuda:0", engine.dtype)
    with torch.no_grad():
        want = stock.encode(P.to_decoder_layout(x, engine.fast_paths.layout)).latent_dist.parameters
    moments, _ = engine.encode_video(x, EncodeSpec())
    assert torch.equal(moments, want)


@pytest.mark.parametrize("model", ["random:wan2.1-tiny", "random:wan2.2-tiny", "random:wan2.1"])
def test_served_encode_bit_identical_to_stock_same_layout(model: str) -> None:
    """Through a real server (bf16, fused kernels, channels_last_3d) and the client: the moments
    equal stock's with the server's layout, one-shot and as an image plus trailing zeros."""
    from harness import make_config, serve_in_thread

    from vaed_client import VaeClient

    config = make_config(model, device="cuda:0", dtype="bfloat16", encode=True)
    with serve_in_thread(config) as running, VaeClient(running.target) as client:
        engine = running.server.pool.engine
        stock = build_random_vae(model.removeprefix("random:")).to("cuda:0", torch.bfloat16).eval()
        P.prepare_decoder(stock, kernels="off", layout=engine.fast_paths.layout)
        h, w = (64, 96) if model.endswith("tiny") else (480, 832)
        x = (torch.rand(1, 3, 9, h, w, generator=torch.Generator().manual_seed(2)) * 2 - 1).to(torch.bfloat16)
        i2v = torch.cat([x[:, :, :1], torch.zeros(1, 3, 8, h, w, dtype=torch.bfloat16)], 2)
        for frames in (x, i2v):
            with torch.no_grad():
                want = stock.encode(P.to_decoder_layout(frames.cuda(), engine.fast_paths.layout)).latent_dist.parameters
            assert torch.equal(client.encode(frames), want.cpu())
