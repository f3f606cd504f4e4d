"""vaed_client: send Wan VAE latents to a vaed server, get decoded frames back.

Needs grpcio, protobuf and numpy; torch is imported only when given torch
tensors (torch in -> torch out, numpy in -> numpy out).
"""

from __future__ import annotations

from .aio import AsyncDecodeSession, AsyncVaeClient
from .wire import MAX_MESSAGE_BYTES
from .client import DecodeSession, ModelInfo, VaeClient
from .errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    VaedError,
)
from .video import DecodedChunk, assemble

__version__ = "0.1.0"

# The result type of one received frame group, under the wire message's name
# too (the generated protobuf class stays at vaed_client._proto.vaed_pb2).
FrameChunk = DecodedChunk


__all__ = [
    "VaeClient",
    "AsyncVaeClient",
    "DecodeSession",
    "AsyncDecodeSession",
    "ModelInfo",
    "DecodedChunk",
    "FrameChunk",
    "assemble",
    "MAX_MESSAGE_BYTES",
    "VaedError",
    "InvalidArgumentError",
    "ResourceExhaustedError",
    "UnavailableError",
    "UnauthenticatedError",
    "CancelledError",
    "DeadlineExceededError",
    "InternalError",
    "__version__",
]
