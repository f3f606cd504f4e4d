"""Why does latent frame 0's GPU time vary? One in-process probe of the served path.

    python scripts/probe_first_frame.py --gaps 0,0.05,0.3,2 --reps 4

Loads the engine the way `vaed serve` does, warms 480x832 up to its steady
chunk, then decodes whole videos (1x16x21x60x104 bf16, RGB8) as the worker
does, one latent frame per step with the host copy on a side stream. Before
each video the GPU idles for one of ``--gaps`` seconds. For frame 0 it prints:

- ``gpu``: GPU time from an event before the step to the host copy's end
  (what the server logs as first_gpu_ms);
- ``launch``: host time to enqueue the step (if it is close to ``gpu``, the
  GPU waited for launches);
- ``mallocs``: new cudaMalloc segments during the step (the allocator grew);
- the SM clock (MHz) sampled by ``nvidia-smi`` every 10 ms, first and lowest
  during the step, and the lowest sample in the idle gap before it.

A variance that follows the idle gap points at clocks; one that follows
``launch`` at the host; one with ``mallocs`` at the allocator.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

import torch

from vaed.engine import DecodeEngine, OutputSpec, warm_up


class ClockSampler:
    """`nvidia-smi` SM clock samples, each stamped with this process's clock on arrival."""

    def __init__(self, gpu: int, period_ms: int = 10) -> None:
        self.samples: list[tuple[float, int]] = []
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                ["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                 "-lms", str(period_ms)], stdout=subprocess.PIPE, text=True)
        except OSError:
            self._proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append((time.perf_counter(), int(line.strip())))
            except ValueError:
                pass

    def between(self, start: float, end: float) -> list[int]:
        return [mhz for t, mhz in self.samples if start <= t <= end]

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def segments() -> int:
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--shape", default="1,16,21,60,104", help="latent shape B,z,T,h,w")
    parser.add_argument("--gaps", default="0,0.05,0.3,2", help="idle seconds before each video")
    parser.add_argument("--reps", type=int, default=4, help="videos per gap")
    parser.add_argument("--precision", default="lossless")
    parser.add_argument("--gpu", type=int, default=0)
    args = parser.parse_args()
    device = f"cuda:{args.gpu}"
    torch.cuda.set_device(device)
    shape = [int(s) for s in args.shape.split(",")]
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    engine = DecodeEngine.load(args.model, device=device, dtype="bfloat16")
    warm_up(engine, (shape[3], shape[4]), args.precision)
    torch.cuda.synchronize()
    spec = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False, precision=args.precision)
    copy_stream = torch.cuda.Stream()
    clocks = ClockSampler(args.gpu)
    time.sleep(1.0)  # the sampler's first line

    gaps = [float(g) for g in args.gaps.split(",")]
    rows: list[dict[str, float]] = []
    for rep in range(args.reps):
        for gap in gaps:
            idle_from = time.perf_counter()
            time.sleep(gap)
            state = engine.new_state()
            segs = segments()
            t0 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(shape[2]):
                group = engine.decode_frame(state, latents[:, :, i : i + 1], spec)
                host = torch.empty(group.frames.shape, dtype=group.frames.dtype, pin_memory=True)
                copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copy_stream):
                    host.copy_(group.frames, non_blocking=True)
                    group.frames.record_stream(copy_stream)
                    done = torch.cuda.Event(enable_timing=i == 0)
                    done.record()
                if i == 0:
                    launched = time.perf_counter() - t0
                    first_done = done
                    mallocs = segments() - segs
                    done.synchronize()
                    step_end = time.perf_counter()
                    gpu_ms = start.elapsed_time(first_done)
            torch.cuda.synchronize()
            engine.free(state)
            step = clocks.between(t0, step_end)
            idle = clocks.between(idle_from, t0)
            row = {"gap": gap, "gpu": gpu_ms, "launch": launched * 1e3, "host": (step_end - t0) * 1e3,
                   "mallocs": mallocs, "clk_first": step[0] if step else -1, "clk_min": min(step) if step else -1,
                   "clk_idle_min": min(idle) if idle else -1}
            rows.append(row)
            print(f"rep {rep} gap {gap:5.2f} s: frame 0 gpu {gpu_ms:6.1f} ms, launch {launched * 1e3:5.1f} ms, "
                  f"host {row['host']:6.1f} ms, mallocs {mallocs}, SM MHz first {row['clk_first']} "
                  f"min {row['clk_min']} (idle min {row['clk_idle_min']})", flush=True)
    clocks.stop()
    for gap in gaps:
        g = [r["gpu"] for r in rows if r["gap"] == gap]
        print(f"gap {gap:5.2f} s: frame 0 gpu median {statistics.median(g):.1f} ms, range {min(g):.1f}-{max(g):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
