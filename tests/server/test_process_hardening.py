"""A real `vaed serve` process on a bad day: a log stream nobody reads, SIGHUP mid-call.

Every wait is a bound on a hang (minutes), never a speed threshold: on a loaded
2-core machine a tiny decode can take seconds, a hung server never answers.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vaed_client import VaeClient

from harness import start_cli_server

# A call waits at most this long; today's hang is forever, a slow machine is seconds.
CALL_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_TIMEOUT_S) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


class _Reader:
    """Reads a process's output on a thread from the moment it is started (the log shipper resumes)."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in list(self.lines)):
                return True
            time.sleep(0.1)
        return False


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S).status


# Each GetModelInfo logs one ~300-byte line: 6000 calls are ~1.8 MB of log, far past
# a pipe's 64 KiB buffer (the old server hung on its ~200th call) and past the
# 4096 records vaed.logs holds, so some are dropped and counted.
LOGGED_CALLS = 6000


@pytest.mark.slow
def test_a_log_stream_nobody_reads_does_not_stop_the_server():
    metrics_port = _free_port()
    proc, target = start_cli_server("--metrics-port", str(metrics_port), "--grace", "60")
    # From here on nobody reads the process's stderr (merged into its stdout pipe).
    try:
        latents = torch.randn(1, 4, 2, 5, 7)
        with VaeClient(target, timeout=CALL_TIMEOUT_S) as client, grpc.insecure_channel(target) as channel:
            for i in range(LOGGED_CALLS):
                assert client.model_info().z_dim == 4
                if i % 500 == 0:
                    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
                    assert client.decode(latents).shape == (1, 5, 40, 56, 3)
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        dropped = _metric(metrics_port, "vaed_log_records_dropped_total")
        assert dropped > 0
        # The shipper resumes: the queued records come out, then the count of the dropped ones.
        reader = _Reader(proc.stdout)
        assert reader.wait_for("log record(s) while the log stream was not read", CALL_TIMEOUT_S), reader.lines[-5:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(CALL_TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
def test_sighup_mid_call_is_ignored_and_the_server_keeps_serving():
    """SIGHUP (a log-rotation hook, a closed terminal) arrives while a session's frames
    are decoding: the session still gets every frame, the server serves the next call,
    and SIGTERM then drains and exits 0 as usual."""
    proc, target = start_cli_server("--grace", "60")
    reader = _Reader(proc.stdout)
    try:
        latents = torch.randn(1, 4, 12, 8, 8)
        with VaeClient(target, timeout=CALL_TIMEOUT_S) as client:
            session = client.session()
            session.push(latents[:, :, :1])
            frames = iter(session)
            first = next(frames)
            session.push(latents[:, :, 1:])  # eleven latent frames decoding while the signal lands
            proc.send_signal(signal.SIGHUP)
            session.close()
            rest = list(frames)
            assert first.first_frame == 0
            assert rest[-1].first_frame + rest[-1].num_frames == 45
            assert reader.wait_for("SIGHUP received and ignored", CALL_TIMEOUT_S), reader.lines[-5:]
            assert client.decode(latents[:, :, :2]).shape == (1, 5, 64, 64, 3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(CALL_TIMEOUT_S) == 0
        assert reader.wait_for("stopped", 10), reader.lines[-5:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
