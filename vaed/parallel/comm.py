"""The three communication patterns of a sharded decode, on torch.distributed only.

- `fill_halo`: before a causal 3-D conv, the conv-input builder has already
  written the shard with `halo` zero rows (or cols) on both sides of the split
  axis -- in the one pass it makes anyway -- and each rank sends its first/last
  `halo` interior rows to its neighbours and writes theirs over the zeros at
  its interior edges (P2P through `batch_isend_irecv`: NCCL between GPUs, gloo
  on CPU). The outer edges keep their zeros, which is exactly the conv's zero
  padding. Only edge rows move: no extra pass over the feature map.
- `exchange_edges`: just the neighbours' rows (the 3x3 image conv after each
  upsample recomputes its edge output rows from thin strips with them);
  `exchange_halo` builds the whole haloed tensor with one `cat` (small inputs).
- `all_gather_along`: the mid-block attention attends over the whole frame, so
  its input is gathered (shards padded to the largest, then trimmed: uneven
  splits) and every rank computes the same full attention.
- `gather_along`: finished frames go to the group's rank 0 (uint8 RGB8 is 2-4x
  fewer bytes than the decoder's bf16/fp32 output, so frames are gathered after
  postprocess).

Send buffers are made dense (`.contiguous()`): both backends refuse strided
tensors, and a halo row of a [B, C, T, H, W] tensor is strided along W or H.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def memory_format_of(x: torch.Tensor) -> torch.memory_format:
    """channels_last(_3d) when x is dense in it (and not also plain contiguous), else contiguous."""
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


_ZEROS: dict[tuple[Any, ...], torch.Tensor] = {}
_ZEROS_MAX = 256  # distinct edge shapes kept (a decode uses ~20: one per level, dtype and T)


def _zero_edge(like: torch.Tensor) -> torch.Tensor:
    """A read-only zero block shaped like an edge slice, reused across calls: the outer edges
    of the first and last shard then cost no launch (every rank of a 2-GPU group has one)."""
    key = (tuple(like.shape), like.dtype, like.device)
    z = _ZEROS.get(key)
    if z is None:
        if len(_ZEROS) >= _ZEROS_MAX:
            _ZEROS.clear()
        z = _ZEROS[key] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return z


def group_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _swap_edges(
    sends: Sequence[tuple[int, torch.Tensor]], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Send each (peer rank, edge) and receive a same-shaped edge from that peer, in one group."""
    ops: list[dist.P2POp] = []
    received: list[torch.Tensor] = []
    for peer_rank, edge in sends:
        send = edge.contiguous()  # gloo (and NCCL) take dense row-major buffers
        recv = torch.empty_like(send)
        peer = _global(group, peer_rank)
        ops += [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
        received.append(recv)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return received


def exchange_edges(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, halo: int = 1
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The neighbours' `halo` boundary rows next to x along `dim`: (rows before x, rows after x),
    None at the group's outer edges. One grouped P2P; x's own edge rows go the other way."""
    n = x.shape[dim]
    if n < halo:
        raise ValueError(f"shard has {n} rows along dim {dim}, fewer than the halo {halo}")
    rank, world = group_rank_world(group)
    sides = [(rank - 1, x.narrow(dim, 0, halo)), (rank + 1, x.narrow(dim, n - halo, halo))]
    received = iter(_swap_edges([(p, edge) for p, edge in sides if 0 <= p < world], group))
    lo, hi = (next(received) if 0 <= p < world else None for p, _ in sides)
    return lo, hi


def fill_halo(padded: torch.Tensor, dim: int, group: dist.ProcessGroup | None, halo: int = 1) -> torch.Tensor:
    """Write the neighbours' boundary rows into `padded`'s zero halo rows, in place.

    `padded` holds the shard with `halo` rows on both ends of `dim` (zeros there,
    e.g. the causal-input builder's zero padding). Afterwards it equals
    `exchange_halo(interior)`: interior edges carry the neighbours' rows, the
    group's outer edges stay zero. Launches: two edge copies out, one grouped
    P2P, two edge copies in.
    """
    if halo < 1:
        return padded
    n = padded.shape[dim] - 2 * halo
    lo, hi = exchange_edges(padded.narrow(dim, halo, max(n, 0)), dim, group, halo)
    if lo is not None:
        padded.narrow(dim, 0, halo).copy_(lo)
    if hi is not None:
        padded.narrow(dim, n + halo, halo).copy_(hi)
    return padded


def exchange_halo(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, halo: int = 1) -> torch.Tensor:
    """x with `halo` neighbour rows added on both sides of `dim` (zeros at the outer edges).

    Keeps x's memory format (channels_last_3d in, channels_last_3d out). Launches:
    two boundary copies, one grouped P2P, one `cat` (a full pass over x; the
    sharded forward avoids it on large inputs, see `fill_halo` and forward.conv2d).
    """
    if halo < 1:
        return x
    lo, hi = exchange_edges(x, dim, group, halo)
    n = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = n + 2 * halo
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format_of(x))
    parts = [lo if lo is not None else _zero_edge(x.narrow(dim, 0, halo)), x,
             hi if hi is not None else _zero_edge(x.narrow(dim, 0, halo))]
    return torch.cat(parts, dim=dim, out=out)  # one pass, written in x's layout


def _padded_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    x = x.contiguous()
    n = x.shape[dim]
    if n == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, 0, n).copy_(x)
    return out


def all_gather_along(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The full tensor along `dim` on every rank; rank r's shard has `sizes[r]` rows there."""
    rank, world = group_rank_world(group)
    if len(sizes) != world or x.shape[dim] != sizes[rank]:
        raise ValueError(f"shard sizes {list(sizes)} do not fit rank {rank} of {world} holding {x.shape[dim]}")
    big = max(sizes)
    mine = _padded_to(x, dim, big)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    full = torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)
    return full.contiguous(memory_format=memory_format_of(x))


def gather_along(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor | None:
    """Concatenate every rank's shard along `dim` on the group's rank 0 (None elsewhere)."""
    rank, world = group_rank_world(group)
    if len(sizes) != world or x.shape[dim] != sizes[rank]:
        raise ValueError(f"shard sizes {list(sizes)} do not fit rank {rank} of {world} holding {x.shape[dim]}")
    mine = _padded_to(x, dim, max(sizes))
    parts = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, parts, dst=_global(group, 0), group=group)
    if parts is None:
        return None
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)
