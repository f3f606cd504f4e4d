"""Shard planning: axis choice, near-even sizes, the minimum extent and the fallback rules."""

from __future__ import annotations

import pytest

from vaed.parallel.plan import (
    ShardPlan,
    choose_axis,
    min_latent_extent,
    plan_shards,
    split_sizes,
)


def test_auto_axis_is_the_longer_latent_axis_width_on_ties() -> None:
    assert choose_axis(60, 104) == "width"
    assert choose_axis(104, 60) == "height"
    assert choose_axis(44, 44) == "width"
    assert choose_axis(3, 9, "height") == "height"
    with pytest.raises(ValueError, match="axis must be one of"):
        choose_axis(3, 3, "depth")


@pytest.mark.parametrize(
    ("extent", "world", "sizes"),
    [(6, 2, (3, 3)), (5, 2, (3, 2)), (7, 3, (3, 2, 2)), (8, 3, (3, 3, 2)), (6, 4, (2, 2, 1, 1)), (4, 4, (1, 1, 1, 1))],
)
def test_split_sizes_are_near_even_and_cover_the_extent(extent: int, world: int, sizes: tuple[int, ...]) -> None:
    assert split_sizes(extent, world) == sizes
    plan = ShardPlan("height", sizes)
    assert plan.extent == extent and plan.world == world
    assert plan.offsets == tuple(sum(sizes[:r]) for r in range(world))
    assert plan.scaled(8) == tuple(8 * s for s in sizes)


def test_minimum_extent_is_one_halo_row_per_rank() -> None:
    # every decoder conv is 3x3 (halo 1) and feature maps only grow, so the latent level decides
    assert min_latent_extent(2) == 2
    assert min_latent_extent(4) == 4
    assert plan_shards(4, 3, 4) == ShardPlan("height", (1, 1, 1, 1))
    assert plan_shards(3, 3, 4) is None  # 3 < 4: one GPU
    assert plan_shards(1, 1, 2) is None
    assert plan_shards(9, 1, 2, "width") is None  # an explicit axis that is too short is not switched
    assert plan_shards(9, 9, 1) is None  # a group of one never shards


def test_min_pixels_keeps_small_frames_on_one_gpu() -> None:
    # 60x104 latent = 480x832 output (399360 pixels)
    assert plan_shards(60, 104, 2, min_pixels=400_000) is None
    assert plan_shards(60, 104, 2, min_pixels=399_360) == ShardPlan("width", (52, 52))
    assert plan_shards(44, 80, 2, scale_spatial=16, min_pixels=704 * 1280) == ShardPlan("width", (40, 40))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="world size"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="positive"):
        plan_shards(0, 4, 2)
