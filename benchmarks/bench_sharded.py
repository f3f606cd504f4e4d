"""Spatially-sharded decode on several GPUs vs one GPU running vaed lossless (random weights).

    python benchmarks/bench_sharded.py                  # 2 GPUs: Wan2.1 480p and 720p, Wan2.2 704x1280; < 6 min on 2 H200s
    python benchmarks/bench_sharded.py --gpus 4         # the same over 4 GPUs
    python benchmarks/bench_sharded.py --min-size       # smallest frame size where sharding wins
    python benchmarks/bench_sharded.py --cases wan2.1-480p --repeats 3
    python benchmarks/bench_sharded.py --profile wan2.1-720p   # where rank 0's time goes, one GPU vs sharded

Per case it prints: seconds of the one-GPU engine (vaed lossless, the served
per-latent-frame loop) and of the sharded engine (same loop, all GPUs), the
speedup, peak allocated memory per GPU during each decode, PSNR of each RGB8
output against an fp32 one-GPU decode of the same latents, the max abs RAW
difference sharded vs one-GPU (bf16), and whether the two are bit-identical.
Times are the min over `--repeats` runs after one warm-up run (first use of a
shape pays cuDNN/Triton set-up). Rank 0 is this process; ranks 1.. are spawned.
NCCL_NVLS_ENABLE=0 is set before anything starts (never NVLink multicast).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import time
from dataclasses import dataclass

log = logging.getLogger("bench_sharded")

GiB = 1024**3


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    height: int
    width: int
    frames: int


CASES = {
    "wan2.1-480p": Case("wan2.1-480p", "random:wan2.1", 480, 832, 81),
    "wan2.1-720p": Case("wan2.1-720p", "random:wan2.1", 720, 1280, 81),
    "wan2.2-704p": Case("wan2.2-704p", "random:wan2.2", 704, 1280, 121),
}
# --min-size probe: Wan2.1, 21 frames (6 latent frames: the steady per-frame cost shows after frame 0)
PROBE_SIZES = [(240, 416), (320, 576), (400, 704), (480, 832), (576, 1024), (720, 1280)]


def _latents(torch, engine, case: Case, seed: int = 0):
    s = engine.scale_spatial
    t = (case.frames - 1) // engine.scale_temporal + 1
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, engine.z_dim, t, case.height // s, case.width // s, generator=g)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(torch, fn, repeats: int, device):
    """(min seconds over `repeats` after one warm-up, the last result)."""
    out = fn()  # warm-up at this shape
    best = math.inf
    for _ in range(repeats):
        out = None  # the previous output does not count in this run's peak memory
        _sync(torch, device)
        t0 = time.perf_counter()
        out = fn()
        _sync(torch, device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _peak(torch, device, reset: bool = False) -> int:
    if device.type != "cuda":
        return 0
    peak = torch.cuda.max_memory_allocated(device)
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def _devices(args) -> tuple[str, ...]:
    return ("cpu",) * args.gpus if args.cpu_smoke else tuple(f"cuda:{i}" for i in range(args.gpus))


def _psnr(torch, a, b) -> float:
    """PSNR in dB of two uint8 videos, on the GPU in slices (an 81-frame 720p video is 224 MB)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    se, n = 0.0, 0
    for i in range(0, a.shape[1], 8):
        d = a[:, i : i + 8].to(dev).float() - b[:, i : i + 8].to(dev).float()
        se += float((d * d).sum())
        n += d.numel()
    mse = se / n
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def run_cases(args, torch, cases: list[Case]) -> list[dict]:
    from vaed.engine import DecodeEngine
    from vaed.parallel import GroupConfig, start_sharded_engine
    from vaed.engine import OutputSpec

    rgb8 = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False)
    raw = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=False)
    devices = _devices(args)
    dev0 = torch.device(devices[0])
    rows = []
    for model in dict.fromkeys(c.model for c in cases):
        t0 = time.perf_counter()
        engine = start_sharded_engine(GroupConfig(model, devices, dtype=args.dtype, axis=args.axis))
        log.info("%s: group of %d ready in %.1f s", model, args.gpus, time.perf_counter() - t0)
        try:
            base = engine.base
            for case in (c for c in cases if c.model == model):
                z = _latents(torch, base, case)
                plan = engine.plan_for(z.shape[3], z.shape[4])
                # one GPU (vaed lossless), then sharded; outputs leave the GPU at once so peaks compare.
                # Engines of an earlier group hold reference cycles (installed forwards): collect them
                # first, or their weights count in this case's rank-0 peak.
                gc.collect()
                if dev0.type == "cuda":
                    torch.cuda.empty_cache()
                _peak(torch, dev0, reset=True)
                t1, out1 = _timed(torch, lambda b=base, z=z: b.decode_video(z, rgb8), args.repeats, dev0)
                peak1 = _peak(torch, dev0)
                out1 = out1.cpu()
                engine.peak_memory(reset=True)
                ts, outs = _timed(torch, lambda e=engine, z=z: e.decode_video(z, rgb8), args.repeats, dev0)
                peaks = engine.peak_memory(reset=True)
                outs = outs.cpu()
                # quality: RAW bf16 sharded vs one GPU, and RGB8 of both vs an fp32 one-GPU decode
                raw1 = base.decode_video(z, raw)
                raws = engine.decode_video(z, raw)
                max_abs = float((raws.float() - raw1.float()).abs().max())
                identical = bool(torch.equal(raws, raw1))
                del raw1, raws
                ref = DecodeEngine.load(model, device=devices[0], dtype="float32")
                out32 = ref.decode_video(z, rgb8).cpu()
                del ref
                gc.collect()
                if dev0.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append({
                    "case": case.name, "plan": f"{plan.axis} {plan.sizes}" if plan else "one GPU (too small)",
                    "t1": t1, "ts": ts, "peak1": peak1, "peaks": peaks,
                    "psnr1": _psnr(torch, out1, out32), "psnrs": _psnr(torch, outs, out32),
                    "max_abs": max_abs, "identical": identical,
                })  # fmt: skip
                log.info("%s done: %s", case.name, rows[-1])
        finally:
            engine.close()
    return rows


