"""Reference computations for the end-to-end tests: diffusers itself."""

from __future__ import annotations

from typing import Any

import torch


def rgb8(decoded: torch.Tensor) -> torch.Tensor:
    """DESIGN.md's RGB8 postprocess of a clamped decoder output [B, 3, T, H, W] -> [B, T, H, W, 3]."""
    return ((decoded.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)


def denormalize(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """What WanPipeline does to output_type='latent' latents before vae.decode."""
    z = vae.config.z_dim
    latents = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)).to(latents.device, latents.dtype)
    return latents / inv_std + mean


@torch.no_grad()
def diffusers_decode(vae: Any, latents: torch.Tensor, *, raw_latents: bool) -> torch.Tensor:
    z = latents.to(vae.device, vae.dtype) if raw_latents else denormalize(vae, latents)
    return vae.decode(z, return_dict=False)[0].cpu()
