"""Server configuration: one frozen dataclass, filled from the CLI (or tests).

Nothing here reads the environment; `vaed.cli` turns flags into a
ServerConfig and every other module takes what it needs from it. Each field
that is a `vaed serve` flag declares it here (name, help, choices; the default
is the field's), so the parser, `--help` and the config cannot disagree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from vaed_client import wire

from .choices import ComputeDtype, ConvPlans, CudaGraphs, Kernels, Layout, LogLevel, Parallel, Precision, SpatialAxis
from .flags import coerce_choices, option, port_number, positive_int, seconds, shapes, whole_number

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
# and the GPU waited on them. benchmarks/bench_service.py on an H200, 14 calls at
# 480x832: first frame through the client median 37.9 ms, max 70.6, 8/14 <= 40
# ms with 16 threads; median 28.0 ms, max 31.7, 14/14 with this default.
GPU_SERVER_CPU_THREADS = 1

# --parallel spatial shards a session only from this output frame size (H*W).
# 480x832 gains 1.78x on two H200s (0.706 s against 1.254 s for 81 frames);
# smaller sizes were not measured, so they stay on one GPU until
# benchmarks/bench_sharded.py --min-size says otherwise.
SPATIAL_MIN_PIXELS = 480 * 832


# The model spec's help: what `--model` accepts.
_MODEL_HELP = (
    "local diffusers folder (repo root or its vae/), hub id (subfolder vae), or "
    "random:wan2.1 / random:wan2.2[?seed=N] (real architectures, seeded random weights) or "
    "random:wan2.1-tiny / random:wan2.2-tiny (a few channels, for CPU development)"
)


def _op_names() -> list[str]:
    # vaed.patches imports torch and the kernels; only a parser being built needs the names.
    from .patches import OP_NAMES

    return sorted(OP_NAMES)


@dataclass(frozen=True)
class ServerConfig:
    """Everything `vaed serve` is told. A field with a flag (`option(...)`) is that flag:
    vaed.cli builds the parser from these fields (vaed.flags), so name, default, choices and
    help are written here once. `devices` comes from --gpu/--device (resolved against the
    host's CUDA devices by vaed.cli); the message sizes are set only by code."""

    model: str = option(DEFAULT_MODEL, _MODEL_HELP)
    devices: tuple[str, ...] = ("cpu",)  # "cpu" or "cuda:N"; several GPUs form a pool behind one port
    dtype: ComputeDtype | None = option(None, "compute dtype", choices=ComputeDtype,
                                        no_default="bfloat16 on CUDA, float32 on CPU")
    host: str = option("0.0.0.0", "address to bind")
    port: int = option(DEFAULT_PORT, "port to bind; 0 picks a free one", parse=port_number)
    precision: Precision = option(
        Precision.LOSSLESS, "tier of requests that do not ask for one; a request may always ask for lossless",
        choices=Precision)
    encode: bool = option(
        False, "load the encoder too and serve Encode (video frames -> latents); Wan2.1's encoder "
        "weights are 0.1 GiB in bf16", action="store_true")
    encode_dtype: ComputeDtype | None = option(
        None, "compute dtype of Encode (a request may ask for --dtype too); one more copy of the encoder "
        "when it differs from --dtype (in fp32: 0.2 GiB for Wan2.1, 0.56 GiB for Wan2.2)", choices=ComputeDtype,
        no_default="--dtype")
    parallel: Parallel = option(
        Parallel.OFF, "spatial: a large request is decoded by all --gpu devices together", choices=Parallel)
    spatial_axis: SpatialAxis = option(
        SpatialAxis.AUTO, "axis split by --parallel spatial; auto = the longer one", choices=SpatialAxis)
    spatial_min_pixels: int = option(
        SPATIAL_MIN_PIXELS, "--parallel spatial shards output frames of at least this many pixels; smaller "
        "ones decode on the first GPU", parse=whole_number, default_note="= 480x832")
    max_sessions: int = option(
        16, "concurrent Decode, DecodeStream and Encode calls (gRPC and HTTP); more get RESOURCE_EXHAUSTED",
        parse=positive_int)
    max_concurrent_rpcs: int | None = option(
        None, "concurrent RPCs of any kind but health; more get RESOURCE_EXHAUSTED unread", parse=positive_int,
        no_default="2 x --max-sessions + 8")
    max_batch: int = option(8, "largest B of one call", parse=positive_int)
    max_latent_frames: int = option(
        1024, "largest T (latent frames) of one call or session; 0 = no limit", parse=whole_number)
    max_pixels: int = option(
        1280 * 1280, "largest output H*W of one frame; 0 = no limit", parse=whole_number,
        default_note="= 1280x1280")
    queue_chunks: int = option(
        2, "decoded chunks buffered per call before its decode waits for the client",
        parse=positive_int)
    max_backlog_frames: int = option(
        4, "latent frames a DecodeStream session buffers before the server stops reading its client",
        parse=positive_int)
    # How long an admitted call may wait for its client's messages (0 = no limit): past it the
    # call ends DEADLINE_EXCEEDED and frees its slot, so idle calls cannot hold every slot until
    # their connection ages out (300 s + its 600 s grace). 10 s before the first message: the client
    # library sends it as the call opens (decode, stream) or with the caller's first push
    # (session(): open it with the first chunk in hand). 30 s between later messages of a
    # DecodeStream: a streaming generator sends one chunk per generation step, and only the
    # generator's time counts: not while the server still decodes or sends what it received
    # (a lockstep client waits for those frames), nor while a full backlog keeps the server
    # from reading, nor after the client half-closed.
    session_first_message_timeout: float = option(
        10.0, "seconds a Decode, DecodeStream or Encode call may wait for its first message (an HTTP call "
        "for its whole body); then it ends DEADLINE_EXCEEDED (HTTP 504) and frees its session slot; 0 = no limit",
        parse=seconds, metavar="SECONDS")
    session_idle_timeout: float = option(
        30.0, "seconds a DecodeStream or Encode session may wait for its next message once everything it "
        "sent is done and sent back; then it ends DEADLINE_EXCEEDED and frees its "
        "slot; 0 = no limit", parse=seconds, metavar="SECONDS")
    # How long an answer may wait for its client to take any of it, on both fronts: a client that
    # opens a large decode and reads nothing otherwise holds its session slot, with the server
    # idle, until its connection goes (gRPC: --max-connection-age 300 s + its 600 s grace).
    send_timeout: float = option(
        30.0, "seconds an answer may wait for its client to take any of it (a gRPC call's next response "
        "message; an HTTP answer's next bytes, the front's or /metrics'); then the call ends "
        "DEADLINE_EXCEEDED and frees its session slot (HTTP: its connection is closed); a slow reader "
        "that keeps reading is not cut; 0 = no limit; --http-send-timeout is its former name, from when it "
        "bounded HTTP answers only", parse=seconds, metavar="SECONDS", aliases=("--http-send-timeout",))
    frame_message_bytes: int = wire.FRAME_MESSAGE_BYTES
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    grace: float = option(
        30.0, "seconds SIGTERM lets in-flight calls (gRPC and HTTP) finish; the rest are then cut; a second "
        "SIGTERM exits at once", parse=seconds)
    kernels: Kernels = option(
        Kernels.AUTO, "fused bit-exact Triton data movement: auto (when eligible), triton (required), off",
        choices=Kernels)
    disabled_ops: tuple[str, ...] = option(
        (), "switch one fused op off (repeatable); the stock aten chain runs in its place",
        name="--disable-op", choice_names=_op_names, action="append")
    layout: Layout = option(
        Layout.AUTO, "decoder memory layout: auto = channels_last_3d on CUDA, contiguous on CPU", choices=Layout)
    cuda_graphs: CudaGraphs = option(
        CudaGraphs.OFF, "replay decoder calls from captured CUDA graphs, one per call signature "
        "(bit-identical; more GPU memory for the graphs' buffers): on = every call, first = each "
        "video's first chunk only (the first frame's launches), off = none", choices=CudaGraphs)
    conv_plans: ConvPlans = option(
        ConvPlans.CACHED, "each tier's convs on the cuDNN engine timed fastest per conv shape, the "
        "lossless tier's on engines that give torch's bits (needs nvidia-cudnn-frontend): cached = "
        "replay the choices in the kernel cache's plan file, tune = also time the warm-up sizes' convs "
        "it lacks at start-up (at most 120 s a start and tier; once per GPU model and cache) and add "
        "them, off = torch's pick", choices=ConvPlans)
    kernel_cache: str | None = option(
        None, "directory Triton keeps its compiled kernels in (TRITON_CACHE_DIR of this process): a "
        "restart that finds them there skips the compiles; mount it on a volume that outlives the pod",
        metavar="DIR", no_default="$TRITON_CACHE_DIR, else Triton's ~/.triton/cache")
    cpu_threads: int | None = option(
        None, "threads of torch's CPU ops in this process", parse=positive_int, metavar="N",
        no_default="1 with --gpu, whose CPU work is small and was slowed by waking a pool per op; with "
        "--device cpu 1 for the -tiny models, up to 10x faster on a busy machine, and torch's default, one "
        "per core, for the full-size ones")
    warmup: bool = option(True, "report SERVING without warm-up decodes", name="--no-warmup", action="store_false")
    warmup_shapes: tuple[tuple[int, int], ...] | None = option(
        None, "output sizes decoded up to their steady chunk before SERVING", parse=shapes,
        metavar="HxW[,HxW...]|none",
        no_default="480x832,720x1280 for Wan2.1, 704x1280 for Wan2.2 on CUDA; a small one on CPU")
    keepalive_time: float = option(60.0, "seconds between server pings on an idle connection", parse=seconds)
    keepalive_timeout: float = option(
        20.0, "seconds a ping may go unanswered before the connection is dropped", parse=seconds)
    min_ping_interval: float = option(
        30.0, "shortest client ping interval allowed, in seconds",
        parse=seconds)
    max_connection_age: float = option(
        300.0, "seconds after which a connection is closed so clients re-resolve DNS and reach "
        "new replicas; 0 = never", parse=seconds)
    # 600 s, as the manifests have it: a DecodeStream session longer than age + grace is cut (and
    # resumed, replaying its latents); a longer grace costs nothing, no new call starts on the
    # closing connection (60 s cut a streaming generator's sessions every 6 minutes)
    max_connection_age_grace: float = option(
        600.0, "seconds in-flight calls (a long DecodeStream session) get after --max-connection-age "
        "before they are cut", parse=seconds)
    # Connection and stream limits (gRPC core; see vaed.server.grpc_options for the measurements).
    handshake_timeout: float = option(
        10.0, "seconds a new connection may take to send the HTTP/2 preface (and TLS handshake) "
        "before it is closed", parse=seconds, metavar="SECONDS")
    max_connections: int = option(
        1000, "concurrent connections from all peers; more are closed as they are accepted, and "
        "it is lowered to leave 256 fds under RLIMIT_NOFILE", parse=positive_int, metavar="N")
    max_streams_per_connection: int | None = option(
        None, "concurrent calls on one connection (HTTP/2 MAX_CONCURRENT_STREAMS); clients queue "
        "past it, and a connection resetting streams faster gets REFUSED_STREAM", parse=positive_int,
        metavar="N", no_default="--max-sessions + 16")
    max_health_calls: int = option(
        8, "health requests read at once (they need no token and are at most 4096 bytes); "
        "more get RESOURCE_EXHAUSTED", parse=positive_int, metavar="N")
    # Named for what it sizes, video: --encode is the VAE encoder's flag.
    video_threads: int | None = option(
        None, "threads that encode server-side video (gRPC format MP4, HTTP output_type=mp4) for every "
        "session; a session uses one at a time", parse=positive_int, metavar="N",
        no_default="half the host's cores per served device (--gpu count, 1 on CPU), 1 to 8")
    metrics_port: int | None = option(None, "serve Prometheus metrics at /metrics on this port",
                                      parse=port_number)
    metrics_host: str | None = option(None, "address the metrics endpoint binds", no_default="--host")
    http_port: int | None = option(
        None, "serve Hugging Face's remote-VAE protocol (diffusers' remote_decode) and /health over HTTP "
        "on this port; the same port as --metrics-port shares its listener", parse=port_number, no_default="off")
    http_host: str | None = option(None, "address the HTTP front binds", no_default="--host")
    tls_cert: str | None = option(None, "PEM certificate chain; with --tls-key serves TLS")
    tls_key: str | None = option(None, "PEM private key for --tls-cert")
    tls_client_ca: str | None = option(
        None, "PEM CA bundle; with --tls-cert/--tls-key clients must present a certificate it signed "
        "(mutual TLS)", metavar="PATH")
    auth_token_file: str | None = option(
        None, "require 'authorization: Bearer <token>' on every RPC but health; "
        "without this flag the token is read from $VAED_AUTH_TOKEN when set")
    log_level: LogLevel = option(
        LogLevel.INFO, "least severe log records written to stderr", choices=LogLevel)

    def __post_init__(self) -> None:
        coerce_choices(self)  # ServerConfig(kernels="off") holds Kernels.OFF

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
    def packaging_threads(self) -> int:
        """--video-threads, else half the host's cores per served device, 1 to 8 (`vaed.video.default_threads`)."""
        if self.video_threads is not None:
            return self.video_threads
        from .video import default_threads

        return default_threads(os.cpu_count(), len(self.devices))

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

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)
