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
* ``vaed_gpu_memory_allocated_bytes{device}``      gauge, scrape time (0 on a CPU device)
* ``vaed_gpu_memory_peak_bytes{device}``           gauge, scrape time (0 on a CPU device)
* ``vaed_log_records_dropped_total``               counter: log records the stalled log writer dropped
* ``vaed_startup_seconds``                         gauge: seconds from `vaed serve`'s start to SERVING
* ``vaed_startup_phase_seconds{phase,device}``     gauge: each start-up phase (``vaed.startup``);
  ``device`` is empty for the process's own phases (import, gc freeze)

Label values are bounded whatever callers pass: a method outside
``RPC_METHODS`` is counted as ``other`` and a code that is not a gRPC status
name as ``UNKNOWN``, so a client that calls made-up method names cannot grow
the registry (and the scrape) without bound.

The endpoint is a route (``add_metrics_route``) on the server's one aiohttp
application (``vaed.http.HttpServer``), served from the server's own asyncio
loop: an idle or half-sent request costs a socket, never a thread, and the
stack's limits (head size, head timeout, connection cap) apply. It answers
``GET /metrics`` only (404 elsewhere, 405 with ``Allow: GET`` for other
methods). A scrape renders the registry on the loop: 1.5 ms for 8 devices
(5 KB), the same loop that runs grpc.aio's handlers (decodes run on worker
threads, so a scrape is answered while they run).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .startup import Phase

logger = logging.getLogger(__name__)

# The autoscaling signal's name; k8s/ (HPA, prometheus-adapter rule) and the
# docs refer to it, so it lives in one place.
PENDING_LATENT_FRAMES_METRIC = "vaed_pending_latent_frames"

# The `method` label values; anything else is counted as OTHER_METHOD.
RPC_METHODS: tuple[str, ...] = ("GetModelInfo", "Decode", "DecodeStream", "Encode")
OTHER_METHOD = "other"

_STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)

# 10 ms .. 60 s. A 480x832 Wan2.1 chunk decodes in ~0.06 s on an H200, a whole
# 81-frame 720p request in ~3 s, a CPU decode or a long DecodeStream session
# takes tens of seconds; past 60 s lands in +Inf.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)

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


def cuda_memory(device: str) -> tuple[float, float]:
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
            allocated, peak = cuda_memory(d.device) if d.device.startswith("cuda") else (0.0, 0.0)
            families["allocated"].add_metric([d.device], allocated)
            families["peak"].add_metric([d.device], peak)
        yield from families.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only: registration must not call into the worker pool.
        yield from self._families().values()


# ------------------------------------------------------------------ metrics


class ServerMetrics:
    """The server's metrics, with a private registry (served by ``add_metrics_route``).

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
        # Set once, at SERVING: the label values are the start-up's phases (a handful, plus one per
        # warm-up shape and device), never a client's.
        self._startup = Gauge("vaed_startup_seconds", "Seconds from the start of vaed serve to SERVING.", registry=r)
        self._startup_phases = Gauge(
            "vaed_startup_phase_seconds", "Seconds each start-up phase took (device empty: the process's own).",
            ["phase", "device"], registry=r,
        )
        r.register(_LoadCollector(load))

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

    def started(self, phases: Iterable[Phase], total: float) -> None:
        """The server reached SERVING after `total` seconds, through `phases` (vaed.startup)."""
        self._startup.set(total)
        for p in phases:
            self._startup_phases.labels(phase=p.name, device=p.device).set(p.seconds)

    def frames_skipped(self, frames: int, latent_frames: int) -> None:
        """Frames a resumed call decoded for its causal cache only; their latent frames count as decoded."""
        self._skipped_frames.inc(frames)
        self._latent_frames.inc(latent_frames)

    # -- exposition ------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format 0.0.4 (what GET /metrics returns)."""
        return generate_latest(self.registry)


# ------------------------------------------------------------------ HTTP


def add_metrics_route(app: web.Application, metrics: ServerMetrics) -> None:
    """Answer ``GET /metrics`` on ``app`` with ``metrics``' exposition.

    Only GET: aiohttp would answer HEAD too (``allow_head``), and the endpoint
    serves one method. Other methods on the path get aiohttp's 405 with
    ``Allow: GET``, other paths its 404; neither reaches the registry.
    """

    async def scrape(request: web.Request) -> web.Response:
        try:
            body = metrics.exposition()
        except Exception:
            logger.warning("metrics exposition failed", exc_info=True)
            raise web.HTTPInternalServerError(text="metrics exposition failed\n") from None
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app.router.add_get(METRICS_PATH, scrape, allow_head=False)
