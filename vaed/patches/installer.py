"""prepare_decoder / remove_fast_paths: put the patch table on one VAE instance (decoder, and encoder when loaded).

Order of decisions, each logged and kept in the :class:`FastPathReport`:

1. weight layout (always applied; it is not a patch, values are unchanged);
2. diffusers version guard -- outside the verified range nothing is patched
   and ``report.stock_reason`` says why;
3. op sets per tier ("lossless" first = the default the forwards use outside
   a ``using`` block): tiers that need Triton are dropped when it cannot run
   (CPU without the interpreter, no triton, ``kernels="off"``); per-op
   switch-offs (``disabled_ops``) and start-up check failures swap single ops
   for their references; an exact tier whose convs' biases cannot be left to
   their readers bit for bit keeps them in the convs;
4. the table's forwards are bound on the instance, with the default op set.

Installing is idempotent (a second call starts from a clean instance) and
leaves the state_dict and parameter names as they were. ``kernels="triton"``
turns every "could not" above into :class:`FastPathError`.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from vaed.choices import Kernels, Layout, Precision
from vaed.kernels import _runtime as rt
from vaed.patches.checks import check_bias_deferral, check_op_set
from vaed.patches.context import OPS_ATTR
from vaed.patches.layout import convert_conv3d_weights, resolve_layout, vae_parts
from vaed.patches.ops import OP_NAMES, OpSet
from vaed.patches.table import row_for
from vaed.patches.versions import diffusers_unverified_reason

if TYPE_CHECKING:  # pragma: no cover
    # the defining module: for type checkers diffusers' top-level name is its torch-less dummy
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

log = logging.getLogger(__name__)

_MARK = "_vaed_fast_path"  # set on every module whose forward we replaced
_REPORT = "_vaed_fast_path_report"


class FastPathError(RuntimeError):
    """Explicitly requested fast paths cannot be installed or run."""


@dataclass(frozen=True)
class FastPathReport:
    kernels: Kernels  # TRITON when Triton ops are installed, else OFF
    layout: Layout  # CHANNELS_LAST or CONTIGUOUS
    installed: tuple[str, ...]  # human-readable list of what was installed
    skipped: tuple[str, ...]  # what was skipped and why
    ops: str = "stock"  # name of the default op set the forwards use ("stock": none installed)
    disabled_ops: tuple[str, ...] = ()  # ops running their reference: flag or failed check
    stock_reason: str | None = None  # why the stock decoder serves (version guard), else None
    op_sets: dict[str, OpSet] = field(default_factory=dict)  # usable tier -> checked op set

    @property
    def summary(self) -> str:
        """One line for logs and ModelInfo."""
        if self.stock_reason is not None:
            return f"stock decoder ({self.stock_reason}); layout={self.layout}"
        tiers = ",".join(self.op_sets) or "none"
        s = f"ops={self.ops} tiers={tiers} kernels={self.kernels} layout={self.layout}"
        if self.disabled_ops:
            s += f" disabled={','.join(self.disabled_ops)}"
        return s

    def ops_for(self, tier: str) -> OpSet:
        """The checked op set of a tier, for ``patches.using``; KeyError names the usable ones."""
        try:
            return self.op_sets[tier]
        except KeyError:
            raise KeyError(f"tier {tier!r} is not available; usable tiers: {sorted(self.op_sets)}") from None


def _kernel_reason(kernels: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if kernels == Kernels.OFF:
        return "disabled (--kernels off)"
    if not rt.triton_available():
        return "triton is not importable"
    if device.type != "cuda" and not (device.type == "cpu" and kernels == Kernels.TRITON and rt.interpreter_active()):
        return f"decoder is on {device.type}, kernels need CUDA"
    if dtype not in rt.SUPPORTED_DTYPES:
        return f"unsupported dtype {dtype}"
    return None


def _resolve_tiers(
    tiers: Iterable[str], ops: OpSet | None
) -> list[tuple[str, OpSet]]:
    if ops is not None:
        return [(ops.name, ops)]
    from vaed.patches import (
        OP_SETS,  # the registry lives in the package (fast tier included)
    )

    out = []
    for t in tiers:
        if t not in OP_SETS:
            raise ValueError(f"unknown tier {t!r}; known: {', '.join(OP_SETS)}")
        out.append((t, OP_SETS[t]))
    if not out:
        raise ValueError("tiers must name at least one op set")
    return out


def prepare_decoder(
    vae: AutoencoderKLWan,
    *,
    kernels: str = Kernels.AUTO,
    layout: str = Layout.AUTO,
    disabled_ops: Iterable[str] = frozenset(),
    tiers: Iterable[str] = (Precision.LOSSLESS,),
    ops: OpSet | None = None,
) -> FastPathReport:
    """Set the decoder's weight layout and install the table's forwards (idempotent).

    ``tiers`` names the op sets to prepare (``OP_SETS`` keys); the first is
    the default. ``ops`` installs that one op set instead (e.g.
    ``REFERENCE_OPS``: the ported forwards over plain torch, for tests).
    ``disabled_ops`` switches single ops (``OP_NAMES``) to their references
    in every tier.
    """
    kernels = Kernels.parse(kernels, "kernels")
    disabled = frozenset(disabled_ops)
    unknown = disabled - set(OP_NAMES)
    if unknown:
        raise ValueError(f"unknown op names in disabled_ops: {sorted(unknown)}; known: {', '.join(OP_NAMES)}")
    wanted = _resolve_tiers(tiers, ops)
    param = next(vae_parts(vae)[0].parameters())  # an encoder-only copy has no decoder
    device, dtype = param.device, param.dtype
    lay = resolve_layout(layout, device)
    n_conv = convert_conv3d_weights(vae, lay)
    remove_fast_paths(vae)  # idempotent: a second call re-installs from a clean state
    installed = [f"{lay} Conv3d weights ({n_conv})"]

    stock_reason = diffusers_unverified_reason()
    if stock_reason is not None:
        if kernels == Kernels.TRITON:
            raise FastPathError(f"--kernels triton requested but unavailable: {stock_reason}")
        log.warning("fast paths: %s", stock_reason)
        stock = FastPathReport(Kernels.OFF, lay, tuple(installed), (stock_reason,), stock_reason=stock_reason)
        return _finish(vae, stock)

    skipped: list[str] = []
    usable: dict[str, OpSet] = {}
    off_ops: set[str] = set(disabled)
    k_reason = _kernel_reason(kernels, device, dtype)
    for tier, opset in wanted:
        if opset.uses_triton and k_reason is not None:
            if kernels == Kernels.TRITON:
                raise FastPathError(f"--kernels triton requested but unavailable: {k_reason}")
            skipped.append(f"fused kernels: {k_reason}" if tier == wanted[0][0] else f"tier {tier}: {k_reason}")
            continue
        masked = opset.without(disabled & set(opset.differs_from_reference()))
        failed = check_op_set(masked, device, dtype)
        if failed and kernels == Kernels.TRITON:
            raise FastPathError(f"--kernels triton requested but start-up checks failed: {failed}")
        for name, why in failed.items():
            skipped.append(f"{tier} {name}: start-up check failed ({why})")
        off_ops |= set(failed)
        checked = masked.without(frozenset(failed))
        if checked.exact and checked.defer_bias and device.type == "cuda":
            bias_why = check_bias_deferral(device, dtype)
            if bias_why is not None:
                if kernels == Kernels.TRITON:
                    raise FastPathError(f"--kernels triton requested but start-up checks failed: {bias_why}")
                log.warning("op set %s: conv biases stay in their convs: %s", checked.name, bias_why)
                skipped.append(f"{tier} deferred conv biases: start-up check failed ({bias_why})")
                checked = dataclasses.replace(checked, defer_bias=frozenset())
        usable[tier] = checked
    for name in sorted(disabled):
        skipped.append(f"{name}: disabled by flag")

    default_tier = wanted[0][0]
    if default_tier not in usable:
        if kernels == Kernels.AUTO:
            log.info("fast paths: layout=%s, kernels off (%s)", lay, k_reason)
        off = FastPathReport(Kernels.OFF, lay, tuple(installed), tuple(skipped), disabled_ops=tuple(sorted(disabled)))
        return _finish(vae, off)
    default = usable[default_tier]
    counts = _install(vae, default)
    installed += [f"{label} ({n})" for label, n in counts.items() if n]
    report = FastPathReport(
        kernels=Kernels.TRITON if default.uses_triton else Kernels.OFF,
        layout=lay,
        installed=tuple(installed),
        skipped=tuple(skipped),
        ops=default_tier,
        disabled_ops=tuple(n for n in OP_NAMES if n in off_ops),
        op_sets=usable,
    )
    log.info("fast paths: %s; installed %s", report.summary, "; ".join(installed))
    return _finish(vae, report)


def _finish(vae: nn.Module, report: FastPathReport) -> FastPathReport:
    setattr(vae, _REPORT, report)
    return report


def _install(vae: nn.Module, default: OpSet) -> dict[str, int]:
    counts: dict[str, int] = {}
    for root in vae_parts(vae):
        for m in root.modules():
            row = row_for(m)
            if row is None:
                continue
            m.forward = types.MethodType(row.forward, m)
            setattr(m, OPS_ATTR, default)
            setattr(m, _MARK, True)
            counts[row.label] = counts.get(row.label, 0) + 1
    return counts


def installed_report(vae: nn.Module) -> FastPathReport | None:
    """The report of the last prepare_decoder on this instance, if any."""
    return getattr(vae, _REPORT, None)


def remove_fast_paths(vae: nn.Module) -> None:
    """Restore the stock forwards (weight layout is left as it is; values are unchanged)."""
    for m in vae.modules():
        if getattr(m, _MARK, False):
            if "forward" in m.__dict__:
                del m.forward
            delattr(m, _MARK)
            if OPS_ATTR in m.__dict__:
                delattr(m, OPS_ATTR)
    if hasattr(vae, _REPORT):
        delattr(vae, _REPORT)
