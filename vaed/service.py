"""gRPC servicer: proto <-> engine. No torch math here; device work goes
through the DeviceWorker, and every domain error becomes a status code in
`status_for`, the one place that chooses codes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc
import torch

from vaed_client import tensors
from vaed_client._proto import vaed_pb2, vaed_pb2_grpc

from .config import ServerConfig
from .engine import DTYPES, OutputSpec
from .errors import CapacityExhausted, InvalidInput, NotReady, VaedServerError
from .rpc_streams import drain_requests
from .worker import DeviceWorker, EndOfOutput, HostGroup, WorkItem

log = logging.getLogger(__name__)

_WIRE_DTYPE = {torch.float16: vaed_pb2.FLOAT16, torch.bfloat16: vaed_pb2.BFLOAT16, torch.float32: vaed_pb2.FLOAT32}


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InvalidInput):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, CapacityExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def output_spec(options: vaed_pb2.DecodeOptions) -> OutputSpec:
    fmt = options.format
    if fmt not in (vaed_pb2.OUTPUT_FORMAT_UNSPECIFIED, vaed_pb2.RGB8, vaed_pb2.RAW):
        raise InvalidInput(f"unknown output format {fmt}; use RGB8 or RAW")
    raw_dtype = None
    if options.raw_dtype != vaed_pb2.DATA_TYPE_UNSPECIFIED:
        name = tensors.DTYPE_NAMES.get(options.raw_dtype)
        if name not in DTYPES:
            raise InvalidInput(
                f"raw_dtype {tensors.dtype_name(options.raw_dtype)} is not a RAW output type; "
                "use FLOAT16, BFLOAT16 or FLOAT32"
            )
        raw_dtype = DTYPES[name]
    return OutputSpec(rgb8=fmt != vaed_pb2.RAW, raw_dtype=raw_dtype, raw_latents=options.raw_latents)


def latents_from_message(message: vaed_pb2.Tensor) -> torch.Tensor:
    try:
        return tensors.to_torch(message)
    except tensors.TensorFormatError as exc:
        raise InvalidInput(f"latents: {exc}") from exc


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def frame_messages(group: HostGroup, request_id: str, rgb8: bool, cap_bytes: int) -> Iterator[vaed_pb2.FrameChunk]:
    """One group -> FrameChunks of at most cap_bytes payload, split on frame boundaries."""
    frames = group.frames
    time_dim = 1 if rgb8 else 2
    count = frames.shape[time_dim]
    per_frame = max(1, frames.numel() * frames.element_size() // max(count, 1))
    step = max(1, cap_bytes // per_frame)
    for start in range(0, count, step):
        part = frames.narrow(time_dim, start, min(step, count - start))
        yield vaed_pb2.FrameChunk(
            request_id=request_id,
            chunk_index=group.chunk_index,
            first_frame=group.first_frame + start,
            frames=tensors.to_message(part),
            final=group.last and start + step >= count,
        )


@dataclass
class CallStats:
    method: str
    request_id: str
    started: float
    shape: list[int] | None = None
    latent_frames: int = 0
    chunks_in: int = 0
    groups_out: int = 0
    frames_out: int = 0
    decode_seconds: float = 0.0
    first_frame_at: float | None = None

    def log_line(self, code: grpc.StatusCode) -> str:
        total_ms = (time.perf_counter() - self.started) * 1e3
        first = f"{(self.first_frame_at - self.started) * 1e3:.1f}" if self.first_frame_at else "-"
        return (
            f"{self.method} id={self.request_id} status={code.name} shape={self.shape} "
            f"latent_frames={self.latent_frames} chunks_in={self.chunks_in} groups={self.groups_out} "
            f"frames={self.frames_out} decode_ms={self.decode_seconds * 1e3:.1f} first_frame_ms={first} "
            f"total_ms={total_ms:.1f}"
        )


class Lifecycle:
    """What the servicer needs to know about the server's state."""

    def __init__(self) -> None:
        self.draining = False


