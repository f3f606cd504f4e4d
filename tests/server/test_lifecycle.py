"""Health, warm-up, drain on SIGTERM, and the real `vaed serve` process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vaed.engine import DecodeEngine
from vaed.server import VaedServer
from vaed_client import VaeClient
from vaed_client.errors import UnavailableError

from harness import make_config


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_is_not_serving_until_loaded_and_warmed_up():
    release = threading.Event()

    def slow_factory(config):
        release.wait(30)
        return DecodeEngine.load(config)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = VaedServer(make_config(), engine_factory=slow_factory)
    try:
        port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        target = f"127.0.0.1:{port}"
        assert health_status(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with VaeClient(target) as client:
            with pytest.raises(UnavailableError, match="warming up"):
                client.decode(torch.randn(1, 4, 1, 5, 7))
        release.set()
        asyncio.run_coroutine_threadsafe(server.wait_ready(60), loop).result(70)
        assert health_status(target) == health_pb2.HealthCheckResponse.SERVING
        assert health_status(target, "vaed.v1.VaeDecoder") == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        asyncio.run_coroutine_threadsafe(server.stop(grace=1), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_reflection_lists_the_service(tiny_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"vaed.v1.VaeDecoder", "grpc.health.v1.Health"} <= names


def test_port_already_in_use_fails_startup(tiny_server):
    from vaed.server import StartupError

    port = tiny_server.server.port

    async def start_second():
        second = VaedServer(make_config(port=port))
        try:
            await second.start()
        finally:
            await second.stop(0)

    with pytest.raises(StartupError, match="could not bind"):
        asyncio.run(start_second())


def _start_cli_server(*extra: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vaed.cli", "serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
         "--model", "random:wan2.1-tiny", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    port = None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"\(port (\d+),", line)
        if match:
            port = match.group(1)
        if "SERVING" in line and port:
            return proc, f"127.0.0.1:{port}"
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


def test_vaed_serve_process_answers_and_drains_on_sigterm():
    proc, target = _start_cli_server("--grace", "20")
    output: list[str] = []
    try:
        with VaeClient(target) as client:
            info = client.model_info()
            assert info.z_dim == 4 and info.device == "cpu"
            # A long stream is in flight when SIGTERM arrives: it must finish.
            latents = torch.randn(1, 4, 12, 24, 24)
            stream = client.stream(latents)
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert first.first_frame == 0
            assert rest[-1].first_frame + rest[-1].num_frames == 45
            # New calls are refused once draining (or the port is closed).
            with pytest.raises(UnavailableError):
                with VaeClient(target, timeout=5) as late:
                    late.decode(torch.randn(1, 4, 1, 5, 7))
        proc.wait(60)
        output = proc.stdout.read().splitlines()
        assert proc.returncode == 0, output
        assert any("draining" in line for line in output)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_explicit_triton_kernels_that_cannot_run_fail_startup():
    """On the CPU the fused kernels cannot run: `--kernels triton` must refuse to serve."""
    from vaed.server import StartupError

    async def start():
        server = VaedServer(make_config(kernels="triton"))
        await server.start()
        try:
            await server.wait_ready(60)
        finally:
            await server.stop(0)

    with pytest.raises(StartupError, match="(?i)triton|cuda|cpu"):
        asyncio.run(start())
