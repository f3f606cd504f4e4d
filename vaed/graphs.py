"""CUDA graphs of decoder calls: captured once per call signature, then replayed.

Why: one decoder call launches ~274 kernels through diffusers' Python
modules; a replay launches them all at once. Measured on an H200 (bf16,
benchmarks/profile_chunks.py): host time per steady 480x832 chunk 13.9 -> 7.2 ms
(lossless) and 19.4 -> 5.6 ms (fast). The GPU stays the bound from 240x416 up,
so whole videos are no faster (480x832x81 lossless 1.248 s eager, 1.274 s
replayed) and the graphs' buffers cost memory: `--cuda-graphs` is off by
default. It pays where the host is the bound (faster decoder kernels, smaller
sizes, many sessions per GPU), and for each video's first chunk, whose
launches (9-18 ms at 480x832) were what the first frame waited for:
`first_chunk_only` (`--cuda-graphs first`) replays only those, cutting the
launches to ~2.5 ms and the first frame's p95 at the client by 2-6 ms (not
the fast tier's `stream()`'s), for +5.7 GiB of GPU memory with 480x832 and
720x1280 warmed (H200). Frame 0's GPU time (~20 ms lossless) is then the bound.

Bit-exactness: a graph holds exactly the kernels the eager forward launched
for one signature -- tier, first_chunk, and the shape, strides and dtype of the
input and of every cache entry (or its None / "Rep" marker). Same inputs, same
kernels (cuDNN algorithms, Triton specialisations), same bytes. The first
call of a signature runs eagerly, so Triton compiles and cuDNN plan choice
happen outside any capture; the second is captured and replayed.

Caches: sessions take turns on one device, so a graph's buffers cannot be a
session's cache for good. Per replay:

* the input latent frame is copied into the graph's static input (~200 KB);
* the session's cache is copied into the graph's static cache inputs unless
  it already is them (this session ran the graph last);
* a *resident* graph (steady chunks: the cache it writes has the signature of
  the cache it reads) writes its new cache into its own static inputs at the
  end of the captured call, and the session's cache then refers to them --
  one in-graph copy per chunk (1.9 GB at 480x832 bf16);
* when another session needs a resident graph, the session whose cache sits
  in it gets private copies first (``_spill``), so no one loses its cache;
* other graphs (the first two chunks) hand out copies of their outputs.

The decoder output is the graph's static output: it is valid until the next
replay on this device, so the caller consumes it (clamp makes a new tensor)
before anything else runs.

Memory: every graph of a device allocates from one shared pool (replays are
serial on the device thread and outputs are consumed or copied right after a
replay, so captures may reuse each other's intermediates); the pool grows to
the largest call's working set plus the live graphs' static outputs. At most
``max_graphs`` graphs are kept (least recently used dropped).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .lru import LruCache

log = logging.getLogger(__name__)

# Graphs kept per device. Per shape and tier a video uses three signatures
# (first chunk, second chunk, steady); 12 cover two warm-up shapes x two tiers.
DEFAULT_MAX_GRAPHS = 12
# Signatures remembered as "ran once" or "stays eager" (each a tuple of ~30 cache
# entries' shapes): bounded, so clients cycling through sizes cannot grow them;
# a forgotten one only runs eagerly once more (or retries its capture).
MAX_REMEMBERED_SIGNATURES = 1024

CacheList = list[Any]  # diffusers' feat_cache: tensors, None, or the "Rep" marker
DecoderCall = Callable[[torch.Tensor, CacheList], torch.Tensor]


def _meta(entry: Any) -> Any:
    if isinstance(entry, torch.Tensor):
        return (tuple(entry.shape), entry.stride(), entry.dtype)
    return entry  # None or "Rep"


def signature(tier: str, first_chunk: bool, x: torch.Tensor, cache: Sequence[Any]) -> tuple[Any, ...]:
    """Everything the eager forward's kernel choice depends on (weights are fixed per engine)."""
    return (tier, first_chunk, _meta(x), tuple(_meta(c) for c in cache))


