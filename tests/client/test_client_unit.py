"""vaed_client against an in-process fake VaeDecoder (no model, no torch math).

The fake answers with a synthetic video whose pixels are a known function of
(batch, frame, y, x, channel), split into small messages, so assembly,
streaming, sessions, errors, retries and auth are checked through the real
wire in milliseconds. Decode exactness against diffusers lives in the
server's end-to-end tests.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import torch

from harness import (
    TEMPORAL, FakeDecoder, expected_video, fake_raw, fake_video, latents_np, self_signed_pem, start_fake_server,
)
import vaed_client
from vaed_client import channel as vchannel
from vaed_client import errors, tensors
from vaed_client._proto import vaed_pb2
from vaed_client.video import assemble



# -- codec -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32])
def test_numpy_round_trip(dtype: Any) -> None:
    a = (np.arange(60).reshape(3, 4, 5) % 200).astype(dtype)
    m = tensors.to_message(a)
    assert tensors.validate(m) == (3, 4, 5)
    back = tensors.to_numpy(m)
    assert back.dtype == a.dtype and np.array_equal(back, a)


def test_bf16_bits_travel_unchanged() -> None:
    t = torch.randn(2, 3, 5).to(torch.bfloat16)
    m = tensors.to_message(t)
    assert m.dtype == vaed_pb2.BFLOAT16 and len(m.data) == t.numel() * 2
    assert m.data == t.view(torch.int16).numpy().tobytes()  # no float32 detour
    back = tensors.to_torch(m)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), t.view(torch.int16))
    widened = tensors.to_numpy(m)
    assert widened.dtype == np.float32 and np.array_equal(widened, t.float().numpy())


def test_codec_rejects_bad_input() -> None:
    with pytest.raises(tensors.TensorFormatError):
        tensors.to_message(np.zeros(3, dtype=np.float64))
    bad = vaed_pb2.Tensor(dtype=vaed_pb2.FLOAT32, shape=[2, 2], data=b"\0" * 15)
    with pytest.raises(tensors.TensorFormatError, match="byte count"):
        tensors.validate(bad)


def test_assemble_joins_chunks_in_any_order() -> None:
    video = fake_video(2, 9, 4, 4)
    parts = [(0, 1), (1, 5), (5, 9)]
    chunks = [
        vaed_client.DecodedChunk(chunk_index=i, first_frame=a, frames=video[:, a:b], request_id="r")
        for i, (a, b) in enumerate(parts)
    ]
    assert np.array_equal(assemble(reversed(chunks)), video)
    with pytest.raises(ValueError, match="tile"):
        assemble(chunks[1:])


# -- errors ------------------------------------------------------------------
class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, errors.UnavailableError),
        (grpc.StatusCode.UNAUTHENTICATED, errors.UnauthenticatedError),
        (grpc.StatusCode.CANCELLED, errors.CancelledError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
        (grpc.StatusCode.NOT_FOUND, errors.VaedError),
    ],
)
def test_error_mapping(code: grpc.StatusCode, cls: type) -> None:
    e = errors.from_rpc_error(_FakeRpcError(code, "the details"))
    assert type(e) is cls and e.code == code and e.details == "the details"
    assert code.name in str(e)


def test_error_mapping_of_bare_rpc_error() -> None:
    e = errors.from_rpc_error(grpc.RpcError())
    assert type(e) is errors.VaedError and e.code == grpc.StatusCode.UNKNOWN


# -- channel -----------------------------------------------------------------
def test_channel_options_and_service_config() -> None:
    opts = dict(vchannel.channel_options())
    assert opts["grpc.max_send_message_length"] == 256 * 1024 * 1024
    assert opts["grpc.max_receive_message_length"] == 256 * 1024 * 1024
    assert opts["grpc.enable_retries"] == 1
    config = json.loads(opts["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method_config,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    # the calls whose request is whole at their start; DecodeStream and Encode are resumed by the client alone
    assert names == {("vaed.v1.VaeDecoder", m) for m in ("GetModelInfo", "Decode")}
    policy = method_config["retryPolicy"]
    assert policy["maxAttempts"] == 5 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert (policy["initialBackoff"], policy["maxBackoff"]) == ("0.1s", "2s")
    # Overrides replace, not duplicate.
    overridden = vchannel.channel_options([("grpc.max_receive_message_length", 5)])
    assert [v for k, v in overridden if k == "grpc.max_receive_message_length"] == [5]


def test_tls_specs(tmp_path: Any) -> None:
    assert vchannel.channel_credentials(None) is None and vchannel.channel_credentials(False) is None
    assert isinstance(vchannel.channel_credentials(True), grpc.ChannelCredentials)
    cert, _ = self_signed_pem()
    path = tmp_path / "ca.pem"
    path.write_bytes(cert)
    for spec in (cert, str(path), path):
        assert isinstance(vchannel.channel_credentials(spec), grpc.ChannelCredentials)
    with pytest.raises(TypeError):
        vchannel.channel_credentials(3)  # type: ignore[arg-type]
    assert vchannel.bearer_metadata("abc") == (("authorization", "Bearer abc"),)
    assert vchannel.bearer_metadata(None) == ()


def test_token_on_insecure_channel(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    with vaed_client.VaeClient(target, token="s3cret") as client:
        client.model_info()
        client.decode(latents_np(t=1))
    assert [m.get("authorization") for m in servicer.metadata] == ["Bearer s3cret"] * 2


def test_tls_with_token() -> None:
    cert, key = self_signed_pem()
    servicer = FakeDecoder()
    server, port = start_fake_server(servicer, grpc.ssl_server_credentials([(key, cert)]))
    try:
        with vaed_client.VaeClient(f"localhost:{port}", tls=cert, token="tok") as client:
            assert client.model_info().model == "fake"
        assert servicer.metadata[-1]["authorization"] == "Bearer tok"
    finally:
        server.stop(0)


def test_dns_target(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    with vaed_client.VaeClient(f"dns:///{target}") as client:
        assert client.model_info().z_dim == 16


def test_retries_unavailable(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    servicer.unavailable_left = 2
    with vaed_client.VaeClient(target) as client:
        assert client.model_info().model == "fake"
        assert servicer.attempts == 3
        servicer.unavailable_left = 2
        # 295 KB of latents: over gRPC's default 256 KiB retry buffer.
        video = client.decode(latents_np(t=2, h=48, w=48))
        assert video.shape[1] == 5 and servicer.attempts == 6
    servicer.unavailable_left = 10
    with vaed_client.VaeClient(target) as client:
        with pytest.raises(errors.UnavailableError):
            client.model_info()


# -- decode / stream ----------------------------------------------------------
@pytest.mark.parametrize("final_empty", [True, False])
@pytest.mark.parametrize("b, t", [(1, 1), (1, 2), (2, 5)])
def test_decode_numpy_rgb8(fake: tuple[FakeDecoder, str], final_empty: bool, b: int, t: int) -> None:
    servicer, target = fake
    servicer.final_empty = final_empty
    with vaed_client.VaeClient(target) as client:
        video = client.decode(latents_np(b=b, t=t, h=3, w=5))
    assert isinstance(video, np.ndarray) and video.dtype == np.uint8
    assert np.array_equal(video, expected_video(b, t, 3, 5))


def test_decode_torch_bf16_in_torch_out(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    latents = torch.randn(1, 16, 2, 2, 2).to(torch.bfloat16)
    with vaed_client.VaeClient(target) as client:
        video = client.decode(latents, raw_latents=True, request_id="abc")
    assert isinstance(video, torch.Tensor) and video.dtype == torch.uint8
    assert np.array_equal(video.numpy(), expected_video(1, 2, 2, 2))
    sent = servicer.requests[-1]
    assert sent.latents.dtype == vaed_pb2.BFLOAT16
    assert sent.latents.data == latents.view(torch.int16).numpy().tobytes()
    assert sent.options.raw_latents and sent.options.request_id == "abc" and sent.options.format == vaed_pb2.RGB8


def test_decode_raw(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    want = fake_raw(expected_video(1, 3, 2, 2))
    with vaed_client.VaeClient(target) as client:
        out = client.decode(latents_np(t=3, h=2, w=2), format="raw")
        assert out.dtype == np.float32 and out.shape == (1, 3, 9, 16, 16) and np.array_equal(out, want)
        out = client.decode(latents_np(t=3, h=2, w=2), format="raw", raw_dtype="bfloat16")
        assert out.dtype == np.float32  # numpy has no bf16: widened exactly
        assert np.array_equal(out, torch.from_numpy(want).to(torch.bfloat16).float().numpy())
        out = client.decode(torch.randn(1, 16, 3, 2, 2), format="RAW", raw_dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.from_numpy(want).to(torch.bfloat16))
        out = client.decode(latents_np(t=3, h=2, w=2), format="raw", raw_dtype="float16")
        assert out.dtype == np.float16
        # Refused by the client itself: a LocalInputError (a ValueError), no server status.
        for kwargs in (dict(format="jpeg"), dict(format="raw", raw_dtype="complex128")):
            with pytest.raises(errors.LocalInputError) as info:
                client.decode(latents_np(), **kwargs)
            assert info.value.code is None and not isinstance(info.value, errors.InvalidArgumentError)
            assert isinstance(info.value, ValueError) and "INVALID_ARGUMENT" not in str(info.value)


def test_stream_yields_chunks_as_they_arrive(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    with vaed_client.VaeClient(target) as client:
        chunks = list(client.stream(latents_np(t=3, h=2, w=2), request_id="s1"))
        torch_chunks = list(client.stream(torch.zeros(1, 16, 3, 2, 2)))
    # 1 + 4 + 4 frames in messages of at most 3 frames
    assert [(c.chunk_index, c.first_frame, c.num_frames) for c in chunks] == [
        (0, 0, 1), (1, 1, 3), (1, 4, 1), (2, 5, 3), (2, 8, 1)
    ]
    assert all(c.request_id == "s1" and isinstance(c.frames, np.ndarray) for c in chunks)
    assert all(isinstance(c.frames, torch.Tensor) for c in torch_chunks)
    assert np.array_equal(assemble(chunks), expected_video(1, 3, 2, 2))
    assert sum(c.nbytes for c in chunks) == expected_video(1, 3, 2, 2).nbytes


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("call", ["stream", "decode"])
def test_stream_sends_its_head_first(fake: tuple[FakeDecoder, str], asynchronous: bool, call: str) -> None:
    """The server starts a session at its first message: it carries the first two latent frames
    and the options, the rest follows (once the first frame is back); nothing lost or reordered.
    decode() sends a whole video the same way, so its first frame (an MP4's first fragment)
    waits for two latent frames, not the whole upload."""
    servicer, target = fake
    head = vaed_client.core.HEAD_LATENT_FRAMES

    def frames_per_message(z: np.ndarray, **kwargs: Any) -> list[int]:
        servicer.requests.clear()
        calls = len(servicer.call_options)
        if asynchronous:
            async def go() -> int:
                async with vaed_client.AsyncVaeClient(target) as client:
                    if call == "decode":
                        return int((await client.decode(z, **kwargs)).shape[1])
                    return sum([c.num_frames async for c in client.stream(z, **kwargs)])
            frames = asyncio.run(go())
        else:
            with vaed_client.VaeClient(target) as client:
                if call == "decode":
                    frames = int(client.decode(z, **kwargs).shape[1])
                else:
                    frames = sum(c.num_frames for c in client.stream(z, **kwargs))
        assert frames == 1 + 4 * (z.shape[2] - 1)
        assert len(servicer.call_options) - calls == 1  # one call: split over messages, so a DecodeStream
        sent = list(servicer.requests)
        assert np.array_equal(np.concatenate([tensors.to_numpy(m.latents) for m in sent], axis=2), z)
        assert [m.HasField("options") for m in sent] == [True] + [False] * (len(sent) - 1)
        return [int(m.latents.shape[2]) for m in sent]

    assert frames_per_message(latents_np(t=7, h=2, w=2), request_id="split") == [head, 7 - head]
    assert servicer.requests[0].options.request_id == "split"
    assert frames_per_message(latents_np(t=2, h=2, w=2)) == [2]
    assert frames_per_message(latents_np(t=1, h=2, w=2)) == [1]
    attempts = servicer.attempts
    with vaed_client.VaeClient(target) as client, pytest.raises(errors.LocalInputError):
        getattr(client, call)(np.zeros((1, 16, 2, 2, 2), np.int64))  # checked before any call
    assert servicer.attempts == attempts  # a new client: not even its GetModelInfo went out


def test_stream_and_session_refuse_mp4_before_any_call(fake: tuple[FakeDecoder, str]) -> None:
    """An MP4 file is one answer at a call's end: the frame calls refuse output_type 'mp4' (they
    used to yield nothing from a call that decoded the whole video), sync and asyncio alike."""
    servicer, target = fake
    attempts = servicer.attempts
    z = latents_np(t=2, h=2, w=2)
    with vaed_client.VaeClient(target) as client:
        with pytest.raises(errors.LocalInputError, match=r"decode\(latents, output_type='mp4'\)"):
            list(client.stream(z, output_type="mp4"))
        with pytest.raises(errors.LocalInputError, match="yield frames"):
            client.session(output_type="MP4")

    async def asynchronous() -> None:
        async with vaed_client.AsyncVaeClient(target) as client:
            with pytest.raises(errors.LocalInputError, match="yield frames"):
                [chunk async for chunk in client.stream(z, output_type="mp4")]
            with pytest.raises(errors.LocalInputError, match="yield frames"):
                client.session(output_type="mp4")

    asyncio.run(asynchronous())
    assert servicer.attempts == attempts  # nothing went out, not even a GetModelInfo


def test_stream_rest_waits_for_the_first_reply() -> None:
    """The request side holds the rest until the first reply opens the gate (or the call ends)."""
    from vaed_client.client import _RestGate
    from vaed_client.core import call_spec, stream_latents

    streamed = stream_latents(call_spec(), latents_np(t=6, h=2, w=2))
    gate = _RestGate()
    requests = gate.requests(streamed)
    assert int(next(requests).latents.shape[2]) == 2
    rest: list[Any] = []
    puller = threading.Thread(target=lambda: rest.append(next(requests)))
    puller.start()
    puller.join(0.3)
    assert puller.is_alive() and not rest  # blocked on the gate, whatever the machine's speed
    gate.opened.set()
    puller.join(10)
    assert int(rest[0].latents.shape[2]) == 4

    class Ended:
        def done(self) -> bool:
            return True

    gate = _RestGate()
    requests = gate.requests(streamed)
    next(requests)
    gate.call = Ended()  # the call ended before any reply: the rest is never sent
    assert list(requests) == []


def test_stream_converts_the_first_frame_before_opening_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rest's upload (serialized on gRPC's thread, holding the GIL) starts only once the
    first reply is converted, so the first frame does not wait for it."""
    from vaed_client import client as client_module
    from vaed_client.core import call_spec

    gate_at_conversion: list[bool] = []
    first_reply = threading.Event()

    def convert(reply: Any, spec: Any, as_torch: bool) -> str:
        gate_at_conversion.append(first_reply.is_set())
        return f"chunk {reply}"

    class Call:
        def __iter__(self) -> Iterator[int]:
            return iter([0, 1])

        def cancel(self) -> None:
            pass

    monkeypatch.setattr(client_module, "chunk_result", convert)
    monkeypatch.setattr(client_module, "has_frames", lambda reply: True)
    chunks = client_module._iterate_chunks(Call(), call_spec(), False, first_reply)
    assert next(chunks) == "chunk 0"
    assert gate_at_conversion == [False]  # converted while the rest was still held
    assert first_reply.is_set()  # and opened before the chunk reached the caller
    assert list(chunks) == ["chunk 1"]


