"""Server interceptors that refuse calls before any of their payload is read.

`refusing_handler` answers a status without reading the request: it is
registered as stream-request with no deserializer (the wire is the same for a
unary request), so a refused 250 MiB Decode costs the server nothing but the
bytes gRPC flow control already let in.

`RpcLimitInterceptor` caps concurrent RPCs (health checks excepted, so
kubelet probes still pass under load); refusals are RESOURCE_EXHAUSTED and
counted through `on_refused`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"

Refused = Callable[[str, str], None]  # (method, status code name)


def refusing_handler(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that aborts with `code` at once and never reads or parses the request."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


def method_name(method: str) -> str:
    """'/vaed.v1.VaeDecoder/Decode' -> 'Decode' (the metrics label)."""
    return method.rsplit("/", 1)[-1] or method


class RpcLimitInterceptor(grpc.aio.ServerInterceptor):
    """At most `limit` RPCs in flight (health excepted); more get RESOURCE_EXHAUSTED unread."""

    def __init__(self, limit: int, on_refused: Refused | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the RPC limit must be >= 1, got {limit}")
        self.limit = limit
        self._in_flight = 0
        self._lock = threading.Lock()
        self._on_refused = on_refused

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        with self._lock:
            admitted = self._in_flight < self.limit
            if admitted:
                self._in_flight += 1
        if not admitted:
            if self._on_refused is not None:
                self._on_refused(method_name(details.method), grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            log.warning("refused %s: %d RPCs in flight (limit %d)", details.method, self.limit, self.limit)
            return refusing_handler(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server has {self.limit} calls in flight; retry shortly",
            )
        return self._counted(handler)

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The same handler, releasing its slot when the call's behaviour returns."""
        release = self._release
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                finally:
                    release()

            return handler._replace(unary_unary=unary_unary)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_su(requests, context)
                finally:
                    release()

            return handler._replace(stream_unary=stream_unary)
        behaviour = handler.unary_stream or handler.stream_stream
        field = "unary_stream" if handler.unary_stream is not None else "stream_stream"

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                result = behaviour(request, context)
                if hasattr(result, "__aiter__"):
                    async for message in result:
                        yield message
                else:  # a coroutine that writes with context.write
                    await result
            finally:
                release()

        return handler._replace(**{field: streaming})
