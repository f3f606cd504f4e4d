"""Decoded chunks and their assembly into a whole video.

Layouts (as the server sends them): RGB8 frames are `[B, t, H, W, 3]` uint8 (time axis 1),
RAW frames `[B, 3, t, H, W]` (time axis 2). Every FrameChunk message says where
its frames start (`first_frame`), so assembly is placement, not concatenation:
messages may be split, and order does not matter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import tensors
from ._proto import vaed_pb2
from .errors import InternalError
from .heap import prefault, video_buffer
from .wire import output_frames  # re-exported; the rule lives in wire

RGB8 = "rgb8"
RAW = "raw"
# Time axis of a chunk's frames by format: the wire formats, then the output
# types of `vaed_client.outputs` (np [B,T,H,W,3], pt [B,T,3,H,W]; pil is a
# list per video of lists of images, its time axis the inner list).
TIME_AXIS = {RGB8: 1, RAW: 2, "uint8": 1, "np": 1, "pt": 1}
PIL = "pil"


@dataclass(frozen=True)
class DecodedChunk:
    """One received group of frames.

    `frames` is a torch tensor when the latents were torch, else numpy; its
    layout follows `format` (see module doc). `nbytes` counts wire bytes.
    """

    chunk_index: int
    first_frame: int
    frames: Any
    request_id: str
    format: str = RGB8
    final: bool = False
    nbytes: int = 0

    @property
    def num_frames(self) -> int:
        if self.format == PIL:
            return len(self.frames[0]) if self.frames else 0
        return int(self.frames.shape[TIME_AXIS[self.format]])

    @property
    def end_frame(self) -> int:
        return self.first_frame + self.num_frames


def frames_nbytes(tensor: vaed_pb2.Tensor) -> int:
    """A validated wire Tensor's payload size, from its header (reading `data` again would copy it)."""
    return tensors.itemsize(tensor.dtype) * math.prod(tensor.shape)


def has_frames(message: vaed_pb2.FrameChunk) -> bool:
    # The final message may be an empty marker with no `frames` set.
    return message.HasField("frames") and len(message.frames.shape) > 0


def to_chunk(message: vaed_pb2.FrameChunk, fmt: str, as_torch: bool) -> DecodedChunk:
    """FrameChunk message (with frames) -> DecodedChunk owning its own memory."""
    try:
        frames = tensors.to_torch(message.frames) if as_torch else tensors.to_numpy(message.frames)
    except tensors.TensorFormatError as e:
        raise InternalError(f"malformed frames from server: {e}") from None
    check_layout(tuple(frames.shape), fmt, message.frames.dtype)
    return DecodedChunk(
        chunk_index=message.chunk_index,
        first_frame=message.first_frame,
        frames=frames,
        request_id=message.request_id,
        format=fmt,
        final=message.final,
        nbytes=frames_nbytes(message.frames),
    )


def check_layout(shape: tuple[int, ...], fmt: str, wire_dtype: int) -> None:
    """InternalError unless a frame group is the wire format's layout (RGB8: uint8 [B, T, H, W, 3];
    RAW: floats [B, 3, T, H, W]) with at least one frame: a reply is read by its shape before its
    bytes."""
    if len(shape) != 5 or (fmt == RGB8 and shape[-1] != 3) or (fmt == RAW and shape[1] != 3) \
            or shape[TIME_AXIS[fmt]] < 1 or (wire_dtype == vaed_pb2.UINT8) != (fmt == RGB8):
        raise InternalError(f"server sent frames of shape {list(shape)} in {tensors.dtype_name(wire_dtype)}, "
                            f"not a {fmt} layout")