def _copy_of(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


@dataclass(eq=False)
class CapturedCall:
    graph: Any                        # torch.cuda.CUDAGraph
    static_x: torch.Tensor
    static_in: CacheList              # cache inputs (regular allocations, not the pool)
    static_out: CacheList             # cache after the call (pool memory, unless resident)
    out: torch.Tensor                 # decoder output (pool memory)
    resident: bool                    # the new cache lands in static_in
    owner: Any = None                 # weakref to the state whose cache is static_in

    def holds_cache_of(self, state: Any) -> bool:
        cache = getattr(state, "cache", None)
        if cache is None or len(cache) != len(self.static_in):
            return False
        return all(c is s for c, s in zip(cache, self.static_in, strict=True) if isinstance(s, torch.Tensor))


@dataclass
class GraphStats:
    eager: int = 0
    captured: int = 0
    replayed: int = 0
    cache_loads: int = 0   # a session's cache copied into a graph
    spills: int = 0        # a resident session's cache copied out for another session
    failed: int = 0        # captures that failed (the signature stays eager)


class DecoderGraphs:
    """Per-device cache of captured decoder calls (the engine owns one; device thread only)."""

    def __init__(self, device: torch.device, *, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 backend: GraphBackend | None = None, first_chunk_only: bool = False) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        self.device = device
        self.max_graphs = max_graphs
        # Only first chunks replayed (`--cuda-graphs first`): frame 0's ~274 launches are what the
        # first frame waits for, while steady chunks are GPU-bound and stay eager (no resident
        # cache buffers, no in-graph cache copy).
        self.first_chunk_only = first_chunk_only
        self.backend = backend or CudaGraphBackend(device)
        self.stats = GraphStats()
        # An evicted graph's owner keeps its cache tensors: they are its references now.
        self._graphs: LruCache[Any, CapturedCall] = LruCache(max_graphs)
        # Signatures (values unused): captures that ran out of memory; run eagerly once,
        # captured on their next call.
        self._eager_only: LruCache[Any, None] = LruCache(MAX_REMEMBERED_SIGNATURES)
        self._seen_once: LruCache[Any, None] = LruCache(MAX_REMEMBERED_SIGNATURES)

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, state: Any, tier: str, first_chunk: bool, x: torch.Tensor, call: DecoderCall) -> torch.Tensor:
        """One decoder call for ``state`` (its ``cache`` list is read and replaced), eager or replayed."""
        if self.first_chunk_only and not first_chunk:
            self.stats.eager += 1
            return call(x, state.cache)
        sig = signature(tier, first_chunk, x, state.cache)
        captured = self._graphs.get(sig)
        if captured is None:
            if sig not in self._seen_once or sig in self._eager_only:
                self._seen_once[sig] = None
                self.stats.eager += 1
                return call(x, state.cache)
            self._seen_once.pop(sig)  # captured or eager-only from here
            captured = self._capture(sig, x, state.cache, call)
            if captured is None:
                self.stats.eager += 1
                return call(x, state.cache)
        return self._replay(captured, state, x)

    # -- internals ---------------------------------------------------------------

    def _capture(self, sig: Any, x: torch.Tensor, cache: CacheList, call: DecoderCall) -> CapturedCall | None:
        static_x = _copy_of(x)
        static_in = [_copy_of(c) for c in cache]
        try:
            graph, out, static_out, resident = self.backend.capture(call, static_x, static_in)
        except torch.cuda.OutOfMemoryError:
            log.warning("no memory to capture a CUDA graph of %s; that call stays eager", _describe(sig))
            self._eager_only[sig] = None
            self.stats.failed += 1
            self.backend.trim()
            return None
        captured = CapturedCall(graph, static_x, static_in, static_out, out, resident)
        self._graphs[sig] = captured  # the least recently used one past max_graphs is dropped
        self.stats.captured += 1
        log.debug("captured %s (%d graphs)", _describe(sig), len(self._graphs))
        return captured

    def _replay(self, captured: CapturedCall, state: Any, x: torch.Tensor) -> torch.Tensor:
        captured.static_x.copy_(x)
        if not (captured.owner is not None and captured.owner() is state and captured.holds_cache_of(state)):
            self._spill(captured)
            for s, c in zip(captured.static_in, state.cache, strict=True):  # one slot per conv, both
                if isinstance(s, torch.Tensor):
                    s.copy_(c)
            self.stats.cache_loads += 1
        self.backend.replay(captured.graph)
        self.stats.replayed += 1
        if captured.resident:
            slots = zip(captured.static_in, captured.static_out, strict=True)
            state.cache = [s if isinstance(s, torch.Tensor) else o for s, o in slots]
            captured.owner = weakref.ref(state)
        else:
            state.cache = [_copy_of(c) for c in captured.static_out]
            captured.owner = None
        return captured.out

    def _spill(self, captured: CapturedCall) -> None:
        """Give the state whose cache lives in ``captured`` its own copies before others use it."""
        owner = captured.owner() if captured.owner is not None else None
        captured.owner = None
        if owner is None or not captured.holds_cache_of(owner):
            return
        owner.cache = [_copy_of(c) for c in owner.cache]
        self.stats.spills += 1


