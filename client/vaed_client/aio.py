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
import os
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio

from . import wire
from .channel import Metadata, PemSpec, TlsSpec, create_aio_channel, prepare_channel
from .client import closed_message, target_list
from .core import (
    END,
    Assembly,
    CallSpec,
    ModelInfo,
    SessionState,
    SessionView,
    StreamedLatents,
    call_spec,
    chunk_result,
    frame_call_spec,
    normalize_latents,
    stream_latents,
)
from .encoding import EncodedAssembly, encode_options, prepare_video, video_chunks
from .errors import CancelledError, ClientClosedError, VaedError
from .mp4 import Mp4Output, mp4_output
from .resume import ATTEMPT_FAILURES, CallReport, Progress, ReplayLog, ResumePolicy, Targets, policy_of
from .video import DecodedChunk, has_frames

log = logging.getLogger(__name__)


class AsyncVaeClient:
    """asyncio client; same options as `VaeClient` (a list of targets, `resume=`). `timeout` is
    the deadline of each call, its resumes included."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = None,
        tls: TlsSpec = None,
        token: str | None = None,
        tls_server_name: str | None = None,
        options: list[tuple[str, Any]] | None = None,
        tls_client_cert: PemSpec = None,
        tls_client_key: PemSpec = None,
        resume: ResumePolicy | bool = True,
    ) -> None:
        self.targets = target_list(target)
        self.target = ",".join(self.targets)
        self.timeout = timeout
        self.resume = policy_of(resume)
        self._targets = Targets(self.targets)
        self._channel_args: dict[str, Any] = dict(
            tls=tls, token=token, options=options, tls_server_name=tls_server_name,
            tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
        )
        prepare_channel(**self._channel_args)  # bad TLS specs fail here, like VaeClient
        self._channels: list[grpc.aio.Channel] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metadata: Metadata = ()
        self._stub_objs: list[Any] = []
        self._closed_in: asyncio.AbstractEventLoop | None = None  # the loop whose close() ended the channel
        self._info: ModelInfo | None = None
        # one model-info fetch per event loop at a time (`_cached_info`); weak: a loop that ends goes
        self._info_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary())

    @property
    def _stub(self) -> Any:
        """The stub of this loop's channel, created on first use. After close(),
        calls in the same loop raise ClientClosedError; another loop starts over."""
        loop = asyncio.get_running_loop()
        if loop is self._closed_in:
            raise ClientClosedError(closed_message(type(self).__name__, self.target, "async with"))
        if not self._channels:
            made = [create_aio_channel(name, **self._channel_args) for name in self.targets]
            self._channels = [channel for channel, _ in made]
            self._metadata = made[0][1]
            self._stub_objs = [wire.pb_grpc.VaeDecoderStub(channel) for channel in self._channels]
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncVaeClient is bound to the event loop of its first call (grpc.aio channels "
                "belong to one loop); create one AsyncVaeClient per event loop"
            )
        return self._stub_objs[0]

    def _stub_at(self, index: int) -> Any:
        self._stub  # noqa: B018  (binds the loop; raises ClientClosedError once closed)
        return self._stub_objs[index]

    def _progress(self, report: CallReport | None, request_id: str, encoder: bool = False,
                  joins_attempts: bool = True) -> Progress:
        return Progress(self.resume, self._targets, report, self.timeout, request_id, encoder=encoder,
                        client_closed=lambda: self.closed, joins_attempts=joins_attempts)

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
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> AsyncVaeClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def model_info(self) -> ModelInfo:
        # GetModelInfo takes no decode's turn (`Targets.first`).
        progress = Progress(ResumePolicy(max_resumes=len(self.targets) - 1), self._targets, None, self.timeout, "",
                            takes_turn=False, client_closed=lambda: self.closed)
        while True:
            stub = self._stub_at(progress.target)
            try:
                reply = await stub.GetModelInfo(
                    wire.pb.ModelInfoRequest(), timeout=progress.remaining(), metadata=self._metadata)
                break
            except grpc.RpcError as e:
                await asyncio.sleep(progress.retry_delay(progress.error_of(e)))
        self._info = ModelInfo.from_proto(reply)
        return self._info

    async def _cached_info(self) -> ModelInfo:
        # Once per client: racing first calls wait for one fetch. Each would take one of the server's
        # RPC slots (2 x sessions + 8): 60 first calls at once sent 35 GetModelInfo, some refused.
        if self._info is None:
            lock = self._info_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
            async with lock:
                if self._info is None:
                    return await self.model_info()
        assert self._info is not None
        return self._info

    async def decode(
        self,
        latents: Any,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
        report: CallReport | None = None,
        fps: int | None = None,
        crf: int | None = None,
        preset: str | None = None,
        lossless: bool = False,
        mp4_path: str | os.PathLike[str] | None = None,
    ) -> Any:
        """The whole video (or its MP4 file: output_type="mp4"); see `VaeClient.decode`."""
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id, fps=fps, crf=crf, preset=preset,
                         lossless=lossless)
        latents = normalize_latents(latents)  # LocalInputError before any call, GetModelInfo too
        mp4 = mp4_output(spec.output_type, mp4_path)
        info = await self._cached_info()
        streamed = stream_latents(spec, latents, info.compute_dtype)
        assembly: Assembly | Mp4Output = mp4 or Assembly(
            spec, streamed.as_torch, info.output_frames(streamed.latent_frames))
        # an MP4's attempts each start the file over: nothing of two decoders is joined
        progress = self._progress(report, spec.options.request_id, joins_attempts=mp4 is None)
        try:
            while True:
                call, first_reply = self._open_stream(streamed, spec, progress)
                assembly.restart()
                try:
                    # its server's identity before any of its replies (here since the call opened)
                    progress.check_server(await call.initial_metadata())
                    async for reply in call:
                        first_reply.set()
                        if (reply := progress.accept(reply, spec.wire_format)) is not None:
                            assembly.add(reply)
                    return assembly.result()
                except ATTEMPT_FAILURES as e:
                    call.cancel()  # a refused replica's call (a failed one is over already)
                    await asyncio.sleep(progress.retry_delay(progress.error_of(e)))  # raises when the call ends here
                except BaseException:
                    call.cancel()
                    raise
                finally:
                    first_reply.set()
        except BaseException:
            assembly.discard()
            raise

    async def encode(
        self,
        frames: Any,
        *,
        output_type: str = "moments",
        out_dtype: Any = None,
        precision: Any = None,
        request_id: str | None = None,
        send_zeros: bool = False,
        encode_dtype: Any = None,
        report: CallReport | None = None,
    ) -> Any:
        """Latents of `frames`; see `VaeClient.encode` (resumed the same way)."""
        video = prepare_video(frames, send_zeros=send_zeros)
        options = encode_options(output_type=output_type, out_dtype=out_dtype, precision=precision,
                                 request_id=request_id, zero_frames=video.zero_frames, encode_dtype=encode_dtype)
        assembly = EncodedAssembly(output_type, video.as_torch, wire.encoded_latent_frames(video.total_frames))
        progress = self._progress(report, options.request_id, encoder=True)

        async def chunks(attempt_options: Any) -> AsyncIterator[Any]:
            # one message made at a time, as the sync client's generator does: the first goes out
            # (and the server starts encoding) before the later ones are even serialised
            for chunk in video_chunks(video, attempt_options):
                yield chunk

        while True:
            call = self._stub_at(progress.target).Encode(chunks(progress.encode_options(options)),
                                                         timeout=progress.remaining(), metadata=self._metadata)
            try:
                progress.check_server(await call.initial_metadata())  # its encoder's identity before its replies
                async for reply in call:
                    if (reply := progress.accept_latent(reply)) is not None:
                        assembly.add(reply)
                return assembly.result()
            except ATTEMPT_FAILURES as e:
                call.cancel()  # a refused replica's call (a failed one is over already)
                await asyncio.sleep(progress.retry_delay(progress.error_of(e)))  # raises when the call ends here
            except BaseException:
                call.cancel()
                raise

    async def stream(
        self,
        latents: Any,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
        report: CallReport | None = None,
    ) -> AsyncIterator[DecodedChunk]:
        """Async-iterate DecodedChunks as they decode; leaving early cancels (`aclose()`, or the
        generator dropped: one held in a variable after a `break` needs `await chunks.aclose()`).
        The latents go as in `VaeClient.stream`: two frames first, the rest after the first frame
        (a resumed attempt sends them all at once)."""
        spec = frame_call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                               raw_dtype=raw_dtype, request_id=request_id)
        latents = normalize_latents(latents)  # LocalInputError before any call, GetModelInfo too
        streamed = stream_latents(spec, latents, (await self._cached_info()).compute_dtype)
        progress = self._progress(report, spec.options.request_id)
        while True:
            call, first_reply = self._open_stream(streamed, spec, progress)
            error: VaedError
            try:
                progress.check_server(await call.initial_metadata())  # before any of its replies
                async for reply in call:
                    first_reply.set()
                    reply = progress.accept(reply, spec.wire_format)
                    if reply is not None and has_frames(reply):
                        yield chunk_result(reply, spec, streamed.as_torch)
                return
            except ATTEMPT_FAILURES as e:  # the call is cancelled below
                error = progress.error_of(e)
            finally:
                first_reply.set()
                call.cancel()  # no-op once the call ended
            await asyncio.sleep(progress.retry_delay(error))

    def _open_stream(self, streamed: StreamedLatents, spec: CallSpec,
                     progress: Progress) -> tuple[Any, asyncio.Event]:
        """One attempt of a whole-video call as a DecodeStream: the head first, the rest once
        `first_reply` is set (`core.StreamedLatents`); a resumed attempt sends everything at
        once, with the frames it skips in its options."""
        first_reply = asyncio.Event()
        attempt: dict[str, Any] = {}  # this attempt's call, for its own request stream

        async def requests(resumed: bool = progress.resumed) -> AsyncIterator[Any]:
            if resumed:
                for message in streamed.all_messages(progress.options(spec.options)):
                    yield message
                return
            yield streamed.first
            if streamed.rest is not None:
                await first_reply.wait()
                if not attempt["call"].done():  # written into an ended call, grpc.aio would report INTERNAL
                    yield streamed.rest_message()

        call = attempt["call"] = self._stub_at(progress.target).DecodeStream(
            requests(), timeout=progress.remaining(), metadata=self._metadata)
        return call, first_reply

    def session(
        self,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
        max_pending: int = 8,
        report: CallReport | None = None,
    ) -> AsyncDecodeSession:
        """Open a DecodeStream session (see `VaeClient.session`); its call starts with the first
        push (or close)."""
        spec = frame_call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                               raw_dtype=raw_dtype, request_id=request_id)
        return AsyncDecodeSession(self, spec, max_pending=max_pending, report=report)


class AsyncDecodeSession(SessionView):
    """A DecodeStream call: `await push()` latent chunks, `async for` frames.

    As `DecodeSession`: pushes go into a `ReplayLog` that the current
    attempt's request stream reads (`push` waits while `max_pending` messages
    wait to be sent), and a background task reads replies into a local queue
    so pushing everything before iterating cannot deadlock; it also resumes
    the session when its server fails. The call starts with the first push (or close).
    """

    def __init__(self, client: AsyncVaeClient, spec: CallSpec, *, max_pending: int = 8,
                 report: CallReport | None = None) -> None:
        self._state = SessionState(spec)
        self._client = client
        self._max_pending = max(1, max_pending)
        self._log = ReplayLog(client.resume.max_replay_bytes)
        self._progress = client._progress(report, spec.options.request_id)
        self.report = self._progress.report
        self._attempt = 0
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: asyncio.Queue[Any] | None = None
        self._changed: asyncio.Event | None = None  # set (and replaced) whenever the log or the attempt moves

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _wait_change(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    async def _start(self) -> Any:
        """Make the reply reader, once; it opens the call at the first push or close (see
        `DecodeSession._first_message_or_close`)."""
        if self._reader is None:
            self._client._stub  # noqa: B018  (binds the client to this loop)
            self._state.info = await self._client._cached_info()  # see SessionState.info
            if self._reader is not None:  # another of this session's tasks started it meanwhile
                return self._call
            self._replies = asyncio.Queue()
            self._changed = asyncio.Event()
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        return self._call

    def _open(self) -> None:
        self._attempt += 1
        self._log.restart()
        options = self._progress.options(self._state.spec.options)
        self._call = self._client._stub_at(self._progress.target).DecodeStream(
            self._requests(self._attempt, options), timeout=self._progress.remaining(),
            metadata=self._client._metadata)
        self._notify()

    async def _requests(self, attempt: int, options: Any) -> AsyncIterator[Any]:
        index = 0
        while True:
            while True:
                if attempt != self._attempt or self._call is None or self._call.done():
                    return
                if index < len(self._log):
                    break
                if self._log.closed:
                    return
                await self._wait_change()
            message = self._log.message(index, options if index == 0 else None)
            self._log.took(index)
            self._notify()
            yield message
            index += 1

    async def _read_replies(self) -> None:
        replies = self._replies
        assert replies is not None
        try:
            while not len(self._log) and not self._log.closed and not self._state.cancelled:
                await self._wait_change()  # the call starts with the first push, or close
            if self._state.cancelled:
                raise CancelledError("session cancelled")
            self._open()
            while True:
                call = self._call
                error: VaedError
                try:
                    self._progress.check_server(await call.initial_metadata())  # before any of its replies
                    async for reply in call:
                        if (reply := self._progress.accept(reply, self._state.format)) is not None:
                            replies.put_nowait(reply)
                    break
                except ATTEMPT_FAILURES as e:
                    call.cancel()  # a refused replica's call (a failed one is over already)
                    error = self._progress.error_of(e)
                await asyncio.sleep(self._progress.retry_delay(error, resumable=self._log.resumable))
                if self._state.cancelled:
                    raise error
                self._open()
            replies.put_nowait(END)
        except VaedError as e:
            replies.put_nowait(self._state.reader_failed(e))
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from reads once the call is cancelled (by the session,
            # or by the client's close, which cancels its channel's calls).
            ended = self._progress.closed_error("its channel closed") or CancelledError("session cancelled")
            replies.put_nowait(self._state.reader_failed(ended))
            if not self._state.cancelled:
                raise
        except BaseException as e:  # keep the consumer from waiting forever
            replies.put_nowait(self._state.reader_failed(VaedError(f"reading replies failed: {e!r}")))
        finally:
            self._notify()

    async def push(self, latents: Any) -> None:
        """Send one latent chunk `[B, z_dim, t, h, w]` (any t >= 1)."""
        self._state.check_push()
        await self._start()
        message = self._state.replay_message(latents)
        while True:
            if self._state.failure is not None:
                raise self._state.failure
            if len(self._log) - self._log.sent < self._max_pending:
                self._log.append(message)
                self._notify()
                # the first push starts the call (on the reader): it has begun when push returns
                while self._call is None and self._reader is not None and not self._reader.done():
                    await self._wait_change()
                return
            if self._reader is not None and self._reader.done():
                raise RuntimeError("session already ended")
            await self._wait_change()

    async def close(self) -> None:
        """Half-close: no more latents; frames still arrive until the end."""
        if self._state.closed:
            return
        self._state.closed = True
        await self._start()
        self._log.closed = True
        self._notify()

    def cancel(self) -> None:
        """Abort the session; the server frees it between chunks."""
        self._state.cancelled = True
        self._state.closed = True
        self._progress.cancelled = True
        self._log.closed = True
        if self._call is not None:
            self._call.cancel()
        self._notify()  # a reader still waiting for the first push ends too

    async def _next_reply(self) -> Any:
        if self._state.error is not None:
            self._state.after_error()
            return None
        await self._start()
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
        assembly = self._state.assembly()
        while (reply := await self._next_reply()) is not None:
            assembly.add(reply)
        return self._state.finish_collect(assembly)

    async def __aenter__(self) -> AsyncDecodeSession:
        await self._start()
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            await self.close()
