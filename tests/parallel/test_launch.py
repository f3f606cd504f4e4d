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
