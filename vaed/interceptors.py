"""Server interceptors that refuse calls before any of their payload is read.

`Refusals` makes handlers that answer a status without reading the request:
they are registered as stream-request with no deserializer (the wire is the
same for a unary request), so a refused 250 MiB Decode costs the server
nothing but the bytes gRPC flow control already let in. Authentication
(`vaed.auth`) and the RPC cap share one instance.

`RpcLimitInterceptor` caps concurrent RPCs (health checks excepted, so
kubelet probes still pass under load); refusals are RESOURCE_EXHAUSTED and
counted through `on_refused`.

`HealthGate` bounds the health service, which needs no token and skips the
RPC cap: at most `limit` health requests are read at once (more get
RESOURCE_EXHAUSTED unread), each read as raw bytes and refused unparsed past
HEALTH_MAX_REQUEST_BYTES. With compression off as well (`vaed.server.grpc_options`),
16 concurrent unauthenticated Checks, gzip bombs inflating to 32 MiB each,
grew a `vaed serve` process by 0 MiB RSS (630 MiB before; three of 200 MiB:
898 MiB, 473 MiB of it kept). An uncompressed request is still received up
to the server's message limit (its sender pays every byte), `limit` at once.

Why not grpc-interceptor's ``AsyncServerInterceptor`` (0.15.4, the base
KServe and TGI use): its ``intercept_service`` (which it says not to
override) re-wraps the next handler with the same kind and the same request
deserializer, and calls ``intercept`` from inside that handler. grpc.aio runs
a unary-request handler only once it has read and parsed the request, so a
refusal raised in ``intercept`` comes after the payload. Measured with a
refusing interceptor on each base, one 32 MiB request per call shape:

=================  ==========================================  ======================
call shape         grpc-interceptor base                       these interceptors
=================  ==========================================  ======================
unary-unary        32 MiB deserialized, then intercept; 0.44 s  nothing read; 0.07 s
unary-stream       32 MiB deserialized, then intercept; 0.18 s  nothing read; 0.05 s
stream-stream      unread (an iterator); 0.06 s                 nothing read; 0.05 s
=================  ==========================================  ======================

Decode is unary-stream and GetModelInfo unary-unary, so that base would read
a refused Decode's whole request (up to 256 MiB) before refusing, and an RPC
slot taken in ``intercept`` would be counted only after the read. Returning
a different handler (``Refusals``, or one served as stream-request so a
rapid reset cannot leak its slot) is what the library's API leaves out, so
the hand-written interceptors stay.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

# How long a refused call waits before its status (see the module docstring's
# table): 0.25 s let 6.4 MB of in-flight grpc.aio writes land in 40 of 40
# calls on loopback; 0.1 s in 36 of 40.
REFUSAL_LINGER_SECONDS = 0.25
# At most this many refusals linger at once; the rest answer at once. A
# lingering stream holds what flow control let in while it waits: with gRPC's
# default BDP-probed windows 6-30 MiB a stream on loopback. 64 concurrent
# refused DecodeStream calls pushing 4 x 16 MiB on one connection grew a
# server by 759 MiB RSS with no cap, by 103-460 MiB with 16 (noisy), and by
# 3 MiB answering at once; with the fixed 4 MiB stream windows the server now
# sets (`vaed.server.STREAM_WINDOW_BYTES`), by 43-112 MiB with or without the cap.
MAX_LINGERING_REFUSALS = 16

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# Largest health request read: a HealthCheckRequest is a service name ("vaed.v1.VaeDecoder/cuda:0"
# is 25 bytes). Bigger ones are refused RESOURCE_EXHAUSTED unparsed; gRPC still receives them
# whole (its message limit is the server's, 256 MiB for Decode), so HealthGate also caps how
# many health requests are read at once.
HEALTH_MAX_REQUEST_BYTES = 4096

Refused = Callable[[str, str], None]  # (method, status code name)


class Refusals:
    """Makes handlers that refuse a call with a status, never reading or parsing its request.

    Each handler is stream-request with no deserializer or serializer: the
    wire does not distinguish a unary request, so it fits any method, and
    grpc.aio hands it an iterator it never advances, so no message is
    requested from the transport. Before its status a refusal lingers
    ``linger`` seconds so a client's in-flight writes complete (see the module
    docstring), unless ``max_lingering`` refusals already linger: then it
    answers at once, which bounds the memory a flood of refused calls holds.
    Share one instance between interceptors so the cap is the server's.
    Handlers run on the server's event loop: the counter needs no lock.
    """

    def __init__(
        self, linger: float = REFUSAL_LINGER_SECONDS, max_lingering: int = MAX_LINGERING_REFUSALS
    ) -> None:
        if linger < 0:
            raise ValueError(f"linger must be >= 0 seconds, got {linger}")
        if max_lingering < 0:
            raise ValueError(f"max_lingering must be >= 0, got {max_lingering}")
        self.linger = linger
        self.max_lingering = max_lingering
        self.lingering = 0  # refusals waiting right now

    async def _wait(self) -> None:
        if self.linger <= 0 or self.lingering >= self.max_lingering:
            return
        self.lingering += 1
        try:
            await asyncio.sleep(self.linger)
        finally:
            self.lingering -= 1

    def handler(self, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
        """A handler for any method that answers ``code`` with ``message``, unread."""

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._wait()
            await context.abort(code, message)

        return grpc.stream_stream_rpc_method_handler(refuse)


def method_name(method: str) -> str:
    """'/vaed.v1.VaeDecoder/Decode' -> 'Decode' (the metrics label)."""
    return method.rsplit("/", 1)[-1] or method


class RpcLimitInterceptor(grpc.aio.ServerInterceptor):
    """At most `limit` RPCs in flight (health excepted); more get RESOURCE_EXHAUSTED unread."""

    def __init__(self, limit: int, on_refused: Refused | None = None, refusals: Refusals | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the RPC limit must be >= 1, got {limit}")
        self.limit = limit
        self._in_flight = 0
        self._lock = threading.Lock()
        self._on_refused = on_refused
        self._refusals = refusals if refusals is not None else Refusals()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED, counted here as `other`
            if self._on_refused is not None:
                self._on_refused(method_name(details.method), grpc.StatusCode.UNIMPLEMENTED.name)
            return None
        if details.method.startswith(HEALTH_PREFIX):
            return handler
        with self._lock:
            admitted = self._in_flight < self.limit
            if admitted:
                self._in_flight += 1
        if not admitted:
            if self._on_refused is not None:
                self._on_refused(method_name(details.method), grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            log.warning("refused %s: %d RPCs in flight (limit %d)", details.method, self.limit, self.limit)
            return self._refusals.handler(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server has {self.limit} calls in flight; retry shortly",
            )
        return self._counted(handler)

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The same handler, releasing its slot when the call's behaviour returns.

        grpc.aio calls a unary-request behaviour only once it has read the
        request: a call cancelled before that (HEADERS then RST_STREAM, the
        rapid-reset pattern) never ran it, so its slot was never released.
        40 000 such resets on one connection leaked every slot: the server then
        answered RESOURCE_EXHAUSTED to all calls until restarted. So every
        handler is served as stream-request here, its behaviour invoked at the
        call's start, and the one request read inside the ``finally``.
        """
        release = self._release
        if not handler.request_streaming:
            handler = _as_stream_request(handler)
        if not handler.response_streaming:
            inner = handler.stream_unary

            async def one_response(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner(requests, context)
                finally:
                    release()

            return handler._replace(stream_unary=one_response)
        behaviour = handler.stream_stream

        async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for message in _relay(behaviour(requests, context)):
                    yield message
            finally:
                release()

        return handler._replace(stream_stream=streaming)


async def _relay(result: Any) -> Any:
    """The messages of a streaming behaviour's result: an async iterator's, or none
    from a coroutine that writes with context.write (awaited to its end)."""
    if hasattr(result, "__aiter__"):
        async for message in result:
            yield message
    else:
        await result


async def _one_request(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    """The single request of a unary-request call, read from its request iterator.

    A call cancelled first raises (or ends the iterator) here, inside the caller's
    ``finally``; a client that half-closes without a message gets INVALID_ARGUMENT.
    A unary client sends one message; later ones are left unread, as grpc.aio does.
    """
    async for request in requests:
        return request
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected one request message, got none")


def _as_stream_request(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A unary-request handler as the stream-request handler that reads its one request."""
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            result = unary_unary(await _one_request(requests, context), context)
            return await result if inspect.isawaitable(result) else result

        return handler._replace(request_streaming=True, unary_unary=None, stream_unary=stream_unary)
    unary_stream = handler.unary_stream

    async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        request = await _one_request(requests, context)
        async for message in _relay(unary_stream(request, context)):
            yield message

    return handler._replace(request_streaming=True, unary_stream=None, stream_stream=stream_stream)


class HealthGate(grpc.aio.ServerInterceptor):
    """At most `limit` health requests read at once, each at most `max_request_bytes`.

    Put it first: health calls skip authentication and the RPC cap, so this is
    all that bounds what an unauthenticated client makes the server read. The
    slot is held while the request is read, not while a Watch streams, so
    probes (a few bytes each) only wait for each other's reads.
    """

    def __init__(
        self, limit: int, max_request_bytes: int = HEALTH_MAX_REQUEST_BYTES, on_refused: Refused | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"the health call limit must be >= 1, got {limit}")
        self.limit = limit
        self.max_request_bytes = max_request_bytes
        self.reading = 0  # event-loop only, as in Refusals
        self._on_refused = on_refused
        self._refusals = Refusals(linger=0)  # a probe sends a few bytes: nothing to wait for

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(HEALTH_PREFIX) or handler.request_streaming:
            return handler
        if self.reading >= self.limit:
            if self._on_refused is not None:
                self._on_refused(method_name(details.method), grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            log.warning("refused %s: %d health requests being read (limit %d)", details.method, self.limit, self.limit)
            return self._refusals.handler(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.limit} health checks are in progress; retry shortly")
        self.reading += 1  # released in `read`, which grpc.aio runs as the call starts
        return self._bounded(handler)

    def _bounded(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler as stream-request over raw bytes: read, size-checked, then parsed."""
        deserialize = handler.request_deserializer
        limit = self.max_request_bytes

        async def read(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                raw = await _one_request(requests, context)
            finally:
                self.reading -= 1
            if len(raw) > limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"a health request has at most {limit} bytes; got {len(raw)}")
            if deserialize is None:
                return raw
            try:
                return deserialize(raw)
            except Exception:  # a malformed message: the client's fault, never a traceback
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed health request")

        if handler.unary_unary is not None:
            check = handler.unary_unary

            async def one_response(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                result = check(await read(requests, context), context)
                return await result if inspect.isawaitable(result) else result

            return handler._replace(request_streaming=True, request_deserializer=None,
                                    unary_unary=None, stream_unary=one_response)
        watch = handler.unary_stream

        async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            result = watch(await read(requests, context), context)
            if hasattr(result, "__aiter__"):
                async for message in result:
                    yield message
            else:  # a coroutine that writes with context.write (grpc's aio HealthServicer.Watch)
                await result

        return handler._replace(request_streaming=True, request_deserializer=None,
                                unary_stream=None, stream_stream=streaming)
