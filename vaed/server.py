"""Server wiring: grpc.aio front, interceptors, health, reflection, metrics,
TLS, keepalive, and the lifecycle (load + warm-up in the background, drain on
SIGTERM, exit at once on a second one)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import resource
import signal
import socket

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vaed_client import wire
from vaed_client.channel import read_token
from vaed_client.heap import keep_freed_memory

from .auth import BearerTokenInterceptor, server_credentials
from .calls import CallCore, Lifecycle
from .choices import Kernels, Parallel
from .config import ServerConfig
from .engine import DecodeEngine
from .engine_protocol import Engine, EngineFactory
from .heap import freeze_startup_heap, unfreeze_heap
from .http import HttpLimits, HttpServer
from .http.front import HfFront
from .http.page import PageRoutes
from .interceptors import HealthGate, Refusals, RpcLimitInterceptor
from .logs import DroppedLogCollector
from .logs import installed as installed_log_handler
from .metrics import METRICS_PATH, ServerMetrics, add_metrics_route
from .models import is_tiny_model, kernel_family
from .parallel.pool import WorkerPool
from .service import VaeDecoderService
from .startup import (
    StartupTimes,
    conv_plan_file,
    kernel_cache_dir,
    kernel_cache_entries,
    phase,
    use_kernel_cache,
)
from .video import PackagingPool
from .worker import DeviceWorker

log = logging.getLogger(__name__)

class StartupError(RuntimeError):
    """The server could not start (port taken, model failed to load, bad TLS/auth files)."""


def conv_plan_file_for(device: str) -> str | None:
    """The fast tier's conv plan file (`vaed.startup.conv_plan_file`); None on a CPU device."""
    return conv_plan_file() if device.startswith("cuda") else None


def engine_factory(config: ServerConfig) -> EngineFactory:
    """How each device worker builds its engine from the config. With
    --parallel spatial the one worker's engine drives a group of all devices
    (`vaed.parallel`): large sessions are sharded, small ones stay on GPU 0."""

    def build(device: str) -> Engine:
        engine = DecodeEngine.load(
            config.model, device=device, dtype=config.compute_dtype_name,
            kernels=config.kernels, layout=config.layout, disabled_ops=config.disabled_ops,
            cuda_graphs=config.cuda_graphs, encoder=config.encode, encode_dtype=config.encode_dtype,
            conv_plans=config.conv_plans, conv_plan_file=conv_plan_file_for(device),
        )
        if config.parallel != Parallel.SPATIAL:
            return engine
        from .parallel import GroupConfig, start_sharded_engine

        group = GroupConfig(
            config.model, config.devices, dtype=config.compute_dtype_name, kernels=config.kernels,
            layout=config.layout, axis=config.spatial_axis, min_pixels=config.spatial_min_pixels,
            engine_options={"disabled_ops": config.disabled_ops},
        )
        with phase("spatial group"):
            sharded = start_sharded_engine(group, base=engine)
        log.info("sharded decode ready: %s", sharded.describe())
        return sharded

    return build


def compile_kernels_ahead(config: ServerConfig, kernel_cache: str) -> None:
    """The packaged kernel records of this model's kind of start (all of them where the
    manifest does not name it), for each device's architecture, compiled into the cache in
    parallel processes while the model loads; the workers' first kernel fetch waits for them
    (`vaed.kernels.precompile`). A cache that has them costs a file check; a failure leaves the
    compiles to the launches, as without records."""
    from .kernels import precompile

    archs = {precompile.arch_of(device) for device in config.devices}
    for arch in sorted(archs):
        if not precompile.manifest_path(arch).exists():
            log.info("no kernel records for sm_%d in this install: its kernels compile at their first launch", arch)

    def report(done: concurrent.futures.Future[list[precompile.CompileReport]]) -> None:
        if done.exception() is not None:
            log.error("compiling the kernels ahead failed (%s); they compile at their first launch", done.exception())
            return
        for compiled in done.result():
            log.info("compiled ahead into %s, beside the model load: %s", kernel_cache, compiled.summary())

    start = precompile.start_name(kernel_family(config.model), config.encode)
    precompile.start_ensure_compiled(archs, kernel_cache, precompile.default_workers(), start).add_done_callback(report)


