"""Domain errors and the one table that turns them into gRPC status codes.

Code below the service raises these; `status_for` is the only place that
chooses a status code, and `vaed.service` the only caller of it.
"""

from __future__ import annotations

import grpc


class VaedServerError(Exception):
    """Base class: the message is safe to show to the caller."""


class InvalidInput(VaedServerError):
    """Bad dtype, shape, byte count, z_dim, non-finite values, empty or over-limit input, malformed message."""


class CapacityExhausted(VaedServerError):
    """Sessions or RPC slots full, or the GPU ran out of memory; retry later."""


class NotReady(VaedServerError):
    """Warming up, draining, or no healthy device left."""


class ClientIdle(VaedServerError):
    """The client sent no message within a session timeout; its slot is freed."""


class ModelLoadError(VaedServerError):
    """Weights could not be found or loaded."""


class ShardGroupError(RuntimeError):
    """The sharded group failed (a rank died or a collective timed out); it serves nothing more.

    Not a caller-facing error: the device worker answers it with NotReady. It lives here,
    not in vaed.parallel, so that the worker below the pool needs nothing from that package."""


_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    # A time limit ran out, the input was not wrong: what a client's own timeout would say
    # (the message names the server's flag), and the client library never retries it.
    (ClientIdle, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of an error; anything unknown is INTERNAL (logged, never shown)."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL
