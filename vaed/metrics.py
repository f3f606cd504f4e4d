"""Prometheus metrics for the vaed server, and the HTTP endpoint that serves them.

Two kinds of metric, two ways of producing them:

* Events (finished or refused RPCs, latencies, decoded frames) are counters
  and histograms the service records as they happen.
* State (sessions, pending work, device health, GPU memory) is read from a
  ``LoadSource`` when Prometheus scrapes, never pushed from the decode path.
  A gauge set "after each chunk" is stale during a burst and reads 0 while the
  first frame of a request decodes; a scrape-time read is exact at every
  scrape and costs the decode path nothing.

Every ``ServerMetrics`` owns its own ``CollectorRegistry``: tests start several
in-process servers, and the global registry would reject a second set of the
same names.

Exported names (all prefixed ``vaed_``):

* ``vaed_requests_total{method,code}``             counter: finished and refused RPCs
* ``vaed_request_duration_seconds{method}``        histogram (finished RPCs only)
* ``vaed_time_to_first_frame_seconds{method}``     histogram
* ``vaed_frames_decoded_total``                    counter (output frames)
* ``vaed_latent_frames_decoded_total``             counter (input latent frames)
* ``vaed_skipped_frames_total``                    counter: output frames a resumed call decoded
  again but did not send (``DecodeOptions.skip_frames``: the client had them)
* ``vaed_active_sessions{device}``                 gauge, scrape time
* ``vaed_pending_latent_frames{device}``           gauge, scrape time: the autoscaling signal
* ``vaed_device_healthy{device}``                  gauge, scrape time (1/0)
* ``vaed_gpu_memory_allocated_bytes{device}``      gauge, scrape time, CUDA devices only
* ``vaed_gpu_memory_peak_bytes{device}``           gauge, scrape time, CUDA devices only

Label values are bounded whatever callers pass: a method outside
``RPC_METHODS`` is counted as ``other`` and a code that is not a gRPC status
name as ``UNKNOWN``, so a client that calls made-up method names cannot grow
the registry (and the scrape) without bound.

The HTTP endpoint (``start_http_server``) is one asyncio loop on one daemon
thread, not a thread per connection: an idle or half-sent request costs a
socket and a coroutine, never a thread, and is closed after
``HTTP_TIMEOUT_SECONDS``; past ``HTTP_MAX_CONNECTIONS`` open connections a new
one evicts the oldest. It serves ``GET /metrics`` only (404 elsewhere, 405
for other methods).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# The autoscaling signal's name; k8s/ (HPA, prometheus-adapter rule) and the
# docs refer to it, so it lives in one place.
PENDING_LATENT_FRAMES_METRIC = "vaed_pending_latent_frames"

# The `method` label values; anything else is counted as OTHER_METHOD.
RPC_METHODS: tuple[str, ...] = ("GetModelInfo", "Decode", "DecodeStream")
OTHER_METHOD = "other"

_STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)

# 10 ms .. 60 s. A 480x832 Wan2.1 chunk decodes in ~0.06 s on an H200, a whole
# 81-frame 720p request in ~3 s, a CPU decode or a long DecodeStream session
# takes tens of seconds; past 60 s lands in +Inf.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)

# A scrape client gets this long to send its request head and read the
# answer; Prometheus sends the head at once, a slowloris client is cut off.
HTTP_TIMEOUT_SECONDS = 5.0
# At most this many connections are open; a new one evicts the oldest. Bounds
# the sockets (file descriptors the gRPC port also needs) that a flood of idle
# connections can hold, without locking real scrapes out.
HTTP_MAX_CONNECTIONS = 64
# Request heads larger than this are refused (a scrape's head is ~200 bytes).
HTTP_MAX_HEAD_BYTES = 8192
METRICS_PATH = "/metrics"


# ------------------------------------------------------------------ load


@dataclass(frozen=True)
class DeviceLoad:
    """One device's state at the moment of a scrape."""

    device: str                 # "cuda:0", "cpu", ...
    healthy: bool               # loaded, warmed up, not failed
    active_sessions: int        # Decode / DecodeStream calls holding a session slot on it, from admission on
    pending_latent_frames: int  # latent frames received and not yet decoded


class LoadSource(Protocol):
    """What the metrics read at scrape time (the worker pool implements it)."""

    def device_loads(self) -> list[DeviceLoad]: ...


