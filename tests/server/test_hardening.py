"""Hostile and unusual clients, through the real wire: exact statuses, bounded
memory, sessions exact at every shape, and no raw control characters in logs."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Iterator

import grpc
import pytest
import torch

from vaed_client import VaeClient, tensors, wire
from vaed_client import channel as vchannel
from vaed_client._proto import vaed_pb2, vaed_pb2_grpc
from vaed_client.errors import DeadlineExceededError, InvalidArgumentError

from harness import make_config, proc_rss_bytes, serve_in_thread, start_cli_server

pb = wire.pb
Z = 4  # z_dim of random:wan2.1-tiny


@pytest.fixture(scope="module")
def server():
    config = make_config(max_latent_frames=0, max_pixels=0, max_sessions=4, max_concurrent_rpcs=6)
    with serve_in_thread(config) as running:
        yield running


@pytest.fixture()
def stub(server):
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20)])
    yield wire.pb_grpc.VaeDecoderStub(channel)
    channel.close()


def _status(call: Iterator) -> tuple[grpc.StatusCode, str]:
    try:
        list(call)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _raw_call(target: str, method: str, payload: bytes, streaming_request: bool) -> tuple[grpc.StatusCode, str]:
    """Send raw bytes to a method (no serializer), as a hostile client would."""
    with grpc.insecure_channel(target) as channel:
        path = f"/{wire.SERVICE_NAME}/{method}"
        try:
            if method == "GetModelInfo":
                channel.unary_unary(path)(payload, timeout=10)
            elif streaming_request:
                list(channel.stream_stream(path)(iter([payload]), timeout=10))
            else:
                list(channel.unary_stream(path)(payload, timeout=10))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


# -- shapes, messages, ids -----------------------------------------------------------------

@pytest.mark.parametrize("shape, nbytes", [
    ([1, Z, 1, 2**32, 2**32], 0),
    ([1, Z, 1, 8, 8 + 2**60], 4096),
    ([2**62, Z, 2**62, 1, 1], 16),
])
def test_shapes_that_overflow_int64_are_invalid_argument(stub, shape, nbytes):
    request = pb.DecodeRequest(latents=pb.Tensor(dtype=pb.FLOAT32, shape=shape, data=b"\0" * nbytes))
    code, details = _status(stub.Decode(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(shape) in details


@pytest.mark.parametrize("method, streaming", [("GetModelInfo", False), ("Decode", False), ("DecodeStream", True)])
def test_malformed_protobuf_is_invalid_argument(server, method, streaming, caplog):
    caplog.set_level(logging.INFO)
    code, details = _raw_call(server.target, method, b"\xff\xff\xff\xff garbage", streaming)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "malformed" in details
    assert "Traceback" not in caplog.text


def test_unknown_method_is_unimplemented_without_auth(server):
    code, _ = _raw_call(server.target, "NoSuchMethod", b"", False)
    assert code == grpc.StatusCode.UNIMPLEMENTED


# "x status=OK": the log line's fields are separated by spaces, so this id forged a field of it
@pytest.mark.parametrize("request_id", ["a" * 129, "line\nbreak", "nul\x00byte", "tab\there", "é-not-ascii",
                                        "x status=OK"])
def test_bad_request_ids_are_refused_and_never_logged_raw(stub, request_id, caplog):
    caplog.set_level(logging.INFO, logger="vaed")
    latents = wire.to_message(torch.randn(1, Z, 1, 5, 7))
    request = pb.DecodeRequest(latents=latents, options=pb.DecodeOptions(request_id=request_id))
    code, details = _status(stub.Decode(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "128 printable ASCII" in details
    for bad in ("\n", "\x00", "\t"):
        assert not any(bad in record.getMessage() for record in caplog.records)
    # no field but the JSON-quoted error (which quotes the id) says status=OK
    assert not any("status=OK" in record.getMessage().split(" error=")[0] for record in caplog.records)
    # the call's line says why it failed, as its client was told
    (line,) = [r.getMessage() for r in caplog.records if "status=INVALID_ARGUMENT" in r.getMessage()]
    assert line.endswith(f" error={json.dumps(details)}"), line


def test_a_128_character_request_id_is_echoed(stub):
    request_id = "r" * 127 + "~"
    latents = wire.to_message(torch.randn(1, Z, 1, 5, 7))
    replies = list(stub.Decode(pb.DecodeRequest(latents=latents, options=pb.DecodeOptions(request_id=request_id))))
    assert {r.request_id for r in replies} == {request_id}


def test_every_call_ends_with_one_empty_final_message(stub):
    latents = wire.to_message(torch.randn(1, Z, 3, 5, 7))
    replies = list(stub.Decode(pb.DecodeRequest(latents=latents)))
    assert [r.final for r in replies] == [False] * (len(replies) - 1) + [True]
    last = replies[-1]
    assert not last.HasField("frames") and last.chunk_index == 3 and last.first_frame == 9


# -- non-finite latents, dtype changes ------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_latents_are_invalid_argument_unless_allowed(server, bad):
    latents = torch.randn(1, Z, 2, 5, 7)
    latents[0, 1, 1, 2, 3] = bad
    with VaeClient(server.target) as client:
        with pytest.raises(InvalidArgumentError, match="NaN or Inf"):
            client.decode(latents)
    with grpc.insecure_channel(server.target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        options = pb.DecodeOptions(format=pb.RAW, raw_dtype=pb.FLOAT32, allow_non_finite=True)
        replies = list(stub.Decode(pb.DecodeRequest(latents=wire.to_message(latents), options=options)))
        assert replies[-1].final and len(replies) > 1


def test_dtype_change_mid_session_is_refused(stub):
    first = pb.LatentChunk(latents=wire.to_message(torch.randn(1, Z, 1, 5, 7)))
    second = pb.LatentChunk(latents=wire.to_message(torch.randn(1, Z, 1, 5, 7).to(torch.bfloat16)))
    code, details = _status(stub.DecodeStream(iter([first, second]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "dtype" in details


# -- sessions are exact at every shape -------------------------------------------------------

@pytest.mark.parametrize("h", [1, 2, 3, 8])
@pytest.mark.parametrize("w", [1, 2, 3, 8])
@pytest.mark.parametrize("split", [(1, 1), (2, 1), (1, 2)])
def test_session_equals_one_shot_at_every_shape(server, h, w, split):
    torch.manual_seed(h * 100 + w)
    latents = torch.randn(1, Z, sum(split), h, w)
    with VaeClient(server.target) as client:
        one_shot = client.decode(latents, format="raw", raw_dtype="float32")
        with client.session(format="raw", raw_dtype="float32") as session:
            start = 0
            for t in split:
                session.push(latents[:, :, start : start + t])
                start += t
            streamed = session.collect()
    assert torch.equal(one_shot, streamed)


# -- limits on calls ----------------------------------------------------------------------------

def test_concurrent_rpcs_over_the_cap_are_resource_exhausted(server):
    """max_concurrent_rpcs=6: four sessions and two DecodeStream calls that have sent nothing yet
    hold every RPC slot. (A client session's call starts with its first push, so the two silent
    calls are raw ones.)"""
    stop = threading.Event()

    def silent() -> Iterator[bytes]:
        stop.wait(60)
        yield from ()

    with VaeClient(server.target) as client, grpc.insecure_channel(server.target) as channel:
        sessions = [client.session() for _ in range(4)]
        waiting = [channel.stream_stream(f"/{wire.SERVICE_NAME}/DecodeStream")(silent(), timeout=60) for _ in range(2)]
        try:
            for s in sessions:
                s.push(torch.randn(1, Z, 1, 5, 7))
            deadline = time.monotonic() + 10
            while server.server.pool.active_sessions < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            stub = wire.pb_grpc.VaeDecoderStub(channel)
            code, details = _status(stub.Decode(pb.DecodeRequest(), timeout=10))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "calls in flight" in details
        finally:
            stop.set()
            for call in waiting:
                call.cancel()
            for s in sessions:
                s.cancel()


# -- input backpressure -------------------------------------------------------------------------

@pytest.mark.slow
def test_stream_flood_is_held_by_flow_control_and_server_memory_stays_bounded():
    """A client tries to push 1 GiB of latents without reading a frame. The server
    reads only while the session's backlog is under --max-backlog-frames, so gRPC
    flow control stops the client (its push stops within the server's fixed 4 MiB stream window and
    the client's own buffers) and the server's RSS grows by less than 128 MiB (the first server grew
    by the whole push: 2.1 GB for ten 39 MiB chunks). The bound covers the message being read, the
    HTTP/2 window, the two decodes the output credits allow and allocator noise. Messages are 1 MiB
    of 1024 small latent frames so those decodes cost little memory. Measured on a 2-core machine:
    5-8 messages left the client, the server grew by 10-33 MiB with 3-5 busy loops beside it and by
    40-72 MiB idle (allocator noise). With
    gRPC's BDP-probed windows (the server's old options) the delay a loaded machine measures grew
    the window: 68 messages left the client and the server grew by 87-114 MiB, and once in CI 220
    MiB."""
    proc, target = start_cli_server("--max-pixels", "0", "--max-latent-frames", "0", "--max-backlog-frames", "4")
    try:
        chunk = pb.LatentChunk(latents=wire.to_message(torch.randn(1, Z, 1024, 8, 8)))  # 1 MiB, 1024 latent frames
        pulled = [0]
        stop = threading.Event()

        def requests():
            for _ in range(1024):  # 1 GiB in all
                if stop.is_set():
                    return
                pulled[0] += 1
                yield chunk

        channel = grpc.insecure_channel(target)
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        # One small call of the same frame size first, read to its end: the decode path's
        # first-use allocations (the model's first forward, gRPC's call buffers) are then in
        # `before`, and the bound measures what the flood itself holds.
        warm = pb.LatentChunk(latents=wire.to_message(torch.randn(1, Z, 2, 8, 8)))
        assert any(r.final for r in stub.DecodeStream(iter([warm]), timeout=60))
        before = proc_rss_bytes(proc.pid)
        call = stub.DecodeStream(requests(), timeout=120)
        # The client pushes as fast as flow control lets it; nothing is read. Wait until it is
        # held (no chunk left it for 3 s), however slowly a loaded machine gets there.
        last, moved_at = -1, time.monotonic()
        deadline = moved_at + 90
        while time.monotonic() - moved_at < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            if pulled[0] != last:
                last, moved_at = pulled[0], time.monotonic()
        held = time.monotonic() - moved_at >= 3
        grown = proc_rss_bytes(proc.pid) - before
        sent = pulled[0]
        stop.set()
        call.cancel()
        channel.close()
        # What the client got rid of sits in the server's 4 MiB stream window and client-side
        # buffers, not in the server's session: 5-8 chunks seen, idle and loaded.
        assert held, f"flow control never held the client: {sent} of 1024 chunks (1 MiB each) and still pushing"
        assert sent < 32, f"flow control let {sent} of 1024 chunks (1 MiB each) through"
        assert grown < 128 << 20, f"server RSS grew by {grown >> 20} MiB"
    finally:
        proc.kill()
        proc.wait(30)


def test_a_session_pushed_ahead_of_its_reader_delivers_every_frame(server):
    """Ten chunks pushed before reading anything (backlog bound 4 latent frames) all decode, in order."""
    latents = torch.randn(1, Z, 10, 4, 4)
    with VaeClient(server.target) as client:
        with client.session(format="raw", raw_dtype="float32") as session:
            for i in range(10):
                session.push(latents[:, :, i : i + 1])
            streamed = session.collect()
        assert torch.equal(streamed, client.decode(latents, format="raw", raw_dtype="float32"))
    assert streamed.shape[2] == 37


@pytest.mark.parametrize("remaining, passed", [(None, False), (5.0, False), (0.2, False), (0.05, True), (0.0, True),
                                               (-1.0, True)])
def test_a_cancellation_just_before_the_servers_deadline_is_the_deadlines(remaining, passed) -> None:
    """The client's deadline cancels the call on its clock, which starts before the server's: a
    cancellation within DEADLINE_SKEW_S of the server's deadline is logged DEADLINE_EXCEEDED
    (one CI run saw it arrive 0.1 ms early and log CANCELLED); one earlier is the caller's."""
    from vaed import service

    class Context:
        def time_remaining(self) -> float | None:
            return remaining

    assert service.DEADLINE_SKEW_S == 0.1
    assert service._deadline_passed(Context())() is passed  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["Decode", "DecodeStream"])