def probe_min_size(args, torch) -> list[dict]:
    from vaed.parallel import GroupConfig, start_sharded_engine
    from vaed.engine import OutputSpec

    rgb8 = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False)
    devices = _devices(args)
    dev0 = torch.device(devices[0])
    model = "random:wan2.1-tiny" if args.cpu_smoke else "random:wan2.1"
    engine = start_sharded_engine(GroupConfig(model, devices, dtype=args.dtype, axis=args.axis))
    rows = []
    sizes = [(h // 8, w // 8) for h, w in PROBE_SIZES[:2]] if args.cpu_smoke else PROBE_SIZES
    try:
        for h, w in sizes:
            case = Case(f"{h}x{w}", model, h, w, 21)
            z = _latents(torch, engine.base, case)
            t1, _ = _timed(torch, lambda z=z: engine.base.decode_video(z, rgb8), args.repeats, dev0)
            ts, _ = _timed(torch, lambda z=z: engine.decode_video(z, rgb8), args.repeats, dev0)
            rows.append({"size": case.name, "t1": t1, "ts": ts})
            log.info("probe %s: one GPU %.3f s, sharded %.3f s", case.name, t1, ts)
    finally:
        engine.close()
    return rows


def profile_case(args, torch, case: Case) -> None:
    """One sharded decode of `case` under torch.profiler on rank 0: wall time, the GPU's busy
    time, and the kernels by total time (NCCL kernel time includes waiting for the peer)."""
    from torch.profiler import ProfilerActivity, profile
    from profiling import device_seconds, kernel_events

    from vaed.engine import OutputSpec
    from vaed.parallel import GroupConfig, start_sharded_engine

    rgb8 = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False)
    devices = _devices(args)
    dev0 = torch.device(devices[0])
    engine = start_sharded_engine(GroupConfig(case.model, devices, dtype=args.dtype, axis=args.axis))
    try:
        z = _latents(torch, engine.base, case)
        engine.decode_video(z, rgb8)  # warm-up at this shape
        for label, fn in (("one GPU", lambda: engine.base.decode_video(z, rgb8)),
                          ("sharded", lambda: engine.decode_video(z, rgb8))):
            _sync(torch, dev0)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                fn()
                _sync(torch, dev0)
                wall = time.perf_counter() - t0
            by_name: dict[str, list[float]] = {}
            for e in kernel_events(prof):
                by_name.setdefault(e.name, []).append(device_seconds(e))
            busy = sum(sum(v) for v in by_name.values())
            print(f"\nprofile {case.name} {label} (rank 0): wall {wall:.3f} s, GPU kernels {busy:.3f} s "
                  f"({100 * busy / wall:.0f} % busy), {sum(len(v) for v in by_name.values())} kernels")
            for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]:
                t = sum(times)
                print(f"  {100 * t / max(busy, 1e-9):5.1f} %  {t:7.3f} s  x{len(times):<6d} {name[:110]}")
    finally:
        engine.close()


