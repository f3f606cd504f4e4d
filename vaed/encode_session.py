"""An Encode call's session: video frames in, one latent frame out per encoder call.

The encoder is causal like the decoder: diffusers' `AutoencoderKLWan._encode`
calls it on frame 0 alone, then on four frames at a time, each call giving one
latent frame. So an Encode session is a `Session` whose backlog items are
whole encoder calls' frames instead of latent frames: `accept` cuts the
client's chunks (any length) into calls here, on the handler side, keeping the
frames of a call not yet complete, and everything else of a session --
backlog room, credits, frame 0 first, failure and close, the device worker's
round-robin -- is the decode session's, one step per call. A frame count that
is not 1 + 4k is refused when the input ends.

Frames stay in their wire dtype until the worker's step (`worker`
converts uint8 there, off the event loop): uint8 [B, t, H, W, 3] is kept as a
permuted view [B, 3, t, H, W] of the received bytes, so calls are cut on one
axis whatever the wire layout. Trailing zero frames (the image-to-video
pattern: an image, then num_frames - 1 zeros) are made here as a broadcast
view of one zero, so 80 frames of zeros cost no memory until their call runs.
"""

from __future__ import annotations

from typing import Any

import torch

from vaed_client import wire

from .engine_protocol import EncodeState, Engine, rgb8_to_video
from .errors import InvalidInput, VaedServerError
from .session import DeviceGroup, HostGroup, Session, has_non_finite


def check_finite_frames(frames: torch.Tensor, first_frame: int) -> None:
    """Raise InvalidInput if one encoder call's float frames (CPU, before the call) hold NaN or
    Inf; checked on the exponent bits as `session.check_finite` checks latents."""
    if has_non_finite(frames):
        last = first_frame + frames.shape[2] - 1
        raise InvalidInput(
            f"frames {first_frame}-{last} hold NaN or Inf values; send finite frames "
            "(or set allow_non_finite to encode them as they are)"
        )


def encoder_call_frames(call: int, scale_temporal: int) -> str:
    """The video frames encoder call `call` (= latent frame) encodes: frame 0 alone, then
    `scale_temporal` frames a call."""
    if call == 0:
        return "frame 0"
    return f"frames {1 + scale_temporal * (call - 1)}-{scale_temporal * call}"


def video_view(frames: torch.Tensor) -> torch.Tensor:
    """A received chunk as [B, 3, t, H, W]: float frames as they are, uint8 permuted (no copy)."""
    return frames.permute(0, 4, 1, 2, 3) if frames.dtype == torch.uint8 else frames


