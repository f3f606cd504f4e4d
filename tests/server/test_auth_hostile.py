"""Unauthenticated callers against a real server: memory stays flat, every refusal is counted.

The memory tests run `vaed serve` in a subprocess with a token and read its
RSS from /proc while four concurrent unauthenticated calls push 250 MiB each
(the attack: 0.9 -> 3.0 GB of server memory when the refusal still read the request;
measured here 2.7 GB of growth before, 25 MB after). The bound, 200 MB, is
under a fifth of one payload, so reading even one request would fail it.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import PeakRss, make_config, serve_in_thread, start_cli_server

TOKEN = "hostile-test-token-0123456789"
PAYLOAD_MIB = 250
CALLS = 4
RSS_GROWTH_BOUND = 200 * 2**20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**30), ("grpc.max_receive_message_length", 2**30)]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def decode_request_bytes(nbytes: int) -> bytes:
    """A valid serialized DecodeRequest with `nbytes` of float32 latents [1, 4, 1, 1, n]
    (encoded by hand: the server must never get as far as parsing it)."""
    n = nbytes // 4
    tensor = _varint(1 << 3) + _varint(4) + _field(2, b"".join(_varint(d) for d in (1, 4, 1, 1, n)))
    tensor += _field(3, bytes(4 * n))
    return _field(1, tensor)


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    proc, target = start_cli_server("--auth-token-file", str(token_file))
    try:
        yield proc.pid, target
    finally:
        proc.kill()
        proc.wait(30)


def _attack(target: str, call: Callable[[grpc.Channel, bytes], object]) -> list[grpc.StatusCode]:
    payload = decode_request_bytes(PAYLOAD_MIB * 2**20)

    def one(_: int) -> grpc.StatusCode:
        with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
            try:
                call(ch, payload)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(CALLS) as pool:
        return list(pool.map(one, range(CALLS)))


def _decode(ch: grpc.Channel, payload: bytes) -> object:
    return list(ch.unary_stream("/vaed.v1.VaeDecoder/Decode")(payload, timeout=60))


def _decode_stream(ch: grpc.Channel, payload: bytes) -> object:
    # One 250 MiB chunk after another: a streaming client that never reads.
    return list(ch.stream_stream("/vaed.v1.VaeDecoder/DecodeStream")(iter([payload] * 4), timeout=60))


def _model_info_with_token(target: str) -> bytes:
    with grpc.insecure_channel(target) as ch:
        return ch.unary_unary("/vaed.v1.VaeDecoder/GetModelInfo")(
            b"", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30
        )


@pytest.mark.parametrize("call", [_decode, _decode_stream], ids=["Decode", "DecodeStream"])
def test_unauthenticated_250mib_calls_do_not_grow_server_rss(
    guarded_server: tuple[int, str], call: Callable[[grpc.Channel, bytes], object]
) -> None:
    pid, target = guarded_server
    with PeakRss(pid) as rss:
        codes = _attack(target, call)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CALLS
    growth = rss.peak - rss.start
    assert growth < RSS_GROWTH_BOUND, f"RSS {rss.start / 2**20:.0f} -> {rss.peak / 2**20:.0f} MiB"
    # The server is unharmed and still serves authenticated callers.
    assert len(_model_info_with_token(target)) > 0


def test_refused_calls_are_counted_by_code(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with serve_in_thread(make_config(auth_token_file=str(token_file), metrics_port=0)) as running:
        target = running.target
        with grpc.insecure_channel(target) as ch:
            for method, payload in (
                ("/vaed.v1.VaeDecoder/Decode", decode_request_bytes(1024)),
                ("/vaed.v1.VaeDecoder/Decode", b"\xff\xff not a protobuf"),
                ("/vaed.v1.VaeDecoder/GetModelInfo", b""),
                ("/probe.Nope/Nope", b""),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    list(ch.unary_stream(method)(payload, timeout=10))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(ch.stream_stream("/vaed.v1.VaeDecoder/DecodeStream")(iter([b"\x00" * 100]), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        port = running.server.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    counted = {
        (s.labels["method"], s.labels["code"]): s.value
        for f in text_string_to_metric_families(body) for s in f.samples if s.name == "vaed_requests_total"
    }
    assert counted == {
        ("Decode", "UNAUTHENTICATED"): 2,
        ("GetModelInfo", "UNAUTHENTICATED"): 1,
        ("DecodeStream", "UNAUTHENTICATED"): 1,
        ("other", "UNAUTHENTICATED"): 1,
    }
