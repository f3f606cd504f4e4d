"""Synchronous vaed client (the blocking front-end over `core`).

    with VaeClient("localhost:50051") as client:
        video = client.decode(latents)                    # [B, T, H, W, 3] uint8
        frames = client.decode(latents, output_type="np") # diffusers' np output
        for chunk in client.stream(latents):              # frames as they decode
            show(chunk.first_frame, chunk.frames)
        with client.session() as session:                 # DecodeStream
            for latent_chunk in generator():
                session.push(latent_chunk)
            video = session.collect()

torch latents give torch results (CPU), numpy latents numpy results, for the
"uint8" and "raw" output types; see `vaed_client.outputs` for np/pt/pil.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import grpc

from . import wire
from .channel import PemSpec, TlsSpec, create_channel, with_default_port
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
    format_name,
    frame_call_spec,
    normalize_latents,
    stream_latents,
)
from .encoding import EncodedAssembly, encode_options, prepare_video, video_chunks
from .errors import CancelledError, ClientClosedError, VaedError
from .mp4 import mp4_output
from .resume import ATTEMPT_FAILURES, CallReport, Progress, ReplayLog, ResumePolicy, Targets, policy_of
from .video import DecodedChunk, has_frames

log = logging.getLogger(__name__)

__all__ = ["VaeClient", "DecodeSession", "ModelInfo", "format_name", "CallReport", "ResumePolicy"]


def target_list(target: str | Sequence[str]) -> list[str]:
    """One target or several (replicas to fail over between), each with vaed's default port."""
    names = [target] if isinstance(target, str) else list(target)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"target must be a non-empty string or a list of them, not {target!r}")
    return [with_default_port(name) for name in names]


def closed_message(kind: str, target: str, block: str = "with") -> str:
    return (f"this {kind} ({target}) is closed: its `{block}` block ended or close() was called; "
            f"make the calls inside the block, or create a new {kind}")


