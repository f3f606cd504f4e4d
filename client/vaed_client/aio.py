"""asyncio vaed client on grpc.aio (the awaiting front-end over `core`).

    async with AsyncVaeClient("localhost:50051") as client:
        video = await client.decode(latents)
        async for chunk in client.stream(latents):
            ...
        async with client.session() as session:
            async for latent_chunk in generator():
                await session.push(latent_chunk)
            video = await session.collect()

grpc.aio binds a channel to the event loop it was created in, so the channel
is created lazily, on the first call, in the loop that runs it: building the
client outside a loop (at import time, in `__init__` of a sync object) works.
Using one client from two different loops raises a RuntimeError that says to
make one client per loop. After `close()` (the end of `async with`) calls in
that loop raise `ClientClosedError`; entered again in a new loop (one
`asyncio.run` per job), the client opens a fresh channel there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc
import grpc.aio

from . import wire
from .channel import Metadata, PemSpec, TlsSpec, create_aio_channel, prepare_channel, with_default_port
from .client import closed_message
from .core import (
    END,
    Assembly,
    CallSpec,
    ModelInfo,
    SessionState,
    SessionView,
    call_spec,
    chunk_result,
    decode_request,
    prepare_latents,
    stream_latents,
)
from .errors import CancelledError, ClientClosedError, from_rpc_error
from .video import DecodedChunk, has_frames

log = logging.getLogger(__name__)


class AsyncVaeClient:
    """asyncio client; same options as `VaeClient`. `timeout` is the deadline of each call."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        tls: TlsSpec = None,
        token: str | None = None,
        tls_server_name: str | None = None,
        options: list[tuple[str, Any]] | None = None,
        tls_client_cert: PemSpec = None,
        tls_client_key: PemSpec = None,
    ) -> None:
        self.target = with_default_port(target)
        self.timeout = timeout
        self._channel_args: dict[str, Any] = dict(
            tls=tls, token=token, options=options, tls_server_name=tls_server_name,
            tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
        )
        prepare_channel(**self._channel_args)  # bad TLS specs fail here, like VaeClient
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metadata: Metadata = ()
        self._stub_obj: Any = None
        self._closed_in: asyncio.AbstractEventLoop | None = None  # the loop whose close() ended the channel
        self._info: ModelInfo | None = None

    @property
    def _stub(self) -> Any:
        """The stub of this loop's channel, created on first use. After close(),
        calls in the same loop raise ClientClosedError; another loop starts over."""
        loop = asyncio.get_running_loop()
        if loop is self._closed_in:
            raise ClientClosedError(closed_message(type(self).__name__, self.target, "async with"))
        if self._channel is None:
            self._channel, self._metadata = create_aio_channel(self.target, **self._channel_args)
            self._stub_obj = wire.pb_grpc.VaeDecoderStub(self._channel)
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncVaeClient is bound to the event loop of its first call (grpc.aio channels "
                "belong to one loop); create one AsyncVaeClient per event loop"
            )
        return self._stub_obj

    @property
    def closed(self) -> bool:
        """Whether close() ran in the running event loop (a new loop may use the client again)."""
        try:
            return asyncio.get_running_loop() is self._closed_in
        except RuntimeError:  # no running loop
            return self._closed_in is not None

    async def close(self) -> None:
        """Close this loop's channel; later calls in this loop raise ClientClosedError.
        (A client built once and entered with `async with` in each new loop, e.g. one
        `asyncio.run` per job, gets a fresh channel in each.)"""
        self._closed_in = asyncio.get_running_loop()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "AsyncVaeClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def model_info(self) -> ModelInfo:
        stub = self._stub
        try:
            reply = await stub.GetModelInfo(wire.pb.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self._info = ModelInfo.from_proto(reply)
        return self._info

    async def _cached_info(self) -> ModelInfo:
        # Once per client (two racing first calls both fetch; harmless).
        return self._info if self._info is not None else await self.model_info()

    async def decode(
        self,
        latents: Any,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> Any:
        """The whole video; see `VaeClient.decode`."""
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id)
        prepared = prepare_latents(latents)
        info = await self._cached_info()
        assembly = Assembly(spec, prepared.as_torch, info.output_frames(prepared.latent_frames))
        call = self._stub.Decode(decode_request(spec, prepared), timeout=self.timeout, metadata=self._metadata)
        try:
            async for reply in call:
                assembly.add(reply)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except BaseException:
            call.cancel()
            raise
        return assembly.result()

    async def stream(
        self,
        latents: Any,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> AsyncIterator[DecodedChunk]:
        """Async-iterate DecodedChunks as they decode; leaving early cancels.
        The latents go as in `VaeClient.stream`: two frames first, the rest after the first frame."""
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id)
        streamed = stream_latents(spec, latents)
        first_reply = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield streamed.first
            if streamed.rest is not None:
                await first_reply.wait()  # the rest waits for the first frame (core.StreamedLatents)
                if not call.done():  # written into an ended call, grpc.aio would report INTERNAL
                    yield streamed.rest_message()

        call = self._stub.DecodeStream(requests(), timeout=self.timeout, metadata=self._metadata)
        try:
            async for reply in call:
                first_reply.set()
                if has_frames(reply):
                    yield chunk_result(reply, spec, streamed.as_torch)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            first_reply.set()
            call.cancel()  # no-op once the call ended

    def session(
        self,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> "AsyncDecodeSession":
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id)
        return AsyncDecodeSession(self, spec)


class AsyncDecodeSession(SessionView):
    """A DecodeStream call: `await push()` latent chunks, `async for` frames.

    `push` waits on gRPC flow control (backpressure). Replies are read by a
    background task into a local queue so pushing everything before
    iterating cannot deadlock; the call starts on first use.
    """

    def __init__(self, client: AsyncVaeClient, spec: CallSpec) -> None:
        self._state = SessionState(spec)
        self._client = client
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: asyncio.Queue[Any] | None = None

    def _start(self) -> Any:
        if self._call is None:
            stub = self._client._stub  # binds the client to this loop
            self._replies = asyncio.Queue()
            self._call = stub.DecodeStream(timeout=self._client.timeout, metadata=self._client._metadata)
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        return self._call

    async def _read_replies(self) -> None:
        call, replies = self._call, self._replies
        assert replies is not None
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    break
                await replies.put(reply)
            await replies.put(END)
        except grpc.RpcError as e:
            await replies.put(self._state.reader_failed(from_rpc_error(e)))
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from read() once the call is cancelled.
            replies.put_nowait(self._state.reader_failed(CancelledError("session cancelled")))
            if not self._state.cancelled:
                raise

    async def push(self, latents: Any) -> None:
        """Send one latent chunk `[B, z_dim, t, h, w]` (any t >= 1)."""
        self._state.check_push()
        call = self._start()
        chunk = self._state.chunk_message(latents)
        try:
            await call.write(chunk)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.InvalidStateError:  # the call already ended
            if self._state.failure is not None:
                raise self._state.failure from None
            raise RuntimeError("session already ended") from None

    async def close(self) -> None:
        """Half-close: no more latents; frames still arrive until the end."""
        if self._state.closed:
            return
        self._state.closed = True
        call = self._start()
        try:
            await call.done_writing()
        except grpc.RpcError as e:
            if self._state.failure is None:
                self._state.reader_failed(from_rpc_error(e))
        except asyncio.InvalidStateError:
            pass  # already finished; the reader reports how

    def cancel(self) -> None:
        """Abort the session; the server frees it between chunks."""
        self._state.cancelled = True
        self._state.closed = True
        if self._call is not None:
            self._call.cancel()

    async def _next_reply(self) -> Any:
        if self._state.error is not None:
            self._state.after_error()
            return None
        self._start()
        assert self._replies is not None
        reply, put_back = self._state.take(await self._replies.get())
        if put_back:
            self._replies.put_nowait(END)
        return reply

    async def __aiter__(self) -> AsyncIterator[DecodedChunk]:
        while (reply := await self._next_reply()) is not None:
            chunk = self._state.chunk(reply)
            if chunk is not None:
                yield chunk

    async def collect(self) -> Any:
        """Close and return the whole video (see `DecodeSession.collect`)."""
        self._state.start_collect()
        await self.close()
        info = await self._client._cached_info() if self._state.latent_frames else None
        assembly = self._state.assembly(info)
        while (reply := await self._next_reply()) is not None:
            assembly.add(reply)
        return self._state.finish_collect(assembly)

    async def __aenter__(self) -> "AsyncDecodeSession":
        self._start()
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            await self.close()
