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
import queue
import threading
from typing import Any, Iterator

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
    decode_request,
    format_name,
    prepare_latents,
    stream_latents,
)
from .errors import ClientClosedError, VaedError, from_rpc_error
from .video import DecodedChunk, has_frames

log = logging.getLogger(__name__)

__all__ = ["VaeClient", "DecodeSession", "ModelInfo", "format_name"]


def closed_message(kind: str, target: str, block: str = "with") -> str:
    return (f"this {kind} ({target}) is closed: its `{block}` block ended or close() was called; "
            f"make the calls inside the block, or create a new {kind}")


class VaeClient:
    """Client for a vaed server (or a `dns:///` name of several replicas).

    `timeout` (seconds) is the deadline of each call: one decode, one stream or
    one whole session. `tls`, `tls_server_name`, `tls_client_cert`/`tls_client_key`
    (mutual TLS) and `token` are described in
    `vaed_client.channel`; `options` are extra gRPC channel arguments. A
    target without a port gets vaed's 50051. Calls after `close()` (or after
    the `with` block) raise `ClientClosedError`.
    """

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
        self._channel, self._metadata = create_channel(
            self.target, tls=tls, token=token, options=options, tls_server_name=tls_server_name,
            tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
        )
        self._stub_obj = wire.pb_grpc.VaeDecoderStub(self._channel)
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

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> "VaeClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls -------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        try:
            reply = self._stub.GetModelInfo(wire.pb.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
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
    ) -> Any:
        """Decode latents `[B, z_dim, T, h, w]` (or `[z_dim, T, h, w]`) to the whole video.

        output_type "uint8" (default): `[B, T_out, H, W, 3]`; "raw":
        `[B, 3, T_out, H, W]` in the server's compute dtype or `raw_dtype`
        (numpy gets bf16 as float32); "np" / "pt" / "pil": diffusers' outputs
        (`vaed_client.outputs`). `format="rgb8"|"raw"` is the wire format.
        """
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id)
        prepared = prepare_latents(latents)
        assembly = Assembly(spec, prepared.as_torch, self._cached_info().output_frames(prepared.latent_frames))
        call = self._stub.Decode(decode_request(spec, prepared), timeout=self.timeout, metadata=self._metadata)
        try:
            for reply in call:
                assembly.add(reply)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except BaseException:
            call.cancel()
            raise
        return assembly.result()

    def stream(
        self,
        latents: Any,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> Iterator[DecodedChunk]:
        """Yield DecodedChunks (frames in `output_type`) as the server decodes
        them. Stopping the iteration early (break, close()) cancels the decode
        on the server. Sent as a DecodeStream: the first two latent frames,
        then the rest once the first frame is back, so the first frame waits
        for neither the whole upload nor its traffic (`core.StreamedLatents`)."""
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id)
        streamed = stream_latents(spec, latents)
        gate = _RestGate()
        gate.call = self._stub.DecodeStream(gate.requests(streamed), timeout=self.timeout, metadata=self._metadata)
        return _iterate_chunks(gate.call, spec, streamed.as_torch, gate.opened)

    def session(
        self,
        *,
        output_type: str | None = None,
        format: Any = None,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
        max_pending: int = 8,
    ) -> "DecodeSession":
        """Open a DecodeStream session: push latent chunks, iterate frames."""
        spec = call_spec(output_type=output_type, format=format, raw_latents=raw_latents,
                         raw_dtype=raw_dtype, request_id=request_id)
        return DecodeSession(self, spec, max_pending=max_pending)


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


def _iterate_chunks(call: Any, spec: CallSpec, as_torch: bool, first_reply: threading.Event) -> Iterator[DecodedChunk]:
    try:
        for reply in call:
            chunk = chunk_result(reply, spec, as_torch) if has_frames(reply) else None
            # Opened only now: the rest's upload is serialized on gRPC's request thread
            # (4.2 MB at 480x832x81, holding the GIL), and would hold up this conversion.
            first_reply.set()
            if chunk is not None:
                yield chunk
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    finally:
        call.cancel()  # no-op when the call already ended


class DecodeSession(SessionView):
    """A DecodeStream call: `push()` latent chunks, iterate DecodedChunks.

    Pushes go through a bounded queue (`max_pending` messages) that gRPC
    drains into the request stream, so a producer that outruns the server
    blocks instead of buffering without limit. Replies are read by a
    background thread into an unbounded local queue, so pushing everything
    before iterating cannot deadlock on flow control (the replies land in
    this process's memory — the whole video, as collect() needs anyway).
    """

    def __init__(self, client: VaeClient, spec: CallSpec, *, max_pending: int = 8) -> None:
        self._state = SessionState(spec)
        self._client = client
        self._requests: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._replies: queue.Queue[Any] = queue.Queue()
        self._call = client._stub.DecodeStream(
            self._request_iterator(), timeout=client.timeout, metadata=client._metadata
        )
        self._reader = threading.Thread(target=self._read_replies, name="vaed-session-reader", daemon=True)
        self._reader.start()

    # -- request side ------------------------------------------------------
    def _request_iterator(self) -> Iterator[Any]:
        # Runs on a gRPC thread; the timeout lets it finish when the call
        # ends without a close() (abandoned session, deadline, server error).
        while True:
            try:
                item = self._requests.get(timeout=0.5)
            except queue.Empty:
                call = getattr(self, "_call", None)  # not yet set on the first pull
                if call is not None and call.done():
                    return
                continue
            if item is END:
                return
            yield item

    def push(self, latents: Any) -> None:
        """Send one latent chunk `[B, z_dim, t, h, w]` (any t >= 1)."""
        self._state.check_push()
        chunk = self._state.chunk_message(latents)
        # Block while the queue is full, but wake up if the call dies meanwhile
        # (otherwise a failed call would leave the producer stuck forever).
        while True:
            if self._state.failure is not None:
                raise self._state.failure
            if self._call.done() and not self._reader.is_alive():
                raise RuntimeError("session already ended")
            try:
                self._requests.put(chunk, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Half-close: no more latents; frames still arrive until the end."""
        if not self._state.closed:
            self._state.closed = True
            self._put_end()

    def _put_end(self) -> None:
        while True:
            try:
                self._requests.put(END, timeout=0.1)
                return
            except queue.Full:
                if self._call.done():
                    return

    def cancel(self) -> None:
        """Abort the session; the server frees it between chunks."""
        self._state.cancelled = True
        self._call.cancel()
        if not self._state.closed:
            self._state.closed = True
            self._put_end()

    # -- reply side --------------------------------------------------------
    def _read_replies(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(END)
        except grpc.RpcError as e:
            self._replies.put(self._state.reader_failed(from_rpc_error(e)))
        except BaseException as e:  # keep the consumer from waiting forever
            self._replies.put(self._state.reader_failed(VaedError(f"reading replies failed: {e!r}")))

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
        assembly = self._state.assembly(self._client._cached_info() if self._state.latent_frames else None)
        while (reply := self._next_reply()) is not None:
            assembly.add(reply)
        return self._state.finish_collect(assembly)

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            self.close()
