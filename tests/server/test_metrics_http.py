"""The metrics HTTP endpoint: GET /metrics only, bounded threads and sockets under idle connections.

Each endpoint runs as the server runs it: ``vaed.http.HttpServer`` with the
metrics route, in an asyncio loop (here on a thread of the test, as the
server's own loop would be).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from vaed.http import HttpLimits, HttpServer
from vaed.http.server import MAX_ERROR_CHARS
from vaed.metrics import PENDING_LATENT_FRAMES_METRIC, DeviceLoad, ServerMetrics, add_metrics_route

HTTP_MAX_CONNECTIONS = HttpLimits().max_connections
T = TypeVar("T")


class StaticLoad:
    def __init__(self, *loads: DeviceLoad) -> None:
        self.loads = list(loads)

    def device_loads(self) -> list[DeviceLoad]:
        return self.loads


def process_threads() -> int:
    """Threads of this whole process (native gRPC/torch threads included), from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line in /proc/self/status")


def get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def refused_exchange(port: int, data: bytes) -> bytes:
    """Send `data` and read the answer of a server that may refuse and close before
    reading it all: its close with unread bytes resets the connection, which can
    overtake the answer (then b"" comes back)."""
    chunks: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass
    return b"".join(chunks)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closed `sock` (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, TimeoutError):
        return False


class Endpoint:
    """A metrics endpoint as the server runs it, its loop on a daemon thread of the test."""

    def __init__(self, metrics: ServerMetrics, limits: HttpLimits | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.http = self.run(self._make(metrics, limits))

    @staticmethod
    async def _make(metrics: ServerMetrics, limits: HttpLimits | None) -> HttpServer:
        http = HttpServer(limits, name="metrics")
        add_metrics_route(http.app, metrics)
        return http

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return self.run(self.http.start(host, port))

    def stop(self) -> None:
        self.run(self.http.stop())

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture()
def endpoints() -> Iterator[list[Endpoint]]:
    """Endpoints a test makes; all closed at its end."""
    made: list[Endpoint] = []
    yield made
    for e in made:
        e.close()


def endpoint(endpoints: list[Endpoint], metrics: ServerMetrics | None = None, **limits: Any) -> Endpoint:
    e = Endpoint(metrics or ServerMetrics(), HttpLimits(**limits) if limits else None)
    endpoints.append(e)
    return e


@pytest.fixture()
def served(endpoints: list[Endpoint]) -> Iterator[tuple[ServerMetrics, int]]:
    m = ServerMetrics(StaticLoad(DeviceLoad("cpu", True, 1, 7)))
    yield m, endpoint(endpoints, m).start()


def test_scrape_returns_the_registry(served: tuple[ServerMetrics, int]) -> None:
    m, port = served
    m.request_finished("GetModelInfo", "OK", 0.001)
    status, ctype, body = get(port)
    assert status == 200
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body) for s in f.samples
    }
    assert samples[("vaed_requests_total", (("code", "OK"), ("method", "GetModelInfo")))] == 1
    assert samples[(PENDING_LATENT_FRAMES_METRIC, (("device", "cpu"),))] == 7
    assert samples[("vaed_active_sessions", (("device", "cpu"),))] == 1
    # Nothing from the process-global default registry leaks in.
    assert not any(name.startswith(("python_gc", "process_")) for name, _ in samples)
    # Prometheus may add query parameters; the path is what counts.
    assert get(port, "/metrics?name[]=vaed_active_sessions")[0] == 200


@pytest.mark.parametrize("path", ["/", "/metrics/", "/metricsx", "/favicon.ico", "/../metrics"])
def test_other_paths_are_404(served: tuple[ServerMetrics, int], path: str) -> None:
    status, _, body = get(served[1], path)
    assert status == 404
    assert "vaed_" not in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
def test_other_methods_are_405(served: tuple[ServerMetrics, int], method: str) -> None:
    reply = raw_exchange(served[1], f"{method} /metrics HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 405 ")
    assert b"\r\nConnection: close\r\n" in reply  # one request per connection
    assert b"\r\nAllow: GET\r\n" in reply
    assert b"vaed_" not in reply


def status_of(reply: bytes) -> int:
    """The status code of a raw HTTP/1.x answer (aiohttp answers an unparsable head as HTTP/1.0)."""
    version, code, _ = reply.split(b" ", 2)
    assert version in (b"HTTP/1.0", b"HTTP/1.1"), reply[:80]
    return int(code)


