"""Halo exchange, all-gather and gather on a real 3-process gloo group (torch only, no model).

Rank r holds rows [offset_r, offset_r + size_r) of one known tensor, so every
result has an exact expected value: neighbour rows inside, zero rows at the
outer edges of the first and last shard, the whole tensor after a gather.
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3
SIZES = (2, 3, 1)  # uneven on purpose, and a one-row shard (halo == shard)


def _full(dim: int, ndim: int) -> torch.Tensor:
    shape = [2, 3, 2, 5, 4] if ndim == 5 else [2, 3, 5, 4]
    shape[dim] = sum(SIZES)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1


def _expected_halo(full: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    start, size = sum(SIZES[:rank]), SIZES[rank]
    zero = torch.zeros_like(full.narrow(dim, 0, 1))
    lo = full.narrow(dim, start - 1, 1) if rank > 0 else zero
    hi = full.narrow(dim, start + size, 1) if rank < WORLD - 1 else zero
    return torch.cat([lo, full.narrow(dim, start, size), hi], dim)


def _worker(rank: int, init: str, results: Any) -> None:
    from vaed.parallel.comm import all_gather_along, exchange_halo, fill_halo, gather_along, memory_format_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {}
    try:
        for ndim, dim in ((5, -2), (5, -1), (4, -2), (4, -1)):
            full = _full(dim, ndim)
            mine = full.narrow(dim, sum(SIZES[:rank]), SIZES[rank])
            if ndim == 5 and dim == -1:
                mine = mine.contiguous(memory_format=torch.channels_last_3d)
            h = exchange_halo(mine, dim, None, 1)
            out[f"halo{ndim}{dim}"] = torch.equal(h, _expected_halo(full, dim, rank))
            if ndim == 5 and dim == -1:
                out["halo_keeps_channels_last"] = h.is_contiguous(memory_format=torch.channels_last_3d)
            # in place over zero rows (the conv-input builder's padding), in mine's layout
            pad = [0, 0] * (-dim - 1) + [1, 1]
            padded = torch.nn.functional.pad(mine, pad).contiguous(memory_format=memory_format_of(mine))
            filled = fill_halo(padded, dim, None, 1)
            out[f"fill{ndim}{dim}"] = filled is padded and torch.equal(filled, _expected_halo(full, dim, rank))
            out[f"allgather{ndim}{dim}"] = torch.equal(all_gather_along(mine, dim, SIZES, None), full)
            g = gather_along(mine, dim, SIZES, None)
            out[f"gather{ndim}{dim}"] = torch.equal(g, full) if rank == 0 else g is None
        try:
            exchange_halo(torch.zeros(1, 1, 1, 0, 3), -2, None, 1)
            out["empty_refused"] = False
        except ValueError:
            out["empty_refused"] = True
        try:
            fill_halo(torch.zeros(1, 1, 1, 2, 3), -2, None, 1)  # two zero rows, no interior
            out["fill_empty_refused"] = False
        except ValueError:
            out["fill_empty_refused"] = True
    except Exception:  # noqa: BLE001 (reported to the test process)
        out["error"] = traceback.format_exc()
    finally:
        results.put((rank, out))
        dist.destroy_process_group()


def test_halo_gather_and_all_gather_are_exact_on_three_ranks(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_worker, args=(f"file://{tmp_path / 'rdv'}", results), nprocs=WORLD, join=True)
    got = dict(results.get() for _ in range(WORLD))
    for rank in range(WORLD):
        assert "error" not in got[rank], got[rank]["error"]
        failed = [k for k, ok in got[rank].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
        assert len(got[rank]) == 19


@pytest.mark.parametrize("bad", [(2, 3), (2, 3, 2)])
def test_sizes_must_fit_the_group(bad: tuple[int, ...]) -> None:
    # checked before any communication: a single-process gloo group suffices
    from vaed.parallel.comm import all_gather_along

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            all_gather_along(torch.zeros(1, 1, 1, 2, 2), -2, bad, None)
    finally:
        dist.destroy_process_group()
