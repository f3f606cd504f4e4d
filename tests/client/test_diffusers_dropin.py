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

from diffusers import (  # noqa: E402
    FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel,
)

from harness import CUDA, make_config, serve_in_thread  # noqa: E402
from vaed_client import RemoteAutoencoderKLWan, VaeClient  # noqa: E402

TEXT_DIM = 32
FRAMES = 9  # 3 latent frames
# Latents are 6x6: below ~12 latent pixels per frame the CPU 1x1x1 post_quant_conv takes another vector
# path for one frame than for T frames, and vaed applies it per latent frame (see vaed.engine).
# Per model: (pixel size giving 6x6 latents, WanPipeline(expand_timesteps=...)): Wan2.1 is 8x spatial;
# Wan2.2 (TI2V-5B layout: 2x2 patches, 16x spatial) runs WanPipeline with expand_timesteps=True.
MODELS = {"random:wan2.1-tiny": (48, False), "random:wan2.2-tiny": (96, True)}


def tiny_transformer(z_dim: int, in_channels: int | None = None) -> Any:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels or z_dim,
        out_channels=z_dim, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,  # 480p latents: 52 patches wide
    ).eval()


def make_pipe(vae: Any, device: str = "cpu", expand_timesteps: bool = False) -> Any:
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=tiny_transformer(vae.config.z_dim), expand_timesteps=expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def run(pipe: Any, output_type: str, device: str = "cpu", hw: tuple[int, int] | None = None) -> Any:
    g = torch.Generator("cpu").manual_seed(0)
    embeds = torch.randn(2, 8, TEXT_DIM, generator=g).to(device)  # batch of 2 prompts
    size = 6 * pipe.vae_scale_factor_spatial  # 6x6 latents unless hw is given
    height, width = hw or (size, size)
    out = pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=height, width=width,
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


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest) -> Iterator[Any]:
    with serve_in_thread(make_config(request.param)) as running:
        yield running


@pytest.fixture(scope="module")
def pipes(served: Any) -> Iterator[tuple[Any, Any, Any]]:
    expand = MODELS[served.config.model][1]
    remote = RemoteAutoencoderKLWan(served.target)
    yield make_pipe(served.reference_vae(), expand_timesteps=expand), make_pipe(remote, expand_timesteps=expand), remote
    remote.close()


@pytest.mark.parametrize("output_type", ["np", "pt", "pil", "latent"])
def test_pipeline_outputs_equal_local_vae(pipes: tuple[Any, Any, Any], output_type: str) -> None:
    local_pipe, remote_pipe, _ = pipes
    local = run(local_pipe, output_type)
    remote = run(remote_pipe, output_type)
    assert_same(local, remote, output_type)
    if output_type == "np":  # a real video, not a constant that any decoder would match
        size = MODELS[remote_pipe.vae.config.remote_model][0]
        assert local.shape == (2, FRAMES, size, size, 3) and local.std() > 0.01
        assert not np.array_equal(local[0], local[1])


def test_remote_vae_looks_like_the_local_one(served: Any, pipes: tuple[Any, Any, Any]) -> None:
    local_pipe, remote_pipe, remote = pipes
    local = served.reference_vae()
    assert remote.config.remote_model == served.config.model
    for key in ("z_dim", "scale_factor_temporal", "scale_factor_spatial", "patch_size"):
        assert remote.config[key] == getattr(remote.config, key) == local.config[key]
    # Pipelines build torch.tensor(latents_mean/std): the float32 values must match.
    for key in ("latents_mean", "latents_std"):
        assert torch.equal(torch.tensor(remote.config[key]), torch.tensor(local.config[key]))
    assert remote.dtype == local.dtype == torch.float32 and remote.device == torch.device("cpu")
    # accelerate's offload hook reads next(module.parameters()): one empty parameter, no weights
    (anchor,) = remote.parameters()
    assert anchor.numel() == 0 and anchor.dtype == remote.dtype and not anchor.requires_grad
    assert remote_pipe.vae is remote and remote_pipe.device == torch.device("cpu")
    assert remote_pipe._execution_device == torch.device("cpu")
    assert remote_pipe.vae_scale_factor_spatial == local_pipe.vae_scale_factor_spatial
    with pytest.raises(NotImplementedError, match="encoder="):
        remote.encode(torch.zeros(1, 3, 1, 8, 8))


