"""Several GPUs decoding one video: spatially-sharded decode over torch.distributed.

Layers (each its own module):

- `plan`: axis choice ("auto" = the longer latent axis, width on ties), near-even
  shard sizes, the minimum latent extent (`world x halo`, halo = 1) -- pure arithmetic;
- `comm`: halo exchange (P2P with the neighbours, zeros at the outer edges),
  all-gather and gather along a spatial dim, uneven shards padded and trimmed;
- `inner_ops`: the per-shard op bundle (the fused lossless op set where available,
  the plain-torch chains beside it);
- `forward`: the Wan decoder's forward on one shard (halo before every spatial
  conv, gathered mid-block attention, everything else local);
- `engine`: `ShardedEngine` (rank 0, the one-GPU engine interface) and
  `Follower` (ranks 1..), driven by small step descriptors;
- `launch`: rank 0 in the calling process, followers spawned, NCCL or gloo.
"""

from .engine import Follower, ShardedEngine, ShardedState, ShardGroupError
from .launch import GroupConfig, start_sharded_engine
from .plan import AXIS_CHOICES, ShardPlan, choose_axis, min_latent_extent, plan_shards, split_sizes

__all__ = [
    "AXIS_CHOICES",
    "Follower",
    "GroupConfig",
    "ShardGroupError",
    "ShardPlan",
    "ShardedEngine",
    "ShardedState",
    "choose_axis",
    "min_latent_extent",
    "plan_shards",
    "split_sizes",
    "start_sharded_engine",
]
