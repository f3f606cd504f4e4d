"""The request/session core shared by `VaeClient` (sync) and `AsyncVaeClient`.

Everything that does not wait lives here, once: option parsing, latents
preparation, request building, reply assembly, output conversion and a
session's bookkeeping. The two front-ends only differ in how they wait
(blocking iteration and threads vs. `await`), as in tritonclient's
`http` / `http.aio` pair over shared request builders.

Input rule (the same in the library and `vaed-client decode`): latents are
`[B, z_dim, T, h, w]`, or `[z_dim, T, h, w]`, taken as B=1 (results keep the
batch axis), in float32, float16 or bfloat16 (torch; numpy has none); float64
is cast to float32. Anything else (another rank, int or uint8 latents) raises
`LocalInputError` before a byte is sent, with the accepted dtypes named.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import outputs, wire
from .errors import CancelledError, InternalError, LocalInputError, VaedError
from .mp4 import MP4, check_no_video_options, video_fields
from .tensors import TensorFormatError, is_torch, native_array
from .video import RAW, RGB8, DecodedChunk, VideoAssembler, has_frames, to_chunk

pb = wire.pb
_WIRE_FORMATS = {RGB8: pb.RGB8, RAW: pb.RAW}
LATENTS_SHAPE_HELP = "latents must be [B, z_dim, T, h, w] or [z_dim, T, h, w]"
# The server decodes these latent dtypes (vaed.session.LATENT_DTYPES); float64 is cast here.
LATENT_DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")
LATENTS_DTYPE_HELP = "use float32, float16 or bfloat16 (a torch tensor; numpy has none); float64 is cast to float32"


def _enum_name(enum: Any, value: int) -> str:
    """An enum value's lower-case name; a value this client's proto does not know (a newer
    server's) as `unknown(N)`, so model_info() and every call that asks for it still work."""
    return enum.Name(value).lower() if value in enum.values() else f"unknown({value})"


# Wan's VAEs scale time by 4 and space by 8 or 16. A factor past this is no VAE's: the client
# would size a 9-frame video's buffer for millions of frames by it (a hostile or broken server).
MAX_SCALE_FACTOR = 64


def _scale_factor(name: str, value: int) -> int:
    if value > MAX_SCALE_FACTOR:
        raise InternalError(f"the server's ModelInfo gives {name} {value}, which no VAE has "
                            f"(at most {MAX_SCALE_FACTOR})")
    return value


@dataclass(frozen=True)
class ModelInfo:
    """What the server decodes with (mirrors the ModelInfo message)."""

    model: str
    z_dim: int
    scale_factor_temporal: int
    scale_factor_spatial: int
    latents_mean: list[float] = field(default_factory=list)
    latents_std: list[float] = field(default_factory=list)
    compute_dtype: str = ""
    device: str = ""
    random_weights: bool = False
    max_message_bytes: int = 0
    max_latent_frames: int = 0
    max_pixels: int = 0
    max_batch: int = 0                                          # largest B of one call (0: not said)
    kernels: str = ""
    layout: str = ""
    fast_paths_note: str = ""                                   # why the stock decoder serves, if it does
    precisions: list[str] = field(default_factory=list)        # tiers offered, the default first
    devices: list[str] = field(default_factory=list)           # devices serving requests
    parallel: str = ""                                         # "off" or the spatial group
    encodes: bool = False                                      # the server serves Encode
    encode_precisions: list[str] = field(default_factory=list)  # its Encode tiers, the default first
    encode_dtypes: list[str] = field(default_factory=list)      # its Encode compute dtypes
    video_formats: list[str] = field(default_factory=list)      # server-side video: "mp4", "mp4_lossless"
    video_fps: int = 0                                          # its default frame rate (the model's)
    decoder_identity: str = ""  # what decides its frames' bits ("" from an older server); see vaed_client.resume
    encoder_identity: str = ""  # the same for Encode

    @classmethod
    def from_proto(cls, message: Any) -> ModelInfo:
        return cls(
            model=message.model,
            z_dim=message.z_dim,
            scale_factor_temporal=_scale_factor("scale_factor_temporal", message.scale_factor_temporal),
            scale_factor_spatial=_scale_factor("scale_factor_spatial", message.scale_factor_spatial),
            latents_mean=list(message.latents_mean),
            latents_std=list(message.latents_std),
            compute_dtype=wire.DTYPE_NAMES.get(message.compute_dtype, "") if message.compute_dtype else "",
            device=message.device,
            random_weights=message.random_weights,
            max_message_bytes=message.max_message_bytes,
            max_latent_frames=message.max_latent_frames,
            max_pixels=message.max_pixels,
            max_batch=message.max_batch,
            kernels=message.kernels,
            layout=message.layout,
            fast_paths_note=message.fast_paths_note,
            precisions=[_enum_name(wire.pb.Precision, p) for p in message.precisions],
            devices=list(message.devices),
            parallel=message.parallel,
            encodes=message.encodes,
            encode_precisions=[_enum_name(wire.pb.Precision, p) for p in message.encode_precisions],
            encode_dtypes=[wire.DTYPE_NAMES.get(d, "") for d in message.encode_dtypes],
            video_formats=[_enum_name(wire.pb.OutputFormat, f) for f in message.video_formats],
            video_fps=message.video_fps,
            decoder_identity=message.decoder_identity,
            encoder_identity=message.encoder_identity,
        )

    def output_frames(self, latent_frames: int) -> int:
        """Frames decoded from `latent_frames` latent frames (1 + 4*(T-1) for Wan)."""
        return wire.output_frames(latent_frames, self.scale_factor_temporal or wire.DEFAULT_TEMPORAL_FACTOR)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- options -------------------------------------------------------------------
def format_name(fmt: Any) -> str:
    """'rgb8' / 'raw' (any case) or an OutputFormat value -> 'rgb8' / 'raw'."""
    if isinstance(fmt, int) and not isinstance(fmt, bool):
        return RAW if fmt == pb.RAW else RGB8
    name = str(fmt).lower()
    if name not in _WIRE_FORMATS:
        raise LocalInputError(f"unknown format {fmt!r}; use 'rgb8' or 'raw'")
    return name


def raw_dtype_value(dtype: Any) -> pb.DataType:
    """'bfloat16' / torch.bfloat16 / np.float32 / a DataType value -> DataType value."""
    try:
        return wire.wire_dtype(dtype)
    except TensorFormatError as e:
        raise LocalInputError(f"raw_dtype: {e}") from None


@dataclass(frozen=True)
class CallSpec:
    """One call's parsed options: what goes on the wire and what to return."""

    wire_format: str  # RGB8 or RAW (RGB8 for mp4: the frames the server encodes)
    output_type: str  # one of outputs.OUTPUT_TYPES
    options: Any  # pb.DecodeOptions

    @property
    def video(self) -> bool:
        """Server-side MP4: the replies carry file bytes, not frames (`vaed_client.mp4`)."""
        return self.output_type == MP4

    def result(self, frames: Any) -> Any:
        return outputs.convert(frames, self.wire_format, self.output_type)


def call_spec(
    *,
    output_type: str | None = None,
    format: Any = None,
    raw_latents: bool = False,
    raw_dtype: Any = None,
    request_id: str | None = None,
    fps: int | None = None,
    crf: int | None = None,
    preset: str | None = None,
    lossless: bool = False,
) -> CallSpec:
    """Parse decode options. `output_type` picks the result; `format` (the
    wire format, kept for compatibility) picks the light RGB8 transport for
    np/pt/pil, whose default is exact RAW in the server's compute dtype.
    "mp4" asks for the server's MP4 file; `fps`, `crf`, `preset` and
    `lossless` are its options (`vaed_client.mp4`)."""
    fmt = format_name(format) if format is not None else None
    if output_type is None:
        output_type = outputs.RAW_OUT if fmt == RAW else outputs.UINT8
    output_type = str(output_type).lower()
    if output_type == MP4:
        if format is not None or raw_dtype is not None:
            raise LocalInputError("format and raw_dtype are options of frame output, not of output_type='mp4'")
        spec = call_spec(raw_latents=raw_latents, request_id=request_id)
        video_fields(spec.options, lossless=lossless, fps=fps, crf=crf, preset=preset)
        return CallSpec(wire_format=RGB8, output_type=MP4, options=spec.options)
    check_no_video_options(output_type, fps=fps, crf=crf, preset=preset, lossless=lossless)
    if output_type not in outputs.OUTPUT_TYPES:
        raise LocalInputError(f"unknown output_type {output_type!r}; use one of {', '.join(outputs.OUTPUT_TYPES)}")
    missing = outputs.missing_dependency(output_type)
    if missing:  # before the call, not as a bare ModuleNotFoundError after the decode
        raise LocalInputError(missing)
    natural = RAW if output_type in (outputs.RAW_OUT, *outputs.PIPELINE_TYPES) else RGB8
    if fmt is not None and output_type in (outputs.UINT8, outputs.RAW_OUT) and fmt != natural:
        raise LocalInputError(f"output_type {output_type!r} cannot travel as format {fmt!r}")
    wire_format = fmt or natural
    if raw_dtype is not None and wire_format != RAW:
        raise LocalInputError("raw_dtype applies to RAW output only (output_type 'raw', 'np', 'pt' or 'pil')")
    if request_id and (problem := wire.request_id_problem(request_id)) is not None:
        raise LocalInputError(problem)
    options = pb.DecodeOptions(
        format=_WIRE_FORMATS[wire_format],
        # The server rejects a raw_dtype it can't produce (e.g. uint8): its message, not a second opinion.
        raw_dtype=raw_dtype_value(raw_dtype) if raw_dtype is not None else pb.DATA_TYPE_UNSPECIFIED,
        raw_latents=bool(raw_latents),
        request_id=request_id or "",
    )
    return CallSpec(wire_format=wire_format, output_type=output_type, options=options)


def frame_call_spec(
    *,
    output_type: str | None = None,
    format: Any = None,
    raw_latents: bool = False,
    raw_dtype: Any = None,
    request_id: str | None = None,
) -> CallSpec:
    """`call_spec` for the calls that yield frames as they decode (`stream()`, `session()`): an
    MP4 file is one answer at the call's end, so output_type 'mp4' is refused before the call."""
    spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents, raw_dtype=raw_dtype,
                     request_id=request_id)
    if spec.video:
        raise LocalInputError("stream() and session() yield frames as they decode; "
                              "for an MP4 file call decode(latents, output_type='mp4')")
    return spec


