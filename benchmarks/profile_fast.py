"""Measure the fast tier against lossless on one GPU, in one run (< 5 min on an H200).

For Wan2.1 480x832x81, Wan2.1 720x1280x81 and Wan2.2 704x1280x121 (bf16,
random weights, white-noise latents; 480p also with smooth latents) prints:

* seconds per whole-video decode (the engine's loop: post_quant_conv, then
  one decoder call per latent frame with a session cache, unpatchify,
  clamp), min of ``--runs`` after a warm-up, and peak memory, for stock
  diffusers (channels_last_3d), ``lossless``, ``lossless-tiled`` (the exact
  2-D channels-last causal-input kernel) and ``fast``;
* bit-identity of lossless and lossless-tiled to stock with that layout;
* PSNR of RGB8 frames and max abs RAW error against an fp32 stock decode of
  the same latents (the fast tier's quality gate: within 0.5 dB of stock bf16 and
  >= 40 dB);
* achieved TFLOP/s for Wan2.1 (3.44 TFLOP per 480x832 frame, scaled by pixels);
* a torch.profiler top-15 kernel table of one steady chunk, lossless and fast,
  with the chunk's GPU time and kernel count.

Run on the GPU machine from the repository root:
    python benchmarks/profile_fast.py            # all cases
    python benchmarks/profile_fast.py --cases wan2.1-480p --runs 3
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vaed import patches as P
from vaed.models import load_model

from profiling import device_seconds, kernel_events

log = logging.getLogger("profile_fast")

CASES: dict[str, tuple[str, tuple[int, int, int]]] = {
    # name: (model spec, (frames, height, width))
    "wan2.1-480p": ("random:wan2.1", (81, 480, 832)),
    "wan2.1-720p": ("random:wan2.1", (81, 720, 1280)),
    "wan2.2-704p": ("random:wan2.2", (121, 704, 1280)),
    # smoke test of this script on a CPU: TRITON_INTERPRET=1 ... --cases tiny --device cpu
    "tiny": ("random:wan2.2-tiny", (5, 32, 32)),
}
DEFAULT_CASES = ("wan2.1-480p", "wan2.1-720p", "wan2.2-704p")
DEVICE = "cuda"
WAN21_TFLOP_PER_480P_FRAME = 3.44  # summed over the decoder's conv shapes (2 * MACs)


def latent_shape(vae: Any, frames: int, height: int, width: int) -> tuple[int, ...]:
    cfg = vae.config
    t = (frames - 1) // cfg.scale_factor_temporal + 1
    return (1, cfg.z_dim, t, height // cfg.scale_factor_spatial, width // cfg.scale_factor_spatial)


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def smooth_latents(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Low-frequency latents: coarse noise, trilinearly upsampled (structured content), on the
    generator's device (bench_http.py makes them on the CPU)."""
    b, c, t, h, w = shape
    coarse = torch.randn(b, c, max(t // 3, 2), max(h // 8, 2), max(w // 8, 2), generator=g, device=g.device)
    return F.interpolate(coarse, size=(t, h, w), mode="trilinear", align_corners=False) * 2


def num_convs(vae: Any) -> int:
    return sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")


@torch.inference_mode()
def decode(vae: Any, z: torch.Tensor, ops: P.OpSet | None, *, stop_after: int | None = None) -> tuple[torch.Tensor, list]:
    """The engine's loop over the whole video; returns (clamped RAW [B, 3, T, H, W], cache)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    cache: list = [None] * num_convs(vae)
    x = vae.post_quant_conv(z)
    n = x.shape[2] if stop_after is None else stop_after
    outs = []
    for i in range(n):
        if ops is None:
            out = vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
        else:
            with P.using(ops):
                out = vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        outs.append(out.clamp(-1.0, 1.0))
    return torch.cat(outs, 2), cache


def timed(fn: Callable[[], torch.Tensor], runs: int) -> tuple[float, float, torch.Tensor]:
    """(min seconds, peak GiB, last output)."""
    best = math.inf
    out = None
    cuda = DEVICE.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(runs):
        out = None
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan
    assert out is not None
    return best, peak, out


def rgb8(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() * 0.5 + 0.5).clamp(0, 1) * 255).round()


def psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (rgb8(a) - rgb8(ref)).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def max_abs(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.float() - ref.float()).abs().max().item()


@torch.inference_mode()
def profile_chunk(vae: Any, z: torch.Tensor, ops: P.OpSet | None, label: str, shapes: bool = False) -> None:
    """Top-15 kernels of one steady chunk (latent frame k = 4, cache filled by frames 0..k-1);
    ``shapes``: also the top-25 aten ops by input shapes (where copies and adds come from)."""
    from torch.profiler import ProfilerActivity, profile

    k = min(4, z.shape[2] - 1)
    _, cache = decode(vae, z[:, :, :k], ops)
    x = vae.post_quant_conv(z[:, :, k : k + 1])
    run = lambda: vae.decoder(x, feat_cache=[c for c in cache], feat_idx=[0], first_chunk=False)
    if ops is not None:
        with P.using(ops):
            run()
    else:
        run()
    sync()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if DEVICE.startswith("cuda") else [ProfilerActivity.CPU]
    with profile(activities=acts, record_shapes=shapes) as prof:
        if ops is not None:
            with P.using(ops):
                run()
        else:
            run()
        sync()
    try:
        kernels = kernel_events(prof)
        total_s = sum(device_seconds(e) for e in kernels)
        print(f"\n--- {label}: one steady chunk: {len(kernels)} GPU events, {total_s * 1000:.2f} ms GPU")
    except Exception as e:  # noqa: BLE001 - profiler event fields move between torch releases
        print(f"\n--- {label}: one steady chunk (event count unavailable: {e})")
    sort = "self_device_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=70)
    except Exception:  # noqa: BLE001 - older torch names it cuda
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70)
    print(table, flush=True)
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True)
        # convolutions are in the kernel table above; these are the rest (copies, adds, norms)
        rest = (e for e in by_shape if e.key.startswith("aten::") and "conv" not in e.key)
        rows = sorted(rest, key=lambda e: -device_seconds(e))[:25]
        print(f"--- {label}: aten ops other than convolutions, by input shapes (device ms, calls, shapes)")
        for e in rows:
            print(f"{device_seconds(e) * 1e3:8.3f} {e.count:4d}  {e.key:28s} {str(e.input_shapes)[:160]}")


def free(*objs: Any) -> None:
    del objs
    gc.collect()
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


def run_case(name: str, runs: int, smooth: bool, do_profile: bool, profile_only: bool = False, shapes: bool = False,
             profile_tiers: tuple[str, ...] = ("fast",)) -> dict[str, Any]:
    spec, (frames, height, width) = CASES[name]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"\n==================== {name}: {spec} {height}x{width}x{frames} bf16 ====================", flush=True)

    if profile_only:
        vae = load_model(spec, DEVICE, torch.bfloat16, decoder_only=True).vae
        rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        z = torch.randn(latent_shape(vae, frames, height, width), generator=g, device=DEVICE)
        zb1 = P.to_decoder_layout(z.to(torch.bfloat16), "channels_last")
        for tier in profile_tiers:
            profile_chunk(vae, zb1, rep.ops_for(tier), f"{name} {tier}", shapes=shapes)
        free(vae)
        return {}
    # fp32 stock reference (plain diffusers: contiguous, nothing installed)
    vae32 = load_model(spec, DEVICE, torch.float32, decoder_only=True).vae
    shape = latent_shape(vae32, frames, height, width)
    latents = {"white": torch.randn(shape, generator=g, device=DEVICE)}
    if smooth:
        latents["smooth"] = smooth_latents(shape, g)
    P.prepare_decoder(vae32, kernels="off", layout="contiguous")
    refs = {}
    for kind, z in latents.items():
        t0 = time.perf_counter()
        refs[kind] = decode(vae32, z.contiguous(), None)[0]
        sync()
        print(f"fp32 stock reference ({kind} latents): {time.perf_counter() - t0:.2f} s", flush=True)
    free(vae32)
    del vae32

    vae = load_model(spec, DEVICE, torch.bfloat16, decoder_only=True).vae
    rep = P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
    print("install:", rep.summary, flush=True)
    for s in rep.skipped:
        print("  skipped:", s)
    variants: dict[str, P.OpSet | None] = {
        "stock-cl3d": None,
        "lossless": rep.ops_for("lossless"),
        "lossless-tiled": P.LOSSLESS_TILED_OPS,
        "fast": rep.ops_for("fast"),
    }
    zb = {k: P.to_decoder_layout(z.to(torch.bfloat16), "channels_last") for k, z in latents.items()}
    tflop = None
    if spec.startswith("random:wan2.1"):
        tflop = WAN21_TFLOP_PER_480P_FRAME * (height * width) / (480 * 832) * frames
    results: dict[str, Any] = {}
    stock_out: torch.Tensor | None = None
    p_stock = p_fast = math.nan
    for label, ops in variants.items():
        if ops is None:
            P.remove_fast_paths(vae)  # the stock forwards, same channels_last weights
        elif P.installed_report(vae) is None:
            P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        decode(vae, zb["white"], ops, stop_after=2)  # first-use costs at this shape (first + steady chunk)
        secs, peak, out = timed(lambda ops=ops: decode(vae, zb["white"], ops)[0], runs)
        p = psnr(out, refs["white"])
        line = f"{label:15s} {secs:7.3f} s  peak {peak:5.1f} GiB"
        if tflop is not None:
            line += f"  {tflop / secs:6.1f} TFLOP/s"
        line += f"  PSNR {p:6.2f} dB  max|RAW err| {max_abs(out, refs['white']):.4f}"
        if stock_out is None:
            stock_out, p_stock = out, p
        else:
            line += f"  bit-identical to stock-cl3d: {'yes' if torch.equal(out, stock_out) else 'no'}"
        if label == "fast":
            p_fast = p
        print(line, flush=True)
        results[label] = secs
        if "smooth" in zb and label in ("stock-cl3d", "fast"):
            o = decode(vae, zb["smooth"], ops)[0]
            print(f"{'':15s} smooth latents: PSNR {psnr(o, refs['smooth']):6.2f} dB  max|RAW err| {max_abs(o, refs['smooth']):.4f}")
            del o
        del out
        free()
    ok = p_fast >= p_stock - 0.5 and p_fast >= 40.0
    print(f"gate: fast {p_fast:.2f} dB vs stock bf16 {p_stock:.2f} dB -> {'PASS' if ok else 'FAIL'}", flush=True)
    del stock_out, refs
    if do_profile:
        if P.installed_report(vae) is None:
            P.prepare_decoder(vae, kernels="triton", layout="channels_last", tiers=("lossless", "fast"))
        profile_chunk(vae, zb["white"], variants["lossless"], f"{name} lossless")
        profile_chunk(vae, zb["white"], variants["fast"], f"{name} fast", shapes=shapes)
    free(vae)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    parser.add_argument("--device", default="cuda:0", help="cpu only for a smoke test under TRITON_INTERPRET=1")
    parser.add_argument("--runs", type=int, default=2, help="timed runs per variant (min is reported)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile-only", action="store_true", help="only the steady-chunk profiles of --tiers")
    parser.add_argument("--tiers", nargs="+", default=["fast"], choices=["lossless", "fast"],
                        help="with --profile-only: the tiers to profile (default: fast)")
    parser.add_argument("--shapes", action="store_true", help="also list the fast chunk's aten ops by input shapes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    global DEVICE
    DEVICE = args.device
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu under TRITON_INTERPRET=1 for a smoke test)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if DEVICE.startswith("cuda") else "cpu"
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {name}")
    t0 = time.perf_counter()
    summary = {}
    for name in args.cases:
        smooth = name in ("wan2.1-480p", "tiny")
        summary[name] = run_case(name, args.runs, smooth=smooth, do_profile=not args.no_profile,
                                 profile_only=args.profile_only, shapes=args.shapes, profile_tiers=tuple(args.tiers))
    print("\n==================== summary (seconds, min of runs) ====================")
    for case, res in summary.items():
        if not res:  # --profile-only
            continue
        base = res["lossless"]
        print(f"{case:12s} " + "  ".join(f"{k} {v:.3f} ({base / v:.2f}x of lossless)" for k, v in res.items()))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