def _describe(sig: Any) -> str:
    tier, first_chunk, x_meta, _ = sig
    return f"{tier} decoder call, input {x_meta[0]}{' (first chunk)' if first_chunk else ''}"


class GraphBackend:
    """How a call is captured and replayed (CUDA here; tests substitute a re-running double)."""

    def capture(self, call: DecoderCall, static_x: torch.Tensor,
                static_in: CacheList) -> tuple[Any, torch.Tensor, CacheList, bool]:
        raise NotImplementedError

    def replay(self, graph: Any) -> None:
        raise NotImplementedError

    def trim(self) -> None:
        """Give back memory a failed capture left cached."""


def record_call(
    call: DecoderCall, static_x: torch.Tensor, static_in: CacheList
) -> tuple[torch.Tensor, CacheList, bool]:
    """The body of a capture: the call, then (resident) its new cache written into ``static_in``."""
    cache = list(static_in)
    out = call(static_x, cache)
    resident = [_meta(c) for c in cache] == [_meta(s) for s in static_in]
    if resident:
        for s, c in zip(static_in, cache, strict=True):
            if isinstance(s, torch.Tensor):
                s.copy_(c)
    return out, cache, resident


class CudaGraphBackend(GraphBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, call: DecoderCall, static_x: torch.Tensor,
                static_in: CacheList) -> tuple[Any, torch.Tensor, CacheList, bool]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the delivery thread may wait on copy events while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out, cache, resident = record_call(call, static_x, static_in)
        return graph, out, cache, resident

    def replay(self, graph: Any) -> None:
        graph.replay()

    def trim(self) -> None:
        torch.cuda.empty_cache()


class RerunBackend(GraphBackend):
    """A graph that re-runs the call on its static buffers: the CUDA backend's reference
    semantics (static inputs read, static outputs overwritten in place) without CUDA."""

    @dataclass(eq=False)
    class _Recording:
        call: DecoderCall
        static_x: torch.Tensor
        static_in: CacheList
        out: torch.Tensor
        cache_out: CacheList
        resident: bool

    def capture(self, call: DecoderCall, static_x: torch.Tensor,
                static_in: CacheList) -> tuple[Any, torch.Tensor, CacheList, bool]:
        out, cache, resident = record_call(call, static_x, list(static_in))
        rec = self._Recording(call, static_x, static_in, out, cache, resident)
        # the values written by capture are garbage in CUDA (nothing executes); make them so here too
        _scribble(out, cache, static_in if resident else [])
        return rec, out, cache, resident

    def replay(self, graph: Any) -> None:
        out, cache, _ = record_call(graph.call, graph.static_x, graph.static_in)
        graph.out.copy_(out)
        for dst, src in zip(graph.cache_out, cache, strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


def _scribble(out: torch.Tensor, *lists: CacheList) -> None:
    out.fill_(float("nan"))
    for entries in lists:
        for t in entries:
            if isinstance(t, torch.Tensor):
                t.fill_(float("nan"))
