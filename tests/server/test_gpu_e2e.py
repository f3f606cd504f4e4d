"""The served decode on a GPU (H200): bit-identical to stock diffusers with
the same weight layout, bf16 and fp32, Wan2.1- and Wan2.2-style models."""

from __future__ import annotations

import pytest
import torch

from vaed.patches import prepare_decoder
from vaed_client import VaeClient

from harness import make_config, serve_in_thread
from harness import diffusers_decode, rgb8

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=[
    ("random:wan2.1-tiny", "bfloat16", "auto"),
    ("random:wan2.1-tiny", "float32", "auto"),
    ("random:wan2.2-tiny", "bfloat16", "auto"),
    ("random:wan2.2-tiny", "float32", "auto"),
    ("random:wan2.1-tiny", "bfloat16", "off"),
    ("random:wan2.1", "bfloat16", "auto"),
    # decoder calls replayed from CUDA graphs (vaed.graphs): still bit-identical to stock
    ("random:wan2.1", "bfloat16", "auto", "graphs"),
    ("random:wan2.2-tiny", "float32", "auto", "graphs"),
], ids=lambda p: "-".join(p))
def gpu_server(request):
    model, dtype, kernels = request.param[:3]
    graphs = "on" if request.param[3:] == ("graphs",) else "off"
    config = make_config(model, device="cuda:0", dtype=dtype, kernels=kernels, cuda_graphs=graphs)
    with serve_in_thread(config) as running:
        yield running


def stock_reference(server):
    """Stock diffusers (no fast paths) with the server's weight layout."""
    ref = server.reference_vae()
    layout = server.server.pool.engine.fast_paths.layout
    prepare_decoder(ref, kernels="off", layout=layout)
    return ref, layout


@pytest.mark.parametrize("b,t,h,w", [(1, 1, 5, 7), (1, 3, 6, 8), (2, 5, 5, 7)])
def test_gpu_decode_bit_identical_to_stock_same_layout(gpu_server, b, t, h, w):
    ref, layout = stock_reference(gpu_server)
    g = torch.Generator().manual_seed(b * 100 + t)
    z = torch.randn(b, ref.config.z_dim, t, h, w, generator=g).to(ref.dtype)
    z_ref = z.cuda().contiguous(memory_format=torch.channels_last_3d) if layout == "channels_last" else z
    expected = diffusers_decode(ref, z_ref, raw_latents=False)
    with VaeClient(gpu_server.target) as client:
        raw = client.decode(z, format="raw")
        frames = client.decode(z)
        with client.session(format="raw") as session:
            start = 0
            for n in ([1, max(t - 2, 0), 1] if t > 2 else [t]):
                if n:
                    session.push(z[:, :, start : start + n])
                    start += n
            streamed = session.collect()
    assert raw.dtype == expected.dtype
    assert torch.equal(raw, expected)
    assert torch.equal(frames, rgb8(expected))
    assert torch.equal(streamed, raw)


def test_gpu_out_of_memory_is_resource_exhausted_and_server_survives():
    from vaed_client.errors import ResourceExhaustedError

    config = make_config("random:wan2.1", device="cuda:0", max_pixels=4096 * 4096, max_batch=64)
    with serve_in_thread(config) as server:
        total = torch.cuda.get_device_properties(0).total_memory
        # 4 x 2048x2048 frames needs far more than 3 GiB of activations. The cap counts what this
        # process holds already (weights, earlier tests' leftovers), so it is 3 GiB on top of that.
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(0) + 3 * 2**30) / total, 0)
        try:
            with VaeClient(server.target) as client:
                with pytest.raises(ResourceExhaustedError):
                    client.decode(torch.randn(4, 16, 2, 256, 256, dtype=torch.bfloat16))
                assert client.decode(torch.randn(1, 16, 2, 8, 8, dtype=torch.bfloat16)).shape == (1, 5, 64, 64, 3)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        assert server.active_sessions == 0
