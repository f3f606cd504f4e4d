"""Throughput of the GPU pool through the client: N concurrent sessions on one
GPU vs on several (`vaed serve --gpu 0` vs `--gpu 0,1`), and one large video
through `--parallel spatial`.

    python benchmarks/bench_pool.py --gpus 0,1 --sessions 4        # 480x832x81 each

Clients run in separate processes (the client's own GIL stays out of the
figure); each decodes one video, RGB8, and the wall time from the first start
to the last end gives videos per second.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import torch

from vaed_process import start_vaed


def one_client(args: tuple[str, tuple[int, ...], mp.synchronize.Barrier]) -> tuple[float, float, int]:
    target, shape, barrier = args
    from vaed_client import VaeClient

    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with VaeClient(target) as client:
        client.decode(latents[:, :, :2])  # connect
        barrier.wait()
        started = time.perf_counter()
        video = client.decode(latents)
        return started, time.perf_counter(), int(video.shape[1])


def run_clients(target: str, shape: tuple[int, ...], n: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        with ctx.Pool(n) as pool:
            results = pool.map(one_client, [(target, shape, barrier)] * n)
    first = min(r[0] for r in results)
    last = max(r[1] for r in results)
    wall = last - first
    return {"sessions": n, "wall_s": round(wall, 3), "videos_per_s": round(n / wall, 3),
            "mean_latency_s": round(sum(r[1] - r[0] for r in results) / n, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--gpus", default="0,1")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--shape", default="1,16,21,60,104", help="latent shape of each session (480x832x81)")
    parser.add_argument("--spatial-shape", default="1,16,21,90,160", help="one video for --parallel spatial (720p)")
    parser.add_argument("--json")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    rows = {}
    for label, gpus, extra in (("one GPU", args.gpus.split(",")[0], []), (f"pool {args.gpus}", args.gpus, [])):
        proc, target, _ = start_vaed(args.model, gpus, ["--warmup-shapes", "480x832", *extra])
        try:
            rows[label] = run_clients(target, shape, args.sessions)
            print(f"[pool] {label}: {json.dumps(rows[label])}", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    one, pool = rows["one GPU"], rows[f"pool {args.gpus}"]
    print(f"[pool] throughput ratio {pool['videos_per_s'] / one['videos_per_s']:.2f}x "
          f"({args.sessions} concurrent {shape} sessions)", flush=True)

    spatial = tuple(int(s) for s in args.spatial_shape.split(","))
    for label, gpus, extra in (("one GPU", args.gpus.split(",")[0], []),
                               ("spatial", args.gpus, ["--parallel", "spatial"])):
        proc, target, _ = start_vaed(args.model, gpus, ["--warmup-shapes", "720x1280", *extra])
        try:
            from vaed_client import VaeClient

            latents = torch.randn(*spatial, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            with VaeClient(target) as client:
                info = client.model_info()
                times, video = [], None
                for _ in range(3):
                    started = time.perf_counter()
                    video = client.decode(latents)
                    times.append(time.perf_counter() - started)
            rows[f"720p {label}"] = {"devices": len(info.devices) if hasattr(info, "devices") else None,
                                     "best_s": round(min(times), 3)}
            if label == "one GPU":
                reference = video
            else:
                same = bool(torch.equal(reference, video))
                diff = (reference.int() - video.int()).abs().max().item()
                rows[f"720p {label}"].update(identical_rgb8=same, max_abs_rgb8=diff)
            print(f"[spatial] {label}: {json.dumps(rows[f'720p {label}'])}", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
