"""Client-observed decode time, time to first frame and server peak GPU memory
of a real `vaed serve` process, against AutoencoderKLWan.decode in one process.

    python benchmarks/bench_service.py --model random:wan2.1 --shape 1,16,21,60,104 --reps 3
    python benchmarks/bench_service.py --op encode --model random:wan2.1 --shape 1,3,81,480,832 --reps 3

`--op encode` times `VaeClient.encode` of seeded bf16 frames (`--shape` B,3,T,H,W; `--frames uint8`:
uint8 frames of that size, as a pipeline's VideoProcessor frames travel) against a
`vaed serve --encode` (bf16), then the same engine in this process (`engine_factory` of the same
config: weights, layout, kernels) encoding the frames already on the GPU; it reports the ratio
served / in-process and whether the served moments equal the in-process ones (torch.equal).

Runs the server as a subprocess on --gpu, measures through VaeClient over
loopback, reads the server's peak GPU memory from its Prometheus endpoint,
stops it, then times stock diffusers decode of the same latents in this
process on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

import torch

from client_clock import watch_placements
from vaed_process import find, print_call_lines, start_vaed


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, int]:
    proc, target, lines = start_vaed(args.model, str(args.gpu), ["--metrics-port", "0", *args.server_args])
    ports = find(r"metrics on http://[^:]+:(\d+)/", lines)
    if not ports:
        proc.kill()
        raise SystemExit("server did not log its metrics port")
    return proc, target, int(ports[0].group(1))


def scrape(metrics_port: int, name: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def measure_service(target: str, latents: torch.Tensor, reps: int, pause: float) -> list[dict[str, float]]:
    """Per rep, one `stream()` (first frame: its first chunk out of the iterator) and one `decode()`
    (first frame: its first reply placed in the video, `client_clock`), each from before the call
    on this process's clock and timed to its last frame."""
    from vaed_client import VaeClient

    placed = watch_placements()
    runs = []
    with VaeClient(target) as client:
        client.decode(latents[:, :, :2])  # connection + first-use warm-up
        for _ in range(reps):
            time.sleep(pause)
            started = time.perf_counter()
            first = None
            frames = 0
            for chunk in client.stream(latents):
                if first is None:
                    first = time.perf_counter() - started
                frames += chunk.num_frames
            total = time.perf_counter() - started
            time.sleep(pause)
            placed.clear()
            started = time.perf_counter()
            video = client.decode(latents)
            decode_total = time.perf_counter() - started
            # freed after the clock, as a caller keeps its video: unmapping 97 MB of touched pages
            # took ~10 ms on a 2-core machine, which a dropped result charged to decode()
            del video
            decode_first = placed[0] - started
            runs.append({"total_s": total, "first_frame_s": first, "frames": frames,
                         "decode_total_s": decode_total, "decode_first_frame_s": decode_first})
            print(f"service: stream() total {total:.3f} s, first frame {first * 1e3:.1f} ms, {frames} frames; "
                  f"decode() total {decode_total:.3f} s, first frame {decode_first * 1e3:.1f} ms", flush=True)
    return runs


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile: the 19th of 20."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def measure_in_process(model: str, latents: torch.Tensor, reps: int, device: str) -> dict[str, float]:
    from vaed.models import load_model

    vae = load_model(model, device, latents.dtype).vae
    z = latents.to(device)
    times = []
    with torch.no_grad():
        vae.decode(z[:, :, :2])
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            vae.decode(z)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            print(f"in-process AutoencoderKLWan.decode: {times[-1]:.3f} s", flush=True)
    return {"seconds": min(times), "peak_bytes": torch.cuda.max_memory_allocated()}


def measure_encode_service(target: str, frames: torch.Tensor, reps: int, pause: float) -> tuple[list[float], Any]:
    from vaed_client import VaeClient

    times = []
    with VaeClient(target, timeout=600) as client:
        # connection + first-use warm-up: 5 frames (uint8 frames are [B, T, H, W, 3])
        client.encode(frames[:, :5] if frames.dtype == torch.uint8 else frames[:, :, :5])
        for _ in range(reps):
            time.sleep(pause)
            started = time.perf_counter()
            moments = client.encode(frames)
            times.append(time.perf_counter() - started)
            print(f"service encode: {times[-1]:.3f} s", flush=True)
    return times, moments


