"""Per-chunk host and GPU time of the engine, eager vs CUDA graphs, lossless vs fast (one GPU).

    python benchmarks/profile_chunks.py                       # Wan2.1 480x832x81, bf16
    python benchmarks/profile_chunks.py --model random:wan2.2 --hw 44x80 --frames 31

For each tier and mode prints, over one video decoded one latent frame at a time:

* ``host``: time until decode_frame returns (Python dispatch; the GPU may still run),
* ``chunk``: time until the GPU finished that frame (synchronised after each frame),
  for the first chunk (the in-process part of time to first frame) and the
  median of the steady chunks,
* ``video``: a whole-video decode without per-frame syncs (min of --reps),
* whether the graph mode's RAW output equals the eager one (torch.equal),
* graph count and GPU memory reserved after the run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vaed.engine import DecodeEngine, OutputSpec, warm_up
from vaed.graphs import DecoderGraphs


def per_chunk(engine: DecodeEngine, z: torch.Tensor, spec: OutputSpec) -> tuple[list[float], list[float]]:
    host, chunk = [], []
    state = engine.new_state()
    for i in range(z.shape[2]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.decode_frame(state, z[:, :, i : i + 1], spec)
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        chunk.append(time.perf_counter() - t0)
    engine.free(state)
    return host, chunk


def whole(engine: DecodeEngine, z: torch.Tensor, spec: OutputSpec, reps: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.decode_video(z, spec)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    assert out is not None
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--hw", default="60x104", help="latent HxW")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tiers", default="lossless,fast")
    args = parser.parse_args()
    h, w = (int(v) for v in args.hw.split("x"))
    engine = DecodeEngine.load(args.model, device="cuda:0", dtype="bfloat16", cuda_graphs="on")
    graphs = engine.graphs
    assert isinstance(graphs, DecoderGraphs)
    t = (args.frames - 1) // engine.scale_temporal + 1
    z = torch.randn(1, engine.z_dim, t, h, w, generator=torch.Generator().manual_seed(0))
    print(f"{args.model} latents {tuple(z.shape)}, {engine.fast_paths.summary}", flush=True)
    for tier in args.tiers.split(","):
        if tier not in engine.precisions:
            print(f"{tier}: not offered", flush=True)
            continue
        spec = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True, precision=tier)
        outs = {}
        for mode in ("eager", "graphs"):
            engine.graphs = graphs if mode == "graphs" else None
            started = time.perf_counter()
            warm_up(engine, (h, w), tier)
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - started
            host, chunk = per_chunk(engine, z, spec)
            video_s, outs[mode] = whole(engine, z, spec, args.reps)
            outs[mode] = outs[mode].cpu()
            print(f"{tier:8} {mode:6}  warm-up {warm_s:6.2f} s | first chunk host {host[0] * 1e3:6.1f} ms "
                  f"chunk {chunk[0] * 1e3:6.1f} ms | steady host {statistics.median(host[2:]) * 1e3:6.1f} ms "
                  f"chunk {statistics.median(chunk[2:]) * 1e3:6.1f} ms | video {video_s:6.3f} s | "
                  f"reserved {torch.cuda.memory_reserved() / 2**30:6.2f} GiB", flush=True)
        print(f"{tier:8} graphs == eager: {torch.equal(outs['eager'], outs['graphs'])}; "
              f"graphs {len(graphs)}, stats {graphs.stats.captured} captured, {graphs.stats.replayed} replayed, "
              f"{graphs.stats.cache_loads} cache loads, {graphs.stats.spills} spills", flush=True)


if __name__ == "__main__":
    main()
