"""Which diffusers releases the ported forwards were verified against.

:mod:`vaed.patches.tree` mirrors private diffusers forwards line for line, for
both of its callers: the installed forwards of a one-device decode and the
sharded decode. A release that changes one of them would make either differ
from stock. Outside the verified range the installer patches nothing (the
stock decoder serves) and spatial sharding is refused
(``vaed.parallel.forward.check_shardable``), each saying why.

Range: 0.38.x - 0.42.x. Tested (CPU reference equality, H200 bit-exactness)
on 0.42.1. Read against the diffusers history: the ported decoder forwards
(WanCausalConv3d, WanRMS_norm, WanResample, WanResidualBlock, WanMidBlock,
WanUpBlock, WanResidualUpBlock, DupUp3D, WanDecoder3d) have the same bodies
from 0.38.0 through 0.42.1 (later changes are return annotations and
docstrings only). The encoder's (WanEncoder3d, WanResample's downsample2d /
downsample3d branches, WanResidualDownBlock, AvgDown3D, and
AutoencoderKLWan._encode's loop: frame 0, then four at a time) were ported
from 0.42.1 and read against 0.38.0: the same bodies (AvgDown3D's __init__
turned an assert into a ValueError, same arithmetic); the CPU tests compare
them with the installed release's own encode. WanMidBlock's body (resnet, then attention + resnet pairs)
was read in 0.38.0, 0.39.0, 0.40.0, 0.42.1 and a later snapshot of the main
branch: the same lines in all.
WanUpBlock's body (its resnets, then its upsampler) was read in 0.42.1 and in
an earlier snapshot of diffusers' main branch; the two differ only in passing
the cache by keyword or by position.
0.37 and older normalize bf16/fp16 activations without the fp32 upcast that
0.38 added to WanRMS_norm ("Stabilize low-precision custom autoencoder RMS
normalization"), which the fused norm prologue reproduces -- so they are out.
"""

from __future__ import annotations

import re

# [low, high] as (major, minor), both included; patch releases within are trusted
VERIFIED_DIFFUSERS: tuple[tuple[int, int], tuple[int, int]] = ((0, 38), (0, 42))


def installed_diffusers_version() -> str | None:
    """diffusers.__version__ read at call time (tests monkeypatch it), or None when unimportable."""
    try:
        import diffusers
    except Exception:  # a broken install counts as "not verified"
        return None
    return str(getattr(diffusers, "__version__", "")) or None


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def diffusers_unverified_reason(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed one) is in the verified range, else why not."""
    v = installed_diffusers_version() if version is None else version
    lo, hi = VERIFIED_DIFFUSERS
    want = f"{lo[0]}.{lo[1]}.x-{hi[0]}.{hi[1]}.x"
    if v is None:
        return "diffusers version unknown; fused forwards are verified for diffusers " + want
    mm = _major_minor(v)
    if mm is None or not lo <= mm <= hi:
        return (
            f"diffusers {v} is outside the versions the fused forwards were verified with ({want}); "
            "serving the stock decoder"
        )
    return None
