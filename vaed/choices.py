"""Every named choice of the server, each one enum defined here once.

A choice's values are the strings a user types (`vaed serve --kernels off`), a
log line prints and ModelInfo carries, so each enum is a `StrEnum`: a member
*is* its string (`Kernels.OFF == "off"`, `f"{Kernels.OFF}"` is `off`), and the
wire, the CLI and callers that pass plain strings see exactly what they saw
when these were string literals. The CLI's `choices`, the config's validation
and the code's comparisons all read the same members, so adding a value is one
line here.

This module imports nothing from vaed: every layer (kernels, patches, parallel,
the server) may use it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self


class Choice(StrEnum):
    """A StrEnum with the one parse-and-explain helper every choice needs."""

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The accepted strings, in definition order (what `--help` lists)."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls, value: str, what: str) -> Self:
        """`value` as a member; a ValueError naming `what` and the accepted values otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {cls.values()}, got {value!r}") from None


class Precision(Choice):
    """A request's tier. The order is the order ModelInfo offers tiers in (after the default)
    and the code a spatial group's step header carries (the index)."""

    LOSSLESS = "lossless"  # bit-identical to stock diffusers
    FAST = "fast"  # lossy fused norm+SiLU (vaed.patches.fast)


class Kernels(Choice):
    """The fused Triton ops: used when eligible, required (start-up fails without them), or off."""

    AUTO = "auto"
    TRITON = "triton"
    OFF = "off"


class Layout(Choice):
    """The decoder's activation memory layout; auto = channels_last on CUDA, contiguous on CPU."""

    AUTO = "auto"
    CHANNELS_LAST = "channels_last"
    CONTIGUOUS = "contiguous"


class CudaGraphs(Choice):
    """Replay captured decoder calls (vaed.graphs), only each video's first chunk (the first
    frame's kernel launches, where the host is the bound), or run them all eagerly."""

    ON = "on"
    FIRST = "first"
    OFF = "off"


class ConvPlans(Choice):
    """Each tier's convs on cuDNN engines timed per shape (vaed.patches.conv_plans; the lossless
    tier's on engines with torch's bits): replay the choices found in the plan file, also time the
    warm-up shapes it lacks, or torch's pick."""

    CACHED = "cached"
    TUNE = "tune"
    OFF = "off"


class Parallel(Choice):
    """One request per device, or large requests sharded over all devices."""

    OFF = "off"
    SPATIAL = "spatial"


class SpatialAxis(Choice):
    """The axis `--parallel spatial` splits; auto = the longer latent axis (width on ties)."""

    AUTO = "auto"
    HEIGHT = "height"
    WIDTH = "width"


class ComputeDtype(Choice):
    """The decoder's compute dtype (None in the config: bfloat16 on CUDA, float32 on CPU)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class LogLevel(Choice):
    """The least severe log records the server writes."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
