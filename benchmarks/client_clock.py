"""When `decode()` places each reply into its video, on the caller's clock (shared by the client
benchmarks). `CallReport.first_data_seconds` counts from after the call's set-up (~0.5 ms of
latents checks and the head message on a 2-core machine) to a reply's arrival before it is placed;
`stream()`'s first chunk is timed by its caller from before the call to the chunk in hand, so
`decode()`'s first frame is timed the same way: from before the call to the first reply placed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def watch_placements(clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The `clock()` readings after each reply with frames that `decode()` places (every call's,
    in order; clear the list between calls). Wraps `vaed_client.core.Assembly.add` for the rest
    of the process."""
    from vaed_client import core
    from vaed_client.video import has_frames

    placed: list[float] = []
    add = core.Assembly.add

    def timed_add(self: Any, reply: Any) -> None:
        add(self, reply)
        if has_frames(reply):
            placed.append(clock())

    core.Assembly.add = timed_add  # type: ignore[method-assign]
    return placed
