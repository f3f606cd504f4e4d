"""Domain errors. The service maps them to gRPC status codes in one place
(`vaed.service.status_for`); nothing else chooses a status code."""

from __future__ import annotations


class VaedServerError(Exception):
    """Base class: message is safe to show to the caller."""


class InvalidInput(VaedServerError):
    """Bad dtype, shape, byte count, z_dim, empty or over-limit input."""


class CapacityExhausted(VaedServerError):
    """Sessions full or the GPU ran out of memory; retry later."""


class NotReady(VaedServerError):
    """Warming up or draining."""


class ModelLoadError(VaedServerError):
    """Weights could not be found or loaded."""
