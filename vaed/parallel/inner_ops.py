"""The one-device op set a shard starts from, by the `kernels` choice.

A sharded decode runs the same data movement as a one-GPU decode, only on a
shard (`vaed.parallel.forward.shard_ops` adds the halo exchange), so it takes
the decoder's own op sets (`vaed.patches.ops.OpSet`) and the fused Triton
kernels keep working on shards. `ATEN_OPS` is the patches' plain-torch op set
(`REFERENCE_OPS`), op for op what stock diffusers runs: used with
`kernels="off"`, and beside the fused set as its reference.
"""

from __future__ import annotations

from vaed.choices import Kernels
from vaed.patches.ops import LOSSLESS_OPS, REFERENCE_OPS, OpSet

# The stock diffusers chains (no kernels): the patches' plain-torch op set, one copy.
ATEN_OPS = REFERENCE_OPS


def resolve_inner_ops(kernels: str = Kernels.AUTO) -> OpSet:
    """The op set shards run with: "off" -> plain torch; "auto"/"triton" -> the lossless op set
    (Triton, per-call fallback to its reference)."""
    return ATEN_OPS if Kernels.parse(kernels, "kernels") == Kernels.OFF else LOSSLESS_OPS