# -- latents -------------------------------------------------------------------
def normalize_latents(latents: Any) -> Any:
    """The input rule of the module doc: float64 -> float32, 4-D -> B=1;
    LocalInputError for other ranks and non-array input."""
    if is_torch(latents):
        import torch

        problem = wire.torch_data_problem(latents)
        if problem:
            raise LocalInputError(problem)
        if latents.dtype == torch.float64:
            latents = latents.float()
    else:
        if not isinstance(latents, np.ndarray) and not hasattr(latents, "__array__"):
            raise LocalInputError(f"latents must be a numpy array or torch tensor, not {type(latents).__name__}")
        latents = native_array(latents)
        if latents.dtype == np.float64:
            latents = latents.astype(np.float32)
    name = str(latents.dtype).removeprefix("torch.")
    if name == "bfloat16" and not is_torch(latents):  # ml_dtypes-style numpy bf16
        raise LocalInputError("numpy bfloat16 latents are not supported; pass a torch tensor or float32")
    if name not in LATENT_DTYPE_NAMES:
        raise LocalInputError(f"latents dtype {name} is not accepted; {LATENTS_DTYPE_HELP}")
    if latents.ndim == 4:
        latents = latents[None]
    if latents.ndim != 5:
        raise LocalInputError(f"{LATENTS_SHAPE_HELP}, got shape {list(latents.shape)}")
    return latents


