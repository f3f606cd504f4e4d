"""How long `vaed serve` took to reach SERVING, phase by phase.

A fresh GPU node took 42-66 s to SERVING (H200: Triton compiles every kernel
variant the fused ops use, then the warm-up decodes), 18 s with warm caches.
To see which phase a change or a cache moves, each phase is logged as it
ends ("start-up: model load on cuda:0 took 1.02 s"), and at SERVING one
summary line lists them all with the total; the metrics endpoint exports them
(`vaed_startup_phase_seconds{phase,device}`, `vaed_startup_seconds`).

The phases, in the order a start goes through them:

* ``import``: from the process's start (the interpreter's own start included)
  until torch, gRPC and vaed are imported and the flags read;
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
import os
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


def process_started() -> float:
    """The `time.perf_counter()` reading at which this process started: its start time in
    /proc/self/stat (clock ticks since boot, 10 ms here) against CLOCK_BOOTTIME, which runs with
    the monotonic clock perf_counter reads on a machine that does not suspend. Off Linux: now."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        start_ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()
    return time.perf_counter() - max(0.0, age)


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


# -- Triton's kernel cache ------------------------------------------------------------------------

# Triton reads this variable whenever it looks for a compiled kernel (triton.knobs.cache.dir),
# so setting it before the first compile moves the whole cache.
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
CONV_PLAN_FILE = "vaed-conv-plans.json"  # in the kernel cache directory


def use_kernel_cache(directory: str | None) -> None:
    """Point Triton's cache at `directory` (--kernel-cache) for this process and the processes it
    starts (a sharded group's followers); None leaves $TRITON_CACHE_DIR or Triton's default.
    Raises ValueError when the directory cannot be made or written: Triton would otherwise
    fail at its first compile, inside a worker's start."""
    if directory is None:
        return
    path = os.path.abspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--kernel-cache {directory}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--kernel-cache {directory} is not writable by this process")
    os.environ[TRITON_CACHE_ENV] = path


def kernel_cache_dir(ask_triton: bool = True) -> str | None:
    """The directory Triton reads and writes compiled kernels in: $TRITON_CACHE_DIR when set
    (what Triton reads), else Triton's default when `ask_triton` (importing Triton takes ~0.6 s,
    not worth it for a CPU server, which compiles nothing); None otherwise or without Triton."""
    if os.environ.get(TRITON_CACHE_ENV):
        return os.environ[TRITON_CACHE_ENV]
    if not ask_triton:
        return None
    try:
        from triton import knobs
    except ImportError:
        return None
    return str(knobs.cache.dir)


def conv_plan_file() -> str | None:
    """Where the fast tier's tuned cuDNN conv plans are kept (`vaed.patches.conv_plans`): beside
    Triton's compiled kernels, on the volume `--kernel-cache` names (one cache to mount, warm
    together); None without a cache directory."""
    cache = kernel_cache_dir()
    return os.path.join(cache, CONV_PLAN_FILE) if cache is not None else None


def kernel_cache_entries(directory: str | None) -> int:
    """Compiled kernels in Triton's cache: one directory per kernel (and per launcher), named
    by the hash of its source, signature, GPU target and Triton version; 0 when absent."""
    if directory is None or not os.path.isdir(directory):
        return 0
    return sum(1 for entry in os.scandir(directory) if entry.is_dir())
