"""The Encode call's shared core for `VaeClient.encode` and `AsyncVaeClient.encode`.

Everything that does not wait, once: input preparation, the request messages
and the reply's assembly; the two clients only differ in how they wait.

Input rule: float frames `[B, 3, T, H, W]` (or `[3, T, H, W]`, taken as B=1)
in [-1, 1], float32 / float16 / bfloat16 (torch; float64 is cast to
float32, as for decode's latents), or uint8 frames `[B, T, H, W, 3]` (or `[T, H, W, 3]`). T must be
1 + 4k. Frames are sent along the encoder's calls (frame 0 alone, then 4 a
message, each at most `FRAME_MESSAGE_BYTES`), made one message at a time, so
the server runs its first call once one frame has arrived and encodes while
the rest uploads.

uint8 when exact: float32 torch frames that are all of the form `u / 255 * 2 - 1`
(what diffusers' VideoProcessor makes of images and videos, so what the Wan
pipelines hand `vae.encode`) are sent as those uint8 values, 4x fewer bytes,
which the server turns back into the same float32 bits; checked bit for bit on
the frames' device, on a GPU always and on the CPU up to `RGB8_CHECK_BYTES`.

Trailing zeros: frames at the end whose every value is +0.0 (bit for bit, so
a -0.0 is sent) are not sent; the request's `trailing_zero_frames` tells the
server to append them. An image-to-video encode (an image, then
num_frames - 1 zero frames) then sends one frame: 4.8 MB for 480x832x81 in
fp32 (2.4 MB bf16, 1.2 MB when the image's floats are uint8 ones, as a
pipeline's are) instead of 388 MB (97 MB had it been uint8).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .errors import InternalError, LocalInputError
from .tensors import TensorFormatError, is_torch, native_array

pb = wire.pb
# float32 frames up to this size on the CPU (a few ms to check), and any on a GPU (where the check
# costs well under a millisecond a frame), are sent as uint8 when they are exactly uint8 frames.
# Larger CPU videos are sent as they are: the check is several passes over the video (2.7 s for
# 81 frames of 480x832 on 2 loaded cores), more than their 4x fewer bytes save over loopback.
RGB8_CHECK_BYTES = wire.FRAME_MESSAGE_BYTES
MOMENTS = "moments"
LATENTS = "latents"
OUTPUT_TYPES = (MOMENTS, LATENTS)
FRAMES_HELP = "frames must be float [B, 3, T, H, W] / [3, T, H, W] in [-1, 1], or uint8 [B, T, H, W, 3] / [T, H, W, 3]"


@dataclass(frozen=True)
class Video:
    """Frames ready to send: the batch axis added, float64 cast, trailing zeros counted."""

    frames: Any            # torch tensor or numpy array, wire layout, the frames to send
    zero_frames: int       # trailing zero frames not sent
    time_dim: int          # 2 for float [B, 3, T, H, W], 1 for uint8 [B, T, H, W, 3]
    as_torch: bool

    @property
    def total_frames(self) -> int:
        return self.frames.shape[self.time_dim] + self.zero_frames


def _trailing_zero_frames(frames: Any, time_dim: int, as_torch: bool) -> int:
    """How many frames at the end are all +0.0 (float frames only; bitwise, so -0.0 is not).
    Scanned from the last frame back, stopping at the first that is not: an ordinary video
    costs one frame's look before its upload starts, not a pass over the whole video."""
    t = frames.shape[time_dim]
    if as_torch:
        import torch

        bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[frames.dtype]

        def nonzero(i: int) -> bool:
            return bool(frames.select(time_dim, i).view(bits).any())
    else:
        bits_np = {np.dtype(np.float32): np.int32, np.dtype(np.float16): np.int16}[frames.dtype]

        def nonzero(i: int) -> bool:
            return bool(np.take(frames, i, axis=time_dim).view(bits_np).any())

    # at least frame 0 travels: the server needs one chunk for the call's shape and dtype
    for i in range(t - 1, 0, -1):
        if nonzero(i):
            return t - 1 - i
    return t - 1


