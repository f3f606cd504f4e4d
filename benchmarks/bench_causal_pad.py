"""Time the lossless conv-input path call by call against HBM bandwidth (one GPU run).

Records every ``causal_pad`` call (and its norm denominator) the lossless
decoder makes for the first chunk and for a steady chunk (bf16,
channels_last_3d, random weights), replays each and prints: the 1-D kernel's
time and achieved GB/s (bytes it must move: x, cache, conv input, next
cache, denominator), the exact channels-last tile kernel on the same call,
the aten denominator (``x.float()`` + ``vector_norm``) and a candidate
without the float copy (``vector_norm(x, dtype=float32)``) with whether its
bits equal, and a plain ``copy_`` of the conv input's bytes as the bandwidth
reference.

    python benchmarks/bench_causal_pad.py                       # Wan2.1 480x832
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import torch

from vaed import kernels as K
from vaed import patches as P
from vaed.models import load_model

from profiling import median_seconds

Call = tuple[Any, ...]


def timed(fn: Callable[[], Any], reps: int) -> float:
    return median_seconds(fn, reps, cuda=torch.cuda.is_available())  # CPU: a smoke test under TRITON_INTERPRET=1


def record(vae: Any, z: torch.Tensor, ops: P.OpSet) -> dict[str, list[tuple[Any, ...]]]:
    calls: dict[str, list[tuple[Any, ...]]] = {"first": [], "steady": []}
    chunk = [-1]
    orig = K.causal_pad

    def spy(x, cache, pad, *, zero_history=False, norm=None, emit_cache=True, **kw):  # noqa: ANN001
        name = {0: "first", 2: "steady"}.get(chunk[0])
        if name is not None:
            calls[name].append((x.clone(), None if cache is None else cache.clone(), tuple(pad), zero_history, norm, emit_cache))
        return orig(x, cache, pad, zero_history=zero_history, norm=norm, emit_cache=emit_cache, **kw)

    K.causal_pad = spy
    try:
        n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
        cache: list = [None] * n
        with torch.inference_mode(), P.using(ops):
            x = vae.post_quant_conv(z)
            for i in range(3):
                chunk[0] = i
                vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
    finally:
        K.causal_pad = orig
    return calls


def report(label: str, calls: list[tuple[Any, ...]], reps: int) -> None:
    print(f"\n=== {label} chunk: {len(calls)} causal_pad calls ===", flush=True)
    print(f"{'x shape':24} {'cache':10} {'norm':4} | 1-D us (GB/s) | tile us | copy-ref us (GB/s) | denom us | denom-nocopy us equal")
    tot = collections.Counter()
    with torch.inference_mode():
        for x, cache, pad, zh, norm, emit in calls:
            padded, nxt = K.causal_pad(x, cache, pad, zero_history=zh, norm=norm, emit_cache=emit)
            es = x.element_size()
            moved = (x.numel() + (cache.numel() if cache is not None and pad[4] > 0 else 0) + padded.numel()
                     + (nxt.numel() if nxt is not None else 0)) * es
            if norm is not None:
                moved += norm.denom.numel() * 4
            t1 = timed(lambda: K.causal_pad(x, cache, pad, zero_history=zh, norm=norm, emit_cache=emit), reps)
            tile = K.causal_pad_cl(x, cache, pad, zero_history=zh, emit_cache=emit, norm=norm)
            tt = timed(lambda: K.causal_pad_cl(x, cache, pad, zero_history=zh, emit_cache=emit, norm=norm), reps) if tile is not None else float("nan")
            if tile is not None:
                assert torch.equal(tile[0], padded), "tile kernel differs"
            dst = torch.empty_like(padded)
            tc = timed(lambda: dst.copy_(padded), reps)
            tf = float("nan")
            if norm is not None and K.causal_pad_cl(x, cache, pad, zero_history=zh, emit_cache=emit, norm_cl=K.NormSilu(norm.gamma, norm.scale, norm.bias)) is not None:
                tf = timed(lambda: K.causal_pad_cl(x, cache, pad, zero_history=zh, emit_cache=emit, norm_cl=K.NormSilu(norm.gamma, norm.scale, norm.bias)), reps)
            tot["fast_cl"] += tf if tf == tf else (tt if tile is not None else t1)
            td = tn = float("nan")
            same = ""
            if norm is not None:
                td = timed(lambda: K.norm_denominator_reference(x), reps)
                alt = torch.linalg.vector_norm(x, 2, dim=1, keepdim=True, dtype=torch.float32)
                same = "yes" if torch.equal(alt, K.norm_denominator(x)) else "NO"
                tn = timed(lambda: torch.linalg.vector_norm(x, 2, dim=1, keepdim=True, dtype=torch.float32), reps)
                tot["denom"] += td
                tot["denom_nocopy"] += tn
            tot["1d"] += t1
            tot["tile"] += tt if tile is not None else t1
            tot["copy"] += tc * 2  # read + write of the conv input's bytes
            tot["bytes"] += moved
            print(f"{str(tuple(x.shape)):24} {str(None if cache is None else cache.shape[2]):10} {'yes' if norm is not None else 'no':4} | "
                  f"{t1 * 1e6:7.1f} ({moved / t1 / 1e9:5.0f}) | {tt * 1e6:7.1f} | {tc * 1e6:7.1f} ({2 * padded.numel() * es / tc / 1e9:5.0f}) | "
                  f"{td * 1e6:7.1f} | {tn * 1e6:7.1f} {same} | fast-cl {tf * 1e6:7.1f}", flush=True)
    print(f"--- {label}: 1-D kernel {tot['1d'] * 1e3:.2f} ms for {tot['bytes'] / 1e9:.2f} GB ({tot['bytes'] / tot['1d'] / 1e9:.0f} GB/s); "
          f"tile where it applies {tot['tile'] * 1e3:.2f} ms; fast tier's ops {tot['fast_cl'] * 1e3:.2f} ms; denominators {tot['denom'] * 1e3:.2f} ms "
          f"(no float copy {tot['denom_nocopy'] * 1e3:.2f} ms)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--hw", default="60x104", help="latent HxW")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    args = parser.parse_args()
    h, w = (int(v) for v in args.hw.split("x"))
    vae = load_model(args.model, args.device, torch.bfloat16, decoder_only=True).vae
    rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless",))
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, h, w, device=args.device, dtype=torch.bfloat16), "channels_last")
    calls = record(vae, z, rep.ops_for("lossless"))
    if args.device.startswith("cuda"):
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for label in ("first", "steady"):
        report(label, calls[label], args.reps)


if __name__ == "__main__":
    main()
