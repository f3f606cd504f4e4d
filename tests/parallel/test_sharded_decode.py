"""Sharded decode on real gloo groups of 2, 3 and 4 CPU processes against the one-process decode.

Rank 0 is this test process (as in a server); followers are started by
`start_sharded_engine`, here from the tests' fork server (tests/launcher.py: the ranks' own
`_follower_main`, without each importing torch and diffusers again). The reference is rank 0's own one-GPU `DecodeEngine`
(the same weights): RAW fp32 output must match within 2e-5 max abs (the
shards' convs see other sizes, so the sums may round differently), and
sessions too small for the group must equal it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import launcher
import pytest
import torch

from vaed.engine import DecodeEngine
from vaed.models import load_model
from vaed.parallel import (
    GroupConfig,
    ShardedEngine,
    ShardGroupError,
    ShardPlan,
    start_sharded_engine,
)
from vaed.engine import OutputSpec

TOL = 2e-5
RAW = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=False)
RAW_VAE_SPACE = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True)
RGB8 = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False)

GROUPS = [
    pytest.param((2, "random:wan2.1-tiny"), id="2ranks-wan2.1"),
    pytest.param((3, "random:wan2.2-tiny"), id="3ranks-wan2.2"),
    pytest.param((2, "random:wan2.2-tiny"), id="2ranks-wan2.2", marks=pytest.mark.slow),
    pytest.param((3, "random:wan2.1-tiny"), id="3ranks-wan2.1", marks=pytest.mark.slow),
    pytest.param((4, "random:wan2.1-tiny"), id="4ranks-wan2.1", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=GROUPS)
def group(request: pytest.FixtureRequest) -> Iterator[ShardedEngine]:
    world, model = request.param
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU ranks share two cores: no oversubscription
    with launcher.forked_followers():
        engine = start_sharded_engine(GroupConfig(model, ("cpu",) * world, dtype="float32", timeout_s=120))
    try:
        yield engine
    finally:
        engine.close()
        torch.set_num_threads(threads)


def _latents(engine: ShardedEngine, t: int, h: int, w: int, seed: int = 0, b: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, engine.base.z_dim, t, h, w, generator=g)


def _decode(engine: ShardedEngine, latents: torch.Tensor, axis: str, output: Any = RAW) -> torch.Tensor:
    engine.axis = axis
    try:
        return engine.decode_video(latents, output)
    finally:
        engine.axis = "auto"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _cases(world: int) -> list[tuple[str, int, int, str, tuple[int, ...]]]:
    """(axis, h, w, expected split axis, expected sizes) for a group of `world` ranks."""
    return [
        ("auto", 2 * world, world + 1, "height", (2,) * world),  # longer axis, even split
        ("width", 3, 2 * world + 1, "width", (3,) + (2,) * (world - 1)),  # uneven
        ("height", world + 1, 3, "height", (2,) + (1,) * (world - 1)),  # uneven, one-row shards
        ("height", world, 2, "height", (1,) * world),  # every shard exactly one halo
    ]


def test_sharded_matches_one_process_on_both_axes_and_uneven_splits(group: ShardedEngine) -> None:
    for i, (axis, h, w, want_axis, want_sizes) in enumerate(_cases(group.world)):
        group.axis = axis
        assert group.plan_for(h, w) == ShardPlan(want_axis, want_sizes)  # type: ignore[arg-type]
        group.axis = "auto"
        z = _latents(group, 3, h, w, seed=i)
        got = _decode(group, z, axis)
        want = group.base.decode_video(z, RAW)
        assert got.dtype == torch.float32
        assert _max_diff(got, want) <= TOL, (axis, h, w)


def test_batch_and_rgb8(group: ShardedEngine) -> None:
    z = _latents(group, 2, 3, 2 * group.world + 1, seed=7, b=2)
    raw = _decode(group, z, "width")
    assert _max_diff(raw, group.base.decode_video(z, RAW)) <= TOL
    rgb = _decode(group, z, "width", RGB8)
    want = group.base.decode_video(z, RGB8)
    assert rgb.dtype == torch.uint8 and rgb.shape == want.shape
    # RAW agrees within 2e-5, so a uint8 value can differ by one step at a rounding edge
    assert _max_diff(rgb, want) <= 1
    assert (rgb != want).float().mean().item() < 0.01


def test_stream_sessions_interleave_and_keep_their_caches(group: ShardedEngine) -> None:
    """Two sharded sessions (other shapes, other axes) and a one-GPU session, stepped in turns
    like the worker does, each fed in chunks: each equals its own whole-video decode."""
    world = group.world
    videos = {
        "tall": _latents(group, 4, 2 * world + 1, 2, seed=11),
        "wide": _latents(group, 4, 2, 2 * world, seed=12),
        "small": _latents(group, 4, 1, 1, seed=13),
    }
    states = {name: group.new_state() for name in videos}
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in videos}
    first_frames: dict[str, list[int]] = {name: [] for name in videos}
    for chunk in ((0, 2), (2, 3), (3, 4)):  # chunks of 2, 1 and 1 latent frames
        for i in range(*chunk):
            for name, z in videos.items():
                decoded = group.decode_frame(states[name], z[:, :, i : i + 1], RAW)
                assert decoded.chunk_index == i
                outs[name].append(decoded.frames)
                first_frames[name].append(decoded.first_frame)
    assert states["tall"].plan is not None and states["tall"].plan.axis == "height"
    assert states["wide"].plan is not None and states["wide"].plan.axis == "width"
    assert states["small"].plan is None  # 1x1: one GPU
    for name, z in videos.items():
        group.free(states[name])
        assert first_frames[name] == [0, 1, 5, 9]
        got = torch.cat(outs[name], dim=2)
        want = group.base.decode_video(z, RAW)
        if name == "small":
            assert torch.equal(got, want)
        else:
            assert _max_diff(got, want) <= TOL, name


def test_too_small_for_the_group_falls_back_bit_identical_to_one_gpu(group: ShardedEngine) -> None:
    world = group.world
    h = w = world - 1 if world > 2 else 1
    assert group.plan_for(h, w) is None
    z = _latents(group, 3, h, w, seed=21)
    got = group.decode_video(z, RAW_VAE_SPACE)
    # a one-GPU engine on a fresh copy of the weights: the sharding-capable engine left the model alone
    fresh = DecodeEngine(load_model(group.base.loaded.spec, "cpu", torch.float32, decoder_only=True))
    want = fresh.decode_video(z, RAW_VAE_SPACE)
    assert torch.equal(got, want)
    # and sharded sessions in between change nothing for the next one-GPU session
    _decode(group, _latents(group, 2, 2 * world, 2), "height")
    _decode(group, _latents(group, 2, 2, 2 * world), "width")
    assert torch.equal(group.decode_video(z, RAW_VAE_SPACE), want)


def test_session_shape_is_fixed(group: ShardedEngine) -> None:
    state = group.new_state()
    try:
        group.decode_frame(state, _latents(group, 1, group.world, 2), RAW)
        with pytest.raises(ValueError, match="session started with"):
            group.decode_frame(state, _latents(group, 1, group.world + 1, 2), RAW)
    finally:
        group.free(state)
    with pytest.raises(ValueError, match="was freed"):  # misuse is refused; the group stays in step
        group.decode_frame(state, _latents(group, 1, group.world, 2), RAW)
    assert group.healthy


def test_group_reports_ranks_and_delegates_to_the_one_gpu_engine(group: ShardedEngine) -> None:
    assert group.peak_memory(reset=True) == [0] * group.world  # CPU ranks: no device memory to report
    assert group.z_dim == group.base.z_dim and group.scale_spatial == group.base.scale_spatial
    assert group.output_frames(3) == 9
    assert group.describe().startswith(f"spatial x{group.world}")
    assert group.health_entries() == {"spatial": True}
    group.keepalive(force=True)  # a no-op step every rank takes; the group keeps working after it
    z = _latents(group, 1, 2 * group.world, 2)
    assert _max_diff(_decode(group, z, "height"), group.base.decode_video(z, RAW)) <= TOL


def test_a_dead_follower_breaks_the_group_with_a_clear_error(group: ShardedEngine) -> None:
    """Last test of each group (it breaks it): rank 0 raises ShardGroupError instead of hanging,
    and new sessions of any size then decode on rank 0 alone (the server keeps serving)."""
    victim = group._launched.procs[-1]
    victim.kill()
    victim.join(10)
    with pytest.raises(ShardGroupError, match=f"sharded decode failed.*pid {victim.pid} exited with code -9"):
        group.decode_video(_latents(group, 1, 2 * group.world, 2), RAW)
    assert not group.healthy
    # ModelInfo.parallel and the group's health entry say so; keepalives stop
    assert group.describe() == "off" and group.health_entries() == {"spatial": False}
    group.keepalive(force=True)
    # new sessions of any size now decode on rank 0 alone, equal to the one-GPU engine
    z = _latents(group, 2, 2 * group.world, 2, seed=31)
    assert torch.equal(group.decode_video(z, RAW), group.base.decode_video(z, RAW))
