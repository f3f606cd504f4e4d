"""vaed_client: send Wan VAE latents to a vaed server, get decoded frames back.

Needs grpcio, protobuf and numpy; torch is imported only when given torch
tensors or asked for torch output (torch in -> torch out, numpy in -> numpy
out), Pillow only for PIL output, PyAV only for `export_video`, diffusers
only for `RemoteAutoencoderKLWan` used inside a diffusers pipeline.
"""

from __future__ import annotations

from typing import Any

from .aio import AsyncDecodeSession, AsyncVaeClient
from .client import DecodeSession, VaeClient
from .core import ModelInfo
from .errors import (
    CancelledError,
    ClientClosedError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    LocalInputError,
    ReplicaMismatchError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    VaedError,
)
from .heap import keep_freed_memory
from .outputs import OUTPUT_TYPES
from .resume import CallReport, ResumePolicy
from .video import DecodedChunk, assemble
from .wire import MAX_MESSAGE_BYTES

__version__ = "0.1.0"

# The result type of one received frame group, under the wire message's name
# too (the generated protobuf class stays at vaed_client.wire.pb.FrameChunk).
FrameChunk = DecodedChunk

# Imported on first use: the drop-in VAE pulls torch (and diffusers when
# present), export_video pulls PyAV; plain clients should not pay for either.
_LAZY = {
    "RemoteAutoencoderKLWan": ("vaed_client.diffusers_vae", "RemoteAutoencoderKLWan"),
    "export_video": ("vaed_client.export", "export_video"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vaed_client' has no attribute {name!r}")


__all__ = [
    "VaeClient",
    "AsyncVaeClient",
    "DecodeSession",
    "AsyncDecodeSession",
    "ModelInfo",
    "CallReport",
    "ResumePolicy",
    "DecodedChunk",
    "FrameChunk",
    "assemble",
    "export_video",
    "RemoteAutoencoderKLWan",
    "OUTPUT_TYPES",
    "MAX_MESSAGE_BYTES",
    "keep_freed_memory",
    "VaedError",
    "LocalInputError",
    "ClientClosedError",
    "InvalidArgumentError",
    "ResourceExhaustedError",
    "UnavailableError",
    "ReplicaMismatchError",
    "UnauthenticatedError",
    "CancelledError",
    "DeadlineExceededError",
    "InternalError",
    "__version__",
]
