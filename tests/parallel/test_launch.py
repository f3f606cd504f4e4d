"""Group start-up: refusals before anything starts, and a follower that cannot load its model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vaed.engine import DecodeEngine
from vaed.parallel import GroupConfig, ShardGroupError, start_sharded_engine


def test_config_resolves_backend_and_world() -> None:
    assert GroupConfig("random:wan2.1", ("cuda:0", "cuda:1")).resolved_backend() == "nccl"
    assert GroupConfig("random:wan2.1", ("cpu", "cpu", "cpu")).resolved_backend() == "gloo"
    assert GroupConfig("random:wan2.1", ("cpu", "cpu"), backend="gloo").world == 2


def test_a_group_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 devices"):
        start_sharded_engine(GroupConfig("random:wan2.1-tiny", ("cpu",)))


@pytest.mark.slow
def test_a_follower_that_cannot_load_fails_start_up_fast() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = DecodeEngine.load("random:wan2.1-tiny", device="cpu", dtype="float32")
        # rank 0 has its engine; the follower is told to load a model that does not exist
        cfg = GroupConfig("random:no-such-model", ("cpu", "cpu"), dtype="float32", timeout_s=60)
        with pytest.raises(ShardGroupError, match="did not start"):
            start_sharded_engine(cfg, base=base)
        assert not dist.is_initialized()  # nothing left behind: a later start can succeed
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_stopped_group_exits_cleanly() -> None:
    """close() stops every follower with exit code 0 (a follower still alive after the join
    timeout is terminated, exit code -15)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = start_sharded_engine(GroupConfig("random:wan2.1-tiny", ("cpu", "cpu"), dtype="float32", timeout_s=60))
        procs = list(engine._launched.procs)
        engine.close()
        assert [p.exitcode for p in procs] == [0]
        assert not dist.is_initialized()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_an_idle_group_outlives_its_control_timeout_through_the_worker_keepalive() -> None:
    """Followers leave a group that sends no step for its control timeout (here 5 s). Rank 0's
    device worker, idle, keeps it alive: after three timeouts the follower is still in the group.
    The same group without keepalives then loses its follower within its timeout."""
    import time

    from vaed.worker import DeviceWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    timeout = 5.0
    try:
        cfg = GroupConfig("random:wan2.1-tiny", ("cpu", "cpu"), dtype="float32", timeout_s=60, control_timeout_s=timeout)
        engine = start_sharded_engine(cfg)
        follower = engine._launched.procs[0]
        assert engine.keepalive_interval == timeout / 4
        worker = DeviceWorker("cpu", lambda device: engine, warmup=False)
        worker.start()
        try:
            assert worker.wait_ready(60) and worker.healthy
            time.sleep(3 * timeout)  # idle: no session, no step
            assert follower.exitcode is None, "the follower left an idle group"
            assert engine.healthy and engine.describe().startswith("spatial x2")
            # control: no more keepalives -- the follower gives up after its timeout
            engine.keepalive_interval = float("inf")
            follower.join(4 * timeout)
            assert follower.exitcode == 1
        finally:
            worker.stop()  # closes the engine
        assert not dist.is_initialized()
    finally:
        torch.set_num_threads(threads)
