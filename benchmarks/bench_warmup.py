"""Start-up time per warm-up shape, first request vs steady at each warmed
shape, and time to first frame, of a real `vaed serve` process through the client.

    python benchmarks/bench_warmup.py --gpu 0            # Wan2.1 (480x832, 720x1280 x81) and Wan2.2 (704x1280 x121)

For each model the server starts with its default --warmup-shapes; the script
reads the per-shape warm-up times from its log, then decodes each warmed shape
three times (the first request after SERVING, then two steady ones) and
reports first / min(steady) and the first frame's arrival.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from vaed_process import find, start_vaed

CASES = {
    "random:wan2.1": [(480, 832, 81), (720, 1280, 81)],
    "random:wan2.2": [(704, 1280, 121)],
}


def start(model: str, gpu: int, extra: list[str]) -> tuple[subprocess.Popen, str, float, dict[str, float]]:
    """The server, seconds to SERVING, and the warm-up seconds per shape from its log."""
    started = time.perf_counter()
    proc, target, lines = start_vaed(model, str(gpu), extra)
    warm = {m.group(1): float(m.group(2)) for m in find(r"warm-up on \S+ at (\d+x\d+) .* took ([\d.]+) s", lines)}
    return proc, target, time.perf_counter() - started, warm


def decode_timed(client, latents: torch.Tensor) -> tuple[float, float]:
    started = time.perf_counter()
    first = None
    for chunk in client.stream(latents):
        if first is None:
            first = time.perf_counter() - started
    return time.perf_counter() - started, first or 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--json")
    parser.add_argument("server_args", nargs="*", help="extra `vaed serve` flags after --")
    args = parser.parse_args()
    from vaed_client import VaeClient

    results = []
    for model in args.models.split(","):
        proc, target, to_serving, warm = start(model, args.gpu, args.server_args)
        try:
            with VaeClient(target) as client:
                info = client.model_info()
                for h, w, frames in CASES[model]:
                    s, st = info.scale_factor_spatial, info.scale_factor_temporal
                    latents = torch.randn(1, info.z_dim, (frames - 1) // st + 1, h // s, w // s,
                                          generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
                    runs = [decode_timed(client, latents) for _ in range(3)]
                    first_total, _ = runs[0]
                    steady = min(r[0] for r in runs[1:])
                    row = {
                        "model": model, "shape": f"{h}x{w}x{frames}", "startup_to_serving_s": round(to_serving, 2),
                        "warmup_s": warm.get(f"{h}x{w}"), "first_request_s": round(first_total, 3),
                        "steady_s": round(steady, 3), "first_over_steady": round(first_total / steady, 3),
                        "first_frame_ms": round(min(r[1] for r in runs) * 1e3, 1),
                    }
                    results.append(row)
                    print("[warmup]", json.dumps(row), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"{'model':<15} {'shape':<14} {'to SERVING':>10} {'warm-up':>8} {'first':>7} {'steady':>7} "
          f"{'ratio':>6} {'1st frame':>9}")
    for r in results:
        print(f"{r['model']:<15} {r['shape']:<14} {r['startup_to_serving_s']:>9.1f}s {r['warmup_s'] or 0:>7.2f}s "
              f"{r['first_request_s']:>6.3f}s {r['steady_s']:>6.3f}s {r['first_over_steady']:>6.3f} "
              f"{r['first_frame_ms']:>7.1f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