def latents_message(latents: Any, compute_dtype: str = "", out: Any = None) -> Any:
    """Normalized latents -> wire Tensor; float32 latents for a server that computes in bfloat16
    travel as bfloat16.

    The server casts latents to its compute dtype before any arithmetic (vaed's LatentInput),
    so the cast made here gives the same bits at half the bytes: a 480x832 stream's first
    message drops from 0.8 to 0.4 MB, 1.8 to 0.9 MB at 720x1280, on the first frame's path.
    (Finite values past bf16's largest, 3.39e38, become Inf here as in the server's cast, and
    the server then refuses them as non-finite.) Callers are whole-video calls, whose
    `compute_dtype` is the one their client's ModelInfo names: the replicas of one target list
    are meant to serve one model in one dtype (a resumed attempt on a server of another dtype
    is refused, `vaed_client.resume`).
    `out`: a message's Tensor field, filled in place (`wire.to_message`)."""
    try:
        if compute_dtype == "bfloat16" and str(latents.dtype).removeprefix("torch.") == "float32":
            return wire.to_bf16_message(latents, out)
        return wire.to_message(latents, out)
    except TensorFormatError as e:
        raise LocalInputError(str(e)) from None


# Latent frames in a stream's first message: frame 0 (the first frame) and frame 1, so the
# server has a steady chunk of work (~60 ms at 480x832 on an H200) while the rest travels.
HEAD_LATENT_FRAMES = 2


