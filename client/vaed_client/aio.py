"""asyncio vaed client on grpc.aio, mirroring `VaeClient`.

    async with AsyncVaeClient("localhost:50051") as client:
        video = await client.decode(latents)
        async for chunk in client.stream(latents):
            ...
        async with client.session() as session:
            async for latent_chunk in generator():
                await session.push(latent_chunk)
            video = await session.collect()
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc
import grpc.aio

from ._proto import vaed_pb2, vaed_pb2_grpc
from .channel import TlsSpec, create_aio_channel
from .client import ModelInfo, build_options, encode_latents, format_name
from .errors import CancelledError, VaedError, from_rpc_error
from .video import RGB8, DecodedChunk, VideoAssembler, has_frames, to_chunk

log = logging.getLogger(__name__)


class AsyncVaeClient:
    """asyncio client; create it inside a running event loop (grpc.aio binds
    channels to the loop). `timeout` is the deadline of each call."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        tls: TlsSpec = None,
        token: str | None = None,
        options: list[tuple[str, Any]] | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._channel, self._metadata = create_aio_channel(target, tls=tls, token=token, options=options)
        self._stub = vaed_pb2_grpc.VaeDecoderStub(self._channel)
        self._info: ModelInfo | None = None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncVaeClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def model_info(self) -> ModelInfo:
        try:
            reply = await self._stub.GetModelInfo(
                vaed_pb2.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self._info = ModelInfo.from_proto(reply)
        return self._info

    async def _cached_info(self) -> ModelInfo:
        # Once per client (two racing first calls both fetch; harmless).
        return self._info if self._info is not None else await self.model_info()

    def _decode_call(self, latents: Any, options: vaed_pb2.DecodeOptions) -> tuple[Any, bool, int | None]:
        message, as_torch, t = encode_latents(latents)
        call = self._stub.Decode(
            vaed_pb2.DecodeRequest(latents=message, options=options),
            timeout=self.timeout,
            metadata=self._metadata,
        )
        return call, as_torch, t

    async def decode(
        self,
        latents: Any,
        *,
        format: str = RGB8,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> Any:
        """The whole video; see `VaeClient.decode`."""
        fmt = format_name(format)
        options = build_options(fmt, raw_latents, raw_dtype, request_id)
        info = await self._cached_info()
        call, as_torch, t = self._decode_call(latents, options)
        assembler = VideoAssembler(fmt, info.output_frames(t) if t else None)
        try:
            async for reply in call:
                assembler.add(reply)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except BaseException:
            call.cancel()
            raise
        return assembler.result(as_torch)

    async def stream(
        self,
        latents: Any,
        *,
        format: str = RGB8,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> AsyncIterator[DecodedChunk]:
        """Async-iterate DecodedChunks as they decode; leaving early cancels."""
        fmt = format_name(format)
        options = build_options(fmt, raw_latents, raw_dtype, request_id)
        call, as_torch, _ = self._decode_call(latents, options)
        try:
            async for reply in call:
                if has_frames(reply):
                    yield to_chunk(reply, fmt, as_torch)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the call ended

    def session(
        self,
        *,
        format: str = RGB8,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> "AsyncDecodeSession":
        fmt = format_name(format)
        return AsyncDecodeSession(self, fmt, build_options(fmt, raw_latents, raw_dtype, request_id))


_END = object()


class AsyncDecodeSession:
    """A DecodeStream call: `await push()` latent chunks, `async for` frames.

    `push` waits on gRPC flow control (backpressure). Replies are read by a
    background task into a local queue so pushing everything before
    iterating cannot deadlock; the call starts on first use.
    """

    def __init__(self, client: AsyncVaeClient, fmt: str, options: vaed_pb2.DecodeOptions) -> None:
        self.format = fmt
        self.request_id = options.request_id
        self._client = client
        self._options: vaed_pb2.DecodeOptions | None = options
        self._as_torch: bool | None = None
        self._latent_frames = 0
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False
        self._cancelled = False
        self._iterated = False
        self._error: VaedError | None = None
        self._failure: VaedError | None = None

    def _start(self) -> Any:
        if self._call is None:
            self._call = self._client._stub.DecodeStream(
                timeout=self._client.timeout, metadata=self._client._metadata
            )
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        return self._call

    async def _read_replies(self) -> None:
        call = self._call
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    break
                await self._replies.put(reply)
            await self._replies.put(_END)
        except grpc.RpcError as e:
            self._failure = from_rpc_error(e)
            await self._replies.put(self._failure)
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from read() once the call is cancelled.
            self._failure = CancelledError("session cancelled")
            self._replies.put_nowait(self._failure)
            if not self._cancelled:
                raise

    async def push(self, latents: Any) -> None:
        """Send one latent chunk `[B, z_dim, t, h, w]` (any t >= 1)."""
        if self._closed:
            raise RuntimeError("push() after close() or cancel()")
        call = self._start()
        message, as_torch, t = encode_latents(latents)
        if self._as_torch is None:
            self._as_torch = as_torch
        chunk = vaed_pb2.LatentChunk(latents=message)
        if self._options is not None:  # options travel on the first message only
            chunk.options.CopyFrom(self._options)
            self._options = None
        self._latent_frames += t or 0
        try:
            await call.write(chunk)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.InvalidStateError:  # the call already ended
            if self._failure is not None:
                raise self._failure from None
            raise RuntimeError("session already ended") from None

    async def close(self) -> None:
        """Half-close: no more latents; frames still arrive until the end."""
        if self._closed:
            return
        self._closed = True
        call = self._start()
        try:
            await call.done_writing()
        except grpc.RpcError as e:
            if self._failure is None:
                self._failure = from_rpc_error(e)
        except asyncio.InvalidStateError:
            pass  # already finished; the reader reports how

    def cancel(self) -> None:
        """Abort the session; the server frees it between chunks."""
        self._cancelled = True
        self._closed = True
        if self._call is not None:
            self._call.cancel()

    async def _next_reply(self) -> vaed_pb2.FrameChunk | None:
        if self._error is not None:
            if self._cancelled:
                return None
            raise self._error
        self._start()
        item = await self._replies.get()
        if item is _END:
            self._replies.put_nowait(_END)
            return None
        if isinstance(item, VaedError):
            self._error = item
            self._replies.put_nowait(_END)
            if self._cancelled:
                return None
            raise item
        if item.request_id:
            self.request_id = item.request_id
        return item

    async def __aiter__(self) -> AsyncIterator[DecodedChunk]:
        while (reply := await self._next_reply()) is not None:
            if has_frames(reply):
                self._iterated = True
                yield to_chunk(reply, self.format, bool(self._as_torch))

    async def collect(self) -> Any:
        """Close and return the whole video (see `DecodeSession.collect`)."""
        if self._iterated:
            raise RuntimeError(
                "collect() after iterating the session: assemble the chunks with vaed_client.video.assemble()"
            )
        await self.close()
        expected = None
        if self._latent_frames:
            expected = (await self._client._cached_info()).output_frames(self._latent_frames)
        assembler = VideoAssembler(self.format, expected)
        while (reply := await self._next_reply()) is not None:
            assembler.add(reply)
        if self._cancelled:
            raise self._error or CancelledError("session cancelled by the client")
        return assembler.result(bool(self._as_torch))

    async def __aenter__(self) -> "AsyncDecodeSession":
        self._start()
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            await self.close()
