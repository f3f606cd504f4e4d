"""CUDA graphs (vaed.graphs) on the GPU: replayed decoder calls write the bytes the eager
calls write, in both tiers, with sessions taking turns on the same graphs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from vaed.engine import DecodeEngine, OutputSpec, warm_up
from vaed.graphs import DecoderGraphs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def engine() -> Iterator[DecodeEngine]:
    yield DecodeEngine.load("random:wan2.1", device="cuda:0", dtype="bfloat16", cuda_graphs="on")


def _spec(precision: str) -> OutputSpec:
    return OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True, precision=precision)


@pytest.mark.parametrize("precision", ["lossless", "fast"])
@pytest.mark.parametrize("hw", [(30, 52), (60, 104)])
def test_replays_equal_eager_decodes(engine: DecodeEngine, precision: str, hw: tuple[int, int]) -> None:
    if precision not in engine.precisions:
        pytest.skip(f"{precision} tier not offered: {engine.fast_paths.summary}")
    g = torch.Generator().manual_seed(hw[0])
    za, zb = (torch.randn(1, 16, 6, *hw, generator=g) for _ in range(2))
    graphs = engine.graphs
    assert graphs is not None
    engine.graphs = None
    try:
        want_a, want_b = engine.decode_video(za, _spec(precision)), engine.decode_video(zb, _spec(precision))
    finally:
        engine.graphs = graphs
    warm_up(engine, hw, precision)
    replays = graphs.stats.replayed
    sa, sb = engine.new_state(), engine.new_state()
    got_a, got_b = [], []
    for i in range(za.shape[2]):
        got_a.append(engine.decode_frame(sa, za[:, :, i : i + 1], _spec(precision)).frames)
        got_b.append(engine.decode_frame(sb, zb[:, :, i : i + 1], _spec(precision)).frames)
    alone = engine.decode_video(za, _spec(precision))
    assert graphs.stats.replayed - replays == 3 * za.shape[2]  # every call of the three decodes was a replay
    assert torch.equal(torch.cat(got_a, 2), want_a)
    assert torch.equal(torch.cat(got_b, 2), want_b)
    assert torch.equal(alone, want_a)


def test_graph_memory_is_reported(engine: DecodeEngine) -> None:
    warm_up(engine, (30, 52), "lossless")  # captures this size's signatures if earlier tests did not
    assert isinstance(engine.graphs, DecoderGraphs) and len(engine.graphs) >= 3
    print(f"graphs {len(engine.graphs)}, stats {engine.graphs.stats.captured} captured, "
          f"{torch.cuda.memory_reserved(0) / 2**30:.2f} GiB reserved")


@pytest.fixture(scope="module")
def first_only() -> Iterator[DecodeEngine]:
    yield DecodeEngine.load("random:wan2.1", device="cuda:0", dtype="bfloat16", cuda_graphs="first")


@pytest.mark.parametrize("precision", ["lossless", "fast"])
def test_first_chunk_replays_equal_eager_decodes(first_only: DecodeEngine, precision: str) -> None:
    """`--cuda-graphs first`: frame 0 replayed, every later chunk eager on the replay's cache copies."""
    if precision not in first_only.precisions:
        pytest.skip(f"{precision} tier not offered: {first_only.fast_paths.summary}")
    graphs = first_only.graphs
    assert graphs is not None and graphs.first_chunk_only
    z = torch.randn(1, 16, 4, 60, 104, generator=torch.Generator().manual_seed(3))
    first_only.graphs = None
    try:
        want = first_only.decode_video(z, _spec(precision))
    finally:
        first_only.graphs = graphs
    kept = len(graphs)  # the module's engine keeps other tests' graphs
    warm_up(first_only, (60, 104), precision)  # frame 0 seen, then captured
    replays = graphs.stats.replayed
    got = first_only.decode_video(z, _spec(precision))
    assert graphs.stats.replayed - replays == 1  # frame 0 only; the other chunks ran eagerly
    assert len(graphs) - kept == 1  # this tier's first-chunk signature, and nothing else
    assert torch.equal(got, want)
    print(f"first-chunk graph at 480x832 {precision}: {torch.cuda.memory_reserved(0) / 2**30:.2f} GiB reserved")
