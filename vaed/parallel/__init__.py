"""Several GPUs decoding one video: spatially-sharded decode over torch.distributed.

Layers (each its own module):

- `plan`: axis choice ("auto" = the longer latent axis, width on ties), near-even
  shard sizes, the minimum latent extent (`world x halo`, halo = 1) -- pure arithmetic;
- `comm`: halo exchange (P2P with the neighbours, zeros at the outer edges),
  all-gather and gather along a spatial dim, uneven shards padded and trimmed;
- `inner_ops`: the one-device op set a shard starts from (the fused lossless set, or
  the plain-torch chains);
- `forward`: the sharded op set (halo exchange at the conv inputs and the
  upsamplers' image convs, gathered mid-block attention, everything else local)
  and the decoder on one shard: the one decoder tree of `vaed.patches.tree`;
- `engine`: `ShardedEngine` (rank 0, the one-GPU engine interface) and
  `Follower` (ranks 1..), driven by small step descriptors;
- `launch`: rank 0 in the calling process, followers spawned, NCCL or gloo.

Server integration (`vaed serve --gpu 0,1 --parallel spatial --spatial-axis auto`):

1. before the gRPC server starts (main thread), build GPU 0's `DecodeEngine` as
   today, then `engine = start_sharded_engine(GroupConfig(model, ("cuda:0",
   "cuda:1"), dtype=..., kernels=..., layout=..., axis=..., min_pixels=...),
   base=gpu0_engine)`: it spawns one process per other GPU and returns when
   every rank has its model;
2. hand `engine` to GPU 0's device worker in place of the one-GPU engine: both
   implement `vaed.engine_protocol.Engine` (`new_state`, `decode_frame`, `free`,
   `output_frames`, `decode_video`, the model facts), so sessions interleave per
   latent frame exactly as before. Sessions whose latent is too small for the
   group, or whose frame is below `min_pixels`, decode on GPU 0 alone,
   bit-identical to the one-GPU engine;
3. health/metrics: `engine.healthy` (False once a rank died: new sessions then
   run on GPU 0 alone, `describe()` says "off" and the health entry
   `vaed.v1.VaeDecoder/spatial` NOT_SERVING), `engine.peak_memory()` (per-rank
   peak bytes), `engine.describe()` for ModelInfo.parallel; the device worker
   calls `engine.keepalive()` on every pass of its loop (a no-op step once a
   quarter of the followers' control timeout went by without one);
   `engine.close()` on drain.

Trade-off of this first design: GPUs 1.. only ever work on sharded sessions,
so with mostly small requests the other GPUs idle (the pool of one-GPU
workers is the better mode there); `min_pixels` is the knob (see
benchmarks/bench_sharded.py --min-size for where sharding starts to win).
"""

from .engine import Follower, ShardedEngine, ShardedState, ShardGroupError, StepHeader
from .launch import GroupConfig, start_sharded_engine
from .plan import (
    ShardPlan,
    choose_axis,
    min_latent_extent,
    plan_shards,
    split_sizes,
)

__all__ = [
    "Follower",
    "GroupConfig",
    "ShardGroupError",
    "ShardPlan",
    "ShardedEngine",
    "ShardedState",
    "StepHeader",
    "choose_axis",
    "min_latent_extent",
    "plan_shards",
    "split_sizes",
    "start_sharded_engine",
]
