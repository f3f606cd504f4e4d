"""Conversion between numpy / torch arrays and the wire `Tensor` message.

Wire tensors are row-major, C-contiguous, little-endian bytes. numpy has no
bfloat16, so BFLOAT16 travels as its raw 16-bit pattern: torch bf16 tensors go
over the wire without a float32 detour, and numpy callers get BFLOAT16 results
widened to float32 (exact: bf16 is the top half of an fp32).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._proto import vaed_pb2

# DataType enum value <-> numpy storage dtype (bf16 stored as uint16 bits).
_NUMPY_STORAGE: dict[int, np.dtype] = {
    vaed_pb2.UINT8: np.dtype("uint8"),
    vaed_pb2.FLOAT16: np.dtype("<f2"),
    vaed_pb2.BFLOAT16: np.dtype("<u2"),
    vaed_pb2.FLOAT32: np.dtype("<f4"),
}
_NUMPY_TO_WIRE: dict[np.dtype, int] = {
    np.dtype("uint8"): vaed_pb2.UINT8,
    np.dtype("float16"): vaed_pb2.FLOAT16,
    np.dtype("float32"): vaed_pb2.FLOAT32,
}
DTYPE_NAMES: dict[int, str] = {
    vaed_pb2.UINT8: "uint8",
    vaed_pb2.FLOAT16: "float16",
    vaed_pb2.BFLOAT16: "bfloat16",
    vaed_pb2.FLOAT32: "float32",
}
WIRE_DTYPE_BY_NAME: dict[str, int] = {name: value for value, name in DTYPE_NAMES.items()}


class TensorFormatError(ValueError):
    """A wire tensor whose dtype, shape or byte count is inconsistent."""


def dtype_name(wire_dtype: int) -> str:
    return DTYPE_NAMES.get(wire_dtype, f"unknown({wire_dtype})")


def itemsize(wire_dtype: int) -> int:
    storage = _NUMPY_STORAGE.get(wire_dtype)
    if storage is None:
        raise TensorFormatError(f"unsupported dtype {dtype_name(wire_dtype)}; use one of {sorted(WIRE_DTYPE_BY_NAME)}")
    return storage.itemsize


def validate(message: vaed_pb2.Tensor) -> tuple[int, ...]:
    """Check dtype, shape and byte count; return the shape."""
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise TensorFormatError(f"negative dimension in shape {list(shape)}")
    expected = itemsize(message.dtype) * int(np.prod(shape, dtype=np.int64))
    if len(message.data) != expected:
        raise TensorFormatError(
            f"byte count {len(message.data)} does not match shape {list(shape)} of "
            f"{dtype_name(message.dtype)} ({expected} bytes expected)"
        )
    return shape


def _is_torch(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def to_message(array: Any) -> vaed_pb2.Tensor:
    """numpy array or torch tensor (any device, bf16 included) -> wire Tensor."""
    if _is_torch(array):
        return _torch_to_message(array)
    array = np.asarray(array)
    wire = _NUMPY_TO_WIRE.get(array.dtype)
    if wire is None:
        raise TensorFormatError(f"unsupported numpy dtype {array.dtype}; use uint8, float16 or float32")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return vaed_pb2.Tensor(dtype=wire, shape=list(array.shape), data=data)


def _torch_to_message(tensor: Any) -> vaed_pb2.Tensor:
    import torch

    wire = {
        torch.uint8: vaed_pb2.UINT8,
        torch.float16: vaed_pb2.FLOAT16,
        torch.bfloat16: vaed_pb2.BFLOAT16,
        torch.float32: vaed_pb2.FLOAT32,
    }.get(tensor.dtype)
    if wire is None:
        raise TensorFormatError(f"unsupported torch dtype {tensor.dtype}; use uint8, float16, bfloat16 or float32")
    host = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        host = host.view(torch.int16)  # same bits; numpy has no bf16
    return vaed_pb2.Tensor(dtype=wire, shape=list(tensor.shape), data=host.numpy().tobytes())


def to_numpy(message: vaed_pb2.Tensor) -> np.ndarray:
    """Wire Tensor -> numpy; BFLOAT16 is widened exactly to float32."""
    shape = validate(message)
    storage = np.frombuffer(message.data, dtype=_NUMPY_STORAGE[message.dtype]).reshape(shape)
    if message.dtype == vaed_pb2.BFLOAT16:
        return (storage.astype(np.uint32) << 16).view(np.float32)
    return storage.astype(storage.dtype.newbyteorder("="), copy=False)


def torch_dtype(wire_dtype: int) -> Any:
    import torch

    itemsize(wire_dtype)  # raises for unknown dtypes
    return {
        vaed_pb2.UINT8: torch.uint8,
        vaed_pb2.FLOAT16: torch.float16,
        vaed_pb2.BFLOAT16: torch.bfloat16,
        vaed_pb2.FLOAT32: torch.float32,
    }[wire_dtype]


def to_torch(message: vaed_pb2.Tensor) -> Any:
    """Wire Tensor -> CPU torch tensor of the wire dtype (bf16 kept as bf16).

    Assumes a little-endian host, like every platform torch ships for.
    """
    import torch

    shape = validate(message)
    dtype = torch_dtype(message.dtype)
    if not message.data:
        return torch.empty(shape, dtype=dtype)
    # protobuf bytes are immutable; bytearray makes the one copy torch can own.
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)


def storage_view(message: vaed_pb2.Tensor) -> np.ndarray:
    """Zero-copy, read-only numpy view of the wire bytes in their storage dtype.

    BFLOAT16 stays as its uint16 bit pattern. Used to copy each received chunk
    once, straight into a preallocated video, instead of decode-then-copy.
    """
    shape = validate(message)
    return np.frombuffer(message.data, dtype=_NUMPY_STORAGE[message.dtype]).reshape(shape)


def widen_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16/int16) -> float32, exactly."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def storage_to_torch(storage: np.ndarray, wire_dtype: int) -> Any:
    """Writable storage array -> torch tensor sharing its memory (bf16 restored)."""
    import torch

    if wire_dtype == vaed_pb2.BFLOAT16:
        return torch.from_numpy(storage.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(storage)
