"""``vaed bench``: stock diffusers vs vaed's lossless decode, one process, same weights and latents.

Variants per case:

* ``stock``        -- ``AutoencoderKLWan.decode`` with contiguous weights and latents
* ``stock-cl3d``   -- the same with channels_last_3d Conv3d weights and latents
* ``vaed-lossless``-- the server's decode: per-latent-frame decoder calls on a
  session-owned cache, fused kernels installed, channels_last_3d, clamp
* ``vaed-fast``    -- the same engine and weights, the fast tier's op set

``--psnr`` adds the quality gate of the fast tier: PSNR of RGB8 frames and max
abs RAW error of each variant against an fp32 stock decode of the same latents
and weights (one extra fp32 decode per case). TFLOP/s uses the Wan2.1
decoder's ~3.44 TFLOP per 480x832 frame, scaled by pixels (n/a for others).

``--op encode`` times the encoder instead, on seeded frames in [-1, 1]:
``stock`` / ``stock-cl3d`` are ``AutoencoderKLWan.encode`` with that layout
(weights and frames), ``vaed-lossless`` the server's encode (one encoder
call per latent frame on a session-owned cache, quant_conv per call, fused
kernels installed, channels_last_3d); bit-identity is that of the moments.
There is no fast encode tier (``vaed-fast`` is skipped), nor ``--psnr``.

``--cuda-graphs on`` runs the vaed variants with their decoder calls replayed
from CUDA graphs (``vaed.graphs``; the warm-up then also captures them).

Seconds are the min over ``--reps`` after one warm-up decode up to the steady chunk (Triton
compiles, cuDNN plans); peak is ``torch.cuda.max_memory_allocated`` during the
timed decodes. "bit-identical" compares with ``torch.equal`` against the stock
variant of the same layout (channels_last_3d for vaed-lossless).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .choices import ConvPlans, CudaGraphs, Kernels, Layout, Precision
from .models import RANDOM_CONFIGS
from .startup import conv_plan_file

log = logging.getLogger(__name__)

DEFAULT_CASES = ("wan2.1:480x832x81", "wan2.1:720x1280x81", "wan2.2:704x1280x121")
VARIANTS = ("stock", "stock-cl3d", "vaed-lossless", "vaed-fast")
# Wan2.1 decoder FLOPs per output pixel (279 TFLOP for 81 frames of 480x832).
WAN21_FLOP_PER_PIXEL = 3.44e12 / (480 * 832)
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
# What `vaed bench` without CUDA suggests: the default cases take hours on a CPU.
CPU_EXAMPLE = "--device cpu --dtype fp32 --case wan2.1-tiny:64x64x17"
_CASE_RE = re.compile(r"^(?:(?P<arch>[\w.\-]+):)?(?P<h>\d+)x(?P<w>\d+)x(?P<f>\d+)$")


@dataclass(frozen=True)
class Case:
    arch: str  # "wan2.1" / "wan2.2" (random weights) unless --model is given
    height: int
    width: int
    frames: int

    @property
    def name(self) -> str:
        return f"{self.arch} {self.height}x{self.width}x{self.frames}"


@dataclass
class Row:
    case: str
    variant: str
    seconds: float
    speedup: float
    peak_gib: float
    bit_identical: str  # "ref", "yes", "no"
    reference: str
    tflops: float = float("nan")
    psnr_db: float = float("nan")       # RGB8 vs an fp32 stock decode (--psnr)
    max_abs_raw: float = float("nan")   # RAW vs the same fp32 decode (--psnr)


def parse_case(text: str) -> Case:
    m = _CASE_RE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"case must look like [wan2.1:]480x832x81, got {text!r}")
    case = Case(m["arch"] or "wan2.1", int(m["h"]), int(m["w"]), int(m["f"]))
    if case.arch not in RANDOM_CONFIGS:
        raise argparse.ArgumentTypeError(f"unknown architecture {case.arch!r} in {text!r}; "
                                         f"known: {', '.join(RANDOM_CONFIGS)}")
    if case.frames % 4 != 1:  # Wan's causal VAE: frame 0, then 4 per latent frame
        raise argparse.ArgumentTypeError(f"frames must be 1 + 4k (Wan's VAE), got {case.frames} in {text!r}")
    # the architecture's pixels per latent (8; Wan2.2's 2x2 patches make 16): checked here, not
    # with a traceback once the case's model has loaded
    spatial = int(RANDOM_CONFIGS[case.arch].get("scale_factor_spatial", 8))
    if case.height % spatial or case.width % spatial or not case.height or not case.width:
        raise argparse.ArgumentTypeError(f"height and width must be multiples of {spatial} for {case.arch}, "
                                         f"got {case.height}x{case.width} in {text!r}")
    return case


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", dest="cases", action="append", type=parse_case, metavar="[ARCH:]HxWxF",
                        help=f"case to run (repeatable); default: {', '.join(DEFAULT_CASES)}")
    parser.add_argument("--model", default=None,
                        help="model spec for every case (local folder, hub id, random:wan2.1[?seed=N]); "
                             "default: random:<case arch>")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--device", default="cuda",
                        help="torch device; cpu works with --dtype fp32 and a small case (default %(default)s)")
    parser.add_argument("--reps", type=int, default=2, help="timed decodes per variant (min is reported)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--kernels", default=Kernels.AUTO, choices=Kernels.values(),
                        help="fused kernels for vaed-lossless")
    parser.add_argument("--cuda-graphs", choices=CudaGraphs.values(), default=CudaGraphs.OFF,
                        help="vaed variants replay captured decoder calls (vaed serve --cuda-graphs)")
    parser.add_argument("--conv-plans", choices=ConvPlans.values(), default=ConvPlans.OFF,
                        help="the vaed variants' convs on tuned cuDNN plans (vaed serve --conv-plans; "
                             "vaed-lossless's with torch's bits); the plan file is the kernel cache's")
    parser.add_argument("--seed", type=int, default=0, help="latents seed")
    parser.add_argument("--psnr", action="store_true", help="PSNR / max abs error against an fp32 stock decode")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write rows as JSON")
    parser.add_argument("--op", choices=("decode", "encode"), default="decode",
                        help="what to time: the decoder (latents -> frames) or the encoder (frames -> moments)")


def _load(spec: str, device: torch.device, dtype: torch.dtype) -> Any:
    from vaed.models import load_model

    return load_model(spec, device, dtype).vae


class CaseError(ValueError):
    """A case the loaded model cannot run (a --model whose scale factors differ from the case's
    architecture's, which `parse_case` checked)."""


def _latent_shape(vae: Any, case: Case) -> tuple[int, int, int, int, int]:
    cfg = vae.config
    st = int(cfg.scale_factor_temporal or 4)
    ss = int(cfg.scale_factor_spatial or 8)
    if (case.frames - 1) % st or case.height % ss or case.width % ss:
        raise CaseError(f"{case.name}: frames must be 1 + {st}k and sides multiples of {ss} for this model")
    return (1, int(cfg.z_dim), (case.frames - 1) // st + 1, case.height // ss, case.width // ss)


def stock_decode(vae: Any, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z, return_dict=False)[0]


def stock_warm_up(vae: Any, z: torch.Tensor) -> None:
    """Stock's decode of the first latent frames, up to the steady chunk."""
    from vaed.engine import WARMUP_LATENT_FRAMES

    stock_decode(vae, z[:, :, :WARMUP_LATENT_FRAMES])


Decode = Callable[[Any, torch.Tensor], torch.Tensor]
WarmUp = Callable[[torch.Tensor], None]


def vaed_decoder(
    vae: Any, spec: str, kernels: str, precision: str, cuda_graphs: str = CudaGraphs.OFF,
    conv_plans: str = ConvPlans.OFF,
) -> tuple[Decode, WarmUp, Callable[[], None]] | None:
    """The server's own decode path (DecodeEngine: session-owned cache, one decoder call per
    latent frame, fast paths installed, clamp), as a decode function, its warm-up (the conv
    plans' tuning first, with ``conv_plans`` tune) and its close."""
    from vaed.engine import DecodeEngine, OutputSpec, warm_up
    from vaed.models import LoadedModel

    if conv_plans == ConvPlans.TUNE:  # the tuning's progress lines (the command logs warnings only)
        logging.getLogger("vaed.engine").setLevel(logging.INFO)
    plan_file = conv_plan_file() if conv_plans != ConvPlans.OFF else None
    engine = DecodeEngine(LoadedModel(vae=vae, spec=spec, random_weights=spec.startswith("random:")),
                          kernels=kernels, layout=Layout.CHANNELS_LAST, cuda_graphs=cuda_graphs,
                          conv_plans=conv_plans, conv_plan_file=plan_file)
    if precision not in engine.precisions:
        log.warning("vaed-%s skipped: tier not available here (%s)", precision, engine.fast_paths.summary)
        engine.close()
        return None
    log.info("vaed-%s: %s%s", precision, engine.fast_paths.summary, ", CUDA graphs" if engine.graphs else "")
    raw = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True, precision=precision)

    def warm(z: torch.Tensor) -> None:
        hw = (int(z.shape[-2]), int(z.shape[-1]))
        engine.prepare_conv_plans([hw], (Precision(precision),))
        warm_up(engine, hw, precision)

    return (lambda _vae, z: engine.decode_video(z, raw)), warm, engine.close


def _nothing() -> None:
    """A stock variant's close: it holds no engine."""


def _rgb8(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() * 0.5 + 0.5).clamp(0, 1) * 255).round()


