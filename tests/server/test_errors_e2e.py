"""Bad input gets the right status and a message; the server keeps serving."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from vaed_client import VaeClient, tensors
from vaed_client._proto import vaed_pb2, vaed_pb2_grpc
from vaed_client.errors import DeadlineExceededError, ResourceExhaustedError

from harness import serve_in_thread, make_config

Z = 4  # z_dim of random:wan2.1-tiny


def good_latents(b=1, t=2, h=5, w=7) -> torch.Tensor:
    return torch.randn(b, Z, t, h, w)


def tensor_msg(array: torch.Tensor) -> vaed_pb2.Tensor:
    return tensors.to_message(array)


def decode_status(stub, request: vaed_pb2.DecodeRequest) -> tuple[grpc.StatusCode, str]:
    try:
        list(stub.Decode(request, timeout=30))
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def stream_status(stub, chunks: list[vaed_pb2.LatentChunk]) -> tuple[grpc.StatusCode, str]:
    try:
        list(stub.DecodeStream(iter(chunks), timeout=30))
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def limited_server():
    config = make_config(max_latent_frames=6, max_pixels=64 * 64, max_batch=2, max_sessions=2)
    with serve_in_thread(config) as running:
        yield running


@pytest.fixture()
def stub(limited_server):
    channel = grpc.insecure_channel(
        limited_server.target, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    yield vaed_pb2_grpc.VaeDecoderStub(channel)
    channel.close()


def _raw(dtype: int, shape: list[int], nbytes: int) -> vaed_pb2.Tensor:
    return vaed_pb2.Tensor(dtype=dtype, shape=shape, data=b"\0" * nbytes)


BAD_DECODE_REQUESTS = {
    "rank 4": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z, 2, 5))), "5-D"),
    "wrong z_dim": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z + 1, 2, 5, 7))), "z_dim"),
    "unknown dtype": (vaed_pb2.DecodeRequest(latents=_raw(9, [1, Z, 1, 5, 7], 4 * Z * 35)), "unsupported dtype"),
    "uint8 latents": (vaed_pb2.DecodeRequest(latents=_raw(vaed_pb2.UINT8, [1, Z, 1, 5, 7], Z * 35)), "latents dtype"),
    "byte count": (vaed_pb2.DecodeRequest(latents=_raw(vaed_pb2.FLOAT32, [1, Z, 1, 5, 7], 4 * Z * 35 - 4)), "byte count"),
    "T = 0": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z, 0, 5, 7))), "empty"),
    "h = 0": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z, 2, 0, 7))), "empty"),
    "w = 0": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z, 2, 5, 0))), "empty"),
    "over max_latent_frames": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z, 7, 5, 7))), "limit of 6"),
    "over max_pixels": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(1, Z, 1, 9, 8))), "pixels"),
    "over max_batch": (vaed_pb2.DecodeRequest(latents=tensor_msg(torch.randn(3, Z, 1, 5, 7))), "batch"),
    "raw_dtype UINT8": (
        vaed_pb2.DecodeRequest(
            latents=tensor_msg(good_latents()),
            options=vaed_pb2.DecodeOptions(format=vaed_pb2.RAW, raw_dtype=vaed_pb2.UINT8),
        ),
        "raw_dtype",
    ),
    "unknown format": (
        vaed_pb2.DecodeRequest(latents=tensor_msg(good_latents()), options=vaed_pb2.DecodeOptions(format=7)),
        "format",
    ),
    # it said "latents: shape []: unsupported dtype unknown(0)"
    "no latents": (vaed_pb2.DecodeRequest(), "the message carries no latents: set its Tensor"),
    "options only": (vaed_pb2.DecodeRequest(options=vaed_pb2.DecodeOptions(request_id="r")), "carries no latents"),
}


@pytest.mark.parametrize("case", sorted(BAD_DECODE_REQUESTS))
def test_bad_decode_request_is_invalid_argument_and_server_keeps_serving(limited_server, stub, case):
    request, fragment = BAD_DECODE_REQUESTS[case]
    code, details = decode_status(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details)
    assert fragment in details, details
    assert "Traceback" not in details
    ok, _ = decode_status(stub, vaed_pb2.DecodeRequest(latents=tensor_msg(good_latents())))
    assert ok == grpc.StatusCode.OK
    assert limited_server.active_sessions == 0


def _chunk(latents: torch.Tensor, options: vaed_pb2.DecodeOptions | None = None) -> vaed_pb2.LatentChunk:
    chunk = vaed_pb2.LatentChunk(latents=tensor_msg(latents))
    if options is not None:
        chunk.options.CopyFrom(options)
    return chunk


BAD_STREAMS = {
    "options on a later message": (
        [_chunk(good_latents(t=1)), _chunk(good_latents(t=1), vaed_pb2.DecodeOptions(raw_latents=True))],
        "first message",
    ),
    "B changes": ([_chunk(good_latents(b=1, t=1)), _chunk(good_latents(b=2, t=1))], "session started"),
    "h changes": ([_chunk(good_latents(t=1)), _chunk(good_latents(t=1, h=6))], "session started"),
    "w changes": ([_chunk(good_latents(t=1)), _chunk(good_latents(t=1, w=6))], "session started"),
    "z_dim changes": ([_chunk(good_latents(t=1)), _chunk(torch.randn(1, Z + 2, 1, 5, 7))], "z_dim"),
    "session over max_latent_frames": ([_chunk(good_latents(t=4)), _chunk(good_latents(t=3))], "limit of 6"),
    "bad first message": ([_chunk(torch.randn(1, Z, 1, 5))], "5-D"),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_bad_stream_is_invalid_argument_and_server_keeps_serving(limited_server, stub, case):
    chunks, fragment = BAD_STREAMS[case]
    code, details = stream_status(stub, chunks)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details)
    assert fragment in details, details
    ok, _ = stream_status(stub, [_chunk(good_latents(t=1)), _chunk(good_latents(t=2))])
    assert ok == grpc.StatusCode.OK
    _wait_for(lambda: limited_server.active_sessions == 0)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_sessions_full_is_resource_exhausted_then_recovers(limited_server):
    with VaeClient(limited_server.target) as client:
        open_sessions = [client.session(), client.session()]
        for session in open_sessions:
            session.push(good_latents(t=1))
        _wait_for(lambda: limited_server.active_sessions == 2)
        with pytest.raises(ResourceExhaustedError) as info:
            client.decode(good_latents())
        assert "sessions" in info.value.details
        for session in open_sessions:
            session.collect()
        _wait_for(lambda: limited_server.active_sessions == 0)
        assert client.decode(good_latents()).shape[1] == 5


def test_out_of_memory_is_resource_exhausted_and_next_request_succeeds(limited_server, monkeypatch):
    engine = limited_server.server.pool.engine
    original = engine.decode_frame
    calls = {"n": 0}

    def failing_once(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return original(*args)

    monkeypatch.setattr(engine, "decode_frame", failing_once)
    with VaeClient(limited_server.target) as client:
        with pytest.raises(ResourceExhaustedError) as info:
            client.decode(good_latents(t=3))
        assert "out of memory" in info.value.details
        assert client.decode(good_latents(t=3)).shape[1] == 9
    assert limited_server.active_sessions == 0


def _slow_steps(engine, monkeypatch, seconds: float) -> None:
    original = engine.decode_frame

    def slow(*args):
        time.sleep(seconds)
        return original(*args)

    monkeypatch.setattr(engine, "decode_frame", slow)


def test_cancel_mid_stream_frees_the_session(limited_server, monkeypatch):
    _slow_steps(limited_server.server.pool.engine, monkeypatch, 0.05)
    with VaeClient(limited_server.target) as client:
        stream = client.stream(good_latents(t=6))
        first = next(stream)
        assert first.first_frame == 0
        assert limited_server.active_sessions == 1
        stream.close()  # stops iteration: the client cancels the call
        _wait_for(lambda: limited_server.active_sessions == 0)
        session = client.session()
        session.push(good_latents(t=2))
        next(iter(session))
        session.cancel()
        _wait_for(lambda: limited_server.active_sessions == 0)
        assert client.decode(good_latents(t=1)).shape[1] == 1


def test_deadline_stops_the_decode_between_chunks(limited_server, monkeypatch):
    _slow_steps(limited_server.server.pool.engine, monkeypatch, 0.2)
    with VaeClient(limited_server.target, timeout=0.5) as client:
        with pytest.raises(DeadlineExceededError):
            client.decode(good_latents(t=6))
    _wait_for(lambda: limited_server.active_sessions == 0)


def test_internal_error_has_no_stack_trace_and_server_survives(limited_server, monkeypatch):
    engine = limited_server.server.pool.engine
    original = engine.decode_frame

    def broken(*args):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(engine, "decode_frame", broken)
    channel = grpc.insecure_channel(limited_server.target)
    code, details = decode_status(vaed_pb2_grpc.VaeDecoderStub(channel), vaed_pb2.DecodeRequest(latents=tensor_msg(good_latents())))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in details and "Traceback" not in details and "request id" in details
    monkeypatch.setattr(engine, "decode_frame", original)
    code, _ = decode_status(vaed_pb2_grpc.VaeDecoderStub(channel), vaed_pb2.DecodeRequest(latents=tensor_msg(good_latents())))
    assert code == grpc.StatusCode.OK
    channel.close()


def test_async_session_rejected_while_writing_gets_the_real_status(limited_server):
    """grpc.aio clients still writing when a session fails used to see INTERNAL
    (28-37 of 40 on loopback); the server drains in-flight chunks first."""
    import asyncio

    from vaed_client import AsyncVaeClient
    from vaed_client.errors import InvalidArgumentError

    async def rejected_session(client) -> type:
        session = client.session()
        try:
            await session.push(torch.randn(1, Z + 1, 1, 5, 7))  # wrong z_dim
            for _ in range(3):
                await session.push(good_latents(t=1))
            await session.collect()
        except Exception as exc:
            return type(exc)
        return type(None)

    async def main() -> list[type]:
        async with AsyncVaeClient(limited_server.target) as client:
            return [await rejected_session(client) for _ in range(20)]

    assert asyncio.run(main()) == [InvalidArgumentError] * 20
    _wait_for(lambda: limited_server.active_sessions == 0)


def test_async_session_with_wrong_token_is_unauthenticated(tmp_path):
    import asyncio

    from vaed_client import AsyncVaeClient
    from vaed_client.errors import UnauthenticatedError

    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    with serve_in_thread(make_config(auth_token_file=str(token_file))) as server:

        async def attempt() -> type:
            async with AsyncVaeClient(server.target, token="wrong-token") as client:
                session = client.session()
                try:
                    await session.push(good_latents(t=1))
                    await session.collect()
                except Exception as exc:
                    return type(exc)
            return type(None)

        async def main() -> list[type]:
            return [await attempt() for _ in range(20)]

        assert asyncio.run(main()) == [UnauthenticatedError] * 20
