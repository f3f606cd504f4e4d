"""The GPU pool: one device worker per GPU behind one port.

Admission happens here, once for the whole server: a call takes a session
slot (`admit`) before its payload is read, and the slot goes back when the
session closes. A slot goes to the least-loaded healthy worker (fewest slots,
then fewest pending latent frames, then device order) and counts in that
worker's load (`vaed_active_sessions`) from admission on: a call still
waiting for its first message holds a slot, so it is load an operator and
the router must see. Its session is attached to the slot's worker. A
worker whose start-up failed, or whose device faulted later, leaves rotation;
the server keeps serving while one worker is healthy.

One process, one thread per GPU: a steady 480x832 chunk is ~62 ms of GPU time
and a few ms of host-side launches, so the GIL is not what bounds two GPUs
(measured through the client with four concurrent 480p sessions; see the
README's multi-GPU figures).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from ..engine_protocol import Engine
from ..errors import CapacityExhausted, NotReady
from ..metrics import DeviceLoad
from ..session import Session
from ..worker import DeviceWorker


class SessionSlot:
    """A taken admission slot on one worker (`index` in the pool); `release` is idempotent."""

    def __init__(self, index: int, release: Callable[[SessionSlot], None]) -> None:
        self.index = index
        self._release = release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release(self)


class WorkerPool:
    def __init__(self, workers: list[DeviceWorker], max_sessions: int) -> None:
        if not workers:
            raise ValueError("a pool needs at least one device worker")
        self.workers = workers
        self.max_sessions = max_sessions
        # Slots held per worker, admission to release; their sum is the admitted count.
        # Not a BoundedSemaphore: admission picks the least-loaded worker from these counts
        # in the same critical section that takes the slot, and the gauges read them, so a
        # semaphore beside them would be a second count to keep equal (its value is private).
        self._slots = [0] * len(workers)
        self._lock = threading.Lock()  # the counts above; taken before no other lock
        self.on_change: Callable[[], None] | None = None  # a worker left rotation (called on its thread)

    # -- lifecycle ---------------------------------------------------------------

    def start(self, on_ready: Callable[[], None]) -> None:
        """Start every worker; `on_ready` runs (on a worker thread) once all have finished starting."""
        remaining = [len(self.workers)]
        lock = threading.Lock()

        def one_ready() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                on_ready()

        for worker in self.workers:
            worker.on_ready = one_ready
            worker.on_fault = self._changed
            worker.start()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return all(worker.wait_ready(timeout) for worker in self.workers)

    @property
    def started(self) -> bool:
        return all(worker.started for worker in self.workers)

    @property
    def healthy_workers(self) -> list[DeviceWorker]:
        return [w for w in self.workers if w.healthy]

    @property
    def ready(self) -> bool:
        """Every worker finished starting and at least one serves."""
        return self.started and bool(self.healthy_workers)

    @property
    def startup_error(self) -> BaseException | None:
        """The first start-up error, when no worker is healthy."""
        if not self.started or self.healthy_workers:
            return None
        return next((w.startup_error for w in self.workers if w.startup_error is not None), None)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()

    # -- sessions ------------------------------------------------------------------

    def admit(self) -> SessionSlot:
        """Take a session slot on the least-loaded worker or raise CapacityExhausted; nothing of
        the call is read yet."""
        pending = [w.load().pending_latent_frames for w in self.workers]  # worker locks, not under ours
        healthy = [i for i, w in enumerate(self.workers) if w.healthy] or list(range(len(self.workers)))
        with self._lock:
            if sum(self._slots) >= self.max_sessions:
                raise CapacityExhausted(
                    f"all {self.max_sessions} sessions are in use (decode and encode calls); retry shortly")
            index = min(healthy, key=lambda i: (self._slots[i], pending[i], i))
            self._slots[index] += 1
        return SessionSlot(index, self._release_slot)

    @property
    def admitted(self) -> int:
        """Calls holding a session slot (attached to a worker or about to be)."""
        with self._lock:
            return sum(self._slots)

    def _release_slot(self, slot: SessionSlot) -> None:
        with self._lock:
            self._slots[slot.index] -= 1

    def attach(self, session: Session, slot: SessionSlot) -> DeviceWorker:
        """Give the session to its slot's worker; if that one left rotation since admission, move
        the slot to the least-loaded healthy worker."""
        if not self.workers[slot.index].healthy:
            healthy = [i for i, w in enumerate(self.workers) if w.healthy]
            if not healthy:
                raise NotReady("no device is serving; see the server log")
            with self._lock:
                index = min(healthy, key=lambda i: (self._slots[i], i))
                self._slots[slot.index] -= 1
                self._slots[index] += 1
                slot.index = index
        worker = self.workers[slot.index]
        worker.attach(session)
        return worker

    def device_loads(self) -> list[DeviceLoad]:
        """Each worker's load; its sessions are the slots it holds, attached or not yet."""
        loads = [w.load() for w in self.workers]
        with self._lock:
            slots = list(self._slots)
        return [dataclasses.replace(load, active_sessions=n) for load, n in zip(loads, slots, strict=True)]

    @property
    def active_sessions(self) -> int:
        return sum(load.active_sessions for load in self.device_loads())

    @property
    def engine(self) -> Engine | None:
        """An engine of a healthy worker (model facts are the same on every device)."""
        for worker in self.workers:
            if worker.healthy and worker.engine is not None:
                return worker.engine
        return None
