"""The decode engine: model, per-session causal caches and the per-chunk
decode step. No gRPC here; every method runs on the worker thread that owns
the device.

Bit-exactness: the loop below is diffusers' `AutoencoderKLWan._decode` taken
apart per latent frame. Every decoder call sees the same inputs as in
diffusers (post_quant_conv of the chunk, one latent frame, the same cache
list), so the output of each call is the same bytes; only the cache list is
owned by the session instead of the module's shared `_feat_map`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import ServerConfig
from .errors import InvalidInput
from .models import LoadedModel, load_model

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
LATENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class OutputSpec:
    rgb8: bool                      # True: uint8 [B, t, H, W, 3]; False: RAW [B, 3, t, H, W]
    raw_dtype: torch.dtype | None   # RAW only; None = compute dtype
    raw_latents: bool               # True: latents already in VAE space


@dataclass
class DecodeSession:
    """One Decode call or DecodeStream session: its causal cache and position."""

    output: OutputSpec
    cache: list[Any] | None = None                       # diffusers feat_cache list, per session
    pending: list[torch.Tensor] = field(default_factory=list)  # post_quant_conv'd latent frames [B, z, 1, h, w]
    next_latent_frame: int = 0                           # index of the next decoder call
    next_output_frame: int = 0                           # first frame index of the next group


@dataclass(frozen=True)
class DecodedGroup:
    """Frames of one decoder call, postprocessed, still on the device."""

    chunk_index: int
    first_frame: int
    frames: torch.Tensor


class DecodeEngine:
    def __init__(self, loaded: LoadedModel, config: ServerConfig) -> None:
        from .install import prepare_decoder

        self.loaded = loaded
        self.vae = loaded.vae
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.compute_dtype_name]
        cfg = self.vae.config
        self.z_dim: int = cfg.z_dim
        self.scale_temporal: int = cfg.scale_factor_temporal
        self.scale_spatial: int = cfg.scale_factor_spatial
        self.patch_size: int | None = cfg.patch_size
        self.latents_mean: list[float] = list(cfg.latents_mean)
        self.latents_std: list[float] = list(cfg.latents_std)
        self.num_convs: int = self.vae._cached_conv_counts["decoder"]
        # WanPipeline's denormalization constants, built the way it builds
        # them (fp32 tensor, 1/std in fp32, then cast) so results match.
        shape = (1, self.z_dim, 1, 1, 1)
        self._mean = torch.tensor(cfg.latents_mean).view(shape).to(self.device, self.dtype)
        self._inv_std = (1.0 / torch.tensor(cfg.latents_std).view(shape)).to(self.device, self.dtype)
        self.fast_paths = prepare_decoder(self.vae, kernels=config.kernels, layout=config.layout)
        log.info(
            "decoder ready: kernels=%s layout=%s installed=%s skipped=%s",
            self.fast_paths.kernels, self.fast_paths.layout,
            list(self.fast_paths.installed), list(self.fast_paths.skipped),
        )

    @classmethod
    def load(cls, config: ServerConfig) -> "DecodeEngine":
        dtype = DTYPES[config.compute_dtype_name]
        return cls(load_model(config.model, config.device, dtype, decoder_only=True), config)

    # -- validation (cheap, no device work) ---------------------------------

    def check_chunk(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        frames_before: int = 0,
        session_shape: tuple[int, int, int] | None = None,
    ) -> None:
        """Raise InvalidInput unless a latent chunk fits the model, the limits and its session
        (`frames_before` latent frames already accepted, `session_shape` = (B, h, w) of its first chunk)."""
        cfg = self.config
        if dtype not in LATENT_DTYPES:
            raise InvalidInput(f"latents dtype {dtype} is not accepted; send float16, bfloat16 or float32")
        if len(shape) != 5:
            raise InvalidInput(f"latents must be 5-D [B, z_dim, T, h, w]; got shape {list(shape)}")
        b, z, t, h, w = shape
        if z != self.z_dim:
            raise InvalidInput(f"latents have z_dim {z} but the served model has z_dim {self.z_dim}")
        if b < 1 or t < 1 or h < 1 or w < 1:
            raise InvalidInput(f"latents shape {list(shape)} is empty: B, T, h and w must be at least 1")
        if b > cfg.max_batch:
            raise InvalidInput(f"batch {b} is over the server limit of {cfg.max_batch}")
        pixels = h * self.scale_spatial * w * self.scale_spatial
        if cfg.max_pixels and pixels > cfg.max_pixels:
            raise InvalidInput(
                f"output frame {h * self.scale_spatial}x{w * self.scale_spatial} ({pixels} pixels) is over "
                f"the server limit of {cfg.max_pixels} pixels"
            )
        if cfg.max_latent_frames and frames_before + t > cfg.max_latent_frames:
            raise InvalidInput(
                f"{frames_before + t} latent frames in this call are over the server limit of "
                f"{cfg.max_latent_frames}"
            )
        if session_shape is not None and (b, h, w) != session_shape:
            raise InvalidInput(
                f"chunk has B, h, w = {(b, h, w)} but this session started with {session_shape}; "
                "every chunk of a session must share B, z_dim, h and w"
            )

    def output_frames(self, latent_frames: int) -> int:
        return 1 + self.scale_temporal * (latent_frames - 1) if latent_frames else 0

    # -- device work (worker thread only) -------------------------------------

    def open_session(self, output: OutputSpec) -> DecodeSession:
        return DecodeSession(output=output, cache=[None] * self.num_convs)

    @torch.inference_mode()
    def accept_chunk(self, session: DecodeSession, latents: torch.Tensor) -> None:
        """Move a validated chunk to the device and queue its latent frames."""
        from .install import to_decoder_layout

        t = latents.shape[2]
        x = latents.to(self.device, non_blocking=True).to(self.dtype)
        if not session.output.raw_latents:
            x = x / self._inv_std + self._mean
        x = to_decoder_layout(x, self.fast_paths.layout)
        x = self.vae.post_quant_conv(x)
        session.pending.extend(x[:, :, i : i + 1] for i in range(t))

    @torch.inference_mode()
    def decode_step(self, session: DecodeSession) -> DecodedGroup:
        """Decode the session's next latent frame into postprocessed frames."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        x = session.pending.pop(0)
        index = session.next_latent_frame
        out = self.vae.decoder(x, feat_cache=session.cache, feat_idx=[0], first_chunk=(index == 0))
        if self.patch_size is not None:
            out = unpatchify(out, patch_size=self.patch_size)
        out = torch.clamp(out, min=-1.0, max=1.0)
        frames = self.postprocess(out, session.output)
        group = DecodedGroup(chunk_index=index, first_frame=session.next_output_frame, frames=frames)
        session.next_latent_frame += 1
        session.next_output_frame += out.shape[2]
        return group

    def postprocess(self, out: torch.Tensor, spec: OutputSpec) -> torch.Tensor:
        """Clamped decoder output [B, 3, t, H, W] -> wire layout, on the device."""
        if spec.rgb8:
            # diffusers' PIL path for an fp32 VAE: (x / 2 + 0.5).clamp(0, 1) * 255, rounded.
            rgb = ((out.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            return rgb.permute(0, 2, 3, 4, 1).contiguous()
        return out.to(spec.raw_dtype or self.dtype).contiguous()

    def close_session(self, session: DecodeSession) -> None:
        session.cache = None
        session.pending.clear()

    def decode_video(self, latents: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        """Whole-video decode in this process (warm-up, benchmarks): the served path, concatenated."""
        self.check_chunk(tuple(latents.shape), latents.dtype)
        session = self.open_session(output)
        self.accept_chunk(session, latents)
        groups = []
        while session.pending:
            groups.append(self.decode_step(session).frames)
        self.close_session(session)
        return torch.cat(groups, dim=1 if output.rgb8 else 2)
