"""`RemoteAutoencoderKLWan` inside a real diffusers `WanPipeline`.

A tiny random WanTransformer3DModel, the tiny random VAE `random:wan2.1-tiny`
served in-process, a flow-matching scheduler, and prompt embeddings passed in
(no tokenizer or text encoder). The same pipeline with the local
AutoencoderKLWan of the same weights is the reference: every output type must
be equal exactly (CPU fp32; on CUDA with the served layout, see the cuda test).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
# WanPipeline's module imports transformers (tokenizer/text-encoder types) even
# though these tests pass prompt embeddings: it must be installed to build one.
pytest.importorskip("transformers")

from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel  # noqa: E402

from harness import CUDA, make_config, serve_in_thread  # noqa: E402
from vaed_client import RemoteAutoencoderKLWan, VaeClient  # noqa: E402

TEXT_DIM = 32
FRAMES, HEIGHT, WIDTH = 9, 32, 32  # 3 latent frames of 4x4 (tiny VAE: 8x spatial)


def tiny_transformer(z_dim: int) -> Any:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z_dim,
        out_channels=z_dim, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()


def make_pipe(vae: Any, device: str = "cpu") -> Any:
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=tiny_transformer(vae.config.z_dim))
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def run(pipe: Any, output_type: str, device: str = "cpu") -> Any:
    g = torch.Generator("cpu").manual_seed(0)
    embeds = torch.randn(2, 8, TEXT_DIM, generator=g).to(device)  # batch of 2 prompts
    out = pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=HEIGHT, width=WIDTH,
               num_frames=FRAMES, num_inference_steps=2, guidance_scale=2.0,
               generator=torch.Generator("cpu").manual_seed(1), output_type=output_type)
    return out.frames


def assert_same(local: Any, remote: Any, output_type: str) -> None:
    if output_type == "np":
        assert isinstance(remote, np.ndarray) and remote.dtype == local.dtype and remote.shape == local.shape
        assert np.array_equal(remote, local)
    elif output_type in ("pt", "latent"):
        assert remote.dtype == local.dtype and remote.shape == local.shape and torch.equal(remote.cpu(), local.cpu())
    else:  # pil: per batch item, a list of images
        assert len(remote) == len(local) == 2
        for a, b in zip(local, remote):
            assert len(a) == len(b) == FRAMES
            assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def served() -> Iterator[Any]:
    with serve_in_thread(make_config("random:wan2.1-tiny")) as running:
        yield running


@pytest.fixture(scope="module")
def pipes(served: Any) -> Iterator[tuple[Any, Any, Any]]:
    remote = RemoteAutoencoderKLWan(served.target)
    yield make_pipe(served.reference_vae()), make_pipe(remote), remote
    remote.close()


@pytest.mark.parametrize("output_type", ["np", "pt", "pil", "latent"])
def test_pipeline_outputs_equal_local_vae(pipes: tuple[Any, Any, Any], output_type: str) -> None:
    local_pipe, remote_pipe, _ = pipes
    local = run(local_pipe, output_type)
    remote = run(remote_pipe, output_type)
    assert_same(local, remote, output_type)
    if output_type == "np":  # a real video, not a constant that any decoder would match
        assert local.shape == (2, FRAMES, HEIGHT, WIDTH, 3) and local.std() > 0.01
        assert not np.array_equal(local[0], local[1])


def test_remote_vae_looks_like_the_local_one(served: Any, pipes: tuple[Any, Any, Any]) -> None:
    local_pipe, remote_pipe, remote = pipes
    local = served.reference_vae()
    for key in ("z_dim", "scale_factor_temporal", "scale_factor_spatial"):
        assert remote.config[key] == getattr(remote.config, key) == local.config[key]
    # Pipelines build torch.tensor(latents_mean/std): the float32 values must match.
    for key in ("latents_mean", "latents_std"):
        assert torch.equal(torch.tensor(remote.config[key]), torch.tensor(local.config[key]))
    assert remote.dtype == local.dtype == torch.float32 and remote.device == torch.device("cpu")
    assert remote_pipe.vae is remote and remote_pipe.device == torch.device("cpu")
    assert remote_pipe._execution_device == torch.device("cpu")
    assert remote_pipe.vae_scale_factor_spatial == local_pipe.vae_scale_factor_spatial
    with pytest.raises(NotImplementedError, match="encoder="):
        remote.encode(torch.zeros(1, 3, 1, 8, 8))


def test_decode_matches_local_decode_and_follows_dtype(served: Any, pipes: tuple[Any, Any, Any]) -> None:
    _, _, remote = pipes
    local = served.reference_vae()
    z = torch.randn(1, local.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = local.decode(z, return_dict=False)[0]
    out = remote.decode(z)
    assert out.sample.dtype == torch.float32 and torch.equal(out.sample, want)
    assert torch.equal(remote.decode(z, return_dict=False)[0], want)
    # pipe.to(dtype) casts the module; decode then answers in z's dtype.
    remote.to(torch.bfloat16)
    try:
        assert remote.dtype == torch.bfloat16
        half = remote.decode(z.to(torch.bfloat16)).sample
        assert half.dtype == torch.bfloat16 and half.shape == want.shape
    finally:
        remote.to(torch.float32)


def test_pipe_vae_assignment(served: Any) -> None:
    remote = RemoteAutoencoderKLWan(VaeClient(served.target))
    pipe = make_pipe(served.reference_vae())
    local = run(pipe, "np")
    pipe.vae = remote
    assert np.array_equal(run(pipe, "np"), local)
    remote.close()


@pytest.mark.cuda
def test_pipeline_on_cuda_equals_local_vae_same_layout() -> None:
    """On the GPU the server runs channels_last_3d (cl3d) weights and the fused
    kernels, bit-identical to stock diffusers *with the same layout*, so the
    reference local VAE is moved to channels_last_3d too."""
    assert CUDA
    with serve_in_thread(make_config("random:wan2.1-tiny", device="cuda:0", dtype="float32")) as running:
        local_vae = running.reference_vae()
        if running.server.worker.engine is not None and getattr(running.server.worker.engine, "layout", "") in (
            "channels_last", "channels_last_3d"
        ):
            local_vae = local_vae.to(memory_format=torch.channels_last_3d)
        remote = RemoteAutoencoderKLWan(running.target)
        assert remote.dtype == torch.float32
        local_pipe = make_pipe(local_vae, "cuda")
        remote_pipe = make_pipe(remote, "cuda")
        assert remote.device.type == "cuda" and remote_pipe._execution_device.type == "cuda"
        for output_type in ("np", "pt", "pil", "latent"):
            assert_same(run(local_pipe, output_type, "cuda"), run(remote_pipe, output_type, "cuda"), output_type)
        remote.close()