def test_decode_matches_local_decode_and_follows_dtype(served: Any, pipes: tuple[Any, Any, Any]) -> None:
    _, _, remote = pipes
    local = served.reference_vae()
    z = torch.randn(1, local.config.z_dim, 3, 6, 6, generator=torch.Generator().manual_seed(3))
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


def test_offload_hook_moves_the_remote_vae(served: Any, pipes: tuple[Any, Any, Any]) -> None:
    """enable_model_cpu_offload() runs accelerate's CpuOffload hook before decode: it reads the
    module's first parameter and moves the module to the execution device (here the CPU)."""
    import accelerate  # a test dependency
    local_pipe, _, _ = pipes
    remote = RemoteAutoencoderKLWan(served.target)
    want = run(local_pipe, "np")
    pipe = make_pipe(remote, expand_timesteps=MODELS[served.config.model][1])
    _, hook = accelerate.cpu_offload_with_hook(remote, execution_device=torch.device("cpu"))
    assert getattr(remote, "_hf_hook", None) is not None
    assert np.array_equal(run(pipe, "np"), want)
    hook.offload()
    assert remote.device == torch.device("cpu")
    remote.close()


def test_lighter_rgb8_wire_format(served: Any, pipes: tuple[Any, Any, Any]) -> None:
    """wire_format="rgb8": uint8 on the wire; PIL frames equal the exact path's (fp32 server),
    np within 1/510, and the frames are not simply the exact ones (the option is really lighter)."""
    local_pipe, _, _ = pipes
    remote = RemoteAutoencoderKLWan(served.target, wire_format="rgb8")
    pipe = make_pipe(remote, expand_timesteps=MODELS[served.config.model][1])
    assert_same(run(local_pipe, "pil"), run(pipe, "pil"), "pil")
    want, got = run(local_pipe, "np"), run(pipe, "np")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.abs(got - want).max() <= 1 / 510 + 1e-6 and not np.array_equal(got, want)
    assert np.array_equal(np.round(got * 255), np.round(want * 255))
    with pytest.raises(ValueError, match="wire_format"):
        RemoteAutoencoderKLWan(served.target, wire_format="jpeg")
    remote.close()


def test_pipe_vae_assignment(served: Any) -> None:
    remote = RemoteAutoencoderKLWan(VaeClient(served.target))
    pipe = make_pipe(served.reference_vae(), expand_timesteps=MODELS[served.config.model][1])
    local = run(pipe, "np")
    pipe.vae = remote
    assert np.array_equal(run(pipe, "np"), local)
    remote.close()


def test_from_pretrained_with_the_remote_vae(served: Any, pipes: tuple[Any, Any, Any], tmp_path: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's form, `WanPipeline.from_pretrained(repo, vae=RemoteAutoencoderKLWan(...), dtype=...)`,
    through a real from_pretrained of a saved tiny pipeline folder (offline). diffusers checks a passed
    component against the base class of what model_index.json names (ModelMixin for AutoencoderKLWan)."""
    from diffusers import AutoencoderKLWan, ModelMixin

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local_pipe, _, _ = pipes
    local_pipe.save_pretrained(tmp_path)  # tokenizer/text_encoder None: saved as null, passed as None below
    index = (tmp_path / "model_index.json").read_text()
    assert '"AutoencoderKLWan"' in index and (tmp_path / "vae").is_dir()
    assert issubclass(RemoteAutoencoderKLWan, ModelMixin) and not issubclass(RemoteAutoencoderKLWan, AutoencoderKLWan)

    remote = RemoteAutoencoderKLWan(served.target)
    empty = dict(tokenizer=None, text_encoder=None, local_files_only=True)
    loaded = WanPipeline.from_pretrained(tmp_path, vae=remote, dtype=torch.float32, **empty)
    reference = WanPipeline.from_pretrained(tmp_path, dtype=torch.float32, **empty)  # the saved local VAE
    for pipe in (loaded, reference):
        pipe.set_progress_bar_config(disable=True)
    assert loaded.vae is remote and isinstance(reference.vae, AutoencoderKLWan)
    assert loaded.config.expand_timesteps == local_pipe.config.expand_timesteps
    for output_type in ("np", "pt", "pil", "latent"):
        want = run(reference, output_type)
        assert_same(want, run(loaded, output_type), output_type)
        assert_same(run(local_pipe, output_type), want, output_type)  # the folder round trip itself is exact
    loaded.to("cpu")  # pipe.to moves the weightless module like any other
    with pytest.raises(NotImplementedError, match="no weights to save"):
        loaded.save_pretrained(tmp_path / "again")
    remote.close()


def test_a_closed_remote_vae_says_so(served: Any) -> None:
    from vaed_client import ClientClosedError

    remote = RemoteAutoencoderKLWan(served.target)
    remote.close()
    with pytest.raises(ClientClosedError, match="is closed"):
        remote.decode(torch.zeros(1, remote.config.z_dim, 1, 6, 6))


def test_image_to_video_pipeline_with_a_local_encoder(served: Any) -> None:
    """WanImageToVideoPipeline encodes the first frame (vae.encode) and decodes
    remotely: with `encoder=` the same weights, outputs equal the local VAE's."""
    from PIL import Image

    expand = MODELS[served.config.model][1]
    remote = RemoteAutoencoderKLWan(served.target, encoder=served.reference_vae())
    z = remote.config.z_dim
    # Wan2.1 I2V concatenates [latents, 4 mask channels, image latents]; Wan2.2 TI2V blends instead.
    in_channels = z if expand else 2 * z + remote.config.scale_factor_temporal

    def make(vae: Any) -> Any:
        pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, image_encoder=None,
                                       image_processor=None, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                       transformer=tiny_transformer(z, in_channels), expand_timesteps=expand)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    size = 6 * remote.config.scale_factor_spatial
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8))
    embeds = torch.randn(1, 8, TEXT_DIM, generator=torch.Generator().manual_seed(0))

    def run_i2v(pipe: Any) -> Any:
        return pipe(image=image, prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=size,
                    width=size, num_frames=FRAMES, num_inference_steps=2, guidance_scale=2.0,
                    generator=torch.Generator("cpu").manual_seed(1), output_type="np").frames

    local = run_i2v(make(served.reference_vae()))
    assert local.shape == (1, FRAMES, size, size, 3) and local.std() > 0.01
    assert np.array_equal(run_i2v(make(remote)), local)
    remote.close()


