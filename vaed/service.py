"""The gRPC servicer: proto <-> session, nothing else.

Handlers are registered with raw bytes in and out of the deserializer, and all
three methods read their requests as a stream (the wire is the same for a
unary request), so the order of work is:

    serving? -> admitted (session slot) -> receive (within the session
    timeouts) -> parse -> validate header -> copy latents -> session

Nothing is received, parsed or copied before the call is authorised (the
interceptors run first) and admitted; a malformed message is
INVALID_ARGUMENT, not the UNKNOWN/INTERNAL a failing deserializer gives.

Errors: code below raises domain errors (`vaed.errors`); `_translated` is the
one place that turns an exception into a status, logs the call once and
records its metrics, however it ends (done, failed, cancelled, deadline).

The end of a call has one shape on the wire: after its frame messages (all
with final=false) comes one FrameChunk with final=true, no frames,
chunk_index = the number of groups and first_frame = the number of frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterator

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from vaed_client import wire

from .choices import Parallel, Precision
from .config import ServerConfig
from .engine import DTYPES, OutputSpec
from .errors import ClientIdle, InvalidInput, NotReady, status_for
from .parallel.pool import SessionSlot, WorkerPool
from .interceptors import REFUSAL_LINGER_SECONDS
from .session import CallRecord, HostGroup, Limits, Session, first_message

log = logging.getLogger(__name__)

pb = wire.pb
_WIRE_DTYPE = {torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16, torch.float32: pb.FLOAT32}
_PRECISION_NAMES = {pb.LOSSLESS: Precision.LOSSLESS, pb.FAST: Precision.FAST}
_PRECISION_VALUES = {name: value for value, name in _PRECISION_NAMES.items()}


class Lifecycle:
    """What the servicer needs to know about the server's state."""

    def __init__(self) -> None:
        self.draining = False


# -- request parsing (pure functions) ------------------------------------------------


def parse(kind: type[Message], raw: bytes) -> Any:
    try:
        return kind.FromString(raw)
    except (DecodeError, ValueError) as exc:
        raise InvalidInput(f"malformed {kind.__name__} message ({len(raw)} bytes): {exc}") from None


def checked_request_id(request_id: str) -> str:
    """The caller's id if it is at most MAX_REQUEST_ID_CHARS printable ASCII characters; a new one if empty."""
    if not request_id:
        return uuid.uuid4().hex[:16]
    limit = wire.MAX_REQUEST_ID_CHARS
    if len(request_id) > limit or not all(" " <= c <= "~" for c in request_id):
        raise InvalidInput(
            f"request_id must be at most {limit} printable ASCII characters; got {len(request_id)} "
            f"characters starting {request_id[:16]!r}"
        )
    return request_id


def output_spec(options: Any, default_precision: str, offered: tuple[str, ...]) -> OutputSpec:
    fmt = options.format
    if fmt not in (pb.OUTPUT_FORMAT_UNSPECIFIED, pb.RGB8, pb.RAW):
        raise InvalidInput(f"unknown output format {fmt}; use RGB8 or RAW")
    raw_dtype = None
    if options.raw_dtype != pb.DATA_TYPE_UNSPECIFIED:
        name = wire.DTYPE_NAMES.get(options.raw_dtype)
        if name not in DTYPES:
            raise InvalidInput(
                f"raw_dtype {wire.dtype_name(options.raw_dtype)} is not a RAW output type; "
                "use FLOAT16, BFLOAT16 or FLOAT32"
            )
        raw_dtype = DTYPES[name]
    if options.precision == pb.PRECISION_UNSPECIFIED:
        precision = default_precision
    elif options.precision in _PRECISION_NAMES:
        precision = _PRECISION_NAMES[options.precision]
    else:
        raise InvalidInput(f"unknown precision {options.precision}; use LOSSLESS or FAST")
    if precision not in offered:
        raise InvalidInput(f"precision {precision} is not offered by this server; it offers {', '.join(offered)}")
    return OutputSpec(
        rgb8=fmt != pb.RAW, raw_dtype=raw_dtype, raw_latents=options.raw_latents,
        precision=precision, allow_non_finite=options.allow_non_finite,
    )