def _rgb8_frames(frames: Any) -> Any | None:
    """float32 torch frames [B, 3, t, H, W] that are exactly what the server makes of uint8 frames
    (`u / 255 * 2 - 1`, as diffusers' VideoProcessor makes them of an image) -> those uint8 frames
    in the wire layout [B, t, H, W, 3]; None when any value is not (checked bit for bit, so -0.0,
    NaN or any other float keeps the float frames)."""
    import torch

    u = frames.add(1.0).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8)
    # The server's conversion (vaed.engine_protocol.rgb8_to_video_reference's bits), here on the frames'
    # device. The divisor is a tensor on that device: CUDA turns a division by a Python scalar
    # into a multiplication by its reciprocal, which rounds differently from the CPU's division
    # (the GPU would then pack frames the server turns into other floats); a true division
    # rounds the same on both.
    back = (u.to(torch.float32) / torch.tensor(255.0, device=u.device)) * 2.0 - 1.0
    if not torch.equal(back.view(torch.int32), frames.view(torch.int32)):
        return None
    return u.permute(0, 2, 3, 4, 1).contiguous()


def prepare_video(frames: Any, *, send_zeros: bool = False) -> Video:
    """Check and shape the caller's frames (`LocalInputError` before a byte is sent)."""
    as_torch = is_torch(frames)
    problem = wire.torch_data_problem(frames) if as_torch else None
    if problem:
        raise LocalInputError(problem)
    if not as_torch:
        frames = native_array(frames)
        if frames.dtype == np.float64:
            frames = frames.astype(np.float32)
    elif str(frames.dtype) == "torch.float64":
        frames = frames.float()
    name = str(frames.dtype).replace("torch.", "")
    if name not in ("uint8", "float32", "float16", "bfloat16"):
        raise LocalInputError(f"frames dtype {name} is not accepted; use uint8, float32, float16 or bfloat16")
    uint8 = name == "uint8"
    if frames.ndim == 4:
        frames = frames[None]
    if frames.ndim != 5 or frames.shape[-1 if uint8 else 1] != 3:
        raise LocalInputError(f"{FRAMES_HELP}; got shape {list(frames.shape)} ({name})")
    time_dim = 1 if uint8 else 2
    if 0 in frames.shape:
        # here, in the caller's shape: an empty float video is "exactly uint8" to _rgb8_frames, and the
        # server then named the repacked [B, T, H, W, 3] shape the caller never sent
        raise LocalInputError(f"frames shape {list(frames.shape)} ({name}) is empty: B, T, H and W must be at least 1")
    t = frames.shape[time_dim]
    try:
        wire.encoded_latent_frames(t)
    except ValueError as e:
        raise LocalInputError(str(e)) from None
    if as_torch:
        frames = frames.detach()
    zeros = 0 if uint8 or send_zeros else _trailing_zero_frames(frames, time_dim, as_torch)
    if zeros:
        frames = frames[:, :, : t - zeros] if time_dim == 2 else frames[:, : t - zeros]
    if as_torch and name == "float32" and (frames.is_cuda or frames.nbytes <= RGB8_CHECK_BYTES):
        packed = _rgb8_frames(frames)
        if packed is not None:  # the same frames at a quarter of the bytes
            frames, time_dim = packed, 1
    return Video(frames=frames, zero_frames=zeros, time_dim=time_dim, as_torch=as_torch)


