"""What a decode engine is: the one interface the device worker, the service and the benchmarks use.

Two engines implement it: `vaed.engine.DecodeEngine` (one device) and
`vaed.parallel.ShardedEngine` (rank 0 of a group of devices, one video split
across them). Both subclass `Engine` explicitly, so what the server may read
is written here and nowhere else; nothing is forwarded by attribute lookup.

Shared here, written once:

- the model facts (`z_dim`, scale factors, `latents_mean/std`, ...), read
  from the loaded model's config by `ModelFacts.of`;
- input preparation (`LatentInput`): to the device and compute dtype, then
  WanPipeline's denormalization, with constants built the way it builds them;
- output postprocessing (`Engine.finish`): unpatchify (Wan2.2), clamp, then
  the wire layout (`postprocess`);
- `decode_video`, the served per-frame loop concatenated.

An engine decodes one latent frame per call (`decode_frame`) into a
`DecodedGroup` on its device; `state` objects are the engine's own (its
cache list and position). The encoder will be another method pair here
(`new_encode_state` / `encode_frames`) over the same input/output halves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vaed_client import wire

from .choices import Parallel, Precision


@dataclass(frozen=True)
class OutputSpec:
    rgb8: bool                      # True: uint8 [B, t, H, W, 3]; False: RAW [B, 3, t, H, W]
    raw_dtype: torch.dtype | None   # RAW only; None = compute dtype
    raw_latents: bool               # True: latents already in VAE space
    precision: str = Precision.LOSSLESS  # op set tier
    allow_non_finite: bool = False  # False: NaN/Inf latents are refused

    @property
    def time_dim(self) -> int:
        return 1 if self.rgb8 else 2


@dataclass(frozen=True)
class DecodedGroup:
    """Frames of one decoder call, postprocessed, still on the device."""

    chunk_index: int
    first_frame: int
    frames: torch.Tensor


@dataclass
class EngineInfo:
    """What ModelInfo reports about an engine."""

    model: str
    random_weights: bool
    device: str
    dtype: torch.dtype
    kernels: str
    layout: str
    fast_paths_note: str
    precisions: tuple[str, ...] = field(default=(Precision.LOSSLESS,))


@dataclass(frozen=True)
class ModelFacts:
    """The model's numbers every engine reports, from the VAE's config."""

    z_dim: int
    scale_temporal: int
    scale_spatial: int
    patch_size: int | None
    latents_mean: list[float]
    latents_std: list[float]
    num_convs: int  # the decoder's causal convs: the length of its cache list

    @classmethod
    def of(cls, vae: Any) -> ModelFacts:
        cfg = vae.config
        return cls(
            z_dim=cfg.z_dim,
            scale_temporal=cfg.scale_factor_temporal,
            scale_spatial=cfg.scale_factor_spatial,
            patch_size=cfg.patch_size,
            latents_mean=list(cfg.latents_mean),
            latents_std=list(cfg.latents_std),
            num_convs=vae._cached_conv_counts["decoder"],
        )


class LatentInput:
    """A latent frame as the decoder takes it: on the device, in the compute dtype, and (unless
    the client sent VAE-space latents) denormalized with WanPipeline's constants, built the way
    it builds them (fp32 tensor, 1/std in fp32, then cast) so results match."""

    def __init__(self, facts: ModelFacts, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        shape = (1, facts.z_dim, 1, 1, 1)
        self.mean = torch.tensor(facts.latents_mean).view(shape).to(device, dtype)
        self.inv_std = (1.0 / torch.tensor(facts.latents_std).view(shape)).to(device, dtype)

    def __call__(self, latent_frame: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        x = latent_frame.to(self.device, non_blocking=True).to(self.dtype)
        if not output.raw_latents:
            x = x / self.inv_std + self.mean
        return x


def postprocess(out: torch.Tensor, output: OutputSpec, dtype: torch.dtype) -> torch.Tensor:
    """Clamped decoder output [B, 3, t, H, W] -> wire layout, on the device."""
    if output.rgb8:
        # diffusers' PIL path for an fp32 VAE: (x / 2 + 0.5).clamp(0, 1) * 255, rounded.
        rgb = ((out.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return rgb.permute(0, 2, 3, 4, 1).contiguous()
    return out.to(output.raw_dtype or dtype).contiguous()


class Engine(ABC):
    """The engine interface. Subclasses set `facts`, `device`, `dtype` and `latent_input`."""

    facts: ModelFacts
    device: torch.device
    dtype: torch.dtype
    latent_input: LatentInput
    graphs: Any = None  # captured decoder calls (vaed.graphs), or None

    # -- model facts ---------------------------------------------------------------------

    @property
    def z_dim(self) -> int:
        return self.facts.z_dim

    @property
    def scale_temporal(self) -> int:
        return self.facts.scale_temporal

    @property
    def scale_spatial(self) -> int:
        return self.facts.scale_spatial

    @property
    def patch_size(self) -> int | None:
        return self.facts.patch_size

    @property
    def latents_mean(self) -> list[float]:
        return self.facts.latents_mean

    @property
    def latents_std(self) -> list[float]:
        return self.facts.latents_std

    @property
    def num_convs(self) -> int:
        return self.facts.num_convs

    @property
    @abstractmethod
    def info(self) -> EngineInfo: ...

    @property
    def precisions(self) -> tuple[str, ...]:
        return self.info.precisions

    def output_frames(self, latent_frames: int) -> int:
        return wire.output_frames(latent_frames, self.scale_temporal)

    # -- decoding --------------------------------------------------------------------------

    @abstractmethod
    def new_state(self) -> Any: ...

    @abstractmethod
    def decode_frame(self, state: Any, latent_frame: torch.Tensor, output: OutputSpec) -> DecodedGroup:
        """Decode one latent frame [B, z, 1, h, w] (any device) into postprocessed frames on the device."""

    @abstractmethod
    def free(self, state: Any) -> None:
        """Drop a session's caches (may run on the event loop's thread)."""

    def prepare_input(self, latent_frame: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        return self.latent_input(latent_frame, output)

    def finish(self, out: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        """A decoder call's output -> the wire's frames: unpatchify (a latent row -> `patch`
        output rows), clamp to [-1, 1], postprocess."""
        if self.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=self.patch_size)
        return self.postprocess(torch.clamp(out, min=-1.0, max=1.0), output)

    def postprocess(self, out: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        return postprocess(out, output, self.dtype)

    def decode_video(self, latents: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        """Whole-video decode in this process (warm-up, benchmarks, tests): the served loop, concatenated."""
        state = self.new_state()
        try:
            groups = [self.decode_frame(state, latents[:, :, i : i + 1], output).frames for i in range(latents.shape[2])]
        finally:
            self.free(state)
        return torch.cat(groups, dim=output.time_dim)

    # -- the group around the engine (a one-device engine has none) ------------------------------

    @property
    def healthy(self) -> bool:
        return True

    def describe(self) -> str:
        """ModelInfo.parallel: "off" for one device (a sharded engine names its group)."""
        return Parallel.OFF

    def health_entries(self) -> dict[str, bool]:
        """Extra health-service entries (name suffix -> serving) beside the device's own."""
        return {}

    def keepalive(self) -> None:
        """Called by the device worker on every pass of its loop, idle or not: an engine that
        must show its group it is alive does so when due (cheap otherwise)."""

    def close(self) -> None:
        """Release what the engine holds beyond its weights (a sharded engine stops its group)."""


EngineFactory = Callable[[str], Engine]  # device -> engine
