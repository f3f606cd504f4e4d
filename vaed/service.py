"""The gRPC servicer: protobuf <-> the call core (`vaed.calls`), statuses out, nothing else.

Every call's logic -- admission, the session timeouts, opening and feeding the
session, streaming its frames, the log line and the metrics -- lives in
`vaed.calls`, written once for every front; this module only translates, as
KServe's gRPC servicer does over its data plane:

* in: the raw request bytes become `InputMessage`s (`parse`,
  `ProtoLatents`, `requested_output`), read only when the core asks;
* out: `FramesOut` / `VideoOut` / `CallEnd` become FrameChunks (`VideoOut`'s
  bytes in FrameChunk.video), `ModelFacts` a ModelInfo, and the core's identity of the
  served decoder (or encoder) each call's initial metadata (`vaed_client.wire`'s headers);
* a `CallFailed` becomes its gRPC status (`grpc.StatusCode[status.name]`:
  the one table is `vaed.errors`), and the context's deadline tells a
  cancelled call from an expired one;
* each response message is written with `context.write` within
  --send-timeout (`vaed.grpc_send` says why not by yielding): a client that
  takes none of its answer for that long has its call ended
  DEADLINE_EXCEEDED, which frees its session slot.

Handlers are registered with raw bytes in and out of the deserializer, and all
three methods read their requests as a stream (the wire is the same for a
unary request), so nothing is received, parsed or copied before the call is
authorised (the interceptors run first) and admitted (the core), and a
malformed message is INVALID_ARGUMENT, not the UNKNOWN/INTERNAL a failing
deserializer gives.

The end of a call has one shape on the wire: after its frame messages (all
with final=false) comes one FrameChunk with final=true, no frames,
chunk_index = the number of groups and first_frame = the number of frames.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from vaed_client import wire

from .calls import (
    Call,
    CallCore,
    CallEnd,
    CallFailed,
    CallInput,
    FramesOut,
    InputMessage,
    LatentFrameOut,
    ModelFacts,
    Out,
    RequestedEncode,
    RequestedOutput,
    VideoMessage,
    VideoOut,
)
from .choices import Precision
from .engine import DTYPES
from .errors import InvalidInput
from .grpc_send import SendStalled, TimedWriter
from .interceptors import REFUSAL_LINGER_SECONDS
from .video import DEFAULT_CRF, DEFAULT_PRESET, VideoError, VideoOptions

log = logging.getLogger(__name__)

pb = wire.pb
_WIRE_DTYPE = {torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16, torch.float32: pb.FLOAT32}
_PRECISION_NAMES = {pb.LOSSLESS: Precision.LOSSLESS, pb.FAST: Precision.FAST}
_PRECISION_VALUES = {name: value for value, name in _PRECISION_NAMES.items()}


# -- protobuf -> the core's types (pure functions) ------------------------------------------


def parse(kind: type[Message], raw: bytes) -> Any:
    try:
        return kind.FromString(raw)
    except (DecodeError, ValueError) as exc:
        raise InvalidInput(f"malformed {kind.__name__} message ({len(raw)} bytes): {exc}") from None


_VIDEO_FORMATS = (pb.MP4, pb.MP4_LOSSLESS)


def video_options(options: Any, default_fps: Callable[[], int]) -> VideoOptions | None:
    """DecodeOptions' video fields -> VideoOptions (None for frame output); a field that does
    not apply, or a value out of range, is InvalidInput."""
    fmt = options.format
    given = [name for name, set_ in (("fps", options.fps != 0), ("crf", options.HasField("crf")),
                                     ("preset", options.preset != "")) if set_]
    if fmt not in _VIDEO_FORMATS:
        if given:
            raise InvalidInput(f"{', '.join(given)}: options of the MP4 and MP4_LOSSLESS formats, "
                               f"not of {pb.OutputFormat.Name(fmt)}")
        return None
    if fmt == pb.MP4_LOSSLESS and options.HasField("crf"):
        raise InvalidInput("crf is an option of MP4; MP4_LOSSLESS is always CRF 0")
    try:
        return VideoOptions(
            fps=options.fps or default_fps(), crf=options.crf if options.HasField("crf") else DEFAULT_CRF,
            preset=options.preset or DEFAULT_PRESET, lossless=fmt == pb.MP4_LOSSLESS)
    except VideoError as exc:
        raise InvalidInput(str(exc)) from None


def requested_output(options: Any, default_fps: Callable[[], int]) -> RequestedOutput:
    """DecodeOptions -> RequestedOutput; values the wire cannot name are InvalidInput.
    `default_fps`: the model's frame rate, for video that asks for none."""
    fmt = options.format
    if fmt not in (pb.OUTPUT_FORMAT_UNSPECIFIED, pb.RGB8, pb.RAW, *_VIDEO_FORMATS):
        raise InvalidInput(f"unknown output format {fmt}; use RGB8, RAW, MP4 or MP4_LOSSLESS")
    video = video_options(options, default_fps)
    raw_dtype = None
    if options.raw_dtype != pb.DATA_TYPE_UNSPECIFIED:
        if fmt != pb.RAW:  # as video options on frames: a mistake, not something to ignore
            raise InvalidInput(f"raw_dtype is an option of the RAW format, not of "
                               f"{pb.OutputFormat.Name(fmt) if fmt else 'RGB8 (the default)'}")
        name = wire.DTYPE_NAMES.get(options.raw_dtype)
        if name not in DTYPES:
            raise InvalidInput(
                f"raw_dtype {wire.dtype_name(options.raw_dtype)} is not a RAW output type; "
                "use FLOAT16, BFLOAT16 or FLOAT32"
            )
        raw_dtype = DTYPES[name]
    if options.precision == pb.PRECISION_UNSPECIFIED:
        precision = None
    elif options.precision in _PRECISION_NAMES:
        precision = _PRECISION_NAMES[options.precision]
    else:
        raise InvalidInput(f"unknown precision {options.precision}; use LOSSLESS or FAST")
    return RequestedOutput(
        rgb8=fmt != pb.RAW, raw_dtype=raw_dtype, precision=precision, raw_latents=options.raw_latents,
        allow_non_finite=options.allow_non_finite, skip_frames=options.skip_frames, video=video,
    )