def test_stream_break_cancels_server_side(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    with vaed_client.VaeClient(target) as client:
        client.decode(latents_np(t=2))
        assert not servicer.cancelled.is_set()  # a finished call is not a cancel
        servicer.delay_s = 0.05
        for chunk in client.stream(latents_np(t=20)):
            break
        assert servicer.cancelled.wait(5)


def test_server_errors_map_to_classes(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    with vaed_client.VaeClient(target) as client:
        with pytest.raises(errors.InvalidArgumentError) as info:
            client.decode(latents_np(), request_id="abort:INVALID_ARGUMENT")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.details == "fake failure"
        with pytest.raises(errors.ResourceExhaustedError):
            client.decode(latents_np(), request_id="abort:RESOURCE_EXHAUSTED")
        with pytest.raises(errors.InternalError):
            list(client.stream(latents_np(), request_id="abort:INTERNAL"))
        with pytest.raises(ValueError):  # LocalInputError is a ValueError too
            client.decode(np.zeros((16, 1, 1), np.float32))
        assert client.decode(latents_np(t=1)).shape == (1, 1, 16, 24, 3)  # still fine


def test_timeout_is_per_call(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    servicer.delay_s = 0.2
    with vaed_client.VaeClient(target, timeout=1.0) as client:
        assert client.decode(latents_np(t=1)).shape[1] == 1  # 0.2 s: within its own deadline
        assert client.decode(latents_np(t=1)).shape[1] == 1  # a fresh deadline per call
        with pytest.raises(errors.DeadlineExceededError):
            client.decode(latents_np(t=5))  # 9 messages, 1.8 s


# -- sessions ----------------------------------------------------------------
def test_session_uneven_chunks_collect(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    latents = latents_np(b=2, t=5, h=2, w=3)
    with vaed_client.VaeClient(target) as client:
        with client.session(request_id="sess") as session:
            for a, b in [(0, 1), (1, 4), (4, 5)]:
                session.push(latents[:, :, a:b])
            video = session.collect()
        assert session.request_id == "sess"
    assert np.array_equal(video, expected_video(2, 5, 2, 3))
    sent = servicer.requests[-3:]
    assert [m.HasField("options") for m in sent] == [True, False, False]
    assert sent[0].options.request_id == "sess"


def test_session_iterate_from_another_thread(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    latents = torch.randn(1, 16, 4, 2, 2)
    got: list[vaed_client.DecodedChunk] = []
    with vaed_client.VaeClient(target) as client:
        session = client.session()
        reader = threading.Thread(target=lambda: got.extend(session))
        reader.start()
        for i in range(4):
            session.push(latents[:, :, i : i + 1])
        session.close()
        reader.join(10)
    assert not reader.is_alive()
    assert all(isinstance(c.frames, torch.Tensor) for c in got)
    assert np.array_equal(assemble(got).numpy(), expected_video(1, 4, 2, 2))


def test_session_push_all_before_reading_does_not_deadlock(fake: tuple[FakeDecoder, str]) -> None:
    # 41 frames of 256x384 RGB8 (12 MB) exceed gRPC's flow-control windows.
    _, target = fake
    with vaed_client.VaeClient(target) as client:
        with client.session() as session:
            for _ in range(11):
                session.push(latents_np(t=1, h=32, w=48))
            session.close()
            chunks = list(session)
    assert assemble(chunks).shape == (1, 41, 256, 384, 3)


def test_session_errors_and_cancel(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    with vaed_client.VaeClient(target) as client:
        session = client.session(request_id="abort:RESOURCE_EXHAUSTED")
        session.push(latents_np(t=1))
        with pytest.raises(errors.ResourceExhaustedError):
            session.collect()

        servicer.delay_s = 0.05
        session = client.session()
        session.push(latents_np(t=10))
        next(iter(session))
        session.cancel()
        assert list(session) == []  # cancelled by us: iteration just ends
        assert servicer.cancelled.wait(5)
        with pytest.raises(RuntimeError):
            session.push(latents_np(t=1))


def test_session_collect_after_cancel_raises(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    servicer.delay_s = 0.05
    with vaed_client.VaeClient(target) as client:
        session = client.session()
        session.push(latents_np(t=5))
        session.cancel()
        with pytest.raises(errors.CancelledError):
            session.collect()


def test_session_collect_of_nothing_and_collect_twice_are_usage_errors(fake: tuple[FakeDecoder, str]) -> None:
    """A session pushed nothing has no video (the server ends it with no frames: that was an
    InternalError, which the client keeps for servers that break the protocol); a second
    collect() has none left (it read the end marker as an empty video: InternalError too)."""
    _, target = fake
    with vaed_client.VaeClient(target) as client:
        with client.session() as session:
            with pytest.raises(errors.LocalInputError, match="pushed no latents"):
                session.collect()
        with client.session() as session:
            session.push(latents_np(t=2))
            assert np.array_equal(session.collect(), expected_video(1, 2, 2, 3))
            with pytest.raises(RuntimeError, match="collect\\(\\) called twice"):
                session.collect()

    async def main() -> None:
        async with vaed_client.AsyncVaeClient(target) as client:
            async with client.session() as session:
                with pytest.raises(errors.LocalInputError, match="pushed no latents"):
                    await session.collect()
            async with client.session() as session:
                await session.push(latents_np(t=2))
                assert np.array_equal(await session.collect(), expected_video(1, 2, 2, 3))
                with pytest.raises(RuntimeError, match="collect\\(\\) called twice"):
                    await session.collect()

    asyncio.run(main())


# -- asyncio -----------------------------------------------------------------
def test_async_client(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake

    async def main() -> None:
        async with vaed_client.AsyncVaeClient(target, token="t") as client:
            info = await client.model_info()
            assert info.scale_factor_temporal == TEMPORAL and info.latents_mean == [0.5] * 16
            video = await client.decode(latents_np(b=2, t=3, h=2, w=2))
            assert np.array_equal(video, expected_video(2, 3, 2, 2))
            raw = await client.decode(torch.zeros(1, 16, 2, 2, 2), format="raw", raw_dtype="bfloat16")
            assert raw.dtype == torch.bfloat16 and raw.shape == (1, 3, 5, 16, 16)

            chunks = [c async for c in client.stream(latents_np(t=3, h=2, w=2))]
            assert [c.first_frame for c in chunks] == [0, 1, 4, 5, 8]

            latents = latents_np(t=5, h=2, w=2)
            async with client.session() as session:
                for a, b in [(0, 1), (1, 4), (4, 5)]:
                    await session.push(latents[:, :, a:b])
                assert np.array_equal(await session.collect(), expected_video(1, 5, 2, 2))

            session = client.session()
            await session.push(torch.zeros(1, 16, 2, 2, 2))
            await session.close()
            got = [c async for c in session]
            assert all(isinstance(c.frames, torch.Tensor) for c in got)
            assert assemble(got).shape == (1, 5, 16, 16, 3)

            with pytest.raises(errors.LocalInputError, match=r"\[16, 1, 1\]"):
                await client.decode(np.zeros((16, 1, 1), np.float32))
            with pytest.raises(errors.ResourceExhaustedError):
                async for _ in client.stream(latents_np(), request_id="abort:RESOURCE_EXHAUSTED"):
                    pass
            session = client.session(request_id="abort:INVALID_ARGUMENT")
            await session.push(latents_np(t=1))
            with pytest.raises(errors.InvalidArgumentError):
                await session.collect()

            servicer.delay_s = 0.05
            session = client.session()
            await session.push(latents_np(t=10))
            async for _ in session:
                break
            session.cancel()
            assert [c async for c in session] == []
        assert all(m.get("authorization") == "Bearer t" for m in servicer.metadata)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_async_timeout(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    servicer.delay_s = 0.1

    async def main() -> None:
        async with vaed_client.AsyncVaeClient(target, timeout=0.25) as client:
            with pytest.raises(errors.DeadlineExceededError):
                await client.decode(latents_np(t=5))

    asyncio.run(main())


# -- packaging ---------------------------------------------------------------
def test_client_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # makes `import torch` fail
        "import numpy as np, vaed_client\n"
        "from vaed_client import tensors\n"
        "a = np.arange(6, dtype=np.float32).reshape(2, 3)\n"
        "assert np.array_equal(tensors.to_numpy(tensors.to_message(a)), a)\n"
        "print(vaed_client.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == vaed_client.__version__
