"""Time each decoder convolution of one chunk against conv2d formulations (one GPU run).

The fast tier spends ~64 % of a steady 480p chunk in cuDNN's conv3d, much of
it in an sm80 implicit-GEMM family. This probe records every conv the Wan
decoder runs for the first chunk and for a steady chunk (bf16,
channels_last_3d, random weights), then for each distinct call times:

* ``conv3d``   -- what vaed runs now (``F.conv3d`` on the pre-padded input);
* ``unfold2d`` -- the kt time taps unfolded into channels, one ``F.conv2d``
  with K = kt*kh*kw*C (the unfold copy timed apart as ``unfold``);
* ``sum2d``    -- kt ``F.conv2d`` calls on time-shifted views, summed;
* ``last2d``   -- first chunk only: the history frames are zeros, so only
  the last time tap contributes (one ``F.conv2d``);
* ``gemm``     -- 1x1x1 convs as one ``F.linear`` over the pixels;
* ``nobias``   -- the call without its bias (torch adds a cuDNN conv's bias
  in a separate pass: the difference is that pass).

Each with its max abs error against an fp32 conv3d of the same bf16 inputs,
and the whole chunk's total per variant (each call at its best variant).
Also prints the top kernels of conv3d vs unfold2d on the largest call.

    python scripts/probe_conv.py                 # Wan2.1 480x832
    python scripts/probe_conv.py --model random:wan2.2 --hw 44x80
"""

from __future__ import annotations

import argparse
import collections
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vaed import patches as P
from vaed.models import load_model

from profiling import median_seconds

Call = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]  # x shape, weight shape, conv stride, bias


def record_calls(vae: Any, z: torch.Tensor, dev: str) -> dict[str, collections.Counter]:
    """Decode 3 latent frames with stock diffusers, counting conv calls of chunk 0 and chunk 2."""
    counts = {"first": collections.Counter(), "steady": collections.Counter()}
    chunk = [-1]
    orig3, orig2 = nn.Conv3d._conv_forward, nn.Conv2d._conv_forward

    def log(kind: str, x: torch.Tensor, w: torch.Tensor, b: Any, stride: Any) -> None:
        name = {0: "first", 2: "steady"}.get(chunk[0])
        if name is not None:
            counts[name][(kind, tuple(x.shape), tuple(w.shape), tuple(stride), b is not None)] += 1

    def conv3(self, x, w, b):  # noqa: ANN001
        log("3d", x, w, b, self.stride)
        return orig3(self, x, w, b)

    def conv2(self, x, w, b):  # noqa: ANN001
        log("2d", x, w, b, self.stride)
        return orig2(self, x, w, b)

    nn.Conv3d._conv_forward, nn.Conv2d._conv_forward = conv3, conv2
    try:
        with torch.inference_mode():
            cache: list = [None] * sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
            x = vae.post_quant_conv(z)
            for i in range(3):
                chunk[0] = i
                vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
    finally:
        nn.Conv3d._conv_forward, nn.Conv2d._conv_forward = orig3, orig2
    return counts


def unfold_time(x: torch.Tensor, kt: int) -> torch.Tensor:
    """(B, C, T+kt-1, H, W) cl3d -> (B*T, kt*C, H, W) channels_last, channel = tap*C + c."""
    b, c, tp, h, w = x.shape
    t = tp - kt + 1
    xt = x.permute(0, 2, 3, 4, 1)  # B Tp H W C (a view of cl3d memory)
    taps = torch.stack([xt[:, k : k + t] for k in range(kt)], dim=-2)  # B T H W kt C
    return taps.reshape(b * t, h, w, kt * c).permute(0, 3, 1, 2)


def weight_2d(w: torch.Tensor) -> torch.Tensor:
    co, ci, kt, kh, kw = w.shape
    return w.permute(0, 2, 1, 3, 4).reshape(co, kt * ci, kh, kw).contiguous(memory_format=torch.channels_last)


def frames_2d(x: torch.Tensor) -> torch.Tensor:
    """(1, C, T, H, W) cl3d -> (T, C, H, W) channels_last view."""
    return x[0].permute(1, 0, 2, 3)


