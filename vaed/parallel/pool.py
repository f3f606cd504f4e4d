"""The GPU pool: one device worker per GPU behind one port.

Admission happens here, once for the whole server: a call takes a session
slot (`admit`) before its payload is read, and the slot goes back when the
session closes. An admitted session goes to the least-loaded healthy worker
(fewest sessions, then fewest pending latent frames, then device order). A
worker whose start-up failed, or whose device faulted later, leaves rotation;
the server keeps serving while one worker is healthy.

One process, one thread per GPU: a steady 480x832 chunk is ~62 ms of GPU time
and a few ms of host-side launches, so the GIL is not what bounds two GPUs
(measured through the client with four concurrent 480p sessions; see the
README's multi-GPU figures).
"""

from __future__ import annotations

import threading
from typing import Callable

from ..errors import CapacityExhausted, NotReady
from ..metrics import DeviceLoad
from ..session import Session
from ..worker import DeviceWorker


class SessionSlot:
    """A taken admission slot; `release` is idempotent."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class WorkerPool:
    def __init__(self, workers: list[DeviceWorker], max_sessions: int) -> None:
        if not workers:
            raise ValueError("a pool needs at least one device worker")
        self.workers = workers
        self.max_sessions = max_sessions
        self._sessions = 0
        self._lock = threading.Lock()
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
        """Take a session slot or raise CapacityExhausted; nothing of the call is read yet."""
        with self._lock:
            if self._sessions >= self.max_sessions:
                raise CapacityExhausted(f"all {self.max_sessions} decode sessions are in use; retry shortly")
            self._sessions += 1
        return SessionSlot(self._release_slot)

    @property
    def admitted(self) -> int:
        """Calls holding a session slot (attached to a worker or about to be)."""
        with self._lock:
            return self._sessions

    def _release_slot(self) -> None:
        with self._lock:
            self._sessions -= 1

    def attach(self, session: Session) -> DeviceWorker:
        """Give the session to the least-loaded healthy worker."""
        candidates = [(w.load(), i, w) for i, w in enumerate(self.workers) if w.healthy]
        if not candidates:
            raise NotReady("no device is serving; see the server log")
        _, _, worker = min(candidates, key=lambda c: (c[0].active_sessions, c[0].pending_latent_frames, c[1]))
        worker.attach(session)
        return worker

    def device_loads(self) -> list[DeviceLoad]:
        return [w.load() for w in self.workers]

    @property
    def active_sessions(self) -> int:
        return sum(load.active_sessions for load in self.device_loads())

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        """An engine of a healthy worker (model facts are the same on every device)."""
        for worker in self.workers:
            if worker.healthy and worker.engine is not None:
                return worker.engine
        return None
