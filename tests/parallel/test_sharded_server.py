"""`--parallel spatial` through the real wire: a CPU server whose one worker drives a 2-rank
gloo group, reached with the real client. Sharded and one-GPU sessions alternate on it; a
DecodeStream session fed in chunks is sharded too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from harness import RunningServer, make_config, serve_in_thread
from vaed_client import VaeClient

from vaed.engine import DecodeEngine
from vaed.parallel import ShardedEngine
from vaed.engine import OutputSpec

TOL = 2e-5
MODEL = "random:wan2.1-tiny"


@pytest.fixture(scope="module")
def sharded_server() -> Iterator[RunningServer]:
    config = make_config(MODEL, devices=("cpu", "cpu"), parallel="spatial", spatial_axis="auto", spatial_min_pixels=0)
    with serve_in_thread(config) as running:
        yield running


@pytest.fixture(scope="module")
def one_gpu() -> DecodeEngine:
    return DecodeEngine.load(MODEL, device="cpu", dtype="float32")


def _want(engine: DecodeEngine, latents: torch.Tensor) -> torch.Tensor:
    return engine.decode_video(latents, OutputSpec(rgb8=False, raw_dtype=None, raw_latents=False))


def test_sharded_and_one_gpu_requests_alternate_through_the_wire(
    sharded_server: RunningServer, one_gpu: DecodeEngine
) -> None:
    engine = sharded_server.server.pool.workers[0].engine
    assert isinstance(engine, ShardedEngine)
    before = (engine.sharded_frames, engine.local_frames)
    g = torch.Generator().manual_seed(0)
    large = torch.randn(1, 4, 3, 4, 6, generator=g)  # sharded: width (3, 3)
    small = torch.randn(1, 4, 3, 1, 1, generator=g)  # too small for 2 ranks: GPU 0 alone
    with VaeClient(sharded_server.target) as vae:
        for _ in range(2):
            got = vae.decode(large, format="raw")
            assert got.shape == (1, 3, 9, 32, 48)
            assert (got - _want(one_gpu, large)).abs().max().item() <= TOL
            assert torch.equal(vae.decode(small, format="raw"), _want(one_gpu, small))
    # the large requests went through the group, the small ones stayed on GPU 0
    assert (engine.sharded_frames - before[0], engine.local_frames - before[1]) == (6, 6)


def test_stream_session_is_sharded_and_streams_per_chunk(
    sharded_server: RunningServer, one_gpu: DecodeEngine
) -> None:
    latents = torch.randn(1, 4, 4, 5, 3, generator=torch.Generator().manual_seed(1))  # height (3, 2)
    with VaeClient(sharded_server.target) as vae:
        firsts = [chunk.first_frame for chunk in vae.stream(latents, format="raw")]
        with vae.session(format="raw") as session:
            session.push(latents[:, :, :2])
            session.push(latents[:, :, 2:3])
            session.push(latents[:, :, 3:])
            video = session.collect()
    assert firsts == [0, 1, 5, 9]  # one group per latent frame, as on one GPU
    assert (video - _want(one_gpu, latents)).abs().max().item() <= TOL


def test_a_broken_group_is_reported_by_model_info_and_health(
    sharded_server: RunningServer, one_gpu: DecodeEngine
) -> None:
    """Last test of the module (it breaks the group): while whole, ModelInfo says spatial and the
    group's health entry is SERVING; once a follower died, ModelInfo says "off" with the one
    device that still decodes, the group's entry is NOT_SERVING, and the server still serves."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def status(service: str) -> int:
        with grpc.insecure_channel(sharded_server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    engine = sharded_server.server.pool.workers[0].engine
    assert isinstance(engine, ShardedEngine)
    large = torch.randn(1, 4, 2, 4, 6, generator=torch.Generator().manual_seed(2))
    with VaeClient(sharded_server.target) as vae:
        info = vae.model_info()
        assert info.parallel.startswith("spatial x2") and info.devices == ["cpu", "cpu"]
        assert status("vaed.v1.VaeDecoder/spatial") == serving
        victim = engine._launched.procs[0]
        victim.kill()
        victim.join(10)
        try:  # fails on the group (UNAVAILABLE), or succeeds on one device if the client retried
            vae.decode(large, format="raw")
        except Exception:  # noqa: BLE001
            pass
        assert not engine.healthy
        deadline = time.monotonic() + 30
        while status("vaed.v1.VaeDecoder/spatial") != not_serving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status("vaed.v1.VaeDecoder/spatial") == not_serving
        assert status("") == serving and status("vaed.v1.VaeDecoder") == serving
        info = vae.model_info()
        assert info.parallel == "off" and info.devices == ["cpu"]
        assert torch.equal(vae.decode(large, format="raw"), _want(one_gpu, large))
