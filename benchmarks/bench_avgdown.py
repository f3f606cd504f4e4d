"""Time the Wan2.2 encoder's AvgDown3D adds call by call: stock's chain against the kernel.

Records every ``avgdown_add`` call the lossless encoder makes for its first call (one frame)
and a steady call (four frames) at one video size (bf16, channels_last_3d, random weights),
replays each and prints stock's chain (pad, permute copy, mean, add) and the fused kernel
with their times, the kernel's GB/s (bytes it must move: source, main, output) and whether
their bits are equal (they must be: a NO is a bug; on a CPU, whose aten sums in another
order, the kernel is compared with its ordered reference instead).

    python benchmarks/bench_avgdown.py                              # Wan2.2 704x1280
    TRITON_INTERPRET=1 python benchmarks/bench_avgdown.py --device cpu --model random:wan2.2-tiny --hw 32x48 --reps 1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import torch

from vaed import kernels as K
from vaed import patches as P
from vaed.models import load_model

from profiling import median_seconds

Call = tuple[torch.Tensor, torch.Tensor, int, int, int]


def record(vae: Any, frames: torch.Tensor, ops: P.OpSet) -> dict[str, list[Call]]:
    """The avgdown_add calls of the encoder's first call and of its next (steady) one."""
    calls: dict[str, list[Call]] = {"first": [], "steady": []}
    label = ["first"]

    def spy(main: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, out_channels: int) -> Any:
        calls[label[0]].append((main.clone(), source.clone(), factor_t, factor_s, out_channels))
        return ops.avgdown_add(main, source, factor_t, factor_s, out_channels)

    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    x = patchify(frames, patch_size=vae.config.patch_size) if vae.config.patch_size else frames
    cache: list = [None] * vae._cached_conv_counts["encoder"]
    with torch.inference_mode(), P.using(dataclasses.replace(ops, name="recording", avgdown_add=spy)):
        vae.encoder(x[:, :, :1], feat_cache=cache, feat_idx=[0])
        label[0] = "steady"
        vae.encoder(x[:, :, 1:5], feat_cache=cache, feat_idx=[0])
    return calls


def report(label: str, calls: list[Call], reps: int, cuda: bool) -> None:
    print(f"\n=== {label} call: {len(calls)} avgdown_add calls ===", flush=True)
    print(f"{'source':26} {'main':26} ft fs  G | stock us | kernel us (GB/s) | equal")
    total = {"stock": 0.0, "kernel": 0.0}
    with torch.inference_mode():
        for call in calls:
            main, source, ft, fs, out_c = call
            groups = source.shape[1] * ft * fs * fs // out_c
            exact = K.avgdown_add_reference if cuda else K.avgdown_add_ordered_reference
            want = exact(main, source, ft, fs, out_c)
            got = K.avgdown_add(main, source, ft, fs, out_c)
            ts = median_seconds(functools.partial(K.avgdown_add_reference, *call), reps, cuda=cuda)
            tk = float("nan")
            same = "declined"
            if got is not None:
                tk = median_seconds(functools.partial(K.avgdown_add, *call), reps, cuda=cuda)
                same = "yes" if got.stride() == want.stride() and torch.equal(got, want) else "NO"
            moved = (source.numel() + 2 * main.numel()) * main.element_size()
            total["stock"] += ts
            total["kernel"] += tk if got is not None else ts
            print(f"{str(tuple(source.shape)):26} {str(tuple(main.shape)):26} {ft:2} {fs:2} {groups:2} | "
                  f"{ts * 1e6:8.1f} | {tk * 1e6:9.1f} ({moved / tk / 1e9:5.0f}) | {same}", flush=True)
    print(f"--- {label}: stock {total['stock'] * 1e3:.3f} ms, kernel {total['kernel'] * 1e3:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.2")
    parser.add_argument("--hw", default="704x1280", help="video HxW")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    args = parser.parse_args()
    h, w = (int(v) for v in args.hw.split("x"))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    vae = load_model(args.model, args.device, dtype).vae
    rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless",))
    frames = torch.rand(1, 3, 5, h, w, device=args.device, dtype=dtype) * 2 - 1
    calls = record(vae, P.to_decoder_layout(frames, "channels_last"), rep.ops_for("lossless"))
    cuda = args.device.startswith("cuda")
    if cuda:
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for label in ("first", "steady"):
        report(label, calls[label], args.reps, cuda)


if __name__ == "__main__":
    main()
