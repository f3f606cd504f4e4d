"""Public wire knowledge of vaed, shared by the client, its CLI and the server.

One copy of everything both ends must agree on: the generated stubs (`pb`,
`pb_grpc`), the service name and methods, message limits, the bearer-token
variable, the frames-per-latent rule, how a frame group is split into
messages, the dtype table and tensor (de)serialisation. The server imports
this module instead of the client's private ones, so changing a rule here
changes it on both ends at once.

Needs numpy, grpcio and protobuf only; torch is imported lazily by the torch
helpers.
"""

from __future__ import annotations

from ._proto import vaed_pb2 as pb
from ._proto import vaed_pb2_grpc as pb_grpc
from .dtypes import (
    DTYPE_NAMES,
    WIRE_DTYPE_BY_NAME,
    TensorFormatError,
    dtype_name,
    is_torch,
    itemsize,
    torch_dtype,
    wire_dtype,
)
from .tensors import payload, to_bf16_message, to_message, to_numpy, to_torch, torch_data_problem, validate

SERVICE_NAME = "vaed.v1.VaeDecoder"
# The port `vaed serve` listens on by default; client targets without a port get
# it (gRPC itself would dial 443).
DEFAULT_PORT = 50051
METHODS: tuple[str, ...] = ("GetModelInfo", "Decode", "DecodeStream", "Encode")

# gRPC's default receive limit is 4 MiB, and one 480x832 RGB8 group of 4
# frames is already 4.8 MiB: both ends set 256 MiB explicitly.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Default cap on one FrameChunk's frame payload: a 720x1280 RGB8 group of 4
# frames (11 MiB) stays one message, far below MAX_MESSAGE_BYTES, and a RAW
# float32 group is split into several messages instead of one 44 MiB blob.
FRAME_MESSAGE_BYTES = 16 * 1024 * 1024

# Environment variable holding the bearer token (read when a command or the
# server starts, never at import).
AUTH_TOKEN_ENV = "VAED_AUTH_TOKEN"
# Longest request_id the server accepts or echoes (it ends up in logs).
MAX_REQUEST_ID_CHARS = 128


def request_id_problem(request_id: object) -> str | None:
    """Why the server refuses a caller's request id, else None: it must be at most
    MAX_REQUEST_ID_CHARS printable ASCII characters other than the space. It is the `id=` field
    of the server's log line, whose fields spaces separate: an id "x status=OK" made a failed
    call's line read as an OK one's."""
    if not isinstance(request_id, str):
        return f"request_id must be a str, got {type(request_id).__name__}"
    if len(request_id) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in request_id):
        return (f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces; "
                f"got {len(request_id)} characters starting {request_id[:16]!r}")
    return None

# Wan's causal VAE: latent frame 0 -> 1 frame, every later one -> 4.
DEFAULT_TEMPORAL_FACTOR = 4

# Initial metadata of Decode / DecodeStream (the decoder's) and Encode (the encoder's): what
# decides the call's bits (ModelInfo.decoder_identity / encoder_identity), sent before the first
# reply, so a client resuming a call on another replica compares it with the first attempt's.
DECODER_IDENTITY_HEADER = "vaed-decoder-identity"
ENCODER_IDENTITY_HEADER = "vaed-encoder-identity"
_IDENTITY_SEPARATOR = "; "


def identity_line(parts: list[tuple[str, str]]) -> str:
    """An identity's (name, value) parts -> its line, `name=value; name=value`. A value keeps to
    printable ASCII without ";" (a gRPC header value; the separator), which a GPU's name could break."""
    def clean(value: str) -> str:
        return "".join(c if " " <= c <= "~" and c != ";" else "?" for c in value).strip()

    return _IDENTITY_SEPARATOR.join(f"{name}={clean(value)}" for name, value in parts)


def identity_parts(line: str) -> dict[str, str]:
    """An identity line -> {name: value} (`identity_line`'s inverse; text without "=" is kept whole,
    under its own text, so two lines of another form still compare)."""
    parts: dict[str, str] = {}
    for item in line.split(";"):
        name, sep, value = item.strip().partition("=")
        if name:
            parts[name] = value if sep else ""
    return parts


def output_frames(latent_frames: int, temporal: int = DEFAULT_TEMPORAL_FACTOR) -> int:
    """Frames decoded from `latent_frames` latent frames: 1 + temporal*(T-1), 0 for 0."""
    if latent_frames < 0:
        raise ValueError(f"latent_frames must be >= 0, got {latent_frames}")
    if temporal < 1:
        raise ValueError(f"temporal factor must be >= 1, got {temporal}")
    return 0 if latent_frames == 0 else 1 + temporal * (latent_frames - 1)


def encoded_latent_frames(frames: int, temporal: int = DEFAULT_TEMPORAL_FACTOR) -> int:
    """Latent frames the causal encoder makes of `frames` frames (1 + temporal*k of them:
    frame 0 alone, then `temporal` per latent frame); ValueError for any other count."""
    if temporal < 1:
        raise ValueError(f"temporal factor must be >= 1, got {temporal}")
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(
            f"the encoder takes 1 + {temporal}k frames (1, {1 + temporal}, {1 + 2 * temporal}, ...), got {frames}"
        )
    return 1 + (frames - 1) // temporal


def frame_slices(count: int, frame_bytes: int, cap_bytes: int) -> list[tuple[int, int]]:
    """(start, length) pieces of a group of `count` frames of `frame_bytes`
    each, so that every piece's payload is <= cap_bytes; a frame larger than
    the cap still travels, alone (a frame cannot be split)."""
    if count < 0 or frame_bytes < 0:
        raise ValueError(f"count and frame_bytes must be >= 0, got {count}, {frame_bytes}")
    if cap_bytes < 1:
        raise ValueError(f"cap_bytes must be >= 1, got {cap_bytes}")
    if count == 0:
        return []
    step = count if frame_bytes == 0 else max(1, min(count, cap_bytes // frame_bytes))
    return [(start, min(step, count - start)) for start in range(0, count, step)]


__all__ = [
    "pb",
    "pb_grpc",
    "SERVICE_NAME",
    "METHODS",
    "MAX_MESSAGE_BYTES",
    "FRAME_MESSAGE_BYTES",
    "AUTH_TOKEN_ENV",
    "MAX_REQUEST_ID_CHARS",
    "request_id_problem",
    "DEFAULT_TEMPORAL_FACTOR",
    "DECODER_IDENTITY_HEADER",
    "ENCODER_IDENTITY_HEADER",
    "identity_line",
    "identity_parts",
    "output_frames",
    "encoded_latent_frames",
    "frame_slices",
    "DTYPE_NAMES",
    "WIRE_DTYPE_BY_NAME",
    "TensorFormatError",
    "dtype_name",
    "itemsize",
    "torch_dtype",
    "wire_dtype",
    "is_torch",
    "to_message",
    "to_bf16_message",
    "torch_data_problem",
    "to_numpy",
    "to_torch",
    "validate",
    "payload",
]