def flops(kind: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: tuple[int, ...]) -> float:
    if kind == "2d":
        n, _, h, w = x_shape
        co, ci, kh, kw = w_shape
        return 2.0 * n * (h - kh + 1) * (w - kw + 1) * co * ci * kh * kw
    b, _, t, h, w = x_shape
    co, ci, kt, kh, kw = w_shape
    return 2.0 * b * (t - kt + 1) * (h - kh + 1) * (w - kw + 1) * co * ci * kt * kh * kw


def probe(vae: Any, counts: collections.Counter, label: str, dev: str, reps: int, dtype: torch.dtype) -> None:
    run = lambda fn: median_seconds(fn, reps, cuda=dev.startswith("cuda"))  # noqa: E731
    g = torch.Generator(device=dev).manual_seed(0)
    totals: dict[str, float] = collections.defaultdict(float)
    total_flop = 0.0
    print(f"\n=== {label} chunk: {sum(counts.values())} conv calls, {len(counts)} distinct ===", flush=True)
    print(f"{'kind':4} {'input':26} {'weight':22} {'n':>2} {'GFLOP':>7} | variant ms (TFLOP/s, max err vs fp32)")
    largest: tuple[float, Any] = (0.0, None)
    for (kind, xs, ws, stride, has_b), n in sorted(counts.items(), key=lambda kv: -flops(kv[0][0], kv[0][1], kv[0][2], kv[0][3])):
        fl = flops(kind, xs, ws, stride)
        total_flop += n * fl
        mf = torch.channels_last_3d if kind == "3d" else torch.channels_last
        x = torch.randn(xs, generator=g, device=dev).to(dtype).contiguous(memory_format=mf)
        w = (torch.randn(ws, generator=g, device=dev) / math.sqrt(math.prod(ws[1:]))).to(dtype).contiguous(memory_format=mf)
        b = torch.randn(ws[0], generator=g, device=dev).to(dtype) if has_b else None
        conv = F.conv3d if kind == "3d" else F.conv2d
        pad = 0 if kind == "3d" else 1  # WanResample's conv2d pads itself; causal convs are pre-padded
        ref = conv(x.float(), w.float(), None if b is None else b.float(), stride, pad)
        variants: dict[str, Callable[[], torch.Tensor]] = {"conv3d" if kind == "3d" else "conv2d": lambda: conv(x, w, b, stride, pad)}
        if b is not None:  # what the separate bias pass costs (torch adds a conv's bias after cuDNN)
            variants["nobias"] = lambda: conv(x, w, None, stride, pad)
        results: dict[str, tuple[float, float]] = {}
        if kind == "3d" and ws[2:] == (1, 1, 1) and xs[0] == 1:
            wl = w.reshape(ws[0], ws[1])
            xl = x.permute(0, 2, 3, 4, 1).reshape(-1, ws[1])  # a view of cl3d memory
            variants["gemm"] = lambda: F.linear(xl, wl, b)
        if kind == "3d" and xs[0] == 1 and stride == (1, 1, 1):
            kt = ws[2]
            t = xs[2] - kt + 1
            w2 = weight_2d(w)
            if kt > 1:
                xu = unfold_time(x, kt).contiguous(memory_format=torch.channels_last)
                variants["unfold"] = lambda: unfold_time(x, kt).contiguous(memory_format=torch.channels_last)
                variants["unfold2d"] = lambda: F.conv2d(xu, w2, b)
                taps = [w[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(kt)]
                views = [frames_2d(x[:, :, k : k + t]) for k in range(kt)]

                def sum2d() -> torch.Tensor:
                    y = F.conv2d(views[0], taps[0], b)
                    for k in range(1, kt):
                        y += F.conv2d(views[k], taps[k])
                    return y

                variants["sum2d"] = sum2d
                if label == "first" and t == 1:
                    last = frames_2d(x[:, :, kt - 1 : kt])
                    variants["last2d"] = lambda: F.conv2d(last, taps[kt - 1], b)
        for name, fn in variants.items():
            sec = run(fn)
            out = fn()
            if name == "unfold":
                err = math.nan
            else:
                if out.dim() == 4 and kind == "3d":
                    out = out.permute(1, 0, 2, 3).unsqueeze(0) if name != "gemm" else out
                if name == "gemm":
                    out = out.reshape(xs[0], xs[2], xs[3], xs[4], ws[0]).permute(0, 4, 1, 2, 3)
                if name == "last2d":  # the zero-history reference: the same conv with the history zeroed
                    xz = x.clone()
                    xz[:, :, : kt - 1] = 0
                    ref_v = conv(xz.float(), w.float(), None if b is None else b.float(), stride, pad)
                    err = (out.float() - ref_v).abs().max().item()
                else:
                    err = (out.float() - ref).abs().max().item() if name != "nobias" else math.nan
            results[name] = (sec, err)
        base = next(iter(results))
        # what the call would cost at its best formulation (an unfold2d pays for its copy)
        costs = {k: sec for k, (sec, _) in results.items() if k not in ("unfold", "unfold2d", "nobias")}
        if "unfold2d" in results:
            costs["unfold2d"] = results["unfold2d"][0] + results["unfold"][0]
        totals["now"] += n * results[base][0]
        totals["best"] += n * min(costs.values())
        parts = []
        for k, (s, e) in results.items():
            tf = "" if k == "unfold" else f" {fl / s / 1e12:.0f}T"
            parts.append(f"{k} {s * 1e3:.3f}{tf}" + ("" if math.isnan(e) else f" e{e:.1e}"))
        print(f"{kind:4} {str(xs):26} {str(ws):22} {n:>2} {fl / 1e9:7.1f} | " + ", ".join(parts), flush=True)
        if kind == "3d" and "unfold2d" in variants and fl > largest[0]:
            largest = (fl, (variants[base], variants["unfold2d"], f"{xs} {ws}"))
    print(f"--- {label}: {total_flop / 1e12:.3f} TFLOP in convs; now {totals['now'] * 1e3:.2f} ms "
          f"({total_flop / max(totals['now'], 1e-12) / 1e12:.0f} TFLOP/s), each call at its best variant "
          f"(unfold copy counted) {totals['best'] * 1e3:.2f} ms", flush=True)
    if dev.startswith("cuda") and largest[1] is not None:
        from torch.profiler import ProfilerActivity, profile

        now, alt, what = largest[1]
        for name, fn in (("conv3d", now), ("unfold2d", alt)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            print(f"kernels of {name} on {what}: {names}", flush=True)


def profile_first_chunk(vae: Any, z: torch.Tensor, dev: str) -> None:
    """Kernel table of the lossless first chunk (the first frame's GPU time, issue #10)."""
    from torch.profiler import ProfilerActivity, profile

    rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless",))
    ops = rep.ops_for("lossless")
    n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    with torch.inference_mode(), P.using(ops):
        x = vae.post_quant_conv(z[:, :, :1])
        run = lambda: vae.decoder(x, feat_cache=[None] * n, feat_idx=[0], first_chunk=True)  # noqa: E731
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in events) / 1e3
    print(f"\n=== lossless first chunk: {len(events)} GPU events, {total:.2f} ms GPU ===")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=90), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--hw", default="60x104", help="latent HxW")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    dev, dtype = args.device, torch.bfloat16
    h, w = (int(v) for v in args.hw.split("x"))
    vae = load_model(args.model, dev, dtype, decoder_only=True).vae
    P.prepare_decoder(vae, kernels="off", layout="channels_last")  # stock forwards, vaed's weight layout
    z = torch.randn(1, vae.config.z_dim, 3, h, w, device=dev, dtype=dtype).contiguous(memory_format=torch.channels_last_3d)
    counts = record_calls(vae, z, dev)
    if dev.startswith("cuda"):
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    for label in ("first", "steady"):
        probe(vae, counts[label], label, dev, args.reps, dtype)
    if dev.startswith("cuda"):
        profile_first_chunk(vae, z, dev)


if __name__ == "__main__":
    main()