def _served_layout(running: Any) -> str:
    """The decoder layout the server runs ("channels_last" on CUDA by default)."""
    server = running.server
    engine = server.pool.engine if hasattr(server, "pool") else server.worker.engine
    fast_paths = getattr(engine, "fast_paths", None)
    return str(getattr(fast_paths, "layout", None) or getattr(engine, "layout", "contiguous"))


def _same_layout_local_vae(running: Any) -> Any:
    """Stock diffusers (no fused kernels) with the server's weight layout; its
    decode takes channels_last_3d input like the served engine does."""
    from vaed.patches import prepare_decoder

    vae = running.reference_vae()
    layout = _served_layout(running)
    prepare_decoder(vae, kernels="off", layout=layout)
    if layout == "channels_last":
        stock_decode = vae.decode

        def decode(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return stock_decode(z.contiguous(memory_format=torch.channels_last_3d), *args, **kwargs)

        vae.decode = decode
    return vae


# Real VAE architectures at a real size on the GPU: vaed's per-latent-frame post_quant_conv
# equals diffusers' whole-video one there (`vaed bench`: bit-identical at 480p, 720p and Wan2.2
# 704p on the H200); at the tiny CPU sizes cuDNN may pick another algorithm per T.
CUDA_MODELS = {"random:wan2.1": ((480, 832), False), "random:wan2.2": ((704, 1280), True)}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", list(CUDA_MODELS))
def test_pipeline_on_cuda_equals_local_vae_same_layout(model: str, dtype: str) -> None:
    """On the GPU the server runs channels_last_3d weights and the fused
    kernels, bit-identical to stock diffusers *with the same layout*: the
    reference local VAE gets that layout. The remote VAE takes the server's
    dtype, like a local VAE loaded in it."""
    assert CUDA
    hw, expand = CUDA_MODELS[model]
    with serve_in_thread(make_config(model, device="cuda:0", dtype=dtype)) as running:
        local_pipe = make_pipe(_same_layout_local_vae(running), "cuda", expand_timesteps=expand)
        remote = RemoteAutoencoderKLWan(running.target)
        assert remote.dtype == getattr(torch, dtype)
        remote_pipe = make_pipe(remote, "cuda", expand_timesteps=expand)
        assert remote.device.type == "cuda" and remote_pipe._execution_device.type == "cuda"
        for output_type in ("np", "pt", "pil", "latent"):
            assert_same(run(local_pipe, output_type, "cuda", hw), run(remote_pipe, output_type, "cuda", hw), output_type)
        # accelerate (a test dependency): offload hooks move the (empty) module and set the execution device
        want = run(local_pipe, "np", "cuda", hw)
        remote_pipe.enable_model_cpu_offload()
        assert remote_pipe._execution_device.type == "cuda"
        assert np.array_equal(run(remote_pipe, "np", "cuda", hw), want)
        remote.close()


# -- encode served: pipelines with nothing but the DiT on the worker -------------------------------


@pytest.fixture(scope="module", params=list(MODELS))
def encoding_served(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The same tiny models, served with their encoder (`vaed serve --encode`)."""
    with serve_in_thread(make_config(request.param, encode=True)) as running:
        yield running


CLIP_DIM = 8  # the tiny image encoder's hidden size: the Wan2.1 I2V transformer's image_dim


def _image_conditioned_transformer(z_dim: int, in_channels: int) -> Any:
    """Wan2.1 I2V's transformer form: cross-attention on image embeddings too (image_dim, and the
    added k/v projections of the real I2V-14B, whose added_kv_proj_dim is its inner dim)."""
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=z_dim, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, image_dim=CLIP_DIM, added_kv_proj_dim=24,
    ).eval()


def _tiny_image_encoder() -> tuple[Any, Any]:
    """A random tiny CLIP vision model and its processor (built offline from configs)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=CLIP_DIM, projection_dim=CLIP_DIM, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, intermediate_size=16, patch_size=4)
    return CLIPVisionModelWithProjection(config).eval(), CLIPImageProcessor(crop_size=32, size=32)


