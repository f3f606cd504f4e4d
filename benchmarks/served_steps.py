"""Where a served decode's time goes beyond the engine's (one GPU).

The engine's steps are timed in one process, adding one piece of the server's loop at a time.

    python benchmarks/served_steps.py                      # fast tier, Wan2.1 480x832x81, bf16
    python benchmarks/served_steps.py --precision lossless --cuda-graphs off

Each line is a whole video (min / median of --reps), with the plans in the kernel cache's plan
file ($TRITON_CACHE_DIR; tune them first with `vaed bench --conv-plans tune`):

1. `decode_video` with raw frames and the latents on the GPU (what `vaed bench` times),
2. the same steps one at a time (a thread waits on each step, as the delivery thread does),
3. RGB8 frames,
4. latents taken from the host,
5. a pinned device-to-host copy per group on a side stream (`vaed.worker`),
6. the waiting thread also copying each group twice, as a message is made of it,
7. latent frame 1 held until frame 0 is delivered (Frame 0 first in `vaed.session`).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from vaed.choices import ConvPlans, CudaGraphs, Layout, Precision
from vaed.engine import DecodeEngine, OutputSpec, warm_up
from vaed.models import LoadedModel, load_model
from vaed.startup import conv_plan_file


def served_loop(engine: DecodeEngine, z: torch.Tensor, output: OutputSpec, copy: bool, serialize: bool,
                hold_frame_0: bool) -> None:
    """The worker's steps over `z` with the pieces asked for, then a sync."""
    copy_stream = torch.cuda.Stream()
    delivered_0 = threading.Event()
    outbox: queue.Queue[tuple[torch.cuda.Event, torch.Tensor | None] | None] = queue.Queue()

    def deliver() -> None:
        while (job := outbox.get()) is not None:
            done, host = job
            done.synchronize()
            if serialize and host is not None:  # as a message is made of the group: two copies, GIL held
                bytes(bytearray(host.numpy().tobytes()))
            delivered_0.set()

    thread = threading.Thread(target=deliver)
    thread.start()
    state = engine.new_state()
    try:
        for i in range(z.shape[2]):
            frames = engine.decode_frame(state, z[:, :, i : i + 1], output).frames
            host = None
            done = torch.cuda.Event()
            if copy:
                host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
                copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copy_stream):
                    host.copy_(frames, non_blocking=True)
                    frames.record_stream(copy_stream)
                    done.record()
            outbox.put((done, host))
            if hold_frame_0 and i == 0:
                delivered_0.wait()
    finally:
        outbox.put(None)
        thread.join()
        engine.free(state)
    torch.cuda.synchronize()


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    fn()  # warm: the allocator's and the pinned pool's blocks
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return min(seconds), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--shape", default="1,16,21,60,104", help="latents B,z,T,h,w")
    parser.add_argument("--precision", default=Precision.FAST, choices=Precision.values())
    parser.add_argument("--cuda-graphs", default=CudaGraphs.FIRST, choices=CudaGraphs.values())
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    vae = load_model(args.model, "cuda", torch.bfloat16).vae
    z_host = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    z_gpu = z_host.cuda()
    engine = DecodeEngine(LoadedModel(vae=vae, spec=args.model, random_weights=args.model.startswith("random:")),
                          kernels="auto", layout=Layout.CHANNELS_LAST, cuda_graphs=args.cuda_graphs,
                          conv_plans=ConvPlans.CACHED, conv_plan_file=conv_plan_file())
    hw = (shape[3], shape[4])
    engine.prepare_conv_plans([hw], (Precision(args.precision),))
    warm_up(engine, hw, args.precision)
    raw = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True, precision=args.precision)
    rgb8 = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=True, precision=args.precision)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("decode_video, raw frames, latents on the GPU",
         lambda: (engine.decode_video(z_gpu, raw), torch.cuda.synchronize())),
        ("the same, step by step", lambda: served_loop(engine, z_gpu, raw, False, False, False)),
        ("RGB8 frames", lambda: served_loop(engine, z_gpu, rgb8, False, False, False)),
        ("latents from the host", lambda: served_loop(engine, z_host, rgb8, False, False, False)),
        ("a pinned copy per group", lambda: served_loop(engine, z_host, rgb8, True, False, False)),
        ("each group copied twice more", lambda: served_loop(engine, z_host, rgb8, True, True, False)),
        ("frame 1 held for frame 0's delivery", lambda: served_loop(engine, z_host, rgb8, True, True, True)),
    ]
    for name, fn in steps:
        best, median = timed(fn, args.reps)
        print(f"{args.precision} --cuda-graphs {args.cuda_graphs}: {name}: min {best * 1e3:.1f} ms, "
              f"median {median * 1e3:.1f} ms", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
