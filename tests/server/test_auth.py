"""Tests of vaed.auth and the `health` command against a tiny in-process grpc.aio server.

The server serves the standard health service plus a generic echo service
with all three call shapes the decoder uses (unary-unary, unary-stream,
stream-stream), so the interceptor is exercised without the real model. The
echo service's request deserializer and a second interceptor are spies: a
refused call must reach neither (no payload parsed, no RPC slot taken).
Memory under hostile unauthenticated calls is measured against a real
`vaed serve` in test_auth_hostile.py.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from harness import write_self_signed
from vaed_client import cli as client_cli
from vaed.auth import BearerTokenInterceptor, server_credentials
from vaed.interceptors import REFUSAL_LINGER_SECONDS, Refusals
from vaed_client.channel import read_token
from vaed_client.wire import AUTH_TOKEN_ENV

TOKEN = "s3cret-token-0123456789abcdef"  # header values must be printable ASCII
SERVICE = "test.Echo"
MALFORMED = b"\xff malformed"  # the spy deserializer rejects payloads starting with 0xff


# ---------------------------------------------------------------- test server


class Spies:
    """What reached the layers behind the auth interceptor."""

    def __init__(self) -> None:
        self.parsed: list[bytes] = []        # payloads given to the request deserializer
        self.intercepted: list[str] = []     # methods seen by the next interceptor
        self.refused: list[tuple[str, str]] = []  # on_refused(method, code) calls

    def deserialize(self, payload: bytes) -> bytes:
        self.parsed.append(payload)
        if payload.startswith(b"\xff"):
            raise ValueError("malformed payload")
        return payload


class _Recorder(grpc.aio.ServerInterceptor):
    def __init__(self, spies: Spies) -> None:
        self._spies = spies

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        self._spies.intercepted.append(details.method)
        return await continuation(details)


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"echo:" + request


async def _unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(3):
        yield request + str(i).encode()


async def _stream_stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r.upper()


def _echo_handler(spies: Spies) -> grpc.GenericRpcHandler:
    de = spies.deserialize
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary, request_deserializer=de),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream, request_deserializer=de),
            "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream, request_deserializer=de),
        },
    )


async def _start_server(
    token: str | None,
    creds: grpc.ServerCredentials | None = None,
    spies: Spies | None = None,
    **interceptor_kw: object,
) -> tuple[grpc.aio.Server, int]:
    spies = spies or Spies()
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if token:
        interceptors.append(
            BearerTokenInterceptor(token, on_refused=lambda m, c: spies.refused.append((m, c)), **interceptor_kw)
        )
    interceptors.append(_Recorder(spies))
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((_echo_handler(spies),))
    hs = health.aio.HealthServicer()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if creds is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


async def _call_all(channel: grpc.aio.Channel, metadata: tuple | None) -> dict[str, object]:
    """Result (or StatusCode) of each call shape."""
    out: dict[str, object] = {}

    async def guard(name: str, coro) -> None:  # type: ignore[no-untyped-def]
        try:
            out[name] = await coro
        except grpc.aio.AioRpcError as exc:
            out[name] = exc.code()
            out[name + ".details"] = exc.details()

    unary = channel.unary_unary(f"/{SERVICE}/Unary")
    await guard("unary", unary(b"hi", metadata=metadata, timeout=5))

    async def collect_us() -> list[bytes]:
        call = channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"x", metadata=metadata, timeout=5)
        return [m async for m in call]

    await guard("unary_stream", collect_us())

    async def collect_ss() -> list[bytes]:
        # Writes before it reads, as a streaming client does: a refusal must
        # still come back as UNAUTHENTICATED, not grpc.aio's INTERNAL.
        call = channel.stream_stream(f"/{SERVICE}/StreamStream")(metadata=metadata, timeout=5)
        got = []
        for m in (b"a", b"b"):
            await call.write(m)
            got.append(await call.read())
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        return got

    await guard("stream_stream", collect_ss())

    stub = health_pb2_grpc.HealthStub(channel)
    await guard("health", stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=5))
    return out


OK_RESULTS = {
    "unary": b"echo:hi",
    "unary_stream": [b"x0", b"x1", b"x2"],
    "stream_stream": [b"A", b"B"],
}


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


# ---------------------------------------------------------------- interceptor


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        (None, "missing credentials"),
        ((("authorization", "Bearer wrong"),), "invalid bearer token"),
        ((("authorization", "Basic " + TOKEN),), "malformed"),
        ((("authorization", "Bearer"),), "malformed"),
    ],
    ids=["missing", "wrong", "wrong-scheme", "empty"],
)
def test_rejected_on_every_call_shape_unread(metadata: tuple | None, fragment: str) -> None:
    spies = Spies()

    async def main() -> dict[str, object]:
        server, port = await _start_server(TOKEN, spies=spies)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await _call_all(ch, metadata)
        finally:
            await server.stop(None)

    out = _run(main())
    for name in OK_RESULTS:
        assert out[name] == grpc.StatusCode.UNAUTHENTICATED, (name, out)
        assert fragment in str(out[name + ".details"])
    # Health stays open without a token.
    assert out["health"].status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[union-attr]
    # No payload was parsed, no later interceptor saw a refused call (only health passed),
    # and every refusal was reported once, by method and code.
    assert spies.parsed == []
    assert spies.intercepted == ["/grpc.health.v1.Health/Check"]
    assert spies.refused == [
        ("Unary", "UNAUTHENTICATED"), ("UnaryStream", "UNAUTHENTICATED"), ("StreamStream", "UNAUTHENTICATED"),
    ]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_right_token_passes(scheme: str) -> None:
    spies = Spies()

    async def main() -> dict[str, object]:
        server, port = await _start_server(TOKEN, spies=spies)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await _call_all(ch, (("authorization", f"{scheme} {TOKEN}"),))
        finally:
            await server.stop(None)

    out = _run(main())
    for name, want in OK_RESULTS.items():
        assert out[name] == want, (name, out)
    assert out["health"].status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[union-attr]
    assert spies.refused == []
    assert spies.parsed == [b"hi", b"x", b"a", b"b"]


def test_unknown_methods_and_malformed_payloads_answer_like_real_methods() -> None:
    """Without a token nothing tells an existing method from a made-up one or a bad payload."""

    async def outcome(ch: grpc.aio.Channel, method: str, payload: bytes, streaming: bool) -> tuple[object, str]:
        try:
            if streaming:
                call = ch.stream_stream(method)(timeout=5)
                await call.write(payload)
                await call.done_writing()
                async for _ in call:
                    pass
            else:
                await ch.unary_unary(method)(payload, timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    cases = [
        (f"/{SERVICE}/Unary", b"fine", False),
        (f"/{SERVICE}/Unary", MALFORMED, False),
        (f"/{SERVICE}/StreamStream", MALFORMED, True),
        ("/nope.Service/Nope", b"", False),
        ("/nope.Service/Nope", b"x" * 1000, True),
        (f"/{SERVICE}/Missing", MALFORMED, False),
    ]
    spies = Spies()

    async def main() -> list[tuple[object, str]]:
        server, port = await _start_server(TOKEN, spies=spies)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return [await outcome(ch, m, p, s) for m, p, s in cases]
        finally:
            await server.stop(None)

    answers = _run(main())
    assert set(answers) == {(grpc.StatusCode.UNAUTHENTICATED, answers[0][1])}, answers
    assert "missing credentials" in answers[0][1]
    assert spies.parsed == []
    assert [m for m, _ in spies.refused] == ["Unary", "Unary", "StreamStream", "Nope", "Nope", "Missing"]


def test_grpc_aio_clients_still_writing_get_unauthenticated() -> None:
    """A streaming grpc.aio client that writes several chunks before reading.

    With Refusals(linger=0) (abort at once) this fails: 22-35 of 40 such calls got
    INTERNAL on loopback (the client's failed write overwrites the status).
    The refusal's linger lets in-flight writes land first.
    """

    async def one(ch: grpc.aio.Channel) -> grpc.StatusCode:
        call = ch.stream_stream(f"/{SERVICE}/StreamStream")(timeout=10)
        try:
            for _ in range(4):
                await call.write(b"\0" * 400_000)
            await call.done_writing()
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        except asyncio.InvalidStateError:  # a write after the status arrived
            return await call.code()
        return grpc.StatusCode.OK

    spies = Spies()

    async def main() -> list[grpc.StatusCode]:
        # 2x the default linger: margin for a loaded CI machine (the
        # mechanism is under test here, not the default's value).
        server, port = await _start_server(
            TOKEN, spies=spies, refusals=Refusals(linger=2 * REFUSAL_LINGER_SECONDS)
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return [await one(ch) for _ in range(12)]
        finally:
            await server.stop(None)

    codes = _run(main())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 12, codes
    assert spies.parsed == [] and len(spies.refused) == 12


def test_on_refused_that_raises_still_refuses(caplog: pytest.LogCaptureFixture) -> None:
    def broken(method: str, code: str) -> None:
        raise RuntimeError("metrics down")

    async def main() -> grpc.StatusCode:
        interceptor = BearerTokenInterceptor(TOKEN, on_refused=broken)
        server = grpc.aio.server(interceptors=[interceptor])
        server.add_generic_rpc_handlers((_echo_handler(Spies()),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await ch.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await server.stop(None)
        raise AssertionError("call succeeded")

    assert _run(main()) == grpc.StatusCode.UNAUTHENTICATED
    assert "on_refused callback failed" in caplog.text


def test_refusal_handler_shape() -> None:
    h = Refusals().handler(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    # Stream-request with no deserializer: grpc.aio reads nothing before the handler runs.
    assert h.request_streaming and h.response_streaming
    assert h.request_deserializer is None and h.response_serializer is None


class _AbortRecorder:
    """The part of a ServicerContext a refusal uses."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted.append((code, details))
        raise grpc.RpcError()  # what grpc.aio's abort does: end the handler


def test_at_most_max_lingering_refusals_linger_the_rest_answer_at_once() -> None:
    refusals = Refusals(linger=30.0, max_lingering=2)
    behaviour = refusals.handler(grpc.StatusCode.UNAUTHENTICATED, "no").stream_stream

    async def never_read() -> AsyncIterator[bytes]:
        raise AssertionError("a refusal must never read its request")
        yield b""  # pragma: no cover

    async def main() -> tuple[int, int, list[bool]]:
        contexts = [_AbortRecorder() for _ in range(5)]
        tasks = [asyncio.ensure_future(behaviour(never_read(), c)) for c in contexts]
        for _ in range(3):
            await asyncio.sleep(0)  # every task runs until it lingers or aborts
        answered = [bool(c.aborted) for c in contexts]
        lingering = refusals.lingering
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return lingering, refusals.lingering, answered

    lingering, after_cancel, answered = _run(main())
    # The first two linger (a 30 s linger: certainly still waiting); the other three answered at once.
    assert answered == [False, False, True, True, True]
    assert lingering == 2
    assert after_cancel == 0  # a cancelled linger gives its place back


def test_refusals_validate_arguments() -> None:
    with pytest.raises(ValueError, match="linger"):
        Refusals(linger=-1.0)
    with pytest.raises(ValueError, match="max_lingering"):
        Refusals(max_lingering=-1)


def test_no_interceptor_means_open() -> None:
    async def main() -> dict[str, object]:
        server, port = await _start_server(None)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await _call_all(ch, None)
        finally:
            await server.stop(None)

    out = _run(main())
    for name, want in OK_RESULTS.items():
        assert out[name] == want


def test_empty_token_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        BearerTokenInterceptor("  \n")


# ---------------------------------------------------------------- read_token


def test_read_token_file_strips(tmp_path: Path) -> None:
    p = tmp_path / "token"
    p.write_text("  abc123\n")
    assert read_token(str(p)) == "abc123"


def test_read_token_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "token"
    p.write_text("\n \n")
    with pytest.raises(ValueError, match="empty"):
        read_token(str(p))


def test_read_token_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        read_token(str(tmp_path / "absent"))


def test_read_token_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    assert read_token(None, AUTH_TOKEN_ENV) is None
    assert read_token(None) is None
    monkeypatch.setenv(AUTH_TOKEN_ENV, " from-env\n")
    assert read_token(None, AUTH_TOKEN_ENV) == "from-env"
    # A file wins over the environment.
    p = tmp_path / "token"
    p.write_text("from-file")
    assert read_token(str(p), AUTH_TOKEN_ENV) == "from-file"
    monkeypatch.setenv(AUTH_TOKEN_ENV, "  ")
    with pytest.raises(ValueError, match=AUTH_TOKEN_ENV):
        read_token(None, AUTH_TOKEN_ENV)


# ---------------------------------------------------------------- TLS


@pytest.fixture()
def tls_files(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    yield write_self_signed(tmp_path)


def test_tls_round_trip_with_token(tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files

    async def main() -> tuple[dict[str, object], grpc.StatusCode]:
        server, port = await _start_server(TOKEN, server_credentials(str(cert), str(key)))
        try:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
                out = await _call_all(ch, (("authorization", f"Bearer {TOKEN}"),))
            # A plaintext client cannot talk to the TLS port.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    await ch.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=3)
                    plain = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    plain = exc.code()
            return out, plain
        finally:
            await server.stop(None)

    out, plain = _run(main())
    for name, want in OK_RESULTS.items():
        assert out[name] == want
    assert plain == grpc.StatusCode.UNAVAILABLE


def test_server_credentials_errors(tmp_path: Path, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    with pytest.raises(ValueError, match="cannot read TLS certificate"):
        server_credentials(str(tmp_path / "absent.crt"), str(key))
    empty = tmp_path / "empty.key"
    empty.write_text("")
    with pytest.raises(ValueError, match="private key"):
        server_credentials(str(cert), str(empty))
    assert server_credentials(str(cert), str(key), client_ca_path=str(cert)) is not None


# ---------------------------------------------------------------- vaed health


def _health_args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client_cli.add_health_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def _in_thread_loop(coro_factory):  # type: ignore[no-untyped-def]
    """Run an aio server on its own loop in a thread while sync code runs here."""
    import threading

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    result = asyncio.run_coroutine_threadsafe(coro_factory(), loop).result(10)

    def stop(server: grpc.aio.Server) -> None:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)

    return result, stop


def test_health_command_serving_and_not(capsys: pytest.CaptureFixture[str]) -> None:
    (server, port), stop = _in_thread_loop(lambda: _start_server(TOKEN))
    try:
        assert client_cli.run_health(_health_args(server=f"127.0.0.1:{port}")) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        assert client_cli.run_health(_health_args(server=f"127.0.0.1:{port}", service="nope")) == 1
        assert capsys.readouterr().out.strip() == "SERVICE_UNKNOWN"
    finally:
        stop(server)
    assert client_cli.run_health(_health_args(server=f"127.0.0.1:{port}", timeout=1.0)) == 1
    assert capsys.readouterr().out.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))


def test_health_command_not_serving(capsys: pytest.CaptureFixture[str]) -> None:
    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        hs = health.aio.HealthServicer()
        await hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    (server, port), stop = _in_thread_loop(start)
    try:
        assert client_cli.run_health(_health_args(server=f"127.0.0.1:{port}")) == 1
        assert capsys.readouterr().out.strip() == "NOT_SERVING"
    finally:
        stop(server)


def test_health_command_tls(tls_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = tls_files
    creds = server_credentials(str(cert), str(key))
    (server, port), stop = _in_thread_loop(lambda: _start_server(TOKEN, creds))
    try:
        args = _health_args(server=f"127.0.0.1:{port}", tls=True, ca_cert=str(cert),
                            tls_server_name="localhost")
        assert client_cli.run_health(args) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        # Without the CA (system roots) the self-signed cert is refused.
        assert client_cli.run_health(_health_args(server=f"localhost:{port}", tls=True, timeout=2.0)) == 1
        assert capsys.readouterr().out.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
    finally:
        stop(server)


def test_health_main_parses_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens on port 1: a quick non-zero exit, not a hang.
    assert client_cli.main(["health", "--server", "127.0.0.1:1", "--timeout", "1"]) == 1
    assert capsys.readouterr().out.strip()


def test_check_handles_odd_values() -> None:
    from vaed.auth import _check

    assert _check((("authorization", "Bearer \u00e9t\u00e9"),), b"abc") == "invalid bearer token"
    assert _check((("authorization", b"Bearer abc"),), b"abc") is None
    assert _check((("x-other", "Bearer abc"),), b"abc").startswith("missing")  # type: ignore[union-attr]
    assert _check(None, b"abc").startswith("missing")  # type: ignore[union-attr]
