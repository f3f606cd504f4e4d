"""Resumable calls, the part of the shared core that decides (both front-ends only wait).

A vaed decode is deterministic: the same latents give the same frames on any
replica of the same model and GPU type (lossless frames are stock diffusers'
bits). So a call whose server dies mid-video is resumed, not failed: the
client opens the call again (on another target of its list, or on the same
`dns:///` name, whose round_robin channel drops the dead replica), replays
the latents it holds, and sets `DecodeOptions.skip_frames` to the frames it
already delivered. The server decodes every latent frame again (the causal
cache needs them) and sends only the rest, so the application sees every
frame exactly once and the result equals an undisturbed call bit for bit.

* Retried: UNAVAILABLE (connection reset, GOAWAY, kill -9, a keepalive
  timeout, a server warming up or draining, a device failure on the server),
  RESOURCE_EXHAUSTED (sessions full or out of memory: another replica may
  have room; so only with several targets or a `dns:` name, never on the
  one server that said it), CANCELLED that this client did not ask for (a server
  cutting a call at the end of its drain grace sends UNAVAILABLE), and grpc.aio's
  INTERNAL "Internal error from Core" for a
  call that ended while the client still wrote, whose status gRPC lost (as UNAVAILABLE).
  Never: INVALID_ARGUMENT, UNAUTHENTICATED, DEADLINE_EXCEEDED (the call's own
  timeout covers all its attempts), INTERNAL and the rest: retrying a request
  the server refused gives the same answer.
* Bounded: `ResumePolicy.max_resumes` attempts after the first, with
  exponential backoff (none when the next target has not failed in this call).
* Exactly once: `Progress.accept` passes on only frames past those delivered
  (a server without skip_frames resends from frame 0; its extra frames are
  dropped here) and refuses a gap.
* Encode (`VaeClient.encode`, `AsyncVaeClient.encode`) resumes the same way, by
  latent frame: the encoder is causal and deterministic, so the new attempt
  sends the caller's frames again and the client drops the latent frames it
  already delivered (`Progress.accept_latent`). No skip option is sent: the
  server must run every encoder call again anyway (each latent frame needs
  the cache of all before it), and what a skip would save is the delivered
  moments' bytes, 1/24 of the frames' in the same dtype for Wan2.1 (a latent
  frame's 2 x 16 channels at 1/64 of the pixels against its 4 frames x 3
  channels; 1/32 for Wan2.2), so nothing new goes on the wire.
* Sessions keep every pushed latent message for replay until the session
  ends, up to `max_replay_bytes` (256 MiB by default: 81 frames of 480x832
  latents are 4.2 MB in bf16, 8.5 MB in fp32). Past it the held latents are
  dropped and the session is no longer resumable: a later failure raises as
  it would without resume (logged once when it happens).
* One decoder per call: every server sends what decides its bits (weights
  digest, compute dtype, default tier, kernels, layout, device kind, spatial
  group; `vaed.identity`) as the initial metadata of Decode and DecodeStream
  (`wire.DECODER_IDENTITY_HEADER`; Encode: the encoder's,
  `wire.ENCODER_IDENTITY_HEADER`), ahead of its first reply. The front-ends
  read each attempt's before taking any of its replies (`Progress.check_server`:
  no extra call, and on the first attempt nothing to wait for beyond its first
  reply). The first identity a call sees is its own; a later attempt whose
  server sends another is ended unused (`ReplicaMismatchError`), its target is
  not tried again in this call (a `dns:` name is: its next attempt may reach
  another replica) and the call resumes on another, within `max_resumes`. When
  no target is left, or the others fail until the resumes run out, the call
  raises `ReplicaMismatchError` naming the parts that differ, rather than join
  two decoders' frames. A server that sends no identity (older than the
  header) is never refused, and an attempt is compared only when it and an
  earlier one both sent one: there is nothing to compare otherwise, so a target
  list that mixes such servers is as unchecked as before the header. An MP4
  call's attempts are not compared: each starts its file over, so it joins
  nothing of two decoders (a rolling update to other weights had failed it).
* The error that ends a resumed call names the call's request id, its resumes,
  the targets tried and the frames delivered, after the last failure's message.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from . import wire
from .errors import (
    ClientClosedError,
    DeadlineExceededError,
    InternalError,
    ReplicaMismatchError,
    UnavailableError,
    VaedError,
    from_rpc_error,
)
from .tensors import TensorFormatError, storage_view
from .video import TIME_AXIS, check_layout

log = logging.getLogger("vaed_client.resume")
pb = wire.pb

# What grpc.aio's INTERNAL says when a request message was written into a call that had ended: the
# status that ended it (the server's) is lost (`Progress.error_of`).
LOST_STATUS_DETAILS = "Internal error from Core"
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})
# What ends an attempt for `Progress.retry_delay` to judge: the call's failure, or its server refused
# before any of its replies was taken (`Progress.check_server`).
ATTEMPT_FAILURES = (grpc.RpcError, ReplicaMismatchError)
# A target that failed is avoided for this long when another one is left (seconds).
FAILED_TARGET_COOLDOWN = 5.0
# ... doubled for each failure in a row that no answer from the target broke, up to this: a hung
# replica (it takes 15-80 s to fail a call) was otherwise tried again by a new call every 5 s.
MAX_TARGET_COOLDOWN = 80.0


@dataclass(frozen=True)
class ResumePolicy:
    """How a call survives its server: attempts, backoff, and a session's replay bound."""

    max_resumes: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    max_replay_bytes: int = 256 * 1024 * 1024

    def backoff(self, repeats: int) -> float:
        """Seconds before an attempt on a target that already failed `repeats` >= 1 times in this call."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (repeats - 1))
        return base * random.uniform(0.8, 1.2)  # jitter: many clients of one dead replica do not come back at once


NO_RESUME = ResumePolicy(max_resumes=0, max_replay_bytes=0)


def policy_of(resume: ResumePolicy | bool | None) -> ResumePolicy:
    """`resume=` of the clients: a policy, True/None (the default policy) or False (never resume)."""
    if resume is False:
        return NO_RESUME
    if resume is None or resume is True:
        return ResumePolicy()
    if isinstance(resume, ResumePolicy):
        return resume
    raise TypeError(f"resume must be a ResumePolicy or a bool, not {type(resume).__name__}")


@dataclass
class CallReport:
    """What happened to one call: pass one as `report=` (or read `session.report`).

    `resumes`: times the call was opened again; `reasons`: why (status and
    message of each failure); `recovery_seconds`: from each failure to the
    first frame after it (or the call's end when nothing was left to send);
    `targets`: the target of each attempt; `first_data_seconds`: from the call's
    start to its first frames (or MP4 bytes, or an encode's first latent frame)
    received, None until then."""

    resumes: int = 0
    reasons: list[str] = field(default_factory=list)
    recovery_seconds: list[float] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    first_data_seconds: float | None = None


class Targets:
    """The client's targets: calls start round-robin over the list, and a failed target is avoided
    while another is left: FAILED_TARGET_COOLDOWN s, doubled for each further failure before the
    target answers again (`answered`), up to MAX_TARGET_COOLDOWN. One `dns:///` name is one target
    (its channel balances over the replicas itself)."""

    def __init__(self, targets: Sequence[str]) -> None:
        if not targets:
            raise ValueError("at least one target is needed")
        self.names = list(targets)
        self._next = 0
        self._failed_at = [float("-inf")] * len(self.names)
        self._failures = [0] * len(self.names)  # in a row, since the target last answered

    def cooldown(self, index: int) -> float:
        """How long target `index` is avoided after its last failure."""
        failures = self._failures[index]
        return min(FAILED_TARGET_COOLDOWN * 2.0 ** max(failures - 1, 0), MAX_TARGET_COOLDOWN)

    def answered(self, index: int) -> None:
        """Target `index` sent a call data: its failures in a row start over."""
        self._failures[index] = 0

    @property
    def elsewhere(self) -> bool:
        """Whether a retry can reach another replica: several targets, or a `dns:` name (its
        round_robin channel sends the next call to the next address)."""
        return len(self.names) > 1 or self.names[0].startswith("dns:")

    def first(self, *, takes_turn: bool = True) -> int:
        """The target of a new call: the next in turn that has not failed recently. A call that
        decodes nothing (GetModelInfo: every replica has the same answer) leaves the turn to
        the next decode."""
        start = self._next
        if takes_turn:
            self._next = (self._next + 1) % len(self.names)
        return self._healthiest(start, exclude=None)

    def after_failure(self, index: int, refused: set[int] | frozenset[int] = frozenset()) -> int:
        """Mark `index` failed; the target to resume on (another one when there is one), none of
        `refused` (targets of another decoder than the call's) while another is left."""
        self._failed_at[index] = time.monotonic()
        self._failures[index] += 1
        return self._healthiest(index + 1, exclude=index, refused=refused)

    def instead_of(self, index: int, refused: set[int] | frozenset[int]) -> int:
        """The target to resume on after `index` served another decoder than the call's: it is not
        marked failed (it serves; other calls may start there)."""
        return self._healthiest(index + 1, exclude=index, refused=refused)

    def _healthiest(self, start: int, exclude: int | None, refused: set[int] | frozenset[int] = frozenset()) -> int:
        n = len(self.names)
        order = [(start + k) % n for k in range(n)]
        usable = [i for i in order if i not in refused] or order
        candidates = [i for i in usable if i != exclude] or usable
        now = time.monotonic()
        fresh = [i for i in candidates if now - self._failed_at[i] >= self.cooldown(i)]
        if fresh:
            return fresh[0]
        return min(candidates, key=lambda i: self._failed_at[i])  # the one that failed longest ago


class Progress:
    """One logical call across its attempts: the frames delivered (always a prefix of the video:
    one call's frames arrive in order), the attempts, and what to do after a failure."""

    def __init__(self, policy: ResumePolicy, targets: Targets, report: CallReport | None,
                 timeout: float | None, request_id: str, takes_turn: bool = True, encoder: bool = False,
                 client_closed: Callable[[], bool] = lambda: False, joins_attempts: bool = True) -> None:
        self.policy = policy
        # False: each attempt's answer starts over (an MP4 call's file), so nothing of two decoders
        # is ever joined and its attempts' identities are not compared (`check_server`)
        self.joins_attempts = joins_attempts
        # whether the application closed the client: an attempt that fails then is not resumed
        self._client_closed = client_closed
        self.targets = targets
        self.report = report if report is not None else CallReport()
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        # the caller's id, else the one the first server answered with (it makes one up): the
        # warning after a failure and the resumed attempt then name the call as that server's log did
        self.request_id = request_id
        self.delivered = 0        # frames handed to the application
        self.target = targets.first(takes_turn=takes_turn)
        self.report.targets.append(targets.names[self.target])
        self._repeats: dict[int, int] = {}  # failures per target in this call
        self._failed_at: float | None = None
        self.cancelled = False    # set by the front-end when the application cancels
        # an Encode compares its servers' encoders, and counts latent frames
        self.kind, self.unit = ("encoder", "latent frames") if encoder else ("decoder", "frames")
        self.header = wire.ENCODER_IDENTITY_HEADER if encoder else wire.DECODER_IDENTITY_HEADER
        self.identity: str | None = None  # the call's: the first that an attempt's server sent
        self._identity_from = ""  # the target that sent it
        self._refused: set[int] = set()  # targets of another identity: not tried again in this call
        self._mismatch: ReplicaMismatchError | None = None  # the last such refusal

    # -- per attempt --------------------------------------------------------------
    @property
    def resumed(self) -> bool:
        return self.report.resumes > 0

    def options(self, base: Any) -> Any:
        """The call's DecodeOptions for this attempt: skip what was delivered, under the call's id
        (a resumed MP4 call delivers no frames, yet keeps the id its first server gave it)."""
        if not self.delivered and (base.request_id or not self.request_id):
            return base
        options = pb.DecodeOptions()
        options.CopyFrom(base)
        if self.delivered:
            options.skip_frames = self.delivered
        options.request_id = options.request_id or self.request_id
        return options

    def encode_options(self, base: Any) -> Any:
        """The call's EncodeOptions for this attempt: a resumed one under the id the first server
        gave a call sent without one (a decode's `options` does the same)."""
        if base.request_id or not self.request_id:
            return base
        options = pb.EncodeOptions()
        options.CopyFrom(base)
        options.request_id = self.request_id
        return options

    def _adopt_request_id(self, reply: Any) -> None:
        if not self.request_id:
            self.request_id = reply.request_id

    def remaining(self) -> float | None:
        """The attempt's timeout: what is left of the call's."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._final(DeadlineExceededError("the call's timeout ran out while resuming it"))
        return left

    def check_server(self, metadata: Any) -> None:
        """An attempt's initial metadata, read before any of its replies is taken. The first
        identity the call sees becomes the call's; a later attempt whose server sends another raises
        ReplicaMismatchError (the front-end ends that attempt and asks `retry_delay`). An attempt
        without one (a server older than the header) is not compared, nor one before any had one."""
        got = identity_of(metadata, self.header)
        if got is None:
            return
        here = self.targets.names[self.target]
        if self.identity is None or not self.joins_attempts:
            self.identity, self._identity_from = got, here
            return
        if got == self.identity:
            return
        first = self._identity_from
        who = (f"a replica behind {here} serves another {self.kind} than the one that served this call first"
               if here == first else f"{here} serves another {self.kind} than {first}, which served this call first")
        raise ReplicaMismatchError(f"{who} ({identity_difference(self.identity, got)})")

    def accept(self, reply: Any, wire_format: str) -> Any | None:
        """A reply -> the part of it the application has not seen (None: nothing new), counted as
        delivered. Replies without frames (the final marker) pass as they are."""
        self._adopt_request_id(reply)
        if self._failed_at is not None and (reply.final or reply.HasField("frames")):
            self._recovered()
        if reply.HasField("frames") or reply.video:
            self.targets.answered(self.target)
            if self.report.first_data_seconds is None:
                self.report.first_data_seconds = time.monotonic() - self.started
        if not reply.HasField("frames") or not len(reply.frames.shape):
            return reply
        check_layout(tuple(reply.frames.shape), wire_format, reply.frames.dtype)
        axis = TIME_AXIS[wire_format]
        count = int(reply.frames.shape[axis])
        first = int(reply.first_frame)
        if first > self.delivered:
            raise InternalError(f"server skipped frames {self.delivered}..{first - 1} (request {self.request_id})")
        if first + count <= self.delivered:
            return None  # all seen before the resume (a server that ignored skip_frames)
        if first < self.delivered:
            reply = _tail(reply, self.delivered - first, axis)
            count = first + count - self.delivered
        self.delivered += count
        return reply

    def accept_latent(self, reply: Any) -> Any | None:
        """An Encode reply -> itself when its latent frame is the next one the application gets,
        None when an earlier attempt delivered it already (a resumed encode runs the whole
        video again: see `encode_resume`); the final marker passes as it is."""
        self._adopt_request_id(reply)
        if reply.final:
            if self._failed_at is not None:
                self._recovered()
            return reply
        index = int(reply.latent_frame)
        if index > self.delivered:
            raise InternalError(f"server skipped latent frames {self.delivered}..{index - 1} "
                                f"(request {self.request_id})")
        if index < self.delivered:
            return None  # the resumed attempt's frames before the failure point: not a recovery yet
        if self._failed_at is not None:
            self._recovered()
        self.targets.answered(self.target)
        if self.report.first_data_seconds is None:
            self.report.first_data_seconds = time.monotonic() - self.started
        self.delivered += 1
        return reply

    def _recovered(self) -> None:
        assert self._failed_at is not None
        self.report.recovery_seconds.append(time.monotonic() - self._failed_at)
        self._failed_at = None

    # -- after a failure --------------------------------------------------------------
    def error_of(self, failure: grpc.RpcError | ReplicaMismatchError) -> VaedError:
        """The VaedError an attempt's failure (`ATTEMPT_FAILURES`) stands for: a refused replica's
        ReplicaMismatchError is its own. grpc.aio reports a message written into a call that has
        just ended as INTERNAL ("Internal error from Core", `LOST_STATUS_DETAILS`) in place of the
        status that ended it. Seen once the call's own timeout has run out, that is the timeout (a
        deadline's status is best effort in grpc: a server-side cancel can arrive first as a bare
        stream reset), so the caller gets the DEADLINE_EXCEEDED its timeout asked for. Before it, it
        is a server that ended the call while the client still wrote (an overloaded server's
        refusal, 6 of 60 calls flooding one with a session), so UNAVAILABLE: the attempt is
        retried like a lost connection, and the next one gets the server's own answer."""
        if isinstance(failure, ReplicaMismatchError):
            return failure
        error = from_rpc_error(failure)
        if not (isinstance(error, InternalError) and error.details == LOST_STATUS_DETAILS):
            return error
        if self.deadline is not None and time.monotonic() >= self.deadline:
            late: VaedError = DeadlineExceededError(f"the call's timeout ran out (gRPC reported: {error.details})")
        else:
            late = UnavailableError(f"the server ended the call while this client was still sending, and gRPC "
                                    f"lost the status it sent (gRPC reported: {error.details})")
        late.__cause__ = error
        return late

    def closed_error(self, details: str) -> ClientClosedError | None:
        """What ends an attempt that failed because the application closed the client (`details`:
        what the attempt saw), else None."""
        if not self._client_closed():
            return None
        return ClientClosedError(f"the client was closed during the call ({details})")

    def retry_delay(self, error: VaedError, *, resumable: bool = True) -> float:
        """Seconds to wait before the next attempt, or raise the call's final error (`_final`) when
        it ends here: not a retryable status, cancelled by the application, out of attempts or
        time, not resumable (a session whose held latents passed the bound), or no target left
        that may serve its decoder. A ReplicaMismatchError (`check_server`) moves to another
        target like a failure, without marking the refused one failed."""
        error.__suppress_context__ = True  # raised from the caller's `except grpc.RpcError`: no grpc chain
        code = error.code
        failed = self.target
        mismatch = isinstance(error, ReplicaMismatchError)
        if isinstance(error, ReplicaMismatchError):  # as `mismatch`, spelt out for the type checker
            self._mismatch = error
            if not self.targets.names[failed].startswith("dns:"):  # one address, one decoder
                self._refused.add(failed)
        closed = self.closed_error(error.details)
        if closed is not None:  # the application's doing (grpc's CANCELLED "Channel closed!"), as a cancel
            raise closed
        if self.cancelled or (code not in RETRYABLE and not mismatch):
            raise self._final(error)
        if not resumable:
            raise self._final(error, "the session is no longer resumable (its latents passed max_replay_bytes)")
        if self.report.resumes >= self.policy.max_resumes:
            raise self._final(error, f"the call's resumes ran out (max_resumes {self.policy.max_resumes})")
        if len(self._refused) == len(self.targets.names):
            raise self._final(error, "no other target is left to resume on")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not self.targets.elsewhere:
            # Sessions full or out of memory: the same server would answer the same.
            raise self._final(error)
        if mismatch:
            self.target = self.targets.instead_of(failed, self._refused)
        else:
            self._repeats[failed] = self._repeats.get(failed, 0) + 1
            self.target = self.targets.after_failure(failed, self._refused)
        repeats = self._repeats.get(self.target, 0)
        delay = self.policy.backoff(repeats) if repeats else 0.0
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            raise self._final(error, "the call's timeout ran out")
        self.report.resumes += 1
        assert code is not None  # RETRYABLE holds status codes only
        reason = f"{'MISMATCH' if mismatch else code.name}: {error.details}"
        self.report.reasons.append(reason)
        self.report.targets.append(self.targets.names[self.target])
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        log.warning("request %s: %s %s after %d %s (%s); resuming on %s in %.2f s (resume %d of %d)",
                    self.request_id or "-", self.targets.names[failed], "refused" if mismatch else "failed",
                    self.delivered, self.unit, reason,
                    self.targets.names[self.target], delay, self.report.resumes, self.policy.max_resumes)
        return delay

    def _final(self, error: VaedError, why: str = "") -> VaedError:
        """The error that ends the call (`why`: the reason it cannot resume). After a server of
        another decoder was refused, a call that ends for want of a target of its own (`error` the
        refusal, or a later failure of a retryable kind) raises ReplicaMismatchError saying so; any
        other error that ends a resumed call gets the call's request id, resumes, targets tried and
        frames delivered after its message."""
        mismatch = self._mismatch
        if mismatch is not None and not self.cancelled and (error is mismatch or error.code in RETRYABLE):
            last = "" if error is mismatch else f" (the last failure: {error})"
            final: VaedError = ReplicaMismatchError(
                f"{mismatch.details}: its {self.unit} are not joined to the first's, and "
                f"{why or 'the call cannot resume'}{last} [{self._context()}]")
        elif not self.report.resumes:
            return error
        else:  # why it stops here (resumes or time run out, ...), where that is not the error itself
            final = type(error)(f"{error.details}{f'; {why}' if why else ''} [{self._context()}]", error.code)
        final.__cause__ = error.__cause__  # the message holds `error`'s: its own cause, if any, stays
        final.__suppress_context__ = True
        return final

    def _context(self) -> str:
        tried = ", ".join(dict.fromkeys(self.report.targets))
        resumes = self.report.resumes
        return (f"request {self.request_id or '-'}: {resumes} resume{'' if resumes == 1 else 's'} "
                f"over {tried}; {self.delivered} {self.unit} delivered")


def identity_of(metadata: Any, header: str) -> str | None:
    """The value of `header` in a call's initial metadata (sync: a tuple of pairs; grpc.aio:
    Metadata, also pairs), None when absent or empty (a server older than the header)."""
    for key, value in metadata or ():
        if key == header and value:
            return value if isinstance(value, str) else bytes(value).decode("ascii", "replace")
    return None


def identity_difference(first: str, other: str) -> str:
    """The parts in which two identity lines differ, "name: first's vs other's" each."""
    a, b = wire.identity_parts(first), wire.identity_parts(other)
    names = list(dict.fromkeys([*a, *b]))
    differ = [f"{name}: {a.get(name, '(none)')} vs {b.get(name, '(none)')}" for name in names
              if a.get(name) != b.get(name)]
    return "; ".join(differ) or f"{first!r} vs {other!r}"


def _tail(reply: Any, cut: int, axis: int) -> Any:
    """A copy of a FrameChunk without its first `cut` frames."""
    try:
        view = storage_view(reply.frames)
    except TensorFormatError as e:
        raise InternalError(f"malformed frames from server: {e}") from None
    index: list[Any] = [slice(None)] * view.ndim
    index[axis] = slice(cut, None)
    rest = np.ascontiguousarray(view[tuple(index)])
    frames = pb.Tensor(dtype=reply.frames.dtype, shape=list(rest.shape), data=rest.tobytes())
    return pb.FrameChunk(request_id=reply.request_id, chunk_index=reply.chunk_index,
                         first_frame=reply.first_frame + cut, frames=frames, final=reply.final)


class ReplayLog:
    """A session's latent messages in push order, held for a replay until the session ends.

    Each attempt reads it from the start with its own cursor (`message(i)`); `sent` is how far
    the current attempt's request stream got, which bounds the pushes in flight. No waiting
    here: each front-end waits on its own primitive (a threading.Condition, an asyncio.Event)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._messages: list[Any] = []
        self._dropped = 0          # messages before this index were let go (past the bound)
        self.bytes = 0
        self.closed = False        # the application half-closed: the stream ends after the last one
        self.sent = 0              # messages the current attempt's request stream took
        # False once the held latents passed max_bytes (from the start when resume is off:
        # then nothing is held past its send)
        self.resumable = max_bytes > 0

    def __len__(self) -> int:
        return self._dropped + len(self._messages)

    def append(self, message: Any) -> None:
        self._messages.append(message)
        self.bytes += len(message.latents.data)
        if self.resumable and self.bytes > self.max_bytes:
            log.warning("session holds %d bytes of latents, over its replay bound of %d: it is no longer "
                        "resumable (a failure from now on ends it)", self.bytes, self.max_bytes)
            self.resumable = False
            self._let_go()

    def took(self, index: int) -> None:
        """The current attempt's stream took message `index`."""
        self.sent = index + 1
        if not self.resumable:
            self._let_go()

    def _let_go(self) -> None:
        # Unresumable: keep only what the current attempt has not sent yet.
        keep_from = max(self.sent, self._dropped)
        del self._messages[: keep_from - self._dropped]
        self._dropped = keep_from

    def message(self, index: int, options: Any | None) -> Any:
        """Message `index` for an attempt; the first carries the attempt's options."""
        message = self._messages[index - self._dropped]
        if options is None:
            return message
        first = pb.LatentChunk()
        first.CopyFrom(message)
        first.options.CopyFrom(options)
        return first

    def restart(self) -> None:
        """A new attempt: its stream starts again at message 0."""
        self.sent = 0


__all__ = ["ResumePolicy", "NO_RESUME", "policy_of", "CallReport", "Targets", "Progress", "ReplayLog", "RETRYABLE",
           "ATTEMPT_FAILURES"]