def requested_encode(options: Any) -> RequestedEncode:
    """EncodeOptions -> RequestedEncode; values the wire cannot name are InvalidInput."""
    def dtype_of(value: int, what: str) -> torch.dtype | None:
        if value == pb.DATA_TYPE_UNSPECIFIED:
            return None
        name = wire.DTYPE_NAMES.get(value)
        if name not in DTYPES:
            raise InvalidInput(
                f"{what} {wire.dtype_name(value)} is not a latent type; use FLOAT16, BFLOAT16 or FLOAT32"
            )
        return DTYPES[name]

    if options.precision == pb.PRECISION_UNSPECIFIED:
        precision = None
    elif options.precision in _PRECISION_NAMES:
        precision = _PRECISION_NAMES[options.precision]
    else:
        raise InvalidInput(f"unknown precision {options.precision}; use LOSSLESS")
    return RequestedEncode(
        latents=options.latents, out_dtype=dtype_of(options.out_dtype, "out_dtype"), precision=precision,
        allow_non_finite=options.allow_non_finite, trailing_zero_frames=options.trailing_zero_frames,
        encode_dtype=dtype_of(options.encode_dtype, "encode_dtype"),
    )


class ProtoLatents:
    """A wire Tensor as the core reads latents (or an Encode's frames): its header without a
    copy of its own, then the copy. The payload is read from the message once, for both
    (`wire.payload`: each read of a protobuf bytes field is a copy)."""

    def __init__(self, message: Any, what: str = "latents") -> None:
        self._message = message
        self._what = what
        self._data: bytes | None = None

    def _payload(self) -> bytes:
        if self._data is None:
            self._data = wire.payload(self._message)
        return self._data

    def header(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of a wire tensor, checked against its byte count."""
        if self._message.dtype == pb.DATA_TYPE_UNSPECIFIED and not len(self._message.shape):  # no tensor at all
            raise InvalidInput(f"the message carries no {self._what}: set its Tensor (dtype, shape and data)")
        try:
            shape = wire.validate(self._message, self._payload())
            return shape, wire.torch_dtype(self._message.dtype)
        except wire.TensorFormatError as exc:
            raise InvalidInput(f"{self._what}: {exc}") from None

    def to_tensor(self) -> torch.Tensor:
        tensor = wire.to_torch(self._message, self._payload())
        self._data = None  # the tensor holds its own copy
        return tensor


def _input_message(request: Any, default_fps: Callable[[], int]) -> InputMessage:
    """A DecodeRequest or LatentChunk; its options are translated when the core reads them."""
    options = request.options
    return InputMessage(
        request_id=options.request_id,
        latents=ProtoLatents(request.latents),
        options=(lambda: requested_output(options, default_fps)) if request.HasField("options") else None,
    )


def decode_request(raw: bytes, default_fps: Callable[[], int]) -> InputMessage:
    return _input_message(parse(pb.DecodeRequest, raw), default_fps)


def latent_chunk(raw: bytes, default_fps: Callable[[], int]) -> InputMessage:
    return _input_message(parse(pb.LatentChunk, raw), default_fps)


def video_chunk(raw: bytes) -> VideoMessage:
    chunk = parse(pb.VideoChunk, raw)
    options = chunk.options
    return VideoMessage(
        request_id=options.request_id,
        frames=ProtoLatents(chunk.frames, "frames"),
        options=(lambda: requested_encode(options)) if chunk.HasField("options") else None,
    )


# -- the core's types -> protobuf ---------------------------------------------------------


def frame_chunk(item: Out) -> Any:
    if isinstance(item, CallEnd):
        return pb.FrameChunk(request_id=item.request_id, chunk_index=item.groups, first_frame=item.frames, final=True)
    if isinstance(item, VideoOut):
        return pb.FrameChunk(request_id=item.request_id, chunk_index=item.chunk_index, first_frame=item.first_frame,
                             video=item.data)
    assert isinstance(item, FramesOut)
    chunk = pb.FrameChunk(request_id=item.request_id, chunk_index=item.chunk_index, first_frame=item.first_frame)
    wire.to_message(item.frames, out=chunk.frames)  # in place: one copy of the frames fewer
    return chunk


def latent_frame_chunk(item: Any) -> Any:
    if isinstance(item, CallEnd):
        return pb.LatentFrameChunk(request_id=item.request_id, latent_frame=item.groups, final=True)
    assert isinstance(item, LatentFrameOut)
    chunk = pb.LatentFrameChunk(request_id=item.request_id, latent_frame=item.latent_frame)
    wire.to_message(item.moments, out=chunk.moments)
    if item.latents is not None:
        wire.to_message(item.latents, out=chunk.latents)
    return chunk


def model_info(facts: ModelFacts) -> Any:
    return pb.ModelInfo(
        model=facts.model,
        z_dim=facts.z_dim,
        scale_factor_temporal=facts.scale_factor_temporal,
        scale_factor_spatial=facts.scale_factor_spatial,
        latents_mean=facts.latents_mean,
        latents_std=facts.latents_std,
        compute_dtype=_WIRE_DTYPE[facts.compute_dtype],
        device=facts.device,
        random_weights=facts.random_weights,
        max_message_bytes=facts.max_message_bytes,
        max_latent_frames=facts.max_latent_frames,
        max_pixels=facts.max_pixels,
        max_batch=facts.max_batch,
        kernels=facts.kernels,
        layout=facts.layout,
        fast_paths_note=facts.fast_paths_note,
        precisions=[_PRECISION_VALUES[p] for p in facts.precisions],
        devices=facts.devices,
        parallel=facts.parallel,
        encodes=facts.encodes,
        encode_precisions=[_PRECISION_VALUES[p] for p in facts.encode_precisions],
        encode_dtypes=[_WIRE_DTYPE[d] for d in facts.encode_dtypes],
        video_formats=list(_VIDEO_FORMATS) if facts.video_fps else [],
        video_fps=facts.video_fps,
        decoder_identity=facts.decoder_identity,
        encoder_identity=facts.encoder_identity,
    )


# -- the context ----------------------------------------------------------------------------


# A client's deadline starts on its clock when it sends the call, the server's when the headers
# arrive, so the cancellation the client's deadline sends can reach the server just before its
# own deadline: 0.1 ms before it in one CI run, logged CANCELLED. A cancellation this close to
# the deadline is the deadline's.
DEADLINE_SKEW_S = 0.1


def _deadline_passed(context: grpc.aio.ServicerContext) -> Callable[[], bool]:
    def passed() -> bool:
        remaining = context.time_remaining()
        return remaining is not None and remaining <= DEADLINE_SKEW_S
    return passed


def _timed_out(context: grpc.aio.ServicerContext, writer: TimedWriter) -> Callable[[], bool]:
    """The call's deadline passed, or its client took nothing for --send-timeout (DEADLINE_EXCEEDED
    either way: the server's time limits end calls so, as HTTP's send timeout does)."""
    deadline_passed = _deadline_passed(context)
    return lambda: writer.stalled or deadline_passed()


class _RequestStream:
    """A streaming call's request messages, read from grpc.aio's receiver, for CallInput.

    Its async generator is made at the first read (a call refused before that, an Encode to a
    decode-only server say, would leave one never awaited, and Python warns at garbage collection)
    and closed by `close` when the call ends: left suspended it holds the last message it yielded,
    and in a reference cycle with the receiver that the garbage collector does not free (grpcio
    1.85: every Decode refused after its one message kept its payload, 64 MB a call)."""

    def __init__(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        self._requests = requests
        self._context = context
        self._messages: AsyncIterator[bytes] | None = None
        self._reads = 0

    async def receive(self) -> bytes | None:
        self._reads += 1
        if self._messages is None:
            self._messages = aiter(self._requests)
        message = await anext(self._messages, None)
        if message is None and self._reads == 1 and await _cancelled_soon(self._context):
            # no first message because the client's connection went, not because it half-closed:
            # the call is cancelled (it was an INVALID_ARGUMENT "needs one message"). Only the
            # first read waits: a later end of input is every call's own, on its latency path.
            raise asyncio.CancelledError
        return message

    async def close(self) -> None:
        messages, self._messages = self._messages, None
        aclose = getattr(messages, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except RuntimeError:  # a read still under way ("already running"): it ends with the call
            log.debug("a request stream was still being read when its call ended")


# A lost connection ends a call's input before grpc marks the call cancelled: half of 30 Decodes
# whose client closed its socket mid-message read their end first. An input that ends before its
# first message is a failed call either way, so it waits this long to tell a client gone from one
# that half-closed.
CANCEL_NOTICE_S = 0.5  # the notice came within 0.1 s for every such call here; the rest is margin


async def _cancelled_soon(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call is cancelled now or within CANCEL_NOTICE_S."""
    for _ in range(25):
        if context.cancelled():
            return True
        await asyncio.sleep(CANCEL_NOTICE_S / 25)
    return context.cancelled()