def test_a_deadline_is_logged_and_counted_as_deadline_exceeded(caplog, method):
    """The server sees a cancelled call; when the caller's deadline passed it reports
    DEADLINE_EXCEEDED, not CANCELLED (log line and vaed_requests_total): for an independent
    client's Decode RPC, and for the client's decode() (a DecodeStream)."""
    import urllib.request

    from harness import decode_rpc

    caplog.set_level(logging.INFO, logger="vaed")
    with serve_in_thread(make_config(metrics_port=0)) as running:
        engine = running.server.pool.engine
        original = engine.decode_frame

        def slow(*args):
            time.sleep(0.2)
            return original(*args)

        engine.decode_frame = slow
        try:
            if method == "Decode":
                with pytest.raises(grpc.RpcError) as info:
                    decode_rpc(running.target, torch.randn(1, Z, 8, 5, 7), timeout=0.5)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                with VaeClient(running.target, timeout=0.5) as client:
                    client.model_info()
                    with pytest.raises(DeadlineExceededError):
                        client.decode(torch.randn(1, Z, 8, 5, 7))
            deadline = time.monotonic() + 10
            while f"{method} id=" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            engine.decode_frame = original
        assert "status=DEADLINE_EXCEEDED" in caplog.text and "status=CANCELLED" not in caplog.text
        port = running.server.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert f'vaed_requests_total{{code="DEADLINE_EXCEEDED",method="{method}"}} 1.0' in text


