"""Would FP8 (e4m3) convolutions hold the fast tier's quality gate?

The fast tier may trade bits for speed only while its RGB8 PSNR against an fp32 decode
stays within 0.5 dB of stock bf16's (and above 40 dB), on white and on smooth latents.
Hopper's FP8 tensor cores would double the convs' peak, so before any FP8 kernel is
worth writing this asks the quality question alone, with FP8's numerics simulated:

* every selected conv quantizes its input to e4m3 with one dynamic scale per tensor
  (amax / 448, the best a per-tensor scale can do) and its weight with one scale per
  output channel, as an FP8 conv would consume them;
* the conv then runs in fp32 on those dequantized values (TF32 off) with the bias added
  in fp32, and rounds to bf16 once, as an FP8 conv with fp32 accumulation and a bf16
  output would: the e4m3 rounding of the operands is the only error it adds over an
  exact conv. Real FP8 tensor cores accumulate with less than fp32's precision, so a
  real kernel does no better than these figures.

Variants: ``stock-bf16`` (the baseline the gate is relative to), ``fp8-all`` (every
conv) and ``fp8-c<N>`` (only the convs with N input channels, e.g. Wan2.1's 96-channel
full-resolution convs, most of its conv time). All run stock diffusers' decoder (no vaed
kernels), so the convs are the only difference; the reference is the same decode in fp32.

Run (GPU machine, repository root):
    python benchmarks/fp8_gate.py --model random:wan2.1 --size 480,832 --frames 17
    python benchmarks/fp8_gate.py --device cpu --model random:wan2.1-tiny --size 32,48 --frames 5
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# bench_convs lives beside this script (sys.path[0] when run as one; not when imported by path)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_convs import wrapped_convs  # noqa: E402
from vaed.bench import quality, stock_decode  # noqa: E402
from vaed.models import load_model  # noqa: E402

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
GATE_DB = 0.5  # the fast tier's allowance under stock bf16's PSNR
FLOOR_DB = 40.0


def e4m3(t: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """``t`` rounded through float8_e4m3fn with an amax scale (one per dim-0 slice when
    ``per_channel``), returned dequantized in fp32."""
    tf = t.float()
    if per_channel:
        amax = tf.abs().amax(dim=tuple(range(1, tf.dim())), keepdim=True)
    else:
        amax = tf.abs().amax()
    scale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (tf / scale).to(torch.float8_e4m3fn).float() * scale


ConvFn = Callable[..., torch.Tensor]


def fp8_conv(original: ConvFn, selected: Callable[[torch.Tensor], bool]) -> ConvFn:
    """``original`` (F.conv2d or F.conv3d) with e4m3 operands where ``selected(input)``."""

    def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *args: Any,
             **kwargs: Any) -> torch.Tensor:
        if not selected(x):
            return original(x, weight, bias, *args, **kwargs)
        out = original(e4m3(x, per_channel=False), e4m3(weight, per_channel=True),
                       None if bias is None else bias.float(), *args, **kwargs)
        return out.to(x.dtype)

    return conv


def fp8_convs(selected: Callable[[torch.Tensor], bool]) -> AbstractContextManager[None]:
    """Every F.conv2d / F.conv3d call (nn.Conv3d's forward goes through them) under fp8_conv."""
    return wrapped_convs(lambda _kind, original: fp8_conv(original, selected))


def selector(variant: str) -> Callable[[torch.Tensor], bool]:
    if variant == "fp8-all":
        return lambda x: True
    channels = int(variant.removeprefix("fp8-c"))
    return lambda x: x.shape[1] == channels


def smooth_latents(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Low-frequency latents: coarse noise, trilinearly upsampled (the GPU gate test's kind)."""
    b, c, t, h, w = shape
    coarse = torch.randn(b, c, max(t // 2, 1), max(h // 4, 1), max(w // 4, 1), generator=g)
    return F.interpolate(coarse, size=(t, h, w), mode="trilinear", align_corners=False) * 2


def latents(vae: Any, kind: str, size: tuple[int, int], frames: int, seed: int) -> torch.Tensor:
    cfg = vae.config
    st, ss = int(cfg.scale_factor_temporal or 4), int(cfg.scale_factor_spatial or 8)
    shape = (1, int(cfg.z_dim), (frames - 1) // st + 1, size[0] // ss, size[1] // ss)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) if kind == "white" else smooth_latents(shape, g)


def decode(vae: Any, z: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return stock_decode(vae, z).clamp(-1, 1).float().cpu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="480,832", help="H,W of the video")
    parser.add_argument("--frames", type=int, default=17, help="video frames (1 + 4k)")
    parser.add_argument("--variants", default="stock-bf16,fp8-all,fp8-c96,fp8-c192,fp8-c384")
    parser.add_argument("--latents", default="white,smooth")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu with a -tiny model)", file=sys.stderr)
        return 2
    # the fp32 reference and the simulated convs in true fp32: TF32 would round operands to 10 bits
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    h, w = (int(v) for v in args.size.split(","))
    vae32 = load_model(args.model, device, torch.float32).vae
    vae16 = load_model(args.model, device, torch.bfloat16).vae
    print(f"{args.model} {h}x{w}x{args.frames} on {device}; gate: PSNR >= stock bf16's - {GATE_DB} dB "
          f"and >= {FLOOR_DB} dB", flush=True)
    failed = 0
    for kind in args.latents.split(","):
        z = latents(vae32, kind, (h, w), args.frames, args.seed).to(device)
        ref = decode(vae32, z)
        base = math.nan
        for variant in args.variants.split(","):
            zb = z.to(torch.bfloat16)
            if variant == "stock-bf16":
                out = decode(vae16, zb)
            else:
                with fp8_convs(selector(variant)):
                    out = decode(vae16, zb)
            psnr, max_abs = quality(out, ref)
            if variant == "stock-bf16":
                base, verdict = psnr, "baseline"
            else:
                holds = psnr >= base - GATE_DB and psnr >= FLOOR_DB
                failed += not holds
                verdict = f"{psnr - base:+6.2f} dB vs stock bf16: gate {'holds' if holds else 'FAILS'}"
            print(f"{kind:6s} {variant:11s} PSNR {psnr:6.2f} dB  max|RAW| {max_abs:.4f}  {verdict}", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
