"""The start-up heap is frozen out of the cyclic GC while the server is SERVING."""

from __future__ import annotations

import gc
import logging

import pytest

from vaed.heap import freeze_startup_heap

from harness import make_config, serve_in_thread


def test_freeze_moves_live_objects_out_of_collection() -> None:
    gc.unfreeze()
    try:
        kept = [[i] for i in range(1000)]  # tracked, alive
        assert any(o is kept[0] for o in gc.get_objects())
        frozen, seconds = freeze_startup_heap()
        assert frozen >= len(kept) and seconds >= 0
        # frozen: in no generation the collector scans (other threads may freeze or free
        # objects meanwhile, so the count itself is not compared)
        assert not any(o is kept[0] or o is kept[-1] for o in gc.get_objects())
        made_later = [0]
        assert any(o is made_later for o in gc.get_objects())
        # garbage made afterwards is still collected
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


def test_server_freezes_its_heap_when_serving(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vaed.server")
    gc.unfreeze()
    try:
        with serve_in_thread(make_config()):
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0  # stopped: collectable again
        assert any("out of the cyclic GC" in r.getMessage() for r in caplog.records)
    finally:
        gc.unfreeze()
