"""What one call may ask of the server: one `Limits` for Decode, DecodeStream and Encode.

A decode's chunks are latents [B, z_dim, T, h, w]; an encode's are frames
([B, 3, T, H, W] float, [B, T, H, W, 3] uint8). Both are checked by the same
rules, written once here: a dtype the server takes, five dimensions, none
empty, the batch, the frame size (pixels, the spatial factor), the length of
the call so far, and every chunk of a call sharing the first chunk's B, size
and dtype. `check_latents` and `check_frames` only read the layout and name
the dimensions the way the client sent them; the checks run before any copy
of the chunk (its header only), so a refused chunk costs no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vaed_client import wire

from .errors import InvalidInput

LATENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
VIDEO_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)

# ((B, h, w) or (B, H, W), dtype) of a call's first chunk: what later chunks must match
FirstChunk = tuple[tuple[int, int, int], torch.dtype]


@dataclass(frozen=True)
class Limits:
    """The served model's numbers and the server's limits one call is checked against."""

    z_dim: int
    scale_spatial: int
    scale_temporal: int
    max_batch: int
    max_latent_frames: int   # 0 = no limit
    max_pixels: int          # 0 = no limit

    @property
    def max_frames(self) -> int:
        """Frames of the longest video whose latents fit max_latent_frames (0 = no limit)."""
        return wire.output_frames(self.max_latent_frames, self.scale_temporal) if self.max_latent_frames else 0

    # -- a decode's latents ------------------------------------------------------------------

    def frame_size(self, h: int, w: int) -> tuple[int, int]:
        """The decoded frames' (H, W) for latents of h x w."""
        return h * self.scale_spatial, w * self.scale_spatial

    def check_latents(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        frames_before: int = 0,
        first: FirstChunk | None = None,
    ) -> None:
        """Raise InvalidInput unless a latent chunk fits the model, the limits and its session
        (`frames_before` latent frames already accepted; `first` = the session's first chunk)."""
        if dtype not in LATENT_DTYPES:
            raise InvalidInput(f"latents dtype {dtype} is not accepted; send float16, bfloat16 or float32")
        if len(shape) != 5:
            raise InvalidInput(f"latents must be 5-D [B, z_dim, T, h, w]; got shape {list(shape)}")
        b, z, t, h, w = shape
        if z != self.z_dim:
            raise InvalidInput(f"latents have z_dim {z} but the served model has z_dim {self.z_dim}")
        self._check_extent("latents", "B, T, h and w", shape, b, t, h, w)
        self._check_pixels("output frame", *self.frame_size(h, w))
        if self.max_latent_frames and frames_before + t > self.max_latent_frames:
            raise InvalidInput(
                f"{frames_before + t} latent frames in this call are over the server limit of "
                f"{self.max_latent_frames}"
            )
        self._check_same(first, (b, h, w), dtype, "B, h, w", "session", "B, z_dim, h and w")

    # -- an encode's frames --------------------------------------------------------------------

    def check_frames(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        frames_before: int = 0,
        first: FirstChunk | None = None,
    ) -> None:
        """Raise InvalidInput unless a frame chunk fits the model, the limits and its call."""
        if dtype not in VIDEO_DTYPES:
            raise InvalidInput(f"frames dtype {dtype} is not accepted; send uint8, float16, bfloat16 or float32")
        if len(shape) != 5:
            raise InvalidInput(
                f"frames must be 5-D ([B, 3, T, H, W] float or [B, T, H, W, 3] uint8); got {list(shape)}")
        if dtype == torch.uint8:
            b, t, h, w, c = shape
            layout = "[B, T, H, W, 3] for uint8"
        else:
            b, c, t, h, w = shape
            layout = "[B, 3, T, H, W] for float frames"
        if c != 3:
            raise InvalidInput(f"frames have {c} channels; send RGB, {layout}; got {list(shape)}")
        self._check_extent("frames", "B, T, H and W", shape, b, t, h, w)
        s = self.scale_spatial
        if h % s or w % s:
            raise InvalidInput(f"frame size {h}x{w} is not a multiple of the model's spatial factor {s}")
        self._check_pixels("frame", h, w)
        self.check_frame_count(frames_before + t)
        self._check_same(first, (b, h, w), dtype, "B, H, W", "call", "B, H and W")

    def check_frame_count(self, total: int, what: str = "frames in this call") -> None:
        """Raise InvalidInput when an encode of `total` frames (`what` they are) would pass
        max_latent_frames."""
        if self.max_frames and total > self.max_frames:
            raise InvalidInput(
                f"{total} {what} are over the server limit of {self.max_frames} "
                f"({self.max_latent_frames} latent frames)"
            )

    # -- the rules both share ----------------------------------------------------------------

    def _check_extent(self, what: str, dims: str, shape: tuple[int, ...], b: int, t: int, h: int, w: int) -> None:
        if b < 1 or t < 1 or h < 1 or w < 1:
            raise InvalidInput(f"{what} shape {list(shape)} is empty: {dims} must be at least 1")
        if b > self.max_batch:
            raise InvalidInput(f"batch {b} is over the server limit of {self.max_batch}")

    def _check_pixels(self, what: str, height: int, width: int) -> None:
        if self.max_pixels and height * width > self.max_pixels:
            raise InvalidInput(
                f"{what} {height}x{width} ({height * width} pixels) is over the server limit of "
                f"{self.max_pixels} pixels"
            )

    @staticmethod
    def _check_same(first: FirstChunk | None, bhw: tuple[int, int, int], dtype: torch.dtype,
                    dims: str, unit: str, shared: str) -> None:
        """A later chunk has the first chunk's B, size (`dims`) and dtype; `unit` names the call."""
        if first is None:
            return
        bhw0, dtype0 = first
        if bhw != bhw0:
            raise InvalidInput(
                f"chunk has {dims} = {bhw} but this {unit} started with {bhw0}; "
                f"every chunk of a {unit} must share {shared}"
            )
        if dtype != dtype0:
            raise InvalidInput(
                f"chunk has dtype {dtype} but this {unit} started with {dtype0}; "
                f"every chunk of a {unit} must share its dtype"
            )
