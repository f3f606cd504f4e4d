"""--send-timeout on the gRPC front: a call whose client takes none of its answer for that long
ends DEADLINE_EXCEEDED and frees its session slot; a client that keeps reading, however slowly,
keeps its call. The flag's former name, --http-send-timeout, still sets it.

Without the timeout a raw client that opened a large Decode and never read it held the only slot
of a `--max-sessions 1` server for ~6 minutes (until --max-connection-age 300 s + 60 s grace
closed its connection), every other client refused RESOURCE_EXHAUSTED meanwhile. Every wait here
is a bound on a hang (WAIT_S), never a speed threshold.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from harness import make_config, serve_in_thread

from vaed.cli import build_parser, config_from_args
from vaed.config import ServerConfig
from vaed_client import wire

pb = wire.pb
Z = 4  # z_dim of random:wan2.1-tiny
WAIT_S = 120.0  # the bound on every wait: a third of the 300 s + 60 s the stalled call held its slot
SEND_TIMEOUT_S = 2.0
STALL_MESSAGE = "took none of its answer"


def _wait_for(predicate: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout:g} s: {what}"
        time.sleep(0.05)


def _stream(channel: grpc.Channel, method: str) -> Any:
    return channel.stream_stream(f"/{wire.SERVICE_NAME}/{method}", request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=pb.FrameChunk.FromString)


def _request(method: str, latents: torch.Tensor, options: Any = None) -> Any:
    kind = pb.DecodeRequest if method == "Decode" else pb.LatentChunk
    message = kind(latents=wire.to_message(latents))
    if options is not None:
        message.options.CopyFrom(options)
    return message


def _drain(call: Any) -> tuple[int, grpc.StatusCode, str]:
    """Read a call to its end, on a thread bounded by WAIT_S: (messages, status, details)."""
    out: dict[str, Any] = {"messages": 0}

    def read() -> None:
        try:
            for _ in call:
                out["messages"] += 1
            out["status"] = (grpc.StatusCode.OK, "")
        except grpc.RpcError as exc:
            out["status"] = (exc.code(), exc.details())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(WAIT_S)
    if reader.is_alive():
        call.cancel()
        pytest.fail(f"the call did not end within {WAIT_S:g} s of reading it")
    return out["messages"], *out["status"]


@pytest.mark.parametrize("method", ["Decode", "DecodeStream"])
def test_a_client_that_reads_nothing_loses_its_slot_after_the_send_timeout(
        method: str, caplog: pytest.LogCaptureFixture) -> None:
    """In process: a raw client (gRPC's default channel options, as any
    client) opens a large decode of the only slot and reads none of it; the server's writes
    stall once the client's receive window is full. After --send-timeout the call ends, and a
    second client's decode, refused RESOURCE_EXHAUSTED until then, succeeds. The first client,
    reading at last, gets what was sent and then DEADLINE_EXCEEDED naming the flag."""
    caplog.set_level(logging.WARNING, logger="vaed.service")
    # RAW float32 frames of 128 x 128: 192 KiB a frame, so the client's receive window fills after a
    # few groups' decode (a second or two on the CPU) and the writes stall
    latents = torch.from_numpy(np.random.default_rng(0).standard_normal((1, Z, 200, 16, 16), dtype=np.float32))
    options = pb.DecodeOptions(format=pb.RAW, raw_dtype=pb.FLOAT32)
    config = make_config(max_sessions=1, send_timeout=SEND_TIMEOUT_S)
    with serve_in_thread(config) as running, \
            grpc.insecure_channel(running.target, options=[("grpc.max_receive_message_length", -1)]) as hog, \
            grpc.insecure_channel(running.target) as other:
        pool = running.server.pool
        stalled = _stream(hog, method)(iter([_request(method, latents, options)]))  # read only at the end
        try:
            _wait_for(lambda: pool.admitted == 1, "the non-reader holds the only slot")
            small = torch.randn(1, Z, 2, 8, 8)
            started = time.monotonic()
            refused = 0
            while True:
                try:
                    replies = list(_stream(other, "Decode")(iter([_request("Decode", small)]), timeout=WAIT_S))
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.code(), exc.details())
                    refused += 1
                    assert time.monotonic() - started < WAIT_S, (
                        f"the second client was refused for {WAIT_S:g} s: the non-reader still holds the slot")
                    time.sleep(0.2)
            took = time.monotonic() - started
            assert replies[-1].final and replies[-1].first_frame == 5
            messages, code, details = _drain(stalled)
        finally:
            stalled.cancel()
    print(f"\n{method}: second client refused {refused} times, decoded {took:.1f} s after the non-reader "
          f"was admitted; the non-reader then read {messages} messages and {code.name}")
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "--send-timeout" in details, (code, details)
    stalls = [r.getMessage() for r in caplog.records if STALL_MESSAGE in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].startswith(f"{method} id=") and f"{SEND_TIMEOUT_S:g} s" in stalls[0]
    lines = [r.getMessage() for r in caplog.records if "status=DEADLINE_EXCEEDED" in r.getMessage()]
    assert len(lines) == 1 and "shape=[1, 4, 200, 16, 16]" in lines[0], lines
    print(lines[0])


def test_a_slow_reader_that_keeps_reading_is_not_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A client reads one message every half --send-timeout for three timeouts, then the rest: its
    call ends OK. Its channel turns bandwidth probing off, so its gRPC library holds at most
    64 KiB ahead of it and every message (110 KiB and more) leaves the server only once asked
    for: each write waits half a timeout on the reader. (With probing on, gRPC's default, the
    library lets its application read MiBs it already holds before the server sees any of it
    taken: README's --send-timeout row says so.) The decode runs ahead of the reader, so the
    server's writes do wait on it."""
    caplog.set_level(logging.WARNING, logger="vaed.service")
    timeout = 4.0
    # 40 groups of RAW float32 96 x 96 frames, one message each: 110 KiB the first (one frame),
    # 432 KiB the others (four)
    latents = torch.randn(1, Z, 40, 12, 12)
    options = pb.DecodeOptions(format=pb.RAW, raw_dtype=pb.FLOAT32)
    config = make_config(max_sessions=1, send_timeout=timeout)
    channel_options = [("grpc.max_receive_message_length", -1), ("grpc.http2.bdp_probe", 0)]
    with serve_in_thread(config) as running, grpc.insecure_channel(running.target, options=channel_options) as channel:
        pool = running.server.pool
        call = _stream(channel, "Decode")(iter([_request("Decode", latents, options)]), timeout=5 * WAIT_S)
        replies = iter(call)
        read = 0
        ahead = 0  # the most latent frames the server had decoded past what the client had read
        slow_until = time.monotonic() + 3 * timeout
        while time.monotonic() < slow_until:
            time.sleep(timeout / 2)
            decoded = latents.shape[2] - pool.device_loads()[0].pending_latent_frames
            ahead = max(ahead, decoded - read)
            assert not next(replies).final
            read += 1
        rest = list(replies)
    assert rest[-1].final and rest[-1].first_frame == 1 + 4 * 39, rest[-1]
    assert read + len(rest) == 41, (read, len(rest))  # 40 groups and the end
    assert ahead >= 1, "the decode never ran ahead of the reader: no write of the call waited on it"
    assert not [r for r in caplog.records if STALL_MESSAGE in r.getMessage()]
    print(f"\nslow reader: {read} messages over {3 * timeout:g} s, one per {timeout / 2:g} s; "
          f"the decode ran up to {ahead} latent frames ahead; call OK")


