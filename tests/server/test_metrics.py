"""Unit tests of vaed.metrics.ServerMetrics, including its HTTP endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vaed.metrics import LATENCY_BUCKETS, QUEUED_CHUNKS_METRIC, ServerMetrics


def _value(m: ServerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels or None)


def test_counters_histograms_gauges() -> None:
    m = ServerMetrics("cpu")
    m.request_finished("Decode", "OK", 0.3)
    m.request_finished("Decode", "OK", 1.2)
    m.request_finished("DecodeStream", "INVALID_ARGUMENT", 0.002)
    m.observe_first_frame("Decode", 0.12)
    m.frames_decoded(frames=81, latent_frames=21)
    m.frames_decoded(frames=4, latent_frames=1)
    m.session_opened()
    m.session_opened()
    m.session_closed()
    m.set_queued_chunks(7)

    assert _value(m, "vaed_requests_total", method="Decode", code="OK") == 2
    assert _value(m, "vaed_requests_total", method="DecodeStream", code="INVALID_ARGUMENT") == 1
    assert _value(m, "vaed_request_duration_seconds_count", method="Decode") == 2
    assert _value(m, "vaed_request_duration_seconds_sum", method="Decode") == pytest.approx(1.5)
    # 0.3 s falls in the 0.5 s bucket, 1.2 s only from 2.5 s up.
    assert _value(m, "vaed_request_duration_seconds_bucket", method="Decode", le="0.5") == 1
    assert _value(m, "vaed_request_duration_seconds_bucket", method="Decode", le="2.5") == 2
    assert _value(m, "vaed_time_to_first_frame_seconds_count", method="Decode") == 1
    assert _value(m, "vaed_frames_decoded_total") == 85
    assert _value(m, "vaed_latent_frames_decoded_total") == 22
    assert _value(m, "vaed_active_sessions") == 1
    assert _value(m, QUEUED_CHUNKS_METRIC) == 7
    # CPU device: GPU gauges present and zero, not absent.
    assert _value(m, "vaed_gpu_memory_allocated_bytes", device="cpu") == 0
    assert _value(m, "vaed_gpu_memory_peak_bytes", device="cpu") == 0


def test_buckets_cover_10ms_to_60s() -> None:
    assert LATENCY_BUCKETS[0] == pytest.approx(0.01)
    assert LATENCY_BUCKETS[-1] == pytest.approx(60.0)
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


def test_registries_are_independent() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.frames_decoded(5, 2)
    assert _value(a, "vaed_frames_decoded_total") == 5
    assert _value(b, "vaed_frames_decoded_total") == 0


def test_cuda_device_without_gpu_reads_zero() -> None:
    # On a CPU-only machine a cuda device string must not break scraping.
    m = ServerMetrics("cuda:0")
    value = _value(m, "vaed_gpu_memory_allocated_bytes", device="cuda:0")
    assert value is not None and value >= 0


def test_http_endpoint_scrape() -> None:
    m = ServerMetrics("cpu")
    port = m.start_http_server(0, host="127.0.0.1")
    try:
        assert port > 0
        m.request_finished("GetModelInfo", "OK", 0.001)
        m.set_queued_chunks(3)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            body = resp.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        expected = {
            "vaed_requests", "vaed_request_duration_seconds", "vaed_time_to_first_frame_seconds",
            "vaed_frames_decoded", "vaed_latent_frames_decoded", "vaed_active_sessions",
            "vaed_queued_chunks", "vaed_gpu_memory_allocated_bytes", "vaed_gpu_memory_peak_bytes",
        }
        assert expected <= set(families)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families.values() for s in f.samples
        }
        assert samples[("vaed_requests_total", (("code", "OK"), ("method", "GetModelInfo")))] == 1
        assert samples[("vaed_queued_chunks", ())] == 3
        # Nothing from the process-global default registry leaks in.
        assert not any(name.startswith("python_gc") for name in families)
        with pytest.raises(RuntimeError):
            m.start_http_server(0, host="127.0.0.1")
    finally:
        m.stop_http_server()
    m.stop_http_server()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_two_servers_in_one_process() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    pa = a.start_http_server(0, host="127.0.0.1")
    pb = b.start_http_server(0, host="127.0.0.1")
    try:
        assert pa != pb
        a.set_queued_chunks(1)
        b.set_queued_chunks(2)
        for port, want in ((pa, "1.0"), (pb, "2.0")):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert f"vaed_queued_chunks {want}" in r.read().decode()
    finally:
        a.stop_http_server()
        b.stop_http_server()
