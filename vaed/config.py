"""Server configuration: one frozen dataclass, filled from the CLI (or tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
DEFAULT_PORT = 50051

# Both ends set send/receive limits explicitly: gRPC's default receive limit is
# 4 MiB and one 480x832 RGB8 chunk of 4 frames is already 4.8 MiB.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Frame groups larger than this are split into several FrameChunks on frame
# boundaries; 16 MiB keeps each message far below both ends' 256 MiB limit and
# still carries 13 frames of 480x832 RGB8 per message.
DEFAULT_FRAME_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    device: str = "cpu"                 # "cpu" or "cuda:N"
    dtype: str | None = None            # None: bfloat16 on CUDA, float32 on CPU
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT            # 0 picks a free port (tests)
    max_sessions: int = 16              # concurrent Decode/DecodeStream calls
    max_batch: int = 8                  # B of one request
    max_latent_frames: int = 1024       # T of one request / session total
    max_pixels: int = 1280 * 1280       # output H * W of one frame
    queue_chunks: int = 2               # decoded groups buffered per session (backpressure)
    frame_message_bytes: int = DEFAULT_FRAME_MESSAGE_BYTES
    max_message_bytes: int = MAX_MESSAGE_BYTES
    grace: float = 30.0                 # seconds SIGTERM waits for in-flight streams
    kernels: str = "auto"               # auto | triton | off
    layout: str = "auto"                # auto | channels_last | contiguous
    warmup: bool = True                 # one decode before reporting SERVING
    metrics_port: int | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def compute_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.is_cuda else "float32"

    def replace(self, **changes: object) -> "ServerConfig":
        return dataclasses.replace(self, **changes)
