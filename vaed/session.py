"""One call's state in one object: a Decode call or a DecodeStream session.

A `Session` holds everything about one call: its output spec, the limits its
input is checked against, its position in the video, its causal cache (the
engine's `DecodeState`), the bounded backlog of latent frames not yet on the
device, its output credits, and the `FrameChannel` its frames leave on.

Every change of a session's state is a method of `Session`; the two threads
that drive it only ask it to move:

* the call (event loop thread) validates and queues input (`accept`,
  `finish_input`), waits for backlog room (`wait_for_room`), reads output
  (`next_group`, `group_sent`), fails it on bad input (`fail`) and closes it
  when it leaves (`close`);
* the device worker (one thread per device) attaches it (`attach`) and takes
  steps: `begin_step`, `take_frame`, `engine_state`, `run_step` (what the
  step runs on the engine is the session's: a decode here, an encode in
  `vaed.encode_session`), then `end_step` (with the step's failure, if any);
  a session whose input is all decoded `finish`es; the delivery thread hands
  its groups over (`deliver_group`).

Shared fields are guarded by the worker's condition variable (the `lock` of
the `Placement` given on attach), which the worker also waits on; every
change notifies it. The end and a failure reach the channel through the
placement's delivery queue, behind the groups handed over before them, so
the call always reads a session's groups, then its end or failure.

Life is an explicit state (`SessionState`)::

    OPEN --finish_input--> INPUT_DONE --(backlog empty)--> ENDED
      \\______________________ fail ____________________--> FAILED
    any state --close (the call left)--> CLOSED

A session's decoder cache is released as soon as it is FAILED or CLOSED and
no step of it runs (`fail`, `close` or `end_step`, whichever comes last).

Frame 0 first: a session's latent frame 1 waits until frame 0 is on the host
and handed to the event loop (`runnable`). Dispatching frame 1 meanwhile
(~14 ms of Python kernel launches at 480x832, holding the GIL) delayed frame
0's delivery: on an H200 the server's first_frame_ms median was 31.4 ms with
the hold and 36.2 ms without (8 calls each). It costs the GPU one idle gap of
a few ms per video when no other session is runnable.

Frame 0 launched: `launched` is set once the worker has launched frame 0's
kernels (or the session is over, whichever comes first), so host work a call
can start early (x264's open for server-side video) runs while the GPU
decodes frame 0 instead of beside its launches.

Credits (output backpressure): the worker takes one before each decode step
and the handler returns it once the group's messages are sent, so a slow
reader stalls only its own session and never piles frames up on the GPU or in
host memory. Both ends of that exchange live in this module.

Backlog (input backpressure): a DecodeStream reader reads the next client
message only while the backlog holds fewer than `max_backlog_frames` latent
frames, so gRPC flow control pushes back on a client that outruns the GPU.
Latents stay on the host until their step: the device holds only the frame
being decoded and the causal cache.

Idle input: a call's reads of client messages are bounded (`first_message`,
`Session.next_message`), so a client that opens a call and sends nothing, or
stops sending mid-session, ends with DEADLINE_EXCEEDED and frees its slot.
The clock runs only while the server waits for the client and owes it
nothing: never while a full backlog keeps the server from reading, nor while
frames of what was received are still decoding or being sent.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .engine import OutputSpec
from .engine_protocol import Engine
from .errors import ClientIdle, InvalidInput, VaedServerError
from .limits import Limits
from .yuv import rgb8_to_yuv420p


class SessionState(enum.Enum):
    OPEN = "open"              # input may still arrive
    INPUT_DONE = "input_done"  # no more input: decode the backlog, then end
    ENDED = "ended"            # the end was put on the channel
    FAILED = "failed"          # an error was put on the channel
    CLOSED = "closed"          # the handler left; nothing more is delivered


# Exponent bits of each latent dtype: all ones means Inf or NaN.
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def has_non_finite(values: torch.Tensor) -> bool:
    """Whether a CPU float tensor holds NaN or Inf: a value whose exponent bits are all ones."""
    as_int, mask = _EXPONENT_BITS[values.dtype]
    return bool(((values.view(as_int) & mask) == mask).any())


def check_finite(latent_frame: torch.Tensor, index: int) -> None:
    """Raise InvalidInput if a CPU latent frame holds NaN or Inf.

    Checked on the exponent bits, one latent frame at a time on the worker
    thread just before its decode: ~0.1 ms for a 480x832 frame (100k values),
    off the event loop and off the first frame's path. `torch.isfinite` on
    bf16 CPU tensors took 40x longer. Frames before the first bad one are
    decoded and sent before the status."""
    if has_non_finite(latent_frame):
        raise InvalidInput(
            f"latent frame {index} holds NaN or Inf values; send finite latents "
            "(or set allow_non_finite to decode them as they are)"
        )


@dataclass(frozen=True)
class DeviceGroup:
    """What one step made, still on the device: a decode's frame group, or an encode's latent
    frame (its moments in `frames`, the normalised latents beside them when asked)."""

    chunk_index: int         # index of the latent frame (= decoder or encoder call) that made it
    first_frame: int         # index in the whole video of its first frame (an encode's: its latent frame)
    frames: torch.Tensor
    latents: torch.Tensor | None = None


@dataclass(frozen=True)
class HostGroup:
    """The frames of one decoder call, in host memory, ready to serialize."""

    chunk_index: int         # index of the latent frame (= decoder call) that made it
    first_frame: int         # index in the whole video of its first frame
    frames: torch.Tensor     # CPU tensor (pinned on CUDA), wire layout
    device_seconds: float    # wall time from the start of its decode step to the host copy's end
    step_started: float      # time.perf_counter() when its decode step began
    gpu_seconds: float | None = None  # GPU clock, step start -> host copy done (frame 0 on CUDA only)
    launch_seconds: float | None = None  # wall time from step start until its last launch (host copy) was enqueued
    latents: torch.Tensor | None = None  # an encode's normalised latents beside its moments (`frames`)


class _End:
    """Put on the channel after the last group."""


_END = _End()


class FrameChannel:
    """Device thread -> handler: one way to put a group, one way to end, one way to fail.

    Thread-safe on the producer side; consumed by one asyncio task. A put after
    the consumer's loop closed is dropped (the caller is gone).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[HostGroup | _End | BaseException] = asyncio.Queue()

    def _put(self, value: HostGroup | _End | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, value)
        except RuntimeError:  # loop closed
            pass

    def put_group(self, group: HostGroup) -> None:
        self._put(group)

    def end(self) -> None:
        self._put(_END)

    def fail(self, exc: BaseException) -> None:
        self._put(exc)

    async def get(self) -> HostGroup | None:
        """The next group; None after the last one; raises the call's failure."""
        value = await self._queue.get()
        if isinstance(value, _End):
            return None
        if isinstance(value, BaseException):
            raise value
        return value