class VaeClient:
    """Client for a vaed server, a `dns:///` name of several replicas, or a list of targets.

    `timeout` (seconds) is the deadline of each call: one decode, one stream or
    one whole session, all its resumes included. `tls`, `tls_server_name`,
    `tls_client_cert`/`tls_client_key` (mutual TLS) and `token` are described in
    `vaed_client.channel`; `options` are extra gRPC channel arguments. A
    target without a port gets vaed's 50051. Calls after `close()` (or after
    the `with` block) raise `ClientClosedError`.

    `resume` (a `ResumePolicy`, True by default, False for never): a call whose
    server fails mid-call is opened again on another target (or the same name)
    and continues where it stopped, every frame exactly once (`vaed_client.resume`).
    """

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
        made = [create_channel(name, tls=tls, token=token, options=options, tls_server_name=tls_server_name,
                               tls_client_cert=tls_client_cert, tls_client_key=tls_client_key)
                for name in self.targets]
        self._channels = [channel for channel, _ in made]
        self._channel, self._metadata = made[0]
        self._stub_objs = [wire.pb_grpc.VaeDecoderStub(channel) for channel in self._channels]
        self._stub_obj = self._stub_objs[0]
        self._closed = False
        self._info: ModelInfo | None = None
        self._info_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------
    @property
    def _stub(self) -> Any:
        """The stub, or ClientClosedError instead of grpc's "Cannot invoke RPC on closed channel!"."""
        if self._closed:
            raise ClientClosedError(closed_message(type(self).__name__, self.target))
        return self._stub_obj

    def _stub_at(self, index: int) -> Any:
        self._stub  # noqa: B018  (raises ClientClosedError once closed)
        return self._stub_objs[index]

    def _progress(self, report: CallReport | None, request_id: str, encoder: bool = False,
                  joins_attempts: bool = True) -> Progress:
        return Progress(self.resume, self._targets, report, self.timeout, request_id, encoder=encoder,
                        client_closed=lambda: self.closed, joins_attempts=joins_attempts)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> VaeClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls -------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        # Each other target is tried once (the channel retries each one itself).
        # GetModelInfo takes no decode's turn (`Targets.first`).
        progress = Progress(ResumePolicy(max_resumes=len(self.targets) - 1), self._targets, None, self.timeout, "",
                            takes_turn=False, client_closed=lambda: self.closed)
        while True:
            try:
                reply = self._stub_at(progress.target).GetModelInfo(
                    wire.pb.ModelInfoRequest(), timeout=progress.remaining(), metadata=self._metadata)
                break
            except grpc.RpcError as e:
                time.sleep(progress.retry_delay(progress.error_of(e)))
        self._info = ModelInfo.from_proto(reply)
        return self._info

    def _cached_info(self) -> ModelInfo:
        # Fetched once per client: decode() needs the temporal factor to
        # preallocate the output; a server's model never changes while it runs.
        with self._info_lock:
            if self._info is None:
                self.model_info()
            assert self._info is not None
            return self._info

    def decode(
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
        """Decode latents `[B, z_dim, T, h, w]` (or `[z_dim, T, h, w]`) to the whole video.

        output_type "uint8" (default): `[B, T_out, H, W, 3]`; "raw":
        `[B, 3, T_out, H, W]` in the server's compute dtype or `raw_dtype`
        (numpy gets bf16 as float32); "np" / "pt" / "pil": diffusers' outputs
        (`vaed_client.outputs`). `format="rgb8"|"raw"` is the wire format.
        "mp4" (batch 1): the server's MP4 file as bytes, or written to `mp4_path` as
        it arrives (the path is returned); `fps`, `crf`, `preset`, `lossless` are its
        options, and a failed server makes it start over on the next (`vaed_client.mp4`).
        `report`: a `CallReport` filled with the call's resumes and why.
        Sent as `stream` sends it (a DecodeStream, two latent frames first), so the first
        frames, and an MP4's first fragment, wait for neither the whole upload nor its traffic.
        """
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id, fps=fps, crf=crf, preset=preset,
                         lossless=lossless)
        latents = normalize_latents(latents)  # LocalInputError before any call, GetModelInfo too
        mp4 = mp4_output(spec.output_type, mp4_path)
        info = self._cached_info()
        streamed = stream_latents(spec, latents, info.compute_dtype)
        assembly = mp4 or Assembly(spec, streamed.as_torch, info.output_frames(streamed.latent_frames))
        # an MP4's attempts each start the file over: nothing of two decoders is joined
        progress = self._progress(report, spec.options.request_id, joins_attempts=mp4 is None)
        try:
            while True:
                gate = self._open_stream(streamed, spec, progress)
                assembly.restart()
                try:
                    # its server's identity before any of its replies (here since the call opened)
                    progress.check_server(gate.call.initial_metadata())
                    for reply in gate.call:
                        if (reply := progress.accept(reply, spec.wire_format)) is not None:
                            assembly.add(reply)
                        gate.opened.set()  # after the first reply is placed (see _iterate_chunks)
                    return assembly.result()
                except ATTEMPT_FAILURES as e:
                    gate.call.cancel()  # a refused replica's call (a failed one is over already)
                    time.sleep(progress.retry_delay(progress.error_of(e)))  # raises when the call ends here
                except BaseException:
                    gate.call.cancel()
                    raise
                finally:
                    gate.opened.set()
        except BaseException:
            assembly.discard()
            raise

    def encode(
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
        """Encode video frames to latents through the server's causal encoder.

        `frames`: float `[B, 3, T, H, W]` in [-1, 1] (float32 / float16 / bfloat16) or uint8
        `[B, T, H, W, 3]` (the batch axis may be left out), T = 1 + 4k. Returns, as a torch
        tensor for torch input (else numpy; bf16 widened to float32), `output_type`
        "moments": `[B, 2 * z_dim, T_lat, h, w]` (mean, then log-variance: what
        `DiagonalGaussianDistribution` takes) or "latents": the normalised latents
        `(mean - latents_mean) / latents_std` as the Wan pipelines compute them, both in
        `out_dtype` (default: the encode's dtype). `encode_dtype` picks the compute dtype among
        ModelInfo.encode_dtypes (default: the first). Frames of zeros at the end are not
        sent (`trailing_zero_frames`) unless `send_zeros`; see `vaed_client.encoding`. A call
        whose server fails is resumed like a decode (`vaed_client.resume`); `report` says how."""
        video = prepare_video(frames, send_zeros=send_zeros)
        options = encode_options(output_type=output_type, out_dtype=out_dtype, precision=precision,
                                 request_id=request_id, zero_frames=video.zero_frames, encode_dtype=encode_dtype)
        assembly = EncodedAssembly(output_type, video.as_torch, wire.encoded_latent_frames(video.total_frames))
        progress = self._progress(report, options.request_id, encoder=True)
        while True:
            call = self._stub_at(progress.target).Encode(video_chunks(video, progress.encode_options(options)),
                                                         timeout=progress.remaining(), metadata=self._metadata)
            try:
                progress.check_server(call.initial_metadata())  # its encoder's identity before its replies
                for reply in call:
                    if (reply := progress.accept_latent(reply)) is not None:
                        assembly.add(reply)
                return assembly.result()
            except ATTEMPT_FAILURES as e:
                call.cancel()  # a refused replica's call (a failed one is over already)
                time.sleep(progress.retry_delay(progress.error_of(e)))  # raises when the call ends here
            except BaseException:
                call.cancel()
                raise

    def stream(
        self,
        latents: Any,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
        report: CallReport | None = None,
    ) -> ChunkStream:
        """Yield DecodedChunks (frames in `output_type`) as the server decodes
        them. Stopping the iteration early cancels the decode on the server:
        close(), leaving a `with client.stream(...) as chunks:` block, or
        dropping the iterator, even before its first next() (a `break` out of
        `for chunk in client.stream(...)` drops it; one held in a variable
        after the break needs close() or the with block: Python tells an
        iterator nothing of a break). Sent as a DecodeStream: the first two latent frames,
        then the rest once the first frame is back, so the first frame waits
        for neither the whole upload nor its traffic (`core.StreamedLatents`).
        A resumed attempt sends everything at once (its first frames are skipped)."""
        spec = frame_call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                               raw_dtype=raw_dtype, request_id=request_id)
        latents = normalize_latents(latents)  # LocalInputError before any call, GetModelInfo too
        streamed = stream_latents(spec, latents, self._cached_info().compute_dtype)
        progress = self._progress(report, spec.options.request_id)
        # The call starts here, not at the first next(): the decode runs while the caller sets up.
        current = _CurrentAttempt(self._open_stream(streamed, spec, progress))
        return ChunkStream(self._resumed_chunks(spec, streamed, progress, current), current)

    def _open_stream(self, streamed: StreamedLatents, spec: CallSpec, progress: Progress) -> _RestGate:
        """One attempt of a whole-video call as a DecodeStream: the head first and the rest at
        the first reply (`core.StreamedLatents`); a resumed attempt sends everything at once,
        with the frames it skips in its options."""
        gate = _RestGate()
        requests = (iter(streamed.all_messages(progress.options(spec.options))) if progress.resumed
                    else gate.requests(streamed))
        gate.call = self._stub_at(progress.target).DecodeStream(
            requests, timeout=progress.remaining(), metadata=self._metadata)
        return gate

    def _resumed_chunks(self, spec: CallSpec, streamed: StreamedLatents, progress: Progress,
                        current: _CurrentAttempt) -> Generator[DecodedChunk, None, None]:
        while True:
            gate = current.gate
            try:
                yield from _iterate_chunks(gate.call, spec, streamed.as_torch, gate.opened, progress)
                return
            except ATTEMPT_FAILURES as e:  # _iterate_chunks ended its call
                time.sleep(progress.retry_delay(progress.error_of(e)))
            current.gate = self._open_stream(streamed, spec, progress)

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
    ) -> DecodeSession:
        """Open a DecodeStream session: push latent chunks, iterate frames. The session keeps
        its pushed latents to replay them if its server fails (`ResumePolicy.max_replay_bytes`).
        Its call starts with the first push (or close), so a generator may open the session well
        before its first latents: the server's --session-first-message-timeout counts from there."""
        spec = frame_call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                               raw_dtype=raw_dtype, request_id=request_id)
        return DecodeSession(self, spec, max_pending=max_pending, report=report)


