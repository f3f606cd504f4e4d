"""The call core: one call from admission to its log line, written once below the fronts.

A front (the gRPC servicer, `vaed.service`; the HTTP front, `vaed.http.front`) only translates.
It hands the core a `CallInput` -- how to receive the call's next raw message
and how to parse one into an `InputMessage` -- a `deadline_passed()` callable,
and a `to_message` converter; it iterates the `Call` the core returns and sends
what comes out, and turns a `CallFailed`'s `Status` into its own status code.
Everything else is here, once:

    serving? -> admitted (a session slot) -> first message (within
    --session-first-message-timeout) -> parsed by the front -> request id ->
    session opened (output spec, limits) -> input fed -> output streamed ->
    finished: logged and counted once, however it ends

Why the input is read lazily, through the front's `receive`: nothing of a call
is received, parsed or copied before it is authorised (the interceptors run
first) and admitted, and every wait for a client message is bounded by the
session timeouts (`vaed.session`). The front's parse is called only when the
core needs a message's content, and its `InputMessage` hands over the latents
as a header (checked against the limits, no copy) and a copy on demand: a
second Decode message is refused without being parsed, and a refused chunk is
never copied.

Why the output is pulled: the core yields `FramesOut` pieces (a frame group
split at the wire's frame message size, on frame boundaries) and one `CallEnd`,
already converted by the front's `to_message`; a group's output credit goes
back when the front asks for the item after its last piece, i.e. once the
front has sent it, so a slow reader stalls only its own session.

Why the front passes `deadline_passed`: a call the front cancels ends
DEADLINE_EXCEEDED when its deadline ran out, UNAVAILABLE when the server cut it
at the end of its drain grace (`Lifecycle.cutting`), and CANCELLED otherwise;
only the front knows its deadline.

Operations: `decode` (one message) and `decode_stream` (a stream of chunks)
share admission, the first-message read, options, the session, the output and
the finish; `encode` (a stream of frame chunks, `vaed.encode_session`) adds
its own open (its session, spec and limits) and output (one `LatentFrameOut`
per encoder call) and reuses the rest. `model_info` is a call without a
session.

Server-side video (`RequestedOutput.video`): the core feeds each frame piece
to the call's packager on the shared `PackagingPool` (`vaed.video`) and yields
`VideoOut` bytes instead of `FramesOut`, so the gRPC format MP4 and the HTTP
`output_type=mp4` are one implementation. A group's credit goes back once its
bytes were sent, as for frames: a slow encoder or reader stalls only its own
session. Video holds one video (batch 1) and is never resumed part-way
(`skip_frames` is refused): x264's bytes depend on its thread count, so a
resumed call cannot splice another host's fragments onto the ones sent.

The log line (logger `vaed.service`, one per call, OK at INFO, others at
WARNING) keeps the name the service had when it wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from vaed_client.wire import frame_slices, request_id_problem

from .choices import Parallel, Precision
from .config import ServerConfig
from .encode_session import EncodeSession
from .engine import OutputSpec
from .engine_protocol import EncodeSpec
from .errors import ClientIdle, InvalidInput, NotReady, Status, status_for
from .limits import Limits
from .parallel.pool import SessionSlot, WorkerPool
from .session import CallRecord, HostGroup, Receive, Session, first_message
from .video import PackagingPool, VideoError, VideoOptions, check_frame_size, default_fps

log = logging.getLogger("vaed.service")

# the encoder's tiers: lossless only (a fast encode tier is not measured yet)
ENCODE_PRECISIONS: tuple[Precision, ...] = (Precision.LOSSLESS,)

T = TypeVar("T")


class Lifecycle:
    """What the calls need to know about the server's state."""

    def __init__(self) -> None:
        self.draining = False
        # the drain's grace is over: a call that ends cancelled now was cut by the server, and its
        # client saw UNAVAILABLE (gRPC) or a closed connection (HTTP), not a cancel of its own
        self.cutting = False


# -- what a front hands the core -------------------------------------------------------


@dataclass(frozen=True)
class RequestedOutput:
    """A call's output options as the front read them (the defaults: nothing asked)."""

    rgb8: bool = True                      # False: RAW
    raw_dtype: torch.dtype | None = None   # RAW frames' dtype; None = the compute dtype
    precision: Precision | None = None     # None = the server's default
    raw_latents: bool = False
    allow_non_finite: bool = False
    skip_frames: int = 0                   # a resumed call: frames the client has (decoded, not sent)
    video: VideoOptions | None = None      # server-side MP4 (needs rgb8): VideoOut bytes instead of frames


