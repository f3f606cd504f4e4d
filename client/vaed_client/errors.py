"""Client-side exceptions: one class per gRPC status the vaed server uses.

Every failed call surfaces as a `VaedError` subclass carrying the status code
(`.code`, a `grpc.StatusCode`) and the server's message (`.details`), so
callers can catch by meaning (`except ResourceExhaustedError: retry later`)
without inspecting grpc internals. The mapping lives here only. Input the
client refuses itself raises `LocalInputError` (code None): it must not read
as if a server had answered INVALID_ARGUMENT. A call on a closed client
raises `ClientClosedError` (code None) instead of grpc's bare ValueError.
"""

from __future__ import annotations

import grpc


class VaedError(Exception):
    """A vaed call failed. Fallback class for codes without a subclass.

    `.code` is the gRPC status the server (or the channel) answered with;
    None only for `LocalInputError`, which never reached a server.
    """

    default_code: grpc.StatusCode | None = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        self.code: grpc.StatusCode | None = code if code is not None else self.default_code
        self.details: str = details
        super().__init__(f"{self.code.name}: {details}" if self.code is not None else details)


class LocalInputError(VaedError, ValueError):
    """This client refused the input before sending anything (unsupported
    dtype or rank, unknown output type, bad option): no server status, code None."""

    default_code = None


class ClientClosedError(VaedError, RuntimeError):
    """A call on a client that was closed (its `with` block ended, or
    `close()` ran): nothing was sent, code None."""

    default_code = None


class InvalidArgumentError(VaedError, ValueError):
    """Bad latents or options (dtype, shape, byte count, z_dim, limits)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhaustedError(VaedError):
    """Sessions full or the server ran out of GPU memory; retrying later can work."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(VaedError):
    """Server unreachable, warming up or draining (after the call's retries and resumes)."""

    default_code = grpc.StatusCode.UNAVAILABLE


class ReplicaMismatchError(UnavailableError):
    """A call could not be finished by a server of the decoder (or encoder) that served its first
    frames: the one it resumed on serves another (other weights, dtype, kernels, layout, ...; the
    message names the parts that differ), and no target serving the first one was left within the
    call's resumes. Its frames are not joined to the first server's. Code UNAVAILABLE: no replica
    that could finish the call was available (a new call starts afresh on one decoder)."""


class UnauthenticatedError(VaedError):
    """Missing or wrong bearer token."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class CancelledError(VaedError):
    """The call was cancelled (by this client or the server)."""

    default_code = grpc.StatusCode.CANCELLED


class DeadlineExceededError(VaedError):
    """The call ran past its `timeout`."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(VaedError):
    """Server-side failure, or a response this client cannot make sense of."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode | None, type[VaedError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgumentError,
        ResourceExhaustedError,
        UnavailableError,
        UnauthenticatedError,
        CancelledError,
        DeadlineExceededError,
        InternalError,
    )
}


def error_class(code: grpc.StatusCode) -> type[VaedError]:
    """The VaedError subclass for a status code (VaedError itself as fallback)."""
    return _BY_CODE.get(code, VaedError)


def from_status(code: grpc.StatusCode, details: str | None) -> VaedError:
    return error_class(code)(details or code.name.lower().replace("_", " "), code)


def from_rpc_error(error: grpc.RpcError) -> VaedError:
    """Map a grpc.RpcError (sync or aio) to the matching VaedError subclass."""
    # grpc.RpcError itself declares no code()/details(); calls that fail carry
    # them (grpc.Call / AioRpcError), bare RpcErrors do not.
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        return VaedError(details or str(error) or "unknown gRPC error")
    return from_status(code, details)


__all__ = [
    "VaedError",
    "LocalInputError",
    "ClientClosedError",
    "InvalidArgumentError",
    "ResourceExhaustedError",
    "UnavailableError",
    "ReplicaMismatchError",
    "UnauthenticatedError",
    "CancelledError",
    "DeadlineExceededError",
    "InternalError",
    "error_class",
    "from_status",
    "from_rpc_error",
]