@dataclass(frozen=True)
class StreamedLatents:
    """One video's latents as DecodeStream messages: the first `HEAD_LATENT_FRAMES` latent
    frames, then the rest once the first frame has come back.

    The server starts decoding a session at its first message, so the first
    frame waits for 0.4 MB (bf16 at 480x832) instead of the whole request
    (4.2 MB at 480x832x81). The rest is held back until the first frame
    arrives: uploaded at once, it shares the connection with the first reply
    and delays it (measured over loopback with a model-less server, 1.2 MB reply:
    median 12.4-14.6 ms with the 4 MB sent at once against 3.0-4.3 ms held
    back on a 2-core machine; 6.1 against 4.2 ms on an H200 host). One
    message before the first reply also means nothing is written into a call
    the server ended on its first message (grpc.aio would then report
    INTERNAL instead of its status). The frames are the same as one Decode
    call's (the server decodes latent frames one at a time either way).
    """

    first: Any  # pb.LatentChunk: the head frames and the options
    rest: Any  # normalized latents after the head, sent at the first frame, or None
    as_torch: bool
    latent_frames: int
    compute_dtype: str = ""  # the server's (see `latents_message`)

    def rest_message(self) -> Any:
        chunk = pb.LatentChunk()
        latents_message(self.rest, self.compute_dtype, out=chunk.latents)
        return chunk

    def all_messages(self, options: Any) -> list[Any]:
        """A resumed attempt's messages, sent at once with `options` (the frames it skips
        come from latents it must step through before any reply, so no gate)."""
        first = pb.LatentChunk()
        first.CopyFrom(self.first)
        first.options.CopyFrom(options)
        return [first] + ([self.rest_message()] if self.rest is not None else [])


def stream_latents(spec: CallSpec, latents: Any, compute_dtype: str = "") -> StreamedLatents:
    """Check latents here (LocalInputError before any call) and split them for DecodeStream,
    in the dtype they travel in for a server computing in `compute_dtype` (`latents_message`)."""
    latents = normalize_latents(latents)
    first = pb.LatentChunk(options=spec.options)
    latents_message(latents[:, :, :HEAD_LATENT_FRAMES], compute_dtype, out=first.latents)  # in place
    t = int(latents.shape[2])
    rest = latents[:, :, HEAD_LATENT_FRAMES:] if t > HEAD_LATENT_FRAMES else None
    return StreamedLatents(first, rest, is_torch(latents), t, compute_dtype)


def receive_as_torch(spec: CallSpec, as_torch: bool) -> bool:
    """Whether to read frames into torch: torch latents (torch out), 'pt', and
    exact np/pil from RAW, which need torch's arithmetic in a half dtype."""
    if as_torch or spec.output_type == outputs.PT:
        return True
    return spec.output_type in outputs.PIPELINE_TYPES and spec.wire_format == RAW and _torch_available()


def chunk_result(reply: Any, spec: CallSpec, as_torch: bool) -> DecodedChunk:
    """A FrameChunk with frames -> DecodedChunk whose frames are in `spec`'s output type."""
    chunk = to_chunk(reply, spec.wire_format, receive_as_torch(spec, as_torch))
    if spec.output_type not in outputs.PIPELINE_TYPES:
        return chunk
    from dataclasses import replace

    return replace(chunk, frames=spec.result(chunk.frames), format=spec.output_type)


class Assembly:
    """One whole-video reply: place messages, then convert once at the end."""

    def __init__(self, spec: CallSpec, as_torch: bool, expected_frames: int | None) -> None:
        self.spec = spec
        self.as_torch = receive_as_torch(spec, as_torch)
        self.assembler = VideoAssembler(spec.wire_format, expected_frames)

    def add(self, reply: Any) -> None:
        self.assembler.add(reply)

    def result(self) -> Any:
        return self.spec.result(self.assembler.result(self.as_torch))

    def restart(self) -> None:
        """A resumed attempt of a frame call sends only frames not placed yet: nothing to forget."""

    def discard(self) -> None:
        """The call failed: nothing to clean up (the frames are in memory)."""