class EncodeSession(Session):
    """One Encode call: `accept` takes frame chunks, the backlog holds encoder calls, a step
    runs one encoder call."""

    def __init__(self, *args: Any, trailing_zero_frames: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trailing_zero_frames = trailing_zero_frames
        self._waiting: list[torch.Tensor] = []  # frames of the next call, not yet complete
        self._waiting_frames = 0
        self._calls_cut = 0

    def _call_frames(self) -> int:
        return 1 if self._calls_cut == 0 else self.limits.scale_temporal

    def _cut(self) -> list[torch.Tensor]:
        """Every complete call among the waiting frames (their pieces joined when split)."""
        calls = []
        while self._waiting_frames >= (need := self._call_frames()):
            parts, got = [], 0
            while got < need:
                piece = self._waiting[0]
                take = min(need - got, piece.shape[2])
                parts.append(piece[:, :, :take])
                if take == piece.shape[2]:
                    self._waiting.pop(0)
                else:
                    self._waiting[0] = piece[:, :, take:]
                got += take
            if len({p.dtype for p in parts}) > 1:  # real uint8 frames beside the zeros: one dtype
                parts = [rgb8_to_video(p) if p.dtype == torch.uint8 else p for p in parts]
            calls.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
            self._waiting_frames -= need
            self._calls_cut += 1
        return calls

    @property
    def frames_received(self) -> int:
        """Video frames accepted so far (`_frames_in` counts encoder calls, as backlog items)."""
        return self.record.shape[2] if self.record.shape is not None else 0

    def received(self) -> str:
        return f"{self.frames_received} video frames received"

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Check a frame chunk against the limits and the call's first chunk (before any copy)."""
        self.limits.check_frames(shape, dtype, frames_before=self.frames_received, first=self._first)

    def accept(self, frames: torch.Tensor) -> None:
        """Queue a CPU chunk that passed `validate`: its complete encoder calls join the backlog."""
        video = video_view(frames)
        b, _, t, h, w = video.shape
        if self._first is None:
            self._first = ((b, h, w), frames.dtype)
            self.record.shape = [b, 3, 0, h, w]
        self._add(video)
        self.record.chunks_in += 1

    def _add(self, video: torch.Tensor) -> None:
        t = video.shape[2]
        assert self.record.shape is not None
        self.record.shape[2] += t
        self._waiting.append(video)
        self._waiting_frames += t
        calls = self._cut()
        if not calls:
            return
        self._frames_in += len(calls)  # backlog items, as a decode session counts latent frames
        self._delivered.clear()
        with self.lock:
            self._backlog.extend(calls)
            self._update_room()
            self.lock.notify_all()

    def finish_input(self) -> None:
        """The client's frames ended: append the trailing zeros, refuse a count that is not
        1 + 4k (InvalidInput), then end the input as a decode session does."""
        if self._first is not None and self.trailing_zero_frames:
            self.limits.check_frame_count(self.frames_received + self.trailing_zero_frames)
            (b, h, w), dtype = self._first
            zero_dtype = torch.float32 if dtype == torch.uint8 else dtype
            zeros = torch.zeros((), dtype=zero_dtype).expand(b, 3, self.trailing_zero_frames, h, w)
            self.trailing_zero_frames = 0
            self._add(zeros)
        try:
            wire.encoded_latent_frames(self.frames_received, self.limits.scale_temporal)
        except ValueError as exc:
            raise InvalidInput(f"{exc} (frames sent plus trailing_zero_frames)") from None
        super().finish_input()

    def refused_output(self, group: HostGroup) -> VaedServerError | None:
        """Moments holding NaN or Inf are refused unless the call allowed them: finite frames far
        outside [-1, 1] (3e38, say) overflow inside the encoder, and an OK with such moments would
        hand the pipeline noise. Checked on the host copy (~0.15 ms for a 480x832 latent frame's, one thread)."""
        if self.output.allow_non_finite or not has_non_finite(group.frames):
            return None
        return InvalidInput(
            f"{encoder_call_frames(group.chunk_index, self.limits.scale_temporal)} encode to NaN or Inf "
            "moments: their values are too large for the encoder (frames are expected in [-1, 1]); set "
            "allow_non_finite to receive such moments as they are"
        )

    # -- the step: one encoder call ----------------------------------------------------------

    def engine_state(self, engine: Engine) -> EncodeState:
        """This call's encoder cache on `engine`, made at its first step."""
        state: EncodeState = self.decoder_state(engine.new_encode_state)
        return state

    def run_step(self, engine: Engine, state: Any, frames: torch.Tensor) -> DeviceGroup:
        """Run one encoder call on one backlog item (that call's frames): uint8 is moved to the
        device and converted there, on the worker thread, not on the event loop (a quarter of the
        float32 bytes to copy, and no CPU pass over them); float frames holding NaN or Inf are
        refused unless the call allowed them."""
        if frames.dtype == torch.uint8:  # to the device at 1 byte a value, converted there
            video = rgb8_to_video(frames.to(engine.device, non_blocking=True))
        else:
            video = frames
        if not self.output.allow_non_finite and frames.dtype != torch.uint8:
            check_finite_frames(video, state.frames_in)
        (encoded,) = engine.encode_frames(state, video, self.output)  # type: ignore[arg-type]  # an EncodeSpec
        i = encoded.latent_frame
        return DeviceGroup(chunk_index=i, first_frame=i, frames=encoded.moments, latents=encoded.latents)