def _unary_input(request: bytes, parse_one: Callable[[bytes], Any]) -> CallInput[bytes]:
    async def receive() -> bytes:
        return request

    return CallInput(receive, parse_one)


def _set_status(context: grpc.aio.ServicerContext, failed: CallFailed) -> None:
    """The call's status, sent when its handler returns. Not `context.abort`: it raises an
    AbortError that grpc keeps on the call's state, and whose traceback reaches the handler's
    frames, which reach that state again: a reference cycle, so the call's request message (its
    latents, up to the message limit) stayed in memory until a full garbage collection, which a
    frozen start-up heap makes rare: 1,500 refused 1.3 MB Decodes grew the server by ~1.5 MB a
    call, to 2.9 GB, and no collection came."""
    context.set_code(grpc.StatusCode[failed.status.name])
    context.set_details(failed.message)


def _identify(writer: TimedWriter, header: str, identity: str) -> None:
    """The call's initial metadata: the identity of what serves it (none while nothing serves:
    the call is refused UNAVAILABLE). Sent as the handler starts, beside the read of the client's
    first message and the decode (`TimedWriter.send_headers`), so the first frame does not wait for
    it, and a client resuming on a replica of another decoder refuses it before that replica has
    re-decoded the frames it would skip."""
    if identity:
        writer.send_headers(((header, identity),))