def latents_header(message: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a wire tensor, checked against its byte count, without copying it."""
    try:
        shape = wire.validate(message)
        return shape, wire.torch_dtype(message.dtype)
    except wire.TensorFormatError as exc:
        raise InvalidInput(f"latents: {exc}") from None


def frame_messages(group: HostGroup, request_id: str, time_dim: int, cap_bytes: int) -> Iterator[Any]:
    """One group -> FrameChunks of at most cap_bytes payload, split on frame boundaries."""
    frames = group.frames
    count = frames.shape[time_dim]
    frame_bytes = frames.numel() * frames.element_size() // max(count, 1)
    for start, length in wire.frame_slices(count, frame_bytes, cap_bytes):
        yield pb.FrameChunk(
            request_id=request_id,
            chunk_index=group.chunk_index,
            first_frame=group.first_frame + start,
            frames=wire.to_message(frames.narrow(time_dim, start, length)),
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _log_line(record: CallRecord, code: grpc.StatusCode) -> str:
    total_ms = (time.perf_counter() - record.started) * 1e3
    first = record.first_frame_at - record.started if record.first_frame_at else None
    return (
        f"{record.method} id={record.request_id} status={code.name} shape={record.shape} "
        f"chunks_in={record.chunks_in} groups={record.groups_out} frames={record.frames_out} "
        f"device_ms={record.device_seconds * 1e3:.1f} first_frame_ms={_ms(first)} "
        f"first_wait_ms={_ms(record.first_wait_s)} first_step_ms={_ms(record.first_step_s)} first_gpu_ms={_ms(record.first_gpu_s)} "
        f"first_launch_ms={_ms(record.first_launch_s)} total_ms={total_ms:.1f}"
        # a resumed call: frames decoded for the causal cache but not sent (the client had them)
        + (f" skipped_frames={record.skipped_frames}" if record.skipped_frames else "")
    )


class VaeDecoderService:
    """GetModelInfo, Decode and DecodeStream over a WorkerPool."""

    def __init__(self, config: ServerConfig, pool: WorkerPool, lifecycle: Lifecycle, metrics: Any = None) -> None:
        self.config = config
        self.pool = pool
        self.lifecycle = lifecycle
        self.metrics = metrics

    def rpc_handlers(self) -> grpc.GenericRpcHandler:
        serialize = pb.FrameChunk.SerializeToString
        return grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, response_serializer=pb.ModelInfo.SerializeToString),
            "Decode": grpc.stream_stream_rpc_method_handler(self.Decode, response_serializer=serialize),
            "DecodeStream": grpc.stream_stream_rpc_method_handler(self.DecodeStream, response_serializer=serialize),
        })

    # -- the one error -> status translation ---------------------------------------------

    def _finish(self, record: CallRecord, code: grpc.StatusCode) -> None:
        (log.info if code == grpc.StatusCode.OK else log.warning)(_log_line(record, code))
        if self.metrics is not None:
            self.metrics.request_finished(record.method, code.name, time.perf_counter() - record.started)
            if code == grpc.StatusCode.OK and record.first_frame_at is not None:
                self.metrics.observe_first_frame(record.method, record.first_frame_at - record.started)

    async def _abort(self, context: grpc.aio.ServicerContext, record: CallRecord, exc: BaseException) -> None:
        code = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("internal error in %s id=%s", record.method, record.request_id, exc_info=exc)
            message = f"internal error (request id {record.request_id}); see the server log"
        else:
            message = str(exc)
        self._finish(record, code)
        await context.abort(code, message)

    @staticmethod
    def _cancel_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED

    async def _translated(
        self,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
        messages: AsyncIterator[Any],
        client_streaming: bool,
    ) -> AsyncIterator[Any]:
        """Run one streaming call: its errors become status codes, it is logged and counted
        once, and its session is closed however it ends. A failing client-streaming call
        lingers briefly, reading nothing, before its status: a grpc.aio client still writing
        otherwise sees INTERNAL instead of it (see vaed.interceptors)."""
        try:
            async for message in messages:
                yield message
        except (asyncio.CancelledError, GeneratorExit):
            self._finish(record, self._cancel_code(context))
            raise
        except Exception as exc:
            await messages.aclose()  # frees the session and stops its reader
            if client_streaming:
                await asyncio.sleep(REFUSAL_LINGER_SECONDS)
            await self._abort(context, record, exc)
        else:
            self._finish(record, grpc.StatusCode.OK)
        finally:
            await messages.aclose()  # runs the call's own cleanup now, not at garbage collection

    # -- RPCs ----------------------------------------------------------------------------

    async def GetModelInfo(self, request: bytes, context: grpc.aio.ServicerContext) -> Any:
        record = CallRecord("GetModelInfo", "-")
        try:
            parse(pb.ModelInfoRequest, request)
            self._check_serving()
            reply = self._model_info()
        except Exception as exc:
            await self._abort(context, record, exc)
        self._finish(record, grpc.StatusCode.OK)
        return reply

    def Decode(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        record = CallRecord("Decode", "-")
        requests = requests.__aiter__()
        return self._translated(context, record, self._decode(requests, record), client_streaming=False)

    def DecodeStream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        record = CallRecord("DecodeStream", "-")
        requests = requests.__aiter__()
        return self._translated(context, record, self._decode_stream(requests, record), client_streaming=True)

    # -- the calls -----------------------------------------------------------------------

    def _check_serving(self) -> None:
        if self.lifecycle.draining:
            raise NotReady("the server is draining for shutdown; retry on another replica")
        if not self.pool.ready:
            if self.pool.started:
                raise NotReady("the model failed to load; see the server log")
            raise NotReady("the server is warming up (loading the model); retry shortly")

    @property
    def _offered(self) -> tuple[str, ...]:
        engine = self.pool.engine
        offered = engine.info.precisions if engine is not None else (Precision.LOSSLESS,)
        default = self.config.precision
        return (default,) + tuple(p for p in Precision if p in offered and p != default)

    def _model_info(self) -> Any:
        engine = self.pool.engine
        if engine is None:
            raise NotReady("no device is serving; see the server log")
        info = engine.info
        cfg = self.config
        return pb.ModelInfo(
            model=cfg.model,
            z_dim=engine.z_dim,
            scale_factor_temporal=engine.scale_temporal,
            scale_factor_spatial=engine.scale_spatial,
            latents_mean=engine.latents_mean,
            latents_std=engine.latents_std,
            compute_dtype=_WIRE_DTYPE[info.dtype],
            device=info.device,
            random_weights=info.random_weights,
            max_message_bytes=cfg.max_message_bytes,
            max_latent_frames=cfg.max_latent_frames,
            max_pixels=cfg.max_pixels,
            kernels=info.kernels,
            layout=info.layout,
            fast_paths_note=info.fast_paths_note,
            precisions=[_PRECISION_VALUES[p] for p in self._offered],
            # a spatial group is one worker whose engine spans every configured device
            devices=list(cfg.devices) if engine.describe() != Parallel.OFF else [w.device for w in self.pool.healthy_workers],
            parallel=engine.describe(),
        )

    def _limits(self) -> Limits:
        engine = self.pool.engine
        if engine is None:
            raise NotReady("no device is serving; see the server log")
        cfg = self.config
        return Limits(
            z_dim=engine.z_dim, scale_spatial=engine.scale_spatial, max_batch=cfg.max_batch,
            max_latent_frames=cfg.max_latent_frames, max_pixels=cfg.max_pixels,
        )

    def _open(self, record: CallRecord, options: Any) -> Session:
        spec = output_spec(options, self.config.precision, self._offered)
        return Session(
            record, spec, self._limits(), loop=asyncio.get_running_loop(),
            credits=self.config.queue_chunks, max_backlog_frames=self.config.max_backlog_frames,
        )

    def _accept(self, session: Session, message: Any) -> None:
        """Validate the wire tensor's header against the session, then copy and queue it."""
        shape, dtype = latents_header(message)
        session.validate(shape, dtype)
        session.accept(wire.to_torch(message))

    async def _frames(self, session: Session, skip_frames: int = 0) -> AsyncIterator[Any]:
        """The session's frame messages, then the final message; raises the session's failure.
        Frames before `skip_frames` (a resumed call's, already delivered elsewhere) are decoded
        but not sent: their latent frames still build the causal cache the later frames need."""
        record = session.record
        cap = self.config.frame_message_bytes
        time_dim = session.output.time_dim
        groups = frames_total = 0  # of the whole video, skipped ones included (the final message's counts)
        while (decoded := await session.next_group()) is not None:
            groups += 1
            frames_total += decoded.frames.shape[time_dim]
            group = self._unsent_part(decoded, record, time_dim, skip_frames)
            if group is None:
                session.group_sent()
                continue
            if record.first_step_s is None:
                record.first_wait_s = group.step_started - record.started
                record.first_step_s = group.device_seconds
                record.first_gpu_s = group.gpu_seconds
                record.first_launch_s = group.launch_seconds
            for message in frame_messages(group, record.request_id, time_dim, cap):
                yield message
                if record.first_frame_at is None:
                    record.first_frame_at = time.perf_counter()
            session.group_sent()
            frames = group.frames.shape[time_dim]
            record.groups_out += 1
            record.frames_out += frames
            record.device_seconds += group.device_seconds
            if self.metrics is not None:
                self.metrics.frames_decoded(frames, 1)
        yield pb.FrameChunk(request_id=record.request_id, chunk_index=groups, first_frame=frames_total, final=True)

    def _unsent_part(self, group: HostGroup, record: CallRecord, time_dim: int, skip_frames: int) -> HostGroup | None:
        """What of `group` a call that skips its first `skip_frames` frames sends: all of it, its
        tail (a group across the boundary) or nothing (None). Skipped frames are counted in the
        record, the log line and vaed_skipped_frames_total."""
        if group.first_frame >= skip_frames:
            return group
        frames = group.frames.shape[time_dim]
        cut = min(frames, skip_frames - group.first_frame)
        record.skipped_frames += cut
        if self.metrics is not None:
            self.metrics.frames_skipped(cut, latent_frames=1 if cut == frames else 0)
        if cut == frames:
            record.device_seconds += group.device_seconds
            return None
        return dataclasses.replace(
            group, first_frame=skip_frames, frames=group.frames.narrow(time_dim, cut, frames - cut))

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[SessionSlot]:
        self._check_serving()
        slot = self.pool.admit()
        try:
            yield slot
        finally:
            slot.release()

    async def _decode(self, requests: AsyncIterator[bytes], record: CallRecord) -> AsyncIterator[Any]:
        async with self._admitted() as slot:
            raw = await first_message(requests, "Decode", self.config.session_first_message_timeout)
            if raw is None:
                raise InvalidInput("Decode needs one DecodeRequest message")
            request = parse(pb.DecodeRequest, raw)
            record.request_id = checked_request_id(request.options.request_id)
            session = self._open(record, request.options)
            skip = request.options.skip_frames
            self._accept(session, request.latents)
            del request, raw  # the session holds the only copy of the latents
            session.finish_input()
            worker = self.pool.attach(session, slot)
            more = asyncio.create_task(
                self._refuse_a_second_request(requests, session, self.config.session_first_message_timeout))
            try:
                async for message in self._frames(session, skip):
                    if message.final:
                        await more  # the call succeeds only once its one message was all it sent
                    yield message
            finally:
                more.cancel()
                with contextlib.suppress(asyncio.CancelledError, InvalidInput):
                    await more
                worker.detach(session)

    async def _decode_stream(self, requests: AsyncIterator[bytes], record: CallRecord) -> AsyncIterator[Any]:
        async with self._admitted() as slot:
            raw = await first_message(requests, "DecodeStream", self.config.session_first_message_timeout)
            if raw is None:
                # Opened and half-closed with no chunk: an empty, successful session.
                record.request_id = checked_request_id("")
                yield pb.FrameChunk(request_id=record.request_id, final=True)
                return
            first = parse(pb.LatentChunk, raw)
            record.request_id = checked_request_id(first.options.request_id)
            session = self._open(record, first.options)
            skip = first.options.skip_frames
            self._accept(session, first.latents)
            del first, raw
            worker = self.pool.attach(session, slot)
            reader = asyncio.create_task(self._read_rest(requests, session))
            try:
                async for message in self._frames(session, skip):
                    yield message
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                worker.detach(session)

    @staticmethod
    async def _refuse_a_second_request(requests: AsyncIterator[bytes], session: Session, timeout: float) -> None:
        """Decode is unary: read on to the client's half-close, and fail the call if a second
        message comes first (gRPC's unary handlers would otherwise just ignore it). A client
        that never half-closes gets `timeout` s after its frames went out, then DEADLINE_EXCEEDED."""
        def late() -> ClientIdle:
            return ClientIdle(
                f"the Decode call was not half-closed within {timeout:g} s after its frames were sent "
                "(the server's --session-first-message-timeout); a unary call sends one message and its end")

        if await session.next_message(requests, timeout, late) is not None:
            exc = InvalidInput("Decode takes exactly one DecodeRequest and a second message arrived; "
                               "send latents in several messages with DecodeStream")
            session.fail(exc)
            raise exc

    async def _read_rest(self, requests: AsyncIterator[bytes], session: Session) -> None:
        """Feed the session's later chunks, reading the next one only while its backlog has
        room (gRPC flow control then holds the client); a bad chunk fails the session."""
        try:
            while True:
                await session.wait_for_room()  # a full backlog is the server's wait: not idle
                raw = await session.next_message(requests, self.config.session_idle_timeout)
                if raw is None:
                    break
                chunk = parse(pb.LatentChunk, raw)
                if chunk.HasField("options"):
                    raise InvalidInput(
                        "options are only accepted on the first message of a DecodeStream; "
                        f"chunk {session.record.chunks_in} carried options"
                    )
                self._accept(session, chunk.latents)
            session.finish_input()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            session.fail(exc)