class VideoAssembler:
    """Places received frames into one preallocated buffer.

    The buffer is allocated once the first message gives B, H, W and dtype,
    with `expected_frames` along time (grown by doubling if the server sends
    more). Each message is copied exactly once, straight from the protobuf
    bytes (bf16 kept as its bit pattern until the end).
    """

    def __init__(self, fmt: str, expected_frames: int | None = None) -> None:
        self.format = fmt
        self.axis = TIME_AXIS[fmt]
        self.expected_frames = expected_frames
        self._storage: np.ndarray | None = None
        self._wire_dtype: int | None = None
        self._filled: np.ndarray = np.zeros(0, dtype=bool)
        self.end = 0
        self.nbytes = 0
        self.request_id = ""

    def add(self, message: vaed_pb2.FrameChunk) -> None:
        if message.request_id:
            self.request_id = message.request_id
        if not has_frames(message):
            return
        try:
            view = tensors.storage_view(message.frames)
        except tensors.TensorFormatError as e:
            raise InternalError(f"malformed frames from server: {e}") from None
        check_layout(view.shape, self.format, message.frames.dtype)
        t = view.shape[self.axis]
        first = int(message.first_frame)
        end = first + t
        if self._storage is None:
            self._allocate(view, message.frames.dtype, max(end, self.expected_frames or 0))
        assert self._storage is not None
        if message.frames.dtype != self._wire_dtype or _without_axis(view.shape, self.axis) != _without_axis(
            self._storage.shape, self.axis
        ):
            raise InternalError(
                f"frames {list(view.shape)} {tensors.dtype_name(message.frames.dtype)} do not match earlier "
                f"frames {list(self._storage.shape)} {tensors.dtype_name(self._wire_dtype or 0)}"
            )
        if end > self._storage.shape[self.axis]:
            self._grow(max(end, 2 * self._storage.shape[self.axis]))
        if self._filled[first:end].any():
            raise InternalError(f"server sent frames {first}..{end - 1} twice")
        index: list[Any] = [slice(None)] * view.ndim
        index[self.axis] = slice(first, end)
        self._storage[tuple(index)] = view
        if not self._filled.any():  # the first frames are in: fault the rest of the pages in beside
            prefault(self._storage)
        self._filled[first:end] = True
        self.end = max(self.end, end)
        self.nbytes += view.nbytes  # the payload's size (bf16 stays 2 bytes in the storage view)

    def _allocate(self, view: np.ndarray, wire_dtype: int, frames: int) -> None:
        shape = list(view.shape)
        shape[self.axis] = frames
        self._storage = video_buffer(shape, view.dtype.newbyteorder("="))
        self._wire_dtype = wire_dtype
        self._filled = np.zeros(frames, dtype=bool)

    def _grow(self, frames: int) -> None:
        assert self._storage is not None
        old = self._storage
        shape = list(old.shape)
        shape[self.axis] = frames
        self._storage = video_buffer(shape, old.dtype)
        index: list[Any] = [slice(None)] * old.ndim
        index[self.axis] = slice(0, old.shape[self.axis])
        self._storage[tuple(index)] = old
        prefault(self._storage)
        self._filled = np.concatenate([self._filled, np.zeros(frames - len(self._filled), dtype=bool)])

    def result(self, as_torch: bool) -> Any:
        """The whole video: torch (CPU) or numpy (bf16 widened to float32)."""
        if self._storage is None or self._wire_dtype is None:
            raise InternalError("server ended the call without sending any frames")
        if not self._filled[: self.end].all():
            missing = np.flatnonzero(~self._filled[: self.end])
            raise InternalError(f"server skipped frames {missing[:8].tolist()} ({len(missing)} missing)")
        if self.expected_frames is not None and self.end != self.expected_frames:
            raise InternalError(f"the latents decode to {self.expected_frames} frames, and the server sent "
                                f"{self.end}")
        storage = self._storage
        if self.end != storage.shape[self.axis]:
            index: list[Any] = [slice(None)] * storage.ndim
            index[self.axis] = slice(0, self.end)
            storage = np.ascontiguousarray(storage[tuple(index)])
        if as_torch:
            return tensors.storage_to_torch(storage, self._wire_dtype)
        if self._wire_dtype == vaed_pb2.BFLOAT16:
            return tensors.widen_bf16_bits(storage)
        return storage


def _without_axis(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(shape) if i != axis)


def assemble(chunks: Iterable[DecodedChunk]) -> Any:
    """Join DecodedChunks (any order) into one video along the time axis."""
    ordered = sorted(chunks, key=lambda c: c.first_frame)
    if not ordered:
        raise ValueError("no chunks to assemble")
    expected = 0
    for chunk in ordered:
        if chunk.first_frame != expected:
            raise ValueError(f"chunks do not tile the video: frame {expected} expected, got {chunk.first_frame}")
        expected = chunk.end_frame
    if ordered[0].format == PIL:
        return [sum((list(c.frames[b]) for c in ordered), []) for b in range(len(ordered[0].frames))]
    axis = TIME_AXIS[ordered[0].format]
    frames = [c.frames for c in ordered]
    if tensors.is_torch(frames[0]):
        import torch

        return torch.cat(frames, dim=axis)
    return np.concatenate(frames, axis=axis)


__all__ = [
    "RGB8", "RAW", "TIME_AXIS", "output_frames", "DecodedChunk", "has_frames", "to_chunk", "VideoAssembler", "assemble",
]