def print_cases(rows: list[dict], gpus: int, dtype: str) -> None:
    print(f"\nsharded over {gpus} GPUs vs one GPU (vaed lossless), {dtype}, random weights, min of repeats")
    head = (
        f"{'case':<13} {'split':<22} {'1 GPU s':>8} {'shard s':>8} {'speedup':>7} {'1 GPU GiB':>9} "
        f"{'shard GiB per GPU':<26} {'mem ratio':>9} {'PSNR 1':>7} {'PSNR sh':>7} {'max|d|':>8} {'identical':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        per = " ".join(f"{p / GiB:.2f}" for p in r["peaks"])
        ratio = max(r["peaks"]) / r["peak1"] if r["peak1"] else float("nan")
        print(
            f"{r['case']:<13} {r['plan']:<22} {r['t1']:>8.3f} {r['ts']:>8.3f} {r['t1'] / r['ts']:>6.2f}x "
            f"{r['peak1'] / GiB:>9.2f} {per:<26} {ratio:>9.2f} {r['psnr1']:>7.2f} {r['psnrs']:>7.2f} "
            f"{r['max_abs']:>8.1e} {r['identical']!s:>9}"
        )
    print("PSNR: RGB8 vs an fp32 one-GPU decode of the same latents (dB); max|d|: RAW sharded vs one GPU;")
    print("mem ratio: the largest per-GPU sharded peak / the one-GPU peak (peak allocated during the decode)")


def print_probe(rows: list[dict], gpus: int) -> None:
    print(f"\n--min-size probe: Wan2.1, 21 frames, {gpus} GPUs sharded vs one GPU")
    print(f"{'size':<10} {'1 GPU s':>8} {'shard s':>8} {'speedup':>7}")
    win = None
    for r in rows:
        sp = r["t1"] / r["ts"]
        print(f"{r['size']:<10} {r['t1']:>8.3f} {r['ts']:>8.3f} {sp:>6.2f}x")
        if win is None and sp > 1.0:
            win = r["size"]
    print(f"smallest size where sharding wins: {win or 'none of the probed sizes'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--axis", default="auto", choices=("auto", "height", "width"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--min-size", action="store_true", help="only the smallest-winning-size probe")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--profile", metavar="CASE", help="only profile one decode of CASE, one GPU and sharded")
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="check this script without GPUs: gloo CPU ranks, tiny models, small sizes (numbers mean nothing)",
    )
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import torch

    if args.cpu_smoke:
        torch.set_num_threads(1)
        args.dtype = "float32"  # bf16 convs on CPU are slow and not what the GPU runs anyway
        where = "CPU smoke run"
    elif torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    else:
        where = f"{torch.cuda.get_device_name(0)} x{args.gpus}"
    print(f"torch {torch.__version__}, {where}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    t0 = time.perf_counter()
    if args.profile:
        case = CASES[args.profile]
        if args.cpu_smoke:
            case = Case(case.name, case.model + "-tiny", case.height // 8, case.width // 8, 9)
        profile_case(args, torch, case)
    elif args.min_size:
        print_probe(probe_min_size(args, torch), args.gpus)
    else:
        cases = [CASES[n] for n in args.cases.split(",") if n]
        if args.cpu_smoke:
            cases = [Case(c.name, c.model + "-tiny", c.height // 8, c.width // 8, 9) for c in cases]
        print_cases(run_cases(args, torch, cases), args.gpus, args.dtype)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
