"""Prometheus metrics for the vaed server.

Every ``ServerMetrics`` owns its own ``CollectorRegistry``: tests start
several in-process servers, and the global default registry would reject the
second set of identically named metrics.

Exported names (all prefixed ``vaed_``):

* ``vaed_requests_total{method,code}``            counter
* ``vaed_request_duration_seconds{method}``       histogram
* ``vaed_time_to_first_frame_seconds{method}``    histogram
* ``vaed_frames_decoded_total``                   counter (output frames)
* ``vaed_latent_frames_decoded_total``            counter (input latent frames)
* ``vaed_active_sessions``                        gauge
* ``vaed_queued_chunks``                          gauge (the HPA's scaling signal)
* ``vaed_gpu_memory_allocated_bytes{device}``     gauge, read at scrape time
* ``vaed_gpu_memory_peak_bytes{device}``          gauge, read at scrape time
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Name of the queue-depth gauge; k8s/ (HPA, prometheus-adapter rule) and the
# docs refer to it, so it lives in one place.
QUEUED_CHUNKS_METRIC = "vaed_queued_chunks"

# 10 ms .. 60 s. A 480x832 Wan2.1 chunk decodes in ~0.1 s on an H200, a whole
# 81-frame 720p request in ~3.5 s, a CPU decode or a long DecodeStream session
# takes tens of seconds; past 60 s lands in +Inf.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)


class _GpuMemoryCollector(Collector):
    """Reads torch's CUDA allocator counters when Prometheus scrapes.

    Reading at scrape time (instead of setting a gauge after each chunk) costs
    nothing on the decode path and is always current. On a CPU device both
    gauges report 0 so dashboards and alerts see a value, not a gap.
    """

    def __init__(self, device: str | None) -> None:
        self._device = device or "cpu"

    def _read(self) -> tuple[float, float]:
        if not self._device.startswith("cuda"):
            return 0.0, 0.0
        try:
            import torch  # imported lazily: the metrics module must not pull torch in at import

            if not torch.cuda.is_available():
                return 0.0, 0.0
            return (
                float(torch.cuda.memory_allocated(self._device)),
                float(torch.cuda.max_memory_allocated(self._device)),
            )
        except Exception:  # a scrape must never raise into the HTTP thread
            logger.debug("could not read CUDA memory for %s", self._device, exc_info=True)
            return 0.0, 0.0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        allocated, peak = self._read()
        g_alloc = GaugeMetricFamily(
            "vaed_gpu_memory_allocated_bytes",
            "Bytes held by tensors in torch's CUDA caching allocator.",
            labels=["device"],
        )
        g_alloc.add_metric([self._device], allocated)
        yield g_alloc
        g_peak = GaugeMetricFamily(
            "vaed_gpu_memory_peak_bytes",
            "Peak bytes held by tensors in torch's CUDA caching allocator since start.",
            labels=["device"],
        )
        g_peak.add_metric([self._device], peak)
        yield g_peak

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Describing without reading CUDA keeps registration cheap and safe
        # before the worker thread has initialised the device.
        yield GaugeMetricFamily("vaed_gpu_memory_allocated_bytes", "", labels=["device"])
        yield GaugeMetricFamily("vaed_gpu_memory_peak_bytes", "", labels=["device"])


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per scrape, daemon threads so shutdown never blocks."""

    daemon_threads = True


class _SilentHandler(WSGIRequestHandler):
    """Keeps one access-log line per scrape (every 15 s) out of stderr."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        return


class ServerMetrics:
    """The server's metrics, with a private registry and optional HTTP endpoint."""

    def __init__(self, device: str | None = None) -> None:
        self.device = device or "cpu"
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "vaed_requests", "Finished RPCs by method and gRPC status code.",
            ["method", "code"], registry=r,
        )
        self._duration = Histogram(
            "vaed_request_duration_seconds",
            "Wall time of an RPC from start to its last message.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._ttff = Histogram(
            "vaed_time_to_first_frame_seconds",
            "Time from the start of an RPC to its first FrameChunk.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._frames = Counter(
            "vaed_frames_decoded", "Output video frames decoded.", registry=r,
        )
        self._latent_frames = Counter(
            "vaed_latent_frames_decoded", "Input latent frames decoded.", registry=r,
        )
        self._sessions = Gauge(
            "vaed_active_sessions", "Decode and DecodeStream calls in progress.", registry=r,
        )
        self._queued = Gauge(
            QUEUED_CHUNKS_METRIC,
            "Latent chunks waiting for the GPU worker (the autoscaling signal).",
            registry=r,
        )
        r.register(_GpuMemoryCollector(self.device))
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- recording -------------------------------------------------------

    def request_finished(self, method: str, code: str, seconds: float) -> None:
        """One finished RPC; ``code`` is a grpc.StatusCode name such as "OK"."""
        self._requests.labels(method=method, code=code).inc()
        self._duration.labels(method=method).observe(max(0.0, seconds))

    def observe_first_frame(self, method: str, seconds: float) -> None:
        self._ttff.labels(method=method).observe(max(0.0, seconds))

    def frames_decoded(self, frames: int, latent_frames: int) -> None:
        self._frames.inc(frames)
        self._latent_frames.inc(latent_frames)

    def session_opened(self) -> None:
        self._sessions.inc()

    def session_closed(self) -> None:
        self._sessions.dec()

    def set_queued_chunks(self, n: int) -> None:
        self._queued.set(n)

    # -- exposition ------------------------------------------------------

    def start_http_server(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics from a daemon thread; returns the bound port (0 = ephemeral)."""
        if self._httpd is not None:
            raise RuntimeError("metrics HTTP server already running")

        class _Server(_ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        httpd = make_server(
            host.strip("[]"), port, make_wsgi_app(self.registry),
            server_class=_Server, handler_class=_SilentHandler,
        )
        thread = threading.Thread(
            target=httpd.serve_forever, name="vaed-metrics-http", daemon=True
        )
        thread.start()
        self._httpd, self._thread = httpd, thread
        bound = int(httpd.server_address[1])
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop_http_server(self) -> None:
        """Stop the endpoint; safe to call when it never started."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
