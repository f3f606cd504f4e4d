"""Bearer-token authentication and TLS credentials for the gRPC server.

Policy: every RPC needs ``authorization: Bearer <token>`` metadata except the
standard health service (``/grpc.health.v1.Health/*``), which kubelet probes,
load balancers and ``vaed health`` call without credentials. Server
reflection stays protected: it lists the whole API surface, and a tool such
as grpcurl can send the header (``-H 'authorization: Bearer ...'``).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .rpc_streams import drain_requests

logger = logging.getLogger(__name__)

# Name of the environment variable holding the token. It is read only when
# the server starts (read_token), never at import.
AUTH_TOKEN_ENV = "VAED_AUTH_TOKEN"

# Methods under this prefix are reachable without a token.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)

_SCHEME = "bearer"
_MISSING = "missing credentials: send metadata 'authorization: Bearer <token>'"
_MALFORMED = "malformed authorization metadata: expected 'Bearer <token>'"
_WRONG = "invalid bearer token"


def _check(metadata: Any, expected: bytes) -> str | None:
    """None when authorised, else the message for UNAUTHENTICATED."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]
    if not values:
        return _MISSING
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != _SCHEME or not token:
        return _MALFORMED
    # compare_digest on bytes: constant time in the token's content, and it
    # accepts non-ASCII input (it raises TypeError on non-ASCII str).
    if not hmac.compare_digest(token.encode("utf-8"), expected):
        return _WRONG
    return None


def _deny_handler(
    handler: grpc.RpcMethodHandler | None, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts UNAUTHENTICATED.

    Keeping the shape and serializers lets gRPC read the request the usual
    way before the abort; a stream-request call is drained briefly first.
    """

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await drain_requests(requests)  # else grpc.aio clients still writing see INTERNAL
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        # Unknown method: answer UNAUTHENTICATED rather than UNIMPLEMENTED so
        # callers without a token learn nothing about which methods exist.
        return grpc.unary_unary_rpc_method_handler(abort)
    de, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, de, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort_stream, de, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, de, ser)
    return grpc.unary_unary_rpc_method_handler(abort, de, ser)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right bearer token with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        token = token.strip()
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = token.encode("utf-8")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        problem = _check(handler_call_details.invocation_metadata, self._expected)
        handler = await continuation(handler_call_details)
        if problem is None:
            return handler
        # Never log the presented token; the method name is enough to debug.
        logger.info("rejected %s: %s", method, problem)
        return _deny_handler(handler, problem)


def read_token(path: str | None, env_var: str | None = None) -> str | None:
    """The auth token from ``path`` or, when no path is given, from ``env_var``.

    Returns None when neither is configured (auth off). Surrounding whitespace
    (the trailing newline of ``echo`` or a Secret file) is stripped. An empty
    file or an empty-but-set variable raises ValueError: an operator who asked
    for auth must not silently get an open server.
    """
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read auth token file {path!r}: {exc.strerror or exc}") from exc
        if not token:
            raise ValueError(f"auth token file {path!r} is empty")
        return token
    if env_var:
        raw = os.environ.get(env_var)
        if raw is None:
            return None
        token = raw.strip()
        if not token:
            raise ValueError(f"environment variable {env_var} is set but empty")
        return token
    return None


def _read_bytes(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read TLS {what} {path!r}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise ValueError(f"TLS {what} {path!r} is empty")
    return data


def server_credentials(
    cert_path: str, key_path: str, client_ca_path: str | None = None
) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with ``client_ca_path`` clients must present a cert (mTLS)."""
    cert = _read_bytes(cert_path, "certificate")
    key = _read_bytes(key_path, "private key")
    if client_ca_path:
        ca = _read_bytes(client_ca_path, "client CA")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )
    return grpc.ssl_server_credentials([(key, cert)])