class VaeDecoderService(vaed_pb2_grpc.VaeDecoderServicer):
    def __init__(self, config: ServerConfig, worker: DeviceWorker, lifecycle: Lifecycle, metrics=None) -> None:
        self.config = config
        self.worker = worker
        self.lifecycle = lifecycle
        self.metrics = metrics

    # -- helpers -------------------------------------------------------------

    def _check_serving(self) -> None:
        if self.lifecycle.draining:
            raise NotReady("the server is draining for shutdown; retry on another replica")
        if not self.worker.ready:
            if self.worker.startup_error is not None:
                raise NotReady("the model failed to load; see the server log")
            raise NotReady("the server is warming up (loading the model); retry shortly")

    def _check_chunk(self, stats: CallStats, latents: torch.Tensor) -> None:
        assert self.worker.engine is not None
        shape = tuple(latents.shape)
        session_shape = None
        if stats.shape is not None:
            session_shape = (stats.shape[0], stats.shape[3], stats.shape[4])
        self.worker.engine.check_chunk(
            shape, latents.dtype, frames_before=stats.latent_frames, session_shape=session_shape
        )
        if stats.shape is None:
            stats.shape = list(shape)
        else:
            stats.shape[2] += shape[2]
        stats.latent_frames += shape[2]
        stats.chunks_in += 1

    async def _abort(self, context: grpc.aio.ServicerContext, stats: CallStats, exc: BaseException) -> None:
        code = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("internal error in %s id=%s", stats.method, stats.request_id, exc_info=exc)
            message = f"internal error (request id {stats.request_id}); see the server log"
        else:
            message = str(exc)
        self._finish(stats, code)
        await context.abort(code, message)

    def _finish(self, stats: CallStats, code: grpc.StatusCode) -> None:
        line = stats.log_line(code)
        (log.info if code == grpc.StatusCode.OK else log.warning)(line)
        if self.metrics is not None:
            self.metrics.request_finished(stats.method, code.name, time.perf_counter() - stats.started)
            if code == grpc.StatusCode.OK and stats.first_frame_at is not None:
                self.metrics.observe_first_frame(stats.method, stats.first_frame_at - stats.started)

    def _open(self, spec: OutputSpec) -> WorkItem:
        item = self.worker.open(spec)
        if self.metrics is not None:
            self.metrics.session_opened()
        return item

    def _close(self, item: WorkItem) -> None:
        self.worker.close(item)
        if self.metrics is not None:
            self.metrics.session_closed()
            self.metrics.set_queued_chunks(self.worker.queued_chunks)

    async def _results(self, item: WorkItem, stats: CallStats) -> AsyncIterator[vaed_pb2.FrameChunk]:
        """Frame messages of one call until its last group; raises the worker's errors."""
        cap = self.config.frame_message_bytes
        while True:
            value = await item.results.get()
            if isinstance(value, BaseException):
                raise value
            if isinstance(value, EndOfOutput):
                yield vaed_pb2.FrameChunk(request_id=stats.request_id, chunk_index=stats.groups_out, final=True)
                return
            assert isinstance(value, HostGroup)
            for message in frame_messages(value, stats.request_id, item.output.rgb8, cap):
                yield message
                if stats.first_frame_at is None:
                    stats.first_frame_at = time.perf_counter()
            self.worker.release_credit(item)
            frames = value.frames.shape[1 if item.output.rgb8 else 2]
            stats.groups_out += 1
            stats.frames_out += frames
            stats.decode_seconds += value.decode_seconds
            if self.metrics is not None:
                self.metrics.frames_decoded(frames, 1)
                self.metrics.set_queued_chunks(self.worker.queued_chunks)
            if value.last:
                return

    # -- RPCs ------------------------------------------------------------------

    async def GetModelInfo(self, request: vaed_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext) -> vaed_pb2.ModelInfo:
        stats = CallStats("GetModelInfo", "-", time.perf_counter())
        try:
            self._check_serving()
        except VaedServerError as exc:
            await self._abort(context, stats, exc)
        engine = self.worker.engine
        assert engine is not None
        self._finish(stats, grpc.StatusCode.OK)
        return vaed_pb2.ModelInfo(
            model=self.config.model,
            z_dim=engine.z_dim,
            scale_factor_temporal=engine.scale_temporal,
            scale_factor_spatial=engine.scale_spatial,
            latents_mean=engine.latents_mean,
            latents_std=engine.latents_std,
            compute_dtype=_WIRE_DTYPE[engine.dtype],
            device=str(engine.device),
            random_weights=engine.loaded.random_weights,
            max_message_bytes=self.config.max_message_bytes,
            max_latent_frames=self.config.max_latent_frames,
            max_pixels=self.config.max_pixels,
            kernels=engine.fast_paths.kernels,
            layout=engine.fast_paths.layout,
        )

    async def Decode(self, request: vaed_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[vaed_pb2.FrameChunk]:
        stats = CallStats("Decode", request.options.request_id or new_request_id(), time.perf_counter())
        async for message in self._guarded(context, stats, self._decode(request, stats)):
            yield message

    async def DecodeStream(self, request_iterator: AsyncIterator[vaed_pb2.LatentChunk], context: grpc.aio.ServicerContext) -> AsyncIterator[vaed_pb2.FrameChunk]:
        stats = CallStats("DecodeStream", "-", time.perf_counter())
        requests = request_iterator.__aiter__()
        async for message in self._guarded(context, stats, self._decode_stream(requests, stats), requests):
            yield message

    async def _guarded(
        self,
        context: grpc.aio.ServicerContext,
        stats: CallStats,
        messages: AsyncIterator[vaed_pb2.FrameChunk],
        requests: AsyncIterator[vaed_pb2.LatentChunk] | None = None,
    ) -> AsyncIterator[vaed_pb2.FrameChunk]:
        """Run one streaming call: its errors become status codes, it is logged and counted once,
        and its session is closed however it ends (done, failed, cancelled, deadline). A failing
        client-streaming call drains the client's in-flight chunks before its status."""
        try:
            async for message in messages:
                yield message
        except (asyncio.CancelledError, GeneratorExit):
            self._finish(stats, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            await messages.aclose()  # frees the session and stops its reader before draining
            if requests is not None:
                await drain_requests(requests)
            await self._abort(context, stats, exc)
        else:
            self._finish(stats, grpc.StatusCode.OK)
        finally:
            await messages.aclose()  # runs the call's own cleanup now, not at garbage collection

    async def _decode(self, request: vaed_pb2.DecodeRequest, stats: CallStats) -> AsyncIterator[vaed_pb2.FrameChunk]:
        self._check_serving()
        spec = output_spec(request.options)
        latents = latents_from_message(request.latents)
        self._check_chunk(stats, latents)
        item = self._open(spec)
        try:
            self.worker.submit(item, latents, last=True)
            async for message in self._results(item, stats):
                yield message
        finally:
            self._close(item)

    async def _decode_stream(
        self, requests: AsyncIterator[vaed_pb2.LatentChunk], stats: CallStats
    ) -> AsyncIterator[vaed_pb2.FrameChunk]:
        self._check_serving()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            # Opened and half-closed with no chunk: an empty, successful session.
            stats.request_id = new_request_id()
            yield vaed_pb2.FrameChunk(request_id=stats.request_id, final=True)
            return
        stats.request_id = first.options.request_id or new_request_id()
        spec = output_spec(first.options)
        latents = latents_from_message(first.latents)
        self._check_chunk(stats, latents)
        item = self._open(spec)
        reader = None
        try:
            self.worker.submit(item, latents)
            reader = asyncio.create_task(self._read_rest(requests, item, stats))
            async for message in self._results(item, stats):
                yield message
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader  # the request stream is free for draining once it returns
            self._close(item)

    async def _read_rest(self, requests: AsyncIterator[vaed_pb2.LatentChunk], item: WorkItem, stats: CallStats) -> None:
        """Feed the session's later chunks; a bad chunk ends the call through the result queue."""
        try:
            async for chunk in requests:
                if chunk.HasField("options"):
                    raise InvalidInput(
                        "options are only accepted on the first message of a DecodeStream; "
                        f"chunk {stats.chunks_in} carried options"
                    )
                latents = latents_from_message(chunk.latents)
                self._check_chunk(stats, latents)
                self.worker.submit(item, latents)
            self.worker.finish_input(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            item.results.put_nowait(exc)