def _torch_available() -> bool:
    # find_spec, not import: numpy-only callers of uint8/raw never pay torch's import.
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# -- sessions ------------------------------------------------------------------
END = object()  # end-of-replies marker in a session's reply queue


class SessionView:
    """What both session front-ends expose from their `SessionState`."""

    _state: SessionState

    @property
    def request_id(self) -> str:
        """The call's request id (the server's once its first reply arrived)."""
        return self._state.request_id

    @property
    def format(self) -> str:
        """The wire format, 'rgb8' or 'raw'."""
        return self._state.format


class SessionState:
    """A DecodeStream session's bookkeeping, shared by both front-ends: the
    pushed messages (each attempt adds its options to its first one, see
    `resume.ReplayLog`), the result container, latent frames sent, request id,
    and what a reply-queue item means for the consumer."""

    def __init__(self, spec: CallSpec) -> None:
        self.spec = spec
        self.request_id = spec.options.request_id
        self.as_torch: bool | None = None
        self.latent_frames = 0
        self.closed = False
        self.cancelled = False
        self.iterated = False
        self.collected = False
        # the served model, learnt before the call opens (as decode() learns it): collect() checks
        # the frame count against it without a GetModelInfo of its own, which a draining server
        # would refuse while it still finishes this call
        self.info: ModelInfo | None = None
        self.error: VaedError | None = None  # seen by the consumer
        self.failure: VaedError | None = None  # set by the reply reader

    @property
    def format(self) -> str:
        return self.spec.wire_format

    def check_push(self) -> None:
        if self.closed:
            raise RuntimeError("push() after close() or cancel()")

    def replay_message(self, latents: Any) -> Any:
        """Latents -> LatentChunk without options, for a session's replay log (each attempt
        puts its own options, with its skip_frames, on its first message)."""
        latents = normalize_latents(latents)
        chunk = pb.LatentChunk()
        latents_message(latents, out=chunk.latents)  # in place: nesting a built Tensor copies it again
        if self.as_torch is None:
            self.as_torch = is_torch(latents)
        self.latent_frames += int(latents.shape[2])
        return chunk

    def reader_failed(self, error: VaedError) -> VaedError:
        self.failure = error
        return error

    def take(self, item: Any) -> tuple[Any, bool]:
        """A reply-queue item -> (reply or None at the end, whether to put END
        back so later readers see the end too). Raises the call's error unless
        the client cancelled."""
        if item is END:
            return None, True
        if isinstance(item, VaedError):
            self.error = item
            if self.cancelled:
                return None, True
            raise item
        if item.request_id:
            self.request_id = item.request_id
        return item, False

    def after_error(self) -> None:
        """Called before waiting: once the call failed, reads end or raise at once."""
        if self.error is not None and not self.cancelled:
            raise self.error

    def chunk(self, reply: Any) -> DecodedChunk | None:
        if not has_frames(reply):
            return None
        self.iterated = True
        return chunk_result(reply, self.spec, bool(self.as_torch))

    def start_collect(self) -> None:
        if self.iterated:
            raise RuntimeError(
                "collect() after iterating the session: assemble the chunks with vaed_client.video.assemble()"
            )
        if self.collected:
            raise RuntimeError("collect() called twice: the first call returned the whole video")
        self.collected = True

    def assembly(self) -> Assembly:
        """The whole video's container, once the session is closed; LocalInputError when nothing
        was pushed (the server then ends the call with no frames: there is no video)."""
        if not self.latent_frames and not self.cancelled:
            raise LocalInputError("collect() of a session that was pushed no latents: there is no video to return")
        info = self.info
        expected = info.output_frames(self.latent_frames) if info is not None and self.latent_frames else None
        return Assembly(self.spec, bool(self.as_torch), expected)

    def finish_collect(self, assembly: Assembly) -> Any:
        if self.cancelled:
            raise self.error or CancelledError("session cancelled by the client")
        return assembly.result()


__all__ = [
    "ModelInfo",
    "CallSpec",
    "call_spec",
    "format_name",
    "normalize_latents",
    "latents_message",
    "HEAD_LATENT_FRAMES",
    "StreamedLatents",
    "stream_latents",
    "chunk_result",
    "receive_as_torch",
    "Assembly",
    "SessionState",
    "SessionView",
    "END",
    "InternalError",
]
