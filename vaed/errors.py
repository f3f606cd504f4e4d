"""Domain errors and the one table that turns them into a call's status.

Code below the fronts raises these; `status_for` is the only place that
chooses a status, and the call core (`vaed.calls`) the only caller of it. A
`Status` is named as gRPC's canonical code of the same meaning (the gRPC front
sends `grpc.StatusCode[status.name]`, the log line and the metrics print the
name) and its value is the HTTP status an HTTP front sends for it, so a front
adds no table of its own.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """How a call ended; the value is the matching HTTP status."""

    OK = 200
    INVALID_ARGUMENT = 400
    RESOURCE_EXHAUSTED = 429
    CANCELLED = 499             # the client closed the request (no standard HTTP code; nginx's)
    INTERNAL = 500
    UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504


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


_STATUS: tuple[tuple[type[BaseException], Status], ...] = (
    (InvalidInput, Status.INVALID_ARGUMENT),
    (CapacityExhausted, Status.RESOURCE_EXHAUSTED),
    (NotReady, Status.UNAVAILABLE),
    # A time limit ran out, the input was not wrong: what a client's own timeout would say
    # (the message names the server's flag), and the client library never retries it.
    (ClientIdle, Status.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> Status:
    """The status of an error; anything unknown is INTERNAL (logged, never shown)."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return Status.INTERNAL
