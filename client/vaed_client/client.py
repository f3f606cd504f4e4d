"""Synchronous vaed client.

    with VaeClient("localhost:50051") as client:
        video = client.decode(latents)               # [B, T, H, W, 3] uint8
        for chunk in client.stream(latents):         # frames as they decode
            show(chunk.first_frame, chunk.frames)
        with client.session() as session:            # DecodeStream
            for latent_chunk in generator():
                session.push(latent_chunk)
            video = session.collect()

torch latents give torch results (CPU), numpy latents numpy results.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import grpc

from . import tensors
from ._proto import vaed_pb2, vaed_pb2_grpc
from .channel import TlsSpec, create_channel
from .errors import CancelledError, InvalidArgumentError, VaedError, from_rpc_error
from .video import RAW, RGB8, DecodedChunk, VideoAssembler, has_frames, output_frames, to_chunk

log = logging.getLogger(__name__)

_FORMATS = {RGB8: vaed_pb2.RGB8, RAW: vaed_pb2.RAW}


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
    kernels: str = ""
    layout: str = ""

    @classmethod
    def from_proto(cls, message: vaed_pb2.ModelInfo) -> "ModelInfo":
        return cls(
            model=message.model,
            z_dim=message.z_dim,
            scale_factor_temporal=message.scale_factor_temporal,
            scale_factor_spatial=message.scale_factor_spatial,
            latents_mean=list(message.latents_mean),
            latents_std=list(message.latents_std),
            compute_dtype=tensors.DTYPE_NAMES.get(message.compute_dtype, "") if message.compute_dtype else "",
            device=message.device,
            random_weights=message.random_weights,
            max_message_bytes=message.max_message_bytes,
            max_latent_frames=message.max_latent_frames,
            max_pixels=message.max_pixels,
            kernels=message.kernels,
            layout=message.layout,
        )

    def output_frames(self, latent_frames: int) -> int:
        """Frames decoded from `latent_frames` latent frames (1 + 4*(T-1) for Wan)."""
        return output_frames(latent_frames, self.scale_factor_temporal or 4)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dtype_value(dtype: Any) -> int:
    """'bfloat16' / torch.bfloat16 / np.float32 / a DataType value -> DataType value."""
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name not in tensors.WIRE_DTYPE_BY_NAME:
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except Exception:  # not a numpy-understood dtype either
            pass
    if name not in tensors.WIRE_DTYPE_BY_NAME:
        raise InvalidArgumentError(f"unknown raw_dtype {dtype!r}; use float32, float16 or bfloat16")
    return tensors.WIRE_DTYPE_BY_NAME[name]


def format_name(fmt: Any) -> str:
    """'rgb8' / 'raw' (any case) or an OutputFormat value -> 'rgb8' / 'raw'."""
    if isinstance(fmt, int):
        return RAW if fmt == vaed_pb2.RAW else RGB8
    name = str(fmt).lower()
    if name not in _FORMATS:
        raise InvalidArgumentError(f"unknown format {fmt!r}; use 'rgb8' or 'raw'")
    return name


def build_options(
    fmt: str, raw_latents: bool, raw_dtype: Any, request_id: str | None
) -> vaed_pb2.DecodeOptions:
    # The server rejects a raw_dtype it can't produce (e.g. uint8); pass it on
    # so the caller gets the server's message rather than a second opinion.
    return vaed_pb2.DecodeOptions(
        format=_FORMATS[format_name(fmt)],
        raw_dtype=_dtype_value(raw_dtype) if raw_dtype is not None else vaed_pb2.DATA_TYPE_UNSPECIFIED,
        raw_latents=bool(raw_latents),
        request_id=request_id or "",
    )


def encode_latents(latents: Any) -> tuple[vaed_pb2.Tensor, bool, int | None]:
    """latents -> (wire tensor, whether they were torch, latent frames T or None)."""
    as_torch = tensors._is_torch(latents)
    try:
        message = tensors.to_message(latents)
    except tensors.TensorFormatError as e:
        raise InvalidArgumentError(str(e)) from None
    shape = list(message.shape)
    # Rank problems are the server's to report; T is only a size hint here.
    return message, as_torch, int(shape[2]) if len(shape) == 5 else None


class VaeClient:
    """Client for a vaed server (or a `dns:///` name of several replicas).

    `timeout` (seconds) is the deadline of each call: one decode, one stream or
    one whole session. `tls` and `token` are described in `vaed_client.channel`.
    """

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
        self._channel, self._metadata = create_channel(target, tls=tls, token=token, options=options)
        self._stub = vaed_pb2_grpc.VaeDecoderStub(self._channel)
        self._info: ModelInfo | None = None
        self._info_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "VaeClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls -------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        try:
            reply = self._stub.GetModelInfo(
                vaed_pb2.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        info = ModelInfo.from_proto(reply)
        self._info = info
        return info

    def _cached_info(self) -> ModelInfo:
        # Fetched once per client: decode() needs the temporal factor to
        # preallocate the output; a server's model never changes while it runs.
        with self._info_lock:
            if self._info is None:
                self.model_info()
            assert self._info is not None
            return self._info

    def _decode_call(self, latents: Any, options: vaed_pb2.DecodeOptions) -> tuple[Any, bool, int | None]:
        message, as_torch, t = encode_latents(latents)
        call = self._stub.Decode(
            vaed_pb2.DecodeRequest(latents=message, options=options),
            timeout=self.timeout,
            metadata=self._metadata,
        )
        return call, as_torch, t

    def decode(
        self,
        latents: Any,
        *,
        format: str = RGB8,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> Any:
        """Decode latents `[B, z_dim, T, h, w]` to the whole video.

        RGB8: `[B, T_out, H, W, 3]` uint8. RAW: `[B, 3, T_out, H, W]` in the
        server's compute dtype or `raw_dtype` (numpy gets bf16 as float32).
        """
        fmt = format_name(format)
        options = build_options(fmt, raw_latents, raw_dtype, request_id)
        info = self._cached_info()
        call, as_torch, t = self._decode_call(latents, options)
        assembler = VideoAssembler(fmt, info.output_frames(t) if t else None)
        try:
            for reply in call:
                assembler.add(reply)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except BaseException:
            call.cancel()
            raise
        return assembler.result(as_torch)

    def stream(
        self,
        latents: Any,
        *,
        format: str = RGB8,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
    ) -> Iterator[DecodedChunk]:
        """Yield DecodedChunks as the server decodes them. Stopping the
        iteration early (break, close()) cancels the decode on the server."""
        fmt = format_name(format)
        options = build_options(fmt, raw_latents, raw_dtype, request_id)
        call, as_torch, _ = self._decode_call(latents, options)
        return _iterate_chunks(call, fmt, as_torch)

    def session(
        self,
        *,
        format: str = RGB8,
        raw_latents: bool = False,
        raw_dtype: Any = None,
        request_id: str | None = None,
        max_pending: int = 8,
    ) -> "DecodeSession":
        """Open a DecodeStream session: push latent chunks, iterate frames."""
        fmt = format_name(format)
        options = build_options(fmt, raw_latents, raw_dtype, request_id)
        return DecodeSession(self, fmt, options, max_pending=max_pending)


def _iterate_chunks(call: Any, fmt: str, as_torch: bool) -> Iterator[DecodedChunk]:
    try:
        for reply in call:
            if has_frames(reply):
                yield to_chunk(reply, fmt, as_torch)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    finally:
        call.cancel()  # no-op when the call already ended


_END = object()


class DecodeSession:
    """A DecodeStream call: `push()` latent chunks, iterate DecodedChunks.

    Pushes go through a bounded queue (`max_pending` messages) that gRPC
    drains into the request stream, so a producer that outruns the server
    blocks instead of buffering without limit. Replies are read by a
    background thread into an unbounded local queue, so pushing everything
    before iterating cannot deadlock on flow control (the replies land in
    this process's memory — the whole video, as collect() needs anyway).
    """

    def __init__(
        self,
        client: VaeClient,
        fmt: str,
        options: vaed_pb2.DecodeOptions,
        *,
        max_pending: int = 8,
    ) -> None:
        self.format = fmt
        self.request_id = options.request_id
        self._options: vaed_pb2.DecodeOptions | None = options
        self._as_torch: bool | None = None
        self._latent_frames = 0
        self._client = client
        self._requests: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._replies: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._cancelled = False
        self._iterated = False
        self._error: VaedError | None = None  # seen by the consumer
        self._failure: VaedError | None = None  # set by the reader thread
        self._call = client._stub.DecodeStream(
            self._request_iterator(), timeout=client.timeout, metadata=client._metadata
        )
        self._reader = threading.Thread(target=self._read_replies, name="vaed-session-reader", daemon=True)
        self._reader.start()

    # -- request side ------------------------------------------------------
    def _request_iterator(self) -> Iterator[vaed_pb2.LatentChunk]:
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
            if item is _END:
                return
            yield item

    def push(self, latents: Any) -> None:
        """Send one latent chunk `[B, z_dim, t, h, w]` (any t >= 1)."""
        if self._closed:
            raise RuntimeError("push() after close() or cancel()")
        message, as_torch, t = encode_latents(latents)
        if self._as_torch is None:
            self._as_torch = as_torch
        chunk = vaed_pb2.LatentChunk(latents=message)
        if self._options is not None:  # options travel on the first message only
            chunk.options.CopyFrom(self._options)
            self._options = None
        self._latent_frames += t or 0
        # Block while the queue is full, but wake up if the call dies meanwhile
        # (otherwise a failed call would leave the producer stuck forever).
        while True:
            if self._failure is not None:
                raise self._failure
            if self._call.done() and not self._reader.is_alive():
                raise RuntimeError("session already ended")
            try:
                self._requests.put(chunk, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Half-close: no more latents; frames still arrive until the end."""
        if not self._closed:
            self._closed = True
            self._put_end()

    def _put_end(self) -> None:
        while True:
            try:
                self._requests.put(_END, timeout=0.1)
                return
            except queue.Full:
                if self._call.done():
                    return

    def cancel(self) -> None:
        """Abort the session; the server frees it between chunks."""
        self._cancelled = True
        self._call.cancel()
        if not self._closed:
            self._closed = True
            self._put_end()

    # -- reply side --------------------------------------------------------
    def _read_replies(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(_END)
        except grpc.RpcError as e:
            self._failure = from_rpc_error(e)
            self._replies.put(self._failure)
        except BaseException as e:  # keep the consumer from waiting forever
            self._failure = VaedError(f"reading replies failed: {e!r}")
            self._replies.put(self._failure)

    def _next_reply(self) -> vaed_pb2.FrameChunk | None:
        """Next reply message, None at the end; raises the call's error."""
        if self._error is not None:
            if self._cancelled:
                return None
            raise self._error
        item = self._replies.get()
        if item is _END:
            self._replies.put(_END)  # later calls see the end too
            return None
        if isinstance(item, VaedError):
            self._error = item
            self._replies.put(_END)
            if self._cancelled:
                return None  # the caller asked for it: end quietly
            raise item
        if item.request_id:
            self.request_id = item.request_id
        return item

    def __iter__(self) -> Iterator[DecodedChunk]:
        while True:
            reply = self._next_reply()
            if reply is None:
                return
            if has_frames(reply):
                self._iterated = True
                yield to_chunk(reply, self.format, bool(self._as_torch))

    def collect(self) -> Any:
        """Close and return the whole video (chunks not taken by iteration)."""
        if self._iterated:
            raise RuntimeError(
                "collect() after iterating the session: assemble the chunks with vaed_client.video.assemble()"
            )
        self.close()
        expected = self._client._cached_info().output_frames(self._latent_frames) if self._latent_frames else None
        assembler = VideoAssembler(self.format, expected)
        while (reply := self._next_reply()) is not None:
            assembler.add(reply)
        if self._cancelled:
            raise self._error or CancelledError("session cancelled by the client")
        return assembler.result(bool(self._as_torch))

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            self.close()