@dataclass(frozen=True)
class RequestedEncode:
    """An Encode call's options as the front read them (the defaults: nothing asked)."""

    latents: bool = False                  # also the normalised latents
    out_dtype: torch.dtype | None = None   # None = the encode's compute dtype
    precision: Precision | None = None     # None = the encode's default tier
    allow_non_finite: bool = False
    trailing_zero_frames: int = 0          # zero frames the server appends (image-to-video)
    encode_dtype: torch.dtype | None = None  # None = the server's default (ModelInfo.encode_dtypes[0])


class LatentsIn(Protocol):
    """A message's latents, still in the front's form."""

    def header(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype, checked against the payload's size, without copying (InvalidInput)."""

    def to_tensor(self) -> torch.Tensor:
        """The copy, on the CPU, [B, z, T, h, w]."""


@dataclass(frozen=True)
class InputMessage:
    """One parsed client message. `options` is read only when the core needs it (its checks
    come after the request id's); None when the message carried no options."""

    request_id: str
    latents: LatentsIn
    options: Callable[[], RequestedOutput] | None = None


@dataclass(frozen=True)
class VideoMessage:
    """One parsed Encode message: its frames (a tensor in the front's form) and options."""

    request_id: str
    frames: LatentsIn
    options: Callable[[], RequestedEncode] | None = None


@dataclass(frozen=True)
class CallInput(Generic[T]):
    """How the core reads one call's input from its front."""

    receive: Receive                     # the next raw message; None once the client half-closed
    # raw -> InputMessage (Decode, DecodeStream) or VideoMessage (Encode); InvalidInput when malformed
    parse: Callable[[T], Any]
    # the call's id where its front knows it before the first message (HTTP's checked X-Request-Id
    # header, "" without one): a call refused before that message (busy, a slow or non-finite body)
    # logs it
    request_id: str = ""


# -- what the core hands the front -------------------------------------------------------


@dataclass(frozen=True)
class FramesOut:
    """Frames for one message: part or all of one group (`chunk_index` = its latent frame)."""

    request_id: str
    chunk_index: int
    first_frame: int     # index in the whole video of `frames`' first frame
    frames: torch.Tensor  # CPU, wire layout


@dataclass(frozen=True)
class LatentFrameOut:
    """One encoder call's latent frame: the moments, and the normalised latents when asked."""

    request_id: str
    latent_frame: int
    moments: torch.Tensor          # CPU [B, 2 * z_dim, 1, h, w]
    latents: torch.Tensor | None   # CPU [B, z_dim, 1, h, w]


@dataclass(frozen=True)
class VideoOut:
    """The next bytes of a call's MP4 file (`RequestedOutput.video`), released by encoding the
    frames of group `chunk_index` from `first_frame` on."""

    request_id: str
    chunk_index: int
    first_frame: int
    data: bytes


@dataclass(frozen=True)
class CallEnd:
    """The call's last item: how many groups and frames it sent."""

    request_id: str
    groups: int
    frames: int


Out = FramesOut | VideoOut | CallEnd


class CallFailed(Exception):
    """A call ended with a failure: its status and the message safe to show the caller. It is
    logged and counted already; the front only sends it."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ModelFacts:
    """What GetModelInfo reports, in the core's types."""

    model: str
    z_dim: int
    scale_factor_temporal: int
    scale_factor_spatial: int
    latents_mean: list[float]
    latents_std: list[float]
    compute_dtype: torch.dtype
    device: str
    random_weights: bool
    max_message_bytes: int
    max_latent_frames: int
    max_pixels: int
    max_batch: int
    kernels: str
    layout: str
    fast_paths_note: str
    precisions: tuple[Precision, ...]   # the default first
    devices: list[str]
    parallel: str
    encodes: bool = False
    encode_precisions: tuple[Precision, ...] = ()
    encode_dtypes: tuple[torch.dtype, ...] = ()
    video_fps: int = 0        # server-side video's default frame rate (the model's); 0: none offered
    decoder_identity: str = ""  # what decides the frames' bits (`vaed.identity`)
    encoder_identity: str = ""  # the same for Encode ("" without an encoder)


def checked_request_id(request_id: str) -> str:
    """The caller's id if the wire's rule takes it (`request_id_problem`); a new one if empty."""
    if not request_id:
        return uuid.uuid4().hex[:16]
    problem = request_id_problem(request_id)
    if problem is not None:
        raise InvalidInput(problem)
    return request_id


def frame_pieces(group: HostGroup, request_id: str, time_dim: int, cap_bytes: int) -> Iterator[FramesOut]:
    """One group -> pieces of at most cap_bytes payload, split on frame boundaries."""
    frames = group.frames
    count = frames.shape[time_dim]
    frame_bytes = frames.numel() * frames.element_size() // max(count, 1)
    for start, length in frame_slices(count, frame_bytes, cap_bytes):
        yield FramesOut(request_id, group.chunk_index, group.first_frame + start,
                        frames.narrow(time_dim, start, length))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def log_line(record: CallRecord, status: Status, error: str = "") -> str:
    total_ms = (time.perf_counter() - record.started) * 1e3
    first = record.first_frame_at - record.started if record.first_frame_at else None
    return (
        f"{record.method} id={record.request_id} status={status.name} shape={record.shape} "
        f"chunks_in={record.chunks_in} groups={record.groups_out} frames={record.frames_out} "
        f"device_ms={record.device_seconds * 1e3:.1f} first_frame_ms={_ms(first)} "
        f"first_wait_ms={_ms(record.first_wait_s)} first_step_ms={_ms(record.first_step_s)} "
        f"first_gpu_ms={_ms(record.first_gpu_s)} "
        f"first_launch_ms={_ms(record.first_launch_s)} total_ms={total_ms:.1f}"
        # a resumed call: frames decoded for the causal cache but not sent (the client had them)
        + (f" skipped_frames={record.skipped_frames}" if record.skipped_frames else "")
        # a failed call's message as its client got it; JSON-quoted, as it may quote the client's input
        + (f" error={json.dumps(error)}" if error else "")
    )


class Call(Generic[T]):
    """One call: iterate it for the front's messages; it is logged and counted once however it
    ends (done, failed, cancelled, deadline), and its session closed. A failure comes out as
    CallFailed, after `linger` seconds with the input closed (see `CallCore.decode_stream`)."""

    def __init__(
        self,
        core: CallCore,
        method: str,
        body: Callable[[CallRecord], AsyncGenerator[Any, None]],
        to_message: Callable[[Any], T],
        deadline_passed: Callable[[], bool],
        linger: float = 0.0,
        request_id: str = "",
    ) -> None:
        self.record = CallRecord(method, request_id or "-")  # "-": not known until the first message
        self._core = core
        self._body = body(self.record)
        self._to_message = to_message
        self._deadline_passed = deadline_passed
        self._linger = linger
        self._refused: Status | None = None  # why the front ended the call early (`end_refused`)
        self._messages = self._run()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._messages

    async def aclose(self) -> None:
        """End the call now (a front that stops reading it): its cleanup runs at once, not at
        garbage collection; a call not over yet is logged as cancelled."""
        await self._messages.aclose()

    async def end_refused(self, status: Status) -> None:
        """End the call now because its front refuses what it makes (a whole answer past the
        front's bound): logged and counted with `status`, the answer the front sends, not as a
        call its client cancelled."""
        self._refused = status
        await self._messages.aclose()

    async def _run(self) -> AsyncGenerator[T, None]:
        failure: CallFailed | None = None
        try:
            async for item in self._body:
                yield self._to_message(item)
        except (asyncio.CancelledError, GeneratorExit):
            if self._deadline_passed():
                ended = Status.DEADLINE_EXCEEDED
            else:
                ended = Status.UNAVAILABLE if self._core.lifecycle.cutting else Status.CANCELLED
            self._core.finish(self.record, self._refused or ended)
            raise
        except Exception as exc:
            await self._body.aclose()  # frees the session and stops its reader before the status
            # logged and counted before the linger: a client that leaves meanwhile cancels the
            # sleep, and its call (refused all the same) was neither logged nor counted
            failure = self._core.failed(self.record, exc)
        else:
            self._core.finish(self.record, Status.OK)
        finally:
            await self._body.aclose()
        if failure is None:
            return
        # Raised outside the except clause, so that it carries no __context__: the failure's
        # traceback holds this frame, which holds the failure (a cycle), and through the context
        # the body's frames held the refused message until a garbage collection (~200 MB of RSS
        # per refused 64 MiB Decode, 2 GB after seven).
        if self._linger > 0:
            await asyncio.sleep(self._linger)
        try:
            raise failure
        finally:
            del failure


class CallCore:
    """Model info, Decode and DecodeStream over a WorkerPool, for any front."""

    def __init__(
        self, config: ServerConfig, pool: WorkerPool, lifecycle: Lifecycle, metrics: Any = None,
        packaging: PackagingPool | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.packaging = packaging  # None: no server-side video (a call asking for it is refused)
        self._identities: tuple[Any, tuple[str, str]] | None = None  # (engine, its lines), made once

    # -- operations: each returns a Call for the front to iterate -------------------------

    def model_info(
        self, input: CallInput[T], to_message: Callable[[ModelFacts], Any], deadline_passed: Callable[[], bool],
    ) -> Call[Any]:
        """One request message, one reply: the served model's facts."""
        async def body(record: CallRecord) -> AsyncGenerator[ModelFacts, None]:
            input.parse(await input.receive())
            self.check_serving()
            yield self.model_facts()

        return Call(self, "GetModelInfo", body, to_message, deadline_passed)

    def decode(
        self, input: CallInput[T], to_message: Callable[[Out], Any], deadline_passed: Callable[[], bool],
    ) -> Call[Any]:
        """Decode: one message of latents, then the frames."""
        return Call(self, "Decode", lambda record: self._decode(record, input), to_message, deadline_passed,
                    request_id=input.request_id)

    def decode_stream(
        self, input: CallInput[T], to_message: Callable[[Out], Any], deadline_passed: Callable[[], bool],
        linger: float = 0.0,
    ) -> Call[Any]:
        """DecodeStream: latent chunks in, frames out as they decode. `linger`: how long a failed
        call waits, reading nothing, before its status (a front whose clients are still writing
        would otherwise miss it; see vaed.interceptors)."""
        return Call(self, "DecodeStream", lambda record: self._decode_stream(record, input), to_message,
                    deadline_passed, linger, request_id=input.request_id)

    def encode(
        self, input: CallInput[T], to_message: Callable[[Any], Any], deadline_passed: Callable[[], bool],
        linger: float = 0.0,
    ) -> Call[Any]:
        """Encode: frame chunks in (`VideoMessage`s), latent frames out (`LatentFrameOut`) as each
        encoder call finishes, then the CallEnd; `linger` as for decode_stream."""
        return Call(self, "Encode", lambda record: self._encode(record, input), to_message, deadline_passed, linger,
                    request_id=input.request_id)

    # -- finishing: the one log line and the metrics ----------------------------------------

    def finish(self, record: CallRecord, status: Status, error: str = "") -> None:
        (log.info if status is Status.OK else log.warning)(log_line(record, status, error))
        if self.metrics is None:
            return
        if status in (Status.RESOURCE_EXHAUSTED, Status.UNAVAILABLE) and record.shape is None:
            # refused before it read its input (sessions full, draining, warming up): counted, not
            # timed, as the interceptors' refusals are (a flood of instant answers would drag the
            # latency quantiles toward zero)
            self.metrics.request_refused(record.method, status.name)
            return
        self.metrics.request_finished(record.method, status.name, time.perf_counter() - record.started)
        if status is Status.OK and record.first_frame_at is not None:
            self.metrics.observe_first_frame(record.method, record.first_frame_at - record.started)

    def failed(self, record: CallRecord, exc: BaseException) -> CallFailed:
        """Log and count a failed call; what its front sends (an internal error's details stay in the log)."""
        status = status_for(exc)
        if status is Status.INTERNAL:
            log.error("internal error in %s id=%s", record.method, record.request_id, exc_info=exc)
            message = f"internal error (request id {record.request_id}); see the server log"
        else:
            message = str(exc)
        self.finish(record, status, message)
        return CallFailed(status, message)

    # -- the server's state and the model ----------------------------------------------------

    def check_serving(self) -> None:
        if self.lifecycle.draining:
            raise NotReady("the server is draining for shutdown; retry on another replica")
        if not self.pool.ready:
            if self.pool.started:
                raise NotReady("the model failed to load; see the server log")
            raise NotReady("the server is warming up (loading the model); retry shortly")

    @property
    def offered(self) -> tuple[Precision, ...]:
        """The precisions this server decodes in, its default first."""
        default = self.default_precision
        return (default,) + tuple(p for p in Precision if p in self._engine_precisions and p != default)

    @property
    def default_precision(self) -> Precision:
        """The tier of a call that asks for none: --precision where the engine has that tier, else
        lossless (on a CPU, or where the fast tier's kernels are unavailable: the server says so at
        start-up), so that what the server offers, decodes and names in its identity agree."""
        return self.config.precision if self.config.precision in self._engine_precisions else Precision.LOSSLESS

    @property
    def _engine_precisions(self) -> tuple[str, ...]:
        """The tiers the served engine has (lossless alone before one serves)."""
        engine = self.pool.engine
        return engine.info.precisions if engine is not None else (Precision.LOSSLESS,)

    def default_fps(self) -> int:
        """The served model's frame rate: server-side video's fps when a call asks for none."""
        engine = self.pool.engine
        return default_fps(engine.patch_size if engine is not None else None)

    def identities(self) -> tuple[str, str]:
        """(decoder identity, encoder identity) of the served model (`vaed.identity`: the engine's,
        with this server's default tier); ("", "") while no device serves. Made once per engine."""
        engine = self.pool.engine
        if engine is None:
            return "", ""
        made = self._identities
        if made is None or made[0] is not engine:
            made = self._identities = (engine, (engine.identity.decoder(self.default_precision),
                                                engine.identity.encoder()))
        return made[1]

    def model_facts(self) -> ModelFacts:
        engine = self.pool.engine
        if engine is None:
            raise NotReady("no device is serving; see the server log")
        info = engine.info
        cfg = self.config
        decoder_identity, encoder_identity = self.identities()
        return ModelFacts(
            model=cfg.model,
            z_dim=engine.z_dim,
            scale_factor_temporal=engine.scale_temporal,
            scale_factor_spatial=engine.scale_spatial,
            latents_mean=engine.latents_mean,
            latents_std=engine.latents_std,
            compute_dtype=info.dtype,
            device=info.device,
            random_weights=info.random_weights,
            max_message_bytes=cfg.max_message_bytes,
            max_latent_frames=cfg.max_latent_frames,
            max_pixels=cfg.max_pixels,
            max_batch=cfg.max_batch,
            kernels=info.kernels,
            layout=info.layout,
            fast_paths_note=info.fast_paths_note,
            precisions=self.offered,
            # a spatial group is one worker whose engine spans every configured device
            devices=(list(cfg.devices) if engine.describe() != Parallel.OFF
                     else [w.device for w in self.pool.healthy_workers]),
            parallel=engine.describe(),
            encodes=engine.encodes,
            encode_precisions=ENCODE_PRECISIONS if engine.encodes else (),
            encode_dtypes=engine.encode_dtypes,
            video_fps=self.default_fps() if self.packaging is not None else 0,
            decoder_identity=decoder_identity,
            encoder_identity=encoder_identity,
        )

    def _limits(self) -> Limits:
        engine = self.pool.engine
        if engine is None:
            raise NotReady("no device is serving; see the server log")
        cfg = self.config
        return Limits(
            z_dim=engine.z_dim, scale_spatial=engine.scale_spatial, scale_temporal=engine.scale_temporal,
            max_batch=cfg.max_batch, max_latent_frames=cfg.max_latent_frames, max_pixels=cfg.max_pixels,
        )

    def output_spec(self, requested: RequestedOutput) -> OutputSpec:
        precision = requested.precision or self.default_precision
        if precision not in self.offered:
            raise InvalidInput(
                f"precision {precision} is not offered by this server; it offers {', '.join(self.offered)}")
        return OutputSpec(
            rgb8=requested.rgb8, raw_dtype=requested.raw_dtype, raw_latents=requested.raw_latents,
            precision=precision, allow_non_finite=requested.allow_non_finite,
            # H.264 is encoded from yuv420p: converted on the device (`vaed.yuv`); lossless takes RGB
            yuv420p=requested.video is not None and not requested.video.lossless,
        )

    # -- the stages a call goes through ------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[SessionSlot]:
        self.check_serving()
        slot = self.pool.admit()
        try:
            yield slot
        finally:
            slot.release()

    # -- a first message's checks on its header alone ---------------------------------------

    def check_decode_head(self, message: InputMessage) -> None:
        """A Decode's first-message checks run on its header alone (the request id, the options,
        the latents' shape and dtype against the model and the limits), for a front whose request
        head holds all they read (HTTP's query): a request they refuse is refused before admission
        and before its body. The session they make is dropped unattached: nothing is admitted."""
        session, _ = self._open(CallRecord("Decode", "-"), message)
        session.validate(*message.latents.header())

    def check_encode_head(self, message: VideoMessage, *, shape_known: bool = True) -> None:
        """As `check_decode_head`, for an Encode; frames whose shape the head does not say (an
        image file's, `shape_known` False) meet the shape checks with their body."""
        session = self._open_encode(CallRecord("Encode", "-"), message)
        if shape_known:
            session.validate(*message.frames.header())

    def _open(self, record: CallRecord, message: InputMessage) -> tuple[Session, RequestedOutput]:
        """The session of a call's first message (request id, output spec, limits) and its options."""
        record.request_id = checked_request_id(message.request_id)
        requested = message.options() if message.options is not None else RequestedOutput()
        if requested.video is not None:
            self._check_video(requested, message.latents)
        session = Session(
            record, self.output_spec(requested), self._limits(), loop=asyncio.get_running_loop(),
            credits=self.config.queue_chunks, max_backlog_frames=self.config.max_backlog_frames,
        )
        return session, requested

    def _check_video(self, requested: RequestedOutput, latents: LatentsIn) -> None:
        """What server-side video cannot do, refused before the session opens."""
        if self.packaging is None:
            raise InvalidInput("this server does not package video; ask for RGB8 frames")
        assert requested.rgb8  # a front asks video of the RGB8 frames
        if requested.skip_frames:
            raise InvalidInput(
                f"skip_frames ({requested.skip_frames}) does not apply to MP4 output: a resumed MP4 call "
                "asks for the whole video again (the encoder's bytes differ between hosts)")
        shape = latents.header()[0]
        if len(shape) != 5:  # another rank: the latents' own checks refuse it
            return
        if shape[0] != 1:
            raise InvalidInput(f"MP4 output holds one video: send batch 1, got {shape[0]}")
        try:
            check_frame_size(*self._limits().frame_size(shape[3], shape[4]))
        except VideoError as exc:
            raise InvalidInput(str(exc)) from None

    async def _video(
        self, pieces: AsyncGenerator[Out, None], options: VideoOptions, frame_size: tuple[int, int] | None,
        yuv420p: bool, launched: asyncio.Event,
    ) -> AsyncGenerator[Out, None]:
        """The call's frame pieces encoded, in order, on the packaging pool: `VideoOut` bytes as
        each piece releases them (the init segment with the first), the rest at the CallEnd. A
        piece's group credit goes back when the next piece is asked for: after its bytes went out.
        When `frame_size` (H, W) is known, the encoder opens once frame 0's kernels are
        `launched` (the session's event), while the GPU decodes frame 0.
        `yuv420p`: the pieces hold the planes the session made on the device (`OutputSpec`)."""
        assert self.packaging is not None
        packager = self.packaging.packager(options)
        if frame_size is not None:
            packager.open_early(*frame_size, after=launched)
        try:
            async for item in pieces:
                if isinstance(item, FramesOut):
                    data = await packager.add(item.frames[0].numpy(), yuv420p=yuv420p)
                    if data:
                        yield VideoOut(item.request_id, item.chunk_index, item.first_frame, data)
                    continue
                assert isinstance(item, CallEnd)
                tail = await packager.close()
                if tail:  # a fragmented MP4's last fragment went out with the last frame: nothing is left
                    yield VideoOut(item.request_id, item.groups, item.frames, tail)
                yield item
        except VideoError as exc:
            raise InvalidInput(str(exc)) from None
        finally:
            packager.discard()

    def _output_of(self, session: Session, requested: RequestedOutput) -> AsyncGenerator[Out, None]:
        """Frames, or their video when the call asked for it (its frame size from the latents
        the session accepted)."""
        pieces = self._output(session, requested.skip_frames)
        if requested.video is None:
            return pieces
        shape = session.record.shape
        frame_size = None if shape is None else session.limits.frame_size(shape[3], shape[4])
        return self._video(pieces, requested.video, frame_size, session.output.yuv420p, session.launched)

    @staticmethod
    def _accept(session: Session, latents: LatentsIn) -> None:
        """Validate the latents' header against the session, then copy and queue them."""
        shape, dtype = latents.header()
        session.validate(shape, dtype)
        session.accept(latents.to_tensor())

    async def _output(self, session: Session, skip_frames: int = 0) -> AsyncGenerator[Out, None]:
        """The session's frame pieces, then the CallEnd; raises the session's failure. Frames
        before `skip_frames` (a resumed call's, already delivered elsewhere) are decoded but not
        sent: their latent frames still build the causal cache the later frames need."""
        record = session.record
        cap = self.config.frame_message_bytes
        time_dim = session.output.time_dim
        groups = frames_total = 0  # of the whole video, skipped ones included (the CallEnd's counts)
        while (decoded := await session.next_group()) is not None:
            groups += 1
            frames_total += decoded.frames.shape[time_dim]
            group = self._unsent_part(decoded, record, time_dim, skip_frames)
            if group is None:
                session.group_sent()
                continue
            if record.first_step_s is None:
                record.first_wait_s = group.step_started - record.started
                record.first_step_s = group.device_seconds
                record.first_gpu_s = group.gpu_seconds
                record.first_launch_s = group.launch_seconds
            for piece in frame_pieces(group, record.request_id, time_dim, cap):
                yield piece
                if record.first_frame_at is None:
                    record.first_frame_at = time.perf_counter()
            session.group_sent()  # the front asked for the next item: the group went out
            frames = group.frames.shape[time_dim]
            record.groups_out += 1
            record.frames_out += frames
            record.device_seconds += group.device_seconds
            if self.metrics is not None:  # every video of the batch: a B = 2 group is twice the work
                batch = group.frames.shape[0]
                self.metrics.frames_decoded(batch * frames, batch)
        yield CallEnd(record.request_id, groups, frames_total)

    def _unsent_part(self, group: HostGroup, record: CallRecord, time_dim: int, skip_frames: int) -> HostGroup | None:
        """What of `group` a call that skips its first `skip_frames` frames sends: all of it, its
        tail (a group across the boundary) or nothing (None). Skipped frames are counted in the
        record, the log line and vaed_skipped_frames_total."""
        if group.first_frame >= skip_frames:
            return group
        frames = group.frames.shape[time_dim]
        cut = min(frames, skip_frames - group.first_frame)
        record.skipped_frames += cut
        if self.metrics is not None:
            self.metrics.frames_skipped(cut, latent_frames=1 if cut == frames else 0)
        if cut == frames:
            record.device_seconds += group.device_seconds
            return None
        return dataclasses.replace(
            group, first_frame=skip_frames, frames=group.frames.narrow(time_dim, cut, frames - cut))

    async def _decode(self, record: CallRecord, input: CallInput[Any]) -> AsyncGenerator[Out, None]:
        timeout = self.config.session_first_message_timeout
        async with self._admitted() as slot:
            raw = await first_message(input.receive, "Decode", timeout)
            if raw is None:
                raise InvalidInput("Decode needs one DecodeRequest message")
            message = input.parse(raw)
            session, requested = self._open(record, message)
            self._accept(session, message.latents)
            del message, raw  # the session holds the only copy of the latents
            session.finish_input()
            worker = self.pool.attach(session, slot)
            more = asyncio.create_task(self._refuse_a_second_message(input.receive, session, timeout))
            try:
                async for item in self._output_of(session, requested):
                    if isinstance(item, CallEnd):
                        await more  # the call succeeds only once its one message was all it sent
                    yield item
            finally:
                more.cancel()
                with contextlib.suppress(asyncio.CancelledError, InvalidInput):
                    await more
                worker.detach(session)

    async def _decode_stream(self, record: CallRecord, input: CallInput[Any]) -> AsyncGenerator[Out, None]:
        async with self._admitted() as slot:
            raw = await first_message(input.receive, "DecodeStream", self.config.session_first_message_timeout)
            if raw is None:
                # Opened and half-closed with no chunk: an empty, successful session.
                record.request_id = checked_request_id("")
                yield CallEnd(record.request_id, 0, 0)
                return
            first = input.parse(raw)
            session, requested = self._open(record, first)
            self._accept(session, first.latents)
            del first, raw
            worker = self.pool.attach(session, slot)
            reader = asyncio.create_task(self._read_rest(input, session, lambda chunk: chunk.latents))
            try:
                async for item in self._output_of(session, requested):
                    yield item
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                worker.detach(session)

    @staticmethod
    async def _refuse_a_second_message(receive: Receive, session: Session, timeout: float) -> None:
        """Decode is unary: read on to the client's half-close, and fail the call if a second
        message comes first (gRPC's unary handlers would otherwise just ignore it). A client
        that never half-closes gets `timeout` s after its frames went out, then DEADLINE_EXCEEDED."""
        def late() -> ClientIdle:
            return ClientIdle(
                f"the Decode call was not half-closed within {timeout:g} s after its frames were sent "
                "(the server's --session-first-message-timeout); a unary call sends one message and its end")

        if await session.next_message(receive, timeout, late) is not None:
            exc = InvalidInput("Decode takes exactly one DecodeRequest and a second message arrived; "
                               "send latents in several messages with DecodeStream")
            session.fail(exc)
            raise exc

    async def _read_rest(self, input: CallInput[Any], session: Session, tensor: Callable[[Any], LatentsIn]) -> None:
        """Feed the session's later chunks (`tensor` picks a parsed message's input: latents or
        frames), reading the next one only while its backlog has room (the front's flow control
        then holds the client); a bad chunk fails the session."""
        method = session.record.method
        try:
            while True:
                await session.wait_for_room()  # a full backlog is the server's wait: not idle
                raw = await session.next_message(input.receive, self.config.session_idle_timeout)
                if raw is None:
                    break
                chunk = input.parse(raw)
                if chunk.options is not None:
                    raise InvalidInput(
                        f"options are only accepted on the first message of a {method}; "
                        f"chunk {session.record.chunks_in} carried options"
                    )
                self._accept(session, tensor(chunk))
            session.finish_input()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            session.fail(exc)

    # -- Encode ----------------------------------------------------------------------------

    def _open_encode(self, record: CallRecord, message: VideoMessage) -> EncodeSession:
        """The Encode session of a call's first message: request id, spec, limits, trailing zeros."""
        record.request_id = checked_request_id(message.request_id)
        requested = message.options() if message.options is not None else RequestedEncode()
        engine = self.pool.engine
        assert engine is not None  # _check_encodes ran
        precision = requested.precision or ENCODE_PRECISIONS[0]
        if precision not in ENCODE_PRECISIONS:
            raise InvalidInput(f"precision {precision} is not offered for Encode by this server; "
                               f"it offers {', '.join(ENCODE_PRECISIONS)}")
        offered = engine.encode_dtypes
        if requested.encode_dtype not in (None, *offered):
            raise InvalidInput(f"encode_dtype {requested.encode_dtype} is not offered by this server; "
                               f"it encodes in {', '.join(str(d) for d in offered)}")
        cfg = self.config
        limits = self._limits()
        # checked before any frame came: the zero frames alone, the call's own frames to come on top
        limits.check_frame_count(requested.trailing_zero_frames,
                                 "trailing zero frames (before the call's own frames, on top of them)")
        spec = EncodeSpec(latents=requested.latents, out_dtype=requested.out_dtype, precision=precision,
                          allow_non_finite=requested.allow_non_finite, dtype=requested.encode_dtype or offered[0])
        return EncodeSession(
            record, spec, limits, loop=asyncio.get_running_loop(),
            credits=cfg.queue_chunks, max_backlog_frames=cfg.max_backlog_frames,
            trailing_zero_frames=requested.trailing_zero_frames,
        )

    def _check_encodes(self) -> None:
        self.check_serving()
        engine = self.pool.engine
        if engine is None or not engine.encodes:
            raise InvalidInput("this server does not encode: it was started without --encode "
                               "(ModelInfo.encodes says so)")

    async def _encode(self, record: CallRecord, input: CallInput[Any]) -> AsyncGenerator[Any, None]:
        """As DecodeStream: admitted, the first chunk (with the options) opens the session, a
        reader feeds the rest under backpressure, latent frames stream back as each encoder call
        finishes, then the CallEnd (groups = frames = latent frames)."""
        self._check_encodes()
        async with self._admitted() as slot:
            raw = await first_message(input.receive, "Encode", self.config.session_first_message_timeout)
            if raw is None:
                raise InvalidInput("Encode needs at least one VideoChunk (frames and options)")
            first = input.parse(raw)
            session = self._open_encode(record, first)
            self._accept(session, first.frames)
            del first, raw
            worker = self.pool.attach(session, slot)
            reader = asyncio.create_task(self._read_rest(input, session, lambda chunk: chunk.frames))
            try:
                async for item in self._latent_frames(session):
                    yield item
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                worker.detach(session)

    async def _latent_frames(self, session: Session) -> AsyncGenerator[Any, None]:
        record = session.record
        count = 0
        while (group := await session.next_group()) is not None:
            if record.first_step_s is None:
                record.first_wait_s = group.step_started - record.started
                record.first_step_s = group.device_seconds
                record.first_gpu_s = group.gpu_seconds
                record.first_launch_s = group.launch_seconds
            yield LatentFrameOut(record.request_id, group.chunk_index, group.frames, group.latents)
            if record.first_frame_at is None:
                record.first_frame_at = time.perf_counter()
            session.group_sent()  # the front asked for the next item: the latent frame went out
            count += 1
            record.groups_out += 1
            record.frames_out += 1
            record.device_seconds += group.device_seconds
        yield CallEnd(record.request_id, count, count)
