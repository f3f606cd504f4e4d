"""The device pool behind one port: least-loaded routing, workers that fail to
start or fault later leave rotation, and the server keeps serving on the rest.
Two CPU workers stand in for two GPUs (the same code path as `--gpu 0,1`)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from vaed.errors import NotReady
from vaed.server import engine_factory
from vaed_client import VaeClient, wire

from harness import make_config, serve_in_thread

Z = 4


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture()
def two_workers():
    with serve_in_thread(make_config(devices=("cpu", "cpu"))) as running:
        yield running


def test_model_info_reports_tiers_devices_and_parallel(two_workers):
    with VaeClient(two_workers.target) as client:
        info = client.model_info()
    assert info.precisions == ["lossless"]  # the fast tier needs CUDA
    assert info.devices == ["cpu", "cpu"]
    assert info.parallel == "off"


def test_every_worker_serves_the_seeds_weights(two_workers):
    """Each worker builds its own copy of a random model: built at once from torch's one global
    generator, their draws interleaved and each served weights of no seed (a call resumed from one
    worker to the other was refused: its identity differed)."""
    from vaed.models import build_random_vae, weights_digest

    want = weights_digest(build_random_vae("wan2.1-tiny"), "decoder")
    assert [w.engine.identity.weights for w in two_workers.server.pool.workers] == [want, want]
    with VaeClient(two_workers.target) as client:
        assert wire.identity_parts(client.model_info().decoder_identity)["weights"] == f"sha256:{want[:16]}"


def test_new_sessions_go_to_the_least_loaded_worker(two_workers):
    pool = two_workers.server.pool
    with VaeClient(two_workers.target) as client:
        sessions = [client.session() for _ in range(2)]
        try:
            for s in sessions:
                s.push(torch.randn(1, Z, 1, 5, 7))
                next(iter(s))  # admitted and decoding: it holds its worker
            assert [load.active_sessions for load in pool.device_loads()] == [1, 1]
        finally:
            for s in sessions:
                s.cancel()
    _wait_for(lambda: pool.active_sessions == 0)


def test_a_worker_that_fails_to_start_leaves_rotation():
    config = make_config(devices=("cpu", "cpu"))
    build = engine_factory(config)
    calls = []
    lock = threading.Lock()

    def flaky(device: str):
        with lock:
            calls.append(device)
            second = len(calls) == 2
        if second:
            raise RuntimeError("device lost while loading")
        return build(device)

    with serve_in_thread(config, build_engine=flaky) as running:
        pool = running.server.pool
        assert [w.healthy for w in pool.workers].count(True) == 1
        with VaeClient(running.target) as client:
            assert client.model_info().devices == ["cpu"]
            for _ in range(3):
                assert client.decode(torch.randn(1, Z, 2, 5, 7)).shape[1] == 5
        assert [load.healthy for load in pool.device_loads()].count(False) == 1


def _raw_decode_error(target: str, latents: torch.Tensor) -> grpc.RpcError:
    """A Decode on a plain channel (no retry policy, unlike VaeClient's): the server's own status."""
    with grpc.insecure_channel(target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Decode(wire.pb.DecodeRequest(latents=wire.to_message(latents)), timeout=60))
    return info.value


def test_a_device_fault_takes_its_worker_out_and_the_server_keeps_serving(two_workers, monkeypatch):
    pool = two_workers.server.pool
    faulty = pool.workers[0]

    def fault(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(faulty.engine, "decode_frame", fault)
    # UNAVAILABLE, not INTERNAL: the request was fine, so a client may retry it elsewhere
    error = _raw_decode_error(two_workers.target, torch.randn(1, Z, 2, 5, 7))  # the first session goes to worker 0
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "device cpu failed; retry" in error.details()
    assert not faulty.healthy
    with pytest.raises(NotReady, match="out of rotation"):  # a session routed to it just before it left
        faulty.attach(None)
    with VaeClient(two_workers.target) as client:
        for _ in range(3):
            assert client.decode(torch.randn(1, Z, 2, 5, 7)).shape[1] == 5
        assert client.model_info().devices == ["cpu"]
    loads = pool.device_loads()
    assert [load.healthy for load in loads] == [False, True]


def test_each_device_has_a_health_entry_that_follows_its_worker(two_workers, monkeypatch):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    pool = two_workers.server.pool
    pool.workers[1].device = "cpu:1"  # two distinct names for the two CPU stand-ins
    faulty = pool.workers[0]

    def status(service: str) -> int:
        with grpc.insecure_channel(two_workers.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    def fault(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(faulty.engine, "decode_frame", fault)
    with VaeClient(two_workers.target) as client:
        # worker 0 fails it with UNAVAILABLE, which the client's channel retries on worker 1
        assert client.decode(torch.randn(1, Z, 2, 5, 7)).shape[1] == 5
    assert not faulty.healthy
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    _wait_for(lambda: status("vaed.v1.VaeDecoder/cpu") == not_serving)
    assert status("vaed.v1.VaeDecoder/cpu:1") == serving
    assert status("") == serving and status("vaed.v1.VaeDecoder") == serving