def measure_encode_in_process(model: str, frames: torch.Tensor, reps: int, gpu: int) -> tuple[float, Any]:
    from vaed.config import ServerConfig
    from vaed.engine_protocol import EncodeSpec
    from vaed.server import engine_factory

    device = f"cuda:{gpu}"
    engine = engine_factory(ServerConfig(model=model, devices=(device,), dtype="bfloat16", encode=True))(device)
    x = frames.to(device)
    if x.dtype == torch.uint8:  # the float frames the server makes of them, already on the GPU
        from vaed.engine_protocol import rgb8_to_video

        x = rgb8_to_video(x.permute(0, 4, 1, 2, 3))
    times = []
    with torch.inference_mode():
        engine.encode_video(x[:, :, :5], EncodeSpec())
        for _ in range(reps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            moments = engine.encode_video(x, EncodeSpec())[0]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            print(f"in-process engine encode: {times[-1]:.3f} s", flush=True)
    return min(times), moments.cpu()


def run_encode(args: argparse.Namespace, shape: list[int]) -> int:
    generator = torch.Generator().manual_seed(0)
    if args.frames == "uint8":  # what a pipeline's VideoProcessor frames travel as (the client packs them)
        b, _, t, h, w = shape
        frames: Any = torch.randint(0, 256, (b, t, h, w, 3), dtype=torch.uint8, generator=generator)
    else:
        frames = (torch.rand(*shape, generator=generator) * 2 - 1).to(torch.bfloat16)
    args.server_args = ["--encode", "--dtype", "bfloat16", *args.server_args]
    proc, target, metrics_port = start_server(args)
    try:
        times, served = measure_encode_service(target, frames, args.reps, args.pause)
        peak = scrape(metrics_port, "vaed_gpu_memory_peak_bytes")
        print(f"server peak GPU memory: {peak / 2**30 if peak is not None else float('nan'):.2f} GiB", flush=True)
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[0] or ""
    print_call_lines(rest, "Encode")
    result: dict[str, Any] = {"model": args.model, "op": "encode", "shape": shape, "frames": args.frames,
                              "frames_bytes": frames.nbytes,
                              "service_s": min(times), "service_peak_gib": peak / 2**30 if peak is not None else None}
    if not args.skip_in_process:
        seconds, local = measure_encode_in_process(args.model, frames, args.reps, args.gpu)
        result.update(in_process_s=seconds, ratio_service_over_in_process=min(times) / seconds,
                      bit_identical=bool(torch.equal(served, local)))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--op", choices=("decode", "encode"), default="decode")
    parser.add_argument("--shape", default=None,
                        help="decode: latent shape B,z,T,h,w (1,16,21,60,104); encode: frames B,3,T,H,W (1,3,81,480,832)")
    parser.add_argument("--frames", choices=("bf16", "uint8"), default="bf16",
                        help="encode: bf16 frames in [-1, 1], or uint8 [B, T, H, W, 3] (a pipeline's, packed)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds between calls (lets the server finish the last call's bookkeeping)")
    parser.add_argument("--skip-in-process", action="store_true", help="measure the service only")
    parser.add_argument("--client-keeps-freed-memory", action="store_true",
                        help="call vaed_client.keep_freed_memory() in this (the client's) process first")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("server_args", nargs="*", help="extra `vaed serve` flags after --")
    args = parser.parse_args()
    if args.client_keeps_freed_memory:
        from vaed_client import keep_freed_memory

        print(f"client malloc: {keep_freed_memory()}", flush=True)
    default_shape = "1,3,81,480,832" if args.op == "encode" else "1,16,21,60,104"
    shape = [int(s) for s in (args.shape or default_shape).split(",")]
    if args.op == "encode":
        return run_encode(args, shape)
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    proc, target, metrics_port = start_server(args)
    try:
        runs = measure_service(target, latents, args.reps, args.pause)
        peak = scrape(metrics_port, "vaed_gpu_memory_peak_bytes")
        print(f"server peak GPU memory: {peak / 2**30 if peak is not None else float('nan'):.2f} GiB", flush=True)
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
        print_call_lines(rest)
    best = min(runs, key=lambda r: r["total_s"])
    best_decode = min(r["decode_total_s"] for r in runs)
    for call, key in (("stream()", "first_frame_s"), ("decode()", "decode_first_frame_s")):
        first_ms = sorted(r[key] * 1e3 for r in runs)
        print(f"service first frame, {call}: median {statistics.median(first_ms):.1f} ms, p95 {p95(first_ms):.1f} ms, "
              f"max {first_ms[-1]:.1f} ms, {sum(f <= 25.0 for f in first_ms)}/{len(first_ms)} calls <= 25 ms",
              flush=True)
    for call, key in (("stream()", "total_s"), ("decode()", "decode_total_s")):
        totals = [r[key] for r in runs]
        print(f"service whole video, {call}: best {min(totals):.3f} s, median {statistics.median(totals):.3f} s",
              flush=True)
    if args.skip_in_process:
        return 0
    stock = measure_in_process(args.model, latents, args.reps, f"cuda:{args.gpu}")
    result = {
        "model": args.model, "shape": shape, "gpu": torch.cuda.get_device_name(args.gpu),
        "service_total_s": best["total_s"], "service_first_frame_ms": min(r["first_frame_s"] for r in runs) * 1e3,
        "service_first_frame_p95_ms": p95([r["first_frame_s"] * 1e3 for r in runs]),
        "decode_total_s": best_decode,
        "decode_first_frame_p95_ms": p95([r["decode_first_frame_s"] * 1e3 for r in runs]),
        "service_peak_gib": peak / 2**30 if peak is not None else None,
        "in_process_s": stock["seconds"], "in_process_peak_gib": stock["peak_bytes"] / 2**30,
        "ratio_service_over_in_process": best["total_s"] / stock["seconds"],
        "ratio_decode_over_in_process": best_decode / stock["seconds"], "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