def quality(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(PSNR in dB of RGB8 frames, max abs difference of RAW) against a reference decode."""
    mse = float(((_rgb8(out) - _rgb8(ref)) ** 2).mean())
    psnr = float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)
    return psnr, float((out.float() - ref.float()).abs().max())


def fp32_reference(spec: str, z: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Stock diffusers in float32, contiguous, same weights (seeded) and latents."""
    vae = _load(spec, device, torch.float32)
    with torch.inference_mode():
        out = stock_decode(vae, z.float().contiguous()).clamp(-1, 1).cpu()
    del vae
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _bit_identity(refs: dict[str, torch.Tensor], variant: str, ref_key: str, out: torch.Tensor) -> str:
    """"ref" for the reference variant (kept in `refs` for the others), else "yes"/"no" by
    torch.equal against it, "n/a" when the reference was not run."""
    if variant == ref_key:
        refs[variant] = out
        return "ref"
    if ref_key in refs:
        return "yes" if torch.equal(refs[ref_key], out) else "no"
    return "n/a"


def _time(fn: Callable[[], torch.Tensor], reps: int, device: torch.device) -> tuple[float, float, torch.Tensor]:
    best = float("inf")
    out = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(max(1, reps)):
        out = None  # drop the previous output before the next decode (peak memory)
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    assert out is not None
    return best, peak, out


def _frames_shape(vae: Any, case: Case) -> tuple[int, int, int, int, int]:
    _latent_shape(vae, case)  # the same checks
    return (1, 3, case.frames, case.height, case.width)


def run_encode_case(case: Case, args: argparse.Namespace, variants: tuple[str, ...]) -> list[Row]:
    """``--op encode``: stock encode per layout, then the engine's encode on the same weights."""
    from vaed.engine import DecodeEngine
    from vaed.engine_protocol import EncodeSpec
    from vaed.models import LoadedModel
    from vaed.patches import prepare_decoder, remove_fast_paths, to_decoder_layout

    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    spec = args.model or f"random:{case.arch}"
    vae = _load(spec, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = (torch.rand(_frames_shape(vae, case), generator=gen) * 2 - 1).to(device=device, dtype=dtype)
    rows: list[Row] = []
    refs: dict[str, torch.Tensor] = {}
    base: float | None = None
    for variant in variants:
        if variant == "vaed-fast":
            log.warning("vaed-fast skipped: there is no fast encode tier")
            continue
        if variant in ("stock", "stock-cl3d"):
            layout = Layout.CONTIGUOUS if variant == "stock" else Layout.CHANNELS_LAST
            prepare_decoder(vae, kernels=Kernels.OFF, layout=layout)
            xi, ref_key = to_decoder_layout(x, layout), variant
            def fn(xx: torch.Tensor, model: Any = vae) -> torch.Tensor:
                return model.encode(xx).latent_dist.parameters
        else:
            engine = DecodeEngine(LoadedModel(vae=vae, spec=spec, random_weights=spec.startswith("random:")),
                                  kernels=args.kernels, layout=Layout.CHANNELS_LAST)
            log.info("vaed-lossless encode: %s", engine.fast_paths.summary)
            xi, ref_key = x, "stock-cl3d"
            def fn(xx: torch.Tensor, model: Any = engine) -> torch.Tensor:
                return model.encode_video(xx, EncodeSpec())[0]
        with torch.inference_mode():
            fn(xi[:, :, :5])  # the first call and a steady one: Triton compiles, cuDNN plans
            secs, peak, out = _time(functools.partial(fn, xi), args.reps, device)
        out_cpu = out.cpu()
        del out
        ident = _bit_identity(refs, variant, ref_key, out_cpu)
        if variant == "stock":
            base = secs
        speed = (base / secs) if base else float("nan")
        rows.append(Row(f"{case.name} encode", variant, secs, speed, peak, ident, ref_key))
        print(f"[bench] {case.name + ' encode':<24} {variant:<14} {secs:7.3f} s  x{speed:5.2f}  "
              f"peak {peak:6.2f} GiB  bit-identical={ident}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    remove_fast_paths(vae)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_case(case: Case, args: argparse.Namespace, variants: tuple[str, ...]) -> list[Row]:
    from vaed.patches import prepare_decoder, remove_fast_paths, to_decoder_layout

    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    spec = args.model or f"random:{case.arch}"
    vae = _load(spec, device, dtype)
    shape = _latent_shape(vae, case)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    z = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    rows: list[Row] = []
    refs: dict[str, torch.Tensor] = {}
    base: float | None = None
    fp32 = fp32_reference(spec, z, device) if args.psnr else None
    fn: Decode
    warm: WarmUp
    for variant in variants:
        if variant in ("stock", "stock-cl3d"):
            layout = Layout.CONTIGUOUS if variant == "stock" else Layout.CHANNELS_LAST
            prepare_decoder(vae, kernels=Kernels.OFF, layout=layout)
            zi, fn, ref_key = to_decoder_layout(z, layout), stock_decode, variant
            warm = functools.partial(stock_warm_up, vae)
            close = _nothing
        else:
            engine_fns = vaed_decoder(vae, spec, args.kernels, variant.removeprefix("vaed-"), args.cuda_graphs,
                                      args.conv_plans)
            if engine_fns is None:
                continue
            (fn, warm, close), zi, ref_key = engine_fns, to_decoder_layout(z, Layout.CHANNELS_LAST), "stock-cl3d"
        with torch.inference_mode():
            warm(zi)  # up to the steady chunk: Triton compiles, cuDNN plans (and captures, with graphs)
            secs, peak, out = _time(functools.partial(fn, vae, zi), args.reps, device)
        close()
        out_cpu = out.cpu()
        del out
        ident = _bit_identity(refs, variant, ref_key, out_cpu)
        if variant == "stock":
            base = secs
        speed = (base / secs) if base else float("nan")
        row = Row(case.name, variant, secs, speed, peak, ident, ref_key)
        if case.arch == "wan2.1" and args.model is None:
            row.tflops = WAN21_FLOP_PER_PIXEL * case.height * case.width * case.frames / secs / 1e12
        if fp32 is not None:
            row.psnr_db, row.max_abs_raw = quality(out_cpu, fp32)
        rows.append(row)
        print(f"[bench] {case.name:<24} {variant:<14} {secs:7.3f} s  x{speed:5.2f}  "
              f"peak {peak:6.2f} GiB  bit-identical={ident}  {row.tflops:5.0f} TFLOP/s  "
              f"PSNR {row.psnr_db:5.2f} dB  max|RAW| {row.max_abs_raw:.4f}", flush=True)
        del out_cpu
        if device.type == "cuda":
            torch.cuda.empty_cache()
    remove_fast_paths(vae)
    del vae, z
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[Row]) -> str:
    head = (f"{'case':<24} {'variant':<14} {'seconds':>8} {'speedup':>8} {'peak GiB':>9} {'TFLOP/s':>8} "
            f"{'PSNR dB':>8} {'max|RAW|':>9}  bit-identical")
    lines = [head, "-" * len(head)]
    for r in rows:
        ident = r.bit_identical if r.bit_identical == "ref" else f"{r.bit_identical} (vs {r.reference})"
        lines.append(f"{r.case:<24} {r.variant:<14} {r.seconds:8.3f} {r.speedup:7.2f}x {r.peak_gib:9.2f} "
                     f"{r.tflops:8.0f} {r.psnr_db:8.2f} {r.max_abs_raw:9.4f}  {ident}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        log.error("unknown variants %s; choose from %s", bad, VARIANTS)
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        log.error("--device %s: %s", args.device, exc)
        return 2
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        log.error("--json %s: no such folder (checked now: the table comes after every case has run)",
                  args.json_path)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        log.error("--device %s requested but CUDA is not available. Without a GPU use the CPU, with fp32 and "
                  "a small case: vaed bench %s", args.device, CPU_EXAMPLE)
        return 2
    cases = args.cases or [parse_case(c) for c in DEFAULT_CASES]
    rows: list[Row] = []
    run_one = run_encode_case if args.op == "encode" else run_case
    for case in cases:
        try:
            rows.extend(run_one(case, args, variants))
        except CaseError as exc:
            log.error("--case: %s", exc)
            return 2
    print(format_table(rows), flush=True)
    if args.json_path:
        meta = {"torch": torch.__version__, "dtype": args.dtype, "reps": args.reps,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vaed bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