def test_malformed_and_oversized_heads(served: tuple[ServerMetrics, int], caplog: pytest.LogCaptureFixture) -> None:
    port = served[1]
    assert status_of(raw_exchange(port, b"GARBAGE\r\n\r\n")) == 400
    assert status_of(raw_exchange(port, b"GET /metrics SPDY/3\r\n\r\n")) == 400
    # Past aiohttp's max_field_size (one header), max_line_size (the request line) and
    # max_headers, the head is refused with 400 (the hand-written server answered 431).
    limits = HttpLimits()
    big = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
    reply = raw_exchange(port, big)
    assert status_of(reply) == 400 and f"Got more than {limits.max_field_size} bytes".encode() in reply
    mib = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n"
    reply = refused_exchange(port, mib)
    assert reply == b"" or status_of(reply) == 400, reply[:80]
    long_line = b"GET /" + b"a" * (limits.max_line_size + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert status_of(raw_exchange(port, long_line)) == 400
    many = b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(limits.max_headers + 1))
    assert status_of(raw_exchange(port, many + b"\r\n")) == 400
    # A head aiohttp cannot parse is quoted in its error, at most MAX_ERROR_CHARS of it (a body
    # sent without its Content-Length is parsed as the next head: 7 KB of it came back).
    reply = refused_exchange(port, b"Z" * 8000 + b" /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert status_of(reply) == 400 and len(error) <= MAX_ERROR_CHARS + 40 and "more characters" in error, error
    # A client's garbage is not logged as a server error (aiohttp would log each with a traceback).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    # The endpoint still answers afterwards.
    assert get(port)[0] == 200


def test_idle_connections_hold_no_threads_and_scrapes_still_work(served: tuple[ServerMetrics, int]) -> None:
    port = served[1]
    get(port)  # warm: everything the endpoint will ever start is started
    baseline = process_threads()
    idle: list[socket.socket] = []
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metr")  # half a request line, never finished
            idle.append(s)
        time.sleep(0.3)  # let the server accept them all
        held = process_threads()
        # A thread per connection would be +100 here (the old endpoint: 14 -> 414 threads for 400).
        assert held <= baseline + 10, (baseline, held)
        status, _, body = get(port)
        assert status == 200 and PENDING_LATENT_FRAMES_METRIC in body
        # At most HTTP_MAX_CONNECTIONS stay open: the oldest idle ones were evicted.
        evicted = sum(closed_by_server(s, 0.2) for s in idle[: 100 - HTTP_MAX_CONNECTIONS])
        assert evicted == 100 - HTTP_MAX_CONNECTIONS
        assert not closed_by_server(idle[-1], 0.2)  # the newest idle one is still waiting
    finally:
        for s in idle:
            s.close()


def test_idle_and_slow_connections_time_out(endpoints: list[Endpoint]) -> None:
    port = endpoint(endpoints, head_timeout=0.5).start()
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    started = time.monotonic()
    idle_closed = closed_by_server(idle, 5.0)
    # A slowloris client that keeps dribbling bytes is cut off by the same deadline.
    slow_closed = False
    while time.monotonic() - started < 5.0:
        try:
            slow.sendall(b"G")
        except (BrokenPipeError, ConnectionResetError):
            slow_closed = True
            break
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    assert idle_closed and slow_closed, (idle_closed, slow_closed, elapsed)
    idle.close()
    slow.close()
    assert get(port)[0] == 200


def test_start_twice_stop_idempotent_and_port_released(endpoints: list[Endpoint]) -> None:
    e = endpoint(endpoints)
    port = e.start()
    with pytest.raises(RuntimeError, match="already running"):
        e.start()
    e.stop()
    e.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_empty_host_is_refused(endpoints: list[Endpoint]) -> None:
    e = endpoint(endpoints)
    with pytest.raises(ValueError, match="metrics host"):
        e.start(host="")
    e.stop()


def test_port_in_use_raises_oserror(endpoints: list[Endpoint]) -> None:
    a, b = endpoint(endpoints), endpoint(endpoints)
    port = a.start()
    with pytest.raises(OSError):
        b.start(port=port)
    b.stop()  # nothing started: still safe
    assert get(port)[0] == 200
    with pytest.raises(OSError):  # a failed start left nothing half-started
        b.start(port=port)


def test_two_endpoints_in_one_process_serve_their_own_registry(endpoints: list[Endpoint]) -> None:
    a = ServerMetrics(StaticLoad(DeviceLoad("cpu", True, 0, 1)))
    b = ServerMetrics(StaticLoad(DeviceLoad("cpu", True, 0, 2)))
    pa = endpoint(endpoints, a).start()
    pb = endpoint(endpoints, b).start()
    assert pa != pb
    for port, want in ((pa, "1.0"), (pb, "2.0")):
        assert f'{PENDING_LATENT_FRAMES_METRIC}{{device="cpu"}} {want}' in get(port)[2]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_host(endpoints: list[Endpoint], host: str) -> None:
    e = endpoint(endpoints)
    port = e.start(host=host)
    with socket.create_connection(("::1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200 ")
    # Bound to ::1 only, so not reachable on IPv4 loopback. Read from the listening sockets:
    # connecting to 127.0.0.1:port instead fails when another process (a parallel test run)
    # happens to listen on that port number over IPv4.
    sockets = e.http.sockets
    assert [(s.family, s.getsockname()[:2]) for s in sockets] == [(socket.AF_INET6, ("::1", port))]


def test_past_the_cap_a_busy_connection_is_kept_and_the_new_one_closed(endpoints: list[Endpoint]) -> None:
    """The cap closes the oldest *idle* connection; with every slot answering, the newcomer goes."""
    e = endpoint(endpoints, max_connections=2)
    release = asyncio.Event()
    entered: list[int] = []

    async def slow(request: web.Request) -> web.Response:  # a route the HTTP front might add
        entered.append(1)
        await release.wait()
        return web.Response(text="done")

    e.http.app.router.add_get("/slow", slow)
    port = e.start()
    busy = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    for s in busy:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.monotonic() + 10
    while len(entered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(entered) == 2
    with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
        assert closed_by_server(extra, 5.0)
    e.loop.call_soon_threadsafe(release.set)
    for s in busy:
        with s:
            s.settimeout(10)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"done")
