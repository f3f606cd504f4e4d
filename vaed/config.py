"""Server configuration: one frozen dataclass, filled from the CLI (or tests).

Nothing here reads the environment; `vaed.cli` turns flags into a
ServerConfig and every other module takes what it needs from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vaed_client import wire

DEFAULT_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
DEFAULT_PORT = 50051

# Pixel sizes warmed before SERVING when --warmup-shapes is not given: the
# sizes Wan users serve. The first request at an unwarmed size paid 5.62 s
# against 1.26 s steady (480x832x81, H200), so pods warm these up front.
DEFAULT_WARMUP_SHAPES: dict[int, tuple[tuple[int, int], ...]] = {
    16: ((480, 832), (720, 1280)),  # Wan2.1 (z_dim 16)
    48: ((704, 1280),),             # Wan2.2 TI2V-5B (z_dim 48)
}

# Intra-op threads of torch's CPU ops in a GPU server. Its CPU work per decode
# step is small (a latent frame's finite check and contiguous copy, ~100k values
# at 480x832), but with torch's default (one thread per core, 16 on the H200
# host) each such op wakes the whole OpenMP pool and waits for its slowest
# thread: latent frame 0's kernel launches then took 10-50 ms instead of 8-18 ms,
# and the GPU waited on them. scripts/bench_service.py on an H200, 14 calls at
# 480x832: first frame through the client median 37.9 ms, max 70.6, 8/14 <= 40
# ms with 16 threads; median 28.0 ms, max 31.7, 14/14 with this default.
GPU_SERVER_CPU_THREADS = 1

PRECISIONS = ("lossless", "fast")
CUDA_GRAPH_CHOICES = ("on", "off")

# --parallel spatial shards a session only from this output frame size (H*W).
# 480x832 gains 1.78x on two H200s (0.706 s against 1.254 s for 81 frames);
# smaller sizes were not measured, so they stay on one GPU until
# scripts/bench_sharded.py --min-size says otherwise.
SPATIAL_MIN_PIXELS = 480 * 832


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    devices: tuple[str, ...] = ("cpu",)  # "cpu" or "cuda:N"; several GPUs form a pool behind one port
    dtype: str | None = None            # None: bfloat16 on CUDA, float32 on CPU
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT            # 0 picks a free port (tests)
    max_sessions: int = 16              # concurrent Decode/DecodeStream calls (all devices)
    max_concurrent_rpcs: int | None = None  # None: 2 x max_sessions + 8 (health checks are never capped)
    max_batch: int = 8                  # B of one request
    max_latent_frames: int = 1024       # T of one request / session total
    max_pixels: int = 1280 * 1280       # output H * W of one frame
    queue_chunks: int = 2               # decoded groups buffered per session (output backpressure)
    max_backlog_frames: int = 4         # latent frames buffered per DecodeStream session (input backpressure)
    # How long an admitted call may wait for its client's messages (0 = no limit): past it the
    # call ends DEADLINE_EXCEEDED and frees its slot, so idle calls cannot hold every slot until
    # their connection ages out (300 s + 60 s grace). 10 s before the first message: the client
    # library sends it as the call opens (decode, stream) or with the caller's first push
    # (session(): open it with the first chunk in hand). 30 s between later messages of a
    # DecodeStream: a streaming generator sends one chunk per generation step, and only the
    # generator's time counts: not while the server still decodes or sends what it received
    # (a lockstep client waits for those frames), nor while a full backlog keeps the server
    # from reading, nor after the client half-closed.
    session_first_message_timeout: float = 10.0
    session_idle_timeout: float = 30.0
    frame_message_bytes: int = wire.FRAME_MESSAGE_BYTES
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    grace: float = 30.0                 # seconds SIGTERM waits for in-flight streams
    kernels: str = "auto"               # auto | triton | off
    disabled_ops: tuple[str, ...] = ()  # fused ops switched off one by one
    layout: str = "auto"                # auto | channels_last | contiguous
    cuda_graphs: str = "off"            # on | off: replay captured decoder calls (vaed.graphs)
    precision: str = "lossless"         # default tier of requests that do not ask
    parallel: str = "off"               # off | spatial (one request over all devices)
    spatial_axis: str = "auto"          # auto | height | width
    spatial_min_pixels: int = SPATIAL_MIN_PIXELS  # smaller output frames decode on one GPU
    cpu_threads: int | None = None      # torch intra-op threads; None: GPU_SERVER_CPU_THREADS on CUDA, torch's default on CPU
    warmup: bool = True                 # warm-up decodes before reporting SERVING
    warmup_shapes: tuple[tuple[int, int], ...] | None = None  # None: DEFAULT_WARMUP_SHAPES by z_dim
    keepalive_time: float = 60.0        # server pings an idle connection every N s
    keepalive_timeout: float = 20.0     # ... and drops it when the ping is not answered within N s
    min_ping_interval: float = 30.0     # clients may ping every >= N s (the client library pings every 60 s)
    max_connection_age: float = 300.0   # close connections after ~N s so clients re-resolve DNS (0 = never)
    max_connection_age_grace: float = 60.0  # in-flight calls get N s more after that
    # Connection and stream limits (gRPC core; see vaed.server.grpc_options for the measurements).
    handshake_timeout: float = 10.0     # a connection that has not sent the HTTP/2 preface by then is closed
    max_connections: int = 1000         # concurrent connections (all peers); more are closed on accept
    max_streams_per_connection: int | None = None  # None: max_sessions + 16 (HTTP/2 MAX_CONCURRENT_STREAMS)
    max_health_calls: int = 8           # health requests read at once; more get RESOURCE_EXHAUSTED unread
    metrics_port: int | None = None
    metrics_host: str | None = None     # None: same as host
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None

    @property
    def device(self) -> str:
        """The first device (the only one unless a GPU pool is served)."""
        return self.devices[0]

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def compute_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.is_cuda else "float32"

    @property
    def intra_op_threads(self) -> int | None:
        """Threads for torch's CPU ops in this server process; None leaves torch's default (CPU decode)."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        return GPU_SERVER_CPU_THREADS if self.is_cuda else None

    @property
    def rpc_limit(self) -> int:
        if self.max_concurrent_rpcs is not None:
            return self.max_concurrent_rpcs
        return 2 * self.max_sessions + 8

    @property
    def streams_per_connection(self) -> int:
        """Every session plus health and info calls on one connection, and below the RPC cap
        (2 x max_sessions + 8) from 9 sessions on, so one connection cannot take every slot."""
        if self.max_streams_per_connection is not None:
            return self.max_streams_per_connection
        return self.max_sessions + 16

    def replace(self, **changes: object) -> "ServerConfig":
        return dataclasses.replace(self, **changes)
