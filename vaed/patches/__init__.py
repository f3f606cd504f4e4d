"""vaed's fast paths on a diffusers Wan decoder, as a table of forwards over op sets.

Layers (Liger-Kernel style: op / module / patch):

* ``vaed.kernels`` -- Triton ops, each beside its plain-torch reference;
* :mod:`.ops` -- :class:`OpSet` bundles: ``REFERENCE_OPS`` (plain torch, what
  stock diffusers runs), ``LOSSLESS_OPS`` (the bit-exact kernels);
  :mod:`.fast` -- ``FAST_OPS`` (the lossy fast tier) and ``LOSSLESS_TILED_OPS``;
* :mod:`.tree` -- diffusers' decoder forwards, written once over an op set
  (one device and spatial shards walk the same bodies);
* :mod:`.forwards` -- the installed forwards: fallback checks, then the tree;
* :mod:`.table` -- which diffusers class gets which forward, using which ops;
* :mod:`.context` -- the op set of the current call (``using``), so tiers
  share one copy of the weights;
* :mod:`.checks`, :mod:`.versions`, :mod:`.installer` -- start-up checks per
  op, the diffusers version guard, and ``prepare_decoder``.

Typical use (the engine)::

    report = prepare_decoder(vae, kernels="auto", layout="auto", tiers=("lossless", "fast"))
    with using(report.ops_for("fast")):  # this call only; other sessions keep theirs
        out = vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=first)
"""

from vaed.choices import Precision
from vaed.patches.context import current_ops, using
from vaed.patches.fast import FAST_OPS, LOSSLESS_TILED_OPS
from vaed.patches.installer import (
    FastPathError,
    FastPathReport,
    installed_report,
    prepare_decoder,
    remove_fast_paths,
)
from vaed.patches.layout import to_decoder_layout
from vaed.patches.ops import (
    LOSSLESS_OPS,
    OP_NAMES,
    REFERENCE_OPS,
    FusedOp,
    NormSilu,
    OpSet,
)
from vaed.patches.table import PATCH_TABLE
from vaed.patches.versions import VERIFIED_DIFFUSERS, diffusers_unverified_reason

# tier -> op set; the first is the default tier
OP_SETS: dict[str, OpSet] = {Precision.LOSSLESS: LOSSLESS_OPS, Precision.FAST: FAST_OPS}

__all__ = [
    "FAST_OPS",
    "LOSSLESS_OPS",
    "LOSSLESS_TILED_OPS",
    "OP_NAMES",
    "OP_SETS",
    "PATCH_TABLE",
    "REFERENCE_OPS",
    "VERIFIED_DIFFUSERS",
    "FastPathError",
    "FastPathReport",
    "FusedOp",
    "NormSilu",
    "OpSet",
    "current_ops",
    "diffusers_unverified_reason",
    "installed_report",
    "prepare_decoder",
    "remove_fast_paths",
    "to_decoder_layout",
    "using",
]
