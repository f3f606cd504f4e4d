"""The one table of wire dtypes: DataType value <-> name <-> numpy / torch dtype.

Every other module (the client, its CLI and the server through
`vaed_client.wire`) looks dtypes up here. numpy has no bfloat16, so its numpy
*storage* is the raw 16-bit pattern (uint16); torch is imported only when a
torch dtype is asked for, so numpy-only installs never pay for it.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import numpy as np

from ._proto import vaed_pb2


class TensorFormatError(ValueError):
    """A wire tensor (or dtype) whose dtype, shape or byte count is unusable."""


DTYPE_NAMES: dict[int, str] = {
    vaed_pb2.UINT8: "uint8",
    vaed_pb2.FLOAT16: "float16",
    vaed_pb2.BFLOAT16: "bfloat16",
    vaed_pb2.FLOAT32: "float32",
}
WIRE_DTYPE_BY_NAME: dict[str, vaed_pb2.DataType] = {
    name: cast(vaed_pb2.DataType, value) for value, name in DTYPE_NAMES.items()  # plain ints at run time
}
# Common spellings people pass (torch/diffusers style); resolved to the names above.
_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
}

# DataType -> numpy storage dtype, little-endian (bf16 stored as its uint16 bits).
NUMPY_STORAGE: dict[int, np.dtype] = {
    vaed_pb2.UINT8: np.dtype("uint8"),
    vaed_pb2.FLOAT16: np.dtype("<f2"),
    vaed_pb2.BFLOAT16: np.dtype("<u2"),
    vaed_pb2.FLOAT32: np.dtype("<f4"),
}


def dtype_name(wire: int) -> str:
    """'float32' for FLOAT32; 'unknown(7)' for values outside the table."""
    return DTYPE_NAMES.get(wire, f"unknown({wire})")


def _supported() -> str:
    return ", ".join(DTYPE_NAMES.values())


def itemsize(wire: int) -> int:
    """Bytes per element of a wire dtype; TensorFormatError for unknown ones."""
    storage = NUMPY_STORAGE.get(wire)
    if storage is None:
        raise TensorFormatError(f"unsupported dtype {dtype_name(wire)}; use one of {_supported()}")
    return storage.itemsize


def torch_dtype(wire: int) -> Any:
    """DataType value -> torch dtype (imports torch)."""
    import torch

    itemsize(wire)  # raises for unknown dtypes
    return getattr(torch, DTYPE_NAMES[wire])


def wire_dtype(dtype: Any) -> vaed_pb2.DataType:
    """torch dtype, numpy dtype/type, name ('bfloat16', 'bf16', 'torch.float16')
    or a DataType value -> DataType value. TensorFormatError otherwise."""
    if isinstance(dtype, bool):
        raise TensorFormatError(f"unsupported dtype {dtype!r}; use one of {_supported()}")
    if isinstance(dtype, int):
        itemsize(dtype)
        return cast(vaed_pb2.DataType, dtype)  # a checked wire value (protobuf enums are ints at run time)
    name = str(dtype).lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in WIRE_DTYPE_BY_NAME:
        try:
            name = np.dtype(dtype).name
        except Exception:  # neither torch, a name, nor a numpy-understood dtype
            pass
    if name not in WIRE_DTYPE_BY_NAME:
        shown = name if isinstance(dtype, type) else str(dtype)
        raise TensorFormatError(f"unsupported dtype {shown}; use one of {_supported()}")
    return WIRE_DTYPE_BY_NAME[name]


def is_torch(value: Any) -> bool:
    """True for a torch.Tensor, without importing torch when nobody else has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
