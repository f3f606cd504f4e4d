"""vaed.graphs on CPU: the capture/replay bookkeeping against eager decodes.

`RerunBackend` stands in for CUDA: a "replay" re-runs the call on the graph's
static buffers and overwrites its static outputs in place, and a capture
leaves NaN in everything it wrote (a CUDA capture executes nothing). So a
replay that read a stale or missing cache, or handed out an output another
replay overwrote, shows up as a difference from the eager decode.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from vaed.engine import DecodeEngine, OutputSpec, warm_up
from vaed.graphs import DecoderGraphs, GraphBackend, RerunBackend, signature

RAW = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True)


@pytest.fixture(scope="module", params=["random:wan2.1-tiny", "random:wan2.2-tiny"])
def engine(request: pytest.FixtureRequest) -> DecodeEngine:
    return DecodeEngine.load(request.param, device="cpu", dtype="float32")


def _with_graphs(engine: DecodeEngine, backend: GraphBackend | None = None, max_graphs: int = 12,
                 first_chunk_only: bool = False) -> DecoderGraphs:
    engine.graphs = DecoderGraphs(engine.device, max_graphs=max_graphs, backend=backend or RerunBackend(),
                                  first_chunk_only=first_chunk_only)
    return engine.graphs


def _latents(engine: DecodeEngine, seed: int, t: int = 5, h: int = 6, w: int = 8) -> torch.Tensor:
    return torch.randn(1, engine.z_dim, t, h, w, generator=torch.Generator().manual_seed(seed))


def _eager(engine: DecodeEngine, z: torch.Tensor) -> torch.Tensor:
    engine.graphs = None
    return engine.decode_video(z, RAW)


def test_replayed_video_equals_eager(engine: DecodeEngine) -> None:
    z = _latents(engine, 0)
    want = _eager(engine, z)
    graphs = _with_graphs(engine)
    try:
        first = engine.decode_video(z, RAW)   # eager once per signature, the steady one captured
        second = engine.decode_video(z, RAW)  # every signature replayed
    finally:
        engine.graphs = None
    assert torch.equal(first, want) and torch.equal(second, want)
    # first chunk, second chunk, steady chunk
    assert graphs.stats.captured == 3 and len(graphs) == 3
    assert graphs.stats.replayed == 2 + 5  # frames 3, 4 of the first video; all five of the second
    assert graphs.stats.eager == 3


def test_first_chunk_only_replays_frame_0_and_leaves_the_rest_eager(engine: DecodeEngine) -> None:
    """`--cuda-graphs first`: one signature (the first chunk) is captured; the videos' other calls
    run eagerly on the cache copies the replay hands out, and interleaved sessions keep theirs."""
    za, zb = _latents(engine, 6), _latents(engine, 7)
    want_a, want_b = _eager(engine, za), _eager(engine, zb)
    graphs = _with_graphs(engine, first_chunk_only=True)
    try:
        first = engine.decode_video(za, RAW)   # frame 0 eager (seen once)
        second = engine.decode_video(za, RAW)  # frame 0 captured, then replayed
        sa, sb = engine.new_state(), engine.new_state()
        got_a, got_b = [], []
        for i in range(za.shape[2]):
            got_a.append(engine.decode_frame(sa, za[:, :, i : i + 1], RAW).frames)
            got_b.append(engine.decode_frame(sb, zb[:, :, i : i + 1], RAW).frames)
    finally:
        engine.graphs = None
    assert torch.equal(first, want_a) and torch.equal(second, want_a)
    assert torch.equal(torch.cat(got_a, 2), want_a) and torch.equal(torch.cat(got_b, 2), want_b)
    assert graphs.stats.captured == 1 and len(graphs) == 1
    assert graphs.stats.replayed == 3  # frame 0 of the second video and of both sessions
    assert graphs.stats.eager == 1 + 4 * 4  # the first video's frame 0, and every later chunk


def test_interleaved_sessions_keep_their_caches(engine: DecodeEngine) -> None:
    za, zb = _latents(engine, 1), _latents(engine, 2)
    want_a, want_b = _eager(engine, za), _eager(engine, zb)
    graphs = _with_graphs(engine)
    try:
        warm_up(engine, (6, 8), "lossless")
        sa, sb = engine.new_state(), engine.new_state()
        got_a, got_b = [], []
        for i in range(za.shape[2]):  # a and b take turns on the same graphs, as sessions on one worker do
            got_a.append(engine.decode_frame(sa, za[:, :, i : i + 1], RAW).frames)
            got_b.append(engine.decode_frame(sb, zb[:, :, i : i + 1], RAW).frames)
        # a continues alone: its cache stays in the resident graph, no copy in
        loads = graphs.stats.cache_loads
        za2 = _latents(engine, 3, t=2)
        more_a = [engine.decode_frame(sa, za2[:, :, i : i + 1], RAW).frames for i in range(2)]
    finally:
        engine.graphs = None
    assert torch.equal(torch.cat(got_a, 2), want_a)
    assert torch.equal(torch.cat(got_b, 2), want_b)
    assert graphs.stats.spills > 0
    assert graphs.stats.cache_loads == loads + 1  # b ran the steady graph last: a loads once, then stays
    # a's continuation equals an eager decode of the concatenated latents
    whole = _eager(engine, torch.cat([za, za2], 2))
    assert torch.equal(torch.cat(got_a + more_a, 2), whole)


def test_one_graph_slot_still_decodes_exactly(engine: DecodeEngine) -> None:
    z = _latents(engine, 4)
    want = _eager(engine, z)
    graphs = _with_graphs(engine, max_graphs=1)
    try:
        outs = [engine.decode_video(z, RAW) for _ in range(3)]
    finally:
        engine.graphs = None
    assert all(torch.equal(o, want) for o in outs)
    assert len(graphs) == 1 and graphs.stats.captured > 1  # evicted and captured again


def test_tiers_and_first_chunk_are_separate_signatures() -> None:
    x = torch.zeros(1, 4, 1, 2, 2)
    cache: list[Any] = [None, torch.zeros(1, 4, 2, 2, 2), "Rep"]
    base = signature("lossless", False, x, cache)
    assert signature("fast", False, x, cache) != base
    assert signature("lossless", True, x, cache) != base
    assert signature("lossless", False, x.contiguous(memory_format=torch.channels_last_3d), cache) != base
    assert signature("lossless", False, x, [None, torch.zeros(1, 4, 1, 2, 2), "Rep"]) != base
    assert signature("lossless", False, x, [None, torch.zeros(1, 4, 2, 2, 2), None]) != base
    assert signature("lossless", False, x.clone(), [None, torch.ones(1, 4, 2, 2, 2), "Rep"]) == base


class _NoMemoryBackend(RerunBackend):
    def capture(self, *args: Any, **kwargs: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("no room for the graph")


def test_a_capture_without_memory_leaves_the_call_eager(engine: DecodeEngine) -> None:
    z = _latents(engine, 5)
    want = _eager(engine, z)
    graphs = _with_graphs(engine, backend=_NoMemoryBackend())
    try:
        outs = [engine.decode_video(z, RAW) for _ in range(2)]
    finally:
        engine.graphs = None
    assert all(torch.equal(o, want) for o in outs)
    assert len(graphs) == 0 and graphs.stats.replayed == 0
    assert graphs.stats.failed == 3 and graphs.stats.eager == 10  # each signature tried once, then eager


def test_engine_refuses_an_unknown_graph_mode() -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        DecodeEngine.load("random:wan2.1-tiny", device="cpu", dtype="float32", cuda_graphs="maybe")


@pytest.mark.parametrize("mode", ["on", "first"])
def test_graphs_stay_off_on_cpu_and_the_log_says_so(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vaed.engine"):
        engine = DecodeEngine.load("random:wan2.1-tiny", device="cpu", dtype="float32", cuda_graphs=mode)
    assert engine.graphs is None
    assert f"--cuda-graphs {mode}: CUDA graphs need a CUDA device; cpu decodes without them" in caplog.text


def test_signatures_seen_once_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client cycling through sizes leaves at most MAX_REMEMBERED_SIGNATURES behind."""
    import vaed.graphs as G

    monkeypatch.setattr(G, "MAX_REMEMBERED_SIGNATURES", 4)
    graphs = DecoderGraphs(torch.device("cpu"), backend=RerunBackend())

    class State:
        cache: list[Any] = [None]

    for size in range(1, 11):  # ten sizes, each called once: each runs eagerly
        x = torch.zeros(1, 2, 1, size, size)
        graphs.run(State(), "lossless", True, x, lambda x, cache: x + 1)
    assert len(graphs._seen_once) == 4 and graphs.stats.eager == 10 and len(graphs) == 0
