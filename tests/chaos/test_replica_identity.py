"""One decoder per call: a call resumed on a replica of another decoder (other weights, dtype,
...) is refused instead of joining two decoders' frames, and a replica of the first decoder
further down the list still finishes it bit-identical. Real `vaed serve` processes (tiny random
models on the CPU, `?seed=1` for other weights), the real client; kills are placed by events
from inside the client's own frame handling (as in test_failover.py), never by sleeps.

Each server sends its identity (`ModelInfo.decoder_identity`) as the initial metadata of every
Decode, DecodeStream and Encode (`vaed_client.wire.DECODER_IDENTITY_HEADER`), and the client
compares each resumed attempt's with the call's before taking any of its replies
(`vaed_client.resume`).
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from vaed_client import AsyncVaeClient, VaeClient, wire
from vaed_client import core as client_core
from vaed_client.encoding import EncodedAssembly
from vaed_client.errors import ReplicaMismatchError, UnavailableError
from vaed_client.resume import CallReport, ResumePolicy
from vaed_client.video import assemble

from chaos_tools import Replica, start_replicas

pytestmark = pytest.mark.slow

Z = 4  # the tiny model's z_dim; 8x8 latents decode to 64x64 frames
OTHER_WEIGHTS = ("--model", "random:wan2.1-tiny?seed=1")


def latents(t: int, seed: int = 0, hw: int = 8) -> torch.Tensor:
    return torch.randn(1, Z, t, hw, hw, generator=torch.Generator().manual_seed(seed))


def frames_of(t: int) -> int:
    return 1 + 4 * (t - 1)


def identity_of(replica: Replica, encoder: bool = False) -> str:
    with VaeClient(replica.target) as client:
        info = client.model_info()
    return info.encoder_identity if encoder else info.decoder_identity


def weights_of(identity: str) -> str:
    return wire.identity_parts(identity)["weights"]


def assert_refused(error: BaseException, first: Replica, other: Replica, weights: dict[str, str], request_id: str,
                   delivered: int, unit: str = "frames", kind: str = "decoder") -> None:
    """The call's error is ReplicaMismatchError naming the replica refused, the one that served
    the call first, the one part that differs (the weights, `weights` by target, taken before any
    kill) with both values, the call's request id and the frames it had delivered."""
    assert type(error) is ReplicaMismatchError, repr(error)
    message = str(error)
    assert weights[first.target] != weights[other.target]
    assert f"{other.target} serves another {kind} than {first.target}, which served this call first" in message
    assert f"(weights: {weights[first.target]} vs {weights[other.target]})" in message  # the only part that differs
    assert f"request {request_id}:" in message and f"; {delivered} {unit} delivered]" in message
    assert message.startswith("UNAVAILABLE: ")  # no replica that could finish the call


def weights_by_target(*replicas: Replica, encoder: bool = False) -> dict[str, str]:
    return {r.target: weights_of(identity_of(r, encoder)) for r in replicas}


@pytest.fixture()
def mixed_pair() -> Iterator[list[Replica]]:
    """Two replicas of the tiny model: seed 0, then seed 1 (other weights, the same shapes)."""
    replicas = start_replicas((), OTHER_WEIGHTS)
    yield replicas
    for replica in replicas:
        replica.stop()


