"""Health, warm-up, drain on SIGTERM, and the real `vaed serve` process."""

from __future__ import annotations

import asyncio
import signal
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vaed.server import VaedServer, engine_factory
from vaed_client import VaeClient
from vaed_client.errors import UnavailableError

from harness import make_config, start_cli_server


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_is_not_serving_until_loaded_and_warmed_up():
    release = threading.Event()

    config = make_config()

    def slow_factory(device):
        release.wait(30)
        return engine_factory(config)(device)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = VaedServer(config, slow_factory)
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


def test_vaed_serve_process_answers_and_drains_on_sigterm():
    """SIGTERM while a session waits on its client: new calls are refused, the session
    still pushes, half-closes and gets every frame, then the process exits 0. The grace
    (300 s) is far above any machine's decode time, and the session ends the drain, so
    the test asserts the drain, not the machine's speed."""
    proc, target = start_cli_server("--grace", "300")
    output: list[str] = []
    try:
        with VaeClient(target) as client:
            info = client.model_info()
            assert info.z_dim == 4 and info.device == "cpu"
            latents = torch.randn(1, 4, 12, 12, 12)
            session = client.session()
            session.push(latents[:, :, :1])
            frames = iter(session)
            first = next(frames)
            proc.send_signal(signal.SIGTERM)
            # New calls are refused once draining (or the port is closed).
            with pytest.raises(UnavailableError):
                with VaeClient(target, timeout=5) as late:
                    late.decode(torch.randn(1, 4, 1, 5, 7))
            session.push(latents[:, :, 1:])  # the in-flight session keeps going
            session.close()
            rest = list(frames)
            assert first.first_frame == 0
            assert rest[-1].first_frame + rest[-1].num_frames == 45
        proc.wait(120)
        output = proc.stdout.read().splitlines()
        assert proc.returncode == 0, output
        assert any("draining" in line for line in output)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_second_sigterm_exits_at_once_with_a_non_zero_code():
    from vaed.server import FORCED_EXIT_CODE

    proc, target = start_cli_server("--grace", "300")
    try:
        with VaeClient(target) as client:
            session = client.session()  # holds the drain open: it never half-closes
            session.push(torch.randn(1, 4, 1, 5, 7))
            next(iter(session))
            proc.send_signal(signal.SIGTERM)
            while True:
                line = proc.stdout.readline()
                assert line, "the server exited before draining"
                if "draining" in line:
                    break
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            assert proc.returncode == FORCED_EXIT_CODE
            session.cancel()
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
