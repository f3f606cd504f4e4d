"""The device worker: one thread owns every CUDA call for one device.

gRPC handlers (asyncio) hand latent chunks to a `WorkItem` and receive decoded
groups through the item's asyncio queue. The thread round-robins over items
one decoder call (one latent frame) at a time, so concurrent sessions share
the GPU fairly and a long video never blocks a short one for long.

Backpressure: each item holds `queue_chunks` credits; decoding a group takes
one, the handler gives it back after the group's messages are sent. A slow
client therefore stalls only its own session and never piles frames up in
GPU or host memory.

Overlap: each group is copied to pinned host memory on a side stream; a
delivery thread waits for the copy and hands the host tensor to the event
loop, while this thread already launches the next decoder call.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import ServerConfig
from .engine import DecodedGroup, DecodeEngine, DecodeSession, OutputSpec
from .errors import CapacityExhausted, VaedServerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostGroup:
    """A decoded group in host memory, ready to serialize."""

    chunk_index: int
    first_frame: int
    frames: torch.Tensor     # CPU tensor (pinned on CUDA)
    last: bool               # no more groups follow for this call
    decode_seconds: float    # device time of this decoder call, as the worker saw it


class EndOfOutput:
    """Queued after the last group when the input ended before it was known to be last."""


@dataclass(eq=False)
class WorkItem:
    """One call's share of the worker: its session, input backlog and output queue."""

    output: OutputSpec
    loop: asyncio.AbstractEventLoop
    results: asyncio.Queue
    credits: threading.Semaphore
    id: int = field(default_factory=itertools.count().__next__)
    inbox: collections.deque = field(default_factory=collections.deque)  # CPU latent chunks
    input_done: bool = False
    closed: bool = False
    session: DecodeSession | None = None
    busy: bool = False        # the worker is inside a step of this item
    end_sent: bool = False    # the last group, an EndOfOutput or an error was delivered

    def deliver(self, value: Any) -> None:
        """Thread-safe put into the handler's queue (dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.results.put_nowait, value)
        except RuntimeError:  # loop closed: the caller is gone
            pass


class DeviceWorker:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[ServerConfig], DecodeEngine] | None = None):
        self.config = config
        self._engine_factory = engine_factory or DecodeEngine.load
        self.engine: DecodeEngine | None = None
        self._lock = threading.Condition()
        self._items: collections.deque[WorkItem] = collections.deque()
        self._stopping = False
        self._ready = threading.Event()
        self.startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"vaed-worker-{config.device}", daemon=True)
        self._copies: queue.Queue = queue.Queue()
        self._delivery = threading.Thread(target=self._deliver_copies, name="vaed-delivery", daemon=True)
        self._copy_stream: torch.cuda.Stream | None = None
        self.on_ready: Callable[[], None] | None = None

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._delivery.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.startup_error is None

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread.ident is None:  # never started (the server failed to bind)
            return
        self._thread.join(timeout=30)
        self._copies.put(None)
        self._delivery.join(timeout=30)

    # -- handler side (event loop thread) ----------------------------------

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def queued_chunks(self) -> int:
        with self._lock:
            return sum(len(item.inbox) + (len(item.session.pending) if item.session else 0) for item in self._items)

    def open(self, output: OutputSpec) -> WorkItem:
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._items) >= self.config.max_sessions:
                raise CapacityExhausted(
                    f"all {self.config.max_sessions} decode sessions are in use; retry shortly"
                )
            item = WorkItem(
                output=output, loop=loop, results=asyncio.Queue(),
                credits=threading.Semaphore(self.config.queue_chunks),
            )
            self._items.append(item)
            self._lock.notify_all()
        return item

    def submit(self, item: WorkItem, latents: torch.Tensor, *, last: bool = False) -> None:
        with self._lock:
            item.inbox.append(latents)
            item.input_done = item.input_done or last
            self._lock.notify_all()

    def finish_input(self, item: WorkItem) -> None:
        with self._lock:
            item.input_done = True
            self._lock.notify_all()

    def release_credit(self, item: WorkItem) -> None:
        item.credits.release()
        with self._lock:
            self._lock.notify_all()

    def close(self, item: WorkItem) -> None:
        """End a call (done, failed or cancelled); its cache is freed now or after the running step."""
        with self._lock:
            item.closed = True
            if item in self._items:
                self._items.remove(item)
            if not item.busy:
                self._free(item)
            self._lock.notify_all()

    def _free(self, item: WorkItem) -> None:
        if item.session is not None and self.engine is not None:
            self.engine.close_session(item.session)
        item.session = None
        item.inbox.clear()

    # -- worker thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            if self.config.is_cuda:
                torch.cuda.set_device(torch.device(self.config.device))
                self._copy_stream = torch.cuda.Stream()
            self.engine = self._engine_factory(self.config)
            if self.config.warmup:
                self._warm_up()
        except BaseException as exc:  # reported by the server, which exits
            if isinstance(exc, VaedServerError):
                log.error("worker failed to start: %s", exc)
            else:
                log.exception("worker failed to start")
            self.startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()
        while True:
            item = self._next_item()
            if item is None:
                return
            self._step(item)

    def _warm_up(self) -> None:
        assert self.engine is not None
        engine = self.engine
        started = time.perf_counter()
        # On CUDA warm up at 480x832 (two latent frames, ~0.1 s on an H200) so
        # cuDNN and Triton first-use costs at a common size are paid before
        # SERVING. The first 81-frame request after start was still slower
        # (1.6-2.2 s against 1.29 s steady, H200): not all first-use cost is here.
        h, w = (480 // engine.scale_spatial, 832 // engine.scale_spatial) if self.config.is_cuda else (8, 8)
        latents = torch.zeros(1, engine.z_dim, 2, h, w)
        engine.decode_video(latents, OutputSpec(rgb8=True, raw_dtype=None, raw_latents=True))
        if self.config.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        log.info("warm-up decode took %.0f ms", (time.perf_counter() - started) * 1e3)

    def _runnable(self, item: WorkItem) -> bool:
        if item.closed or item.end_sent:
            return False
        return bool(item.inbox) or bool(item.session and item.session.pending) or item.input_done

    def _next_item(self) -> WorkItem | None:
        """Round-robin: the first runnable item with a free credit moves to the back."""
        with self._lock:
            while True:
                if self._stopping:
                    return None
                for _ in range(len(self._items)):
                    item = self._items[0]
                    self._items.rotate(-1)
                    if self._runnable(item) and item.credits.acquire(blocking=False):
                        item.busy = True
                        return item
                self._lock.wait(timeout=0.5)

    def _step(self, item: WorkItem) -> None:
        assert self.engine is not None
        engine = self.engine
        try:
            with self._lock:
                chunk = item.inbox.popleft() if item.inbox else None
            if item.session is None:
                item.session = engine.open_session(item.output)
            if chunk is not None:
                engine.accept_chunk(item.session, chunk)
            if not item.session.pending:
                # Input ended with nothing left to decode: tell the handler.
                item.credits.release()
                with self._lock:
                    ended = item.input_done and not item.inbox
                if ended:
                    item.end_sent = True
                    item.deliver(EndOfOutput())
                return
            started = time.perf_counter()
            group = engine.decode_step(item.session)
            with self._lock:
                last = item.input_done and not item.inbox and not item.session.pending
                item.end_sent = last
            self._hand_over(item, group, last, started)
        except torch.cuda.OutOfMemoryError:
            log.warning("CUDA out of memory in call %d; freeing its cache", item.id)
            self._fail(item, CapacityExhausted("the GPU ran out of memory for this request; retry with fewer frames or a smaller batch"))
        except VaedServerError as exc:
            self._fail(item, exc)
        except Exception as exc:  # never let one call take the worker down
            log.exception("decode step failed in call %d", item.id)
            self._fail(item, exc)
        finally:
            with self._lock:
                item.busy = False
                if item.closed:
                    self._free(item)

    def _fail(self, item: WorkItem, exc: BaseException) -> None:
        with self._lock:
            item.end_sent = True
            self._free(item)
        if self.config.is_cuda:
            torch.cuda.empty_cache()
        item.deliver(exc)

    def _hand_over(self, item: WorkItem, group: DecodedGroup, last: bool, started: float) -> None:
        """Start the device-to-host copy on the side stream; the delivery thread finishes it."""
        frames = group.frames
        if frames.device.type == "cuda":
            assert self._copy_stream is not None
            host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            self._copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._copy_stream):
                host.copy_(frames, non_blocking=True)
                frames.record_stream(self._copy_stream)  # keep the block alive until the copy ran
                done = torch.cuda.Event()
                done.record()
        else:
            host, done = frames, None
        self._copies.put((item, group, host, done, last, started))

    def _deliver_copies(self) -> None:
        while True:
            job = self._copies.get()
            if job is None:
                return
            item, group, host, done, last, started = job
            if done is not None:
                done.synchronize()
            item.deliver(HostGroup(
                chunk_index=group.chunk_index, first_frame=group.first_frame, frames=host,
                last=last, decode_seconds=time.perf_counter() - started,
            ))