class _CurrentAttempt:
    """The gate of a stream's current attempt (a resume opens another): shared by its chunk
    generator and its `ChunkStream`, which would form a cycle if the generator held the stream."""

    def __init__(self, gate: _RestGate) -> None:
        self.gate = gate


class ChunkStream(Iterator[DecodedChunk]):
    """What `VaeClient.stream` returns: its DecodeStream is open before the first `next()`, so
    `close()`, and dropping the iterator, cancel that call even when it was never iterated (a
    generator closed before its first `next()` runs none of its code: the server would hold the
    session until its idle timeout, and a `--max-sessions` slot with it)."""

    def __init__(self, chunks: Generator[DecodedChunk, None, None], current: _CurrentAttempt) -> None:
        self._chunks: Generator[DecodedChunk, None, None] | None = chunks
        self._current = current

    def __next__(self) -> DecodedChunk:
        if self._chunks is None:
            raise StopIteration
        return next(self._chunks)

    def close(self) -> None:
        """Stop iterating and cancel the call on the server (a no-op once it ended)."""
        chunks, self._chunks = self._chunks, None
        if chunks is not None:
            chunks.close()
        call = self._current.gate.call
        if call is not None:
            call.cancel()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class _RestGate:
    """Holds a stream's rest (`StreamedLatents.rest`) until its first reply arrives."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.call: Any = None  # set right after the call is made

    def requests(self, streamed: StreamedLatents) -> Iterator[Any]:
        # Runs on a gRPC thread; polls so that it ends with a call that ends first.
        yield streamed.first
        if streamed.rest is None:
            return
        while not self.opened.wait(0.5):
            if self.call is not None and self.call.done():
                return
        if self.call is None or not self.call.done():
            yield streamed.rest_message()


def _iterate_chunks(call: Any, spec: CallSpec, as_torch: bool, first_reply: threading.Event,
                    progress: Progress | None = None) -> Iterator[DecodedChunk]:
    """The chunks of one attempt; its RpcError (or ReplicaMismatchError: its server's identity is
    checked first) propagates (the caller decides on a resume)."""
    try:
        if progress is not None:
            progress.check_server(call.initial_metadata())
        for reply in call:
            if progress is not None:
                reply = progress.accept(reply, spec.wire_format)
            chunk = chunk_result(reply, spec, as_torch) if reply is not None and has_frames(reply) else None
            # Opened only now: the rest's upload is serialized on gRPC's request thread
            # (4.2 MB at 480x832x81, holding the GIL), and would hold up this conversion.
            first_reply.set()
            if chunk is not None:
                yield chunk
    finally:
        first_reply.set()
        call.cancel()  # no-op when the call already ended


class DecodeSession(SessionView):
    """A DecodeStream call: `push()` latent chunks, iterate DecodedChunks.

    Pushed messages go into the session's `ReplayLog`, which the current
    attempt's request stream reads from; `push` blocks while `max_pending`
    messages wait to be sent, so a producer that outruns the server blocks
    instead of buffering without limit. Replies are read by a background
    thread into an unbounded local queue, so pushing everything before
    iterating cannot deadlock on flow control (the replies land in this
    process's memory — the whole video, as collect() needs anyway). That
    thread also resumes the session when its server fails: it opens the call
    again and the new request stream replays the log from its first message.
    `report` (a `CallReport`) says how often it resumed and why.
    """

    def __init__(self, client: VaeClient, spec: CallSpec, *, max_pending: int = 8,
                 report: CallReport | None = None) -> None:
        client._stub  # noqa: B018  (a closed client says so here, as before the call started later)
        self._state = SessionState(spec)
        self._state.info = client._cached_info()
        self._client = client
        self._max_pending = max(1, max_pending)
        self._log = ReplayLog(client.resume.max_replay_bytes)
        self._cond = threading.Condition()
        self._replies: queue.Queue[Any] = queue.Queue()
        self._progress = client._progress(report, spec.options.request_id)
        self.report = self._progress.report
        self._attempt = 0
        self._call: Any = None
        self._reader = threading.Thread(target=self._read_replies, name="vaed-session-reader", daemon=True)
        self._reader.start()

    def _open(self) -> None:
        """Start an attempt: a new call whose request stream reads the log from message 0."""
        with self._cond:
            self._attempt += 1
            self._log.restart()
            attempt = self._attempt
            # gRPC reads the new request stream on its own thread before DecodeStream returns:
            # the failed attempt's call, done, would end that stream after its replay
            self._call = None
        options = self._progress.options(self._state.spec.options)
        call = self._client._stub_at(self._progress.target).DecodeStream(
            self._request_iterator(attempt, options), timeout=self._progress.remaining(),
            metadata=self._client._metadata)
        with self._cond:
            self._call = call
            self._cond.notify_all()
        if self._state.cancelled:  # cancel() ran while no call was there to cancel
            call.cancel()

    # -- request side ------------------------------------------------------
    def _request_iterator(self, attempt: int, options: Any) -> Iterator[Any]:
        # Runs on a gRPC thread; the timed wait lets it finish when its call ends without a
        # close() (abandoned session, deadline, server error) or a newer attempt took over.
        index = 0
        while True:
            with self._cond:
                while True:
                    if attempt != self._attempt:
                        return
                    if index < len(self._log):
                        break
                    if self._log.closed:
                        return
                    if self._call is not None and self._call.done():
                        return
                    self._cond.wait(0.5)
                message = self._log.message(index, options if index == 0 else None)
                self._log.took(index)
                self._cond.notify_all()
            yield message
            index += 1

    def push(self, latents: Any) -> None:
        """Send one latent chunk `[B, z_dim, t, h, w]` (any t >= 1)."""
        self._state.check_push()
        message = self._state.replay_message(latents)
        # Block while max_pending messages wait, but wake up if the session dies meanwhile
        # (otherwise a failed call would leave the producer stuck forever).
        with self._cond:
            while True:
                if self._state.failure is not None:
                    raise self._state.failure
                if len(self._log) - self._log.sent < self._max_pending:
                    self._log.append(message)
                    self._cond.notify_all()
                    # the first push starts the call (on the reader): it has begun when push returns
                    while self._call is None and self._state.failure is None and self._reader.is_alive():
                        self._cond.wait(0.1)
                    return
                if not self._reader.is_alive():
                    raise RuntimeError("session already ended")
                self._cond.wait(0.1)

    def close(self) -> None:
        """Half-close: no more latents; frames still arrive until the end."""
        self._state.closed = True
        with self._cond:
            self._log.closed = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """Abort the session; the server frees it between chunks."""
        self._state.cancelled = True
        self._progress.cancelled = True
        self.close()
        with self._cond:
            call = self._call
        if call is not None:
            call.cancel()

    # -- reply side --------------------------------------------------------
    def _first_message_or_close(self) -> bool:
        """Wait for the first push (or close): the call starts then, not when the session is made
        (a DiT's first chunk can take longer than the server's first-message timeout, 10 s, and
        an open call holds a session slot). False: cancelled first."""
        with self._cond:
            while not len(self._log) and not self._log.closed and not self._state.cancelled:
                self._cond.wait(0.5)
            return not self._state.cancelled

    def _read_replies(self) -> None:
        try:
            if not self._first_message_or_close():
                raise CancelledError("session cancelled")
            self._open()
            while True:
                with self._cond:
                    call = self._call
                try:
                    self._progress.check_server(call.initial_metadata())  # before any of its replies
                    for reply in call:
                        if (reply := self._progress.accept(reply, self._state.format)) is not None:
                            self._replies.put(reply)
                    break
                except ATTEMPT_FAILURES as e:
                    call.cancel()  # a refused replica's call (a failed one is over already)
                    error = self._progress.error_of(e)
                delay = self._progress.retry_delay(error, resumable=self._log.resumable)
                time.sleep(delay)
                if self._state.cancelled:
                    raise error
                self._open()
            self._replies.put(END)
        except VaedError as e:
            self._replies.put(self._state.reader_failed(e))
        except BaseException as e:  # keep the consumer from waiting forever
            self._replies.put(self._state.reader_failed(VaedError(f"reading replies failed: {e!r}")))
        finally:
            with self._cond:
                self._cond.notify_all()

    def _next_reply(self) -> Any:
        """Next reply message, None at the end; raises the call's error."""
        if self._state.error is not None:
            self._state.after_error()
            return None
        reply, put_back = self._state.take(self._replies.get())
        if put_back:
            self._replies.put(END)
        return reply

    def __iter__(self) -> Iterator[DecodedChunk]:
        while (reply := self._next_reply()) is not None:
            chunk = self._state.chunk(reply)
            if chunk is not None:
                yield chunk

    def collect(self) -> Any:
        """Close and return the whole video (chunks not taken by iteration)."""
        self._state.start_collect()
        self.close()
        assembly = self._state.assembly()
        while (reply := self._next_reply()) is not None:
            assembly.add(reply)
        return self._state.finish_collect(assembly)

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            self.close()