def _i2v_pipe(vae: Any, expand: bool) -> Any:
    """Wan2.2 TI2V (expand_timesteps) has no image encoder; Wan2.1 I2V's transformer also attends
    to the image's CLIP embeddings (diffusers 0.42.1 refuses `image_embeds=` beside the `image` its
    VAE conditioning needs, so a tiny random CLIP makes them; it is not the VAE under test)."""
    z = vae.config.z_dim
    # Wan2.1 I2V concatenates [latents, 4 mask channels, image latents]; Wan2.2 TI2V blends instead.
    in_channels = z if expand else 2 * z + vae.config.scale_factor_temporal
    if expand:
        transformer, image_encoder, image_processor = tiny_transformer(z, in_channels), None, None
    else:
        transformer = _image_conditioned_transformer(z, in_channels)
        image_encoder, image_processor = _tiny_image_encoder()
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, image_encoder=image_encoder,
                                   image_processor=image_processor,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                   transformer=transformer, expand_timesteps=expand)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("output_type", ["np", "pt", "pil", "latent"])
def test_image_to_video_with_served_encode_equals_local_vae(encoding_served: Any, output_type: str) -> None:
    """WanImageToVideoPipeline (Wan2.1 I2V; Wan2.2 TI2V with expand_timesteps) with
    vae=RemoteAutoencoderKLWan and no local VAE: the image (and, for Wan2.1, its num_frames - 1
    zero frames) is encoded on the server; every output equals the local AutoencoderKLWan's."""
    from PIL import Image

    expand = MODELS[encoding_served.config.model][1]
    remote = RemoteAutoencoderKLWan(encoding_served.target)
    assert remote.info.encodes
    size = 6 * remote.config.scale_factor_spatial
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8))
    embeds = torch.randn(1, 8, TEXT_DIM, generator=torch.Generator().manual_seed(0))

    def run_i2v(pipe: Any) -> Any:
        return pipe(image=image, prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=size,
                    width=size, num_frames=FRAMES, num_inference_steps=2, guidance_scale=2.0,
                    generator=torch.Generator("cpu").manual_seed(1), output_type=output_type).frames

    local_pipe = _i2v_pipe(encoding_served.reference_vae(), expand)
    assert (local_pipe.image_encoder is None) == expand  # Wan2.1 I2V: conditioned on image embeddings
    local = run_i2v(local_pipe)
    got = run_i2v(_i2v_pipe(remote, expand))
    remote.close()
    if output_type == "pil":
        assert len(got) == len(local) == 1
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(local[0], got[0]))
    elif output_type == "np":
        assert np.array_equal(got, local) and local.std() > 0.01
    else:
        assert got.dtype == local.dtype and torch.equal(got, local)