# -- refused calls keep nothing ------------------------------------------------------------------

# Calls and payload per method: 635 MiB in all (0.6, 2.5 and 4 MiB a call), which the server kept
# when each call kept its message (+444 MiB for the first 353 MiB of them); with nothing kept,
# +80 and +84 MiB (what gRPC's and Python's allocators hold). DecodeStream and Encode refusals
# linger (~0.25 s a call) for the client to stop sending.
REFUSED = {"Decode": (600, (1, Z + 1, 4, 128, 64)), "DecodeStream": (40, (1, Z + 1, 4, 256, 128)),
           "Encode": (40, (1, 4, 1, 512, 512))}  # wrong z_dim, and frames of 4 channels (RGB has 3)


def test_refused_calls_keep_none_of_their_messages() -> None:
    """Decode, DecodeStream and Encode calls refused at their first message leave the server's
    memory where it was. A refusal used to be `context.abort`, whose AbortError grpc keeps on the
    call's state in a reference cycle with the handler's frames, so each call's message stayed
    until a full garbage collection: ~1.5 MB for each 1.3 MB call, past 2.9 GB. The server runs
    with glibc's mmap threshold in its environment, so that freed messages leave its RSS
    (`vaed serve` otherwise keeps freed memory for reuse)."""
    from harness import start_serve

    def call(stub: Any, method: str, tensor: torch.Tensor) -> Iterator:
        message = wire.to_message(tensor)
        if method == "Decode":
            return stub.Decode(pb.DecodeRequest(latents=message), timeout=60)
        if method == "DecodeStream":
            return stub.DecodeStream(iter([pb.LatentChunk(latents=message)]), timeout=60)
        return stub.Encode(iter([pb.VideoChunk(frames=message)]), timeout=60)

    proc, target, _ = start_serve("--encode", fresh_interpreter=True,
                                  environ={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    try:
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = wire.pb_grpc.VaeDecoderStub(channel)
            for method, (_, shape) in REFUSED.items():  # each path's first call: its imports, its buffers
                assert _status(call(stub, method, torch.zeros(shape)))[0] == grpc.StatusCode.INVALID_ARGUMENT
            before = proc_rss_bytes(proc.pid)
            sent = 0
            for method, (calls, shape) in REFUSED.items():
                tensor = torch.zeros(shape)
                for _ in range(calls):
                    code, details = _status(call(stub, method, tensor))
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, details)
                sent += calls * tensor.numel() * 4
            growth = proc_rss_bytes(proc.pid) - before
        print(f"\nrefused calls carrying {sent >> 20} MiB: RSS {growth / (1 << 20):+.1f} MiB")
        assert growth < sent // 3, f"the server kept {growth >> 20} MiB after refusing {sent >> 20} MiB of calls"
    finally:
        proc.kill()
        proc.wait(30)


def test_a_call_refused_after_its_whole_message_keeps_none_of_it() -> None:
    """Decodes of 64 MiB refused once their message is whole (the frames are over --max-pixels)
    leave the server's memory where it was. grpc.aio's request generator, left suspended after
    the one message it yielded, held that message in a reference cycle the garbage collector
    does not free: +64 MiB a call for good (and, while the failure carried the refusal as its
    context, +200 MiB until a collection)."""
    from harness import start_serve

    calls, shape = 5, (1, Z, 1, 2048, 2048)  # 64 MiB of fp32 latents; 16384 x 16384 frames
    proc, target, _ = start_serve("--max-pixels", str(256 * 256), fresh_interpreter=True,
                                  environ={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    try:
        options = [("grpc.max_send_message_length", 256 << 20)]
        with grpc.insecure_channel(target, options=options) as channel:
            stub = wire.pb_grpc.VaeDecoderStub(channel)
            request = pb.DecodeRequest(latents=wire.to_message(torch.zeros(shape)))
            # the first such call's imports and gRPC's buffers for a message of this size
            assert _status(stub.Decode(request, timeout=120))[0] == grpc.StatusCode.INVALID_ARGUMENT
            before = proc_rss_bytes(proc.pid)
            for _ in range(calls):
                code, details = _status(stub.Decode(request, timeout=120))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "pixels" in details, details
            growth = proc_rss_bytes(proc.pid) - before
        sent = calls * request.latents.ByteSize()
        print(f"\n{calls} refused Decodes of {sent // calls >> 20} MiB: RSS {growth / (1 << 20):+.1f} MiB")
        assert growth < sent // calls, f"the server kept {growth >> 20} MiB after refusing {sent >> 20} MiB of calls"
    finally:
        proc.kill()
        proc.wait(30)


def test_a_refused_call_whose_client_leaves_during_the_linger_is_still_counted(caplog):
    """DecodeStream's refusals linger ~0.25 s before their status; a client that gives up
    meanwhile (a 0.1 s deadline) cancelled that wait, and its refused call was neither logged
    nor counted. Each of the 10 calls is counted once, by the status the server gave it (or as
    cut, where the deadline came before the server judged it)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    caplog.set_level(logging.INFO, logger="vaed")
    bad = torch.randn(1, Z + 1, 1, 4, 4)  # a z_dim the model does not have: INVALID_ARGUMENT
    with serve_in_thread(make_config(metrics_port=0)) as running:
        with grpc.insecure_channel(running.target, options=vchannel.channel_options()) as channel:
            stub = vaed_pb2_grpc.VaeDecoderStub(channel)
            for _ in range(10):
                chunks = iter([vaed_pb2.LatentChunk(latents=tensors.to_message(bad))])
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.DecodeStream(chunks, timeout=0.1))
                assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT)
        port = running.server.metrics_port

        def counted() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            return {s.labels["code"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "vaed_requests_total" and s.labels.get("method") == "DecodeStream"}

        deadline = time.monotonic() + 30  # a bound on a hang: the lingering calls end within ~0.25 s
        while sum(counted().values()) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(counted().values()) == 10, counted()
        assert counted().get("INVALID_ARGUMENT", 0) >= 1, counted()  # the linger was reached
        assert caplog.text.count("DecodeStream id=") == 10, caplog.text


def test_racing_first_calls_of_an_asyncio_client_fetch_the_model_once():
    """Each call of a fresh AsyncVaeClient needs the model's info first. 12 first calls at once
    sent a GetModelInfo each, every one taking an RPC slot (60 at once sent 35, some refused);
    racing first calls now wait for one fetch, and every video is the same."""
    import asyncio
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from vaed_client import AsyncVaeClient

    latents = torch.randn(1, Z, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    with serve_in_thread(make_config(metrics_port=0)) as running:
        async def first_calls() -> list[torch.Tensor]:
            async with AsyncVaeClient(running.target) as client:
                return list(await asyncio.gather(*(client.decode(latents, output_type="pt") for _ in range(12))))

        videos = asyncio.run(first_calls())
        text = urllib.request.urlopen(f"http://127.0.0.1:{running.server.metrics_port}/metrics", timeout=10).read()
        counted = {(s.labels["method"], s.labels["code"]): s.value
                   for f in text_string_to_metric_families(text.decode()) for s in f.samples
                   if s.name == "vaed_requests_total"}
    assert all(torch.equal(v, videos[0]) for v in videos[1:])
    assert counted.get(("DecodeStream", "OK")) == 12, counted
    assert counted.get(("GetModelInfo", "OK")) == 1, counted


def _half_a_message_then_gone(port: int, method: str, message: bytes) -> None:
    """A raw HTTP/2 gRPC call that sends half of its one message, then closes its socket."""
    import socket
    import struct

    import h2.config
    import h2.connection

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", f"/vaed.v1.VaeDecoder/{method}"),
                                   (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                                   ("te", "trailers")])
        framed = b"\0" + struct.pack(">I", len(message)) + message
        conn.send_data(stream, framed[: len(framed) // 2])  # within the default 64 KiB window
        s.sendall(conn.data_to_send())
        time.sleep(0.05)  # the server has the call's head and part of its message


@pytest.mark.parametrize("method", ["Decode", "Encode"])
def test_a_client_gone_before_its_first_message_is_counted_cancelled(method):
    """A client whose connection closes halfway through its first message sent nothing whole:
    the call is CANCELLED (it was INVALID_ARGUMENT "needs one message", for about half of the
    calls, whose end of input the server read before grpc marked the call cancelled)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if method == "Decode":
        request = vaed_pb2.DecodeRequest(latents=tensors.to_message(torch.randn(1, Z, 2, 8, 8)))
    else:
        request = vaed_pb2.VideoChunk(frames=tensors.to_message(torch.zeros(1, 5, 32, 32, 3, dtype=torch.uint8)))
    message = request.SerializeToString()
    assert len(message) < 60_000
    calls = 10
    with serve_in_thread(make_config(metrics_port=0, encode=method == "Encode")) as running:
        port = int(running.target.rsplit(":", 1)[1])
        for _ in range(calls):
            _half_a_message_then_gone(port, method, message)

        def counted() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{running.server.metrics_port}/metrics",
                                          timeout=10).read().decode()
            return {s.labels["code"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "vaed_requests_total" and s.labels.get("method") == method}

        deadline = time.monotonic() + 30  # a bound on a hang: each call ends as its socket closes
        while sum(counted().values()) < calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counted() == {"CANCELLED": calls}, counted()
