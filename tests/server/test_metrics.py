"""Unit tests of vaed.metrics.ServerMetrics: recording, bounded labels, scrape-time load gauges.

The HTTP endpoint has its own module, test_metrics_http.py.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vaed.metrics import PENDING_LATENT_FRAMES_METRIC, DeviceLoad, ServerMetrics


def _value(m: ServerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels or None)


@dataclass
class FakeLoad:
    """A LoadSource whose answer the test changes between scrapes."""

    loads: list[DeviceLoad] = field(default_factory=list)
    calls: int = 0

    def device_loads(self) -> list[DeviceLoad]:
        self.calls += 1
        return list(self.loads)


# ---------------------------------------------------------------- events


def test_finished_requests_counted_and_timed() -> None:
    m = ServerMetrics()
    m.request_finished("Decode", "OK", 0.3)
    m.request_finished("Decode", "OK", 1.2)
    m.request_finished("DecodeStream", "INVALID_ARGUMENT", 0.002)
    m.request_finished("Decode", "OK", -1.0)  # a clock step back is clamped to 0, not a negative sum

    assert _value(m, "vaed_requests_total", method="Decode", code="OK") == 3
    assert _value(m, "vaed_requests_total", method="DecodeStream", code="INVALID_ARGUMENT") == 1
    assert _value(m, "vaed_request_duration_seconds_count", method="Decode") == 3
    assert _value(m, "vaed_request_duration_seconds_sum", method="Decode") == pytest.approx(1.5)
    # 0 s and 0.3 s fall in the 0.5 s bucket, 1.2 s only from 2.5 s up.
    assert _value(m, "vaed_request_duration_seconds_bucket", method="Decode", le="0.5") == 2
    assert _value(m, "vaed_request_duration_seconds_bucket", method="Decode", le="1.0") == 2
    assert _value(m, "vaed_request_duration_seconds_bucket", method="Decode", le="2.5") == 3


def test_slow_calls_land_in_inf_bucket_only() -> None:
    m = ServerMetrics()
    m.request_finished("DecodeStream", "OK", 75.0)  # a long session: past the largest bucket
    assert _value(m, "vaed_request_duration_seconds_bucket", method="DecodeStream", le="60.0") == 0
    assert _value(m, "vaed_request_duration_seconds_bucket", method="DecodeStream", le="+Inf") == 1


def test_refused_requests_counted_but_not_timed() -> None:
    m = ServerMetrics()
    m.request_refused("Decode", "UNAUTHENTICATED")
    m.request_refused("DecodeStream", "RESOURCE_EXHAUSTED")
    m.request_refused("DecodeStream", "RESOURCE_EXHAUSTED")
    assert _value(m, "vaed_requests_total", method="Decode", code="UNAUTHENTICATED") == 1
    assert _value(m, "vaed_requests_total", method="DecodeStream", code="RESOURCE_EXHAUSTED") == 2
    # Instant refusals must not drag latency quantiles towards zero.
    assert _value(m, "vaed_request_duration_seconds_count", method="Decode") is None
    assert _value(m, "vaed_request_duration_seconds_count", method="DecodeStream") is None


def test_first_frame_and_frame_counters() -> None:
    m = ServerMetrics()
    m.observe_first_frame("Decode", 0.12)
    m.frames_decoded(frames=81, latent_frames=21)
    m.frames_decoded(frames=4, latent_frames=1)
    assert _value(m, "vaed_time_to_first_frame_seconds_count", method="Decode") == 1
    assert _value(m, "vaed_time_to_first_frame_seconds_bucket", method="Decode", le="0.1") == 0
    assert _value(m, "vaed_time_to_first_frame_seconds_bucket", method="Decode", le="0.25") == 1
    assert _value(m, "vaed_frames_decoded_total") == 85
    assert _value(m, "vaed_latent_frames_decoded_total") == 22


def test_method_and_code_labels_are_bounded() -> None:
    m = ServerMetrics()
    # Full paths are accepted and shortened; made-up names and codes collapse.
    m.request_refused("/vaed.v1.VaeDecoder/GetModelInfo", "UNAUTHENTICATED")
    for i in range(50):
        m.request_refused(f"/probe.Service/Method{i}", "UNAUTHENTICATED")
    m.request_finished("Decode", "NOT_A_CODE", 0.1)
    assert _value(m, "vaed_requests_total", method="GetModelInfo", code="UNAUTHENTICATED") == 1
    assert _value(m, "vaed_requests_total", method="other", code="UNAUTHENTICATED") == 50
    assert _value(m, "vaed_requests_total", method="Decode", code="UNKNOWN") == 1
    methods = {
        s.labels["method"]
        for f in text_string_to_metric_families(m.exposition().decode())
        for s in f.samples if s.name == "vaed_requests_total"
    }
    assert methods == {"GetModelInfo", "other", "Decode"}


def test_registries_are_independent() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.frames_decoded(5, 2)
    assert _value(a, "vaed_frames_decoded_total") == 5
    assert _value(b, "vaed_frames_decoded_total") == 0


# ---------------------------------------------------------------- scrape-time load


def test_load_gauges_are_read_at_every_scrape() -> None:
    load = FakeLoad([DeviceLoad("cpu", True, 2, 19)])
    m = ServerMetrics(load)
    calls_after_init = load.calls  # registration must not read the load
    assert _value(m, "vaed_active_sessions", device="cpu") == 2
    assert _value(m, PENDING_LATENT_FRAMES_METRIC, device="cpu") == 19
    assert _value(m, "vaed_device_healthy", device="cpu") == 1
    # The next scrape sees the new state, with nothing pushed in between.
    load.loads = [DeviceLoad("cpu", False, 0, 0)]
    assert _value(m, "vaed_active_sessions", device="cpu") == 0
    assert _value(m, PENDING_LATENT_FRAMES_METRIC, device="cpu") == 0
    assert _value(m, "vaed_device_healthy", device="cpu") == 0
    assert calls_after_init == 0 and load.calls > 0


def test_one_series_per_device() -> None:
    load = FakeLoad([DeviceLoad("cuda:0", True, 3, 40), DeviceLoad("cuda:1", False, 1, 5)])
    m = ServerMetrics(load)
    body = m.exposition().decode()
    pending = {
        s.labels["device"]: s.value
        for f in text_string_to_metric_families(body) if f.name == PENDING_LATENT_FRAMES_METRIC
        for s in f.samples
    }
    assert pending == {"cuda:0": 40, "cuda:1": 5}
    assert _value(m, "vaed_device_healthy", device="cuda:1") == 0


def test_no_load_source_means_no_gauge_samples() -> None:
    m = ServerMetrics()
    assert _value(m, PENDING_LATENT_FRAMES_METRIC, device="cpu") is None
    names = {f.name for f in text_string_to_metric_families(m.exposition().decode())}
    assert PENDING_LATENT_FRAMES_METRIC in names  # described (HELP/TYPE), just no samples
    assert "vaed_queued_chunks" not in names  # the old, misleading signal is gone


def test_failing_load_source_does_not_fail_the_scrape() -> None:
    class Broken:
        def device_loads(self) -> list[DeviceLoad]:
            raise RuntimeError("worker pool gone")

    m = ServerMetrics(Broken())
    m.request_finished("Decode", "OK", 0.1)
    body = m.exposition().decode()  # must not raise
    assert 'vaed_requests_total{code="OK",method="Decode"} 1.0' in body
    assert _value(m, PENDING_LATENT_FRAMES_METRIC, device="cpu") is None


def test_gpu_memory_reads_zero_on_cpu_and_without_cuda() -> None:
    # This machine has no initialised CUDA: cuda devices read exactly 0; a CPU device
    # reports 0 too, so dashboards and alerts see a value, not a gap.
    load = FakeLoad([DeviceLoad("cpu", True, 0, 0), DeviceLoad("cuda:0", True, 0, 0)])
    m = ServerMetrics(load)
    assert _value(m, "vaed_gpu_memory_allocated_bytes", device="cuda:0") == 0
    assert _value(m, "vaed_gpu_memory_peak_bytes", device="cuda:0") == 0
    assert _value(m, "vaed_gpu_memory_allocated_bytes", device="cpu") == 0
    assert _value(m, "vaed_gpu_memory_peak_bytes", device="cpu") == 0


def test_gpu_memory_read_from_torch_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def allocated(device: str) -> int:
        seen.append(device)
        return {"cuda:0": 1000, "cuda:1": 2000}[device]

    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        memory_allocated=allocated,
        max_memory_allocated=lambda device: {"cuda:0": 5000, "cuda:1": 7000}[device],
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    load = FakeLoad([DeviceLoad("cuda:0", True, 1, 4), DeviceLoad("cuda:1", True, 0, 0)])
    m = ServerMetrics(load)
    assert _value(m, "vaed_gpu_memory_allocated_bytes", device="cuda:0") == 1000
    assert _value(m, "vaed_gpu_memory_allocated_bytes", device="cuda:1") == 2000
    assert _value(m, "vaed_gpu_memory_peak_bytes", device="cuda:1") == 7000
    assert set(seen) == {"cuda:0", "cuda:1"}


def test_gpu_memory_not_read_before_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(device: str) -> int:
        raise AssertionError("must not touch the allocator (it would initialise CUDA on the scrape thread)")

    cuda = types.SimpleNamespace(is_initialized=lambda: False, memory_allocated=never, max_memory_allocated=never)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    m = ServerMetrics(FakeLoad([DeviceLoad("cuda:0", False, 0, 0)]))
    assert _value(m, "vaed_gpu_memory_allocated_bytes", device="cuda:0") == 0