@dataclass
class CallRecord:
    """What the log line and the metrics of one call report (handler side only)."""

    method: str
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    shape: list[int] | None = None   # B, z, T (summed over chunks), h, w
    chunks_in: int = 0
    groups_out: int = 0
    frames_out: int = 0
    skipped_frames: int = 0   # decoded but not sent: the client resumed the call holding them
    device_seconds: float = 0.0
    first_frame_at: float | None = None
    # The first frame's time split in two known parts, the step with its GPU share (the rest is
    # delivery and sending):
    first_wait_s: float | None = None   # call start -> the device starts latent frame 0
    first_step_s: float | None = None   # latent frame 0's step: decode + copy to host
    first_gpu_s: float | None = None    # ... of which the GPU's own clock saw (CUDA only)
    first_launch_s: float | None = None  # ... until its last kernel was enqueued (close to gpu: the host bounds it)


_ids = itertools.count()


# What a front supplies to read a call's input: the next raw message, None once the client
# half-closed. The session only bounds the wait; the front's message type is opaque here.
Receive = Callable[[], Awaitable[Any]]


async def _read(receive: Receive) -> Any:
    return await receive()


async def _receive(
    receive: Receive,
    timeout: float,
    late: Callable[[], ClientIdle],
    clock_starts: asyncio.Event | None = None,
) -> Any:
    """The next message (None when the client half-closed), or raise `late()` once `timeout`
    seconds (0 = no limit) passed without one, counted from when `clock_starts` is set."""
    read = asyncio.ensure_future(_read(receive))
    try:
        if clock_starts is not None and not clock_starts.is_set():
            started = asyncio.ensure_future(clock_starts.wait())
            try:
                await asyncio.wait((read, started), return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
        if timeout > 0 and not read.done():
            await asyncio.wait((read,), timeout=timeout)
            if not read.done():
                raise late()
        return await read
    finally:
        read.cancel()  # no-op once it is done; the call ends after a timeout, nothing reads again


async def first_message(receive: Receive, method: str, timeout: float) -> Any:
    """A call's first message (None if the client half-closed first), within `timeout` s of now."""
    return await _receive(receive, timeout, lambda: ClientIdle(
        f"no {method} message arrived within {timeout:g} s of the call's start "
        "(the server's --session-first-message-timeout); open the call when its first message is ready"
    ))


@dataclass(frozen=True)
class Placement:
    """Where a session runs: what its device worker gives it on `Session.attach`."""

    device: str
    lock: threading.Condition                       # the worker's: guards shared fields, wakes the worker
    deliver: Callable[[Callable[[], None]], None]   # run a job on the delivery thread, behind earlier groups
    free_cache: Callable[[Any], None]               # the engine's release of a decoder cache


def _deliver_now(job: Callable[[], None]) -> None:
    job()


def _no_cache(cache: Any) -> None:
    """Before attach there is no engine and no cache to release."""


class Session:
    """One Decode call or DecodeStream session (see the module docstring). The operation is
    the session's: `engine_state` and `run_step` say what a step runs on the engine, so the
    device worker runs every kind of session alike (`vaed.encode_session` overrides both)."""

    def __init__(
        self,
        record: CallRecord,
        output: OutputSpec,
        limits: Limits,
        *,
        loop: asyncio.AbstractEventLoop,
        credits: int,
        max_backlog_frames: int,
    ) -> None:
        self.id = next(_ids)
        self.record = record
        self.output = output
        self.limits = limits
        self.channel = FrameChannel(loop)
        self.state = SessionState.OPEN
        # until attach: the session's own lock, failures delivered at once, nothing to free
        self._placement = Placement("", threading.Condition(), _deliver_now, _no_cache)
        self._cache: Any = None           # the engine's DecodeState (cache + position); worker thread
        self._busy = False                # the worker is inside a step of this session
        self._first_group_pending = False  # frame 0 taken, its group not yet handed to the event loop
        self._frames_taken = 0
        self._backlog: collections.deque[torch.Tensor] = collections.deque()  # CPU [B, z, 1, h, w]
        self._credits = credits
        self._max_backlog = max(1, max_backlog_frames)
        self._loop = loop
        self._loop_thread = threading.get_ident()  # sessions are built on the handler's loop
        self._room = asyncio.Event()
        self._room.set()
        self._first: tuple[tuple[int, int, int], torch.dtype] | None = None
        self._frames_in = 0
        self._groups_sent = 0            # one group per latent frame; handler side only
        self._delivered = asyncio.Event()  # every latent frame received so far was decoded and sent
        self._delivered.set()
        self.launched = asyncio.Event()  # frame 0's kernels are launched, or the session is over

    @property
    def lock(self) -> threading.Condition:
        """The condition variable guarding the shared fields: the worker's once attached."""
        return self._placement.lock

    @property
    def device(self) -> str | None:
        return self._placement.device or None

    @property
    def busy(self) -> bool:
        """A step of this session runs on its worker."""
        return self._busy

    # -- handler side ----------------------------------------------------------

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Check a chunk against the limits and the session's first chunk (before any copy)."""
        self.limits.check_latents(shape, dtype, frames_before=self._frames_in, first=self._first)

    def accept(self, latents: torch.Tensor) -> None:
        """Queue a CPU chunk [B, z, t, h, w] that passed `validate` as t latent frames."""
        b, z, t, h, w = latents.shape
        if self._first is None:
            self._first = ((b, h, w), latents.dtype)
            self.record.shape = [b, z, 0, h, w]
        assert self.record.shape is not None
        self.record.shape[2] += t
        self.record.chunks_in += 1
        self._frames_in += t
        self._delivered.clear()
        with self.lock:
            self._backlog.extend(latents[:, :, i : i + 1] for i in range(t))
            self._update_room()
            self.lock.notify_all()

    def finish_input(self) -> None:
        with self.lock:
            if self.state is SessionState.OPEN:
                self.state = SessionState.INPUT_DONE
            self.lock.notify_all()

    async def wait_for_room(self) -> None:
        """Return once the backlog holds fewer than max_backlog_frames latent frames."""
        await self._room.wait()

    async def next_message(
        self, receive: Receive, timeout: float, late: Callable[[], ClientIdle] | None = None,
    ) -> Any:
        """The client's next message (None when it half-closed). `late()` (by default a
        DecodeStream's ClientIdle) once it sent nothing for `timeout` s (0 = no limit) after
        every frame of what it sent so far went out: until then the client may be waiting for
        those frames, so the wait is the server's, not its."""
        return await _receive(receive, timeout, late or (lambda: ClientIdle(
            f"no {self.record.method} message arrived for {timeout:g} s after the last results were sent "
            f"({self.received()}; the server's --session-idle-timeout); "
            "send chunks more often, or half-close the stream when the input ends"
        )), clock_starts=self._delivered)

    def received(self) -> str:
        """What the client sent so far, in the call's own unit (for messages)."""
        return f"{self._frames_in} latent frames received"

    async def next_group(self) -> HostGroup | None:
        return await self.channel.get()

    def group_sent(self) -> None:
        """The handler sent a group's messages: return its credit."""
        with self.lock:
            self._credits += 1
            self.lock.notify_all()
        self._groups_sent += 1
        if self._groups_sent >= self._frames_in:
            self._delivered.set()

    def close(self) -> None:
        """The call left (done, failed or cancelled): nothing more is delivered; the cache is
        released now, or when the running step ends."""
        with self.lock:
            self.state = SessionState.CLOSED
            self._backlog.clear()
            self._release_cache_if_done()
            self.lock.notify_all()
        self._on_loop(self.launched.set)

    # -- either side -------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """The one failure path (bad input from the call, a failed step from the worker): stop
        decoding, drop the backlog, release the cache once no step runs, and end the call with
        `exc` behind the groups already handed over. A session already over stays as it is."""
        with self.lock:
            if self.state in (SessionState.OPEN, SessionState.INPUT_DONE):
                self.state = SessionState.FAILED
                self._backlog.clear()
                self._update_room()
                self._placement.deliver(lambda: self.channel.fail(exc))
            self._release_cache_if_done()
            self.lock.notify_all()
        self._on_loop(self.launched.set)

    # -- worker side -------------------------------------------------------------------

    def attach(self, placement: Placement) -> None:
        """The session joins its device worker (before the worker can see it): from now on the
        worker's condition variable guards it and its end travels the worker's delivery queue."""
        with self.lock:
            self._placement = placement

    @property
    def backlog_frames(self) -> int:
        return len(self._backlog)

    def runnable(self) -> bool:
        """A step can run now (call with `lock` held): a frame and a credit, or the end to
        deliver; never while frame 0 is still on its way out (see the module docstring)."""
        if self._first_group_pending:
            return False
        if self._drained():
            return True
        return self.state in (SessionState.OPEN, SessionState.INPUT_DONE) and bool(self._backlog) and self._credits > 0

    def begin_step(self) -> None:
        """The worker picked this runnable session for its next step."""
        with self.lock:
            self._busy = True

    def take_frame(self) -> torch.Tensor | None:
        """Pop the next latent frame and its credit; None when the step is the end (`finish`)."""
        with self.lock:
            if not self._backlog:
                return None
            self._credits -= 1
            frame = self._backlog.popleft()
            if self._frames_taken == 0:
                self._first_group_pending = True
            self._frames_taken += 1
            self._update_room()
            return frame

    def decoder_state(self, new_state: Callable[[], Any]) -> Any:
        """The engine's DecodeState of this session, made by `new_state` at its first step."""
        assert self._busy, "the decoder state is only used inside a step"
        if self._cache is None:
            self._cache = new_state()
        return self._cache

    def engine_state(self, engine: Engine) -> Any:
        """This session's state on `engine` (causal cache and position), made at its first step."""
        return self.decoder_state(engine.new_state)

    def run_step(self, engine: Engine, state: Any, latent_frame: torch.Tensor) -> DeviceGroup:
        """Decode one latent frame taken from the backlog (worker thread, inside a step); a
        frame holding NaN or Inf is refused unless the call allowed them."""
        if not self.output.allow_non_finite:
            check_finite(latent_frame, state.next_latent_frame)
        group = engine.decode_frame(state, latent_frame, self.output)
        frames = rgb8_to_yuv420p(group.frames) if self.output.yuv420p else group.frames
        return DeviceGroup(group.chunk_index, group.first_frame, frames)

    def first_step_launched(self) -> None:
        """Frame 0's kernels are launched (worker thread): set `launched` on the call's loop."""
        self._on_loop(self.launched.set)

    def finish(self) -> None:
        """Every latent frame was decoded after the input ended: deliver the end."""
        with self.lock:
            if self.state is SessionState.INPUT_DONE:
                self.state = SessionState.ENDED
                self._placement.deliver(self.channel.end)
        self._on_loop(self.launched.set)

    def finish_if_drained(self) -> None:
        """After a step (worker thread): with the input ended and every latent frame taken, deliver
        the end now, behind the step's group. As a step of its own the end waited its turn behind
        every other session's next step (20-40 ms each on an H200 at 480x832), and with it the
        call's status, which `decode()` returns on and a Content-Length HTTP answer ends with."""
        with self.lock:
            drained = self._drained()
        if drained:
            self.finish()

    def _drained(self) -> bool:
        """The input ended and every latent frame was taken: only the end is left (`lock` held)."""
        return self.state is SessionState.INPUT_DONE and not self._backlog

    def end_step(self, failure: BaseException | None = None) -> None:
        """The step is over; `failure` fails the session (after the step, so its cache goes at once)."""
        with self.lock:
            self._busy = False
            if failure is not None:
                self.fail(failure)
            self._release_cache_if_done()
            self.lock.notify_all()

    def deliver_group(self, group: HostGroup) -> None:
        """Put a decoded group on the channel (delivery thread), or end the call with the reason
        `refused_output` gives; after frame 0's, the worker may step the session again."""
        refusal = self.refused_output(group)
        if refusal is None:
            self.channel.put_group(group)
        else:
            # on the channel here, in order: the last step may have ended the session already,
            # its end queued behind this group, which `fail` would leave as it is
            self.channel.fail(refusal)
            self.fail(refusal)  # no further steps
        if self._first_group_pending:
            with self.lock:
                self._first_group_pending = False
                self.lock.notify_all()

    def refused_output(self, group: HostGroup) -> VaedServerError | None:
        """Why a step's output must not be sent (delivery thread, after its host copy); None sends
        it. A decode sends what it made (its input was checked before the step)."""
        return None

    def _release_cache_if_done(self) -> None:
        """Free the decoder cache of a failed or closed session that no step uses (`lock` held)."""
        if self._busy or self._cache is None:
            return
        if self.state in (SessionState.FAILED, SessionState.CLOSED):
            cache, self._cache = self._cache, None
            self._placement.free_cache(cache)

    def _update_room(self) -> None:
        """Re-evaluate backlog room on the handler's loop."""
        self._on_loop(self._refresh_room)

    def _on_loop(self, job: Callable[[], None]) -> None:
        """Run `job` on the handler's loop: now when already on it, else as its next callback."""
        if threading.get_ident() == self._loop_thread:
            job()
            return
        try:
            self._loop.call_soon_threadsafe(job)
        except RuntimeError:  # loop closed: the caller is gone
            pass

    def _refresh_room(self) -> None:
        # Reads the backlog when it runs, so scheduled refreshes never undo a later change.
        with self.lock:
            has_room = len(self._backlog) < self._max_backlog
        (self._room.set if has_room else self._room.clear)()
