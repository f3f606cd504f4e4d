"""Conversion between numpy / torch arrays and the wire `Tensor` message.

Wire tensors are row-major, C-contiguous, little-endian bytes. numpy has no
bfloat16, so BFLOAT16 travels as its raw 16-bit pattern: torch bf16 tensors go
over the wire without a float32 detour, and numpy callers get BFLOAT16 results
widened to float32 (exact: bf16 is the top half of an fp32). The dtype table
is `dtypes.py`; the public face of both is `vaed_client.wire`.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from ._proto import vaed_pb2
from .dtypes import (  # re-exported: the old public names of this module
    DTYPE_NAMES,
    NUMPY_STORAGE,
    WIRE_DTYPE_BY_NAME,
    TensorFormatError,
    dtype_name,
    is_torch,
    itemsize,
    torch_dtype,
    wire_dtype,
)

__all__ = [
    "DTYPE_NAMES", "NUMPY_STORAGE", "WIRE_DTYPE_BY_NAME", "TensorFormatError", "dtype_name", "is_torch", "itemsize",
    "torch_dtype", "wire_dtype", "validate", "payload", "to_message", "to_numpy", "to_torch", "storage_view",
    "widen_bf16_bits", "storage_to_torch", "to_bf16_message", "torch_data_problem", "MAX_RANK",
]


# Most dimensions a wire tensor may have (latents [B, z, T, h, w] and frames [B, T, H, W, 3] have 5).
MAX_RANK = 8


def validate(message: vaed_pb2.Tensor, data: bytes | None = None) -> tuple[int, ...]:
    """Check dtype, shape and byte count; return the shape. `data`: `message.data` when the
    caller already read it (see `payload`).

    The expected byte count is computed with Python ints: numpy's int64
    product wraps (shape [1,16,1,2**32,2**32] is 2**68 elements, 0 mod 2**64),
    which would let an absurd shape with a small payload through.
    """
    if len(message.shape) > MAX_RANK:
        # before any arithmetic or message on the shape: a product of 600 000 dimensions took the
        # server's event loop 9 s, and a message echoing it passed gRPC's 16 KiB metadata limit
        raise TensorFormatError(f"the shape has {len(message.shape)} dimensions; a vaed tensor has at most {MAX_RANK}")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise TensorFormatError(f"negative dimension in shape {list(shape)}")
    try:
        size = itemsize(message.dtype)
    except TensorFormatError as e:
        raise TensorFormatError(f"shape {list(shape)}: {e}") from None
    expected = size * math.prod(shape)
    count = len(payload(message) if data is None else data)
    if count != expected:
        raise TensorFormatError(
            f"byte count {count} does not match shape {list(shape)} of "
            f"{dtype_name(message.dtype)} ({expected} bytes expected)"
        )
    return shape


def to_message(array: Any, out: vaed_pb2.Tensor | None = None) -> vaed_pb2.Tensor:
    """numpy array or torch tensor (any device, bf16 included) -> wire Tensor.

    `out`: the Tensor field of a message being built (`chunk.frames`), filled in place and
    returned. Nesting a Tensor built apart copies its payload once more (protobuf's upb
    runtime): 40 % of building and serializing a 4.8 MB FrameChunk (4 RGB8 480x832 frames)."""
    if is_torch(array):
        return _torch_to_message(array, out)
    array = np.asarray(array)
    try:
        wire = wire_dtype(array.dtype)
    except TensorFormatError:
        raise TensorFormatError(f"unsupported numpy dtype {array.dtype}; use uint8, float16 or float32") from None
    if wire == vaed_pb2.BFLOAT16:  # only reachable through ml_dtypes-style numpy bf16
        raise TensorFormatError("numpy bfloat16 is not supported; pass a torch tensor")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return _filled(out, wire, array.shape, data)


def _filled(out: vaed_pb2.Tensor | None, wire: int, shape: tuple[int, ...], data: bytes) -> vaed_pb2.Tensor:
    message = vaed_pb2.Tensor() if out is None else out
    message.dtype = cast(vaed_pb2.DataType, wire)  # a checked, nonzero DataType: marks `out` present
    del message.shape[:]
    message.shape.extend(int(d) for d in shape)
    message.data = data
    return message


def torch_data_problem(tensor: Any) -> str | None:
    """Why a torch tensor has no dense data to send (torch's own errors for these name numpy or
    storage, which the caller never used), or None."""
    import torch

    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor cannot travel; pass a dense one (.to_dense())"
    if tensor.is_meta:
        return "a meta tensor has no data to send"
    return None


def _torch_to_message(tensor: Any, out: vaed_pb2.Tensor | None = None) -> vaed_pb2.Tensor:
    import torch

    try:
        wire = wire_dtype(tensor.dtype)
    except TensorFormatError:
        raise TensorFormatError(
            f"unsupported torch dtype {tensor.dtype}; use uint8, float16, bfloat16 or float32"
        ) from None
    problem = torch_data_problem(tensor)
    if problem:
        raise TensorFormatError(problem)
    host = tensor.detach().to("cpu")
    if tensor.dtype == torch.bfloat16:
        host = host.view(torch.int16)  # same bits; numpy has no bf16
    # numpy's tobytes writes C order from any strides in one single-threaded copy; a torch
    # .contiguous() first (e.g. of a latents[:, :, :2] slice) would add a copy that wakes
    # torch's whole intra-op pool, which in a busy process costs milliseconds of jitter.
    return _filled(out, wire, tuple(tensor.shape), host.numpy().tobytes())


def to_bf16_message(array: Any, out: vaed_pb2.Tensor | None = None) -> vaed_pb2.Tensor:
    """float32 numpy array or torch tensor -> BFLOAT16 wire Tensor, rounded as torch's
    `.to(torch.bfloat16)` rounds (to nearest, ties to even; NaN stays NaN; past bf16's largest
    finite value, Inf), so the server sees the bits its own cast would have made. `out` as
    for `to_message`."""
    if is_torch(array):
        import torch

        return _torch_to_message(array.to(torch.bfloat16), out)
    bits = np.ascontiguousarray(array, dtype="<f4").view(np.uint32)
    # Round to nearest even on the top 16 bits: add 0x7FFF plus the kept part's lowest bit.
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype("<u2")
    nan = (bits & 0x7FFFFFFF) > 0x7F800000  # the carry above would turn some NaNs into Inf or 0
    if nan.any():
        rounded[nan] = 0x7FC0
    return _filled(out, vaed_pb2.BFLOAT16, bits.shape, rounded.tobytes())


def native_array(value: Any) -> np.ndarray:
    """``np.asarray(value)`` in this machine's byte order: a big-endian array holds the same
    numbers, and the dtype rules name ``float32``, never ``>f4``."""
    array = np.asarray(value)
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def to_numpy(message: vaed_pb2.Tensor) -> np.ndarray:
    """Wire Tensor -> numpy; BFLOAT16 is widened exactly to float32."""
    storage = storage_view(message)
    if message.dtype == vaed_pb2.BFLOAT16:
        return widen_bf16_bits(storage)
    return storage.astype(storage.dtype.newbyteorder("="), copy=False)


def payload(message: vaed_pb2.Tensor) -> bytes:
    """`message.data`, read once per use: protobuf's upb runtime makes a new bytes object, a copy of
    the payload, on every read of a bytes field (17 ms for a 19 MB message of 4 fp32 480x832 frames),
    so the functions here read it once and pass it on instead of reading it per check."""
    return message.data


def to_torch(message: vaed_pb2.Tensor, data: bytes | None = None) -> Any:
    """Wire Tensor -> CPU torch tensor of the wire dtype (bf16 kept as bf16); `data` as for
    `validate`.

    Assumes a little-endian host, like every platform torch ships for.
    """
    import torch

    data = payload(message) if data is None else data
    shape = validate(message, data)
    dtype = torch_dtype(message.dtype)
    if not data:
        return torch.empty(shape, dtype=dtype)
    # protobuf bytes are immutable; bytearray makes the one copy torch can own.
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def storage_view(message: vaed_pb2.Tensor) -> np.ndarray:
    """Zero-copy, read-only numpy view of the wire bytes in their storage dtype.

    BFLOAT16 stays as its uint16 bit pattern. Used to copy each received chunk
    once, straight into a preallocated video, instead of decode-then-copy.
    """
    data = payload(message)
    shape = validate(message, data)
    return np.frombuffer(data, dtype=NUMPY_STORAGE[message.dtype]).reshape(shape)


def widen_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16/int16) -> float32, exactly."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def storage_to_torch(storage: np.ndarray, wire: int) -> Any:
    """Writable storage array -> torch tensor sharing its memory (bf16 restored)."""
    import torch

    if wire == vaed_pb2.BFLOAT16:
        return torch.from_numpy(storage.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(storage)
