"""Bearer-token authentication and TLS credentials for the gRPC server.

Policy: every RPC needs ``authorization: Bearer <token>`` metadata except the
standard health service (``/grpc.health.v1.Health/*``), which kubelet probes,
load balancers and ``vaed health`` call without credentials. Server
reflection stays protected: it lists the whole API surface, and a tool such
as grpcurl can send the header (``-H 'authorization: Bearer ...'``).

A refused call is answered without receiving or parsing its payload. The
interceptor decides on the metadata alone and returns a ``Refusals`` handler:
registered as stream-request with no deserializer, so grpc.aio issues no read
before (or after) the handler runs and nothing is parsed; the wire does not
distinguish a unary request, so it fits every method. What the server holds
for a refused call is what HTTP/2 flow control already let in for its stream,
whatever the client sends: four concurrent unauthenticated 250 MiB Decode
calls grew a `vaed serve` process by 2.7 GB RSS when the refusal still read
the request, and now by 25 MB (four DecodeStream calls pushing 4 x 250 MiB
each: 5 MB).

Known, unknown and malformed calls get the same handler, so without a token
every method answers alike (UNAUTHENTICATED, same delay): methods cannot be
probed, and a malformed payload is never looked at.

The refusal lingers briefly before its status. A grpc.aio client that is
still writing when the stream closes reports INTERNAL ("Internal error from
Core") instead of the server's status: its failed write overwrites the status
(``set_internal_error``). Measured on loopback, 40 grpc.aio DecodeStream-style
calls per case, without a token:

    client writes before reading   abort at once   after 0.1 s    after 0.25 s
    8 x 10 B                       22 INTERNAL     0              0
    4 x 400 kB                     32 INTERNAL     0              0
    16 x 400 kB (6.4 MB)           35 INTERNAL     4 INTERNAL     0

Unary-request calls and sync clients got UNAUTHENTICATED every time either
way. Reading the stream to its half-close (what the old refusal did) also
fixes it, but reads payload without bound; lingering reads nothing, lets the
client's in-flight writes complete into the flow-control window, and costs
each refused call 0.25 s (the same for every method, so the delay tells
nothing either). A lingering stream holds its flow-control window, so at
most MAX_LINGERING_REFUSALS linger at once and the rest answer at once. A
grpc.aio client that writes far past the window before it reads, or is
refused during a flood, can still see INTERNAL.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .interceptors import Refusals, method_name

logger = logging.getLogger(__name__)

# Methods under this prefix are reachable without a token.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)

# on_refused(method, code_name): method is the last part of the path
# ("Decode"), code_name a grpc.StatusCode name ("UNAUTHENTICATED").
RefusedCallback = Callable[[str, str], None]

_SCHEME = "bearer"
# Where vaed's own clients take the token from (vaed_client.channel.read_token).
_HOW = ("the client commands (vaed-client decode/encode/info, vaed decode/info) take --token-file FILE "
        "or $VAED_AUTH_TOKEN, VaeClient(..., token=...) in Python")
_MISSING = (
    f"missing credentials: this server requires a bearer token ('authorization: Bearer <token>' metadata); {_HOW}"
)
_MALFORMED = f"malformed authorization metadata: expected 'Bearer <token>'; {_HOW}"
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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer token with UNAUTHENTICATED, unread.

    Put it first among the server's interceptors: a refused call never
    reaches the next one (no RPC slot taken, no handler looked up), and
    ``on_refused(method, "UNAUTHENTICATED")`` is called once per refusal so
    the server can count it (a callback that raises is logged, never fatal).
    """

    def __init__(
        self,
        token: str,
        on_refused: RefusedCallback | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        token = token.strip()
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = token.encode("utf-8")
        self._on_refused = on_refused
        self._refusals = refusals if refusals is not None else Refusals()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        problem = _check(handler_call_details.invocation_metadata, self._expected)
        if problem is None:
            return await continuation(handler_call_details)
        # Never log the presented token; the method (repr: it is the
        # client's string) is enough to debug.
        logger.info("refused %r: %s", method, problem)
        if self._on_refused is not None:
            try:
                self._on_refused(method_name(method), grpc.StatusCode.UNAUTHENTICATED.name)
            except Exception:
                logger.warning("on_refused callback failed", exc_info=True)
        return self._refusals.handler(grpc.StatusCode.UNAUTHENTICATED, problem)


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
    """TLS credentials from PEM files; with ``client_ca_path`` clients must present a cert (mTLS).
    ValueError, naming the files, for ones that are not a PEM certificate and its private key (or
    a PEM CA): gRPC refuses them only as it binds, which read as an address problem."""
    cert = _read_bytes(cert_path, "certificate")
    key = _read_bytes(key_path, "private key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # no password: gRPC takes no encrypted key, and OpenSSL would ask for one on the terminal
        context.load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-cert {cert_path!r} and --tls-key {key_path!r} are not a PEM certificate and "
                         f"its unencrypted private key ({exc.reason or exc})") from None
    if client_ca_path:
        ca = _read_bytes(client_ca_path, "client CA")
        try:
            context.load_verify_locations(cafile=client_ca_path)
        except ssl.SSLError as exc:
            raise ValueError(f"--tls-client-ca {client_ca_path!r} holds no PEM certificate ({exc.reason or exc})"
                             ) from None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )
    return grpc.ssl_server_credentials([(key, cert)])
