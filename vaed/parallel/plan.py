"""Where a request's feature maps are cut: axis choice, shard sizes, the minimum size.

Pure arithmetic, no torch.distributed, so the server can decide "sharded or one
GPU" before any device work.

Why the latent level decides everything: the Wan decoder only ever *grows* its
feature maps (nearest 2x upsamples, DupUp3D, 2x2 unpatchify), so a shard that
owns latent rows [a, b) owns rows [s*a, s*b) at a level of scale s, and shard
boundaries never move between levels. Every spatial conv of the decoder is 3x3
(stride 1, padding 1), so its halo is 1 row/col; at scale s a shard holds s*n
rows, so the tightest constraint is at the latent level (s = 1):

    every shard needs >= halo (= 1) latent rows  =>  extent >= world_size.

That is the correctness minimum (`min_latent_extent`); below it the request
falls back to one GPU. Whether sharding is *worth it* is a separate, measured
threshold (benchmarks/bench_sharded.py --min-size) passed in as `min_pixels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from vaed.choices import SpatialAxis

HALO = 1  # every spatial conv of the Wan decoder is 3x3, stride 1, padding 1


def choose_axis(h: int, w: int, axis: str = SpatialAxis.AUTO) -> SpatialAxis:
    """HEIGHT or WIDTH: `auto` = the longer latent axis (fewer halo bytes per shard), width on ties."""
    chosen = SpatialAxis.parse(axis, "axis")
    if chosen == SpatialAxis.AUTO:
        return SpatialAxis.HEIGHT if h > w else SpatialAxis.WIDTH
    return chosen


def split_sizes(extent: int, world: int) -> tuple[int, ...]:
    """Near-even split: the first `extent % world` shards get one row more (5 over 2 -> 3, 2)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if extent < 0:
        raise ValueError(f"extent must be >= 0, got {extent}")
    base, extra = divmod(extent, world)
    return tuple(base + (1 if r < extra else 0) for r in range(world))


def min_latent_extent(world: int, halo: int = HALO) -> int:
    """Smallest latent extent along the split axis that a group of `world` ranks can shard."""
    return world * max(halo, 1)


@dataclass(frozen=True)
class ShardPlan:
    """How one session's feature maps are split: along `axis`, rank r owns latent rows/cols
    [offsets[r], offsets[r] + sizes[r]) and s times that at a level of scale s."""

    axis: SpatialAxis  # HEIGHT or WIDTH
    sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    @property
    def extent(self) -> int:
        return sum(self.sizes)

    @property
    def dim(self) -> int:
        """The split dim of a [..., H, W] tensor (5-D activations, 4-D images, RAW output)."""
        return -2 if self.axis == SpatialAxis.HEIGHT else -1

    def scaled(self, scale: int) -> tuple[int, ...]:
        return tuple(s * scale for s in self.sizes)


def plan_shards(
    h: int,
    w: int,
    world: int,
    axis: str = SpatialAxis.AUTO,
    *,
    scale_spatial: int = 8,
    min_pixels: int = 0,
    halo: int = HALO,
) -> ShardPlan | None:
    """The plan for a latent of h x w on `world` ranks, or None = decode on one GPU.

    None when world == 1, when the chosen axis is shorter than `min_latent_extent`
    (a shard would have fewer rows than the halo), or when the output frame has
    fewer than `min_pixels` pixels (not worth the exchanges; measured threshold).
    An explicit axis that is too short falls back too (it is never switched).
    """
    if h < 1 or w < 1:
        raise ValueError(f"latent extent must be positive, got {h}x{w}")
    if world <= 1:
        return None
    chosen = choose_axis(h, w, axis)
    extent = h if chosen == SpatialAxis.HEIGHT else w
    if extent < min_latent_extent(world, halo):
        return None
    if min_pixels and h * w * scale_spatial * scale_spatial < min_pixels:
        return None
    return ShardPlan(chosen, split_sizes(extent, world))
