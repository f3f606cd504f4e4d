"""The resume decisions of the client's shared core (`vaed_client.resume`), without a server:
which statuses are retried, exactly-once delivery across attempts, the replay bound."""

from __future__ import annotations

import time

import grpc
import grpc.aio
import numpy as np
import pytest

from vaed_client import wire
from vaed_client.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    ReplicaMismatchError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    VaedError,
)
from vaed_client.resume import CallReport, Progress, ReplayLog, ResumePolicy, Targets, policy_of

LOST = "Stream removed (Socket closed)"  # what gRPC says when a server is killed mid-call


def _progress(*targets: str, policy: ResumePolicy | None = None, timeout: float | None = None) -> Progress:
    return Progress(policy or ResumePolicy(), Targets(list(targets)), CallReport(), timeout, "rid")


def _reply(first: int, count: int, final: bool = False) -> wire.pb.FrameChunk:
    """RGB8 frames [1, count, 2, 2, 3] whose every byte is its frame number."""
    video = np.repeat(np.arange(first, first + count, dtype=np.uint8), 12).reshape(1, count, 2, 2, 3)
    return wire.pb.FrameChunk(first_frame=first, frames=wire.to_message(video), final=final)


def _frame_numbers(reply: wire.pb.FrameChunk) -> list[int]:
    return [int(frame[0, 0, 0]) for frame in wire.to_numpy(reply.frames)[0]]


