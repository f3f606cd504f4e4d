"""Server wiring: grpc.aio front, health, reflection, metrics, auth, TLS,
and the lifecycle (load + warm-up in the background, drain on SIGTERM)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vaed_client._proto import vaed_pb2, vaed_pb2_grpc

from .auth import AUTH_TOKEN_ENV, BearerTokenInterceptor, read_token, server_credentials
from .config import ServerConfig
from .engine import DecodeEngine
from .metrics import ServerMetrics
from .service import Lifecycle, VaeDecoderService
from .worker import DeviceWorker

log = logging.getLogger(__name__)

SERVICE_NAME = vaed_pb2.DESCRIPTOR.services_by_name["VaeDecoder"].full_name


class StartupError(RuntimeError):
    """The server could not start (port taken, model failed to load, bad TLS/auth files)."""


class VaedServer:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[ServerConfig], DecodeEngine] | None = None):
        self.config = config
        self.lifecycle = Lifecycle()
        self.worker = DeviceWorker(config, engine_factory)
        self.metrics = ServerMetrics(config.device) if config.metrics_port is not None else None
        self.metrics_port: int | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Bind, start serving NOT_SERVING, and load the model in the background. Returns the port."""
        cfg = self.config
        interceptors = []
        token = read_token(cfg.auth_token_file, AUTH_TOKEN_ENV)
        if token is not None:
            interceptors.append(BearerTokenInterceptor(token))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                # Off: with SO_REUSEPORT a second server on the same port
                # would silently share traffic instead of failing to start.
                ("grpc.so_reuseport", 0),
            ],
        )
        service = VaeDecoderService(cfg, self.worker, self.lifecycle, self.metrics)
        vaed_pb2_grpc.add_VaeDecoderServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
        address = f"{cfg.host}:{cfg.port}" if ":" not in cfg.host else f"[{cfg.host}]:{cfg.port}"
        try:
            if cfg.tls_cert or cfg.tls_key:
                if not (cfg.tls_cert and cfg.tls_key):
                    raise StartupError("TLS needs both --tls-cert and --tls-key")
                port = server.add_secure_port(address, server_credentials(cfg.tls_cert, cfg.tls_key))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"could not bind {address}: {exc}") from exc
        if not port:
            raise StartupError(f"could not bind {address} (port in use?)")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        self.port = port
        if self.metrics is not None:
            self.metrics_port = self.metrics.start_http_server(cfg.metrics_port or 0, cfg.host)
        loop = asyncio.get_running_loop()
        self.worker.on_ready = lambda: loop.call_soon_threadsafe(self._on_worker_ready)
        self.worker.start()
        log.info("listening on %s (port %d, %s); loading %s on %s",
                 address, port, "TLS" if cfg.tls_cert else "plaintext", cfg.model, cfg.device)
        return port

    def _on_worker_ready(self) -> None:
        self._ready.set()
        if self.worker.startup_error is None and not self.lifecycle.draining:
            asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.SERVING))
            log.info("SERVING")

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for load + warm-up; raises StartupError if the model failed to load."""
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(None, self.worker.wait_ready, timeout)
        if not ok:
            raise StartupError(f"model not ready after {timeout} s")
        if self.worker.startup_error is not None:
            raise StartupError(str(self.worker.startup_error)) from self.worker.startup_error
        await self._ready.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: new calls get UNAVAILABLE, in-flight streams get `grace` seconds to finish."""
        if self._stopped.is_set():
            return
        grace = self.config.grace if grace is None else grace
        self.lifecycle.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: waiting up to %.1f s for %d session(s)", grace, self.worker.active_sessions)
        if self._server is not None:
            await self._server.stop(grace)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.worker.stop)
        if self.metrics is not None:
            self.metrics.stop_http_server()
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig) -> int:
    """`vaed serve`: run until SIGTERM/SIGINT, then drain. Returns the exit code."""
    server = VaedServer(config)
    try:
        await server.start()
    except (StartupError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    ready = asyncio.ensure_future(server.wait_ready())
    stop_wait = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([ready, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("model failed to load: %s", ready.exception())
        stop_wait.cancel()
        await server.stop(0)
        return 3
    await stop_wait
    ready.cancel()
    log.info("signal received; shutting down")
    await server.stop()
    return 0