class KillAfter:
    """Wraps the client's whole-video assembly: kill -9 the replica serving the call (and `also`)
    once `messages` frame messages are placed; `frames` counts the frames placed, which is what
    the call delivered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, replicas: dict[str, Replica], report: CallReport,
                 messages: int, also: tuple[Replica, ...] = ()) -> None:
        self.killed = False
        self.frames = 0
        placed = [0]
        add = client_core.Assembly.add

        def counting_add(assembly: Any, reply: Any) -> None:
            add(assembly, reply)
            if reply.HasField("frames") and len(reply.frames.shape):
                self.frames += int(reply.frames.shape[1])  # RGB8 [B, t, H, W, 3]
                placed[0] += 1
            if placed[0] == messages and not self.killed:
                replicas[report.targets[0]].kill()
                for replica in also:
                    replica.kill()
                self.killed = True

        monkeypatch.setattr(client_core.Assembly, "add", counting_add)


# -- a replica of another decoder is refused --------------------------------------------------------


@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_an_mp4_decode_resumed_on_other_weights_is_that_decoders_whole_video(
        mixed_pair: list[Replica], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        front: str) -> None:
    """An MP4 call's attempts each start its file over, so nothing of two decoders is joined:
    kill -9 of the seed-0 replica once its first MP4 bytes came, and the call finishes on the
    seed-1 replica (a rolling update to other weights) with that decoder's whole video, under
    the id the first server gave it. It raised ReplicaMismatchError, and the resumed attempt went
    out without that id."""
    import av

    from vaed_client import mp4 as client_mp4

    first, other = mixed_pair
    x = latents(16)
    replicas = {r.target: r for r in mixed_pair}
    report = CallReport()
    killed: list[str] = []
    add = client_mp4.Mp4Output.add

    def add_then_kill(output: Any, reply: Any) -> None:
        add(output, reply)
        if reply.video and not killed:
            killed.append(report.targets[0])
            replicas[report.targets[0]].kill()

    monkeypatch.setattr(client_mp4.Mp4Output, "add", add_then_kill)
    caplog.set_level("WARNING", logger="vaed_client.resume")
    targets = [first.target, other.target]
    if front == "sync":
        with VaeClient(targets) as client:
            data = client.decode(x, output_type="mp4", report=report)
    else:
        async def decode() -> Any:
            async with AsyncVaeClient(targets) as client:
                return await client.decode(x, output_type="mp4", report=report)

        data = asyncio.run(decode())
    assert killed == [first.target] and report.targets[-1] == other.target and report.resumes >= 1
    with av.open(io.BytesIO(data)) as container:
        assert sum(1 for _ in container.decode(video=0)) == frames_of(16)
    # the id the first server gave the call (its resume warning names it) is the one the other logs
    named = re.search(rf"request (\w+): {re.escape(first.target)} failed", caplog.text)
    assert named is not None, caplog.text
    assert other.wait_for_line(f" id={named.group(1)} status=OK", timeout=30), other.log()


@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_decode_resumed_on_other_weights_raises_instead_of_joining_frames(
        mixed_pair: list[Replica], monkeypatch: pytest.MonkeyPatch, front: str) -> None:
    """kill -9 of the seed-0 replica mid-decode: the resume reaches the seed-1 replica, whose
    identity differs, so none of its frames is taken; the dead replica is tried again until the
    resumes run out, and the call raises ReplicaMismatchError. (Without the check, the video
    came back whole, its two halves from two different weight sets.)"""
    first, other = mixed_pair
    weights = weights_by_target(first, other)
    x = latents(16)
    replicas = {r.target: r for r in mixed_pair}
    report = CallReport()
    killer = KillAfter(monkeypatch, replicas, report, messages=4)
    request_id = f"mismatch-decode-{front}"
    with pytest.raises(UnavailableError) as raised:
        if front == "sync":
            with VaeClient([first.target, other.target]) as client:
                client.decode(x, report=report, request_id=request_id)
        else:
            async def decode() -> Any:
                async with AsyncVaeClient([first.target, other.target]) as client:
                    return await client.decode(x, report=report, request_id=request_id)

            asyncio.run(decode())
    assert killer.killed and report.targets[:2] == [first.target, other.target]
    assert_refused(raised.value, first, other, weights, request_id, killer.frames)
    assert 0 < killer.frames < frames_of(16)
    assert report.resumes == ResumePolicy().max_resumes  # the dead replica was tried until they ran out
    assert report.reasons[1].startswith(f"MISMATCH: {other.target} serves another decoder")
    assert other.target not in report.targets[2:]  # refused once, not tried again in this call
    assert f"the call's resumes ran out (max_resumes {ResumePolicy().max_resumes})" in str(raised.value)


def test_stream_resumed_on_other_weights_raises_after_the_first_decoders_frames(
        mixed_pair: list[Replica]) -> None:
    """The sync stream() yields the seed-0 replica's frames (equal to its undisturbed decode)
    up to the kill, then raises ReplicaMismatchError: not one frame of the seed-1 replica."""
    first, other = mixed_pair
    weights = weights_by_target(first, other)
    x = latents(16, seed=1)
    with VaeClient(first.target) as client:
        want = client.decode(x)
    report = CallReport()
    chunks: list[Any] = []
    with pytest.raises(UnavailableError) as raised:
        with VaeClient([first.target, other.target], resume=ResumePolicy(max_resumes=2)) as client:
            for chunk in client.stream(x, report=report, request_id="mismatch-stream"):
                chunks.append(chunk)
                if len(chunks) == 4:
                    first.kill()
    assert report.targets[:2] == [first.target, other.target]
    delivered = chunks[-1].end_frame
    assert_refused(raised.value, first, other, weights, "mismatch-stream", delivered)
    assert [c.first_frame for c in chunks] == [0, *range(1, delivered - 1, 4)]
    assert torch.equal(assemble(chunks), want[:, :delivered])  # the first decoder's frames only


def test_session_resumed_on_other_weights_raises(mixed_pair: list[Replica]) -> None:
    """A DecodeSession pushes two latent frames, takes their frames, and its replica is killed
    (mid-session by construction: the rest is pushed after the kill). The resume on the seed-1
    replica is refused, and the session raises ReplicaMismatchError."""
    first, other = mixed_pair
    weights = weights_by_target(first, other)
    x = latents(10, seed=2)
    with VaeClient([first.target, other.target], resume=ResumePolicy(max_resumes=2)) as client:
        session = client.session(request_id="mismatch-session")
        session.push(x[:, :, :2])
        chunks = iter(session)
        taken = [next(chunks), next(chunks)]  # frame 0, then frames 1-4: all two latent frames make
        first.kill()
        with pytest.raises(UnavailableError) as raised:  # from a push once the session has failed, or from its frames
            for i in range(2, 10):
                session.push(x[:, :, i : i + 1])
            session.close()
            taken += list(chunks)
    assert session.report.targets[:2] == [first.target, other.target]
    assert_refused(raised.value, first, other, weights, "mismatch-session", frames_of(2))
    assert taken[-1].end_frame == frames_of(2)


@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_encode_resumed_on_other_weights_raises(monkeypatch: pytest.MonkeyPatch, front: str) -> None:
    """Encode: the replica of the first encoder is killed after 4 of 12 latent frames; the
    other replica's encoder has other weights, so its latent frames are refused the same way."""
    first, other = start_replicas(("--encode",), ("--encode", *OTHER_WEIGHTS))
    try:
        weights = weights_by_target(first, other, encoder=True)
        video = torch.rand(1, 3, 1 + 4 * 11, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
        report = CallReport()
        placed = [0]
        add = EncodedAssembly.add

        def counting_add(assembly: Any, reply: Any) -> None:
            add(assembly, reply)
            placed[0] += not reply.final
            if placed[0] == 4:
                first.kill()

        monkeypatch.setattr(EncodedAssembly, "add", counting_add)
        targets = [first.target, other.target]
        policy = ResumePolicy(max_resumes=2)
        request_id = f"mismatch-encode-{front}"
        with pytest.raises(UnavailableError) as raised:
            if front == "sync":
                with VaeClient(targets, resume=policy) as client:
                    client.encode(video, report=report, request_id=request_id)
            else:
                async def encode() -> Any:
                    async with AsyncVaeClient(targets, resume=policy) as client:
                        return await client.encode(video, report=report, request_id=request_id)

                asyncio.run(encode())
        assert report.targets[:2] == targets
        assert_refused(raised.value, first, other, weights, request_id, placed[0], unit="latent frames",
                       kind="encoder")
    finally:
        first.stop()
        other.stop()


# -- a replica of the first decoder further down the list finishes the call ---------------------------


def test_a_replica_of_the_first_decoder_finishes_the_call_past_one_of_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three replicas: seed 0 (killed mid-decode), seed 1, seed 0. The resume on the seed-1
    replica is refused before any of its frames is taken, and the third finishes the call
    bit-identical to an undisturbed one; the report shows the refused target."""
    first, other, same = start_replicas((), OTHER_WEIGHTS, ())
    try:
        x = latents(16, seed=5)
        with VaeClient(same.target) as client:
            want = client.decode(x)
        report = CallReport()
        replicas = {r.target: r for r in (first, other, same)}
        killer = KillAfter(monkeypatch, replicas, report, messages=4)
        with VaeClient([first.target, other.target, same.target]) as client:
            got = client.decode(x, report=report, request_id="mismatch-then-same")
        assert killer.killed and torch.equal(got, want)
        assert report.targets == [first.target, other.target, same.target] and report.resumes == 2
        assert report.reasons[0].startswith("UNAVAILABLE: ")
        assert report.reasons[1].startswith(f"MISMATCH: {other.target} serves another decoder than {first.target}")
        (call,) = same.resumed_calls("mismatch-then-same")  # it skipped what the first had delivered
        assert call["status"] == "OK" and int(call["skipped_frames"]) + int(call["frames"]) == frames_of(16)
    finally:
        for replica in (first, other, same):
            replica.stop()


# -- every replica dead: the error says what the call went through ----------------------------------


def test_the_error_after_every_replica_died_names_the_resumes_targets_and_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both replicas (one model) are killed mid-decode: each resume fails until they run out, and
    the UnavailableError says how many resumes, over which targets, and how many frames had come."""
    pair = start_replicas((), ())
    try:
        report = CallReport()
        killer = KillAfter(monkeypatch, {r.target: r for r in pair}, report, messages=4, also=tuple(pair))
        targets = [r.target for r in pair]
        with pytest.raises(UnavailableError) as raised:
            with VaeClient(targets, resume=ResumePolicy(max_resumes=3)) as client:
                client.decode(latents(16, seed=6), report=report, request_id="all-dead")
        error = raised.value
        assert type(error) is UnavailableError and error.code == grpc.StatusCode.UNAVAILABLE
        assert killer.killed and report.resumes == 3
        context = re.search(r"\[(.*)\]$", str(error))
        assert context is not None, str(error)
        tried = ", ".join(dict.fromkeys(report.targets))
        assert set(report.targets) == set(targets)
        assert context.group(1) == f"request all-dead: 3 resumes over {tried}; {killer.frames} frames delivered"
        assert str(error).startswith("UNAVAILABLE: ")  # the last failure's own message comes first
    finally:
        for replica in pair:
            replica.stop()


# -- the identity ----------------------------------------------------------------------------------


def test_the_identity_is_in_model_info_and_each_calls_headers() -> None:
    """Two replicas of one model have one identity; another seed differs in the weights only,
    another dtype in the dtype only. A server with --encode has the same decoder identity and an
    encoder identity of its own, which it sends on Encode; the decoder's goes with Decode and
    DecodeStream, before any frame."""
    a, b, seed1, bf16, encoding = start_replicas(
        (), (), OTHER_WEIGHTS, ("--dtype", "bfloat16"), ("--encode",))
    try:
        ids = {r.target: identity_of(r) for r in (a, b, seed1, bf16, encoding)}
        parts = {t: wire.identity_parts(i) for t, i in ids.items()}
        assert ids[a.target] and ids[a.target] == ids[b.target] == ids[encoding.target]
        assert set(parts[a.target]) >= {"weights", "dtype", "precision", "kernels", "layout", "device", "software"}
        assert parts[a.target]["weights"].startswith("sha256:") and parts[a.target]["dtype"] == "float32"
        assert parts[a.target]["software"].startswith(f"torch {torch.__version__}, cudnn ")

        def differing(x: Replica, y: Replica) -> set[str]:
            px, py = parts[x.target], parts[y.target]
            return {k for k in px.keys() | py.keys() if px.get(k) != py.get(k)}

        assert differing(a, seed1) == {"weights"}
        assert differing(a, bf16) == {"dtype"} and parts[bf16.target]["dtype"] == "bfloat16"
        assert identity_of(a, encoder=True) == ""
        encoder_identity = identity_of(encoding, encoder=True)
        assert encoder_identity and weights_of(encoder_identity) != weights_of(ids[encoding.target])

        x = wire.pb.LatentChunk(latents=wire.to_message(latents(2).numpy()))
        frames = wire.pb.VideoChunk(frames=wire.to_message(torch.zeros(1, 3, 1, 64, 64).numpy()))
        with grpc.insecure_channel(encoding.target) as channel:
            stub = wire.pb_grpc.VaeDecoderStub(channel)
            for method, request, header, want in [
                (stub.Decode, wire.pb.DecodeRequest(latents=x.latents), wire.DECODER_IDENTITY_HEADER, ids[a.target]),
                (stub.DecodeStream, iter([x]), wire.DECODER_IDENTITY_HEADER, ids[a.target]),
                (stub.Encode, iter([frames]), wire.ENCODER_IDENTITY_HEADER, encoder_identity),
            ]:
                call = method(request, timeout=60)
                assert dict(call.initial_metadata()).get(header) == want, method
                assert list(call)[-1].final  # the call itself went through
    finally:
        for replica in (a, b, seed1, bf16, encoding):
            replica.stop()