@pytest.mark.parametrize("output_type", ["np", "pt", "pil", "latent"])
def test_video_to_video_with_served_encode_equals_local_vae(encoding_served: Any, output_type: str) -> None:
    """WanVideoToVideoPipeline encodes the whole input video (vae.encode, sample_mode argmax)."""
    from diffusers import WanVideoToVideoPipeline
    from PIL import Image

    if MODELS[encoding_served.config.model][1]:
        # its latent size is height // 2 ** len(vae.temperal_downsample) = 8x: Wan2.1's VAE only
        pytest.skip("diffusers' WanVideoToVideoPipeline assumes an 8x spatial VAE; Wan2.2's is 16x")
    remote = RemoteAutoencoderKLWan(encoding_served.target)
    size = 6 * remote.config.scale_factor_spatial
    rng = np.random.default_rng(2)
    video = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(FRAMES)]
    embeds = torch.randn(1, 8, TEXT_DIM, generator=torch.Generator().manual_seed(0))

    def run_v2v(vae: Any) -> Any:
        pipe = WanVideoToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tiny_transformer(
            vae.config.z_dim), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.set_progress_bar_config(disable=True)
        return pipe(video=video, prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=size,
                    width=size, num_inference_steps=4, strength=0.5, guidance_scale=2.0,
                    generator=torch.Generator("cpu").manual_seed(1), output_type=output_type).frames

    local = run_v2v(encoding_served.reference_vae())
    got = run_v2v(remote)
    remote.close()
    if output_type == "pil":
        assert len(got) == len(local) == 1 and len(local[0]) == FRAMES
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(local[0], got[0]))
    elif output_type == "np":
        assert np.array_equal(got, local) and local.std() > 0.01
    else:
        assert got.dtype == local.dtype and torch.equal(got, local)


@pytest.mark.parametrize("frames", [2, 4, 10])
def test_encode_leaves_trailing_frames_out_as_the_local_vae(encoding_served: Any, frames: int) -> None:
    """AutoencoderKLWan encodes frame 0 and whole groups of 4 of any frame count and leaves the
    rest out (WanVideoToVideoPipeline passes the user's video as it is); the served encode,
    which takes 1 + 4k frames, gets the same frames and gives the same moments."""
    remote = RemoteAutoencoderKLWan(encoding_served.target)
    size = 6 * remote.config.scale_factor_spatial  # the image-to-video tests' size (CPU convs of 2x2 latents
    # differed from the server's by an ulp at any frame count)
    x = torch.rand(1, 3, frames, size, size, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    want = encoding_served.reference_vae().encode(x).latent_dist
    got = remote.encode(x).latent_dist
    remote.close()
    assert got.mean.shape[2] == 1 + (frames - 1) // 4
    assert torch.equal(got.mean, want.mean) and torch.equal(got.logvar, want.logvar)


def test_encode_refuses_integer_frames_as_the_local_vae_does(encoding_served: Any) -> None:
    """AutoencoderKLWan refuses a uint8 video (its conv's input and bias types differ); the served
    encode sent its 0..255 as frames in [-1, 1] and returned wrong latents without a word."""
    remote = RemoteAutoencoderKLWan(encoding_served.target)
    size = 6 * remote.config.scale_factor_spatial
    frames = torch.randint(0, 256, (1, 3, 5, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        encoding_served.reference_vae().encode(frames)
    for dtype in (torch.uint8, torch.int64):
        with pytest.raises(TypeError, match=r"floating-point tensor in \[-1, 1\]"):
            remote.encode(frames.to(dtype))
    scaled = frames.float() / 127.5 - 1
    want = encoding_served.reference_vae().encode(scaled).latent_dist.mean
    assert torch.equal(remote.encode(scaled).latent_dist.mean, want)
    remote.close()


def test_batches_over_the_server_limit_go_in_slices() -> None:
    """A pipeline's batch (prompts x videos per prompt) may exceed the server's --max-batch,
    which a local VAE does not have: the drop-in sends slices of at most that many and joins
    them in order (the local VAE's decode and encode of the same slices: a CPU conv's bits may
    depend on the batch it runs in)."""
    with serve_in_thread(make_config("random:wan2.1-tiny", encode=True, max_batch=2)) as running:
        remote = RemoteAutoencoderKLWan(running.target)
        assert remote.info.max_batch == 2
        local = running.reference_vae()
        z = torch.randn(5, remote.config.z_dim, 2, 6, 6, generator=torch.Generator().manual_seed(0))
        x = torch.rand(3, 3, 5, 48, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
        with torch.no_grad():
            want = torch.cat([local.decode(part).sample for part in z.split(2)])
            want_mean = torch.cat([local.encode(part).latent_dist.mean for part in x.split(2)])
        assert torch.equal(remote.decode(z).sample, want)
        assert torch.equal(remote.encode(x).latent_dist.mean, want_mean)
        remote.close()
