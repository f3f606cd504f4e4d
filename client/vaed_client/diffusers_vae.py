"""`RemoteAutoencoderKLWan`: a vaed server as the `vae` of a diffusers Wan pipeline.

    from vaed_client import RemoteAutoencoderKLWan
    pipe = WanPipeline.from_pretrained(repo, vae=RemoteAutoencoderKLWan("vaed:50051"), dtype=torch.bfloat16)
    video = pipe(prompt, output_type="np").frames   # decoded remotely

(`WanPipeline(..., vae=...)` and `pipe.vae = ...` work as well.)

Why a diffusers `ModelMixin` (when diffusers is installed): `from_pretrained`
checks every component passed in against the base class of what its
model_index.json names (`pipeline_loading_utils.maybe_raise_or_warn`: for
`AutoencoderKLWan` that is `ModelMixin`, by `issubclass` of the passed
object's class) and raises "... should be ModelMixin" otherwise. ModelMixin
is a `torch.nn.Module` that adds methods and no state; this class overrides
what it would read from weights or a config (`config`, `dtype`, `device`),
and `save_pretrained` raises (there are no weights to save). Without
diffusers the base is `torch.nn.Module`. The annotation check that follows
only logs "Expected types for vae: (AutoencoderKLWan,) ..." (a warning, not
an error: this is not an AutoencoderKLWan and does not pretend to be one).

Design: a module whose one parameter is empty (0 elements).
Pipelines treat every `nn.Module` component alike — `pipe.to(...)` moves it,
`device` and `_execution_device` read it, `enable_model_cpu_offload()` hooks
it, and accelerate's offload hook reads `next(module.parameters()).device` —
and that parameter carries `.device` / `.dtype` through those moves, exactly
as the weights of a local `AutoencoderKLWan` would. There are no weights:
`to("cuda")` costs nothing, and offload hooks move an empty module.

What Wan pipelines read (diffusers 0.42.1, pipelines/wan/*.py): `vae.config`
(`z_dim`, `latents_mean`, `latents_std`, `scale_factor_temporal`,
`scale_factor_spatial`), `vae.dtype`, the module's execution device, and
`vae.decode(z, return_dict=False)[0]`. They de-normalise the latents
themselves, so `decode` sends VAE-space latents (`raw_latents=True`) and asks
for RAW frames in `z`'s dtype: the pipeline's own postprocess then sees the
same tensor a local VAE of that dtype returns (bit-identical when the server
runs the same weights, dtype and layout). The config is fetched from the
server's ModelInfo when the object is built.

The lighter option, `wire_format="rgb8"`, receives uint8 frames (1 byte a
value against RAW's 2 in bf16 or 4 in fp32) and hands the pipeline
`u / 127.5 - 1`: its postprocess then gives `pil` frames equal to the exact
path's for an fp32 server (the server quantizes like diffusers' PIL path)
and `np` / `pt` within 1/510 of them; not bit-identical.

`encode` (image-to-video and video-to-video conditioning, Wan2.2 TI2V) is
served when the server loaded its encoder (`vaed serve --encode`,
ModelInfo.encodes): the frames go up in the input's dtype, or as uint8 when
float32 frames are exactly uint8 ones (as VideoProcessor makes them; checked
bit for bit), an I2V input's trailing zero frames as a count, not bytes; the
moments come back in the input's
dtype and are wrapped in diffusers' `DiagonalGaussianDistribution` on the
input's device, so `latent_dist.mode()` / `.sample(generator)` are what a
local VAE's would be (bit-identical with the same weights, dtype and layout).
`encoder=` a local `AutoencoderKLWan` still encodes locally instead.
diffusers is optional: without it `config` is a read-only dict with attribute
access and `decode` returns a small `DecoderOutput` with `.sample` (a served
`encode` needs diffusers for its output types).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .client import VaeClient
from .core import ModelInfo

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the type checker sees the diffusers base (installed with the server)
    from diffusers.models.modeling_utils import ModelMixin as _ModuleBase
else:
    try:  # what diffusers' from_pretrained requires of a passed-in VAE (see the module doc)
        from diffusers.models.modeling_utils import ModelMixin as _ModuleBase
    except ImportError:  # diffusers is optional: outside its pipelines a plain module does
        _ModuleBase = torch.nn.Module


class _AttrDict(dict):
    """Read-only dict with attribute access (diffusers' FrozenDict without diffusers)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("the remote VAE config is read-only")

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("the remote VAE config is read-only")


def _frozen_config(values: dict[str, Any]) -> Any:
    try:
        from diffusers.configuration_utils import FrozenDict
    except ImportError:
        return _AttrDict(values)
    return FrozenDict(values)


@dataclass
class _DecoderOutput:
    sample: torch.Tensor
    commit_loss: Any = None

    def __getitem__(self, index: int) -> Any:
        return (self.sample,)[index]


def _decoder_output(sample: torch.Tensor) -> Any:
    try:
        from diffusers.models.autoencoders.vae import DecoderOutput
    except ImportError:
        return _DecoderOutput(sample=sample)
    return DecoderOutput(sample=sample)


def config_from_info(info: ModelInfo) -> dict[str, Any]:
    """The AutoencoderKLWan-style config a pipeline reads, from ModelInfo."""
    spatial = info.scale_factor_spatial or 8
    return {
        "_class_name": "AutoencoderKLWan",
        "z_dim": info.z_dim,
        "latents_mean": list(info.latents_mean),
        "latents_std": list(info.latents_std),
        "scale_factor_temporal": info.scale_factor_temporal or 4,
        "scale_factor_spatial": spatial,
        # Wan2.2's VAE packs 2x2 pixels into channels (16x spatial); Wan2.1 does not.
        "patch_size": 2 if spatial == 16 else None,
        "in_channels": 12 if spatial == 16 else 3,
        "out_channels": 12 if spatial == 16 else 3,
        "remote_model": info.model,
    }


class RemoteAutoencoderKLWan(_ModuleBase):
    """Drop-in for `AutoencoderKLWan` in diffusers Wan pipelines, decoding on a vaed server.

    `target` and `client_options` (timeout, tls, token, tls_server_name,
    options) are those of `VaeClient`. `dtype` defaults to the server's
    compute dtype, like a local VAE loaded in that dtype; `.to(dtype)` changes
    it. `wire_format` is "raw" (exact, the default) or "rgb8" (lighter, see
    the module doc).
    """

    _supports_gradient_checkpointing = False

    def __init__(
        self,
        target: str | VaeClient,
        *,
        dtype: torch.dtype | None = None,
        encoder: Any = None,
        wire_format: str = "raw",
        **client_options: Any,
    ) -> None:
        super().__init__()
        if wire_format not in ("raw", "rgb8"):
            raise ValueError(f"wire_format must be 'raw' (exact) or 'rgb8' (lighter), got {wire_format!r}")
        self.wire_format = wire_format
        self._client = target if isinstance(target, VaeClient) else VaeClient(target, **client_options)
        self.info = self._client.model_info()
        if dtype is None:
            dtype = getattr(torch, self.info.compute_dtype, torch.float32) if self.info.compute_dtype else torch.float32
        # The empty parameter carries device and dtype through .to(), pipe.to() and offload hooks
        # (a buffer is not enough: accelerate's CpuOffload.pre_forward calls next(parameters())).
        self._anchor = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self._config = _frozen_config(config_from_info(self.info))
        self._encoder = encoder

    # -- what pipelines read -------------------------------------------------
    @property
    def config(self) -> Any:
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor.dtype

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def temperal_downsample(self) -> list[bool]:
        """AutoencoderKLWan's attribute (diffusers' spelling), which WanVideoToVideoPipeline reads
        for its temporal factor (2 ** its sum): Wan's two time downsamples in the last blocks."""
        halvings = (self.config["scale_factor_temporal"]).bit_length() - 1
        return [False] * (3 - halvings) + [True] * halvings

    @property
    def client(self) -> VaeClient:
        return self._client

    # -- decode ----------------------------------------------------------------
    def _pre_forward(self) -> None:
        # accelerate's cpu_offload_with_hook (enable_model_cpu_offload) hooks
        # forward(); diffusers' own VAEs call the hook from decode, so do we.
        hook = getattr(self, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(self)

    @torch.no_grad()
    def decode(self, z: torch.Tensor, return_dict: bool = True) -> Any:
        """VAE-space latents `[B, z_dim, T, h, w]` -> `DecoderOutput(sample=[B, 3, T_out, H, W])`
        clamped to [-1, 1], on z's device and in z's dtype (float32 for other dtypes)."""
        self._pre_forward()
        if not isinstance(z, torch.Tensor):
            raise TypeError(f"decode expects a torch.Tensor, got {type(z).__name__}")
        raw_dtype = z.dtype if z.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32

        def served(part: torch.Tensor) -> torch.Tensor:
            if self.wire_format == "rgb8":
                frames = self._client.decode(part, output_type="uint8", raw_latents=True)  # [B, T, H, W, 3]
                return frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # back to the decoder's [-1, 1]
            return self._client.decode(part, output_type="raw", raw_dtype=raw_dtype, raw_latents=True)

        sample = self._by_batch(served, z.to(raw_dtype))
        sample = sample.to(device=z.device, dtype=z.dtype if z.dtype.is_floating_point else raw_dtype)
        if not return_dict:
            return (sample,)
        return _decoder_output(sample)

    def forward(self, sample: torch.Tensor, sample_posterior: bool = False, return_dict: bool = True,
                generator: torch.Generator | None = None) -> Any:
        """As `AutoencoderKLWan.forward`: frames encoded, then the posterior's mode (or, with
        `sample_posterior`, a sample drawn with `generator`) decoded."""
        posterior = self.encode(sample).latent_dist
        z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        return self.decode(z, return_dict=return_dict)

    @torch.no_grad()
    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        """Frames `[B, 3, T, H, W]` in [-1, 1] -> `AutoencoderKLOutput(latent_dist=
        DiagonalGaussianDistribution(moments))`, the moments on x's device in x's dtype: served,
        or on the local `encoder=` when one was given."""
        if self._encoder is not None:
            return self._encoder.encode(x.to(self._encoder.device, self._encoder.dtype), return_dict=return_dict)
        self._pre_forward()
        if not self.info.encodes:
            raise NotImplementedError(
                f"the server at {self._client.target} does not encode (start it with `vaed serve --encode`), "
                "or pass encoder=<a local AutoencoderKLWan> to RemoteAutoencoderKLWan"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"encode expects a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            # AutoencoderKLWan refuses them too (its conv's input and bias types differ); served, a
            # uint8 video's 0..255 went out as values in [-1, 1] and came back as wrong latents
            raise TypeError(f"encode expects frames as a floating-point tensor in [-1, 1], as AutoencoderKLWan "
                            f"does, got {x.dtype} (uint8 frames: x.float() / 127.5 - 1)")
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        dtype = x.dtype if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        if x.dim() == 5 and x.shape[2] > 1:
            # AutoencoderKLWan encodes frame 0, then whole groups of 4, and leaves trailing frames
            # out (10 frames: 9 encoded, 3 latent frames); the server takes 1 + 4k frames only
            x = x[:, :, : 1 + 4 * ((x.shape[2] - 1) // 4)]
        moments = self._by_batch(lambda part: self._client.encode(part, output_type="moments", out_dtype=dtype),
                                 x.to(dtype))
        posterior = DiagonalGaussianDistribution(moments.to(device=x.device, dtype=dtype))
        if not return_dict:
            return (posterior,)
        return AutoencoderKLOutput(latent_dist=posterior)

    def _by_batch(self, call: Any, x: torch.Tensor) -> torch.Tensor:
        """`call(x)`, in slices of the server's largest batch when x's is larger (a pipeline's
        prompts x videos per prompt may be; a local VAE takes any), joined along the batch."""
        limit = self.info.max_batch
        if x.dim() != 5 or not limit or x.shape[0] <= limit:
            return call(x)
        return torch.cat([call(part) for part in x.split(limit)])

    # -- no-ops pipelines or users may call on a local VAE ---------------------
    def enable_slicing(self) -> None:
        """No-op: the server decodes per latent chunk already."""

    def disable_slicing(self) -> None:
        """No-op."""

    def enable_tiling(self, *args: Any, **kwargs: Any) -> None:
        """No-op: spatial tiling is the server's concern."""

    def disable_tiling(self) -> None:
        """No-op."""

    def clear_cache(self) -> None:
        """No-op: the server owns the causal cache of each call."""

    def extra_repr(self) -> str:
        return (f"target={self._client.target!r}, model={self.info.model!r}, z_dim={self.info.z_dim}, "
                f"wire_format={self.wire_format!r}")

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the weights live on the server (a pipeline's `save_pretrained` lands here too)."""
        raise NotImplementedError(
            f"RemoteAutoencoderKLWan has no weights to save (it decodes on {self._client.target}); save the "
            "pipeline with a local AutoencoderKLWan, or save the other components and pass "
            "vae=RemoteAutoencoderKLWan(...) to from_pretrained again"
        )

    def close(self) -> None:
        self._client.close()
