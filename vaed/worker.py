"""The device worker: one thread owns every CUDA call for one device.

It round-robins over its sessions one step at a time; a step decodes one
latent frame (one decoder call, one frame group) or, for an Encode, runs one
encoder call (one latent frame), so concurrent sessions share the GPU fairly
and a long video never blocks a short one for long. A session is runnable
when it has a backlog item and an output credit (see `vaed.session`), or
when its input ended and only the end is left to deliver. The worker writes
no field of a session: it asks the session to move (`attach`, `begin_step`,
`take_frame`, `end_step`, `finish`, `fail`, `close`), and what a step runs on
the engine is the session's own (`engine_state`, `run_step`), so the worker
has one loop for every operation and a session's life is read in one module.

Overlap: each group is copied to pinned host memory on a side stream; a
delivery thread waits for the copy and puts the group on the session's
channel while this thread already launches the next decoder call. Ends and
failures travel through the same delivery queue, so a session's channel
always sees its groups, then its end, in order.

Threads, not processes, per device: the host work of a step is launching
~274 kernels and a few Python calls, and a GPU pool of one process keeps the
handoff to the event loop in memory (see `vaed.parallel.pool` for the
measured scaling).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .engine import WARMUP_ENCODE_FRAMES, WARMUP_LATENT_FRAMES, warm_up, warm_up_encode
from .engine_protocol import Engine, EngineFactory
from .errors import CapacityExhausted, NotReady, ShardGroupError, VaedServerError
from .metrics import DeviceLoad
from .patches import FastPathError
from .session import DeviceGroup, HostGroup, Placement, Session
from .startup import StartupTimes, phase, recording

log = logging.getLogger(__name__)

# Without --warmup-shapes on CPU: one small decode (tests, development).
CPU_WARMUP_LATENT_HW = (8, 8)

# what `_next_session` returns after an idle wait: the loop passes by the keepalive again
_IDLE: Any = object()


class DeviceFault(RuntimeError):
    """The device itself failed (not the request): the worker leaves rotation."""


def is_device_fault(exc: BaseException) -> bool:
    """CUDA errors other than OOM poison the context; OOM and bad input do not."""
    if isinstance(exc, (DeviceFault,)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


class DeviceWorker:
    def __init__(
        self,
        device: str,
        build_engine: EngineFactory,
        *,
        warmup: bool = True,
        warmup_shapes: tuple[tuple[int, int], ...] | None = None,
        startup: StartupTimes | None = None,
    ) -> None:
        self.device = device
        self._build_engine = build_engine
        self._warmup = warmup
        self._warmup_shapes = warmup_shapes
        self.engine: Engine | None = None
        self.startup_error: BaseException | None = None
        self.fault: BaseException | None = None   # set when the device failed after start
        self.warmup_seconds: dict[str, float] = {}
        self.startup = startup or StartupTimes()  # this device's start-up phases go here (vaed.startup)
        self._lock = threading.Condition()
        self._sessions: collections.deque[Session] = collections.deque()
        self._stopping = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"vaed-worker-{device}", daemon=True)
        self._outbox: queue.Queue[tuple[torch.cuda.Event | None, Callable[[], None]] | None] = queue.Queue()
        self._delivery = threading.Thread(target=self._deliver, name=f"vaed-delivery-{device}", daemon=True)
        self._copy_stream: torch.cuda.Stream | None = None
        self.on_ready: Callable[[], None] | None = None
        self.on_fault: Callable[[], None] | None = None  # called once the device left rotation
        self._placement = Placement(device, self._lock, self._deliver_later, self._free_cache)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._delivery.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def started(self) -> bool:
        """Start-up finished, successfully or not."""
        return self._ready.is_set()

    @property
    def healthy(self) -> bool:
        return self._ready.is_set() and self.startup_error is None and self.fault is None

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread.ident is None:  # never started (the server failed to bind)
            return
        self._thread.join(timeout=30)
        self._outbox.put(None)
        self._delivery.join(timeout=30)
        if self.engine is not None:
            self.engine.close()  # a sharded engine stops its follower processes

    # -- handler side (event loop thread) -----------------------------------------

    def attach(self, session: Session) -> None:
        with self._lock:
            if not self.healthy:  # the device, not the request: another replica can serve it
                raise NotReady(f"device {self.device} is out of rotation; retry")
            session.attach(self._placement)
            self._sessions.append(session)
            self._lock.notify_all()

    def detach(self, session: Session) -> None:
        """The handler left (done, failed or cancelled); the cache is freed now or after the running step."""
        with self._lock:
            session.close()
            if session in self._sessions:
                self._sessions.remove(session)
            self._lock.notify_all()

    def load(self) -> DeviceLoad:
        with self._lock:
            return DeviceLoad(
                device=self.device,
                healthy=self.healthy,
                active_sessions=len(self._sessions),
                pending_latent_frames=sum(s.backlog_frames for s in self._sessions),
            )

    def _free_cache(self, cache: Any) -> None:
        """A session's decoder cache is released (called by the session, `_lock` held)."""
        if self.engine is not None:
            self.engine.free(cache)

    def _deliver_later(self, job: Callable[[], None]) -> None:
        """A session's end or failure, queued behind the groups handed over before it."""
        self._outbox.put((None, job))

    # -- worker thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            with recording(self.startup, self.device):  # the engine's phases (model load, ...) are this device's
                self._start()
        except BaseException as exc:  # reported by the pool / server
            if isinstance(exc, (VaedServerError, FastPathError)):  # a configuration's failure: its message says it
                log.error("worker on %s failed to start: %s", self.device, exc)
            else:
                log.exception("worker on %s failed to start", self.device)
            self.startup_error = exc
            self._ready.set()
            if self.on_ready is not None:
                self.on_ready()
            return
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()
        while True:
            self._keep_group_alive()
            session = self._next_session()
            if session is None:
                return
            if session is not _IDLE:
                self._step(session)

    def _start(self) -> None:
        """Device context, engine, warm-up: each a start-up phase of this device."""
        if self.is_cuda:
            with phase("cuda init"):
                torch.cuda.set_device(torch.device(self.device))
                self._copy_stream = torch.cuda.Stream()
        self.engine = self._build_engine(self.device)
        if self._warmup:
            self._warm_up(self.engine)
            for name, seconds in self.warmup_seconds.items():  # each already has its log line
                self.startup.add(f"warm-up {name}", seconds, self.device, logged=False)

    def _keep_group_alive(self) -> None:
        """`engine.keepalive()` on every pass, idle or not: a sharded engine sends its followers
        a no-op when due (they leave the group after the control timeout without a step); a
        one-device engine does nothing. A group that fails it is reported like a failed step."""
        assert self.engine is not None
        try:
            self.engine.keepalive()
        except ShardGroupError as exc:
            log.error("spatial group failed its keepalive on %s: %s", self.device, exc)
            self._group_changed()

    def _group_changed(self) -> None:
        """The engine's group broke; this worker stays in rotation (the engine decodes on this
        device alone), but the server re-reads health, whose group entry turns NOT_SERVING."""
        if self.on_fault is not None:
            self.on_fault()

    def _warm_shapes(self, engine: Engine) -> list[tuple[int, int]]:
        """Latent (h, w) sizes to warm: the configured pixel sizes, or one small CPU decode."""
        if self._warmup_shapes is not None:
            s = engine.scale_spatial
            return [(h // s, w // s) for h, w in self._warmup_shapes]
        if not self.is_cuda:
            return [CPU_WARMUP_LATENT_HW]
        from .config import DEFAULT_WARMUP_SHAPES

        s = engine.scale_spatial
        return [(h // s, w // s) for h, w in DEFAULT_WARMUP_SHAPES.get(engine.z_dim, ((480, 832),))]

    def _warm_up(self, engine: Engine) -> None:
        """Decode every warm-up shape up to its steady chunk in every offered tier (and, with an
        encoder, encode it up to its steady call in every encode dtype), so the first real request
        at that shape does not pay cuDNN plan selection, Triton compiles (the fast tier's kernels
        specialise per shape too) or allocator growth."""
        frames = WARMUP_LATENT_FRAMES if self.is_cuda else 2
        shapes = self._warm_shapes(engine)
        engine.prepare_conv_plans(shapes)  # before the warm-up: it then runs (and captures) the plans
        for h, w in shapes:
            started = time.perf_counter()
            for precision in engine.precisions:
                warm_up(engine, (h, w), precision, frames)
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
            name = f"{h * engine.scale_spatial}x{w * engine.scale_spatial}"
            self.warmup_seconds[name] = time.perf_counter() - started
            log.info("warm-up on %s at %s (%d latent frames) took %.2f s",
                     self.device, name, frames, self.warmup_seconds[name])
            if engine.encodes:  # the encoder's own compiles and plans, in every encode dtype
                started = time.perf_counter()
                for dtype in engine.encode_dtypes:
                    warm_up_encode(engine, (h, w), dtype)
                if self.is_cuda:
                    torch.cuda.synchronize(self.device)
                self.warmup_seconds[f"{name} encode"] = time.perf_counter() - started
                log.info("warm-up of the encoder on %s at %s (%d frames, %s) took %.2f s", self.device, name,
                         WARMUP_ENCODE_FRAMES, ", ".join(str(d).removeprefix("torch.") for d in engine.encode_dtypes),
                         self.warmup_seconds[f"{name} encode"])
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _next_session(self) -> Session | None:
        """Round-robin: the first runnable session moves to the back and is marked busy."""
        with self._lock:
            while True:
                if self._stopping:
                    return None
                for _ in range(len(self._sessions)):
                    session = self._sessions[0]
                    self._sessions.rotate(-1)
                    if session.runnable():
                        session.begin_step()
                        return session
                if not self._lock.wait(timeout=0.5):
                    return _IDLE  # nothing runnable for a while: the loop keeps the group alive

    def _step(self, session: Session) -> None:
        """Run one step of `session`; whatever goes wrong fails that session, not the worker."""
        failure: BaseException | None = None
        try:
            self._run_step(session)
        except torch.cuda.OutOfMemoryError:
            log.warning("CUDA out of memory in session %d on %s; freeing its cache", session.id, self.device)
            failure = CapacityExhausted(
                "the GPU ran out of memory for this request; retry with fewer frames or a smaller batch")
        except VaedServerError as exc:
            failure = exc
        except ShardGroupError as exc:
            # The spatial group broke (a follower died); the engine already runs new
            # sessions on this GPU alone, so the worker stays in rotation.
            log.error("spatial group failed in session %d on %s: %s", session.id, self.device, exc)
            failure = NotReady("the multi-GPU decode group failed; retry (the server continues on one GPU)")
            self._group_changed()
        except Exception as exc:  # never let one call take the worker down
            log.exception("decode step failed in session %d on %s", session.id, self.device)
            if is_device_fault(exc):
                self._leave_rotation(exc)
                # UNAVAILABLE, not INTERNAL: the request was fine and a client resumes it elsewhere
                exc = NotReady(f"device {self.device} failed; retry on another device or replica")
            failure = exc
        finally:
            session.end_step(failure)  # a failed session's cache is freed here
        if failure is not None and self.is_cuda:
            torch.cuda.empty_cache()

    def _run_step(self, session: Session) -> None:
        """Run the session's next step on the engine (a decoder call, or an Encode's encoder
        call: the session knows which) and hand its group over, or deliver its end."""
        assert self.engine is not None
        engine = self.engine
        item = session.take_frame()
        if item is None:  # input ended and nothing is left: deliver the end
            session.finish()
            return
        started = time.perf_counter()
        state = session.engine_state(engine)
        first_step = state.next_latent_frame == 0
        # only frame 0's GPU time is reported (first_gpu_ms): later steps record no event
        started_event = self._timing_event() if first_step else None
        group = session.run_step(engine, state, item)
        self._hand_over(session, group, started, started_event)
        if first_step:
            session.first_step_launched()
        session.finish_if_drained()

    def _leave_rotation(self, exc: BaseException) -> None:
        """A device fault: fail every session here and take no new ones."""
        log.error("device %s failed (%s); it leaves rotation", self.device, exc)
        with self._lock:
            self.fault = exc
            others = [s for s in self._sessions if not s.busy]
        for other in others:
            other.fail(NotReady(f"device {self.device} failed; retry on another device or replica"))
        if self.is_cuda:
            torch.cuda.empty_cache()
        if self.on_fault is not None:
            self.on_fault()

    def _timing_event(self) -> torch.cuda.Event | None:
        if not self.is_cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _hand_over(self, session: Session, group: DeviceGroup, started: float,
                   started_event: torch.cuda.Event | None) -> None:
        """Start the device-to-host copy on the side stream; the delivery thread finishes it."""
        frames = group.frames
        latents = group.latents
        host_latents = latents
        if frames.device.type == "cuda":
            assert self._copy_stream is not None
            host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            self._copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._copy_stream):
                host.copy_(frames, non_blocking=True)
                frames.record_stream(self._copy_stream)  # keep the block alive until the copy ran
                if latents is not None:
                    host_latents = torch.empty(latents.shape, dtype=latents.dtype, pin_memory=True)
                    host_latents.copy_(latents, non_blocking=True)
                    latents.record_stream(self._copy_stream)
                # timed only where the step's start was (frame 0); otherwise it only signals the copy
                copied = torch.cuda.Event(enable_timing=started_event is not None)
                copied.record()
            done: torch.cuda.Event | None = copied
        else:
            host, done = frames, None
        launched = time.perf_counter() - started

        def deliver() -> None:
            gpu = started_event.elapsed_time(done) / 1e3 if started_event is not None and done is not None else None
            session.deliver_group(HostGroup(
                chunk_index=group.chunk_index, first_frame=group.first_frame, frames=host,
                device_seconds=time.perf_counter() - started, step_started=started, gpu_seconds=gpu,
                launch_seconds=launched, latents=host_latents,
            ))

        self._outbox.put((done, deliver))

    def _deliver(self) -> None:
        while True:
            job = self._outbox.get()
            if job is None:
                return
            done, deliver = job
            if done is not None:
                done.synchronize()
            deliver()
