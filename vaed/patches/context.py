"""Which op set the patched forwards use for the current call.

One copy of the weights serves every tier: sessions of the lossless and the
fast tier (and a sharded variant) decode side by side through the same
installed forwards. So an installed forward never binds an op set; it reads
the active one from a context variable that the caller sets around each
decoder call (``with using(ops): decoder(...)``), and otherwise the default
chosen at install time, stored on the module. A ContextVar (not a module
global) keeps concurrent callers apart: each thread, and each asyncio task,
sees its own value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from vaed.patches.ops import OpSet

OPS_ATTR = "_vaed_ops"  # the install-time default, set on every patched module

_ACTIVE: ContextVar[OpSet | None] = ContextVar("vaed_active_ops", default=None)


@contextlib.contextmanager
def using(ops: OpSet) -> Iterator[OpSet]:
    """Run the patched forwards with ``ops`` inside this block (this thread / task only)."""
    if not isinstance(ops, OpSet):
        raise TypeError(f"using() needs an OpSet, got {type(ops).__name__}")
    token = _ACTIVE.set(ops)
    try:
        yield ops
    finally:
        _ACTIVE.reset(token)


def current_ops() -> OpSet | None:
    """The op set set by the innermost ``using`` block, or None."""
    return _ACTIVE.get()


def ops_for(module: Any) -> OpSet:
    """The op set a patched forward of ``module`` runs with now."""
    ops = _ACTIVE.get()
    return ops if ops is not None else getattr(module, OPS_ATTR)
