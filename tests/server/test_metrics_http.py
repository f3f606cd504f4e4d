"""The metrics HTTP endpoint: GET /metrics only, bounded threads and sockets under idle connections."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vaed.metrics import HTTP_MAX_CONNECTIONS, PENDING_LATENT_FRAMES_METRIC, DeviceLoad, ServerMetrics


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


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closed `sock` (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, TimeoutError):
        return False


@pytest.fixture()
def served() -> Iterator[tuple[ServerMetrics, int]]:
    m = ServerMetrics(StaticLoad(DeviceLoad("cpu", True, 1, 7)))
    port = m.start_http_server(0, host="127.0.0.1")
    try:
        yield m, port
    finally:
        m.stop_http_server()


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
    assert b"\r\nAllow: GET\r\n" in reply
    assert b"vaed_" not in reply


def test_malformed_and_oversized_heads(served: tuple[ServerMetrics, int]) -> None:
    port = served[1]
    assert raw_exchange(port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw_exchange(port, b"GET /metrics SPDY/3\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    big = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
    assert raw_exchange(port, big).startswith(b"HTTP/1.1 431 ")
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


def test_idle_and_slow_connections_time_out() -> None:
    m = ServerMetrics()
    port = m.start_http_server(0, host="127.0.0.1", timeout=0.5)
    try:
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
    finally:
        m.stop_http_server()


def test_start_twice_stop_idempotent_and_port_released() -> None:
    m = ServerMetrics()
    port = m.start_http_server(0, host="127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="already running"):
            m.start_http_server(0, host="127.0.0.1")
    finally:
        m.stop_http_server()
    m.stop_http_server()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_empty_host_is_refused() -> None:
    m = ServerMetrics()
    with pytest.raises(ValueError, match="metrics host"):
        m.start_http_server(0, host="")
    m.stop_http_server()


def test_port_in_use_raises_oserror() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    port = a.start_http_server(0, host="127.0.0.1")
    try:
        with pytest.raises(OSError):
            b.start_http_server(port, host="127.0.0.1")
        b.stop_http_server()  # nothing started: still safe
        assert get(port)[0] == 200
    finally:
        a.stop_http_server()


def test_two_endpoints_in_one_process_serve_their_own_registry() -> None:
    a = ServerMetrics(StaticLoad(DeviceLoad("cpu", True, 0, 1)))
    b = ServerMetrics(StaticLoad(DeviceLoad("cpu", True, 0, 2)))
    pa = a.start_http_server(0, host="127.0.0.1")
    pb = b.start_http_server(0, host="127.0.0.1")
    try:
        assert pa != pb
        for port, want in ((pa, "1.0"), (pb, "2.0")):
            assert f'{PENDING_LATENT_FRAMES_METRIC}{{device="cpu"}} {want}' in get(port)[2]
    finally:
        a.stop_http_server()
        b.stop_http_server()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_host(host: str) -> None:
    m = ServerMetrics()
    port = m.start_http_server(0, host=host)
    try:
        with socket.create_connection(("::1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 200 ")
        # Bound to ::1 only, so not reachable on IPv4 loopback. Read from the listening sockets:
        # connecting to 127.0.0.1:port instead fails when another process (a parallel test run)
        # happens to listen on that port number over IPv4.
        sockets = m._http._server.sockets  # type: ignore[union-attr]
        assert [(s.family, s.getsockname()[:2]) for s in sockets] == [(socket.AF_INET6, ("::1", port))]
    finally:
        m.stop_http_server()
