"""Tests of vaed.auth and vaed.health_check against a tiny in-process grpc.aio server.

The server serves the standard health service plus a generic echo service
with all three call shapes the decoder uses (unary-unary, unary-stream,
stream-stream), so the interceptor is exercised without the real model.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from harness import write_self_signed
from vaed import health_check
from vaed.auth import AUTH_TOKEN_ENV, BearerTokenInterceptor, read_token, server_credentials

TOKEN = "s3cret-token-0123456789abcdef"  # header values must be printable ASCII
SERVICE = "test.Echo"


# ---------------------------------------------------------------- test server


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


def _echo_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
            "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
        },
    )


async def _start_server(
    token: str | None, creds: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    interceptors = [BearerTokenInterceptor(token)] if token else []
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((_echo_handler(),))
    hs = health.aio.HealthServicer()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if creds is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


async def _call_all(
    channel: grpc.aio.Channel, metadata: tuple | None, expect_ok: bool = True
) -> dict[str, object]:
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
        call = channel.stream_stream(f"/{SERVICE}/StreamStream")(metadata=metadata, timeout=5)
        if not expect_ok:
            # Read before writing: grpc.aio's client can report INTERNAL
            # ("Internal error from Core") instead of the server's status when
            # a request write races the server's early abort (about 1 call in
            # 10 here). The server side is deterministic; this keeps the test so.
            await call.read()
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
def test_rejected_on_every_call_shape(metadata: tuple | None, fragment: str) -> None:
    async def main() -> dict[str, object]:
        server, port = await _start_server(TOKEN)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await _call_all(ch, metadata, expect_ok=False)
        finally:
            await server.stop(None)

    out = _run(main())
    for name in OK_RESULTS:
        assert out[name] == grpc.StatusCode.UNAUTHENTICATED, (name, out)
        assert fragment in str(out[name + ".details"])
    # Health stays open without a token.
    assert out["health"].status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[union-attr]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_right_token_passes(scheme: str) -> None:
    async def main() -> dict[str, object]:
        server, port = await _start_server(TOKEN)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await _call_all(ch, (("authorization", f"{scheme} {TOKEN}"),))
        finally:
            await server.stop(None)

    out = _run(main())
    for name, want in OK_RESULTS.items():
        assert out[name] == want, (name, out)
    assert out["health"].status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[union-attr]


def test_unknown_method_without_token_is_unauthenticated() -> None:
    async def main() -> grpc.StatusCode:
        server, port = await _start_server(TOKEN)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    await ch.unary_unary("/nope.Service/Nope")(b"", timeout=5)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                raise AssertionError("call succeeded")
        finally:
            await server.stop(None)

    assert _run(main()) == grpc.StatusCode.UNAUTHENTICATED


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
    with pytest.raises(ValueError):
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
    health_check.add_arguments(parser)
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
        assert health_check.run(_health_args(server=f"127.0.0.1:{port}")) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        assert health_check.run(_health_args(server=f"127.0.0.1:{port}", service="nope")) == 1
        assert capsys.readouterr().out.strip() == "SERVICE_UNKNOWN"
    finally:
        stop(server)
    assert health_check.run(_health_args(server=f"127.0.0.1:{port}", timeout=1.0)) == 1
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
        assert health_check.run(_health_args(server=f"127.0.0.1:{port}")) == 1
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
        assert health_check.run(args) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        # Without the CA (system roots) the self-signed cert is refused.
        assert health_check.run(_health_args(server=f"localhost:{port}", tls=True, timeout=2.0)) == 1
        assert capsys.readouterr().out.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
    finally:
        stop(server)


def test_health_main_parses_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens on port 1: a quick non-zero exit, not a hang.
    assert health_check.main(["--server", "127.0.0.1:1", "--timeout", "1"]) == 1
    assert capsys.readouterr().out.strip()


def test_check_handles_odd_values() -> None:
    from vaed.auth import _check

    assert _check((("authorization", "Bearer \u00e9t\u00e9"),), b"abc") == "invalid bearer token"
    assert _check((("authorization", b"Bearer abc"),), b"abc") is None
    assert _check((("x-other", "Bearer abc"),), b"abc").startswith("missing")  # type: ignore[union-attr]
    assert _check(None, b"abc").startswith("missing")  # type: ignore[union-attr]