def _transport_summary(cfg: ServerConfig) -> str:
    if not cfg.tls_cert:
        return "plaintext"
    return "mutual TLS (client certificates required)" if cfg.tls_client_ca else "TLS"


def worker_devices(config: ServerConfig) -> tuple[str, ...]:
    """One worker per device, or one worker whose engine spans every device (spatial)."""
    return config.devices[:1] if config.parallel == Parallel.SPATIAL else config.devices


# File descriptors kept free of gRPC connections for the metrics endpoint, model files,
# logs and the device runtime: --max-connections is lowered to RLIMIT_NOFILE minus this.
FD_HEADROOM = 256


def connection_cap(config: ServerConfig) -> int:
    """--max-connections, lowered so gRPC's connections alone cannot exhaust RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or config.max_connections + FD_HEADROOM <= soft:
        return config.max_connections
    cap = max(1, soft - FD_HEADROOM)
    log.warning("--max-connections %d lowered to %d: RLIMIT_NOFILE is %d and %d fds stay free",
                config.max_connections, cap, soft, FD_HEADROOM)
    return cap


# Each stream's HTTP/2 receive window, fixed: what a client that stops being read can park in
# the server. gRPC's default BDP probing sizes the window from the measured delay, so a loaded
# machine grows it: a DecodeStream pushing 1 MiB messages into a full backlog parked 68-134 MiB
# in the server's transport (RSS +87-220 MiB on 2 busy cores); fixed at 4 MiB, 5-8 messages and
# +10-33 MiB. A read of a larger message still opens the window to that message's length, and
# 4 MiB is 8 GB/s at a 0.5 ms round trip: loopback uploads of 1 and 8 MiB messages ran 1.0-1.3 GB/s with BDP probing
# and 1.35-1.45 GB/s without it.
STREAM_WINDOW_BYTES = 4 << 20


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Message limits, keepalive, connection age (so clients re-resolve DNS and reach new
    replicas), fixed stream windows, and the limits a hostile client meets before any call is
    authenticated."""

    def ms(seconds: float) -> int:
        return int(seconds * 1000)

    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Identity only: a compressed request is refused UNIMPLEMENTED ("Compression algorithm
        # 'gzip' is disabled") from its headers, before a byte of it is read. vaed's client never
        # compresses (latents and frames do not shrink). With gzip on, one unauthenticated health
        # Check of 199 KB inflated to 200 MiB grew a server by ~610 MB RSS.
        ("grpc.compression_enabled_algorithms_bitset", 1),
        # A TCP connection that sends no HTTP/2 preface is closed after this (gRPC's default:
        # 120 s); past the cap new connections are closed as they are accepted. Without either,
        # 20 400 idle connections took a server to its RLIMIT_NOFILE (20 000) and hung health
        # probes and /metrics; with a cap of 20, 100 idle connections held 20 fds, and none
        # after the timeout.
        ("grpc.server_handshake_timeout_ms", ms(config.handshake_timeout)),
        ("grpc.max_allowed_incoming_connections", connection_cap(config)),
        # HTTP/2 MAX_CONCURRENT_STREAMS (gRPC's default: unlimited). gRPC core also refuses new
        # streams (REFUSED_STREAM) while a connection holds more streams than this that the
        # server has not finished releasing, which is what bounds a rapid reset (HEADERS +
        # RST_STREAM in a loop, which MAX_CONCURRENT_STREAMS alone does not): of 40 000 resets
        # on one connection 36 005 were refused in the transport (none without the limit), and
        # another client's GetModelInfo loop had no CANCELLED call (8-10 of ~2000 without).
        # gRPC sends such a connection no GOAWAY; it closes one that stops reading.
        ("grpc.max_concurrent_streams", config.streams_per_connection),
        # Off: with SO_REUSEPORT a second server on the same port would
        # silently share traffic instead of failing to start.
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", ms(config.keepalive_time)),
        ("grpc.keepalive_timeout_ms", ms(config.keepalive_timeout)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(config.min_ping_interval)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ms(config.min_ping_interval)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]
    if config.max_connection_age > 0:
        options += [
            ("grpc.max_connection_age_ms", ms(config.max_connection_age)),
            ("grpc.max_connection_age_grace_ms", ms(config.max_connection_age_grace)),
        ]
    return options


def bind_problem(host: str, port: int) -> str:
    """Why `host:port` cannot be bound, from a plain socket: gRPC only says "Failed to bind"."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r} is not an address of this machine ({exc.strerror})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "address already in use; choose another --port (or stop the server holding it)"
                return f"{exc.strerror or exc}; check --host and --port"
    return "gRPC refused the address (see its message above); check --host and --port"


async def _start_http(server: HttpServer, host: str, port: int, flag: str) -> int:
    """An HTTP listener started, or a StartupError naming the flag whose port it could not bind."""
    try:
        return await server.start(host, port)
    except OSError as exc:
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise StartupError(f"could not bind {host}:{port} for {flag}: {why}; choose another {flag} "
                           "(not --port's either)") from None


def auth_summary(config: ServerConfig, has_token: bool) -> str:
    """The start-up log's words on authentication."""
    if not has_token:
        return "no auth token: every client is accepted"
    source = f"--auth-token-file {config.auth_token_file}" if config.auth_token_file else f"${wire.AUTH_TOKEN_ENV}"
    return f"bearer token required on every RPC but health (from {source})"


def http_host(config: ServerConfig) -> str:
    return config.http_host or config.host


def http_front_shares_metrics(config: ServerConfig) -> bool:
    """The front's routes go on the metrics listener when both name the same address: one
    socket, one connection cap. Given different ports they get a listener each, so decode
    clients (up to 64 connections, each holding a body) cannot crowd scrapes out, and a network
    policy can open the front to pipeline pods and metrics to Prometheus alone."""
    return (config.metrics_port is not None and config.http_port == config.metrics_port
            and http_host(config) == (config.metrics_host or config.host))


class VaedServer:
    def __init__(self, config: ServerConfig, build_engine: EngineFactory | None = None,
                 startup: StartupTimes | None = None):
        self.config = config
        self.lifecycle = Lifecycle()
        # the start-up's phases (vaed.startup); `vaed serve` passes its clock, started before the imports
        self.startup = startup or StartupTimes()
        build = build_engine or engine_factory(config)
        self.pool = WorkerPool(
            [DeviceWorker(device, build, warmup=config.warmup, warmup_shapes=config.warmup_shapes,
                          startup=self.startup)
             for device in worker_devices(config)],
            max_sessions=config.max_sessions,
        )
        self.metrics = ServerMetrics(load=self.pool) if config.metrics_port is not None else None
        if self.metrics is not None and (log_handler := installed_log_handler()) is not None:
            self.metrics.registry.register(DroppedLogCollector(log_handler))
        # Server-side video for both fronts; its threads start with the first call that asks.
        self.packaging = PackagingPool(config.packaging_threads)
        # every call's logic, below the fronts (the gRPC servicer translates for it)
        self.core = CallCore(config, self.pool, self.lifecycle, self.metrics, packaging=self.packaging)
        self.metrics_port: int | None = None
        # The one HTTP stack; /metrics is its first route.
        self.http: HttpServer | None = None
        if self.metrics is not None:
            self.http = HttpServer(HttpLimits(send_timeout=config.send_timeout), name="metrics")
            add_metrics_route(self.http.app, self.metrics)
        # The HTTP front (--http-port): routes on the metrics stack when it is the same address,
        # else a listener of its own (see `http_front_shares_metrics`).
        self.front: HfFront | None = None
        self.front_http: HttpServer | None = None
        self.http_port: int | None = None
        if config.http_port is not None:
            token = read_token(config.auth_token_file, wire.AUTH_TOKEN_ENV)
            self.front = HfFront(self.core, token=token, on_refused=self._refused)
            if self.http is not None and http_front_shares_metrics(config):
                self.front_http = self.http
            else:
                self.front_http = HttpServer(HttpLimits(send_timeout=config.send_timeout), name="HTTP front")
            self.front.add_routes(self.front_http.app)
            # the page at GET / (vaed.http.page), over the front's core and token
            PageRoutes(self.core, self.front, auth_required=token is not None).add_routes(self.front_http.app)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()

    def _refused(self, method: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.request_refused(method, code)

    async def start(self) -> int:
        """Bind, start serving NOT_SERVING, and load the model in the background. Returns the port."""
        cfg = self.config
        # The health gate first (health calls need no token), then auth: an unauthenticated
        # call is refused before it takes an RPC slot.
        interceptors: list[grpc.aio.ServerInterceptor] = [HealthGate(cfg.max_health_calls, on_refused=self._refused)]
        refusals = Refusals()  # one cap on lingering refusals for the whole server
        token = read_token(cfg.auth_token_file, wire.AUTH_TOKEN_ENV)
        if token is not None:
            interceptors.append(BearerTokenInterceptor(token, on_refused=self._refused, refusals=refusals))
        interceptors.append(RpcLimitInterceptor(cfg.rpc_limit, on_refused=self._refused, refusals=refusals))
        server = grpc.aio.server(interceptors=interceptors, options=grpc_options(cfg))
        service = VaeDecoderService(self.core)
        server.add_generic_rpc_handlers((service.rpc_handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [wire.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        address = f"{cfg.host}:{cfg.port}" if ":" not in cfg.host else f"[{cfg.host}]:{cfg.port}"
        credentials = None
        if cfg.tls_cert or cfg.tls_key or cfg.tls_client_ca:
            # checked before binding: StartupError is a RuntimeError, which the bind below reports
            # as an address problem
            if not (cfg.tls_cert and cfg.tls_key):
                raise StartupError("TLS needs both --tls-cert and --tls-key (--tls-client-ca adds client "
                                   "certificates to TLS)")
            credentials = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        try:
            if credentials is not None:
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"could not bind {address}: {bind_problem(cfg.host, cfg.port)}") from exc
        if not port:
            raise StartupError(f"could not bind {address}: {bind_problem(cfg.host, cfg.port)}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        self.port = port
        try:
            if self.http is not None:
                self.metrics_port = await _start_http(self.http, cfg.metrics_host or cfg.host, cfg.metrics_port or 0,
                                                      "--metrics-port")
                shown = (cfg.metrics_host or cfg.host).strip("[]")
                log.info("metrics on http://%s:%d%s", f"[{shown}]" if ":" in shown else shown, self.metrics_port,
                         METRICS_PATH)
            if self.front_http is not None and self.front_http is not self.http:
                self.http_port = await _start_http(self.front_http, http_host(cfg), cfg.http_port or 0, "--http-port")
            elif self.front_http is not None:
                self.http_port = self.metrics_port
        except StartupError:
            await self.stop(0)  # the gRPC port and any HTTP one already bound
            raise
        if self.front_http is not None:
            shown = http_host(cfg).strip("[]")
            log.info("HTTP front (Hugging Face remote-VAE protocol) on http://%s:%d/",
                     f"[{shown}]" if ":" in shown else shown, self.http_port)
        loop = asyncio.get_running_loop()
        # the pool calls these from device threads; they hand over to the event loop

        def on_change() -> None:
            loop.call_soon_threadsafe(self._on_pool_change)

        def on_ready() -> None:
            loop.call_soon_threadsafe(self._on_pool_ready)

        self.pool.on_change = on_change
        self.pool.start(on_ready=on_ready)
        log.info("listening on %s (port %d, %s, %s); loading %s on %s",
                 address, port, _transport_summary(cfg), auth_summary(cfg, token is not None),
                 cfg.model, ", ".join(cfg.devices))
        return port

    def _on_pool_ready(self) -> None:
        self._ready.set()
        if self.pool.ready and not self.lifecycle.draining:
            with self.startup.timed("gc freeze"):
                frozen, seconds = freeze_startup_heap()
            log.info("froze %d start-up objects out of the cyclic GC (a full collection took %.0f ms)",
                     frozen, seconds * 1e3)
            if self.core.default_precision != self.config.precision:
                log.warning("--precision %s: this server has no %s tier (its kernels are off or failed their "
                            "start-up checks; the fast paths line says why): calls that ask for no tier get %s, "
                            "and it offers %s", self.config.precision, self.config.precision,
                            self.core.default_precision, ", ".join(self.core.offered))
            # made once here, before the first call; what a resuming client compares (vaed.identity)
            decoder_identity, encoder_identity = self.core.identities()
            log.info("decoder identity: %s%s", decoder_identity,
                     f"; encoder identity: {encoder_identity}" if encoder_identity else "")
            asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.SERVING))
            down = [w.device for w in self.pool.workers if not w.healthy]
            total = self.startup.elapsed()
            log.info("SERVING on %s%s", ", ".join(w.device for w in self.pool.healthy_workers),
                     f" ({', '.join(down)} failed to start)" if down else "")
            log.info("%s", self.startup.summary(total))
            if self.metrics is not None:
                self.metrics.started(self.startup.phases, total)

    def _on_pool_change(self) -> None:
        """A device left rotation: its health entry turns NOT_SERVING (the server's stays
        SERVING while one device serves)."""
        if not self.lifecycle.draining:
            serving = self.pool.ready
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            asyncio.ensure_future(self._set_health(status))

    async def _set_health(self, status: int) -> None:
        """The server's entries ("" and the service) get `status`; each device's entry
        (`vaed.v1.VaeDecoder/cuda:0`, ...) is SERVING only while the server is and it is healthy."""
        for name in ("", wire.SERVICE_NAME):
            await self.health.set(name, status)
        for worker in self.pool.workers:
            serving = worker.healthy or not worker.started
            device_status = status if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(f"{wire.SERVICE_NAME}/{worker.device}", device_status)
            for name, ok in (worker.engine.health_entries().items() if worker.engine is not None else ()):
                # a spatial group's entry (`vaed.v1.VaeDecoder/spatial`): NOT_SERVING once it broke
                entry_status = device_status if ok else health_pb2.HealthCheckResponse.NOT_SERVING
                await self.health.set(f"{wire.SERVICE_NAME}/{name}", entry_status)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for load + warm-up; raises StartupError if no device could start."""
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(None, self.pool.wait_ready, timeout)
        if not ok:
            raise StartupError(f"model not ready after {timeout} s")
        error = self.pool.startup_error
        if error is not None:
            raise StartupError(str(error)) from error
        await self._ready.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: new calls get UNAVAILABLE, in-flight calls (gRPC and HTTP) get `grace` seconds to
        finish; the rest are then cut and the server stops."""
        if self._stopped.is_set():
            return
        grace = self.config.grace if grace is None else grace
        self.lifecycle.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: waiting up to %.1f s for %d session(s)", grace, self.pool.admitted)
        # The server keeps answering while sessions finish: new calls get UNAVAILABLE
        # from the servicer, which clients retry on another replica. gRPC's own stop
        # refuses new calls outright and cuts the rest at the deadline, so that comes last.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.pool.admitted and loop.time() < deadline:
            await asyncio.sleep(0.05)
        # What still runs at the end of the grace is cut, and counted as its client sees it
        # (UNAVAILABLE), not as a cancel of its own: gRPC's stop cuts at the deadline, this first.
        remaining = max(0.0, deadline - loop.time())
        mark_cut = loop.call_at(deadline, setattr, self.lifecycle, "cutting", True)
        if remaining == 0:
            self.lifecycle.cutting = True
        if self._server is not None:
            await self._server.stop(remaining)
        mark_cut.cancel()
        self.lifecycle.cutting = True  # the HTTP calls left are cut next
        # The grace is over for HTTP calls too: cut them as gRPC's were just cancelled, before the
        # workers stop (an HTTP call would otherwise wait on its stopped worker until aiohttp's
        # shutdown gave up on it, minutes later).
        if self.front_http is not None:
            await self.front_http.stop()
        await loop.run_in_executor(None, self.pool.stop)
        if self.http is not None:
            await self.http.stop()  # a no-op when it carried the front, stopped above
        self.packaging.shutdown()
        self._stopped.set()
        unfreeze_heap()  # this process may go on (tests, an embedding app): its garbage is collectable again
        log.info("stopped")


# Exit code of a second SIGTERM/SIGINT during the drain: 128 + SIGTERM, as a shell reports it.
FORCED_EXIT_CODE = 128 + signal.SIGTERM


# torch intra-op threads of a CPU server decoding a "-tiny" model (without --cpu-threads).
# Its ops are a few channels wide, far less work than waking and joining a thread pool costs:
# on a busy 2-core machine (load ~5) a 64x64, 17-frame decode took a median 0.34 s on one
# thread against 2.7-3.6 s (max 11 s) on torch's default of two, and 480x832 x 9 frames
# 12-22 s against 20-43 s. The full-size architectures are compute-bound and keep torch's
# default: random:wan2.1 at 128x128 x 5 frames took 4.2-7.3 s on two threads, 8.1 s on one.
TINY_MODEL_CPU_THREADS = 1


def cpu_threads(config: ServerConfig) -> int | None:
    """The intra-op threads `serve` sets: --cpu-threads, else 1 on CUDA and for a tiny model on
    the CPU; None leaves torch's default (one per core)."""
    threads = config.intra_op_threads
    if threads is None and not config.is_cuda and is_tiny_model(config.model):
        return TINY_MODEL_CPU_THREADS
    return threads


def set_cpu_threads(config: ServerConfig) -> int | None:
    """Set torch's intra-op threads for this process (`cpu_threads`); returns the number set,
    or None when torch's default stays. Process-wide, so only `serve` calls it, never a
    server embedded in another program (tests)."""
    threads = cpu_threads(config)
    if threads is not None:
        torch.set_num_threads(threads)
        log.info("torch CPU ops use %d intra-op thread(s)", threads)
    return threads


async def serve(config: ServerConfig, startup: StartupTimes | None = None) -> int:
    """`vaed serve`: run until SIGTERM/SIGINT, then drain; a second signal exits at once. Returns the exit code.
    SIGHUP (a closed terminal, a log-rotation hook) is logged and ignored: its default kills the
    process mid-call, and the server has no log file to reopen (it writes stderr). `startup` is
    the start-up clock `vaed serve` started before its imports (their time is its first phase)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lambda: log.info("SIGHUP received and ignored; SIGTERM drains and stops"))
    if startup is not None:
        startup.add("import", startup.elapsed())
    set_cpu_threads(config)
    log.info("malloc: %s", keep_freed_memory())
    try:
        use_kernel_cache(config.kernel_cache)  # before any worker can compile a kernel
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    kernel_cache = kernel_cache_dir(ask_triton=config.is_cuda)
    kernels_found = kernel_cache_entries(kernel_cache)
    if kernel_cache is not None:
        log.info("Triton kernel cache: %s (%d compiled kernels found)", kernel_cache, kernels_found)
    if config.is_cuda and kernel_cache is not None and config.kernels != Kernels.OFF:
        compile_kernels_ahead(config, kernel_cache)
    try:
        server = VaedServer(config, startup=startup)  # reads the token file for the HTTP front
        await server.start()
    except (StartupError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    stop_requested = asyncio.Event()

    def on_signal() -> None:
        if stop_requested.is_set():
            log.error("second signal during the drain; exiting now")
            if (log_handler := installed_log_handler()) is not None:
                log_handler.flush(1.0)  # os._exit skips the writer thread's queue otherwise
            os._exit(FORCED_EXIT_CODE)
        stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    ready = asyncio.ensure_future(server.wait_ready())
    stop_wait = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([ready, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        # The worker logged the cause (with its device); this line says what happens next.
        log.error("no device could start; exiting")
        stop_wait.cancel()
        await server.stop(0)
        return 3
    if ready.done() and kernel_cache is not None:
        # the same count at start and now: every kernel came from the cache, none was compiled
        log.info("Triton kernel cache %s: %d compiled kernels at start, %d now",
                 kernel_cache, kernels_found, kernel_cache_entries(kernel_cache))
    await stop_wait
    ready.cancel()
    log.info("signal received; shutting down")
    await server.stop()
    return 0