def encode_options(
    *, output_type: str, out_dtype: Any = None, precision: Any = None, request_id: str | None = None,
    zero_frames: int = 0, encode_dtype: Any = None,
) -> Any:
    if output_type not in OUTPUT_TYPES:
        raise LocalInputError(f"unknown output_type {output_type!r}; use one of {', '.join(OUTPUT_TYPES)}")
    if request_id and (problem := wire.request_id_problem(request_id)) is not None:
        raise LocalInputError(problem)
    options = pb.EncodeOptions(latents=output_type == LATENTS, trailing_zero_frames=zero_frames,
                               request_id=request_id or "")
    if out_dtype is not None:
        try:
            options.out_dtype = wire.wire_dtype(out_dtype)
        except wire.TensorFormatError as e:
            raise LocalInputError(f"out_dtype: {e}") from None
    if encode_dtype is not None:
        try:
            options.encode_dtype = wire.wire_dtype(encode_dtype)
        except wire.TensorFormatError as e:
            raise LocalInputError(f"encode_dtype: {e}") from None
    if precision is not None:
        name = str(getattr(precision, "value", precision)).upper()
        if name not in ("LOSSLESS", "FAST"):
            raise LocalInputError(f"unknown precision {precision!r}; use 'lossless'")
        options.precision = pb.Precision.Value(name)
    return options


def call_slices(count: int, frame_bytes: int, cap_bytes: int,
                temporal: int = wire.DEFAULT_TEMPORAL_FACTOR) -> list[tuple[int, int]]:
    """(start, length) of the messages of `count` frames: cut where the causal encoder's calls
    are (frame 0 alone, then `temporal` frames), each call's frames in pieces of at most
    `cap_bytes` (`wire.frame_slices`). The first message is one frame, so the server's first
    encoder call starts once one frame has arrived, and every later message completes a call."""
    slices: list[tuple[int, int]] = []
    start = 0
    while start < count:
        length = min(1 if start == 0 else temporal, count - start)
        slices += [(start + s, n) for s, n in wire.frame_slices(length, frame_bytes, cap_bytes)]
        start += length
    return slices


def video_chunks(video: Video, options: Any, cap_bytes: int = wire.FRAME_MESSAGE_BYTES) -> Iterator[Any]:
    """VideoChunks along the encoder's calls (`call_slices`), each made only when the previous one
    was taken, options on the first."""
    frames = video.frames
    count = frames.shape[video.time_dim]
    frame_bytes = int(np.prod(frames.shape)) * frames.element_size() // count if video.as_torch else \
        frames.nbytes // count
    for i, (start, length) in enumerate(call_slices(count, frame_bytes, cap_bytes)):
        part = frames[:, :, start : start + length] if video.time_dim == 2 else frames[:, start : start + length]
        chunk = pb.VideoChunk()
        wire.to_message(part, out=chunk.frames)  # in place: nesting a built Tensor copies it again
        if i == 0:
            chunk.options.CopyFrom(options)
        yield chunk


class EncodedAssembly:
    """The replies of one Encode call -> the whole result (moments or latents): one latent frame a
    reply, `latent_frames` of them, all of one shape and dtype, or an InternalError naming what
    the server sent instead."""

    def __init__(self, output_type: str, as_torch: bool, latent_frames: int) -> None:
        self.output_type = output_type
        self.as_torch = as_torch
        self.latent_frames = latent_frames
        self.parts: list[Any] = []
        self.final = False

    def add(self, reply: Any) -> None:
        if reply.final:
            self.final = True
            return
        tensor = reply.latents if self.output_type == LATENTS else reply.moments
        try:
            part = wire.to_torch(tensor) if self.as_torch else wire.to_numpy(tensor)
        except TensorFormatError as e:
            raise InternalError(f"malformed {self.output_type} from server: {e}") from None
        first = self.parts[0] if self.parts else part
        if part.ndim != 5 or part.shape[2] != 1 or part.dtype != first.dtype or \
                tuple(part.shape) != tuple(first.shape):
            raise InternalError(f"server sent {self.output_type} of shape {list(part.shape)} ({part.dtype}) "
                                f"for latent frame {len(self.parts)}; one latent frame a reply, as the first: "
                                f"{list(first.shape)} ({first.dtype})")
        self.parts.append(part)

    def result(self) -> Any:
        if not self.final:
            raise InternalError("the Encode call ended without its final message")
        if len(self.parts) != self.latent_frames:
            raise InternalError(f"the frames encode to {self.latent_frames} latent frames, and the server sent "
                                f"{len(self.parts)}")
        if self.as_torch:
            import torch

            return torch.cat(self.parts, dim=2)
        return np.concatenate(self.parts, axis=2)
