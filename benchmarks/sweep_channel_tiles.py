"""Sweep the channels-last tile kernels' launch shape over a steady chunk's real calls (one GPU run).

Records the fast tier's kernel calls of one steady chunk (as
``bench_fast_kernels.py`` does), then replays each distinct call under
several tile shapes -- elements per program (``rt.CHANNEL_TILE``) x warps --
and prints the GPU time of each, the chunk's total per shape, and the total
with every call at its own best shape. Calls are timed in batches of
``--batch`` between two CUDA events, so the host's launch work overlaps the
GPU's and only kernel time counts. Calls with a deferred conv bias are also
timed without it (same tile shape), to see what the bias costs.

    python benchmarks/sweep_channel_tiles.py --model random:wan2.1 --hw 60x104
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
from collections.abc import Callable
from typing import Any

import torch
from bench_fast_kernels import Call, describe, record

from vaed import patches as P
from vaed.kernels import _runtime as rt
from vaed.models import load_model

# (elements per program, warps); the first is today's rule (rt.channel_tile)
SHAPES = ((4096, 8), (2048, 4), (8192, 16))


def tile_rule(elements: int, warps: int) -> Callable[..., tuple[int, int, int]]:
    def rule(channels: int, pixels: int | None = None) -> tuple[int, int, int]:
        block_c = rt.pow2(channels)
        block_p = max(1, elements // block_c)
        if pixels is not None:
            block_p = max(1, min(rt.pow2(pixels), block_p))
        full = block_p * block_c >= elements
        return block_p, block_c, warps if full else max(1, min(warps, 4))
    return rule


def batch_seconds(fn: Callable[[], Any], batch: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of (GPU time of ``batch`` back-to-back calls) / batch."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / batch)
    return sorted(times)[len(times) // 2]


def without_x_bias(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    norm_cl = kwargs.get("norm_cl")
    if norm_cl is None or norm_cl.x_bias is None:
        return None
    return {**kwargs, "norm_cl": dataclasses.replace(norm_cl, x_bias=None)}


def sweep(calls: list[Call], batch: int) -> None:
    groups: dict[str, list[Call]] = collections.defaultdict(list)
    for c in calls:
        groups[describe(c[0], c[2], c[3])].append(c)
    header = " ".join(f"{e // 1024:>3}k/{w:<2}" for e, w in SHAPES)
    print(f"\n{'call (us per call)':72} {'n':>2} | {header} | no-xbias", flush=True)
    totals = [0.0] * len(SHAPES)
    best_total = 0.0
    saved = rt.channel_tile
    try:
        with torch.inference_mode():
            for label, group in groups.items():
                _, fn, args, kwargs = group[0]
                row = []
                for i, (elements, warps) in enumerate(SHAPES):
                    rt.channel_tile = tile_rule(elements, warps)
                    sec = batch_seconds(lambda fn=fn, a=args, k=kwargs: fn(*a, **k), batch)
                    row.append(sec)
                    totals[i] += sec * len(group)
                best_total += min(row) * len(group)
                rt.channel_tile = saved
                plain = without_x_bias(kwargs)
                nob = "" if plain is None else f"{batch_seconds(lambda fn=fn, a=args, k=plain: fn(*a, **k), batch) * 1e6:8.1f}"
                cells = " ".join(f"{s * 1e6:7.1f}" for s in row)
                print(f"{label:72} {len(group):>2} | {cells} | {nob}", flush=True)
    finally:
        rt.channel_tile = saved
    cells = " ".join(f"{t * 1e3:7.3f}" for t in totals)
    print(f"{'chunk total (ms)':72} {len(calls):>2} | {cells} | best-per-call {best_total * 1e3:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--hw", nargs="+", default=["60x104"], help="latent HxW, one or more")
    parser.add_argument("--batch", type=int, default=10)
    args = parser.parse_args()
    vae = load_model(args.model, "cuda", torch.bfloat16, decoder_only=True).vae
    rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
    for hw in args.hw:
        h, w = (int(v) for v in hw.split("x"))
        z = torch.randn(1, vae.config.z_dim, 3, h, w, device="cuda", dtype=torch.bfloat16)
        z = P.to_decoder_layout(z, "channels_last")
        print(f"{args.model} latent {h}x{w}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
        sweep(record(vae, z, rep.ops_for("fast")), args.batch)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