@pytest.mark.parametrize("error", [
    InvalidArgumentError("bad latents"),
    UnauthenticatedError("no token"),
    InternalError("bug"),
    VaedError("deadline", grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_errors_of_the_request_are_never_retried(error):
    progress = _progress("a:1", "b:1")
    progress.delivered = 5
    with pytest.raises(type(error)):
        progress.retry_delay(error)
    assert progress.report.resumes == 0 and progress.report.targets == ["a:1"]


def test_a_lost_connection_resumes_on_the_other_target_at_once_and_is_logged(caplog):
    progress = _progress("a:1", "b:1")
    progress.delivered = 5
    with caplog.at_level("WARNING", logger="vaed_client.resume"):
        assert progress.retry_delay(UnavailableError(LOST)) == 0.0  # b has not failed: no backoff
    assert progress.report.resumes == 1 and progress.report.targets == ["a:1", "b:1"]
    assert progress.report.reasons == [f"UNAVAILABLE: {LOST}"]
    assert progress.options(wire.pb.DecodeOptions(request_id="rid")).skip_frames == 5
    assert "a:1 failed after 5 frames (UNAVAILABLE: Stream removed (Socket closed)); resuming on b:1" in caplog.text


def test_a_call_without_an_id_is_named_by_the_id_its_first_server_gave_it(caplog):
    """The server makes up an id for a call that sent none and logs under it; the client's
    warning and the resumed attempt carry that id, so both replicas' logs and the client's
    name the call alike. A caller's own id is never replaced."""
    progress = Progress(ResumePolicy(), Targets(["a:1", "b:1"]), CallReport(), None, "")
    first = _reply(0, 1)
    first.request_id = "3f2a9c0d11e84b7a"
    progress.accept(first, "rgb8")
    with caplog.at_level("WARNING", logger="vaed_client.resume"):
        progress.retry_delay(UnavailableError(LOST))
    assert "request 3f2a9c0d11e84b7a: a:1 failed after 1 frames" in caplog.text
    assert progress.options(wire.pb.DecodeOptions()).request_id == "3f2a9c0d11e84b7a"
    own = _progress("a:1", "b:1")
    other = _reply(0, 1)
    other.request_id = "made-up-by-a-server"
    own.accept(other, "rgb8")
    assert own.request_id == "rid" and own.options(wire.pb.DecodeOptions(request_id="rid")).request_id == "rid"


def test_resource_exhausted_moves_to_another_replica_but_not_back_to_the_same_one():
    progress = _progress("a:1", "b:1")
    assert progress.retry_delay(ResourceExhaustedError("sessions full")) == 0.0
    assert progress.target == 1
    alone = _progress("a:1")
    alone.delivered = 3
    with pytest.raises(ResourceExhaustedError):  # the one server that said it would say it again
        alone.retry_delay(ResourceExhaustedError("out of memory"))
    dns = _progress("dns:///vaed-headless:50051")  # its round_robin channel picks the next replica
    dns.delivered = 3
    assert dns.retry_delay(ResourceExhaustedError("sessions full")) > 0  # backoff: the same name again


def test_attempts_are_bounded_and_back_off_on_a_target_that_failed():
    policy = ResumePolicy(max_resumes=3, initial_backoff=0.1, max_backoff=0.3)
    progress = _progress("a:1", policy=policy)
    progress.delivered = 1
    delays = [progress.retry_delay(UnavailableError(LOST)) for _ in range(3)]
    assert [round(d / b, 1) for d, b in zip(delays, (0.1, 0.2, 0.3))] == [pytest.approx(r, abs=0.21) for r in (1, 1, 1)]
    with pytest.raises(UnavailableError):
        progress.retry_delay(UnavailableError(LOST))
    assert progress.report.resumes == 3


def test_resume_false_never_resumes():
    progress = _progress("a:1", "b:1", policy=policy_of(False))
    progress.delivered = 2
    with pytest.raises(UnavailableError):
        progress.retry_delay(UnavailableError(LOST))


def test_frames_are_delivered_exactly_once_across_attempts():
    progress = _progress("a:1", "b:1")
    assert _frame_numbers(progress.accept(_reply(0, 1), "rgb8")) == [0]
    assert _frame_numbers(progress.accept(_reply(1, 4), "rgb8")) == [1, 2, 3, 4]
    progress.retry_delay(UnavailableError(LOST))
    # a server that ignored skip_frames sends from frame 0 again: seen frames are dropped,
    # a group across the boundary is cut
    assert progress.accept(_reply(0, 1), "rgb8") is None
    assert progress.accept(_reply(1, 4), "rgb8") is None
    tail = progress.accept(_reply(3, 4), "rgb8")
    assert tail.first_frame == 5 and _frame_numbers(tail) == [5, 6]
    assert progress.delivered == 7 and len(progress.report.recovery_seconds) == 1
    with pytest.raises(InternalError, match="skipped frames 7..8"):
        progress.accept(_reply(9, 4), "rgb8")
    final = wire.pb.FrameChunk(first_frame=9, final=True)
    assert progress.accept(final, "rgb8") is final


def test_a_session_past_its_replay_bound_is_no_longer_resumable(caplog):
    message = wire.pb.LatentChunk(latents=wire.pb.Tensor(data=b"x" * 100))
    log = ReplayLog(max_bytes=250)
    log.append(message)
    log.append(message)
    assert log.resumable and len(log) == 2
    with caplog.at_level("WARNING", logger="vaed_client.resume"):
        log.append(message)
    assert not log.resumable and "no longer resumable" in caplog.text
    log.took(0)
    assert len(log) == 3  # indices keep counting; what was sent is let go
    progress = _progress("a:1", "b:1")
    progress.delivered = 1
    with pytest.raises(UnavailableError):
        progress.retry_delay(UnavailableError(LOST), resumable=log.resumable)


def test_each_attempt_puts_its_own_options_on_its_first_message():
    log = ReplayLog(max_bytes=1 << 20)
    log.append(wire.pb.LatentChunk(latents=wire.pb.Tensor(data=b"a")))
    log.append(wire.pb.LatentChunk(latents=wire.pb.Tensor(data=b"b")))
    first = log.message(0, wire.pb.DecodeOptions(skip_frames=5))
    assert first.options.skip_frames == 5 and first.latents.data == b"a"
    assert not log.message(0, None).HasField("options")  # the held message is not changed
    assert not log.message(1, None).HasField("options")


def test_targets_rotate_and_avoid_one_that_just_failed():
    targets = Targets(["a", "b", "c"])
    assert [targets.first() for _ in range(4)] == [0, 1, 2, 0]
    assert targets.after_failure(1) == 2
    assert targets.first() == 2  # b (next in turn) failed just now: skipped while others are fresh
    turn = Targets(["a", "b"])
    assert [turn.first(takes_turn=False), turn.first(), turn.first()] == [0, 0, 1]  # info calls take no turn


def test_encode_replies_pass_once_each_by_latent_frame():
    """A resumed encode gets latent frames 0.. again: those delivered before are dropped, the
    next one passes, a gap is an error, the final marker always passes. The recovery is timed to
    that next frame, not to the first duplicate; the first data to the first latent frame."""
    progress = _progress("a:1", "b:1")
    latent = [wire.pb.LatentFrameChunk(latent_frame=i) for i in range(4)]
    assert progress.report.first_data_seconds is None
    assert [progress.accept_latent(r) is r for r in latent[:3]] == [True] * 3
    assert progress.report.first_data_seconds is not None
    progress.retry_delay(UnavailableError(LOST))
    assert [progress.accept_latent(r) for r in latent[:3]] == [None] * 3
    assert progress.report.recovery_seconds == []  # the duplicates are no recovery yet
    assert progress.accept_latent(latent[3]) is latent[3] and progress.delivered == 4
    assert len(progress.report.recovery_seconds) == 1
    end = wire.pb.LatentFrameChunk(latent_frame=4, final=True)
    assert progress.accept_latent(end) is end
    with pytest.raises(InternalError, match="skipped latent frames 4..5"):
        progress.accept_latent(wire.pb.LatentFrameChunk(latent_frame=6))


def _aio_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_an_internal_error_past_the_calls_timeout_is_its_deadline() -> None:
    # grpc.aio reports a request message written into a call its deadline just ended as INTERNAL
    progress = _progress("a:1", timeout=3600.0)
    core = _aio_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    lost = progress.error_of(core)  # the timeout has not run out: a status gRPC lost (below)
    assert type(lost) is UnavailableError and isinstance(lost.__cause__, InternalError)
    progress.deadline = time.monotonic() - 0.001
    late = progress.error_of(core)
    assert type(late) is DeadlineExceededError and late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "Internal error from Core" in str(late) and isinstance(late.__cause__, InternalError)
    with pytest.raises(DeadlineExceededError):
        progress.retry_delay(late)
    # only INTERNAL stands for the timeout: a server's own answer keeps its status
    refused = progress.error_of(_aio_error(grpc.StatusCode.INVALID_ARGUMENT, "bad latents"))
    assert type(refused) is InvalidArgumentError
    assert type(_progress("a:1").error_of(core)) is UnavailableError  # no timeout at all


def test_a_resumed_call_that_delivered_no_frames_keeps_the_id_its_first_server_gave() -> None:
    """An MP4 call counts no frames (its file restarts on a resume), so its resumed attempt went
    out without the id the first server made up, and the second server logged another."""
    progress = Progress(ResumePolicy(), Targets(["a:1", "b:1"]), CallReport(), None, "")
    base = wire.pb.DecodeOptions(fps=16, crf=18)
    assert progress.options(base) is base  # nothing known yet
    progress.accept(wire.pb.FrameChunk(request_id="given-by-a", video=b"\0" * 64), "rgb8")
    assert progress.delivered == 0
    progress.retry_delay(UnavailableError(LOST))
    resumed = progress.options(base)
    assert resumed.request_id == "given-by-a" and resumed.skip_frames == 0
    assert (resumed.fps, resumed.crf) == (16, 18) and base.request_id == ""  # a copy: the caller's stay
    own = wire.pb.DecodeOptions(request_id="mine")
    assert progress.options(own) is own  # the caller's own id is the call's


def test_a_target_failing_again_and_again_is_avoided_longer_until_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung replica fails each call only after 15-80 s; with a fixed 5 s cooldown every new call
    went back to it after 5 s. Each failure in a row doubles how long it is avoided (5, 10, 20 s,
    ... 80 s at most) while another target is left; an answer from it starts over."""
    from vaed_client import resume

    now = [1000.0]
    monkeypatch.setattr(resume.time, "monotonic", lambda: now[0])
    targets = Targets(["hung:1", "ok:1"])
    waits = []
    for _ in range(6):
        assert targets.after_failure(0) == 1
        first_back = None
        for second in range(0, 200):
            now[0] += 1.0
            if targets._healthiest(0, exclude=None) == 0:
                first_back = second + 1
                break
        waits.append(first_back)
    assert waits == [5, 10, 20, 40, 80, 80]
    assert targets.cooldown(0) == resume.MAX_TARGET_COOLDOWN
    progress = Progress(ResumePolicy(), targets, CallReport(), None, "rid")
    progress.target = 0
    progress.accept(_reply(0, 1), "rgb8")  # it answered
    assert targets.cooldown(0) == resume.FAILED_TARGET_COOLDOWN
    targets.after_failure(0)
    now[0] += resume.FAILED_TARGET_COOLDOWN
    assert targets._healthiest(0, exclude=None) == 0  # back after the first cooldown again


def test_an_internal_error_from_core_is_a_lost_status_and_retried() -> None:
    # grpc.aio's INTERNAL for a message written into a call the server had ended (its refusal's
    # status lost): retried as UNAVAILABLE, on the same server too, so the next attempt gets the
    # server's own answer; a server's own INTERNAL is never retried
    progress = _progress("a:1")
    lost = progress.error_of(_aio_error(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert type(lost) is UnavailableError and lost.code == grpc.StatusCode.UNAVAILABLE
    assert "still sending" in str(lost) and "Internal error from Core" in str(lost)
    assert progress.retry_delay(lost) >= 0 and progress.report.resumes == 1
    own = progress.error_of(_aio_error(grpc.StatusCode.INTERNAL, "decoder failed: CUDA error"))
    assert type(own) is InternalError
    with pytest.raises(InternalError, match="decoder failed"):
        progress.retry_delay(own)
    no_resume = _progress("a:1", policy=ResumePolicy(max_resumes=0))
    with pytest.raises(UnavailableError, match="still sending"):
        no_resume.retry_delay(no_resume.error_of(_aio_error(grpc.StatusCode.INTERNAL, "Internal error from Core")))


# -- one decoder per call: each attempt's identity header (`Progress.check_server`) -----------------

IDENTITY = "weights=sha256:aaaa; dtype=float32; precision=lossless; kernels=off; layout=contiguous; device=cpu"
OTHER_WEIGHTS = IDENTITY.replace("sha256:aaaa", "sha256:bbbb")
OTHER_DTYPE = IDENTITY.replace("float32", "bfloat16")


def _headers(identity: str | None, header: str = wire.DECODER_IDENTITY_HEADER) -> tuple[tuple[str, str], ...]:
    """An attempt's initial metadata as grpc gives it; None: a server older than the header."""
    return (("content-type", "application/grpc"),) + (((header, identity),) if identity is not None else ())


def test_a_resume_on_another_decoder_is_refused_and_its_target_not_tried_again_in_the_call(caplog):
    progress = _progress("a:1", "b:1", "c:1")
    progress.check_server(_headers(IDENTITY))  # the first attempt's: the call's
    progress.delivered = 9
    progress.retry_delay(UnavailableError(LOST))
    assert progress.target == 1
    with pytest.raises(ReplicaMismatchError) as refused:
        progress.check_server(_headers(OTHER_WEIGHTS))
    assert str(refused.value) == ("UNAVAILABLE: b:1 serves another decoder than a:1, which served this call first "
                                  "(weights: sha256:aaaa vs sha256:bbbb)")
    with caplog.at_level("WARNING", logger="vaed_client.resume"):
        assert progress.retry_delay(refused.value) == 0.0  # c has not failed: no backoff
    assert progress.target == 2 and progress.report.resumes == 2
    assert progress.report.targets == ["a:1", "b:1", "c:1"]
    assert progress.report.reasons[1].startswith("MISMATCH: b:1 serves another decoder")
    assert "request rid: b:1 refused after 9 frames (MISMATCH: " in caplog.text
    progress.check_server(_headers(IDENTITY))  # c serves the call's decoder
    progress.retry_delay(UnavailableError(LOST))  # c fails too: back to a, never to b
    assert progress.target == 0
    assert progress.targets.first() == 1  # a new call starts on b: refused for this call, not failed (a, c are)


def test_two_identities_are_compared_only_when_both_were_sent():
    """A server older than the header sends none: it is not refused, nor is a later attempt
    compared with it; the first identity any attempt sends is the call's."""
    progress = _progress("a:1", "b:1", "c:1")
    progress.check_server(_headers(None))
    progress.retry_delay(UnavailableError(LOST))
    progress.check_server(_headers(OTHER_DTYPE))  # nothing to compare with: it becomes the call's
    progress.retry_delay(UnavailableError(LOST))
    progress.check_server(_headers(None))  # an older server again: not refused
    progress.retry_delay(UnavailableError(LOST))
    with pytest.raises(ReplicaMismatchError, match=r"\(dtype: bfloat16 vs float32\)"):
        progress.check_server(_headers(IDENTITY))
    encode = Progress(ResumePolicy(), Targets(["a:1", "b:1"]), CallReport(), None, "rid", encoder=True)
    encode.check_server(_headers(IDENTITY, wire.ENCODER_IDENTITY_HEADER))
    encode.retry_delay(UnavailableError(LOST))
    encode.check_server(_headers(OTHER_WEIGHTS))  # a decoder's header: not the encoder's
    with pytest.raises(ReplicaMismatchError, match="serves another encoder"):
        encode.check_server(_headers(OTHER_WEIGHTS, wire.ENCODER_IDENTITY_HEADER))


def test_no_target_of_the_calls_decoder_left_ends_the_call_with_the_difference():
    progress = _progress("a:1", "b:1")
    progress.check_server(_headers(IDENTITY))
    progress.delivered = 13
    progress.retry_delay(UnavailableError(LOST))
    with pytest.raises(ReplicaMismatchError) as refused:
        progress.check_server(_headers(OTHER_WEIGHTS))
    progress.retry_delay(refused.value)  # a may still come back: it is tried again
    assert progress.target == 0
    with pytest.raises(ReplicaMismatchError) as again:
        progress.check_server(_headers(OTHER_DTYPE))  # it did, with another dtype
    with pytest.raises(ReplicaMismatchError) as final:
        progress.retry_delay(again.value)
    assert str(final.value) == (
        "UNAVAILABLE: a replica behind a:1 serves another decoder than the one that served this call first "
        "(dtype: float32 vs bfloat16): its frames are not joined to the first's, and no other target is left to "
        "resume on [request rid: 2 resumes over a:1, b:1; 13 frames delivered]")
    # the call's other failures after a refusal end it with the refusal too, naming the last one
    late = _progress("a:1", "b:1", policy=ResumePolicy(max_resumes=2))
    late.check_server(_headers(IDENTITY))
    late.retry_delay(UnavailableError(LOST))
    with pytest.raises(ReplicaMismatchError) as refused:
        late.check_server(_headers(OTHER_WEIGHTS))
    late.retry_delay(refused.value)
    with pytest.raises(ReplicaMismatchError, match=r"resumes ran out \(max_resumes 2\) \(the last failure: "
                                                   r"UNAVAILABLE: Stream removed"):
        late.retry_delay(UnavailableError(LOST))
    with pytest.raises(InvalidArgumentError):  # a refusal of the request itself stays what it is
        late.retry_delay(InvalidArgumentError("bad latents"))


def test_a_dns_name_is_not_refused_for_good():
    """Behind one `dns:` name the next attempt may reach another replica: a refusal moves on to
    the same name (within the resumes), and only their end ends the call."""
    progress = _progress("dns:///vaed-headless:50051", policy=ResumePolicy(max_resumes=2))
    progress.check_server(_headers(IDENTITY))
    progress.retry_delay(UnavailableError(LOST))
    with pytest.raises(ReplicaMismatchError) as refused:
        progress.check_server(_headers(OTHER_WEIGHTS))
    assert "a replica behind dns:///vaed-headless:50051 serves another decoder" in str(refused.value)
    assert progress.retry_delay(refused.value) >= 0 and progress.target == 0
    progress.check_server(_headers(IDENTITY))  # the round_robin channel reached the call's decoder
    assert progress.report.resumes == 2


def test_the_error_that_ends_a_resumed_call_says_what_it_went_through():
    progress = _progress("a:1", "b:1", policy=ResumePolicy(max_resumes=2, initial_backoff=0.001))
    progress.delivered = 21
    progress.retry_delay(UnavailableError(LOST))
    progress.retry_delay(UnavailableError(LOST))
    with pytest.raises(UnavailableError) as ended:
        progress.retry_delay(UnavailableError("connection refused"))
    assert type(ended.value) is UnavailableError and ended.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(ended.value) == ("UNAVAILABLE: connection refused; the call's resumes ran out (max_resumes 2) "
                                "[request rid: 2 resumes over a:1, b:1; 21 frames delivered]")
    # the call's timeout ending the resumes says so too (it read as any other failure)
    timed = _progress("a:1", timeout=3600.0)
    timed.delivered = 5
    timed.retry_delay(UnavailableError(LOST))
    timed.deadline = time.monotonic() - 0.001
    with pytest.raises(UnavailableError, match=r"; the call's timeout ran out \[request rid: 1 resume over a:1"):
        timed.retry_delay(UnavailableError("connection refused"))
    never = _progress("a:1", "b:1", policy=policy_of(False))
    with pytest.raises(UnavailableError) as alone:
        never.retry_delay(UnavailableError(LOST))
    assert str(alone.value) == f"UNAVAILABLE: {LOST}"  # nothing was resumed: nothing to add