def _cuda_memory(device: str) -> tuple[float, float]:
    """(allocated, peak) bytes of torch's CUDA allocator on ``device``; zeros when unreadable.

    Never imports torch and never initialises CUDA from the scrape thread:
    before the worker has touched the device nothing is allocated anyway.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return 0.0, 0.0
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device))
    except Exception:  # a scrape must never fail on one device's counters
        logger.debug("could not read CUDA memory for %s", device, exc_info=True)
        return 0.0, 0.0


class _LoadCollector(Collector):
    """Per-device gauges, read from the ``LoadSource`` when Prometheus scrapes."""

    def __init__(self, load: LoadSource | None) -> None:
        self._load = load

    def _families(self) -> dict[str, GaugeMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["device"])

        return {
            "sessions": gauge(
                "vaed_active_sessions",
                "Decode and DecodeStream calls holding a session slot, from admission (before their first message).",
            ),
            "pending": gauge(
                PENDING_LATENT_FRAMES_METRIC,
                "Latent frames received and not yet decoded, summed over sessions (the autoscaling signal).",
            ),
            "healthy": gauge("vaed_device_healthy", "1 when the device serves decodes, else 0."),
            "allocated": gauge(
                "vaed_gpu_memory_allocated_bytes", "Bytes held by tensors in torch's CUDA caching allocator."
            ),
            "peak": gauge(
                "vaed_gpu_memory_peak_bytes",
                "Peak bytes held by tensors in torch's CUDA caching allocator since start.",
            ),
        }

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        loads: list[DeviceLoad] = []
        if self._load is not None:
            try:
                loads = list(self._load.device_loads())
            except Exception:  # families without samples rather than a failed scrape
                logger.warning("could not read device loads for metrics", exc_info=True)
        for d in loads:
            families["sessions"].add_metric([d.device], d.active_sessions)
            families["pending"].add_metric([d.device], d.pending_latent_frames)
            families["healthy"].add_metric([d.device], 1.0 if d.healthy else 0.0)
            # A CPU device reports 0, so dashboards and alerts see a value, not a gap.
            allocated, peak = _cuda_memory(d.device) if d.device.startswith("cuda") else (0.0, 0.0)
            families["allocated"].add_metric([d.device], allocated)
            families["peak"].add_metric([d.device], peak)
        yield from families.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only: registration must not call into the worker pool.
        yield from self._families().values()


# ------------------------------------------------------------------ metrics


class ServerMetrics:
    """The server's metrics, with a private registry and an optional HTTP endpoint.

    Recording methods (the service calls these, one way per event):
    ``request_finished`` for a call a handler ran, ``request_refused`` for a
    call refused before any handler ran (auth, RPC limit: counted, not timed),
    ``observe_first_frame``, ``frames_decoded``.
    """

    def __init__(self, load: LoadSource | None = None, methods: Collection[str] = RPC_METHODS) -> None:
        self._methods = frozenset(methods)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "vaed_requests", "Finished and refused RPCs by method and gRPC status code.",
            ["method", "code"], registry=r,
        )
        self._duration = Histogram(
            "vaed_request_duration_seconds",
            "Wall time of an RPC a handler ran, from its start to its last message.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._ttff = Histogram(
            "vaed_time_to_first_frame_seconds",
            "Time from the start of an RPC to its first FrameChunk.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._frames = Counter("vaed_frames_decoded", "Output video frames decoded.", registry=r)
        self._latent_frames = Counter(
            "vaed_latent_frames_decoded", "Input latent frames decoded.", registry=r,
        )
        self._skipped_frames = Counter(
            "vaed_skipped_frames",
            "Output frames a resumed call decoded again but did not send (the client had them).", registry=r,
        )
        r.register(_LoadCollector(load))
        self._http: _MetricsHttpServer | None = None

    def _method(self, method: str) -> str:
        name = method.rsplit("/", 1)[-1]  # "/vaed.v1.VaeDecoder/Decode" -> "Decode"
        return name if name in self._methods else OTHER_METHOD

    @staticmethod
    def _code(code: str) -> str:
        return code if code in _STATUS_NAMES else grpc.StatusCode.UNKNOWN.name

    # -- recording -------------------------------------------------------

    def request_finished(self, method: str, code: str, seconds: float) -> None:
        """One RPC a handler ran; ``code`` is a grpc.StatusCode name such as "OK"."""
        method = self._method(method)
        self._requests.labels(method=method, code=self._code(code)).inc()
        self._duration.labels(method=method).observe(max(0.0, seconds))

    def request_refused(self, method: str, code: str) -> None:
        """One RPC refused before a handler ran (UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...).

        Counted in ``vaed_requests_total`` but kept out of the duration
        histogram: a flood of instant refusals would drag latency quantiles
        towards zero.
        """
        self._requests.labels(method=self._method(method), code=self._code(code)).inc()

    def observe_first_frame(self, method: str, seconds: float) -> None:
        self._ttff.labels(method=self._method(method)).observe(max(0.0, seconds))

    def frames_decoded(self, frames: int, latent_frames: int) -> None:
        self._frames.inc(frames)
        self._latent_frames.inc(latent_frames)

    def frames_skipped(self, frames: int, latent_frames: int) -> None:
        """Frames a resumed call decoded for its causal cache only; their latent frames count as decoded."""
        self._skipped_frames.inc(frames)
        self._latent_frames.inc(latent_frames)

    # -- exposition ------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format 0.0.4 (what GET /metrics returns)."""
        return generate_latest(self.registry)

    def start_http_server(
        self, port: int, host: str = "0.0.0.0", timeout: float = HTTP_TIMEOUT_SECONDS
    ) -> int:
        """Serve GET /metrics from one daemon thread; returns the bound port (0 = ephemeral).

        ``host`` is an IPv4 or IPv6 address (brackets allowed). Raises
        OSError when the address cannot be bound, ValueError when it is empty.
        """
        if self._http is not None:
            raise RuntimeError("metrics HTTP server already running")
        address = host.strip("[]")
        if not address:
            # asyncio would bind every interface, each on its own ephemeral port.
            raise ValueError("metrics host must be an address such as 0.0.0.0, :: or 127.0.0.1")
        http = _MetricsHttpServer(self.exposition, timeout=timeout)
        bound = http.start(address, port)
        self._http = http
        shown = f"[{address}]" if ":" in address else address
        logger.info("metrics on http://%s:%d%s", shown, bound, METRICS_PATH)
        return bound

    def stop_http_server(self) -> None:
        """Stop the endpoint and close its connections; safe when it never started."""
        http, self._http = self._http, None
        if http is not None:
            http.stop()


