"""Time the fast tier's own kernels call by call against HBM bandwidth (one GPU run).

Decodes three latent frames with the fast op set (bf16, channels_last_3d,
random weights) and records, in the steady chunk, every call to the kernels
vaed wrote: the conv-input tile kernel (``causal_pad_cl``: one-pass
norm+SiLU, the deferred conv bias, the unfolded time taps), the residual
add with conv2's bias (``bias_residual_add``) and the DupUp3D add. Each
distinct call is replayed and printed with its time, the bytes it must move
(every input read once, every output written once) and achieved GB/s, beside
a device copy of the same byte count (the bandwidth a kernel could reach).
Calls a kernel declines (its fallback runs) are listed with their strides,
each resample conv2d with its input, weight and output strides, and each
conv3d whose output is not channels_last_3d.

    python benchmarks/bench_fast_kernels.py                                   # Wan2.1 480x832
    python benchmarks/bench_fast_kernels.py --model random:wan2.2 --hw 44x80  # Wan2.2 704x1280
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from profiling import median_seconds

from vaed import kernels as K
from vaed import patches as P
from vaed.models import load_model
from vaed.patches import fast
from vaed.patches.ops import FusedOp

Call = tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def record(vae: Any, z: torch.Tensor, ops: P.OpSet) -> list[Call]:
    """The steady chunk's (chunk 2) calls of the fast tier's kernels, with their inputs kept."""
    calls: list[Call] = []
    chunk = [-1]

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if chunk[0] == 2 and out is not None:
                calls.append((name, fn, args, kwargs))
            elif chunk[0] == 2:  # a decline: the call ran its fallback (aten or the 1-D kernel)
                strides = [tuple(t.stride()) for t in _tensors(args)[:3]]
                print(f"declined: {describe(name, args, kwargs)} strides {strides}", flush=True)
            return out
        return wrapped

    def conv2d_spy(conv: Any, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
        y = conv2d(conv, x, bias=bias)
        if chunk[0] == 2:
            print(f"conv2d {tuple(x.shape)} in {x.stride()} weight {conv.weight.stride()} -> out {y.stride()}", flush=True)
        return y

    saved = (fast.causal_pad_cl, fast.bias_residual_add, K.causal_pad_cl)
    fast.causal_pad_cl = spy("causal_pad_cl", saved[0])
    K.causal_pad_cl = spy("causal_pad_cl", saved[2])  # the exact tile path at norm-free sites
    fast.bias_residual_add = spy("bias_residual_add", saved[1])
    ref = getattr(ops.dupup_add, "reference", ops.dupup_add)
    def conv3d_spy(conv: Any, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
        y = conv3d(conv, x, bias=bias)
        if chunk[0] == 2 and not y.is_contiguous(memory_format=torch.channels_last_3d):
            print(f"conv3d {tuple(x.shape)} in {x.stride()} weight {conv.weight.stride()} -> out {y.stride()} "
                  "(not channels_last_3d)", flush=True)
        return y

    conv2d, conv3d = ops.conv2d, ops.conv3d
    ops = dataclasses.replace(
        ops, dupup_add=FusedOp("dupup_add", spy("dupup_add", K.dupup_add), ref), conv2d=conv2d_spy, conv3d=conv3d_spy
    )
    try:
        n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
        cache: list = [None] * n
        with torch.inference_mode(), P.using(ops):
            x = P.to_decoder_layout(vae.post_quant_conv(z), "channels_last")  # as on the GPU (CPU convs pick)
            for i in range(3):
                chunk[0] = i
                vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
    finally:
        fast.causal_pad_cl, fast.bias_residual_add, K.causal_pad_cl = saved
    return calls


def describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    x = args[0]
    if name == "causal_pad_cl":
        cache = args[1]
        flags = []
        if kwargs.get("norm_cl") is not None:
            flags.append("norm" + ("+bias" if kwargs["norm_cl"].x_bias is not None else ""))
        if kwargs.get("norm") is not None:
            flags.append("exact-norm")
        if kwargs.get("unfold"):
            flags.append(f"unfold{kwargs['unfold']}")
        return f"{name} x{tuple(x.shape)} cache{0 if cache is None else cache.shape[2]} {' '.join(flags) or 'pad'}"
    if name == "bias_residual_add":
        return f"{name} {tuple(x.shape)} bias={'yes' if len(args) > 2 and args[2] is not None else 'no'}"
    return f"{name} main{tuple(x.shape)} source{tuple(args[1].shape)}"


def report(calls: list[Call], reps: int) -> None:
    groups: dict[str, list[Call]] = collections.defaultdict(list)
    for c in calls:
        groups[describe(c[0], c[2], c[3])].append(c)
    print(f"\n=== steady chunk: {len(calls)} calls of the fast tier's kernels, {len(groups)} distinct ===", flush=True)
    print(f"{'call':78} {'n':>2} | {'us':>8} {'MB':>8} {'GB/s':>6} | copy-ref us (GB/s)")
    total_s = total_b = 0.0
    with torch.inference_mode():
        for label, group in groups.items():
            _, fn, args, kwargs = group[0]
            out = fn(*args, **kwargs)
            moved = sum(t.numel() * t.element_size() for t in _tensors(args) + _tensors(kwargs) + _tensors(out))
            sec = median_seconds(lambda fn=fn, a=args, k=kwargs: fn(*a, **k), reps, cuda=torch.cuda.is_available())
            src = torch.empty(moved // 2, dtype=torch.uint8, device=args[0].device)  # a copy reads and writes it
            dst = torch.empty_like(src)
            ref = median_seconds(lambda d=dst, s=src: d.copy_(s), reps, cuda=torch.cuda.is_available())
            ref_bytes = 2 * src.numel()
            total_s += sec * len(group)
            total_b += moved * len(group)
            print(f"{label:78} {len(group):>2} | {sec * 1e6:8.1f} {moved / 1e6:8.1f} {moved / sec / 1e9:6.0f} | "
                  f"{ref * 1e6:7.1f} ({ref_bytes / ref / 1e9:4.0f})", flush=True)
    print(f"--- {total_s * 1e3:.2f} ms for {total_b / 1e9:.2f} GB: {total_b / max(total_s, 1e-12) / 1e9:.0f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--hw", default="60x104", help="latent HxW")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-timing", action="store_true", help="only the declines and conv2d layouts")
    args = parser.parse_args()
    h, w = (int(v) for v in args.hw.split("x"))
    vae = load_model(args.model, "cuda", torch.bfloat16, decoder_only=True).vae
    rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, h, w, device="cuda", dtype=torch.bfloat16), "channels_last")
    print(f"{args.model} latent {h}x{w}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    calls = record(vae, z, rep.ops_for("fast"))
    if not args.no_timing:
        report(calls, args.reps)


if __name__ == "__main__":
    main()