class VaeDecoderService:
    """GetModelInfo, Decode, DecodeStream and Encode: translations over a CallCore."""

    def __init__(self, core: CallCore) -> None:
        self.core = core

    def rpc_handlers(self) -> grpc.GenericRpcHandler:
        serialize = pb.FrameChunk.SerializeToString
        return grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, response_serializer=pb.ModelInfo.SerializeToString),
            "Decode": grpc.stream_stream_rpc_method_handler(self.Decode, response_serializer=serialize),
            "DecodeStream": grpc.stream_stream_rpc_method_handler(self.DecodeStream, response_serializer=serialize),
            "Encode": grpc.stream_stream_rpc_method_handler(
                self.Encode, response_serializer=pb.LatentFrameChunk.SerializeToString),
        })

    async def GetModelInfo(self, request: bytes, context: grpc.aio.ServicerContext) -> Any:
        call = self.core.model_info(
            _unary_input(request, lambda raw: parse(pb.ModelInfoRequest, raw)), model_info, _deadline_passed(context))
        replies = []
        try:
            replies = [reply async for reply in call]  # one reply
        except CallFailed as failed:
            _set_status(context, failed)
            return None  # the status alone
        finally:
            await call.aclose()
        return replies[0]

    def _writer(self, context: grpc.aio.ServicerContext) -> TimedWriter:
        return TimedWriter(context, self.core.config.send_timeout)

    async def Decode(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        parse_one = functools.partial(decode_request, default_fps=self.core.default_fps)
        writer = self._writer(context)
        _identify(writer, wire.DECODER_IDENTITY_HEADER, self.core.identities()[0])
        stream = _RequestStream(requests, context)
        call = self.core.decode(CallInput(stream.receive, parse_one), frame_chunk, _timed_out(context, writer))
        await self._answer(context, call, writer, stream)

    async def DecodeStream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        # A failing client-streaming call lingers briefly, reading nothing, before its status: a
        # grpc.aio client still writing otherwise sees INTERNAL instead of it (see vaed.interceptors).
        parse_one = functools.partial(latent_chunk, default_fps=self.core.default_fps)
        writer = self._writer(context)
        _identify(writer, wire.DECODER_IDENTITY_HEADER, self.core.identities()[0])
        stream = _RequestStream(requests, context)
        call = self.core.decode_stream(
            CallInput(stream.receive, parse_one), frame_chunk, _timed_out(context, writer),
            linger=REFUSAL_LINGER_SECONDS)
        await self._answer(context, call, writer, stream)

    async def Encode(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        writer = self._writer(context)
        _identify(writer, wire.ENCODER_IDENTITY_HEADER, self.core.identities()[1])
        stream = _RequestStream(requests, context)
        call = self.core.encode(
            CallInput(stream.receive, video_chunk), latent_frame_chunk, _timed_out(context, writer),
            linger=REFUSAL_LINGER_SECONDS)
        await self._answer(context, call, writer, stream)

    @staticmethod
    async def _answer(
        context: grpc.aio.ServicerContext, call: Call[Any], writer: TimedWriter, stream: _RequestStream
    ) -> None:
        """Write a call's messages; its failure becomes the call's status, and a client that takes
        none of them for --send-timeout has the call ended DEADLINE_EXCEEDED. `stream`, the call's
        request messages, is closed when it ends."""
        try:
            async for message in call:
                await writer.write(message)
        except CallFailed as failed:
            await writer.headers_sent()  # the status goes after the call's headers
            _set_status(context, failed)
        except SendStalled as stalled:
            record = call.record
            log.warning("%s id=%s: the client took none of its answer for %g s (--send-timeout); "
                        "the call ends DEADLINE_EXCEEDED and frees its session slot",
                        record.method, record.request_id, stalled.seconds)
            await call.aclose()  # logged and its slot freed now, not once the status got out
            await writer.end(grpc.StatusCode.DEADLINE_EXCEEDED, str(stalled))
        finally:
            writer.abandon()  # a call cancelled before its first message: its header send ends on its own
            await call.aclose()  # runs the call's own cleanup now, not at garbage collection
            await stream.close()
