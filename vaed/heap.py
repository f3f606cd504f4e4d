"""Keep Python's cyclic garbage collector off the start-up heap.

After start-up a vaed process holds ~470k GC-tracked objects (torch, diffusers,
the decoder's modules: measured with random:wan2.1 loaded). A full collection
walks all of them, ~210 ms on a 2-core development machine, and Python starts
one whenever enough new objects have survived: at a moment no one chooses,
stalling the thread that holds the GIL (a decode step's kernel launches, the
send of a first frame). `gc.freeze()` moves everything alive once the model is
loaded and warm into a generation the collector never scans; objects created
later are collected as before, and frozen ones are still freed by reference
counting. The server unfreezes when it stops (a process that goes on, such as
a test run, gets its cyclic garbage collected again).
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> tuple[int, float]:
    """Collect once, then freeze what survived. Returns (objects frozen, seconds the collection took)."""
    started = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - started
    gc.freeze()
    return gc.get_freeze_count(), seconds


def unfreeze_heap() -> None:
    """Undo `freeze_startup_heap` (a stopping server whose process goes on)."""
    gc.unfreeze()
