"""Output types: what `decode(..., output_type=...)` returns.

| output_type | wire format | result |
|---|---|---|
| "uint8" | RGB8 | `[B, T, H, W, 3]` uint8 (torch in -> torch out, numpy in -> numpy) |
| "raw"   | RAW  | `[B, 3, T, H, W]` clamped decoder output (same container rule) |
| "np"    | RAW (exact) or RGB8 (light) | float32 numpy `[B, T, H, W, 3]` in [0, 1] |
| "pt"    | RAW (exact) or RGB8 (light) | torch `[B, T, 3, H, W]` in [0, 1] |
| "pil"   | RAW (exact) or RGB8 (light) | list (per batch item) of lists of PIL images |
| "mp4"   | MP4 / MP4_LOSSLESS | the server's MP4 file: bytes, or the path given as `mp4_path` (`vaed_client.mp4`) |

np / pt / pil follow diffusers' `VideoProcessor.postprocess_video` exactly:
it takes the decoder output in the VAE's dtype, computes
`(x * 0.5 + 0.5).clamp(0, 1)` *in that dtype*, then (np) `.float()` in
`[B, T, H, W, 3]`, (pt) keeps the dtype in `[B, T, 3, H, W]`, (pil) rounds
`x * 255` of the float32 numpy. The exact path therefore asks for RAW in the
server's compute dtype and repeats that arithmetic here: bit-identical for
every dtype when torch is installed; without torch a float32 server is still
exact (numpy's fp32 mul/add/clip round like torch's), half-precision RAW is
widened to float32 first (not bit-identical to diffusers' bf16 arithmetic).

The light option (`format="rgb8"`) sends uint8 frames, 4x fewer bytes than
fp32 RAW (2x fewer than bf16): np/pt become `uint8 / 255` in float32, which
is within 1/510 of diffusers' values, and pil is exact for an fp32 server
(RGB8 is diffusers' PIL rounding of the fp32 output).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import is_torch

UINT8 = "uint8"
RAW_OUT = "raw"
NP = "np"
PT = "pt"
PIL = "pil"
MP4 = "mp4"  # the server's MP4 file (bytes), not frames: `vaed_client.mp4`
OUTPUT_TYPES: tuple[str, ...] = (UINT8, RAW_OUT, NP, PT, PIL, MP4)
# output types postprocessed here from a wire format
PIPELINE_TYPES: tuple[str, ...] = (NP, PT, PIL)


TORCH_NEEDED = ("output_type='pt' returns torch tensors and needs torch: pip install 'vaed-client[torch]' "
                "(on a machine without a GPU take the CPU build first, see the README), or use output_type='np'")
PILLOW_NEEDED = "output_type='pil' needs Pillow: pip install 'vaed-client[video]'"


def missing_dependency(output_type: str) -> str | None:
    """Why `output_type` cannot be produced in this environment (torch for 'pt',
    Pillow for 'pil'), or None; looked up without importing either."""
    import importlib.util

    if output_type == PT and importlib.util.find_spec("torch") is None:
        return TORCH_NEEDED
    if output_type == PIL and importlib.util.find_spec("PIL") is None:
        return PILLOW_NEEDED
    return None


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # the client install does not require torch
        raise ImportError(TORCH_NEEDED) from None
    return torch


def _unit_from_raw(raw: Any) -> Any:
    """diffusers' denormalize, `(x * 0.5 + 0.5).clamp(0, 1)`, in raw's own dtype."""
    if is_torch(raw):
        return (raw * 0.5 + 0.5).clamp(0, 1)
    half = np.asarray(0.5, dtype=raw.dtype)
    return np.clip(raw * half + half, np.asarray(0, raw.dtype), np.asarray(1, raw.dtype))


def from_raw(raw: Any, output_type: str) -> Any:
    """RAW frames `[B, 3, T, H, W]` (torch in its wire dtype, or numpy) -> np / pt / pil."""
    if output_type == PT:
        torch = _torch()
        raw = raw if is_torch(raw) else torch.from_numpy(np.ascontiguousarray(raw))
        return _unit_from_raw(raw).permute(0, 2, 1, 3, 4).contiguous()
    unit = _unit_from_raw(raw)
    if is_torch(unit):
        video = unit.permute(0, 2, 3, 4, 1).float().numpy()  # diffusers' pt_to_numpy
    else:
        video = np.ascontiguousarray(unit.transpose(0, 2, 3, 4, 1), dtype=np.float32)
    if output_type == NP:
        return video
    return _to_pil((video * 255).round().astype("uint8"))


def from_rgb8(frames: Any, output_type: str) -> Any:
    """RGB8 frames `[B, T, H, W, 3]` uint8 -> np / pt / pil (the light option)."""
    array = frames.numpy() if is_torch(frames) else np.asarray(frames)
    if output_type == PIL:
        return _to_pil(array)
    video = array.astype(np.float32) / np.float32(255)
    if output_type == NP:
        return video
    return _torch().from_numpy(np.ascontiguousarray(video.transpose(0, 1, 4, 2, 3)))


def _to_pil(video: np.ndarray) -> list[list[Any]]:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(PILLOW_NEEDED) from None
    return [[Image.fromarray(np.ascontiguousarray(frame)) for frame in item] for item in video]


def convert(frames: Any, wire_format: str, output_type: str) -> Any:
    """Wire-layout frames (a whole video or one chunk) -> the asked output type."""
    if output_type not in PIPELINE_TYPES:
        return frames
    return from_raw(frames, output_type) if wire_format == "raw" else from_rgb8(frames, output_type)