# ------------------------------------------------------------------ HTTP


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


class _MetricsHttpServer:
    """A minimal HTTP/1.x server for one path, on its own asyncio loop and thread.

    Each connection gets one request and ``Connection: close``; its whole
    exchange (head in, answer out) must finish within ``timeout``. At most
    ``max_connections`` are open: a new connection closes the oldest.
    """

    def __init__(
        self,
        render: Callable[[], bytes],
        timeout: float = HTTP_TIMEOUT_SECONDS,
        max_connections: int = HTTP_MAX_CONNECTIONS,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"metrics HTTP timeout must be > 0, got {timeout}")
        self._render = render
        self._timeout = timeout
        self._max_connections = max_connections
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vaed-metrics-http", daemon=True)
        self._server: asyncio.Server | None = None
        # Open connections in arrival order (dict: ordered, O(1) removal).
        self._tasks: dict[asyncio.Task[None], None] = {}

    def start(self, host: str, port: int) -> int:
        self._thread.start()
        try:
            future = asyncio.run_coroutine_threadsafe(
                asyncio.start_server(self._serve, host, port, limit=HTTP_MAX_HEAD_BYTES), self._loop
            )
            self._server = future.result(timeout=10.0)
        except BaseException:
            self._stop_loop()
            raise
        return int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5.0)
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
        if not self._loop.is_running():
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._tasks) >= self._max_connections:
            # Evict the oldest connection, not the new one: a scraper sends its
            # head within milliseconds and is done, so the oldest open
            # connection is the one most likely idle; refusing new ones
            # instead would let idle connections lock scrapes out.
            oldest = next(iter(self._tasks))
            oldest.cancel()
            del self._tasks[oldest]
        self._tasks[task] = None
        try:
            await asyncio.wait_for(self._exchange(reader, writer), self._timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass  # idle, half-sent, evicted or gone: just close
        except Exception:
            logger.warning("metrics request failed", exc_info=True)
        finally:
            self._tasks.pop(task, None)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            status, body = 431, b"request head too large\n"
        else:
            status, body = self._answer(head)
        content_type = CONTENT_TYPE_PLAIN_0_0_4 if status == 200 else "text/plain; charset=utf-8"
        extra = "Allow: GET\r\n" if status == 405 else ""
        writer.write(
            (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
             f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode("ascii") + body
        )
        await writer.drain()

    def _answer(self, head: bytes) -> tuple[int, bytes]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, b"bad request line\n"
        method, target = parts[0], parts[1]
        path = target.split(b"?", 1)[0]  # Prometheus may add query parameters
        if path != METRICS_PATH.encode():
            return 404, b"not found: only GET /metrics is served\n"
        if method != b"GET":
            return 405, b"method not allowed: only GET /metrics is served\n"
        try:
            return 200, self._render()
        except Exception:
            logger.warning("metrics exposition failed", exc_info=True)
            return 500, b"metrics exposition failed\n"