# -- the flags ----------------------------------------------------------------------------------


def _parsed(*flags: str) -> ServerConfig:
    return config_from_args(build_parser("serve").parse_args(["serve", "--device", "cpu", *flags]))


def test_send_timeout_flag_and_its_former_name() -> None:
    """--send-timeout bounds both fronts; --http-send-timeout, its name from when it bounded HTTP
    answers only, is the same flag (the last one given wins), so deployments passing it still start."""
    assert _parsed().send_timeout == ServerConfig.send_timeout == 30.0
    assert _parsed("--send-timeout", "2.5").send_timeout == 2.5
    assert _parsed("--http-send-timeout", "7").send_timeout == 7.0
    assert _parsed("--send-timeout", "2.5", "--http-send-timeout", "7").send_timeout == 7.0
    assert _parsed("--http-send-timeout", "7", "--send-timeout", "2.5").send_timeout == 2.5
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            _parsed("--send-timeout", bad)


def test_a_write_that_fails_as_its_call_is_cancelled_is_read_not_logged() -> None:
    """The race a client's cancel makes (about 1 in 80 cancels 8-22 ms into a call): the write
    fails (the stream is gone) and the handler is cancelled before it reads that failure. The
    failure is read all the same, so asyncio logs no "Task exception was never retrieved" with
    a traceback at ERROR. A stand-in context, to make the race happen every time."""
    import gc

    from vaed.grpc_send import TimedWriter

    class Context:
        async def write(self, message: object) -> None:
            raise RuntimeError("Failed \"execute_batch\": the stream is gone")

    unretrieved: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        writer = TimedWriter(Context(), timeout=30.0)
        handler = asyncio.ensure_future(writer.write(b"frames"))
        await asyncio.sleep(0)  # the handler starts the write and waits on it
        await asyncio.sleep(0)  # the write fails; the handler's wake-up is queued
        handler.cancel()        # ... and the client's cancel comes first
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0)
        gc.collect()  # an unread failure is reported when its future is collected

    asyncio.run(main())
    assert unretrieved == []
