"""Reading GPU kernel times out of a torch.profiler run (shared by the profiling scripts).

torch renamed the per-event device-time fields over releases (``self_cuda_time_total``
-> ``self_device_time_total``; some builds only fill ``device_time``), so each
script asked for them by hand before.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def kernel_events(prof: Any) -> list[Any]:
    """The profiler's GPU-side events (kernels, copies, memsets)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def device_seconds(event: Any) -> float:
    """One GPU event's own device time in seconds (0 when this torch reports none)."""
    value = getattr(event, "self_device_time_total", None)
    if value is None:  # torch before the rename
        value = getattr(event, "self_cuda_time_total", None)
    if not value:  # builds that fill only this one
        value = getattr(event, "device_time", 0.0)
    return float(value or 0.0) / 1e6


def median_seconds(fn: Callable[[], Any], reps: int, cuda: bool, warmup: int = 2) -> float:
    """Median time of ``fn()`` over ``reps`` calls after ``warmup``: CUDA events around each call
    on a GPU (a call shorter than its launch measures the launch), the host clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
