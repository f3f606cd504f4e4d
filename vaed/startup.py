"""How long `vaed serve` took to reach SERVING, phase by phase.

A fresh GPU node took 42-66 s to SERVING (H200: Triton compiles every kernel
variant the fused ops use, then the warm-up decodes), 18 s with warm caches.
To see which phase a change or a cache moves, each phase is logged as it
ends ("start-up: model load on cuda:0 took 1.02 s"), and at SERVING one
summary line lists them all with the total; the metrics endpoint exports them
(`vaed_startup_phase_seconds{phase,device}`, `vaed_startup_seconds`).

The phases, in the order a start goes through them:

* ``import``: torch, gRPC and vaed imported, from `vaed serve`'s entry (the
  interpreter's own start, before it, is not counted);
* per device: ``cuda init`` (the device's context and copy stream),
  ``model load`` (weights built or read, moved to the device), ``fast paths``
  (weight layout, the fused forwards installed and every fused op's start-up
  bit-identity check: the first Triton compiles happen here), ``warm-up HxW``
  (each warm-up shape decoded to its steady chunk in every tier: the
  per-shape Triton compiles and cuDNN plan choices);
* ``gc freeze`` (`vaed.heap`), once the devices are ready.

Devices start in parallel (one thread each), so the total is not the sum.

Device phases are timed where they happen (`vaed.models`, `vaed.engine`, the
worker) through `phase`, which records into the recorder its thread was given
(`recording`): the engine factory, the models and the installer are shared
with `vaed bench` and the tests, which record nothing, so no recorder is
threaded through their signatures.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    device: str = ""  # "" = the process's own phase (import, gc freeze)


class StartupTimes:
    """The phases of one server's start, recorded from any thread, in the order they ended."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started  # perf_counter() of the start
        self._lock = threading.Lock()
        self._phases: list[Phase] = []

    def add(self, name: str, seconds: float, device: str = "", *, logged: bool = True) -> None:
        """Record a phase; a name seen before on the same device adds up (e.g. `fast paths` of the
        decoder and of an encoder copy). `logged=False` for a phase its own line already reports."""
        with self._lock:
            for i, p in enumerate(self._phases):
                if p.name == name and p.device == device:
                    self._phases[i] = Phase(name, p.seconds + seconds, device)
                    break
            else:
                self._phases.append(Phase(name, seconds, device))
        if logged:
            log.info("start-up: %s%s took %.2f s", name, f" on {device}" if device else "", seconds)

    @contextlib.contextmanager
    def timed(self, name: str, device: str = "") -> Iterator[None]:
        """Record the time the `with` body takes (also when it raises: a failed start is timed too)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started, device)

    @property
    def phases(self) -> list[Phase]:
        with self._lock:
            return list(self._phases)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def summary(self, total: float | None = None) -> str:
        """One line: the total, then every phase in order, each device's grouped where its first
        phase ended ("import 3.10 s, cuda:0 [model load 1.02 s, ...], gc freeze 0.21 s")."""
        total = self.elapsed() if total is None else total
        phases = self.phases
        parts: list[str] = []
        shown: set[str] = set()
        for p in phases:
            if not p.device:
                parts.append(f"{p.name} {p.seconds:.2f} s")
            elif p.device not in shown:
                shown.add(p.device)
                inner = ", ".join(f"{q.name} {q.seconds:.2f} s" for q in phases if q.device == p.device)
                parts.append(f"{p.device} [{inner}]")
        return f"start-up took {total:.2f} s to SERVING: " + ", ".join(parts)


_current = threading.local()


@contextlib.contextmanager
def recording(times: StartupTimes, device: str) -> Iterator[None]:
    """Phases timed on this thread (`phase`) inside the block are `device`'s in `times`."""
    previous = getattr(_current, "target", None)
    _current.target = (times, device)
    try:
        yield
    finally:
        _current.target = previous


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time one start-up phase of this thread's device; outside `recording` (bench, tests,
    a sharded group's follower processes) it only runs the block."""
    target = getattr(_current, "target", None)
    if target is None:
        yield
        return
    times, device = target
    with times.timed(name, device):
        yield
